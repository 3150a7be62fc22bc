"""NCCL-style coalescing blocks (``_coalescing_manager(group, device)``, as Megatron's FP8 parameter all-gathers use
them): the ops inside run as issued on the group, and the block's work is its last op's (tier b)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld


@pytest.fixture
def session():
    yield P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(5,)), timing=False))
    P.deactivate()


def test_a_device_coalescing_block_runs_its_ops_and_returns_a_work(session) -> None:
    a, b = torch.ones(4), torch.full((2,), 3.0)
    with _coalescing_manager(dist.group.WORLD, torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    # mirror policy: the 7 virtual members contribute this rank's values, so SUM = 8 x
    assert a.tolist() == [8.0] * 4 and b.tolist() == [24.0] * 2
    assert len(cm.works) == 1


def test_an_empty_block_has_no_work(session) -> None:
    with _coalescing_manager(dist.group.WORLD, torch.device("cpu"), async_ops=True) as cm:
        pass
    cm.wait()
    assert cm.works == []
