"""Chrome trace / Perfetto export of a replay: one process per rank, one thread per stream.

Open the file in https://ui.perfetto.dev or chrome://tracing. Per rank (pid = global rank):

- "compute" (tid 0): compute spans, and WAIT nodes that held the rank (cat "wait");
- "comm <role>" / "p2p <axis>": each communication op from when it started to when it ended (cat "comm");
  a blocking op is preceded by a "wait for peers" span from the rank's arrival until the last member
  arrived (cat "bubble", the same time `RankBreakdown.bubble_us` counts) when that is not empty.

Every "X" event carries ``args`` with the node index, and for communication ops the bytes and sequence
number. Times are microseconds from the iteration start (the Chrome trace unit). Ranks replayed as one
actor get identical rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prism_plugin.graph.result import ReplayResult
from prism_plugin.graph.schema import NodeKind

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(result: ReplayResult, ranks: Iterable[int]) -> dict[str, Any]:
    """The Chrome trace JSON object (``{"traceEvents": [...], ...}``) of `ranks` from `result`."""
    events: list[dict[str, Any]] = []
    for rank in ranks:
        actor = result.space.actor_of(rank)
        tids: dict[str, int] = {"compute": 0}
        events.append(
            {"ph": "M", "pid": rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "pid": rank, "tid": 0, "name": "process_labels", "args": {"labels": actor.class_name}}
        )
        spans = result.op_spans(rank)
        for span in spans:
            node = span.node
            stream = node.stream
            if stream not in tids:
                tids[stream] = len(tids)
            tid = tids[stream]
            args: dict[str, Any] = {"node": span.index}
            if node.kind.is_comm:
                args.update(size_bytes=node.size_bytes, seq=node.seq, issue_us=span.issue_us)
                if span.ready_us > span.issue_us and not node.is_async:  # the rank sat idle
                    events.append(
                        _x(rank, tid, "wait for peers", "bubble", span.issue_us, span.ready_us, args)
                    )
                events.append(_x(rank, tid, node.label(), "comm", span.start_us, span.end_us, args))
            elif node.kind is NodeKind.WAIT:
                if span.end_us > span.issue_us:
                    events.append(_x(rank, tid, node.label(), "wait", span.issue_us, span.end_us, args))
            elif span.end_us > span.start_us:
                events.append(
                    _x(rank, tid, node.name or "compute", "compute", span.start_us, span.end_us, args)
                )
        for stream, tid in tids.items():
            events.append(
                {"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": stream}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": "prism_plugin replay"}}


def _x(pid: int, tid: int, name: str, cat: str, begin_us: float, end_us: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": begin_us,
            "dur": end_us - begin_us, "args": args}  # fmt: skip


def write_chrome_trace(result: ReplayResult, path: str | Path, ranks: Iterable[int]) -> Path:
    """Write `chrome_trace(result, ranks)` to `path`; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(result, ranks)), encoding="utf-8")
    return path
