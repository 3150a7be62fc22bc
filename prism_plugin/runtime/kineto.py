"""A Kineto-format trace of one virtual-GPU rank: the emulated host, CUDA streams, kernels and NCCL collectives.

In virtual-GPU mode with virtual time (`prism_plugin.device.clock.VirtualTime`) the session builds a
`KinetoTrace` when ``PRISM_KINETO=<dir>`` is set and writes ``<dir>/rank<R>.kineto.json`` at deactivate, in the
format ``torch.profiler`` exports and Holistic Trace Analysis loads (``TraceAnalysis(trace_dir=<dir>)``; keep the
directory for these traces only: HTA reads every trace file in it, so not ``PRISM_TIMELINE``'s):

- top level: ``distributedInfo`` (rank, world size, backend; first, where HTA's rank scan looks),
  ``schemaVersion``, ``deviceProperties`` (the virtual GPUs), ``baseTimeNanoseconds`` 0, ``traceEvents``, and a
  ``prism`` entry saying the clock is emulated;
- per kernel (an ATen op the kernel model times; the clock's `record` callback, chained after any existing one):
  a host ``cpu_op`` named after the op (``aten::mm``) over its launch, inside it a ``cuda_runtime``
  ``cudaLaunchKernel`` with a ``correlation`` id, and a ``kernel`` event with the same name and correlation on
  GPU ``device`` / ``stream`` (program streams: the virtual stream id + 7, so the default stream is 7 as in
  real traces), joined by an ``ac2g`` flow;
- per communication op (an op observer, after the clock has placed it): ``c10d::<op>`` and
  ``record_param_comms`` (the real backend's metadata, `prism_plugin.runtime.profiler.comm_args`) over its launch,
  a ``cudaLaunchKernel``, and the kernel ``ncclDevKernel_<Kind>...`` on the group's communication stream (ids
  from 1000) from the op's emulated start to its completion, so HTA counts it as communication;
- per marked iteration: a host ``ProfilerStep#<i>`` from the host time of its mark to the next one's (the open
  iteration: to its last host event), from which HTA takes iterations (it drops the last one's kernels).

Times are emulated microseconds from the virtual clock's origin, written to the nanosecond (3 decimals); HTA
rounds ns-resolution events to whole microseconds unless ``HTA_DISABLE_NS_ROUNDING=1``.

Limitations: kernel names are the ATen op names, not the CUDA kernels a real GPU would run; one kernel per op
(a real op may launch several); the host's own Python time is not modelled (only launches), so host spans are
launch-length; copies are kernels like any other op (no ``Memcpy`` events); bounded at `max_events` kernels
plus ops (the rest counted in ``prism.dropped``). Non-goals: a CPU run's profiler trace
(`prism_plugin.runtime.profiler` completes those).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpEvent, OpWork
from prism_plugin.runtime.profiler import C10D_OPS, comm_args, nccl_kernel_name
from prism_plugin.runtime.timeline import trace_meta

__all__ = ["COMM_STREAM_BASE", "DEFAULT_STREAM", "KinetoTrace"]

DEFAULT_STREAM = 7
"""The Kineto stream id of a device's default stream (a virtual stream's id + 7)."""
COMM_STREAM_BASE = 1000
"""The first communication stream's id; one per process group, in order of first use."""
_ROW = re.compile(r"cuda:(\d+) stream (\d+)")
_CORRELATION_BASE = 1 << 24
"""Correlation / external ids start above it (real traces' are large too; HTA 0.5 with pandas >= 3 fails on
ids small enough that its index column is stored as int8)."""


def _op_name(name: str) -> str:
    """``aten.mm.default`` -> ``aten::mm`` (the profiler's name of an ATen op)."""
    if name.startswith("aten.") and name.count(".") >= 1:
        parts = name.split(".")
        return f"aten::{parts[1]}"
    return name


