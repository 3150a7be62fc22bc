"""The CPU tensor-storage tracker (prism_plugin.device.memory): exact, deterministic byte counts."""

from __future__ import annotations

import torch

from prism_plugin.device.memory import StorageTracker, current_tracker


def test_counts_allocations_frees_and_peak_exactly() -> None:
    with StorageTracker() as mem:
        assert current_tracker() is mem
        a = torch.empty(1000)  # 4000 B
        b = torch.ones(250, dtype=torch.float64)  # 2000 B
        assert mem.current_bytes == 6000
        del a
        assert mem.current_bytes == 2000
        c = b * 2  # a new 2000 B result
        assert mem.current_bytes == 4000
        del b, c
    assert mem.current_bytes == 0 and mem.peak_bytes == 6000 and mem.allocations == 3
    assert current_tracker() is None


def test_views_inplace_and_out_are_not_allocations() -> None:
    base = torch.zeros(100)
    with StorageTracker() as mem:
        v = base.view(10, 10)[1:3]  # a view of a storage made before start: baseline, never counted
        v.add_(1)
        x = torch.empty(100)
        torch.add(base, 1, out=x)
        x.view(4, 25).t()
    assert mem.peak_bytes == 400 and mem.allocations == 1


def test_autograd_backward_is_seen_and_two_runs_agree() -> None:
    def step() -> int:
        torch.manual_seed(0)
        w = torch.randn(64, 64, requires_grad=True)
        with StorageTracker() as mem:
            loss = (torch.randn(8, 64) @ w).tanh().sum()
            loss.backward()
        return mem.peak_bytes

    first = step()
    assert first >= 64 * 64 * 4 and first == step()


def test_paused_allocations_are_not_counted_but_frees_are() -> None:
    with StorageTracker() as mem:
        kept = torch.empty(10)
        with mem.paused():
            scratch = torch.empty(1000)
        del kept, scratch
        assert mem.current_bytes == 0
    assert mem.peak_bytes == 40


def test_reset_peak() -> None:
    with StorageTracker() as mem:
        big = torch.empty(1000)
        del big
        mem.reset_peak()
        small = torch.empty(10)
        assert mem.peak_bytes == 40
        del small


def test_the_cpu_trackers_history_opens_in_torchs_memory_viz() -> None:
    import pickle

    from torch.cuda import _memory_viz

    from prism_plugin.device.memory import StorageTracker

    tracker = StorageTracker()
    tracker.record_history(max_entries=3)
    with tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(10)  # 40 B
        del a
        c = torch.empty(7)  # 28 B: the oldest entry falls out of the ring of 3
    snap = pickle.loads(pickle.dumps(tracker.snapshot()))  # what a dump holds: builtin types only
    (trace,) = snap["device_traces"]
    assert [(e["action"], e["size"], e["time_us"]) for e in trace] == [("alloc", 40, 2), ("free_completed", 4000, 3),
                                                                        ("alloc", 28, 4)]
    assert snap["segments"] == [] and "<html" in _memory_viz.trace_plot(snap).lower()
    del b, c
