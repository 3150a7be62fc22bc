"""CUDA graphs on a virtual H100 (`prism_plugin.device.graphs`): capture recorded once, each replay one launch.

Each case runs in a fresh process (the virtual CUDA device library loads before torch) and prints one JSON line.
Time is dgx-h100's roofline through a `KernelTimer` with a binary launch overhead (2^-17 s), so host figures are
exact multiples of it; memory is the caching-allocator model's, to the byte. The program is torch's own graph API
(``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``) as a GPU user writes it.
"""

from __future__ import annotations

from children import EPILOGUE, program, run_child, timed_h100_prelude

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.model import GroupPlacement

MiB = 1 << 20
LAUNCH = 2.0**-17
N = 4096  # (4096, 4096) bf16: 32 MiB, a multiple of the allocator's 2 MiB rounding for large blocks

PRELUDE = timed_h100_prelude(LAUNCH) + """
    def f(x):  # three elementwise kernels; relu's and mul's outputs are intermediates
        return torch.relu(x) * 2 + 1
"""


def run(body: str) -> dict:
    return run_child(program(PRELUDE, body, EPILOGUE))


def test_capture_records_kernels_in_a_private_pool_and_a_replay_is_one_launch(library: None) -> None:
    out = run(f"""
        x = torch.randn({N}, {N}, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.current_stream().key
        torch.cuda.synchronize()
        start = clock.ends[stream]
        f(x)  # eagerly: the device span of its three kernels
        out["eager_s"] = clock.ends[stream] - start
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # (torch.cuda.graph's entry synchronizes: the host waits for the eager kernels)
        before = (torch.cuda.memory_allocated(), clock.kernels, clock.host_s,
                  torch.cuda.memory_stats()["allocation.all.allocated"])
        with torch.cuda.graph(g):
            out["capturing_inside"] = torch.cuda.is_current_stream_capturing()
            static = f(x)
        out["capturing_after"] = torch.cuda.is_current_stream_capturing()
        out["captured_kernels"] = g.kernels
        out["clock_kernels_during_capture"] = clock.kernels - before[1]
        out["capture_host_launches"] = (clock.host_s - before[2]) / {LAUNCH!r}
        out["allocated_after_capture"] = torch.cuda.memory_allocated() - before[0]
        out["mallocs_in_capture"] = torch.cuda.memory_stats()["allocation.all.allocated"] - before[3]
        reserved = torch.cuda.memory_reserved()
        fresh = torch.empty({N}, {N}, device="cuda", dtype=torch.bfloat16)  # outside the capture: not the pool's
        out["reserved_for_fresh"] = torch.cuda.memory_reserved() - reserved
        mallocs, host, start = (torch.cuda.memory_stats()["allocation.all.allocated"], clock.host_s,
                                clock.position(stream))
        g.replay()
        out["replay_mallocs"] = torch.cuda.memory_stats()["allocation.all.allocated"] - mallocs
        out["replay_host_launches"] = (clock.host_s - host) / {LAUNCH!r}
        out["replay_s"] = clock.ends[stream] - start
        out["summary"] = vg.graphs.summary()
        g.reset()
        try:
            g.replay()
        except RuntimeError as exc:
            out["after_reset"] = str(exc)
    """)
    assert out["capturing_inside"] is True and out["capturing_after"] is False
    assert out["captured_kernels"] == 3 and out["clock_kernels_during_capture"] == 0
    assert out["capture_host_launches"] == 3.0  # the host records each launch; the device does not move
    # the pool's blocks: relu's output (freed after mul), mul's, add's (the static output, reusing relu's block)
    assert out["mallocs_in_capture"] == 3 and out["allocated_after_capture"] == 32 * MiB
    assert out["reserved_for_fresh"] == 32 * MiB  # the pool's free block (mul's) is private to the graph
    assert out["replay_mallocs"] == 0 and out["replay_host_launches"] == 1.0
    assert abs(out["replay_s"] - out["eager_s"]) < 1e-15 and out["replay_s"] > 3 * LAUNCH
    assert out["summary"] == {"captured": 1, "replays": 1, "replayed_s": round(out["replay_s"], 9)}
    assert "never captured (or was reset)" in out["after_reset"]


