"""Backend identity (issue 11, item 8): the program sees the backend it asked for, refusals included (tier b).

torch's ``dist.get_backend(group)`` reads the name torch recorded for the group (``_world.pg_map``); the
session records the emulated backend's name there, and the prism group's ``getBackendName`` (``name()``,
``_get_backend_name()``) answers the same. Emulating gloo, the group refuses what torch 2.13's gloo refuses,
with gloo's own text (measured against a real gloo group here: AVG of an integer tensor, uneven all_gather);
``backend="prism"`` emulates nothing and accepts both.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld


@pytest.fixture
def emulate():
    def start(rank: int = 5, backend: str | None = None) -> P.Session:
        return P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(rank,)), timing=False),
                          backend=backend)

    yield start
    P.deactivate()


def _real_gloo_error(fn) -> str:
    """The error a real one-process gloo group raises for `fn(group)`."""
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    with pytest.raises(RuntimeError) as info:
        fn(pg)
    return str(info.value)


def test_get_backend_answers_the_requested_name(emulate) -> None:
    emulate()
    world = dist.group.WORLD
    assert (dist.get_backend(), world.name(), world._get_backend_name()) == ("gloo", "gloo", "gloo")
    assert dist.get_backend_config() == "cpu:gloo,cuda:gloo"
    tp = dist.new_group([4, 5])
    side = dist.new_group([4, 5], backend="nccl")  # a side backend the program asked for, by name
    assert (dist.get_backend(tp), tp.name(), dist.get_backend(side), side.name()) == ("gloo", "gloo", "nccl", "nccl")
    dist.monitored_barrier()  # torch allows it on gloo groups only


@pytest.mark.parametrize("backend", ["nccl", "prism"])
def test_the_program_asked_for_another_backend(emulate, backend: str) -> None:
    emulate(backend=backend)
    assert dist.get_backend() == backend == dist.group.WORLD.name()
    if backend == "nccl":
        with pytest.raises(ValueError, match="monitored_barrier is only implemented for GLOO backend"):
            dist.monitored_barrier()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_avg_of_an_integer_tensor_is_refused_with_gloos_error(emulate, dtype: torch.dtype) -> None:
    expected = _real_gloo_error(lambda pg: pg.allreduce([torch.ones(3, dtype=dtype)], _avg()).wait())
    emulate()
    for call in (lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG),
                 lambda t: dist.reduce(t, 0, op=dist.ReduceOp.AVG),
                 lambda t: dist.reduce_scatter_tensor(t[:1].clone(), t.repeat(8)[:8], op=dist.ReduceOp.AVG)):
        with pytest.raises(RuntimeError) as info:
            call(torch.ones(3, dtype=dtype))
        assert str(info.value) == expected
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # torch 2.13's gloo averages floats: accepted
    assert t.tolist() == [2.0, 2.0, 2.0]


def _avg() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    return opts


def test_uneven_all_gather_is_refused_with_gloos_error(emulate) -> None:
    emulate()
    outs = [torch.zeros(2)] + [torch.zeros(3)] * 7
    with pytest.raises(RuntimeError, match=r"^ProcessGroupGloo::allgather: invalid tensor size at index 1 "
                                           r"\(expected \(2\), got \(3\)\)$"):
        dist.all_gather(outs, torch.ones(2))


def test_nccl_and_prism_accept_what_gloo_refuses(emulate) -> None:
    for backend in ("nccl", "prism"):
        emulate(backend=backend)
        t = torch.full((3,), 4, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [4, 4, 4]
        outs = [torch.zeros(2)] + [torch.zeros(3)] * 7
        dist.all_gather(outs, torch.ones(2))
        P.deactivate()


def test_nccl_premul_sum_is_a_sum_scaled_by_its_factor(emulate) -> None:
    """NCCL's PREMUL_SUM (FSDP2's gradient reduce-scatter): the sum of factor x input over the members, written to
    the result only (the input is left as it was); 8 members mirroring this rank's contribution."""
    emulate(backend="nccl")
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
    assert t.tolist() == [4.0, 4.0, 4.0]  # 8 x 0.25 x 2
    grads = torch.arange(16.0)
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, grads, op=dist._make_nccl_premul_sum(torch.tensor([0.5])))
    assert out.tolist() == [40.0, 44.0] and grads.tolist() == list(map(float, range(16)))  # 8 x 0.5 x [10, 11]
    with pytest.raises(RuntimeError, match="^Cannot use ReduceOp.PREMUL_SUM with Gloo$"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0), group=dist.new_group([4, 5],
                                                                                                   backend="gloo"))
