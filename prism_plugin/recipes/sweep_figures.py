"""The figures of one sweep point (`prism_plugin.recipes.sweep`), from its real rank's summary and timeline.

Definitions are in `prism_plugin.recipes.sweep`'s docstring; `step_breakdown` reads a prism timeline
(``PRISM_TIMELINE``, `prism_plugin.runtime.timeline`'s Chrome trace) and `point_figures` a prism summary's
``virtual_gpu`` section. Pure: reads mappings, starts nothing.
Limitation: the breakdown needs the timeline to keep the measured steps and their neighbours (its record budget).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prism_plugin.recipes.sweep_points import SweepPoint

__all__ = ["Breakdown", "PointFigures", "peak_bf16", "point_figures", "step_breakdown"]

@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    """Mean per measured step, seconds, from a timeline (`step_breakdown`); compute + exposed + other = step."""

    steps: int
    step_s: float
    compute_s: float
    comm_s: float
    """Time a communication stream runs an op (hidden under compute or exposed)."""
    exposed_comm_s: float
    other_s: float
    dropped_spans: int


_COMPUTE_ROW = re.compile(r"^cuda:\d+ stream \S+$")
_COMM_ROW = re.compile(r"^comm stream ")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of `spans` not covered by `cover` (both merged, sorted)."""
    return _length(spans) - sum(_length(_clip(cover, a, b)) for a, b in spans)


def step_breakdown(timeline: Mapping[str, Any]) -> Breakdown | None:
    """Compute / exposed communication / other per measured step from a prism timeline (Chrome trace JSON,
    ``prism-timeline`` format: kernel rows ``cuda:D stream S``, ``comm stream G`` rows, the host row's closed
    ``iteration i`` spans); only steps i >= 1 whose iterations i - 1 and i + 1 the timeline kept too
    (``otherData.iterations_kept``: it drops the oldest when over its record budget); None when no step qualifies.

    Example: a 10 ms step whose compute stream runs 7 ms and whose comm stream runs 4 ms, 1 ms of it while a
    kernel runs -> compute 7 ms, exposed 3 ms, other 0 ms.
    """
    events = timeline.get("traceEvents", [])
    other = timeline.get("otherData", {})
    rank = other.get("rank")
    kept = other.get("iterations_kept")
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    windows: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X" or (rank is not None and e.get("pid") != rank):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        if e.get("cat") == "iteration":
            i = e["args"].get("iteration", 0)
            # a measured step whose neighbours were kept too: the one before holds kernels that run into this
            # window, and a step that alone filled the timeline's budget is dropped by the next one's records
            if not e["args"].get("open") and i >= 1 and (kept is None or {i - 1, i + 1} <= set(kept)):
                windows.append(span)
            continue
        row = rows.get((e["pid"], e["tid"]), "")
        if _COMPUTE_ROW.match(row):
            compute.append(span)
        elif _COMM_ROW.match(row):
            comm.append(span)
    if not windows:
        return None
    # spans of one row do not overlap, but the program's streams (or comm streams) may: their union counts
    compute, comm = _union(compute), _union(comm)
    parts = []
    for lo, hi in windows:
        busy, talking = _clip(compute, lo, hi), _clip(comm, lo, hi)
        parts.append((hi - lo, _length(busy), _length(talking), _minus(talking, busy)))
    n = len(parts)
    step, comp, comm_s, exp = (sum(p[i] for p in parts) / n * 1e-6 for i in range(4))
    dropped = int(other.get("dropped", {}).get("spans", 0))
    return Breakdown(steps=n, step_s=step, compute_s=comp, comm_s=comm_s, exposed_comm_s=exp,
                     other_s=max(step - comp - exp, 0.0), dropped_spans=dropped)


