"""The per-rank timeline: one real rank's ops, waits, iterations and virtual peers as a Chrome trace.

The session builds a `Timeline` when the run has an output directory (``<output>/timeline``) or ``PRISM_TIMELINE=<dir>``
names one (``PRISM_TIMELINE=off``: none; `timeline_dir`) and writes it at deactivate as
``<dir>/rank<R>.timeline.json``, a Chrome trace event format JSON object (``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}``) that Perfetto and chrome://tracing open. Two process tracks:

- ``rank R (real)``, rows (threads): ``host`` (one "iteration i" span per marked iteration, an instant at each
  mark), ``communication`` (one complete event per op from issue to completion, with its kind, group,
  bytes, peer, seq, issue / arrival / completion, ``wait_s`` = arrival - issue and whom it waited on;
  overlapping async ops spill onto ``communication 2``, ...), ``wait`` (each wait() from entry to return, one
  row per waiting thread) and one row per `add_span` row (a virtual-time clock's ``cuda stream 7``);
- ``rank R: virtual participants``: one row per virtual peer this rank shares ops with (at most `MAX_PEERS`,
  those of the smallest groups first: TP/PP peers before DP/world), an instant at each shared op's arrival.
  No graph and no fault: the symmetric assumption (they arrive with this rank), said in ``otherData``; when
  a replay or a fault moved an op's arrival, the instant is the latest member's arrival.

Times are microseconds from the earliest kept timestamp (``otherData.origin_s`` on the op clock, whose name
``time_name`` says: "wall" or "emulated"); args' ``*_s`` figures are seconds from the same origin.

Cost: an observer of every op. `on_op` does nothing; `on_issued` (run after every observer's `on_op`, so
it reads the final arrival and cost, the virtual-time clock's included) allocates one slotted record, which is
also the work's `WaitTrace` (chained to a trace already linked, e.g. the tracer's); `add_span` appends one
tuple. Every dict is built in `write`. Measured: about 2.5 us per op, as the tracer's (a shared 2-core host).
`chrome_trace_problems` checks a written trace against the format's rules (the tests use it).

Bounded: at most `max_iterations` iterations (the ops before the first mark are one) and `MAX_RECORDS` ops and
spans in all; the oldest iterations are dropped first (FIFO: a long run keeps its latest steps), and one
iteration that alone fills the budget stops recording until the next mark. Peer instants are capped at
`MAX_PEER_INSTANTS`. Every drop is counted in ``otherData.dropped`` and the summary.

Limitations: a communication span ends at the modelled completion (``arrival_s + cost_s``); with several real
members the real exchange may end later (the wait row shows when wait() returned). Who delayed an op is named
only when live faults are attached (`faults`: their blamed straggler); a replayed arrival names the group's
virtual members. Virtual peers' compute is not drawn (the replay's op spans are not read yet).

Non-goals: not a profiler trace (torch.profiler / Kineto integration is separate) and not the recipes' probe
trace (`prism_plugin.recipes.probe`); the program's own compute is the gaps between ops, not a span.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpClock, OpEvent, OpGroup, OpWork, WaitTrace
from prism_plugin.config.kinds import OpKind

__all__ = ["MAX_PEERS", "MAX_PEER_INSTANTS", "MAX_RECORDS", "Timeline", "chrome_trace_problems", "timeline_dir",
           "trace_meta"]

MAX_PEERS = 16
"""Virtual peers drawn, one row each (the smallest groups' first)."""
MAX_RECORDS = 100_000
"""Ops plus spans kept over all kept iterations: about 250 bytes each in memory (25 MB), and, written with
their peers' instants, a file of about 50 MB that takes seconds to write and that Perfetto opens."""
MAX_PEER_INSTANTS = 100_000
"""Virtual peers' arrival instants written (the earliest kept ops' first)."""
_MAX_LANES = 32  # communication rows; a program with more ops in flight at once nests the rest on the last
_MAX_LISTED = 16  # group members / waited-on ranks named in one op's args


def timeline_dir(output_dir: str | Path | None, environ: Mapping[str, str] | None = None) -> Path | None:
    """Where this rank's timeline goes: ``PRISM_TIMELINE=<dir>``; by default ``<output>/timeline`` when the run has
    an output directory (bounded: `prism_plugin.runtime.timeline.MAX_RECORDS`); none with ``PRISM_TIMELINE=off``
    or without an output directory."""
    env = os.environ if environ is None else environ
    named = env.get("PRISM_TIMELINE", "")
    if named == "off":
        return None
    if named:
        return Path(named)
    return Path(output_dir) / "timeline" if output_dir else None

class _OpRecord:
    """One op as the timeline keeps it; the work's `WaitTrace` (stamps its wait, then the chained trace's)."""

    __slots__ = ("kind", "gid", "seq", "size", "peer", "issue_s", "arrival_s", "end_s", "failed", "wait_s",
                 "done_s", "thread", "inner")

    def __init__(self, kind: OpKind, gid: int, seq: int, size: int, peer: int | None, issue_s: float,
                 arrival_s: float, end_s: float, failed: bool, inner: WaitTrace | None) -> None:
        self.kind, self.gid, self.seq, self.size, self.peer = kind, gid, seq, size, peer
        self.issue_s, self.arrival_s, self.end_s, self.failed = issue_s, arrival_s, end_s, failed
        self.wait_s = -1.0
        self.done_s = -1.0
        self.thread = 0
        self.inner = inner

    def on_wait(self, clock: OpClock) -> None:
        if self.inner is not None:
            self.inner.on_wait(clock)
        if self.wait_s < 0.0:
            self.wait_s = clock.now_s()
            self.thread = threading.get_ident()

    def on_done(self, clock: OpClock) -> None:
        if self.inner is not None:
            self.inner.on_done(clock)
        if self.done_s < 0.0 and self.wait_s >= 0.0:
            self.done_s = clock.now_s()


class _Iteration:
    """The ops and spans recorded between two marks (index 0: before the first mark)."""

    __slots__ = ("index", "start_s", "end_s", "ops", "spans", "order")

    def __init__(self, index: int, start_s: float) -> None:
        self.index = index
        self.start_s = start_s
        self.end_s = -1.0  # set by the next mark; the open one ends at its last record
        self.ops: list[_OpRecord] = []
        self.spans: list[tuple[str, str, float, float, dict[str, Any] | None, str]] = []
        self.order = bytearray()
        """0 for an op, 1 for a span, in the order they came (a fast-forward's repeat keeps it: `periods`)."""


class Timeline:
    """The Chrome-trace timeline of one real rank; an op observer (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, out_dir: Path, *, now_s: Callable[[], float],
                 time_name: str = "wall", max_iterations: int = 50) -> None:
        if max_iterations < 1:
            raise ValueError(f"max_iterations={max_iterations!r}: keep at least 1 iteration")
        if time_name not in ("wall", "emulated"):
            raise ValueError(f"time_name={time_name!r}: 'wall' (the host's clock) or 'emulated' (virtual time)")
        self.rank = rank
        self.world_size = world_size
        self.path = Path(out_dir) / f"rank{rank}.timeline.json"
        self.now_s = now_s
        self.time_name = time_name
        self.max_iterations = max_iterations
        self.max_records = MAX_RECORDS
        """Ops plus spans kept in all (tests lower it)."""
        self.max_peer_instants = MAX_PEER_INSTANTS
        """Virtual peers' arrival instants written at most."""
        self.faults: Any = None
        """The session's `LiveFaults`, when it attaches them: its ``waits`` name whom a delayed op waited on."""
        self.real_ranks: frozenset[int] = frozenset((rank,))
        """Ranks known to be real besides the groups' own record (`real_group_ranks`); this rank at least."""
        self._groups: list[OpGroup] = []  # kept alive, so their ids stay unique
        self._gids: dict[int, int] = {}
        self._closed: deque[_Iteration] = deque()
        self._current = _Iteration(0, now_s())
        self._ops: list[_OpRecord] | None = self._current.ops  # None: this iteration filled the budget
        self._used = 0  # ops plus spans kept
        self.dropped_iterations = 0
        self.dropped_ops = 0
        self.dropped_spans = 0
        self.dropped_peer_instants = 0
        self.events_written = 0
        self.write_s = 0.0

    # -- the hot path -----------------------------------------------------------------------------
    def on_op(self, event: OpEvent) -> None:
        """Nothing: the op's figures are read in `on_issued`, once every observer has moved them."""

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        """Record the op with its final arrival and completion, and link the record to `work` (chained)."""
        if not self._room():
            self.dropped_ops += 1
            return
        vg = event.group
        gid = self._gids.get(id(vg))
        if gid is None:
            gid = self._gids[id(vg)] = len(self._groups)
            self._groups.append(vg)
        failure = event.failure
        rec = _OpRecord(event.kind, gid, event.seq, event.size_bytes, event.peer, event.issue_s, event.arrival_s,
                        event.completion_s if failure is None else failure.raise_at_s, failure is not None,
                        work.trace)
        work.trace = rec
        self._keep_op(rec)

    def add_span(self, row: str, name: str, start_s: float, end_s: float, args: dict | None = None, *,
                 category: str = "compute") -> None:
        """A span on row `row` (e.g. a kernel on "cuda stream 7"); spans of one row should not overlap."""
        if not self._room():
            self.dropped_spans += 1
            return
        self._keep_span((row, name, start_s, end_s, args, category))

    def _room(self) -> bool:
        """Whether one more record is kept (the budget: `_make_room`)."""
        return self._ops is not None and (self._used < self.max_records or self._make_room())

    def _keep_op(self, rec: _OpRecord) -> None:
        self._used += 1
        self._current.ops.append(rec)
        self._current.order.append(0)

    def _keep_span(self, span: tuple[str, str, float, float, dict[str, Any] | None, str]) -> None:
        self._used += 1
        self._current.spans.append(span)
        self._current.order.append(1)

    def periods(self) -> Any:
        """This timeline's side of a fast-forward (`prism_plugin.runtime.periods`)."""
        from prism_plugin.runtime.periods import TimelinePeriods

        return TimelinePeriods(self)

    def on_mark(self, iteration: int, start_s: float) -> None:
        """Iteration `iteration` starts at `start_s`: close the open iteration, open the next."""
        current = self._current
        current.end_s = start_s
        if current.ops or current.spans or current.index > 0:
            self._closed.append(current)
        while len(self._closed) >= self.max_iterations:  # the open one counts too
            self._drop_oldest()
        self._current = _Iteration(iteration, start_s)
        self._ops = self._current.ops

    def _drop_oldest(self) -> None:
        old = self._closed.popleft()
        self.dropped_iterations += 1
        self.dropped_ops += len(old.ops)
        self.dropped_spans += len(old.spans)
        self._used -= len(old.ops) + len(old.spans)

    def _make_room(self) -> bool:
        """Drop the oldest closed iterations until one record fits; False (and stop until the next mark) if
        the open iteration alone fills the budget."""
        while self._used >= self.max_records and self._closed:
            self._drop_oldest()
        if self._used < self.max_records:
            return True
        self._ops = None
        return False

    # -- writing ----------------------------------------------------------------------------------
    def _iterations(self) -> list[_Iteration]:
        return [*self._closed, self._current]

    def _real(self) -> set[int]:
        real = set(self.real_ranks)
        for vg in self._groups:
            ranks = vg.global_ranks
            real.update(ranks[g] for g in getattr(vg, "real_group_ranks", ()))
        return real

    def _peers(self, real: set[int]) -> tuple[list[int], int]:
        """The virtual peers drawn (smallest groups first, then first seen) and how many were left out."""
        candidates: list[tuple[int, int, Any]] = []
        p2p: dict[int, None] = {}
        for it in self._iterations():
            for rec in it.ops:
                if rec.peer is not None and rec.peer not in real:
                    p2p[rec.peer] = None
        if p2p:
            candidates.append((2, -1, list(p2p)))
        used = {rec.gid for it in self._iterations() for rec in it.ops if rec.peer is None}
        candidates += [(len(self._groups[g].global_ranks), g, self._groups[g].global_ranks) for g in sorted(used)]
        candidates.sort(key=lambda c: (c[0], c[1]))
        chosen: dict[int, None] = {}
        everyone: set[int] = set()
        for _, _, members in candidates:
            for r in members:
                if r in real:
                    continue
                everyone.add(r)
                if len(chosen) < MAX_PEERS:
                    chosen.setdefault(r, None)
        return list(chosen), len(everyone) - len(chosen)

    def _fault_blame(self) -> dict[tuple[str, int, str], int]:
        waits = getattr(self.faults, "waits", None) or ()
        return {(group, seq, op): who for _t, _d, who, op, group, seq, _step in waits}

    def to_dict(self) -> dict[str, Any]:
        """The trace as a Chrome trace event format JSON object (see the module docstring)."""
        its = self._iterations()
        times = [it.start_s for it in its if it.index > 0]
        for it in its:  # issue order need not be time order (threads), nor a stream's spans
            if it.ops:
                times.append(min(rec.issue_s for rec in it.ops))
            if it.spans:
                times.append(min(s[2] for s in it.spans))
        origin = min(times) if times else self._current.start_s

        def us(t: float) -> float:
            return round((t - origin) * 1e6, 3)

        def rel(t: float) -> float:
            return round(t - origin, 9)

        pid, vpid = self.rank, self.world_size + self.rank
        events: list[dict[str, Any]] = []
        tids: dict[str, int] = {}

        def tid(row: str) -> int:
            t = tids.get(row)
            if t is None:
                t = tids[row] = len(tids)
            return t

        for row in ("host", "communication", "wait"):
            tid(row)
        # host: iterations and their boundaries
        for it in its:
            if it.index == 0:
                continue
            stop = it.end_s if it.end_s >= 0.0 else _last_s(it, it.start_s)  # the open one: its last record
            events.append({"ph": "X", "name": f"iteration {it.index}", "cat": "iteration", "ts": us(it.start_s),
                           "dur": _dur(us(it.start_s), us(stop)), "pid": pid, "tid": 0,
                           "args": {"iteration": it.index, "ops": len(it.ops), "open": it.end_s < 0.0}})
            events.append({"ph": "i", "s": "p", "name": f"iteration {it.index} start", "cat": "iteration",
                           "ts": us(it.start_s), "pid": pid, "tid": 0})
        # communication: one span per op, greedy lanes so async ops in flight together do not overlap
        real = self._real()
        blame = self._fault_blame()
        lanes: list[float] = []
        waits: dict[int, int] = {}
        ops = sorted(((it.index, rec) for it in its for rec in it.ops), key=lambda p: p[1].issue_s)
        moved = 0
        for index, rec in ops:
            vg = self._groups[rec.gid]
            start, stop = rec.issue_s, max(rec.end_s, rec.issue_s)
            lane = next((i for i, free in enumerate(lanes) if free <= start), None)
            if lane is None:
                if len(lanes) < _MAX_LANES:
                    lanes.append(stop)
                    lane = len(lanes) - 1
                else:
                    lane = len(lanes) - 1
            lanes[lane] = max(lanes[lane], stop)
            row = "communication" if lane == 0 else f"communication {lane + 1}"
            members = vg.global_ranks if rec.peer is None else (self.rank, rec.peer)
            waited_s = rec.arrival_s - rec.issue_s
            args: dict[str, Any] = {
                "kind": rec.kind.value, "group": vg.name, "group_desc": str(getattr(vg, "desc", "") or ""),
                "group_size": len(vg.global_ranks), "bytes": rec.size, "peer": rec.peer, "seq": rec.seq,
                "iteration": index, "issue_s": rel(rec.issue_s), "arrival_s": rel(rec.arrival_s),
                "completion_s": rel(rec.end_s), "wait_s": round(waited_s, 9),
                "members": _listed(members),
            }
            if waited_s > 0.0:
                moved += 1
                who = blame.get((vg.name, rec.seq, rec.kind.value))
                if who is not None:
                    args["waited_on"], args["waited_on_source"] = [who], "live fault (straggler)"
                else:
                    args["waited_on"] = _listed([r for r in members if r not in real])
                    args["waited_on_source"] = "replayed arrival: the latest of the group's virtual members"
            else:
                args["waited_on"] = []
            if rec.failed:
                args["failed"] = True
            if rec.done_s >= 0.0:
                args["wait_returned_s"] = rel(rec.done_s)
            events.append({"ph": "X", "name": rec.kind.value, "cat": "communication", "ts": us(start),
                           "dur": _dur(us(start), us(stop)), "pid": pid, "tid": tid(row), "args": args})
            # wait: from wait() entry to return, one row per waiting thread
            if rec.wait_s >= 0.0 and rec.done_s >= 0.0:
                n = waits.setdefault(rec.thread, len(waits))
                wrow = "wait" if n == 0 else f"wait (thread {n + 1})"
                events.append({"ph": "X", "name": f"wait {rec.kind.value}", "cat": "wait", "ts": us(rec.wait_s),
                               "dur": _dur(us(rec.wait_s), us(rec.done_s)), "pid": pid, "tid": tid(wrow),
                               "args": {"kind": rec.kind.value, "group": vg.name, "seq": rec.seq,
                                        "waited_s": round(rec.done_s - rec.wait_s, 9)}})
        # spans added by the clock (kernels per emulated stream)
        for it in its:
            for row, name, start, stop, span_args, category in it.spans:
                ev: dict[str, Any] = {"ph": "X", "name": name, "cat": category, "ts": us(start),
                                      "dur": _dur(us(start), us(stop)), "pid": pid, "tid": tid(row)}
                if span_args:
                    ev["args"] = span_args
                events.append(ev)
        # virtual participants: an arrival instant per shared op
        peers, left_out = self._peers(real)
        chosen = set(peers)
        in_group: dict[int, list[int]] = {}
        budget = self.max_peer_instants
        written_instants = dropped_instants = 0
        for index, rec in ops:
            if rec.peer is not None:
                who = [rec.peer] if rec.peer in chosen else []
            else:
                who = in_group.get(rec.gid)
                if who is None:
                    vg = self._groups[rec.gid]
                    who = in_group[rec.gid] = [p for p in peers if vg.group_rank_of(p) is not None]
            if not who:
                continue
            late = rec.arrival_s > rec.issue_s
            for p in who:
                if written_instants >= budget:
                    dropped_instants += 1
                    continue
                written_instants += 1
                events.append({"ph": "i", "s": "t", "name": f"arrive {rec.kind.value}", "cat": "arrival",
                               "ts": us(rec.arrival_s), "pid": vpid, "tid": p,
                               "args": {"group": self._groups[rec.gid].name, "seq": rec.seq, "iteration": index,
                                        "arrival": "latest member (replay/fault)" if late else "symmetric"}})
        self.dropped_peer_instants = dropped_instants
        # metadata: process and row names, in this order
        meta = [trace_meta("process_name", pid, 0, name=f"rank {self.rank} (real)"),
                trace_meta("process_sort_index", pid, 0, sort_index=0)]
        for row, t in tids.items():
            meta += [trace_meta("thread_name", pid, t, name=row), trace_meta("thread_sort_index", pid, t, sort_index=t)]
        if peers:
            meta += [trace_meta("process_name", vpid, 0, name=f"rank {self.rank}: virtual participants"),
                     trace_meta("process_sort_index", vpid, 0, sort_index=1)]
            for i, p in enumerate(peers):
                meta += [trace_meta("thread_name", vpid, p, name=f"rank {p} (virtual)"),
                         trace_meta("thread_sort_index", vpid, p, sort_index=i)]
        arrivals = ("symmetric: virtual participants arrive with this rank" if not moved else
                    f"moved: {moved} of {len(ops)} ops arrived after this rank issued them (an execution graph's "
                    "replay or a live fault delayed the latest member); the others symmetric")
        other = {
            "format": "prism-timeline", "version": 1, "rank": self.rank, "world_size": self.world_size,
            "time_name": self.time_name, "time_unit": "us from origin_s; args' *_s: seconds from origin_s",
            "origin_s": origin, "arrivals": arrivals,
            "iterations_kept": [it.index for it in its if it.index > 0 or it.ops or it.spans],
            "ops": len(ops), "virtual_peers": peers, "virtual_peers_left_out": left_out,
            "virtual_peers_rule": f"at most {MAX_PEERS}, those of the smallest groups first",
            "dropped": self._dropped(), "drop_policy": "oldest iterations first (FIFO); an iteration that alone "
            "fills the budget stops recording until the next mark",
        }
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}

    def _dropped(self) -> dict[str, int]:
        return {"iterations": self.dropped_iterations, "ops": self.dropped_ops, "spans": self.dropped_spans,
                "peer_instants": self.dropped_peer_instants}

    def write(self) -> Path:
        """Write ``<out_dir>/rank<R>.timeline.json`` (again on each call) and return its path."""
        t0 = time.perf_counter()  # the writer's own cost, in wall time whatever the op clock
        trace = self.to_dict()
        self.events_written = len(trace["traceEvents"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", encoding="utf-8") as fh:
            json.dump(trace, fh, separators=(",", ":"), default=str)  # spans' args are the caller's
        self.write_s = time.perf_counter() - t0
        return self.path

    def summary(self) -> dict[str, Any]:
        """Path, events written (0 before `write`), drops, time name, iterations and ops kept."""
        its = self._iterations()
        return {"path": str(self.path), "events": self.events_written, "dropped": self._dropped(),
                "time_name": self.time_name, "iterations": sum(1 for it in its if it.index > 0),
                "ops": sum(len(it.ops) for it in its), "spans": sum(len(it.spans) for it in its),
                "write_s": round(self.write_s, 4)}


def trace_meta(event: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    """A Chrome-trace metadata event: a process's or thread's name, label or sort index."""
    return {"ph": "M", "ts": 0, "name": event, "pid": pid, "tid": tid, "args": args}


def _listed(ranks: Any) -> list[int] | dict[str, Any]:
    """Ranks named in an op's args: all of them up to `_MAX_LISTED`, else the first ones and the count."""
    n = len(ranks)
    if n <= _MAX_LISTED:
        return list(ranks)
    return {"first": [ranks[i] for i in range(_MAX_LISTED)], "count": n}


def _dur(start_us: float, stop_us: float) -> float:
    """A complete event's duration, never negative, rounded like its timestamps."""
    return round(max(0.0, stop_us - start_us), 3)


def _last_s(it: _Iteration, default_s: float) -> float:
    """The latest time recorded in `it` (an op's completion or wait return, a span's end)."""
    last = default_s
    for rec in it.ops:
        last = max(last, rec.end_s, rec.done_s)
    for span in it.spans:
        last = max(last, span[3])
    return last


_PHASES = frozenset("XBEiIMCbenstfPOND")
_META = frozenset(("process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"))


def chrome_trace_problems(trace: Any) -> list[str]:
    """What breaks the Chrome trace event format's rules in `trace` (a JSON object trace); [] when none.

    Checked: the object form (``traceEvents`` list, ``displayTimeUnit`` "ms" or "ns"); every event has a known
    ``ph``, a numeric ``ts`` >= 0 and integer ``pid`` / ``tid``; complete events ("X") a ``dur`` >= 0 and,
    per thread, proper nesting (no partial overlap, to 1 ns); instants a scope "g", "p" or "t"; metadata ("M")
    a known name with its ``args``; every thread with an event has a ``thread_name`` and every process a
    ``process_name``. Not checked: B/E pairing, flow and async ids (the timeline writes none).

    >>> chrome_trace_problems({"traceEvents": [{"ph": "X", "ts": 0, "pid": 0, "tid": 0, "dur": -1}]})[0]
    'event 0: X needs dur >= 0, has -1'
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a JSON object trace with a traceEvents list"]
    problems: list[str] = []
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is not 'ms' or 'ns'")
    threads: dict[tuple[Any, Any], list[tuple[float, float, int]]] = {}
    named_threads, named_procs = set(), set()
    for i, ev in enumerate(trace["traceEvents"]):
        ph = ev.get("ph") if isinstance(ev, dict) else None
        if ph not in _PHASES:
            problems.append(f"event {i}: unknown ph {ph!r}")
            continue
        ts, pid, tid = ev.get("ts"), ev.get("pid"), ev.get("tid")
        if not isinstance(ts, int | float) or ts < 0:
            problems.append(f"event {i}: ts must be a number >= 0, has {ts!r}")
        if not isinstance(pid, int) or not isinstance(tid, int):
            problems.append(f"event {i}: pid and tid must be integers, has {pid!r}, {tid!r}")
        if ph == "M":
            if ev.get("name") not in _META or not isinstance(ev.get("args"), dict):
                problems.append(f"event {i}: metadata {ev.get('name')!r} unknown or without args")
            elif ev["name"] == "thread_name":
                named_threads.add((pid, tid))
            elif ev["name"] == "process_name":
                named_procs.add(pid)
            continue
        threads.setdefault((pid, tid), [])
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, int | float) or dur < 0:
                problems.append(f"event {i}: X needs dur >= 0, has {dur!r}")
            elif isinstance(ts, int | float):
                threads[(pid, tid)].append((float(ts), float(dur), i))
        elif ph in "iI" and ev.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"event {i}: instant scope {ev.get('s')!r} is not g, p or t")
    for (pid, tid), spans in threads.items():
        if (pid, tid) not in named_threads:
            problems.append(f"thread pid={pid} tid={tid} has events but no thread_name")
        if pid not in named_procs:
            problems.append(f"process pid={pid} has events but no process_name")
        stack: list[float] = []
        for ts, dur, i in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= ts + 1e-3:
                stack.pop()
            if stack and ts + dur > stack[-1] + 1e-3:
                problems.append(f"event {i}: X on pid={pid} tid={tid} overlaps the enclosing span's end")
            stack.append(ts + dur)
    return sorted(set(problems), key=problems.index)
