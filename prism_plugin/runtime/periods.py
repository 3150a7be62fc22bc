"""The tracer's and the timeline's side of an exact fast-forward (`prism_plugin.device.fast_forward`).

A fast-forward advances a virtual GPU by whole periods of repeated work without running them. The records an op
observer keeps for those periods must then be what running them would have kept: `prism emulate` builds its
execution graph from the tracer's records (`prism_plugin.runtime.tracer`), and the timeline
(`prism_plugin.runtime.timeline`) draws them. So each of the two offers a *period view* (its ``periods()``), with
which the engine:

- notes where the observer stands at each mark (`position`);
- proves that two periods kept the same records (`signature`: each record with its times relative to its
  period's start and its sequence number relative to its group's at that start), as it proves the kernels and
  allocations the same;
- writes the last period's records `times` more times (`repeat`), each shifted by a whole number of periods in
  time and by the group's per-period growth in sequence number, through the observer's own bounds (the tracer's
  iteration limit, the timeline's record budget), so what is kept and what is dropped is what the full run keeps
  and drops. A copy is a record of its original's own class: this module imports neither observer.

A period has two starts: the host's, and the device's (the host or the furthest stream, whichever is later). They
move apart when the GPU runs ahead of the host by a lead that grows every period. Every op's times are places on
its stream (issue, wait and return read the current stream's position, `prism_plugin.device.clock`), so they are
relative to the device's start and shift by its step; only spans on the ``host`` row (host work) are the host's.

A period the observer cannot describe (an iteration mark inside it, the timeline's record budget filled inside
it) gives a reason instead of a signature: the engine then proves nothing there, and the work runs.

A hybrid run's replayed arrivals (`prism_plugin.runtime.arrivals`) keep no records, but their table of virtual
arrivals is data from outside the program, so two equal periods do not prove the next: `ArrivalPeriods` signs the
arrivals the period's ops met (relative to the device's start), and its `horizon` says for how many periods after
the proven one the table goes on repeating them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from prism_plugin.device.period_proof import TOLERANCE_S

__all__ = ["ArrivalPeriods", "TimelinePeriods", "TracerPeriods"]

SeqOf = Callable[[Any], int]
"""A group (`prism_plugin.comm.group.VirtualGroup`) -> a sequence number (its own at a mark, or its growth)."""
Late = Sequence[tuple[int, float, float]]
"""The records of a period pending at its end (their places in it), with the stamps their counterparts of the
period before received one period after theirs (relative to its start): `prism_plugin.device.pending_works`."""


def _rel(t: float, base: float) -> float:
    return t - base if t >= 0.0 else -1.0


def _shift(t: float, by: float) -> float:
    return t + by if t >= 0.0 else t


def _base(row: str, host: float, device: float) -> float:
    """The host's figure for a span on the ``host`` row, else the device's."""
    return host if row == "host" else device


class TracerPeriods:
    """`prism_plugin.runtime.tracer.Tracer`'s period view."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer

    def position(self) -> tuple[Any, int]:
        current = self.tracer._current
        return (None, self.tracer.untraced_ops) if current is None else (id(current), len(current))

    def signature(self, a: tuple[Any, int], b: tuple[Any, int], host_s: float, base_s: float,
                  seq_of: SeqOf) -> list[Any] | str:
        if a[0] != b[0]:
            return "an iteration of the trace ended inside the period"
        if a[0] is None:
            return [("untraced", b[1] - a[1])]
        groups = self.tracer._keep
        return [(r.op, r.group, r.seq - seq_of(groups[r.group]), r.size, r.peer, r.issue_s - base_s,
                 r.return_s - base_s, _rel(r.wait_s, base_s), _rel(r.end_s, base_s), r.thread)
                for r in self.tracer._current[a[1]:b[1]]]

    def index(self, a: tuple[Any, int], b: tuple[Any, int]) -> dict[int, int]:
        """The records of the period from `a` to `b`: id -> place in it."""
        if a[0] is None or a[0] != b[0]:
            return {}
        return {id(r): i for i, r in enumerate(self.tracer._current[a[1]:b[1]])}

    @staticmethod
    def stamps(record: Any, base_s: float) -> tuple[float, float]:
        return _rel(record.wait_s, base_s), _rel(record.end_s, base_s)

    def repeat(self, a: tuple[Any, int], b: tuple[Any, int], times: int, host_step_s: float, period_s: float,
               seq_step: SeqOf, late: Late = (), base_s: float = 0.0) -> dict[int, Any]:
        tracer = self.tracer
        if a[0] is None:
            tracer.untraced_ops += times * (b[1] - a[1])
            return {}
        current, groups = tracer._current, tracer._keep
        period = current[a[1]:b[1]]
        stamps = {place: (wait, end) for place, wait, end in late}
        for place, (wait, end) in stamps.items():  # stamped in the first advanced period
            period[place].wait_s, period[place].end_s = _shift(wait, base_s), _shift(end, base_s)
        last: dict[int, Any] = {}
        for k in range(1, times + 1):
            by = k * period_s
            for place, r in enumerate(period):
                copy = type(r)(r.op, r.group, r.seq + k * seq_step(groups[r.group]), r.size, r.peer, r.issue_s + by,
                                r.thread)
                copy.return_s, copy.wait_s, copy.end_s = r.return_s + by, _shift(r.wait_s, by), _shift(r.end_s, by)
                if place in stamps and k == times:  # the program waits on it after the advance
                    copy.wait_s = copy.end_s = -1.0
                    last[place] = copy
                current.append(copy)
        return last