def test_make_graphed_callables_trains_through_forward_and_backward_graphs(library: None) -> None:
    out = run("""
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        m = m.cuda().bfloat16()
        sample = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(m, (sample,))
        out["after_capture"] = vg.graphs.summary()
        x = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        graphed(x).sum().backward()
        out["after_step"] = vg.graphs.summary()
        out["grads"] = [list(p.grad.shape) for p in m.parameters()]
    """)
    assert out["after_capture"]["captured"] == 2 and out["after_capture"]["replays"] == 0  # forward, backward
    assert out["after_step"]["replays"] == 2 and out["after_step"]["replayed_s"] > 0
    assert out["grads"] == [[4096, 1024], [4096], [1024, 4096], [1024]]


def test_a_weak_reference_to_a_static_output_owns_no_memory(library: None) -> None:
    """TransformerEngine's ``make_weak_ref`` (answered at the first capture where TE bound it) lets a graph's static
    output return to the pool when the program drops it: the alias stays, its bytes stop counting."""
    out = run(f"""
        import transformer_engine.pytorch.graph as te_graph
        x = torch.randn({N}, {N}, device="cuda", dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = f(x)
        out["te_answered"] = te_graph.make_weak_ref == vg.graphs.weak_ref
        allocated = torch.cuda.memory_allocated()
        weak = te_graph.make_weak_ref((static, None, 3))
        out["weak_allocated"] = torch.cuda.memory_allocated() - allocated
        del static
        out["after_drop"] = torch.cuda.memory_allocated() - allocated
        out["weak"] = [list(weak[0].shape), str(weak[0].dtype), str(weak[0].device), weak[1], weak[2]]
    """)
    assert out["te_answered"] is True
    assert out["weak_allocated"] == 0 and out["after_drop"] == -32 * MiB
    assert out["weak"] == [[N, N], "torch.bfloat16", "cuda:0", None, 3]


def test_a_collective_inside_a_capture_is_paid_at_every_replay(library: None) -> None:
    """A TP all-reduce inside a graphed layer (rank 0 of 8 on one DGX H100 node, the prism backend): captured with
    the graph's kernels at the cost model's figure, so a replay lasts the kernels' time plus the all-reduce's; the
    op itself is issued once, at capture."""
    out = run(f"""
        import torch.distributed as dist
        import prism_plugin as P
        from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
        P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,), gpus_per_node=8),
                                   profile="dgx-h100", device="virtual-gpu"), backend="nccl")
        x = torch.randn({N}, {N}, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.current_stream().key
        def layer(x):
            y = f(x)
            dist.all_reduce(y)
            return y
        torch.cuda.synchronize()
        start = clock.ends[stream]
        f(x)
        out["kernels_s"] = clock.ends[stream] - start
        g = torch.cuda.CUDAGraph()
        ops = clock.comm_ops
        with torch.cuda.graph(g):
            static = layer(x)
        out["names"] = g._kernels
        out["ops_at_capture"] = clock.comm_ops - ops
        torch.cuda.synchronize()
        start = clock.position(stream)
        g.replay(); g.replay()
        out["two_replays_s"] = clock.ends[stream] - start
        out["ops_after"] = clock.comm_ops - ops
    """)
    placement = GroupPlacement.from_ranks(range(8), 8)
    all_reduce_s = CostModel(load_profile("dgx-h100")).collective_us_placed(OpKind.ALL_REDUCE, 32 * MiB,
                                                                             placement) * 1e-6
    names = [name for name, _ in out["names"]]
    # the graph's kernels in capture order: f's three, the all-reduce at the cost model's figure (the emulator's
    # write of the 7 virtual peers' share, y *= 8 under the mirror policy, is the collective's own: no kernel)
    assert names == ["aten.relu.default", "aten.mul.Tensor", "aten.add.Tensor", "nccl:all_reduce"]
    assert abs(out["names"][-1][1] - all_reduce_s) < 1e-15
    assert out["ops_at_capture"] == 1 and out["ops_after"] == 1  # issued once, at capture, onto the graph
    assert abs(out["two_replays_s"] - 2 * sum(d for _, d in out["names"])) < 1e-12
    assert abs(sum(d for _, d in out["names"][:3]) - out["kernels_s"]) < 1e-15
