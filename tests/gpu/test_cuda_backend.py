"""Tier (d): the prism backend on CUDA tensors, one real rank (rank 3 of 8), in this process.

The mirror policy's contract on a GPU: every virtual member contributes what the real rank does, so
all_reduce(SUM) is 8 x the input, all_gather_into_tensor is 8 copies of it and reduce_scatter_tensor(SUM)
is 8 x the input's chunk 3. The CUDA results must equal the same ops on CPU tensors under the same
session (bit for bit: the values are small integers, exact in float32) and those closed forms, and the
mirror path writes in place (comm/fill.py: no allocation beyond views): after each op
``torch.cuda.memory_allocated()`` is what it was before, and ``torch.cuda.max_memory_allocated()``
since then shows no extra bytes either.

Not covered: more than one real rank on CUDA (the inner group would be NCCL: needs 2 GPUs), timing
(`timing=False`: the modelled clock is the CPU tests' subject). Skipped where CUDA is not available.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda)")]

WORLD, RANK = 8, 3
NUMEL = 1 << 20  # 4 MiB of float32 per rank: large enough that a hidden copy would show in the allocator


@pytest.fixture
def session() -> Iterator[P.Session]:
    torch.cuda.set_device(0)
    s = P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=WORLD, real_ranks=(RANK,), gpus_per_node=8),
                                     data_policy=P.DataPolicy.MIRROR, timing=False))
    try:
        yield s
    finally:
        P.deactivate()


def _input(device: str) -> torch.Tensor:
    # small integers: every sum below is exact in float32, so CUDA and CPU agree bit for bit
    return (torch.arange(NUMEL, dtype=torch.float32) % 7 + RANK).to(device)


def _op_holds_no_memory(op: Callable[[], None]) -> None:
    """Run `op` on already-allocated tensors; assert the allocator holds, and peaked at, no extra bytes."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    op()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "bytes held after the op"
    assert torch.cuda.max_memory_allocated() == before, "the op allocated while it ran"


def test_world_is_rank_3_of_8_on_cuda(session: P.Session) -> None:
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (RANK, WORLD, "gloo")


def test_all_reduce_on_cuda_equals_the_mirror_policy(session: P.Session) -> None:
    gpu, cpu = _input("cuda"), _input("cpu")
    _op_holds_no_memory(lambda: dist.all_reduce(gpu))
    dist.all_reduce(cpu)
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(cpu, WORLD * _input("cpu"))


def test_all_gather_into_tensor_on_cuda_equals_the_mirror_policy(session: P.Session) -> None:
    gpu_in, cpu_in = _input("cuda"), _input("cpu")
    gpu_out = torch.empty(WORLD * NUMEL, device="cuda")
    cpu_out = torch.empty(WORLD * NUMEL)
    _op_holds_no_memory(lambda: dist.all_gather_into_tensor(gpu_out, gpu_in))
    dist.all_gather_into_tensor(cpu_out, cpu_in)
    assert torch.equal(gpu_out.cpu(), cpu_out)
    assert torch.equal(cpu_out, cpu_in.repeat(WORLD))
    assert torch.equal(gpu_in.cpu(), cpu_in)  # the input is left as it was


def test_reduce_scatter_tensor_on_cuda_equals_the_mirror_policy(session: P.Session) -> None:
    gpu_in, cpu_in = _input("cuda"), _input("cpu")
    gpu_out = torch.empty(NUMEL // WORLD, device="cuda")
    cpu_out = torch.empty(NUMEL // WORLD)
    _op_holds_no_memory(lambda: dist.reduce_scatter_tensor(gpu_out, gpu_in))
    dist.reduce_scatter_tensor(cpu_out, cpu_in)
    assert torch.equal(gpu_out.cpu(), cpu_out)
    chunk = NUMEL // WORLD
    assert torch.equal(cpu_out, WORLD * cpu_in[RANK * chunk:(RANK + 1) * chunk])
