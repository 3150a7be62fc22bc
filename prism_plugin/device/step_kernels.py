"""What a virtual-time summary carries for the ``fit`` kernel model (`prism_plugin.cost.kernel_fit`).

`attach_step_figures(vgpu, timer, clock)` adds to the summary's ``virtual_gpu.kernels``:

- ``step_by_class_s``: per emulated step (one per ``virtual_time.step_times_s`` entry), each kernel class's
  modelled seconds of the kernels launched in it (the kernel timer's per-class totals at each iteration mark,
  differenced);
- ``efficiency``: per class the (compute, memory) efficiency the kernel model ran with (the fit scales them);
- ``job``: the job's key (`kernel_fit.job_key` of the program's arguments, as ``sys.argv`` holds them when the
  summary is written, and ``WORLD_SIZE``), the arguments and world size, so a fit can name its runs;
- under the ``fit`` model, ``fit``: the overlay file, the runs it was fitted on, and ``fitting_row`` (this job
  is one of them: its figures are not validation).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from prism_plugin.cost.kernel_fit import FitModel, job_key
from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.clock import VirtualTime
from prism_plugin.device.kernel_timer import KernelTimer

__all__ = ["attach_step_figures"]


def attach_step_figures(vgpu: Any, timer: KernelTimer, clock: VirtualTime) -> None:
    """Snapshot `timer`'s per-class totals at each of `clock`'s iteration marks; extend `vgpu`'s kernel summary."""
    snapshots: list[dict[str, float]] = []
    on_mark = clock.on_mark

    def marking(iteration: int, start_s: float) -> None:
        on_mark(iteration, start_s)
        snapshots.append(dict(timer.summary(top=0).by_class_s))

    clock.on_mark = marking  # type: ignore[method-assign]

    warned: list[bool] = []

    def summary() -> dict[str, Any]:
        kernels = timer.summary()
        warning = kernels.table_warning()
        if warning and not warned:  # said once, at the run's end, on stderr (the summary keeps the figures)
            warned.append(True)
            print(warning, file=sys.stderr, flush=True)
        out = kernels.as_dict()
        out["step_by_class_s"] = [
            {c: round(b.get(c, 0.0) - a.get(c, 0.0), 12) for c in b if b.get(c, 0.0) != a.get(c, 0.0)}
            for a, b in zip(snapshots, snapshots[1:], strict=False)]
        efficiency = getattr(timer.model, "efficiency", None) or getattr(
            getattr(timer.model, "fallback", None), "efficiency", None)
        if efficiency is not None:
            out["efficiency"] = {c.value: [efficiency.compute_efficiency(c), efficiency.memory_efficiency(c)]
                                 for c in KernelClass}
        world = os.environ.get("WORLD_SIZE")
        argv = list(sys.argv)
        key = job_key(argv, int(world) if world and world.isdigit() else None)
        out["job"] = {"key": key, "argv": argv, "world_size": int(world) if world and world.isdigit() else None}
        if isinstance(timer.model, FitModel):
            out["fit"] = timer.model.report(key)
        return out

    vgpu.kernel_summary = summary
