"""Emulated collectives inside the user's ``torch.profiler.profile(...)``, named as the real backend names them.

A real NCCL collective shows up in a Kineto trace as host ranges ``c10d::allreduce_`` (the dispatcher op) and
``nccl:all_reduce``, a ``record_param_comms`` range carrying the collective's metadata ("Collective name",
"Process Group Name", "Process Group Description", "Process Group Ranks", "Group size", "In msg nelems",
"Out msg nelems", "dtype", "Rank", "Seq"; the names of torch's ``saveNcclMetaTyped``), a ``cudaLaunchKernel``
and a GPU kernel ``ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)`` on the communicator's stream (which the
exporter gives the same metadata). gloo shows ``c10d::allreduce_`` and ``gloo:all_reduce``. The prism group is a
Python process group, so torch's dispatcher records none of these; `ProfilerRanges`, an op observer, does:

1. **live** (whenever the profiler is enabled, ``torch._C._autograd._profiler_enabled()``): each op opens
   ``c10d::<op>`` and ``<backend>:<kind>`` ranges in `on_op` and closes them in `on_issued` (the op's enqueue,
   as the real backend's ranges cover it). The metadata rides on the inner range as keyword inputs, which the
   profiler writes as args only with ``record_shapes=True``. A range named ``record_param_comms`` cannot be
   opened from Python: the profiler then reads C++ debug info that does not exist and crashes the process;
2. **at export**: while the session is active, ``profile.export_chrome_trace(path)`` (and so
   ``tensorboard_trace_handler``) is followed by `augment_trace`, which adds, per emulated op in the trace, the
   metadata on the ``<backend>:<kind>`` range, a ``record_param_comms`` range with it, and (``kernels=True``,
   the default) a ``cudaLaunchKernel`` plus an ``ncclDevKernel_<Kind>...`` GPU kernel on a communication stream
   with the op's emulated duration, linked by correlation id and an ``ac2g`` flow. So HTA's kernel, temporal and
   communication breakdowns see each collective as communication, even in a CPU-only profile of a gloo
   emulation (where the real run would have had no GPU kernel: said in the trace's ``prism`` entry).

Where the kernel sits: from the op's emulated start (its issue plus ``arrival_s - issue_s``, the wait for the
other members) for ``cost_s``, placed on the profiler's clock through the range's start: with the wall clock
exactly where the op's wait() saw it complete, so a kernel may begin a few microseconds before its range (the
real exchange's enqueue ran between the issue and the observers); with an emulated clock, from the range's
start. A trace exported after `deactivate` can still be augmented by `augment_trace` with the observer's
`records`.

Limitations: a send's dtype is not known to the op seam ("Byte", nelems = bytes); "In msg nelems" of a gather
is the received elements over the group size (even splits); "In/Out split size" are empty; the ranges are
opened on the issuing thread (gloo's own ranges are on its worker thread). Matching a trace's ranges to the
records is by name and nearest host time (within `MATCH_TOLERANCE_NS`); a range without a record is left as
it is. Non-goals: the program's own compute kernels in a CPU profile (the virtual-GPU Kineto trace,
`prism_plugin.runtime.kineto`, has them).
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prism_plugin.comm.context import OpEvent, OpGroup, OpWork
from prism_plugin.config.kinds import OpKind

__all__ = ["C10D_OPS", "COLLECTIVE_NAMES", "CommRecord", "MATCH_TOLERANCE_NS", "ProfilerRanges", "augment_trace",
           "comm_args", "nccl_kernel_name"]

COLLECTIVE_NAMES: dict[OpKind, str] = {
    OpKind.ALL_REDUCE: "allreduce", OpKind.BROADCAST: "broadcast", OpKind.REDUCE: "reduce",
    OpKind.ALL_GATHER: "allgather", OpKind.REDUCE_SCATTER: "reduce_scatter", OpKind.ALL_TO_ALL: "all_to_all",
    OpKind.GATHER: "gather", OpKind.SCATTER: "scatter", OpKind.BARRIER: "barrier", OpKind.SEND: "send",
    OpKind.RECV: "recv",
}
"""The "Collective name" torch's process groups record for each op (``RECORD_PARAM_COMMS``)."""

