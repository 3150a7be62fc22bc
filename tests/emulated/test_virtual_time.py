"""Virtual time: emulated CUDA streams, events and collectives on virtual GPUs give exact, deterministic times.

Each case runs in a fresh process (the virtual CUDA device library loads before torch) and prints one JSON
line. The kernel model here is a fixed one (every ``mm`` takes ``MS`` = 2**-10 s, nothing else is a kernel;
launch overhead 2**-17 s), binary fractions, so every expected figure is exact in floating point and asserted
with ``==``: the mechanism (stream order, event waits, host syncs, comm-stream overlap, a straggler's wait, the
cost model's change with N) is what is tested, not a kernel model.
"""

from __future__ import annotations

import pytest
from children import EPILOGUE, program, run_child

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.model import GroupPlacement

MS = 2.0**-10
LAUNCH = 2.0**-17

PRELUDE = f"""
import json, sys
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
import torch.distributed as dist
import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
MS, LAUNCH = {MS!r}, {LAUNCH!r}
def model(func, args, kwargs, out):
    return MS if func is torch.ops.aten.mm.default else None
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8).start()
    clock = vg.start_time(model, LAUNCH)
"""


def run(body: str) -> dict:
    return run_child(program(PRELUDE, body, EPILOGUE))


def ps(times: list[float]) -> list[float]:
    """Times to the picosecond: a step time is a difference of two absolute emulated times, exact but for the
    last bits of the floating-point subtraction."""
    return [round(t, 12) for t in times]


def all_reduce_s(nbytes: int, world: int) -> float:
    """The cost model's all-reduce time on dgx-h100 over ranks 0..world-1 (what the session charges)."""
    placement = GroupPlacement.from_ranks(range(world), 8)
    return CostModel(load_profile("dgx-h100")).collective_us_placed(OpKind.ALL_REDUCE, nbytes, placement) * 1e-6


def test_streams_events_and_host_syncs_follow_cuda_semantics(library: None) -> None:
    out = run("""
        a = torch.randn(256, 256, device="cuda")
        b = a @ a; c = b @ a; d = c @ b                        # default stream: 0 .. 3 MS
        e0 = torch.cuda.Event(enable_timing=True); e0.record()  # at 3 MS
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):                         # idle stream: starts at the host's 3 launches
            x = a @ a; y = x @ a
        e1 = side.record_event(torch.cuda.Event(enable_timing=True))
        out["host_before"] = clock.host_s
        out["side_end"] = clock.position(side.key)
        out["e1_query"] = e1.query()
        torch.cuda.current_stream().wait_event(e1)           # before 3 MS: no delay
        z = y @ d                                             # 3 .. 4 MS
        e2 = torch.cuda.Event(enable_timing=True); e2.record()
        out["elapsed_ms"] = e0.elapsed_time(e2)
        out["query_before_item"] = torch.cuda.current_stream().query()
        z.sum().item()                                        # the host waits for the default stream
        out["host_after_item"] = clock.host_s
        side2 = torch.cuda.Stream()
        side2.wait_stream(torch.cuda.current_stream())       # holds side2 until 4 MS
        with torch.cuda.stream(side2):
            w = a @ a                                         # 4 .. 5 MS
        side2.synchronize()
        out["host_after_sync"] = clock.host_s
        out["summary"] = clock.summary()
    """)
    assert out["host_before"] == 5 * LAUNCH
    assert out["side_end"] == 3 * LAUNCH + 2 * MS and out["e1_query"] is False
    assert out["elapsed_ms"] == 1e3 * MS
    assert out["query_before_item"] is False
    assert out["host_after_item"] == 4 * MS
    assert out["host_after_sync"] == 5 * MS
    s = out["summary"]
    assert (s["kernels"], s["launches"], s["kernel_s"], s["streams"], s["host_syncs"]) == (7, 7, round(7 * MS, 9), 3, 2)


