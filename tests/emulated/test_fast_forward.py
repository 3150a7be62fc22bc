"""Exact fast-forward (`prism_plugin.device.fast_forward`) on a virtual H100, driven as a schedule adapter drives it.

The child program is a 1F1B-like steady state without Megatron: ``W`` micro-batches of an MLP in flight in a
first-in first-out list, each steady iteration one forward (appended) and one backward (of the oldest), a
period of ``W`` iterations. With fast-forward on, it marks every period, and once one is proven advances the
device by whole periods and skips them by turning its list ``W`` times per period (inside ``silent``); with it
off, it runs every iteration. Both print every figure the virtual GPU keeps: the full
``torch.cuda.memory_stats()``, the memory summary, the clock's summary and the kernel tallies. They must be
equal: integers exactly, times to 1e-12 s (the advance multiplies where the run adds).
"""

from __future__ import annotations

import pytest

from integration_tests.compare import assert_same_figures
from tests.emulated.children import EPILOGUE, program, run_child

PRELUDE = """
import json, sys
from collections import deque
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
from prism_plugin.config.virtual_time import VirtualTimeOptions
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.profiles import load_profile
from prism_plugin.device.device import VirtualGpu
from prism_plugin.device.fast_forward import FastForward, FastForwardBroken
from prism_plugin.runtime.device_session import start_virtual_time
out = {}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm")).start()
    start_virtual_time(vg, load_profile("dgx-h100"), VirtualTimeOptions())
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to("cuda")
    ff = FastForward(vg)
    ROWS = 16
    def forward():
        x = torch.randn(ROWS, 512, device="cuda")
        small = torch.ones(3, device="cuda")  # small-pool churn: its block placement does not repeat
        return (model(x) * small.sum()).float().pow(2).mean()
"""

STEADY = """
    W, M, FF, BUDGET, ROWS, QUERY, EVERY, ODD = {w}, {m}, {ff}, {budget}, {rows}, {query}, {every}, {odd}
    base_rows = ROWS
    if BUDGET:  # a timeline draws every kernel (its record budget may fill on the way)
        from prism_plugin.runtime.timeline import Timeline
        timeline = Timeline(0, 1, ".", now_s=lambda: vg.clock.host_s, time_name="emulated")
        timeline.max_records = BUDGET
        vg.clock.record = timeline.add_span
    fifo = deque(forward() for _ in range(W))
    steady, i, skipped, proofs = M - W, 0, 0, []
    while i < steady:
        if FF and (EVERY or i % W == 1 % W):
            ff.mark(keep=W + 3)  # EVERY: each iteration a period, the window W + 1 back (Megatron's adapter)
            if ff.proven():
                n = (steady - 2 - i) // W
                if n >= 1:
                    ff.advance(n * W if EVERY else n)
                    with ff.silent():
                        fifo.rotate(-n * W)
                    i += n * W
                    skipped += n * W
                    continue
        if QUERY:
            torch.cuda.current_stream().query()  # the host asks how far the GPU got (without waiting)
        ROWS = 2 * base_rows if i == ODD else base_rows  # ODD: one micro-batch twice the size
        fifo.append(forward())
        fifo.popleft().backward()
        i += 1
    while fifo:
        fifo.popleft().backward()
    torch.cuda.synchronize()
    ff.stop()
    out["skipped"] = skipped
    out["not_proven"] = dict(ff.not_proven)
    out["stats"] = torch.cuda.memory_stats()
    summary = vg.summary()
    out["device"] = summary["devices"][0]
    out["clock"] = summary["virtual_time"]
    out["tallies"] = [[t.op, t.count, t.total_s, t.flops, t.bytes] for t in sorted(
        vg.kernel_timer._tallies.values(), key=lambda t: t.op)]
    if BUDGET:
        out["timeline"] = timeline.to_dict()
        out["timeline_summary"] = {{k: v for k, v in timeline.summary().items() if k not in ("path", "write_s")}}
"""


def _run(w: int, m: int, ff: bool, budget: int = 0, rows: int = 16, query: bool = False,
         every: bool = False, odd: int = -1) -> dict:
    return run_child(program(PRELUDE, STEADY.format(w=w, m=m, ff=ff, budget=budget, rows=rows, query=query,
                                                    every=every, odd=odd), EPILOGUE))


@pytest.mark.parametrize(("w", "m", "every"), [(3, 40, False), (1, 20, False), (5, 40, True)])
def test_fast_forward_gives_every_figure_of_the_full_run(library: None, w: int, m: int, every: bool) -> None:
    """`every`: each iteration is a period, proven once the last two are the same and the iterations back to the
    micro-batch the last one frees made the same allocations; the skip is a whole number of turns of the list."""
    full, fast = _run(w, m, ff=False), _run(w, m, ff=True, every=every)
    assert full["skipped"] == 0
    assert fast["skipped"] >= (m - w) // 2, fast  # most of the steady state was advanced, not run
    if every:  # proven after W + 2 iterations (whole periods of W: after 3W + 1), so 25 of the 35 are advanced
        assert fast["skipped"] == 25, fast
    for key in ("stats", "device", "clock", "tallies"):
        assert_same_figures(fast[key], full[key], rel_tol=0, abs_tol=1e-12, path=key)
    assert fast["clock"]["kernels"] == full["clock"]["kernels"] > 0


