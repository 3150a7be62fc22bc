"""The fast-forward's proof, its pure part: the virtual GPU at a mark (`Capture`) and how two marks or two periods
are compared (`prism_plugin.device.fast_forward` says what is proven and why).

Times recorded relative to a period's start are the same within `TOLERANCE_S`; everything else is compared
exactly. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TOLERANCE_S", "Capture", "from_malloc", "growth", "same", "same_map", "stream_frame"]

TOLERANCE_S = 1e-10
"""How far two recorded times (relative to their period's start) may differ and still be the same: rounding of
the executed sums, five orders of magnitude below the nanosecond the summary reports."""


@dataclass
class Capture:
    """The virtual GPU at one mark."""

    host_s: float
    ends: dict[Any, float]
    positions: dict[Any, float]
    """Each stream's place relative to the host (``max(end - host, 0)``)."""
    layout: tuple[Any, ...]
    totals: dict[Any, float]
    mallocs: int
    views: tuple[Any, ...] = ()
    """Where each recording observer (`FastForward.views`) stands."""
    pending: tuple[Any, ...] = ()
    """The communication handles issued and not yet waited on, held weakly (`prism_plugin.device.pending_works`):
    each ``(handle, its records, its completion and arrival relative to the device)``."""
    kept: tuple[Any, ...] = ()
    """Per recording observer, its records of the period ending here as of this mark (`PendingWorks.kept`), or
    why they do not describe it; set by `FastForward.mark`."""

    @property
    def device_s(self) -> float:
        """Where the device stands: the host or the furthest stream, whichever is later (the base of the times
        recorded on streams; the host's own records are relative to `host_s`)."""
        return max(self.host_s, max(self.ends.values(), default=self.host_s))


def same(a: Any, b: Any) -> bool:
    """Equal, with floats within `TOLERANCE_S` (tuples and lists element by element)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= TOLERANCE_S
    if isinstance(a, tuple | list):
        return isinstance(b, tuple | list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def same_map(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return all(same(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b))


def from_malloc(period: list[tuple[Any, ...]], mallocs_before: int, first: int) -> list[tuple[Any, ...]]:
    """The events of `period` (which began after `mallocs_before` mallocs) from the malloc numbered `first` on."""
    made = mallocs_before
    for i, event in enumerate(period):
        if event[0] == "m":
            if made == first:
                return period[i:]
            made += 1
    return []


def growth(a: dict[Any, float], b: dict[Any, float]) -> dict[Any, float]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}


def stream_frame(captures: list[Capture]) -> str | None:
    """Why the streams' places at the marks `captures` do not let their periods repeat (None: they do).

    In the host's frame, every stream stands at the same place relative to the host at each mark. In the GPU's
    frame the GPU runs ahead by a lead that grows every period (GPU-bound work the host never waits for): the host
    moves by the same step every period, and every stream that moves at all by the same larger one, the device's;
    the host neither waited for the GPU (a synchronisation) nor asked it how far it got (a query) in either period.
    With the records of the two periods the same relative to the device (the proof's other conditions), no launch
    in the second was held back by the host (it would have started ``lead growth`` earlier in the first than its
    launch), so the next periods repeat it: each starts a device step after its predecessor, ever further ahead of
    a launch that comes a host step later."""
    if all(same_map(a.positions, b.positions) for a, b in zip(captures, captures[1:], strict=False)):
        return None
    elsewhere = "the streams stand elsewhere relative to the host"
    pairs = list(zip(captures, captures[1:], strict=False))
    host = [b.host_s - a.host_s for a, b in pairs]
    device = [b.device_s - a.device_s for a, b in pairs]
    if not (same(host[0], host[1]) and same(device[0], device[1])) or device[1] - host[1] <= TOLERANCE_S:
        return elsewhere
    for key in set().union(*(c.ends for c in captures)):
        if any(key not in c.ends for c in captures):
            return elsewhere
        steps = [b.ends[key] - a.ends[key] for a, b in pairs]
        if not (all(step == 0.0 for step in steps) or all(same(step, device[1]) for step in steps)):
            return elsewhere
    for figure in (("clock", "host_syncs"), ("shim", "queries")):
        if any(b.totals[figure] != a.totals[figure] for a, b in pairs):
            return "the host waited for or queried the GPU, which runs ahead of it"
    return None