class KinetoTrace:
    """The Kineto trace of one virtual-GPU rank: a kernel recorder for the virtual clock and an op observer."""

    def __init__(self, rank: int, world_size: int, out_dir: Path, clock: Any, *, backend: str = "nccl",
                 gpu_name: str = "virtual GPU", gpu_memory_bytes: int = 0, num_devices: int = 1,
                 max_events: int = 1_000_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events={max_events!r}: keep at least one event")
        self.rank = rank
        self.world_size = world_size
        self.path = Path(out_dir) / f"rank{rank}.kineto.json"
        self.clock = clock
        """The `VirtualTime` whose kernels and host this trace reads."""
        self.backend = backend
        self.gpu_name = gpu_name
        self.gpu_memory_bytes = gpu_memory_bytes
        self.num_devices = num_devices
        self.max_events = max_events
        self.host_pid = os.getpid()
        self.host_tid = self.host_pid
        self.kernels: list[tuple[str, int, int, float, float, float, float]] = []
        """(op name, device, stream, launch_s, start_s, end_s) per compute kernel."""
        self.ops: list[tuple[OpEvent, dict[str, Any], int, float, float, float, float]] = []
        """(event, metadata, comm stream, launch_s, start_s, end_s) per communication op."""
        self.marks: list[tuple[int, float]] = []
        """(iteration, host_s) at each mark."""
        self.comm_streams: dict[str, int] = {}
        self.dropped = 0
        self._previous: Any = None

    # -- inputs ---------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Chain `record_kernel` onto the clock's ``record`` callback (after the one already set, if any)."""
        previous = self._previous = self.clock.record

        if previous is None:
            self.clock.record = self.record_kernel
            return

        def record(row: str, name: str, start_s: float, end_s: float) -> None:
            previous(row, name, start_s, end_s)
            self.record_kernel(row, name, start_s, end_s)

        self.clock.record = record

    def record_kernel(self, row: str, name: str, start_s: float, end_s: float) -> None:
        """A kernel on a program stream (the clock's callback); communication rows come from `on_issued`."""
        m = _ROW.fullmatch(row)
        if m is None:
            return
        if len(self.kernels) + len(self.ops) >= self.max_events:
            self.dropped += 1
            return
        cost_s = self.clock.last_launch_s  # the clock has just advanced the host by it
        self.kernels.append((_op_name(name), int(m[1]), int(m[2]) + DEFAULT_STREAM, self.clock.host_s - cost_s, cost_s,
                             start_s, end_s))

    def on_op(self, event: OpEvent) -> None:
        """Nothing: the clock (the last observer) places the op after this; `on_issued` reads it."""

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        if len(self.kernels) + len(self.ops) >= self.max_events:
            self.dropped += 1
            return
        stream = self.comm_streams.setdefault(event.group.name, COMM_STREAM_BASE + len(self.comm_streams))
        cost_s = self.clock.last_launch_s
        end_s = event.completion_s if event.failure is None else event.failure.raise_at_s
        self.ops.append((event, comm_args(event, self.rank), stream, self.clock.host_s - cost_s, cost_s,
                         event.arrival_s, max(end_s, event.arrival_s)))

    def on_mark(self, iteration: int) -> None:
        """An iteration starts now on the host."""
        self.marks.append((iteration, self.clock.host_s))

    # -- output ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The trace as Kineto's JSON object (module docstring)."""
        pid, tid = self.host_pid, self.host_tid
        events: list[dict[str, Any]] = []
        host_end_us = 0.0

        def us(t: float) -> float:
            return round(t * 1e6, 3)

        def launch(name: str, launch_s: float, cost_s: float, ext: int, args: dict[str, Any] | None = None,
                   outer: str | None = None) -> float:
            t, launch_us = us(launch_s), 1e6 * cost_s
            if outer is not None:
                events.append({"ph": "X", "cat": "cpu_op", "name": outer, "pid": pid, "tid": tid, "ts": t,
                               "dur": round(launch_us, 3), "args": {"External id": ext}})
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": pid, "tid": tid, "ts": t,
                           "dur": round(launch_us, 3), "args": {"External id": ext, **(args or {})}})
            rt = t  # inside its op (HTA nests by interval), and no later than the kernel, which may start at once
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                           "ts": rt, "dur": round(launch_us / 2, 3),
                           "args": {"correlation": ext, "External id": ext, "cbid": 211}})
            events.append({"ph": "s", "id": ext, "pid": pid, "tid": tid, "ts": rt, "cat": "ac2g", "name": "ac2g"})
            return t + launch_us

        def kernel(name: str, device: int, stream: int, start_s: float, end_s: float, ext: int,
                   args: dict[str, Any] | None = None) -> None:
            ts = us(start_s)
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": stream, "ts": ts,
                           "dur": round(us(end_s) - ts, 3),
                           "args": {"device": device, "stream": stream, "correlation": ext, "External id": ext,
                                    **(args or {})}})
            events.append({"ph": "f", "id": ext, "pid": device, "tid": stream, "ts": ts, "cat": "ac2g",
                           "name": "ac2g", "bp": "e"})

        ext = _CORRELATION_BASE
        streams: set[tuple[int, int]] = set()
        for name, device, stream, launch_s, cost_s, start_s, end_s in self.kernels:
            ext += 1
            host_end_us = max(host_end_us, launch(name, launch_s, cost_s, ext))
            kernel(name, device, stream, start_s, end_s, ext)
            streams.add((device, stream))
        for event, args, stream, launch_s, cost_s, start_s, end_s in self.ops:
            ext += 1
            host_end_us = max(host_end_us, launch("record_param_comms", launch_s, cost_s, ext, args,
                                                  outer=C10D_OPS[event.kind]))
            dtype = args["dtype"]
            kernel(nccl_kernel_name(event.kind, dtype), 0, stream, start_s, end_s, ext, args)
        # iterations: ProfilerStep#i from its mark's host time to the next mark's (the open one: its last event)
        marks = sorted(self.marks, key=lambda m: m[1])
        for i, (iteration, host_s) in enumerate(marks):
            start = us(host_s)
            stop = us(marks[i + 1][1]) if i + 1 < len(marks) else host_end_us
            if stop <= start:
                continue
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{iteration}", "pid": pid,
                           "tid": tid, "ts": start, "dur": round(stop - start, 3), "args": {}})
        meta = [trace_meta("process_name", pid, 0, name="python"), trace_meta("process_labels", pid, 0, labels="CPU"),
                trace_meta("thread_name", pid, tid, name="thread (emulated host)")]
        for d in sorted({d for d, _ in streams} | ({0} if self.ops else set())):
            meta += [trace_meta("process_name", d, 0, name="python"),
                     trace_meta("process_labels", d, 0, labels=f"GPU {d}")]
        meta += [trace_meta("thread_name", d, s, name=f"stream {s}") for d, s in sorted(streams)]
        meta += [trace_meta("thread_name", 0, s, name=f"stream {s} (communication, group {group})")
                 for group, s in self.comm_streams.items()]
        return {
            "distributedInfo": {"backend": self.backend, "rank": self.rank, "world_size": self.world_size},
            "schemaVersion": 1,
            "deviceProperties": [{"id": d, "name": self.gpu_name, "totalGlobalMem": self.gpu_memory_bytes}
                                 for d in range(self.num_devices)],
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 0,
            "prism": {"clock": "emulated", "time_unit": "emulated us from the virtual clock's origin",
                      "kernels": len(self.kernels), "comm_ops": len(self.ops), "dropped": self.dropped,
                      "note": "kernel names are the ATen ops the kernel model timed; NCCL kernels are the "
                              "emulated collectives with their modelled durations"},
            "traceEvents": meta + events,
            "traceName": str(self.path),
        }

    def write(self) -> Path:
        """Write ``<dir>/rank<R>.kineto.json`` (the directory is created)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.to_dict()))
        return self.path

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "kernels": len(self.kernels), "comm_ops": len(self.ops),
                "dropped": self.dropped}
