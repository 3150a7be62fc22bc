"""Trace capture on a real rank: every communication op of every iteration, with wall-clock times.

The session creates a `Tracer` when ``EmulationConfig.trace_dir`` is set. It is an op observer
(`prism_plugin.comm.context`): `on_issued` records each op once its handle exists and links the record to
the handle, whose wait() stamps the first wait on the issuing thread and its return, on the op clock;
`on_iteration` (each iteration mark) closes an iteration.
At `close` the iterations are written as a `RankTrace` (``<trace_dir>/rank<R>.trace.json``); compute spans
are derived from the gaps between calls when the trace is turned into a class trace
(`prism_plugin.graph.convert`).

Cost: a record object and one clock read per op, two clock reads per wait; nothing per compute. Only
the first `max_iterations` iterations are kept (then recording stops), so memory stays bounded.
Ops before the first mark and after the last one are not recorded (counted in the metadata). CPU only:
times are host wall clock, which on GPU would be enqueue times (DESIGN.md section 5), not device times.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpClock, OpEvent, OpWork
from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.rank_trace import RANK_TRACE_FORMAT, RANK_TRACE_VERSION, TIME_DECIMALS, RankTrace

__all__ = ["OpRecord", "Tracer"]


class OpRecord:
    """The live record of one op (TimedWork writes `wait_s` / `end_s`)."""

    __slots__ = ("op", "group", "seq", "size", "peer", "issue_s", "return_s", "wait_s", "end_s", "thread")

    def __init__(self, op: OpKind, group: int, seq: int, size: int, peer: int, issue_s: float,
                 thread: int) -> None:
        self.op, self.group, self.seq, self.size, self.peer = op, group, seq, size, peer
        self.issue_s = issue_s
        self.return_s = issue_s
        self.wait_s = -1.0
        self.end_s = -1.0
        self.thread = thread

    def on_wait(self, clock: OpClock) -> None:
        if self.wait_s < 0.0 and threading.get_ident() == self.thread:
            self.wait_s = clock.now_s()

    def on_done(self, clock: OpClock) -> None:
        if self.end_s < 0.0 and self.wait_s >= 0.0:
            self.end_s = clock.now_s()


class Tracer:
    """Per-iteration op records of one real rank; `close()` writes them."""

    def __init__(self, rank: int, world_size: int, out_dir: Path, max_iterations: int,
                 metadata: dict[str, Any], now_s: Callable[[], float] = time.perf_counter) -> None:
        self.now_s = now_s
        """The op clock's time: when `on_issued` returns to the program."""
        self.rank = rank
        self.world_size = world_size
        self.path = Path(out_dir) / f"rank{rank}.trace.json"
        self.max_iterations = max_iterations
        self.metadata = metadata
        self._groups: dict[int, int] = {}
        self._group_ranks: list[tuple[int, ...] | None] = []
        self._keep: list[Any] = []  # the traced groups, so their ids stay unique
        self._closed: list[tuple[int, float, float, list[OpRecord]]] = []
        self._current: list[OpRecord] | None = None  # None before the first mark and when full
        self._start_s = 0.0
        self._index = 0
        self.untraced_ops = 0
        self.write_s = 0.0

    @property
    def recording(self) -> bool:
        return self._current is not None

    def on_op(self, event: OpEvent) -> None:
        pass

    def periods(self) -> Any:
        """This tracer's side of a fast-forward (`prism_plugin.runtime.periods`)."""
        from prism_plugin.runtime.periods import TracerPeriods

        return TracerPeriods(self)

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        """Record the op (issued at ``event.issue_s``, this rank's own arrival) and link it to `work`."""
        current = self._current
        if current is None:
            self.untraced_ops += 1
            return
        vg = event.group
        gid = self._groups.get(id(vg))
        if gid is None:
            gid = self._groups[id(vg)] = len(self._group_ranks)
            self._group_ranks.append(None if vg.is_world else tuple(vg.global_ranks))
            self._keep.append(vg)
        peer = event.peer
        rec = OpRecord(event.kind, gid, event.seq, event.size_bytes, -1 if peer is None else peer, event.issue_s,
                       threading.get_ident())
        work.trace = rec
        current.append(rec)
        rec.return_s = self.now_s()

    def on_iteration(self, anchor_s: float, index: int) -> None:
        """An iteration mark at `anchor_s`: close the open iteration (if any), open the next."""
        if self._current is not None:
            self._closed.append((self._index, self._start_s, anchor_s, self._current))
        if len(self._closed) >= self.max_iterations:
            self._current = None
            return
        self._current = []
        self._start_s = anchor_s
        self._index = index

    def to_dict(self) -> dict[str, Any]:
        """The closed iterations in the `RankTrace` JSON format (built directly: a trace may hold 10^6 ops)."""
        iterations = []
        for index, start, end, recs in self._closed:
            ops = []
            for r in recs:
                waited = r.wait_s >= 0.0 and r.end_s >= 0.0
                ops.append([r.op.value, r.group, r.seq, r.size, r.peer, round((r.issue_s - start) * 1e6, TIME_DECIMALS),
                            round((r.return_s - start) * 1e6, TIME_DECIMALS),
                            round((r.wait_s - start) * 1e6, TIME_DECIMALS) if waited else -1.0,
                            round((r.end_s - start) * 1e6, TIME_DECIMALS) if waited else -1.0])
            iterations.append({"index": index, "start_s": start,
                               "duration_us": round((end - start) * 1e6, TIME_DECIMALS), "ops": ops})
        meta = {**self.metadata, "untraced_ops": self.untraced_ops + len(self._current or ())}
        return {"format": RANK_TRACE_FORMAT, "version": RANK_TRACE_VERSION, "rank": self.rank,
                "world_size": self.world_size, "groups": [None if g is None else list(g) for g in self._group_ranks],
                "iterations": iterations, "metadata": meta}

    def rank_trace(self) -> RankTrace:
        return RankTrace.from_dict(self.to_dict())

    def close(self) -> Path:
        """Write the closed iterations (the open one, cut by the program's end, is dropped)."""
        t0 = time.perf_counter()  # the writer's own cost, in wall time whatever the op clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))
        self.write_s = time.perf_counter() - t0
        return self.path

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "iterations": len(self._closed),
                "ops": sum(len(recs) for *_, recs in self._closed), "write_s": round(self.write_s, 4)}
