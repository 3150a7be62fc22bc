"""The metrics probe of recipe runs: per-step wall time, peak tensor memory and first loss of one rank.

    PRISM_PROBE_DIR=out python -m prism_plugin.recipes.probe -m package.module args...
    PRISM_PROBE_DIR=out python -m prism_plugin.recipes.probe script.py args...

It installs its hooks, then runs the unmodified program as ``__main__`` (it composes with the
launchers: ``prism run ... -m prism_plugin.recipes.probe -m prog``, or directly under the recipe
runner's plain launcher). At exit it writes ``<PRISM_PROBE_DIR>/rank<R>.metrics.json`` (schema
`METRICS_SCHEMA`) and ``rank<R>.trace.json`` (Chrome trace: one span per step, a memory counter, and
under faults the waits they caused).

What it measures, identically in real and emulated runs (so the two compare like with like):
- **Steps**: a step ends when the program's first optimizer (the first ``torch.optim.Optimizer``
  instance that ever steps) finishes ``step()``; a wrapped or chained optimizer that steps several
  inner optimizers still counts one step. Step i (i >= 1) lasts from the end of step i-1 (after the
  probe's own work there) to its own end; step 0 has no start mark (it holds the program's set-up),
  so its duration is not reported: recipes always discard at least one warm-up step.
- **Garbage collection**: Python's automatic cyclic collector is off and a full collection runs at
  each step end (outside the steps' durations). Otherwise tensors held by reference cycles are freed at
  moments that depend on how many Python objects each run happened to create, and the peak moves by
  those tensors from run to run; this way it is reproducible to the byte (a program whose cycles would
  have been collected mid-step shows a higher, but deterministic, peak). ``PRISM_PROBE_GC=auto`` keeps
  the collector as it is.
- **Realignment**: in a real run of several processes, a barrier on the default group follows the probe's
  own work at each step end (outside the steps' durations), so every rank starts the next step together;
  otherwise the rank whose collection ended first would wait for its peers in the next step's first
  collective, a wait the probe made (`Probe._realign`). Emulations need none: their peers are virtual.
- **Memory**: on CPU a `prism_plugin.device.memory.StorageTracker` started before the program, extended with
  a timeline and per-step peaks: bytes of live tensor storage created by ATen ops (see that module's
  limitations). On GPU: ``torch.cuda.max_memory_allocated`` of the current device, peak reset at
  each step end. ``peak_bytes`` is the maximum from the program's start to the end of its last step.
  Allocations gloo makes inside calls the emulator issues on its inner real groups (e.g. its
  ``_reduce_scatter_base`` clone of the input) are not counted: the target backend (NCCL) makes no
  such temporary, and a plain gloo run reaches gloo through the dispatcher, where the tracker does not
  look inside; nor are the copies a recording run keeps of every received payload. Both runs
  therefore count the program's own tensors.
- **Modelled communication**: under an emulation, the session's modelled communication time per
  step (`Session.modelled_comm_s` at each step end), so scale recipes can subtract it; with faults, the
  extra cost that degraded links and jitter add to it (``fault_extra_comm_s``, from
  `prism_plugin.runtime.live_faults.LiveFaults.extra_comm_s`; None without faults).
- **Faults** (``faults``; None without): the ops the session's faults delayed, each with when it waited,
  how long and on which rank (the blame), and the hangs / crashes met
  (`prism_plugin.runtime.live_faults.LiveFaults.timeline`), on the probe's clock; the Chrome trace shows them
  on a "fault waits" row.
- **Loss**: the value of the first one-element root with an implicit (or one-element) gradient handed
  to autograd's engine in each step (``loss.backward()``, ``torch.autograd.backward(loss)``,
  Megatron's ``custom_backward`` on the last stage): a rank whose backward starts from received
  gradients (an earlier pipeline stage) has no loss. ``first_loss`` is step 0's.

Env: ``PRISM_PROBE_DIR`` (required), ``PRISM_PROBE_LABEL`` (free text stored in the file, e.g.
``real`` / ``emulated``), ``PRISM_PROBE_STORE`` (a FileStore path: the program's
``init_process_group`` then rendezvouses through it instead of env:// ports; the recipe runner's plain
real launches use it), ``PRISM_PROBE_MEMORY=0`` (no tracker: timing only).

Limitations: one training thread (the tracker and the loss hook see the thread that runs the
program); the tracker's Python dispatch slows every op by a few microseconds in both runs alike;
a program without a torch optimizer reports no steps.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from prism_plugin.device.memory import StorageTracker
from prism_plugin.device.undo import Patches

__all__ = ["METRICS_SCHEMA", "Probe", "TimelineTracker", "main"]

METRICS_SCHEMA = "prism-recipe-metrics/1"
_MAX_TIMELINE = 4000  # points kept in the written timeline (peaks preserved, see _decimate)
_MAX_RAW = 2_000_000  # raw timeline points kept in memory before thinning
_GLOO_OPS = ("allreduce", "allreduce_coalesced", "_reduce_scatter_base", "reduce_scatter",
             "reduce_scatter_tensor_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
             "allgather_into_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base", "gather",
             "scatter", "send", "recv", "barrier")


class TimelineTracker(StorageTracker):
    """A `StorageTracker` that also keeps a (time, live bytes) timeline and a resettable window peak."""

    def __init__(self, origin_s: float) -> None:
        super().__init__()
        self.origin_s = origin_s
        self.window_peak_bytes = 0
        """Highest live bytes since the last `close_window()`."""
        self.times_s: list[float] = []
        self.values: list[int] = []
        self.suspended = 0
        """While > 0, new storages are not counted (frees still are): the emulator's own real groups."""

    def _note(self) -> None:
        if len(self.times_s) >= _MAX_RAW:  # keep memory bounded on long runs: halve, keeping peaks
            self.times_s, self.values = _decimate(self.times_s, self.values, _MAX_RAW // 2)
        self.times_s.append(time.perf_counter() - self.origin_s)
        self.values.append(self.current_bytes)

    def _register(self, t: torch.Tensor) -> None:
        if self.suspended:
            return
        before = self.current_bytes
        super()._register(t)
        if self.current_bytes != before:
            if self.current_bytes > self.window_peak_bytes:
                self.window_peak_bytes = self.current_bytes
            self._note()

    def _free(self, key: int) -> None:
        before = self.current_bytes
        super()._free(key)
        if self.current_bytes != before:
            self._note()

    def close_window(self) -> int:
        """The window's peak; the next window starts from the bytes alive now."""
        peak = self.window_peak_bytes
        self.window_peak_bytes = self.current_bytes
        return peak


def _decimate(times: list[float], values: list[int], limit: int) -> tuple[list[float], list[int]]:
    """At most ~`limit` points: each bin of consecutive points keeps its first and its highest point."""
    if len(times) <= limit:
        return list(times), list(values)
    width = max(1, (2 * len(times)) // limit)
    out_t: list[float] = []
    out_v: list[int] = []
    for start in range(0, len(times), width):
        hi = max(range(start, min(start + width, len(times))), key=values.__getitem__)
        for i in sorted({start, hi}):
            out_t.append(times[i])
            out_v.append(values[i])
    return out_t, out_v


class _EngineProxy:
    """Stands in for ``Variable._execution_engine``: notes scalar backward roots, forwards everything."""

    def __init__(self, engine: Any, probe: Probe) -> None:
        self._engine = engine
        self._probe = probe

    def run_backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        self._probe._on_backward(tensors, kwargs["grad_tensors"] if "grad_tensors" in kwargs else
                                 (args[0] if args else None))
        return self._engine.run_backward(tensors, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class Probe:
    """Hooks of one process (see the module docstring); `install()` then `write()` at exit."""

    def __init__(self, out_dir: Path, label: str = "", track_memory: bool = True,
                 collect_garbage: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.label = label
        self.origin_s = time.perf_counter()
        self.cuda = torch.cuda.is_available()
        self.tracker = TimelineTracker(self.origin_s) if track_memory and not self.cuda else None
        self.track_memory = track_memory
        self.step_ends_s: list[float] = []
        self.step_starts_s: list[float] = []
        """step_starts_s[i] is when step i+1 starts: the end of the probe's work after step i."""
        self.collect_garbage = collect_garbage
        self.step_peaks: list[int | None] = []
        self.step_live: list[int | None] = []
        self.losses: list[float | None] = []
        self.modelled_comm_s: list[float | None] = []
        """The emulation session's cumulative modelled communication at each step end (None: no session)."""
        self.fault_comm_s: list[float | None] = []
        self._faults: Any = None  # the session's LiveFaults, kept from a step end (the session may be gone at exit)
        """The extra communication cost of link and jitter faults, cumulative at each step end (None: no faults)."""
        self._progress: Path | None = None
        self._pending_loss: float | None = None
        self._first_optimizer: int | None = None
        self._rank: int | None = None
        self._world: int | None = None
        self._patches = Patches()

    # -- hooks -------------------------------------------------------------------------------------
    def install(self) -> Probe:
        from torch.autograd.variable import Variable
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._patches.callback(register_optimizer_step_post_hook(self._on_optimizer_step).remove)
        self._patches.setattr(Variable, "_execution_engine", _EngineProxy(Variable._execution_engine, self))
        store = os.environ.get("PRISM_PROBE_STORE")
        if store:
            self._rendezvous_through(store)
        if self.collect_garbage:
            gc.disable()
            self._patches.callback(gc.enable)
        if self.tracker is not None:
            self._suspend_in_gloo(self.tracker)
            self.tracker.start()
        return self

    def _suspend_in_gloo(self, tracker: TimelineTracker) -> None:
        """Do not count what gloo allocates inside its own calls made from Python (the emulator's inner real
        groups; a plain run reaches gloo through the dispatcher, where the tracker does not see inside), nor
        the copies a recording run's `Recorder` keeps of received payloads (emulator state)."""
        import torch.distributed as dist

        if dist.is_available() and hasattr(dist, "ProcessGroupGloo"):
            self._suspend_during(tracker, dist.ProcessGroupGloo, _GLOO_OPS)
        from prism_plugin.comm.recording import Recorder

        self._suspend_during(tracker, Recorder, ("record",))

    def _suspend_during(self, tracker: TimelineTracker, cls: Any, names: tuple[str, ...]) -> None:
        thread = threading.get_ident()  # the tracker's thread: the only one whose allocations it sees
        for name in names:
            original = getattr(cls, name, None)
            if original is None:
                continue

            def call(obj: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if threading.get_ident() != thread:
                    return _original(obj, *args, **kwargs)
                with _uncounted(tracker):
                    return _original(obj, *args, **kwargs)

            self._patches.setattr(cls, name, call)

    def uninstall(self) -> None:
        if self.tracker is not None and self.tracker in _tracker_stack():
            self.tracker.stop()
        self._patches.close()

    def _rendezvous_through(self, path: str) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = c10d.init_process_group

        @functools.wraps(original)
        def init_process_group(backend: Any = None, init_method: Any = None, *args: Any, **kwargs: Any) -> None:
            if init_method in (None, "env://") and kwargs.get("store") is None and not args:
                kwargs.pop("store", None)
                world = int(kwargs.pop("world_size", -1))
                rank = int(kwargs.pop("rank", -1))
                world = int(os.environ["WORLD_SIZE"]) if world == -1 else world
                rank = int(os.environ["RANK"]) if rank == -1 else rank
                store = dist.FileStore(os.path.abspath(path), world)
                return original(backend, store=store, rank=rank, world_size=world, **kwargs)
            return original(backend, init_method, *args, **kwargs)

        self._patches.setattr(dist, "init_process_group", init_process_group)
        self._patches.setattr(c10d, "init_process_group", init_process_group)

    def _on_backward(self, tensors: Any, grads: Any) -> None:
        if self._pending_loss is not None:
            return
        roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        if len(roots) != 1 or not isinstance(roots[0], torch.Tensor) or roots[0].numel() != 1:
            return
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        grad = grads[0] if grads else None
        # a loss is a one-element root whose gradient is implicit (None) or one element too; Megatron's pipeline
        # stages also hand autograd one-element roots (activations whose data it replaced by a placeholder), but
        # with the full-size gradient received from the next stage
        if grad is None or (isinstance(grad, torch.Tensor) and grad.numel() == 1):
            self._pending_loss = float(roots[0].detach().float().reshape(()).item())

    def _on_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        if self._first_optimizer is None:
            self._first_optimizer = id(optimizer)
        elif id(optimizer) != self._first_optimizer:
            return
        end_s = time.perf_counter() - self.origin_s
        self._capture_rank()
        self.step_ends_s.append(end_s)
        session = _prism_session()
        self.modelled_comm_s.append(None if session is None else float(session.modelled_comm_s))
        faults = getattr(session, "faults", None)
        self.fault_comm_s.append(None if faults is None else float(faults.extra_comm_s))
        if faults is not None:
            self._faults = faults
        self.losses.append(self._pending_loss)
        self._pending_loss = None
        if self.tracker is not None:
            self.step_peaks.append(self.tracker.close_window())
            self.step_live.append(self.tracker.current_bytes)
        elif self.cuda and self.track_memory:
            self.step_peaks.append(int(torch.cuda.max_memory_allocated()))
            self.step_live.append(int(torch.cuda.memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
        else:
            self.step_peaks.append(None)
            self.step_live.append(None)
        if self._progress is not None:
            with open(self._progress, "a") as fh:
                fh.write(f"{len(self.step_ends_s)}\n")
        if self.collect_garbage:
            gc.collect()
        if session is None:
            self._realign()
        # the next step starts after the probe's own work (kept out of every step's duration)
        self.step_starts_s.append(time.perf_counter() - self.origin_s)

    def _realign(self) -> None:
        """Start the next step on every real rank together: a barrier on the default group after the probe's own
        work, in a real run of several processes.

        The probe's work at a step end (above all the full garbage collection, ~0.1 s with torch loaded) lasts
        a different time on each rank; the rank done first would wait for its peers at the next step's first
        collective, and that wait, made by the probe and not by the program, would count in its step (measured:
        the toy TP2 recipe's real medians 16-21 ms against 9-10 ms undisturbed steps). An emulated rank's peers
        are virtual and arrive with it, so an emulation has nothing to realign."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        with _uncounted(self.tracker):  # what the barrier allocates is the probe's, not the program's
            dist.barrier()

    def _capture_rank(self) -> None:
        if self._rank is not None:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        else:
            self._rank = int(os.environ.get("RANK", "0"))
            self._world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._progress = self.out_dir / f"rank{self._rank}.progress"

    # -- output ------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The metrics document (`METRICS_SCHEMA`)."""
        self._capture_rank()
        steps = []
        comm, extra = self.modelled_comm_s, self.fault_comm_s
        for i, end in enumerate(self.step_ends_s):
            steps.append({
                "index": i,
                "end_s": round(end, 9),
                "duration_s": None if i == 0 else round(end - self.step_starts_s[i - 1], 9),
                "modelled_comm_s": None if i == 0 or comm[i] is None or comm[i - 1] is None
                else round(comm[i] - comm[i - 1], 9),
                "fault_extra_comm_s": None if i == 0 or extra[i] is None or extra[i - 1] is None
                else round(extra[i] - extra[i - 1], 9),
                "peak_bytes": self.step_peaks[i],
                "live_bytes": self.step_live[i],
                "loss": self.losses[i],
            })
        peaks = [p for p in self.step_peaks if p is not None]
        faults = self._faults if self._faults is not None else getattr(_prism_session(), "faults", None)
        if self.tracker is not None:
            source = "cpu tensor-storage tracker (prism_plugin.device.memory)"
            t, v = _decimate(self.tracker.times_s, self.tracker.values, _MAX_TIMELINE)
            if self.step_ends_s:  # the timeline up to the last step end, as the peak
                keep = [i for i, x in enumerate(t) if x <= self.step_ends_s[-1]]
                t, v = [t[i] for i in keep], [v[i] for i in keep]
        else:
            source = "torch.cuda.max_memory_allocated" if self.cuda and self.track_memory else "none"
            t, v = [], []
        return {
            "schema": METRICS_SCHEMA,
            "rank": self._rank,
            "world_size": self._world,
            "label": self.label,
            "pid": os.getpid(),
            "memory_source": source,
            "peak_bytes": max(peaks) if peaks else None,
            "first_loss": self.losses[0] if self.losses else None,
            "steps": steps,
            "timeline": {"t_s": [round(x, 6) for x in t], "live_bytes": v},
            "faults": None if faults is None else faults.timeline(self.origin_s),
        }

    def write(self) -> Path:
        doc = self.metrics()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{doc['rank']}.metrics.json"
        path.write_text(json.dumps(doc))
        (self.out_dir / f"rank{doc['rank']}.trace.json").write_text(json.dumps(chrome_trace(doc)))
        return path


def chrome_trace(doc: dict[str, Any]) -> dict[str, Any]:
    """A Chrome trace (chrome://tracing, Perfetto) of one metrics document: step spans and live bytes."""
    pid = int(doc["rank"] or 0)
    name = f"rank {doc['rank']} of {doc['world_size']} ({doc['label'] or 'run'})"
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "steps"}},
    ]
    for s in doc["steps"]:
        if s["duration_s"] is None:
            continue
        events.append({"ph": "X", "name": f"step {s['index']}", "cat": "step", "pid": pid, "tid": 0,
                       "ts": 1e6 * (s["end_s"] - s["duration_s"]), "dur": 1e6 * s["duration_s"],
                       "args": {k: s[k] for k in ("peak_bytes", "live_bytes", "loss", "modelled_comm_s")}})
    for t, v in zip(doc["timeline"]["t_s"], doc["timeline"]["live_bytes"], strict=True):
        events.append({"ph": "C", "name": "live tensor bytes", "pid": pid, "tid": 0, "ts": 1e6 * t,
                       "args": {"bytes": v}})
    faults = doc.get("faults")
    if faults:  # who this rank waited on, when (blame), and the hangs / crashes it met
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "fault waits"}})
        for w in faults["waits"]:
            events.append({"ph": "X", "name": f"waits on rank {w['on_rank']}", "cat": "fault", "pid": pid, "tid": 1,
                           "ts": 1e6 * w["t_s"], "dur": 1e6 * w["dur_s"],
                           "args": {**{k: w[k] for k in ("op", "group", "seq", "step")},
                                    "blame_chain": [doc["rank"], w["on_rank"]]}})
        for e in faults["events"]:
            events.append({"ph": "i", "s": "p", "name": f"{e['event']}: {e['fault']}", "cat": "fault", "pid": pid,
                           "tid": 1, "ts": 1e6 * e["t_s"],
                           "args": {k: v for k, v in e.items() if k not in ("t_s", "event", "fault")}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"memory_source": doc["memory_source"]}}


@contextlib.contextmanager
def _uncounted(tracker: TimelineTracker | None) -> Iterator[None]:
    """What the calling thread allocates inside is not counted by `tracker` (None: no tracker)."""
    if tracker is None:
        yield
        return
    tracker.suspended += 1
    try:
        yield
    finally:
        tracker.suspended -= 1


def _prism_session() -> Any:
    """The active prism session of this process, if the program runs under one."""
    module = sys.modules.get("prism_plugin.runtime.session")
    return module.current_session() if module is not None else None


def _tracker_stack() -> list[Any]:
    from prism_plugin.device import memory

    return memory.TRACKERS.all()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    out = os.environ.get("PRISM_PROBE_DIR")
    if not out:
        raise SystemExit("prism probe: set PRISM_PROBE_DIR to the folder for rank<R>.metrics.json")
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m prism_plugin.recipes.probe script.py [args] | -m module [args]")
    probe = Probe(Path(out), os.environ.get("PRISM_PROBE_LABEL", ""),
                  track_memory=os.environ.get("PRISM_PROBE_MEMORY", "1") != "0",
                  collect_garbage=os.environ.get("PRISM_PROBE_GC", "step") != "auto").install()

    def finish() -> None:
        probe.uninstall()
        probe.write()

    atexit.register(finish)
    from prism_plugin.runtime.bootstrap import run_target

    run_target(args)


if __name__ == "__main__":
    main()
