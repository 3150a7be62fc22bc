"""Kernel-table recording: measured per-op durations of a real run, for the ``table`` kernel model (DESIGN.md §11).

`KernelRecorder` is a ``TorchDispatchMode`` that lets every ATen op run for real and, for each op writing a
tensor on the recorded device type, keys it by `prism_plugin.device.kernels.kernel_cost` (op,
shape, dtype: the key virtual time looks up, so a table recorded here answers the same program's kernels
exactly) and times it:

- ``cpu``: ``time.perf_counter_ns()`` around the op's execution below the mode (the op runs on the host
  thread: its wall time is its kernel time; run with ``torch.set_num_threads(1)`` for a one-core figure), or
  with ``clock="cpu"`` ``time.thread_time_ns()``, this thread's CPU time: what the op costs when it has a core
  to itself (time descheduled on a shared machine left out; one thread only: torch's intra-op threads and
  other threads' work are not counted);
- ``cuda``: CUDA events recorded on the current stream around the op after a ``torch.cuda.synchronize()``, so
  the figure is the device time of the op's kernel(s) (launch gaps between the kernels of one op included).

Steps are optimizer steps (``torch.optim.Optimizer.register_optimizer_step_post_hook``, a global hook, as
`prism run`'s iteration marker): the recorder skips everything up to the end of the ``warmup``-th step, then
alternates a **timed** step (the mode on: every op timed and costed) with a **plain** step (the mode taken off
the dispatch stack: the program runs as without the recorder, only its collective calls and the step boundary
timed), for ``steps`` timed steps (None: to the program's end); a program with no optimizer records nothing
and `table_data` refuses the empty table. The plain steps give the step time and the time inside collective
calls: under the mode every op pays a C++ -> Python round trip and the costing that a real step does not (a
DeepSpeed ZeRO-1 MLP of 152 small ops a step measured 32-39 ms a step under the mode against 14-21 ms plain, and
a peer's slowed step is waited out inside the other rank's collectives: 12-17 ms against 7-10 ms plain).
`run_program` runs a script (``runpy.run_path``) or ``-m module``
in this process, as rank 0 of 1 when the environment names no torch.distributed rendezvous.

The table (`table_data`, `TableModel`'s JSON format) holds one entry per key with the median of its samples
(``duration_us``) and their ``count``, plus ``metadata``: torch version, threads, host, program, steps, the
device's name (``cpu`` or ``torch.cuda.get_device_name()``) and, on ``cpu``, the host time per launch
(``host_overhead_us_per_launch``: the plain steps' mean wall time, less their mean time inside the program's
torch.distributed collective calls (waits of blocking ones included, reported as ``comm_time_per_step_*``) and
the timed steps' mean kernel time, over the kernels and c10d collectives a timed step launches: the program's
Python, autograd, dispatch and host-side work per launch; with no plain step recorded, the timed steps less the
recorder's bookkeeping stand in, ``step_source`` says which; a negative difference is reported as 0, the figure
as measured in ``host_overhead_raw_us_per_launch``), the figure to give virtual time as the profile's
``kernels.launch_overhead_us``. On
a CPU host and "device" are one thread, so an emulation of such a table runs with ``CUDA_LAUNCH_BLOCKING=1``
(each launch returns when its kernel ends; `prism_plugin.runtime.device_session.VirtualTimeOptions`).

Limitations: an op's timed duration includes the Python -> C++ call below the mode (a few us), so a table's
kernels are slightly long and the host time per launch short by as much (their sum per step is the plain
step's); a plain step can start while a peer still ends its timed one (the tail after its last collective);
the mode is taken off only when no infra mode (fake, functional) sits above it on the stack; an op's CPU time
includes the allocator's work; collectives are timed where the program calls ``torch.distributed.<collective>``
(an ``async_op=True`` call's later ``wait()`` and one imported by name before recording are host time, not
communication); on ``cuda`` the per-op synchronization removes overlap between kernels and the host overhead is
not measured (null); ops of other device types (host work) and ops with no kernel (views, metadata,
collectives) are not recorded.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prism_plugin.cost.kernel_table import TABLE_FORMAT, TABLE_VERSION
from prism_plugin.cost.kernels import KernelCost
from prism_plugin.device.kernels import kernel_cost

__all__ = ["KernelRecorder", "KeySamples", "device_name", "run_program", "table_data"]

_Key = tuple[str, tuple[int, ...], str]
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
_TIMED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend",
                      "irecv", "gather", "scatter", "all_gather_object", "broadcast_object_list",
                      "all_reduce_coalesced")


@dataclass(slots=True)
class KeySamples:
    """The measured durations of one (op, shape, dtype) key, in nanoseconds."""

    cost: KernelCost
    durations_ns: list[int] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        """The median sample in microseconds (the mean of the two middle ones for an even count)."""
        return statistics.median(self.durations_ns) / 1e3

    @property
    def mean_us(self) -> float:
        """The mean sample in microseconds (what a step pays on average, a descheduled sample's tail included)."""
        return statistics.fmean(self.durations_ns) / 1e3


class KernelRecorder(TorchDispatchMode):
    """Times each ATen op on `device_type` tensors after `warmup` optimizer steps, for `steps` steps.

    Use as a context manager around the program (`record` installs the optimizer hook too). Example::

        recorder = KernelRecorder("cpu", warmup=2, steps=5)
        with recorder.record():
            train()                         # 7+ optimizer steps
        table = table_data(recorder, program=["train.py"])
    """

    def __init__(self, device_type: str = "cpu", *, warmup: int = 1, steps: int | None = None,
                 clock: str = "wall") -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type={device_type!r}: record on cpu or cuda")
        if clock not in ("wall", "cpu") or (clock == "cpu" and device_type != "cpu"):
            raise ValueError(f"clock={clock!r}: wall (perf_counter), or cpu (this thread's CPU time) on a cpu device")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} must be an integer >= 0 (optimizer steps skipped)")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps={steps!r} must be an integer >= 1 (optimizer steps recorded), or None")
        super().__init__()
        self.device_type, self.warmup, self.steps, self.clock = device_type, warmup, steps, clock
        self._now = time.perf_counter_ns if clock == "wall" else time.thread_time_ns
        self.samples: dict[_Key, KeySamples] = {}
        self.optimizer_steps = 0
        """Optimizer steps seen so far (all of them, warm-up included)."""
        self.recording = warmup == 0
        self.step_ends_ns: list[int] = []
        """The clock (ns) at each step's opening in the window (after the hook's own work), timed and plain; empty
        until the window opens."""
        self.timed_step_ns: list[int] = []
        """Each timed step's wall (or cpu) time, the recorder's work included."""
        self.plain_step_ns: list[int] = []
        """Each plain step's time: the program without the mode (its collective calls and step hook timed)."""
        self.plain_comm_ns: list[int] = []
        """Time per plain step inside the program's torch.distributed collective calls."""
        self._timing = True
        """Whether the open step is a timed one (else plain)."""
        self._mode_off: list[Any] | None = None
        """While a plain step runs: the modes that sat above this one on the dispatch stack (re-pushed over it)."""
        self.kernels_per_step: list[int] = []
        self.collectives_per_step: list[int] = []
        """c10d collectives per recorded step: launches too (virtual time's host pays each one overhead); a timed
        ``torch.distributed`` call that dispatched no c10d op counts as one."""
        self.kernel_ns_per_step: list[int] = []
        self.bookkeeping_ns_per_step: list[int] = []
        """The recorder's own time per recorded step (costing, timing, synchronizing): not the program's."""
        self.comm_ns_per_step: list[int] = []
        """Time per recorded step inside the program's torch.distributed collective calls (less kernels in them)."""
        self._kernels = self._kernel_ns = self._bookkeeping_ns = self._collectives = self._comm_ns = 0
        self._in_collective = False

    # -- steps -----------------------------------------------------------------------------------------------
    def on_optimizer_step(self, *_: Any) -> None:
        """The optimizer-step post hook: opens the window after warm-up, closes each step, timed and plain."""
        now = self._now()
        self.optimizer_steps += 1
        if self.recording and self.step_ends_ns:
            step_ns = now - self.step_ends_ns[-1]
            self.step_ends_ns.append(now)
            if self._timing:
                self.timed_step_ns.append(step_ns)
                self.kernels_per_step.append(self._kernels)
                self.collectives_per_step.append(self._collectives)
                self.kernel_ns_per_step.append(self._kernel_ns)
                self.bookkeeping_ns_per_step.append(self._bookkeeping_ns)
                self.comm_ns_per_step.append(self._comm_ns)
                self._timing = not self._take_off()
            else:
                self.plain_step_ns.append(step_ns)
                self.plain_comm_ns.append(self._comm_ns)
                if self.steps is not None and len(self.kernels_per_step) >= self.steps:
                    self.recording = False
                else:
                    self._put_back()
                    self._timing = True
        elif self.optimizer_steps == self.warmup:
            self.recording = True
        self._kernels = self._kernel_ns = self._bookkeeping_ns = self._collectives = self._comm_ns = 0
        if self.recording and not self.step_ends_ns:
            self.step_ends_ns.append(self._now())
        elif self.recording:
            self.step_ends_ns[-1] = self._now()  # the next step opens after the hook's own work

    def _take_off(self) -> bool:
        """Take this mode off the dispatch stack for a plain step (the modes above it stay, in order); False when
        an infra mode (or none of the stack) makes that unsafe: the step is then timed as well."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

        stack = _get_current_dispatch_mode_stack()
        if self not in stack:
            return False
        above = stack[stack.index(self) + 1:]
        if any(getattr(mode, "_mode_key", None) is not None for mode in above):
            return False
        for _ in above:
            _pop_mode()
        _pop_mode()
        for mode in above:
            _push_mode(mode)
        self._mode_off = above
        return True

    def _put_back(self) -> None:
        """Push this mode back where `_take_off` found it (under the modes that were above it, if still there)."""
        if self._mode_off is None:
            return
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

        above = self._mode_off
        stack = _get_current_dispatch_mode_stack()
        keep = above if stack[len(stack) - len(above):] == above else []
        for _ in keep:
            _pop_mode()
        _push_mode(self)
        for mode in keep:
            _push_mode(mode)
        self._mode_off = None

    @property
    def recorded_steps(self) -> int:
        return len(self.kernels_per_step)

    @contextmanager
    def record(self) -> Any:
        """This mode and the global optimizer-step hook, for the duration of the block."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self.on_optimizer_step)
        restore = self._time_collectives()
        if self.recording:  # warmup 0: the window opens now
            self.step_ends_ns.append(self._now())
        try:
            with self:
                try:
                    yield self
                finally:
                    self._put_back()  # a plain step open at the end: the mode back on the stack for its exit
        finally:
            handle.remove()
            restore()

    def _time_collectives(self) -> Any:
        """Wrap ``torch.distributed``'s collective functions to time the calls; returns the undo."""
        import torch.distributed as dist

        if not dist.is_available():
            return lambda: None
        from torch.distributed import distributed_c10d

        saved = [(module, name, getattr(module, name)) for module in (dist, distributed_c10d)
                 for name in _TIMED_COLLECTIVES if hasattr(module, name)]
        wrapped: dict[int, Any] = {}
        for module, name, original in saved:
            if id(original) not in wrapped:
                wrapped[id(original)] = self._timed(original)
            setattr(module, name, wrapped[id(original)])

        def restore() -> None:
            for module, name, original in saved:
                setattr(module, name, original)

        return restore

    def _timed(self, original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self._in_collective or not (self.recording and self.step_ends_ns):
                return original(*args, **kwargs)
            self._in_collective = True
            start, kernel_ns, collectives = self._now(), self._kernel_ns, self._collectives
            try:
                return original(*args, **kwargs)
            finally:
                self._comm_ns += self._now() - start - (self._kernel_ns - kernel_ns)
                if self._collectives == collectives:  # no c10d op dispatched (e.g. prism's own process groups,
                    self._collectives += 1            # Megatron under `python -m prism_plugin.megatron`): one launch
                self._in_collective = False

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        return collective

    # -- ops -------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.recording or not self.step_ends_ns:
            return func(*args, **kwargs)
        entry = self._now()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = self._now()
            out = func(*args, **kwargs)
            end = self._now()
            finish.record()
            finish.synchronize()
            duration_ns = int(round(begin.elapsed_time(finish) * 1e6))
        else:
            start = self._now()
            out = func(*args, **kwargs)
            end = self._now()
            duration_ns = end - start
        self._account(func, args, kwargs, out, duration_ns)
        # the program's own time in this call is the op's (end - start); the rest is the recorder's
        self._bookkeeping_ns += self._now() - entry - (end - start)
        return out

    def _account(self, func: Any, args: tuple, kwargs: dict, out: Any, duration_ns: int) -> None:
        cost = kernel_cost(func, args, kwargs, out, device_types=(self.device_type,))
        if cost is None:
            if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
                self._collectives += 1
            return
        key = (cost.op, cost.shape, cost.dtype)
        entry = self.samples.get(key)
        if entry is None:
            entry = self.samples[key] = KeySamples(cost)
        entry.durations_ns.append(max(duration_ns, 1))
        self._kernels += 1
        self._kernel_ns += duration_ns


def device_name(device_type: str) -> str:
    """The table's ``device``: ``cpu``, or the CUDA device's name (``NVIDIA H100 80GB HBM3``)."""
    return "cpu" if device_type == "cpu" else torch.cuda.get_device_name()


def table_data(recorder: KernelRecorder, *, program: Sequence[str], device: str | None = None,
               statistic: str = "median") -> dict[str, Any]:
    """`recorder`'s samples as a kernel table (`TableModel.from_json`'s format): one entry per key, its median
    (`statistic` ``mean``: its mean, which on a shared machine keeps the descheduled samples' share, as a real step
    pays it: the sum of the ops' means is the mean of the steps' kernel time).

    Entries are sorted by (op, dtype, shape). Raises `ValueError` when no step was recorded (no optimizer, or
    fewer optimizer steps than the warm-up), or for a `statistic` other than median / mean.
    """
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic={statistic!r}: use median or mean")
    if recorder.recorded_steps == 0:
        raise ValueError(f"no step recorded: the program made {recorder.optimizer_steps} optimizer step(s) and "
                         f"{recorder.warmup} were warm-up; lower --warmup, run more steps, or use a program that "
                         "steps a torch.optim optimizer (steps are optimizer steps)")
    device = device or device_name(recorder.device_type)
    entries = [{"op": s.cost.op, "kernel_class": s.cost.kernel_class.value, "shape": list(s.cost.shape),
                "dtype": s.cost.dtype, "device": device, "flops": s.cost.flops, "bytes": s.cost.bytes,
                "duration_us": round(s.mean_us if statistic == "mean" else s.median_us, 3),
                "count": len(s.durations_ns)}
               for s in sorted(recorder.samples.values(), key=lambda s: (s.cost.op, s.cost.dtype, s.cost.shape))]
    # the program's step: the plain steps (no mode), else the timed steps less the recorder's bookkeeping
    timed_ns = [w - b for w, b in zip(recorder.timed_step_ns, recorder.bookkeeping_ns_per_step, strict=True)]
    plain = bool(recorder.plain_step_ns)
    program_ns = recorder.plain_step_ns if plain else timed_ns
    comm_ns = recorder.plain_comm_ns if plain else recorder.comm_ns_per_step
    kernels, collectives = sum(recorder.kernels_per_step), sum(recorder.collectives_per_step)
    host_us = raw_host_us = None
    if recorder.device_type == "cpu" and kernels + collectives:
        launches = (kernels + collectives) / recorder.recorded_steps
        mean = statistics.fmean
        host_ns = mean(program_ns) - mean(comm_ns) - mean(recorder.kernel_ns_per_step)
        # the timed kernels run slightly long (the call below the mode): with little host time and a noisy
        # machine the difference can come out negative; no launch costs less than nothing (the raw figure kept)
        raw_host_us = round(host_ns / launches / 1e3, 3)
        host_us = max(raw_host_us, 0.0)
    metadata = {
        "torch_version": torch.__version__, "threads": torch.get_num_threads(), "host": platform.node(),
        "machine": platform.machine(), "processor": platform.processor() or None, "program": list(program),
        "device_type": recorder.device_type, "device": device, "clock": recorder.clock, "statistic": statistic,
        "kernel_time_per_step_mean_s": round(statistics.fmean(recorder.kernel_ns_per_step) / 1e9, 9),
        "comm_time_per_step_mean_s": round(statistics.fmean(comm_ns) / 1e9, 9),
        "warmup_steps": recorder.warmup,
        "recorded_steps": recorder.recorded_steps, "plain_steps": len(recorder.plain_step_ns),
        "step_source": "plain" if plain else "timed",
        "optimizer_steps_seen": recorder.optimizer_steps,
        "kernels_per_step": round(kernels / recorder.recorded_steps, 3),
        "collectives_per_step": round(collectives / recorder.recorded_steps, 3),
        "step_time_median_s": round(statistics.median(program_ns) / 1e9, 9),
        "step_time_mean_s": round(statistics.fmean(program_ns) / 1e9, 9),
        "timed_step_time_median_s": round(statistics.median(timed_ns) / 1e9, 9),
        "kernel_time_per_step_median_s": round(statistics.median(recorder.kernel_ns_per_step) / 1e9, 9),
        "comm_time_per_step_median_s": round(statistics.median(comm_ns) / 1e9, 9),
        "recorder_overhead_per_step_median_s": round(statistics.median(recorder.bookkeeping_ns_per_step) / 1e9, 9),
        "host_overhead_us_per_launch": host_us,
        "host_overhead_raw_us_per_launch": raw_host_us,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "note": "steps are optimizer steps, timed (every op timed) and plain (the program alone) in turn; step and "
                "comm times are the plain steps' (step_source); host_overhead_us_per_launch is (mean step - mean "
                "comm - mean kernel time) / (kernels + collectives) a step: give it to virtual time as the "
                "profile's kernels.launch_overhead_us",
    }
    return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "metadata": metadata, "entries": entries}


def _default_rendezvous(environ: dict[str, str]) -> dict[str, str]:
    """The torch.distributed variables of rank 0 of 1 that `environ` lacks (none when it names a rank)."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return {}
    # port 0: the store of the only rank binds a free port itself (nobody else connects): no port race
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def run_program(target: Sequence[str]) -> int:
    """Run ``[script, args...]`` or ``["-m", module, args...]`` in this process as ``__main__``; its exit code.

    The program sees ``sys.argv`` as it would under ``python``; when the environment names no rank it is rank
    0 of a world of 1 (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set for the run, then removed).
    """
    target = list(target)
    if not target or (target[0] == "-m" and len(target) < 2):
        raise ValueError("name the program: [script.py, args...] or [-m, module, args...]")
    added = _default_rendezvous(dict(os.environ))
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    os.environ.update(added)
    try:
        from prism_plugin.runtime.lifecycle import run_target

        run_target(target)
        return 0
    except SystemExit as exc:
        code = exc.code
        return 0 if code is None else (code if isinstance(code, int) else 1)
    finally:
        sys.argv = saved_argv
        if target[0] != "-m" and saved_path0 is not None:
            sys.path.pop(0)
        for name in added:
            os.environ.pop(name, None)
        _destroy_default_group()


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
