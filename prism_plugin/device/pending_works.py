"""Communication handles pending across a fast-forward's marks (`prism_plugin.device.fast_forward`).

Megatron's interleaved schedule overlaps its pipeline exchanges with compute: each steady iteration issues its
receive for the next iteration and its send, and waits on them an iteration later, so at every mark some handles
are issued and not yet waited on. The tracer and the timeline stamp an op's record when its handle is waited on
(`prism_plugin.comm.work.TimedWork.wait`): the records of a period are complete only one mark later. So:

- at each mark, each recording observer's records of the period just ended are taken *as of the mark* (pending
  ones unstamped), with the places of the records still pending and the stamps (relative to the period's start)
  that the records pending at the mark before received in it (`kept`); two periods are the same when all three are
  (`unproven`), and when the handles pending at their marks complete at the same places relative to the device;
- a handle pending at one mark must be waited on before the next (a lifetime under a period);
- the advance (`repeat`) writes each observer's copies of the last period, the pending records stamped where their
  counterparts were one period later (the last copy's stay pending), moves each pending handle's completion by the
  periods advanced, and points it at the last copy's records: the program waits on it after the skipped work, as
  the full run waits on the handle the last skipped period issued.

The handles are the session's op counters' (`prism_plugin.runtime.session.OpCounters.issued`): every op issued
while the engine records.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["PendingWorks", "pending_at"]


def _chain(work: Any) -> tuple[Any, ...]:
    """The records `work` stamps when waited on, outermost first (the timeline's record holds the tracer's)."""
    records, record = [], getattr(work, "trace", None)
    while record is not None:
        records.append(record)
        record = getattr(record, "inner", None)
    return tuple(records)


def pending_at(issued: Iterable[weakref.ref[Any]], device_s: float | None) -> tuple[Any, ...]:
    """The handles of `issued` (weak references) not yet waited on, each as ``(weak reference, its records, its
    completion and arrival relative to `device_s`)``: nothing that keeps the program's objects alive. Without
    virtual time (`device_s` None) their times are the wall clock's: not compared."""
    pending = []
    for ref in issued:
        work = ref()
        if work is not None and not work.is_completed_flag():
            times = () if device_s is None else (work.deadline_s - device_s, work.arrival_s - device_s)
            pending.append((ref, _chain(work), times))
    return tuple(pending)


def _waiting(pending: tuple[Any, ...]) -> bool:
    return any((work := ref()) is not None and not work.is_completed_flag() for ref, _, _ in pending)


class PendingWorks:
    """The engine's (`prism_plugin.device.fast_forward.FastForward`) handles pending at its marks."""

    def __init__(self, engine: Any, same: Callable[[Any, Any], bool]) -> None:
        self.engine = engine
        self.same = same
        """The engine's equality of recorded figures (floats within its tolerance)."""

    def kept(self, b: Any, c: Any) -> tuple[Any, ...]:
        """Per recording observer, the period from capture `b` to capture `c` as of now: ``((records, pending
        places, late stamps), {record id: place})``, or why the observer's records do not describe it."""
        if _waiting(b.pending):
            return ("an op was still pending a period after it was issued",)
        kept: list[Any] = []
        for i, view in enumerate(self.engine.views):
            records = view.signature(b.views[i], c.views[i], b.host_s, b.device_s, self.engine._seq_of(b.totals))
            if isinstance(records, str):
                kept.append(records)
                continue
            index = view.index(b.views[i], c.views[i])
            places = {id(r): index[id(r)] for _, chain, _ in c.pending for r in chain if id(r) in index}
            before = b.kept[i][1] if len(b.kept) > i and not isinstance(b.kept[i], str) else {}
            late = sorted((place, *view.stamps(r, b.device_s)) for _, chain, _ in b.pending for r in chain
                          if (place := before.get(id(r))) is not None)
            kept.append(((records, tuple(sorted(places.values())), tuple(late)), places))
        return tuple(kept)

    def unproven(self, captures: list[Any]) -> str | None:
        """Why the handles pending at `captures` (three marks) or the observers' records of their two periods do
        not let the periods repeat (None: they do)."""
        times = [tuple(t for _, _, t in c.pending) for c in captures]
        if not all(self.same(a, b) for a, b in zip(times, times[1:], strict=False)):
            return "the ops pending at the period boundaries differ"
        first, second = captures[-2].kept, captures[-1].kept
        for kept in (first, second):
            reason = next((k for k in kept if isinstance(k, str)), None)
            if reason is not None:
                return reason
        for view, a, b in zip(self.engine.views, first, second, strict=True):
            if not self.same(a[0], b[0]):
                return f"the periods kept different records in the {type(view).__name__.removesuffix('Periods')}"
        return None

    def repeat(self, c1: Any, c2: Any, periods: int, host_step_s: float, device_step_s: float,
               seq_step: Any) -> None:
        """The observers' copies of the period from `c1` to `c2`, `periods` times; the handles pending at `c2`
        complete `periods` device steps later and stamp the last copy's records."""
        last: dict[int, Any] = {}
        for i, view in enumerate(self.engine.views):
            (_, _, late), places = c2.kept[i]
            copies = view.repeat(c1.views[i], c2.views[i], periods, host_step_s, device_step_s, seq_step,
                                 late=late, base_s=c2.device_s)
            last.update({key: copies[place] for key, place in places.items() if place in copies})
        for ref, chain, _ in c2.pending:
            work = ref()
            if work is None:
                continue
            made = [last[id(r)] for r in chain if id(r) in last]
            for outer, inner in zip(made, made[1:], strict=False):
                outer.inner = inner
            if made and hasattr(made[-1], "inner"):
                made[-1].inner = None
            work.trace = made[0] if made else None
            if device_step_s:  # virtual time: the handle completes that much later
                work.deadline_s += periods * device_step_s
                work.arrival_s += periods * device_step_s