def test_a_micro_batch_in_flight_unlike_the_others_holds_the_proof_back(library: None) -> None:
    """Each iteration a period (W = 5 in flight): one micro-batch of twice the rows, made in iteration 6, is in
    flight until iteration 11 frees it. While it is, a window whose last two iterations are alike (7 and 8) must not
    prove (its backward, still to come, is not the last iteration's): the iterations back to the oldest block the
    last one frees must have made its allocations. The fast run gives the full run's figures, and proves later than
    without the odd micro-batch (at the mark before iteration 14 instead of 7)."""
    full, fast = _run(5, 40, ff=False, odd=6), _run(5, 40, ff=True, every=True, odd=6)
    for key in ("stats", "device", "clock", "tallies"):
        assert_same_figures(fast[key], full[key], rel_tol=0, abs_tol=1e-12, path=key)
    assert fast["skipped"] == 15, fast  # proven before iteration 14: (35 - 2 - 14) // 5 turns of 5
    assert fast["not_proven"].get("the periods ran different kernels, ops or allocations", 0) >= 2, fast


def test_gpu_bound_work_is_fast_forwarded_in_the_gpus_frame(library: None) -> None:
    """131,072-row micro-batches: the GPU runs ahead of the host by a lead that grows every period (nothing syncs).
    The periods are proven in the GPU's frame and advanced, host and streams each by their own step; the figures
    are the full run's, and a timeline keeps the full run's kernels."""
    full, fast = _run(3, 40, ff=False, budget=100_000, rows=131072), _run(3, 40, ff=True, budget=100_000,
                                                                          rows=131072)
    clock = full["clock"]  # GPU-bound: the kernels take far longer than the host's launches
    assert clock["kernel_s"] > 5 * clock["launches"] * clock["launch_overhead_us"] * 1e-6, clock
    assert fast["skipped"] >= 18, fast
    for key in ("stats", "device", "clock", "tallies"):
        assert_same_figures(fast[key], full[key], rel_tol=0, abs_tol=1e-12, path=key)
    assert_same_figures(fast["timeline"], full["timeline"], rel_tol=0, abs_tol=1e-6, path="timeline")
    assert fast["timeline_summary"] == full["timeline_summary"]


def test_a_host_that_queries_a_gpu_running_ahead_proves_nothing(library: None) -> None:
    """A ``Stream.query()`` each iteration: its answer depends on how far ahead the GPU runs, which grows, so no
    period is proven in the GPU's frame, and everything runs."""
    fast = _run(3, 40, ff=True, rows=131072, query=True)
    assert fast["skipped"] == 0, fast
    assert fast["not_proven"].get("the host waited for or queried the GPU, which runs ahead of it", 0) >= 8, fast


@pytest.mark.parametrize("budget", [100_000, 600])
def test_a_timeline_keeps_what_the_full_run_keeps(library: None, budget: int) -> None:
    """The timeline's kernels of the advanced periods are drawn as the full run draws them (each shifted by whole
    periods); with a small record budget it fills on the way, and keeps and drops the same records."""
    full, fast = _run(3, 40, ff=False, budget=budget), _run(3, 40, ff=True, budget=budget)
    assert fast["skipped"] >= 18, fast
    assert_same_figures(fast["timeline"], full["timeline"], rel_tol=0, abs_tol=1e-6, path="timeline")
    assert fast["timeline_summary"] == full["timeline_summary"]
    dropped = full["timeline_summary"]["dropped"]
    assert (dropped["spans"] > 0) == (budget < 1000), dropped
    assert_same_figures(fast["clock"], full["clock"], rel_tol=0, abs_tol=1e-12, path="clock")


def test_work_that_grows_is_never_proven(library: None) -> None:
    out = run_child(program(PRELUDE, """
        kept = []
        for i in range(12):
            ff.mark()
            kept.append(forward().detach())  # one more live tensor each period: the live storages grow
            out.setdefault("proven", []).append(ff.proven())
        ff.stop()
        out["not_proven"] = dict(ff.not_proven)
    """, EPILOGUE))
    assert not any(out["proven"])
    assert out["not_proven"].get("the live storages differ at the period boundaries", 0) >= 8


def test_skipped_calls_that_touch_the_device_raise(library: None) -> None:
    out = run_child(program(PRELUDE, """
        fifo = deque(forward() for _ in range(2))
        for i in range(8):
            ff.mark()
            if ff.proven():
                ff.advance(1)
                try:
                    with ff.silent():
                        forward()  # the adapter skipped the calls, yet the program ran one: not exact any more
                except FastForwardBroken as exc:
                    out["raised"] = str(exc)
                break
            fifo.append(forward())
            fifo.popleft().backward()
        out["silent_after"] = vg.silent
    """, EPILOGUE))
    assert "--prism-fast-forward off" in out["raised"]
    assert out["silent_after"] is False
