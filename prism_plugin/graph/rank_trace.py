"""What one real rank did, iteration by iteration: the raw trace that trace capture writes (DESIGN.md 6).

A `RankTrace` holds, for each traced iteration, every communication op the rank issued with its wall-clock
times as offsets from the iteration start (the session's `EmulationClock` anchor): when the call was made
(the rank's *arrival*), when it returned, when the program waited on it and when that wait returned.
Compute is implicit: it is the time between communication calls (`prism_plugin.graph.convert` turns a raw
trace into a `ClassTrace` of compute spans, ops and waits). Groups are stored once, as global ranks.

JSON file ``rank<R>.trace.json`` (``save`` / ``load``), version 1::

    {"format": "prism-rank-trace", "version": 1, "rank": 5, "world_size": 8192,
     "groups": [null, [4, 5, 6, 7], ...],           # null: the default (world) group
     "iterations": [{"index": 3, "start_s": 1234.5678, "duration_us": 81234.5, "ops": [OP, ...]}, ...],
     "metadata": {"profile": "local-cpu-gloo", ...}}

An OP is a list (compact: a trace may hold 10^5 ops)::

    [op, group, seq, size_bytes, peer, issue_us, return_us, wait_us, end_us]

    op          OpKind value ("all_reduce", "send", ...)
    group       index into "groups"
    seq         the op's sequence number on its live group (1, 2, ... since the group was created)
    size_bytes  bytes as the cost model counts them
    peer        send/recv: the peer's global rank; else -1
    issue_us    call entry (the rank's arrival at the op)
    return_us   call return
    wait_us     entry of the first wait() on the issuing thread in this iteration; -1: not waited in it
    end_us      return of that wait(); -1 likewise

Limitations: one issuing thread (waits from other threads, e.g. a future's helper thread, are not recorded,
so the op counts as waited at the iteration end); an iteration is what lies between two marks, the part
before the first mark and after the last one is not kept.

Pure: stdlib and prism_plugin.config.kinds only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from prism_plugin.config.errors import positive_int, rank_in_range
from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.errors import GraphError

__all__ = ["RANK_TRACE_FORMAT", "RANK_TRACE_VERSION", "TIME_DECIMALS", "RankTrace", "TracedIteration", "TracedOp",
           "load_rank_traces"]

RANK_TRACE_FORMAT = "prism-rank-trace"
RANK_TRACE_VERSION = 1
TIME_DECIMALS = 6
"""Decimals of the ops' times (us) written: to the picosecond. A fast-forwarded run's periods repeat in its trace to
that, so the graph built from it, and a hybrid run's replayed arrivals, repeat them within the fast-forward's proof
tolerance (`prism_plugin.device.fast_forward.TOLERANCE_S`, 1e-10 s); at the nanosecond they would not."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedOp:
    """One communication op of one iteration, times in microseconds from the iteration start."""

    op: OpKind
    group: int
    """Index into `RankTrace.groups`."""
    seq: int
    """Sequence number on the live group (informational: graphs number ops per group role)."""
    size_bytes: int
    peer: int = -1
    """SEND/RECV: the peer's global rank."""
    issue_us: float
    return_us: float
    wait_us: float = -1.0
    """First wait() entry on the issuing thread within the iteration; -1 when not waited in it."""
    end_us: float = -1.0
    """Return of that wait(); -1 when not waited in the iteration."""

    @property
    def waited(self) -> bool:
        return self.wait_us >= 0.0

    @property
    def blocked_us(self) -> float:
        """Time the rank was held by this op: issue -> wait return for an op waited at once, else the wait."""
        return 0.0 if not self.waited else self.end_us - self.wait_us

    def to_list(self) -> list[Any]:
        return [self.op.value, self.group, self.seq, self.size_bytes, self.peer,
                round(self.issue_us, TIME_DECIMALS), round(self.return_us, TIME_DECIMALS),
                round(self.wait_us, TIME_DECIMALS), round(self.end_us, TIME_DECIMALS)]

    @classmethod
    def from_list(cls, row: Sequence[Any]) -> TracedOp:
        if len(row) != 9:
            raise GraphError(f"traced op {list(row)!r} must have 9 columns (see prism_plugin.graph.rank_trace)")
        op, group, seq, size, peer, issue, ret, wait, end = row
        return cls(op=OpKind(op), group=int(group), seq=int(seq), size_bytes=int(size), peer=int(peer),
                   issue_us=float(issue), return_us=float(ret), wait_us=float(wait), end_us=float(end))


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedIteration:
    """The ops of one iteration (between two iteration marks), in issue order."""

    index: int
    """The emulation clock's iteration number at its start."""
    duration_us: float
    """Wall time from this iteration's mark to the next one."""
    ops: tuple[TracedOp, ...]
    start_s: float = 0.0
    """The mark's host clock reading (``time.perf_counter``): compares iterations of ranks on one host."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not (math.isfinite(self.duration_us) and self.duration_us >= 0):
            raise GraphError(f"iteration {self.index}: duration_us={self.duration_us!r} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTrace:
    """Every traced iteration of one real rank."""

    rank: int
    world_size: int
    groups: tuple[tuple[int, ...] | None, ...]
    """Global ranks of each group the trace refers to; None for the default (world) group."""
    iterations: tuple[TracedIteration, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(None if g is None else tuple(g) for g in self.groups))
        object.__setattr__(self, "iterations", tuple(self.iterations))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        positive_int("world_size", self.world_size, hint="the traced job's rank count", error=GraphError)
        rank_in_range(self.rank, self.world_size, error=GraphError)
        for it in self.iterations:
            for op in it.ops:
                if not 0 <= op.group < len(self.groups):
                    raise GraphError(f"iteration {it.index}: op {op.op.value} names unknown group {op.group}")

    def group_ranks(self, group: int) -> tuple[int, ...]:
        """Global ranks of group `group` (the world group expanded)."""
        ranks = self.groups[group]
        return tuple(range(self.world_size)) if ranks is None else ranks

    def step_times_us(self) -> list[float]:
        return [it.duration_us for it in self.iterations]

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RANK_TRACE_FORMAT,
            "version": RANK_TRACE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "groups": [None if g is None else list(g) for g in self.groups],
            "iterations": [
                {"index": it.index, "start_s": it.start_s, "duration_us": round(it.duration_us, TIME_DECIMALS),
                 "ops": [op.to_list() for op in it.ops]}
                for it in self.iterations
            ],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankTrace:
        if data.get("format") != RANK_TRACE_FORMAT:
            raise GraphError(f"not a rank trace: 'format' is {data.get('format')!r}, not {RANK_TRACE_FORMAT!r}")
        if data.get("version") != RANK_TRACE_VERSION:
            raise GraphError(
                f"rank trace version {data.get('version')!r} is not supported (this is {RANK_TRACE_VERSION})"
            )
        try:
            return cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                groups=tuple(None if g is None else tuple(g) for g in data["groups"]),
                iterations=tuple(
                    TracedIteration(index=int(it["index"]), duration_us=float(it["duration_us"]),
                                    ops=tuple(TracedOp.from_list(row) for row in it["ops"]),
                                    start_s=float(it.get("start_s", 0.0)))
                    for it in data["iterations"]
                ),
                metadata=data.get("metadata", {}),
            )
        except KeyError as exc:
            raise GraphError(f"rank trace is missing field {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> RankTrace:
        """Read a trace file; every refusal is a `GraphError` naming the file ("rank trace file ...: ...")."""
        where = f"rank trace file {path}"
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise GraphError(f"{where}: cannot be read ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise GraphError(f"{where}: not JSON ({exc}); `prism run --trace DIR` writes these files") from None
        if not isinstance(data, Mapping):
            raise GraphError(f"{where}: not a rank trace: a JSON object is expected, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise GraphError(f"{where}: {exc}") from None


def load_rank_traces(paths: Sequence[str | Path]) -> list[RankTrace]:
    """Every ``*.trace.json`` under `paths` (files or directories, searched recursively), by rank.

    Raises GraphError when nothing is found or two files hold the same rank.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.trace.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise GraphError(f"trace path {str(p)!r} does not exist")
    if not files:
        raise GraphError(f"no *.trace.json under {[str(p) for p in paths]}: run `prism run --trace DIR` first")
    traces: dict[int, tuple[Path, RankTrace]] = {}
    for f in files:
        t = RankTrace.load(f)
        if t.rank in traces:
            raise GraphError(f"two traces of rank {t.rank}: {traces[t.rank][0]} and {f}; pass one per rank")
        traces[t.rank] = (f, t)
    return [traces[r][1] for r in sorted(traces)]
