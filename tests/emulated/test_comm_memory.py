"""The communicator-buffer model (cost/comm_memory.py) and its separate place in a rank's summary."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.cost.comm_memory import CommUse, NcclBufferModel

M = NcclBufferModel()
PROTOCOLS = 4 * 2**20 + 4_915_200 + 524_288  # SIMPLE + LL128 + LL buffers of one connection


def test_model_arithmetic() -> None:
    assert M.protocol_bytes == PROTOCOLS
    assert M.communicator_bytes(size=8, num_nodes=1, p2p_peers=0) == 16 * PROTOCOLS  # ring only
    assert M.communicator_bytes(size=16, num_nodes=2, p2p_peers=0) == 16 * 4 * PROTOCOLS  # + tree
    assert M.communicator_bytes(size=1, num_nodes=1, p2p_peers=0) == 0
    # p2p only: 2 channels x (send + recv) x 4 MiB per peer
    assert M.communicator_bytes(size=2, num_nodes=1, p2p_peers=2, collective=False) == 2 * 2 * 2 * 4 * 2**20
    report = M.report([CommUse(size=8, num_nodes=1, collective=True, p2p_peers=0),
                       CommUse(size=1, num_nodes=1, collective=True, p2p_peers=0)])
    assert report["modelled_bytes"] == 16 * PROTOCOLS and report["communicators"] == 1


@pytest.fixture
def session():
    s = P.activate(EmulationConfig(world=VirtualWorld(world_size=32, real_ranks=(3,), gpus_per_node=8)))
    yield s
    P.deactivate()


def test_summary_reports_modelled_buffers_apart_from_measured_memory(session) -> None:
    tp = dist.new_group([0, 1, 2, 3])        # one node
    dp = dist.new_group([3, 11, 19, 27])     # four nodes
    idle = dist.new_group([3, 7])            # created, never used: NCCL would not build it
    x = torch.ones(4)
    dist.all_reduce(x, group=tp)
    dist.all_reduce(x, group=dp)
    dist.send(x, dst=4)
    assert idle is not None
    mem = P.current_session().summary()["communicator_memory"]
    expected = 16 * PROTOCOLS + 16 * 4 * PROTOCOLS + 2 * 2 * 4 * 2**20  # tp ring; dp ring + tree; world p2p
    assert mem["modelled_bytes"] == expected
    assert mem["communicators"] == 3
    assert "not part of the measured peak" in mem["note"]
