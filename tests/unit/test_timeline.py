"""Tier (a) tests of the per-rank timeline (`prism_plugin.runtime.timeline`), driven with fake ops and works.

Each test feeds a `Timeline` hand-made `OpEvent`s on fake groups and fake work handles, on a fake clock whose
time the test sets, then checks the written Chrome trace: exact event counts, timestamps and durations in
microseconds, FIFO dropping, the chained `WaitTrace`, the virtual peers' rows and the format's rules.
"""

from __future__ import annotations

import doctest
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from prism_plugin.comm.context import OpEvent, OpObserver
from prism_plugin.config.kinds import OpKind
from prism_plugin.runtime import timeline as timeline_mod
from prism_plugin.runtime.timeline import MAX_PEERS, Timeline, chrome_trace_problems
from prism_plugin.runtime.tracer import Tracer


class Clock:
    """A settable op clock."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def now_s(self) -> float:
        return self.t

    def sleep_until(self, deadline_s: float, record: bool = True) -> None:
        self.t = max(self.t, deadline_s)


class Group:
    """What the timeline reads of a `VirtualGroup`."""

    def __init__(self, name: str, ranks: list[int], real: tuple[int, ...] = (0,), is_world: bool = False) -> None:
        self.name, self.desc, self.is_world = name, "", is_world
        self.global_ranks = tuple(ranks)
        self.real_group_ranks = tuple(sorted(self.global_ranks.index(r) for r in real if r in self.global_ranks))
        self.all_real = len(self.real_group_ranks) == len(ranks)

    def group_rank_of(self, global_rank: int) -> int | None:
        return self.global_ranks.index(global_rank) if global_rank in self.global_ranks else None


class Work:
    def __init__(self, deadline_s: float) -> None:
        self.trace: Any = None
        self.deadline_s = deadline_s

    def is_completed_flag(self) -> bool:
        return False


class Failure:
    raise_at_s = 0.0
    error = RuntimeError("hung")

    def raised(self) -> None:
        pass


class Recorder:
    """Another observer's `WaitTrace`, already linked to the work."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_wait(self, clock: Any) -> None:
        self.calls.append("wait")

    def on_done(self, clock: Any) -> None:
        self.calls.append("done")


def issue(tl: Timeline, clock: Clock, group: Group, *, cost_s: float = 0.0, late_s: float = 0.0,
          kind: OpKind = OpKind.ALL_REDUCE, peer: int | None = None, seq: int = 1, size: int = 64,
          wait_for_s: float | None = None, work: Work | None = None) -> Work:
    """One op issued now; `wait_for_s`: then waited for that long (the clock advances)."""
    t = clock.t
    event = OpEvent(kind, group, seq, size, peer, (), t, t + late_s, cost_s, cost_s)
    tl.on_op(event)
    work = work if work is not None else Work(event.completion_s)
    tl.on_issued(event, work)
    if wait_for_s is not None:
        work.trace.on_wait(clock)
        clock.t += wait_for_s
        work.trace.on_done(clock)
    return work


def events(trace: dict[str, Any], cat: str, ph: str = "X") -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("cat") == cat and e["ph"] == ph]