def test_the_virtual_members_share_of_a_result_launches_nothing(library: None) -> None:
    """The mirror rule writes the 63 virtual members' contributions into an all-reduce's result in place (SUM: x
    times 64). On a GPU the collective's own kernel writes its result, so those writes are no kernels: under a
    kernel model that times every op, each all-reduce is one launch and nothing else."""
    out = run("""
        P.activate(EmulationConfig(world=VirtualWorld(world_size=64, real_ranks=(0,), gpus_per_node=8),
                                   profile="dgx-h100", device="virtual-gpu"), backend="nccl")
        vg.kernel_time = lambda func, args, kwargs, out: MS     # every op on a device tensor is a kernel
        g = torch.ones(4 << 20, device="cuda")
        before = (clock.kernels, clock.launches, clock.host_s)
        dist.all_reduce(g)                                      # its data rule runs at the call
        dist.all_reduce(g, async_op=True).wait()                # ... or at the wait
        out["added"] = [clock.kernels - before[0], clock.launches - before[1], clock.host_s - before[2]]
        out["untimed_depth"] = clock.untimed_depth
        P.deactivate()
    """)
    assert out["added"] == [0, 2, 2 * LAUNCH]
    assert out["untimed_depth"] == 0


def test_bucketed_dp_reduce_is_hidden_behind_backward_until_the_last_bucket(library: None) -> None:
    out = run("""
        P.activate(EmulationConfig(world=VirtualWorld(world_size=64, real_ranks=(0,), gpus_per_node=8),
                                   profile="dgx-h100", device="virtual-gpu"), backend="nccl")
        a = torch.randn(1024, 1024, device="cuda")
        buckets = [torch.empty(4 << 20, device="cuda") for _ in range(4)]   # 16 MiB fp32 each
        P.mark_iteration(0)
        x, works = a, []
        for g in buckets:
            x = x @ a                                            # a layer's backward, then its bucket's reduce
            works.append(dist.all_reduce(g, async_op=True))
        out["compute_end"] = clock.position(torch.cuda.current_stream().key)
        for w in works:
            w.wait()                                             # the stream waits; the host does not
        out["host_after_waits"] = clock.host_s
        torch.cuda.synchronize()
        P.mark_iteration(1)
        summary = P.deactivate()
        out["steps"] = clock.step_times_s()
        out["modelled_comm_s"] = summary["modelled_comm_s"]
        out["clock"] = summary["clock"]
    """)
    cost = all_reduce_s(16 << 20, 64)
    assert cost < MS  # each reduce fits behind the next layer's backward
    assert out["compute_end"] == 4 * MS
    assert out["host_after_waits"] == 8 * LAUNCH  # 4 kernels + 4 collective launches; nothing blocked
    assert ps(out["steps"]) == ps([4 * MS + cost])  # only the last bucket's reduce is exposed
    assert out["clock"] == "emulated"


@pytest.mark.parametrize("world", [8, 8192])
def test_the_same_job_at_n_8_and_8192_differs_by_the_modelled_communication(library: None, world: int) -> None:
    out = run(f"""
        P.activate(EmulationConfig(world=VirtualWorld(world_size={world}, real_ranks=(0,), gpus_per_node=8),
                                   profile="dgx-h100", device="virtual-gpu"), backend="nccl")
        a = torch.randn(1024, 1024, device="cuda")
        g = torch.empty(64 << 20, device="cuda")                 # 256 MiB of fp32 gradients
        P.mark_iteration(0)
        x = a @ a; x = x @ a                                     # 2 MS of compute
        dist.all_reduce(g)                                       # synchronous: exposed
        x = x @ a                                                # then 1 MS
        torch.cuda.synchronize()
        P.mark_iteration(1)
        P.deactivate()
        out["steps"] = clock.step_times_s()
    """)
    assert ps(out["steps"]) == ps([2 * MS + all_reduce_s(256 << 20, world) + MS])


def test_a_stragglers_added_time_is_exact(library: None) -> None:
    out = run("""
        P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,), gpus_per_node=8),
                                   profile="dgx-h100", device="virtual-gpu",
                                   faults=("straggler:ranks=1,factor=3",)), backend="nccl")
        a = torch.randn(1024, 1024, device="cuda")
        g = torch.empty(1 << 20, device="cuda")
        for step in range(3):
            P.mark_iteration(step)
            x = a @ a; x = x @ a                                 # 2 MS before the reduce
            dist.all_reduce(g)
            torch.cuda.synchronize()
        P.mark_iteration(3)
        summary = P.deactivate()
        out["steps"] = clock.step_times_s()
        out["waits"] = [e["waited_s"] for e in summary["faults"]["steps"]]
    """)
    cost = all_reduce_s(4 << 20, 8)
    assert out["waits"] == [4 * MS] * 3  # rank 1 computes 3x as long: arrives 2 x 2 MS after rank 0
    assert ps(out["steps"]) == ps([2 * MS + 4 * MS + cost] * 3)