C10D_OPS: dict[OpKind, str] = {
    OpKind.ALL_REDUCE: "c10d::allreduce_", OpKind.BROADCAST: "c10d::broadcast_", OpKind.REDUCE: "c10d::reduce_",
    OpKind.ALL_GATHER: "c10d::allgather_", OpKind.REDUCE_SCATTER: "c10d::reduce_scatter_",
    OpKind.ALL_TO_ALL: "c10d::alltoall_", OpKind.GATHER: "c10d::gather_", OpKind.SCATTER: "c10d::scatter_",
    OpKind.BARRIER: "c10d::barrier", OpKind.SEND: "c10d::send", OpKind.RECV: "c10d::recv_",
}
"""The dispatcher op of each kind: the outer host range of a real backend's collective."""
_NCCL_FUNCS: dict[OpKind, tuple[str, bool]] = {  # NCCL's function in the kernel name, whether it reduces
    OpKind.ALL_REDUCE: ("AllReduce", True), OpKind.BROADCAST: ("Broadcast", False), OpKind.REDUCE: ("Reduce", True),
    OpKind.ALL_GATHER: ("AllGather", False), OpKind.REDUCE_SCATTER: ("ReduceScatter", True),
    OpKind.ALL_TO_ALL: ("SendRecv", False), OpKind.GATHER: ("SendRecv", False), OpKind.SCATTER: ("SendRecv", False),
    OpKind.BARRIER: ("AllReduce", True), OpKind.SEND: ("SendRecv", False), OpKind.RECV: ("SendRecv", False),
}
_NCCL_TYPES = {"Float": "f32", "Half": "f16", "BFloat16": "bf16", "Double": "f64", "Long": "i64", "Int": "i32",
               "Byte": "u8", "Char": "i8", "Bool": "u8", "Float8_e4m3fn": "f8e4m3", "Float8_e5m2": "f8e5m2"}
_KERNEL_SIGNATURE = "(ncclDevComm*, unsigned long, ncclWork*)"
_TRUNCATE = 30  # torch's kTruncateLength for rank lists

MATCH_TOLERANCE_NS = 5_000_000
"""How far (ns) a trace's range may start from a record's host time and still be that op (the profiler's clock
and ``time.time_ns`` agree to microseconds; ops of one name are normally far more than 5 ms apart or in order)."""


def nccl_kernel_name(kind: OpKind, dtype: str) -> str:
    """The NCCL device kernel a collective runs, as Kineto names it.

    >>> nccl_kernel_name(OpKind.ALL_REDUCE, "Float")
    'ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)'
    >>> nccl_kernel_name(OpKind.SEND, "BFloat16")
    'ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)'
    """
    func, reduces = _NCCL_FUNCS[kind]
    if func == "SendRecv":
        return f"ncclDevKernel_SendRecv{_KERNEL_SIGNATURE}"
    suffix = f"_Sum_{_NCCL_TYPES.get(dtype, 'u8')}" if reduces else ""
    return f"ncclDevKernel_{func}{suffix}_RING_LL{_KERNEL_SIGNATURE}"


def _rank_list(ranks: Sequence[int]) -> str:
    """A rank list as torch writes it ("[0, 1, 2]"; over 30 ranks: the first 29, "...", the last)."""
    if len(ranks) > _TRUNCATE:
        return "[" + ", ".join(map(str, ranks[:_TRUNCATE - 1])) + f", ..., {ranks[-1]}]"
    return "[" + ", ".join(map(str, ranks)) + "]"


def _dtype_name(event: OpEvent) -> tuple[str, int]:
    """c10's name of the received dtype ("Float") and its element size; ("Byte", 1) with nothing received."""
    received = event.received
    if not received:
        return "Byte", 1
    t = received[0]
    return _C10_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")), t.element_size()


_C10_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
              torch.uint8: "Byte", torch.bool: "Bool"}