class TimelinePeriods:
    """`prism_plugin.runtime.timeline.Timeline`'s period view: its open iteration keeps the order in which ops and
    spans came (``order``), so a repeat meets the record budget exactly where the full run would."""

    def __init__(self, timeline: Any) -> None:
        self.timeline = timeline

    def position(self) -> tuple[Any, ...]:
        t = self.timeline
        it = t._current
        return (id(it), t._ops is None, len(it.ops), len(it.spans), len(it.order), t.dropped_ops, t.dropped_spans)

    def signature(self, a: tuple[Any, ...], b: tuple[Any, ...], host_s: float, base_s: float,
                  seq_of: SeqOf) -> list[Any] | str:
        if a[0] != b[0]:
            return "an iteration of the timeline ended inside the period"
        if a[1]:  # the iteration filled the budget before the period: everything in it is dropped
            return [("dropped", b[5] - a[5], b[6] - a[6])]
        if b[1]:
            return "the timeline's record budget filled inside the period"
        it, groups = self.timeline._current, self.timeline._groups
        ops = [(r.kind, r.gid, r.seq - seq_of(groups[r.gid]), r.size, r.peer, r.issue_s - base_s,
                r.arrival_s - base_s, r.end_s - base_s, r.failed, _rel(r.wait_s, base_s), _rel(r.done_s, base_s),
                r.thread) for r in it.ops[a[2]:b[2]]]
        spans = [(row, name, start - _base(row, host_s, base_s), end - _base(row, host_s, base_s), args, category)
                 for row, name, start, end, args, category in it.spans[a[3]:b[3]]]
        return [bytes(it.order[a[4]:b[4]]), ops, spans]

    def index(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> dict[int, int]:
        """The op records of the period from `a` to `b`: id -> place among them."""
        if a[0] != b[0] or a[1] or b[1]:
            return {}
        return {id(r): i for i, r in enumerate(self.timeline._current.ops[a[2]:b[2]])}

    @staticmethod
    def stamps(record: Any, base_s: float) -> tuple[float, float]:
        return _rel(record.wait_s, base_s), _rel(record.done_s, base_s)

    def repeat(self, a: tuple[Any, ...], b: tuple[Any, ...], times: int, host_step_s: float, period_s: float,
               seq_step: SeqOf, late: Late = (), base_s: float = 0.0) -> dict[int, Any]:
        t = self.timeline
        if a[1]:
            t.dropped_ops += times * (b[5] - a[5])
            t.dropped_spans += times * (b[6] - a[6])
            return {}
        it = t._current
        ops, spans, order = it.ops[a[2]:b[2]], it.spans[a[3]:b[3]], bytes(it.order[a[4]:b[4]])
        stamps = {place: (wait, done) for place, wait, done in late}
        thread = threading.get_ident()
        for place, (wait, done) in stamps.items():  # stamped in the first advanced period
            ops[place].wait_s, ops[place].done_s = _shift(wait, base_s), _shift(done, base_s)
            ops[place].thread = thread
        last: dict[int, Any] = {}
        for k in range(1, times + 1):
            by = k * period_s
            o = s = 0
            for kind in order:
                if not t._room():
                    if kind:
                        t.dropped_spans += 1
                    else:
                        t.dropped_ops += 1
                elif kind:
                    row, name, start, end, args, category = spans[s]
                    shift = k * _base(row, host_step_s, period_s)
                    t._keep_span((row, name, start + shift, end + shift, args, category))
                else:
                    r = ops[o]
                    copy = type(r)(r.kind, r.gid, r.seq + k * seq_step(t._groups[r.gid]), r.size, r.peer,
                                     r.issue_s + by, r.arrival_s + by, r.end_s + by, r.failed, None)
                    copy.wait_s, copy.done_s, copy.thread = _shift(r.wait_s, by), _shift(r.done_s, by), r.thread
                    if o in stamps and k == times:  # the program waits on it after the advance
                        copy.wait_s = copy.done_s = -1.0
                        copy.thread = 0
                        last[o] = copy
                    t._keep_op(copy)
                s += kind
                o += 1 - kind
        return last


def _repeats(entry: tuple[Any, float] | None, later: tuple[Any, float] | None, by_s: float) -> bool:
    """Whether table entry `later` is `entry` (an op kind and an arrival offset) `by_s` later."""
    if entry is None or later is None:
        return entry is later
    return entry[0] is later[0] and abs(later[1] - entry[1] - by_s) <= TOLERANCE_S


class ArrivalPeriods:
    """`prism_plugin.runtime.arrivals.ReplayedArrivals`' period view: where its iteration's lookups stand (the k-th
    op of each group role and of each peer's sends and receives), and the virtual arrivals a period's ops met."""

    def __init__(self, arrivals: Any) -> None:
        self.arrivals = arrivals

    def position(self) -> tuple[Any, ...]:
        a = self.arrivals
        return (id(a.table), a.clock.iteration_start_s, a.active, dict(a._coll), dict(a._p2p),
                (a.replayed, a.outside_iterations, a.unmatched, a.mismatched))

    def _entries(self, a: tuple[Any, ...], b: tuple[Any, ...], shift: int = 0) -> list[Any]:
        """The table entries the ops between `a` and `b` looked up, `shift` periods on: per role or peer channel, each
        op's place in the period and its entry (kind and offset in s; None where the graph has no such op)."""
        table = self.arrivals.table

        def collective(role: str, k: int) -> tuple[Any, float] | None:
            return table.collectives.get((role, k))

        def p2p(channel: tuple[Any, int], k: int) -> tuple[Any, float] | None:
            offset = table.p2p.get((*channel, k))
            return None if offset is None else (channel[0], offset)

        out: list[Any] = []
        for place, lookup, key in ((3, collective, None), (4, p2p, lambda kv: (kv[0][0].value, kv[0][1]))):
            for channel, k in sorted(b[place].items(), key=key):
                k0 = a[place].get(channel, 0)
                for j in range(k0, k):
                    entry = lookup(channel, j + shift * (k - k0))
                    out.append((channel, j - k0, None if entry is None else (entry[0], entry[1] * 1e-6)))
        return out

    def signature(self, a: tuple[Any, ...], b: tuple[Any, ...], host_s: float, base_s: float,
                  seq_of: SeqOf) -> list[Any] | str:
        if a[:2] != b[:2]:
            return "an iteration of the replayed arrivals began inside the period"
        counts = [y - x for x, y in zip(a[5], b[5], strict=True)]
        start = b[1] - base_s  # the iteration's start relative to the period's
        return [b[2], counts, [(key, j, None if e is None else (e[0], start + e[1]))
                               for key, j, e in self._entries(a, b)]]

    def horizon(self, a: tuple[Any, ...], b: tuple[Any, ...], step_s: float, periods: int) -> int:
        """How many of the `periods` after the period from `a` to `b` (proven, `step_s` long on the device) meet the
        same virtual arrivals relative to their starts, in the table."""
        if not b[2]:
            return periods
        last = [e for _, _, e in self._entries(a, b)]
        for n in range(1, periods + 1):
            later = [e for _, _, e in self._entries(a, b, n)]
            if not all(_repeats(e, f, n * step_s) for e, f in zip(last, later, strict=True)):
                return n - 1
        return periods

    @staticmethod
    def index(a: tuple[Any, ...], b: tuple[Any, ...]) -> dict[int, int]:
        return {}

    @staticmethod
    def stamps(record: Any, base_s: float) -> tuple[float, float]:
        raise AssertionError("the replayed arrivals keep no records")

    def repeat(self, a: tuple[Any, ...], b: tuple[Any, ...], times: int, host_step_s: float, period_s: float,
               seq_step: SeqOf, late: Late = (), base_s: float = 0.0) -> dict[int, Any]:
        arrivals = self.arrivals
        for role, k in b[3].items():
            arrivals._coll[role] += times * (k - a[3].get(role, 0))
        for key, k in b[4].items():
            arrivals._p2p[key] += times * (k - a[4].get(key, 0))
        replayed, outside, unmatched, mismatched = (times * (y - x) for x, y in zip(a[5], b[5], strict=True))
        arrivals.replayed += replayed
        arrivals.outside_iterations += outside
        arrivals.unmatched += unmatched
        arrivals.mismatched += mismatched
        return {}