def rows(trace: dict[str, Any], pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def test_ops_waits_and_iterations_in_microseconds(tmp_path: Path) -> None:
    clock = Clock(100.0)
    tl = Timeline(0, 4, tmp_path, now_s=clock.now_s)
    assert isinstance(tl, OpObserver)
    tp, world = Group("tp", [0, 1]), Group("world", [0, 1, 2, 3], is_world=True)
    issue(tl, clock, world, cost_s=0.0005, wait_for_s=0.0006)  # before the first mark: kept as iteration 0
    for i in (1, 2):
        clock.t = 100.0 + i * 0.01
        tl.on_mark(i, clock.t)
        clock.t += 0.001
        issue(tl, clock, tp, cost_s=0.0002, seq=i, wait_for_s=0.00025)
        issue(tl, clock, world, cost_s=0.0004, seq=i + 1)  # never waited: no wait span
    clock.t = 100.05
    path = tl.write()
    assert path == tmp_path / "rank0.timeline.json"
    trace = json.loads(path.read_text())
    assert trace == tl.to_dict() and trace["displayTimeUnit"] == "ms"
    assert chrome_trace_problems(trace) == []
    comm = events(trace, "communication")
    assert [(e["name"], e["ts"], e["dur"], e["args"]["group_size"]) for e in comm] == [
        ("all_reduce", 0.0, 500.0, 4), ("all_reduce", 11000.0, 200.0, 2), ("all_reduce", 11250.0, 400.0, 4),
        ("all_reduce", 21000.0, 200.0, 2), ("all_reduce", 21250.0, 400.0, 4)]
    first = comm[0]["args"]
    assert first == {"kind": "all_reduce", "group": "world", "group_desc": "", "group_size": 4, "bytes": 64,
                     "peer": None, "seq": 1, "iteration": 0, "issue_s": 0.0, "arrival_s": 0.0,
                     "completion_s": 0.0005, "wait_s": 0.0, "members": [0, 1, 2, 3], "waited_on": [],
                     "wait_returned_s": 0.0006}
    waits = events(trace, "wait")
    assert [(e["ts"], e["dur"]) for e in waits] == [(0.0, 600.0), (11000.0, 250.0), (21000.0, 250.0)]
    spans = events(trace, "iteration")
    assert [(e["name"], e["ts"], e["dur"], e["args"]["open"]) for e in spans] == [
        ("iteration 1", 10000.0, 10000.0, False), ("iteration 2", 20000.0, 1650.0, True)]  # open: its last record
    assert len(events(trace, "iteration", "i")) == 2
    assert rows(trace, 0) == {0: "host", 1: "communication", 2: "wait"}
    # virtual participants: 1 (tp, the smallest group) first, then 2 and 3; an instant per shared op
    assert trace["otherData"]["virtual_peers"] == [1, 2, 3]
    assert rows(trace, 4) == {1: "rank 1 (virtual)", 2: "rank 2 (virtual)", 3: "rank 3 (virtual)"}
    arrivals = events(trace, "arrival", "i")
    assert Counter(e["tid"] for e in arrivals) == {1: 5, 2: 3, 3: 3}
    assert {e["args"]["arrival"] for e in arrivals} == {"symmetric"}
    other = trace["otherData"]
    assert (other["rank"], other["world_size"], other["time_name"], other["origin_s"]) == (0, 4, "wall", 100.0)
    assert other["arrivals"] == "symmetric: virtual participants arrive with this rank"
    # ops, waits, host (2 spans, 2 instants), arrivals; metadata: 2 per process + 2 per row
    assert len(trace["traceEvents"]) == 5 + 3 + 4 + 11 + (2 + 2 * 3) + (2 + 2 * 3) == 39
    assert tl.summary() == {"path": str(path), "events": len(trace["traceEvents"]),
                            "dropped": {"iterations": 0, "ops": 0, "spans": 0, "peer_instants": 0},
                            "time_name": "wall", "iterations": 2, "ops": 5, "spans": 0,
                            "write_s": tl.summary()["write_s"]}


def test_oldest_iterations_dropped_first(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 8, tmp_path, now_s=clock.now_s, max_iterations=2)
    tp = Group("tp", [0, 1])
    for i in range(1, 6):
        tl.on_mark(i, clock.t)
        for seq in range(3):
            issue(tl, clock, tp, seq=seq, cost_s=1e-4)
            clock.t += 1e-3
    trace = tl.to_dict()
    assert sorted({e["args"]["iteration"] for e in events(trace, "communication")}) == [4, 5]
    assert [e["name"] for e in events(trace, "iteration")] == ["iteration 4", "iteration 5"]
    assert trace["otherData"]["dropped"] == {"iterations": 3, "ops": 9, "spans": 0, "peer_instants": 0}
    assert trace["otherData"]["iterations_kept"] == [4, 5]
    assert chrome_trace_problems(trace) == []


def test_record_budget_drops_old_iterations_then_stops_the_open_one(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 8, tmp_path, now_s=clock.now_s)
    tl.max_records = 5
    tp = Group("tp", [0, 1])
    tl.on_mark(1, clock.t)
    for seq in range(4):
        issue(tl, clock, tp, seq=seq)
    tl.on_mark(2, clock.t)
    for seq in range(7):  # iteration 1 (4 ops) is dropped to make room, then the budget is full
        issue(tl, clock, tp, seq=seq)
    for _ in range(2):
        tl.add_span("cuda stream 7", "gemm", clock.t, clock.t)
    assert tl.summary()["ops"] == 5 and tl.summary()["spans"] == 0
    assert tl._dropped() == {"iterations": 1, "ops": 4 + 2, "spans": 2, "peer_instants": 0}
    tl.on_mark(3, clock.t)  # a new iteration records again, dropping iteration 2
    issue(tl, clock, tp)
    assert tl.summary()["ops"] == 1 and tl.dropped_iterations == 2


def test_chained_wait_trace_and_the_real_tracer(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 4, tmp_path, now_s=clock.now_s)
    tp = Group("tp", [0, 1])
    other = Recorder()
    work = Work(clock.t)
    work.trace = other
    issue(tl, clock, tp, work=work, wait_for_s=0.002)
    assert work.trace is not other and other.calls == ["wait", "done"]
    # the session's order: the tracer links its record first, the timeline chains it
    tracer = Tracer(0, 4, tmp_path, 8, {}, now_s=clock.now_s)
    tracer.on_iteration(clock.t, 1)
    tl.on_mark(1, clock.t)
    event = OpEvent(OpKind.ALL_REDUCE, tp, 2, 8, None, (), clock.t, clock.t, 0.001, 0.001)
    work = Work(event.completion_s)
    for observer in (tracer, tl):
        observer.on_op(event)
    for observer in (tracer, tl):
        observer.on_issued(event, work)
    clock.t += 0.0005
    work.trace.on_wait(clock)
    clock.t += 0.0015
    work.trace.on_done(clock)
    (rec,) = tracer._current
    assert (rec.wait_s, rec.end_s) == (pytest.approx(100.0025), pytest.approx(100.004))
    waits = events(tl.to_dict(), "wait")
    assert [(e["ts"], e["dur"]) for e in waits] == [(0.0, 2000.0), (2500.0, 1500.0)]


def test_overlapping_async_ops_take_separate_rows(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 4, tmp_path, now_s=clock.now_s)
    dp = Group("dp", [0, 2])
    works = []
    for seq in range(3):  # three buckets in flight at once, then one after they completed
        works.append(issue(tl, clock, dp, seq=seq, cost_s=0.01))
        clock.t += 0.001
    clock.t += 0.02
    issue(tl, clock, dp, seq=3, cost_s=0.01)
    trace = tl.to_dict()
    by_row = Counter(rows(trace, 0)[e["tid"]] for e in events(trace, "communication"))
    assert by_row == {"communication": 2, "communication 2": 1, "communication 3": 1}
    assert chrome_trace_problems(trace) == []


def test_virtual_peers_smallest_groups_first_and_bounded(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 64, tmp_path, now_s=clock.now_s)
    world = Group("world", list(range(64)), real=(0, 32), is_world=True)
    dp = Group("dp", list(range(0, 64, 4)), real=(0, 32))
    tp = Group("tp", [0, 1, 2, 3])
    for g in (world, dp, tp):  # issue order is not the rule: group size is
        issue(tl, clock, g, cost_s=1e-4)
        clock.t += 1e-3
    issue(tl, clock, world, kind=OpKind.SEND, peer=40, size=8)
    trace = tl.to_dict()
    other = trace["otherData"]
    # the p2p peer (a pair), tp 1-3, then dp's virtual members (real rank 32 is not drawn) up to 16
    assert other["virtual_peers"] == [40, 1, 2, 3, *range(4, 32, 4), 36, *range(44, 60, 4)]
    assert len(other["virtual_peers"]) == MAX_PEERS
    assert other["virtual_peers_left_out"] == 62 - MAX_PEERS  # 64 ranks less the 2 real ones
    arrivals = events(trace, "arrival", "i")
    assert len(arrivals) == 16 + 13 + 3 + 1  # world: all drawn; dp: 13 of its 14 virtual; tp: 3; the send: 1
    assert chrome_trace_problems(trace) == []
    tl.max_peer_instants = 10
    trace = tl.to_dict()
    assert len(events(trace, "arrival", "i")) == 10 and trace["otherData"]["dropped"]["peer_instants"] == 23


def test_moved_arrivals_failures_and_fault_blame(tmp_path: Path) -> None:
    clock = Clock()
    tl = Timeline(0, 8, tmp_path, now_s=clock.now_s, time_name="emulated")
    tp = Group("tp", [0, 1, 2, 3])
    issue(tl, clock, tp, late_s=0.003, cost_s=0.001, seq=1)
    issue(tl, clock, tp, late_s=0.002, cost_s=0.001, seq=2)
    failed = OpEvent(OpKind.ALL_REDUCE, tp, 3, 4, None, (), clock.t, clock.t, 0.0, 0.0)
    failed.failure = Failure()
    failed.failure.raise_at_s = clock.t + 0.5
    tl.on_issued(failed, Work(0.0))

    class Faults:  # LiveFaults.waits: (from s, waited s, on rank, op, group, seq, step)
        waits = [(100.0, 0.003, 2, "all_reduce", "tp", 1, 0)]

    tl.faults = Faults()
    trace = tl.to_dict()
    first, second, third = (e["args"] for e in events(trace, "communication"))
    assert (first["wait_s"], first["waited_on"], first["waited_on_source"]) == (0.003, [2], "live fault (straggler)")
    assert second["waited_on"] == [1, 2, 3] and second["waited_on_source"].startswith("replayed arrival")
    assert third["failed"] is True and third["completion_s"] == 0.5
    arrivals = events(trace, "arrival", "i")
    assert {e["ts"] for e in arrivals if e["args"]["seq"] == 1} == {3000.0}
    assert trace["otherData"]["arrivals"].startswith("moved: 2 of 3 ops")
    assert trace["otherData"]["time_name"] == "emulated"


def test_spans_per_emulated_stream(tmp_path: Path) -> None:
    clock = Clock(5.0)
    tl = Timeline(3, 8, tmp_path, now_s=clock.now_s, time_name="emulated")
    tl.on_mark(1, 5.0)
    tl.add_span("cuda stream 7", "gemm", 5.0, 5.002, {"flops": 10})
    tl.add_span("cuda stream 7", "gelu", 5.002, 5.0025)
    tl.add_span("cuda stream 13", "nccl all_reduce", 5.001, 5.004, category="communication")
    trace = tl.to_dict()
    assert rows(trace, 3) == {0: "host", 1: "communication", 2: "wait", 3: "cuda stream 7", 4: "cuda stream 13"}
    compute = events(trace, "compute")
    assert [(e["name"], e["ts"], e["dur"], e["tid"], e.get("args")) for e in compute] == [
        ("gemm", 0.0, 2000.0, 3, {"flops": 10}), ("gelu", 2000.0, 500.0, 3, None)]
    assert [e["tid"] for e in events(trace, "communication")] == [4]
    assert [e["dur"] for e in events(trace, "iteration")] == [4000.0]  # open: to the last span's end
    assert chrome_trace_problems(trace) == [] and tl.summary()["spans"] == 3


def test_bad_arguments_and_format_rules(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_iterations"):
        Timeline(0, 2, tmp_path, now_s=Clock().now_s, max_iterations=0)
    with pytest.raises(ValueError, match="emulated"):
        Timeline(0, 2, tmp_path, now_s=Clock().now_s, time_name="virtual")
    bad = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "ts": 0, "pid": 0, "tid": 0, "args": {"name": "host"}},
        {"ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0},
        {"ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 0},  # overlaps the first one's end
        {"ph": "i", "s": "x", "ts": 1, "pid": 0, "tid": 1},
        {"ph": "Q", "ts": 1, "pid": 0, "tid": 0},
    ]}
    problems = chrome_trace_problems(bad)
    assert problems == ["event 3: instant scope 'x' is not g, p or t", "event 4: unknown ph 'Q'",
                        "process pid=0 has events but no process_name",
                        "event 2: X on pid=0 tid=0 overlaps the enclosing span's end",
                        "thread pid=0 tid=1 has events but no thread_name"]
    assert doctest.testmod(timeline_mod).failed == 0