@dataclass(frozen=True, kw_only=True, slots=True)
class PointFigures:
    """A point's figures (see the module docstring for each definition); times in emulated seconds."""

    step_time_s: float | None
    step_times_s: tuple[float, ...]
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    flops_per_step: int | None
    """This rank's kernel FLOPs in one step."""
    peak_bf16_flops_per_s: float | None
    compute_s: float | None
    exposed_comm_s: float | None
    bubble_s: float | None
    other_s: float | None
    modelled_comm_s: float | None
    """Modelled communication per step, hidden or exposed: the comm streams' busy time in the measured steps
    (timeline), else the summary's ``modelled_comm_s`` / steps (which counts step 0 and the final barrier too)."""
    breakdown_note: str
    gpu: str
    gpu_memory_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    fits: bool
    ooms: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        return d


def _own_device(vgpu: Mapping[str, Any], local_rank: int = 0) -> Mapping[str, Any]:
    devices = vgpu["devices"]
    return devices[local_rank % max(1, len(devices))]


def point_figures(summary: Mapping[str, Any], point: SweepPoint, *, peak_bf16_flops_per_s: float | None,
                  timeline: Mapping[str, Any] | None = None) -> PointFigures:
    """The figures of `point` from its real rank's prism summary (and timeline, for the breakdown).

    The rank's own device is ``cuda:0`` (one real rank per point: LOCAL_RANK 0).
    """
    vgpu = summary.get("virtual_gpu")
    if not vgpu:
        raise ValueError(f"point {point.name}: the summary has no virtual_gpu section (not a virtual-GPU run?)")
    steps_total = point.recipe.steps.total
    vt = vgpu.get("virtual_time") or {}
    steps = tuple(float(s) for s in vt.get("step_times_s", ()))
    step = statistics.median(steps) if steps else None
    kernels = vgpu.get("kernels") or {}
    flops = int(kernels["flops"]) // steps_total if "flops" in kernels else None  # every step runs the same kernels
    mfu = None
    if step and flops is not None and peak_bf16_flops_per_s:
        mfu = flops / step / peak_bf16_flops_per_s
    tokens = point.tokens_per_step / step / point.world_size if step and point.tokens_per_step else None
    bd = step_breakdown(timeline) if timeline is not None else None
    note = "no timeline: breakdown not measured"
    if timeline is not None and bd is None:
        dropped = timeline.get("otherData", {}).get("dropped", {}).get("spans", 0)
        note = (f"the timeline kept no complete measured step ({dropped} spans dropped by its record budget): "
                "breakdown not measured; fewer micro-batches per step fit")
    if bd is not None:
        note = f"timeline: mean of {bd.steps} measured steps"
        if bd.dropped_spans:
            note += f" ({bd.dropped_spans} spans dropped by the timeline's bound: kept steps only)"
    bubble = (0.0 if point.layout.pp == 1 else None) if bd is not None else None
    comm = bd.comm_s if bd is not None else summary.get("modelled_comm_s")
    if comm is not None and bd is None:
        comm = float(comm) / steps_total
    dev = _own_device(vgpu)
    return PointFigures(
        step_time_s=step, step_times_s=steps, tokens_per_s_per_gpu=tokens, mfu=mfu, flops_per_step=flops,
        peak_bf16_flops_per_s=peak_bf16_flops_per_s, compute_s=None if bd is None else bd.compute_s,
        exposed_comm_s=None if bd is None else bd.exposed_comm_s, bubble_s=bubble,
        other_s=None if bd is None else bd.other_s,
        modelled_comm_s=None if comm is None else float(comm), breakdown_note=note,
        gpu=vgpu["gpu"], gpu_memory_bytes=int(vgpu["gpu_memory_bytes"]),
        peak_allocated_bytes=int(dev["peak_allocated_bytes"]), peak_reserved_bytes=int(dev["peak_reserved_bytes"]),
        device_total_bytes=int(dev["device_total_bytes"]), fits=bool(dev["fits"]), ooms=len(dev["ooms"]))


def peak_bf16(point: SweepPoint) -> float | None:
    """The dense bf16 peak FLOP/s of the point's GPU (the emulation's ``gpu``, else its profile's)."""
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.cost.profiles import load_profile

    emu = point.recipe.emulated[0]
    name = emu.gpu or load_profile(point.recipe.resolve_profile(emu)).gpu
    return None if name is None else gpu_spec(name).peak_flops_per_s.get("bfloat16")