def comm_args(event: OpEvent, rank: int) -> dict[str, Any]:
    """The metadata a real backend's ``record_param_comms`` carries for `event`, issued by global `rank`."""
    vg: OpGroup = event.group
    ranks = list(vg.global_ranks)
    size = len(ranks)
    dtype, elem = _dtype_name(event)
    received = event.numel if event.received else event.size_bytes // elem
    kind = event.kind
    if kind in (OpKind.ALL_GATHER, OpKind.GATHER):
        in_nelems, out_nelems = received // max(size, 1), received
    elif kind is OpKind.REDUCE_SCATTER:
        in_nelems, out_nelems = received * size, received
    elif kind is OpKind.SEND:
        in_nelems, out_nelems = received, 0
    elif kind is OpKind.BARRIER:
        in_nelems = out_nelems = 0
    else:
        in_nelems = out_nelems = received
    group_rank = vg.group_rank_of(rank)
    args: dict[str, Any] = {
        "Collective name": COLLECTIVE_NAMES[kind], "dtype": dtype, "In msg nelems": in_nelems,
        "Out msg nelems": out_nelems, "In split size": "[]", "Out split size": "[]", "Group size": size,
        "Process Group Name": vg.name, "Process Group Description": vg.desc or "undefined",
        "Process Group Ranks": _rank_list(ranks), "Rank": -1 if group_rank is None else group_rank,
        "Seq": event.seq,
    }
    if size > 1 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:], strict=False)):
        args["Global rank start"], args["Global rank stride"] = ranks[0], ranks[1] - ranks[0]
    if event.peer is not None:
        args["Src Rank" if kind is OpKind.RECV else "Dst Rank"] = event.peer
    return args


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One op seen while the profiler was enabled: its names, metadata and times (host: unix ns; emulated: s)."""

    kind: OpKind
    range_name: str
    """The ``<backend>:<kind>`` range opened for it."""
    args: dict[str, Any]
    host_start_ns: int
    host_end_ns: int
    wait_s: float
    """When the op ran, from the range's start: ``arrival_s - issue_s`` (the wait for the other members) less
    the time from the issue to the range (wall clock only; may be negative)."""
    cost_s: float
    group_name: str


class ProfilerRanges:
    """An op observer: the real backend's ranges while the torch profiler runs, and the records `augment_trace`
    completes an exported trace with (module docstring)."""

    def __init__(self, rank: int, backend: str, *, wall_now_s: Callable[[], float] | None = None,
                 max_records: int = 1_000_000) -> None:
        self.rank = rank
        self.backend = backend
        self.wall_now_s = wall_now_s
        """The op clock when it is the wall clock (its ``issue_s`` are then host times): the kernel is placed
        from the op's issue, which precedes `on_op` by the real exchange's enqueue; None (an emulated clock):
        from the range's start."""
        self.max_records = max_records
        self.records: list[CommRecord] = []
        self.dropped = 0
        self._open = threading.local()
        self._undo: Callable[[], None] | None = None

    def idle(self) -> bool:
        """Whether it records nothing now (no torch.profiler runs): repeated work may be fast-forwarded."""
        return not torch._C._autograd._profiler_enabled()

    # -- the op seam -------------------------------------------------------------------------------
    def on_op(self, event: OpEvent) -> None:
        if not torch._C._autograd._profiler_enabled():
            return
        pending = getattr(self._open, "pending", None)
        if pending is not None:  # an op whose on_issued never came (it raised): close its ranges first
            self._close(pending)
        args = comm_args(event, self.rank)
        outer = torch._C._profiler._RecordFunctionFast(C10D_OPS[event.kind], list(event.received))
        inner = torch._C._profiler._RecordFunctionFast(f"{self.backend}:{event.kind.value}", [], args)
        outer.__enter__()
        inner.__enter__()
        lag_s = self.wall_now_s() - event.issue_s if self.wall_now_s is not None else 0.0
        self._open.pending = (event, outer, inner, args, time.time_ns(), max(lag_s, 0.0))

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pending = getattr(self._open, "pending", None)
        if pending is None or pending[0] is not event:
            return
        self._close(pending)
        _, _, _, args, start_ns, lag_s = pending
        if len(self.records) >= self.max_records:
            self.dropped += 1
            return
        self.records.append(CommRecord(event.kind, f"{self.backend}:{event.kind.value}", args, start_ns,
                                       time.time_ns(), max(event.arrival_s - event.issue_s, 0.0) - lag_s,
                                       max(event.cost_s, 0.0), event.group.name))

    def _close(self, pending: tuple) -> None:
        self._open.pending = None
        _, outer, inner = pending[:3]
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)

    # -- export --------------------------------------------------------------------------------------
    def install(self) -> None:
        """Follow every ``torch.profiler.profile.export_chrome_trace`` with `augment_trace` (undone by
        `uninstall`)."""
        if self._undo is not None:
            return
        from torch.profiler.profiler import _KinetoProfile

        original = _KinetoProfile.export_chrome_trace

        @functools.wraps(original)
        def export_chrome_trace(prof: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            out = original(prof, path, *args, **kwargs)
            self.augment(path)
            return out

        _KinetoProfile.export_chrome_trace = export_chrome_trace  # type: ignore[method-assign]

        def undo() -> None:
            _KinetoProfile.export_chrome_trace = original  # type: ignore[method-assign]

        self._undo = undo

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def augment(self, path: str | Path, *, kernels: bool = True) -> int:
        """`augment_trace` with this observer's records; returns the ops completed."""
        return augment_trace(path, self.records, kernels=kernels)

    def summary(self) -> dict[str, Any]:
        return {"ops_recorded": len(self.records), "dropped": self.dropped}


# -- augmenting an exported trace -----------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def _dump(path: Path, trace: dict[str, Any]) -> None:
    text = json.dumps(trace)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


def _us(ns: float) -> float:
    return round(ns / 1000.0, 3)


def augment_trace(path: str | Path, records: Sequence[CommRecord], *, kernels: bool = True,
                  device: int = 0) -> int:
    """Complete the exported Kineto/Chrome trace at `path` (``.json`` or ``.json.gz``, rewritten in place) with
    the emulated ops in `records` (module docstring); returns how many of its ranges were matched to a record.

    `kernels`: also add each op's ``cudaLaunchKernel`` and ``ncclDevKernel_*`` GPU kernel on GPU `device`
    (one stream per process group, ids from 1000), so HTA's breakdowns count the communication. Idempotent:
    a trace already augmented (``prism.augmented``) is left as it is.
    """
    path = Path(path)
    trace = _load(path)
    meta = trace.setdefault("prism", {})
    if meta.get("augmented"):
        return 0
    events: list[dict[str, Any]] = trace.get("traceEvents", [])
    base_ns = int(trace.get("baseTimeNanoseconds", 0))
    by_name: dict[str, list[CommRecord]] = {}
    for rec in records:
        by_name.setdefault(rec.range_name, []).append(rec)
    starts = {name: [r.host_start_ns for r in recs] for name, recs in by_name.items()}
    used: set[int] = set()
    corr = 1 << 24  # clear of the profiler's own correlation and external ids
    for e in events:
        for key in ("correlation", "External id"):
            value = e.get("args", {}).get(key)
            if isinstance(value, int) and value >= corr:
                corr = value + 1
    streams: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    matched = 0
    for e in events:
        recs = by_name.get(e.get("name", ""))
        if recs is None or e.get("ph") != "X":
            continue
        ts_ns = base_ns + float(e["ts"]) * 1000.0
        rec = _nearest(recs, starts[e["name"]], ts_ns, used)
        if rec is None:
            continue
        matched += 1
        e.setdefault("args", {}).update(rec.args)
        pid, tid, ts, dur = e["pid"], e["tid"], float(e["ts"]), float(e.get("dur", 0.0))
        added.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid, "ts": ts,
                      "dur": dur, "args": {"External id": corr, **rec.args}})
        if kernels:
            stream = streams.setdefault(rec.group_name, 1000 + len(streams))
            k_ts = ts + _us(rec.wait_s * 1e9)  # the emulated start (may precede the range: module docstring)
            rt = round(ts + dur / 4, 3)  # inside its range, before the kernel
            added.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                          "ts": rt, "dur": round(dur / 4, 3),
                          "args": {"correlation": corr, "External id": corr, "cbid": 211}})
            added.append({"ph": "X", "cat": "kernel", "name": nccl_kernel_name(rec.kind, rec.args["dtype"]),
                          "pid": device, "tid": stream, "ts": round(k_ts, 3), "dur": _us(rec.cost_s * 1e9),
                          "args": {"device": device, "stream": stream, "correlation": corr, "External id": corr,
                                   **rec.args}})
            added.append({"ph": "s", "id": corr, "pid": pid, "tid": tid, "ts": rt, "cat": "ac2g",
                          "name": "ac2g"})
            added.append({"ph": "f", "id": corr, "pid": device, "tid": stream, "ts": round(k_ts, 3), "cat": "ac2g",
                          "name": "ac2g", "bp": "e"})
        corr += 1
    if kernels and streams:
        added.append({"ph": "M", "name": "process_name", "pid": device, "tid": 0, "args": {"name": "python"}})
        added.append({"ph": "M", "name": "process_labels", "pid": device, "tid": 0,
                      "args": {"labels": f"GPU {device}"}})
        for group, stream in streams.items():
            added.append({"ph": "M", "name": "thread_name", "pid": device, "tid": stream,
                          "args": {"name": f"stream {stream} (prism: comm stream of group {group})"}})
    events.extend(added)
    trace["traceEvents"] = events
    meta.update({"augmented": True, "ops": matched, "kernels": kernels,
                 "note": "collectives emulated by prism: record_param_comms ranges and (kernels) NCCL kernels "
                         "with the emulated durations on per-group communication streams were added after export"})
    _dump(path, trace)
    return matched


def _nearest(recs: list[CommRecord], starts: list[int], ts_ns: float, used: set[int]) -> CommRecord | None:
    """The unused record of `recs` (sorted by start) whose host start is nearest `ts_ns`, within tolerance."""
    i = bisect.bisect_left(starts, ts_ns)
    best, best_d = None, float(MATCH_TOLERANCE_NS)
    for j in range(max(i - 8, 0), min(i + 8, len(recs))):
        d = abs(starts[j] - ts_ns)
        if id(recs[j]) not in used and d <= best_d:
            best, best_d = recs[j], d
    if best is not None:
        used.add(id(best))
    return best
