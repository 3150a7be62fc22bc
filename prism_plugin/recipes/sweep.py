"""`prism sweep`: one recipe's job over several scales or layouts, each point a virtual-GPU emulation.

A sweep takes a ``device: virtual-gpu`` recipe (`prism_plugin.recipes.virtual_gpu`), its first emulation (or the
one named) and a list of world sizes N (x optional layouts, x optional hardware profiles), and runs each point as
that emulation with N, the layout, the profile and the per-rank batch replaced: one ``prism run --device
virtual-gpu`` process tree per point, one real rank, the program at real size. Example::

    spec = SweepSpec(recipe=load_recipe("recipes/virtual-gpu-llama-1b.yaml"), world_sizes=(512, 1024, 2048),
                     global_batch=2048)
    points = derive_points(spec)   # n512: dp 512, micro 1 x accumulation 4 = 2048 sequences per step
    results = run_points(points, Path("out"), jobs=2)

**Batch.** With `SweepSpec.global_batch` G (sequences per step) the job trains at a fixed global batch: the
micro-batch stays the recipe's ``model.micro_batch_size`` m and the gradient accumulation k = G / (m x dp) changes
with dp (``model.microbatches_per_step``, the llama program's ``--accumulation``); G must be a multiple of m x dp
at every point. Without it each replica keeps the recipe's m x microbatches_per_step (weak scaling: the global
batch grows with dp).

**Figures of a point** (`point_figures`, from the real rank's prism summary and its timeline,
``PRISM_TIMELINE``; all emulated time, deterministic):

- step time: the median of the measured steps (``virtual_gpu.virtual_time.step_times_s``: every marked step
  after the first);
- tokens/s/GPU: global batch x seq length / step time / N;
- MFU: this rank's kernel FLOPs per step (``virtual_gpu.kernels.flops`` / steps: torch's flop registry, i.e.
  the matmuls and attention the rank's kernels execute, causal attention counting its unmasked half; the
  embedding lookup and elementwise ops count 0) / step time / the GPU's dense bf16 peak
  (`prism_plugin.cost.gpu.GpuSpec.peak_flops_per_s`);
- step-time breakdown (mean over measured steps, from the timeline's spans in each step's window): compute =
  time the rank's compute streams run a kernel; exposed communication = time a communication stream runs an op
  while no compute stream runs a kernel; bubble = 0 at pp = 1 (None otherwise: not measured yet); other = the
  rest of the step (no stream busy: the host's launch overhead and syncs). Without a timeline these are None;
- modelled communication per step, hidden or not (the comm streams' busy time in the measured steps; without a
  timeline ``modelled_comm_s`` / steps);
- the rank's own device: peak allocated / reserved, device total (reserved + CUDA context), the GPU's memory,
  fits, OOM count.

A point that fails (an OOM with ``oom: raise``, an error, a timeout) is a `PointResult` with its `error` (and the
memory figures of its summary, if it wrote one), never an exception out of `run_points`.

Modules: `prism_plugin.recipes.sweep_points` (the spec and its points), `prism_plugin.recipes.sweep_figures` (a
point's figures), this one (running points, the JSON document), `prism_plugin.recipes.sweep_report` (table, plots).

**Where points run.** Locally, at most `jobs` points at a time (each one process tree); or on a Ray cluster
(``ray_address``: ``ray.init(address=...)``, or ``"local"`` to start a local instance), each point one
``@ray.remote`` task running the same `run_point`. Ray is optional (the ``cluster`` extra) and imported only then.
On a remote cluster each point's files stay on the node that ran it; its figures come back to the driver.

Limitations: one real rank per point (symmetric DP ranks: any rank stands for all); the llama program is data
parallel only, so layouts other than tp = pp = cp = 1 are refused by the recipe schema until a virtual-GPU
program with model parallelism exists; a breakdown needs the timeline to keep every span of the measured steps
(``MAX_RECORDS``; a point whose timeline dropped spans says so in ``breakdown_note``).
Non-goals: choosing the best layout, real (non-virtual) runs, what-ifs other than the hardware profile
(faults, stragglers: the recipe's own emulations). With several profiles the memory plot draws the first
point's GPU capacity.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.recipes import runner
from prism_plugin.recipes.plans import ProcessSpec, virtual_gpu_plan
from prism_plugin.recipes.runner import RunFailed, execute
from prism_plugin.recipes.sweep_figures import Breakdown, PointFigures, peak_bf16, point_figures, step_breakdown
from prism_plugin.recipes.sweep_points import (
    LAYOUT_KEYS,
    SweepError,
    SweepPoint,
    SweepSpec,
    derive_points,
    parse_layouts,
    parse_world_sizes,
)

__all__ = ["SCHEMA", "Breakdown", "PointFigures", "PointResult", "SweepError", "SweepPoint", "SweepSpec",
           "default_jobs", "derive_points", "parse_layouts", "parse_world_sizes", "peak_bf16", "point_figures",
           "run_point", "run_points", "step_breakdown", "sweep_document", "SweepInterrupted"]

SCHEMA = "prism-sweep/1"

@dataclass(frozen=True, kw_only=True, slots=True)
class PointResult:
    """What one point produced: its figures, or its error (with what figures its summary still had)."""

    point: SweepPoint
    figures: PointFigures | None
    error: str | None
    wall_s: float
    folder: str

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point.to_dict(), "ok": self.ok, "error": self.error, "wall_s": round(self.wall_s, 3),
                "folder": self.folder, "figures": None if self.figures is None else self.figures.to_dict()}


_OOM_LINE = re.compile(r"(?:torch\.)?OutOfMemoryError: (CUDA out of memory\.[^\n]*)")


def _error_text(exc: BaseException, log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    oom = _OOM_LINE.search(text)
    if oom:
        return oom.group(1)[:300]
    return str(exc).splitlines()[0][:300]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_point(point: SweepPoint, output: str | Path, *, timeout_s: float = 900.0) -> PointResult:
    """Run `point` into ``output/<point.name>`` (its folder is emptied first) and read its figures.

    Never raises for a failed run: the result carries the error (an OOM names torch's message).
    """
    out = Path(output) / point.name
    recipe, emu = point.recipe, point.recipe.emulated[0]
    plan = virtual_gpu_plan(recipe, emu, 0, out)
    timeline_dir = out / "timeline"
    plan = dataclasses.replace(plan, processes=tuple(
        ProcessSpec(argv=p.argv, env={**p.env, "PRISM_TIMELINE": str(timeline_dir)}, log=p.log)
        for p in plan.processes))
    t0 = time.monotonic()
    error = None
    try:
        execute([plan], steps_total=recipe.steps.total, timeout_s=timeout_s)
    except RunFailed as exc:
        error = _error_text(exc, plan.processes[0].log)
    except OSError as exc:
        error = f"could not start the point's run: {exc}"
    wall = time.monotonic() - t0
    assert plan.summary_dir is not None
    summary = _read_json(plan.summary_dir / f"rank{point.rank}.summary.json")
    figures = None
    if summary is not None and summary.get("virtual_gpu"):
        timeline = _read_json(timeline_dir / f"rank{point.rank}.timeline.json")
        try:
            figures = point_figures(summary, point, peak_bf16_flops_per_s=peak_bf16(point), timeline=timeline)
        except (KeyError, TypeError, ValueError, RunFailed) as exc:
            error = error or f"unreadable summary: {type(exc).__name__}: {exc}"
    elif error is None:
        error = f"rank {point.rank} wrote no virtual-GPU summary; see {plan.processes[0].log}"
    if error is None and summary is not None and summary.get("error"):
        error = str(summary["error"])[:300]
    return PointResult(point=point, figures=figures, error=error, wall_s=wall, folder=str(out))


PointDone = Callable[[PointResult], None]
PointStarted = Callable[[SweepPoint], None]


def default_jobs() -> int:
    """min(2, this machine's cores): points run this many at a time by default."""
    return max(1, min(2, os.cpu_count() or 1))


def run_points(points: Sequence[SweepPoint], output: Path, *, jobs: int | None = None, ray_address: str | None = None,
               timeout_s: float = 900.0, on_start: PointStarted | None = None,
               on_done: PointDone | None = None) -> list[PointResult]:
    """Run every point, at most `jobs` at a time locally or as Ray tasks (`ray_address`); results in point order."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise SweepError(f"--jobs must be >= 1, got {jobs}")
    Path(output).mkdir(parents=True, exist_ok=True)
    if ray_address is not None:
        return _run_on_ray(points, Path(output), ray_address, jobs=jobs, timeout_s=timeout_s, on_start=on_start,
                           on_done=on_done)
    results: dict[str, PointResult] = {}
    pool = ThreadPoolExecutor(max_workers=jobs)

    def one(p: SweepPoint) -> PointResult:
        if on_start is not None:
            on_start(p)
        return run_point(p, output, timeout_s=timeout_s)

    try:
        futures = [pool.submit(one, p) for p in points]
        for fut in as_completed(futures):
            res = fut.result()
            results[res.point.name] = res
            if on_done is not None:
                on_done(res)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM turned into one by the CLI: start no more points
        pool.shutdown(wait=False, cancel_futures=True)  # the queued points never start
        runner.STOP.set()  # the running points stop their processes
        try:
            pool.shutdown(wait=True)
        finally:
            runner.STOP.clear()
        finished = [results[p.name] for p in points if p.name in results]
        raise SweepInterrupted(finished) from exc
    pool.shutdown()
    return [results[p.name] for p in points]


class SweepInterrupted(KeyboardInterrupt):
    """A sweep stopped by Ctrl-C or SIGTERM: no point was started after it, the running ones were stopped;
    `finished` holds the points that had ended before it (in point order)."""

    def __init__(self, finished: list[PointResult]) -> None:
        super().__init__(f"sweep interrupted after {len(finished)} finished point(s)")
        self.finished = finished
        self.signal_name, self.signal_number = "SIGINT (Ctrl-C)", 2


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray, the optional `cluster` extra: pip install prism_plugin[cluster]") from None
    return ray


def _run_on_ray(points: Sequence[SweepPoint], output: Path, address: str, *, jobs: int, timeout_s: float,
                on_start: PointStarted | None, on_done: PointDone | None) -> list[PointResult]:
    ray = _import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address == "local":  # a local instance for this sweep: `jobs` CPUs, no dashboard
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(run_point)
        pending = {}
        for p in points:
            pending[task.remote(p, str(output), timeout_s=timeout_s)] = p
            if on_start is not None:
                on_start(p)
        results: dict[str, PointResult] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                p = pending.pop(ref)
                try:
                    res = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a task that died (node lost, worker crash) is the point's error
                    res = PointResult(point=p, figures=None, error=f"ray task failed: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:300] if str(exc) else ''}", wall_s=0.0,
                                      folder=str(output / p.name))
                results[p.name] = res
                if on_done is not None:
                    on_done(res)
        return [results[p.name] for p in points]
    finally:
        if started_here:
            ray.shutdown()


def sweep_document(spec: SweepSpec, results: Sequence[PointResult], *, engine: str,
                   plots: Sequence[Path] = ()) -> dict[str, Any]:
    """The ``sweep.json`` document: the spec, how points ran, every point's figures or error."""
    recipe = spec.recipe
    emu = spec.base_emulation()
    return {
        "schema": SCHEMA, "recipe": recipe.name, "source": str(recipe.source) if recipe.source else None,
        "emulation": emu.name, "program": recipe.program.value,
        "spec": {"world_sizes": list(spec.world_sizes),
                 "layouts": [{k: getattr(lay, k) for k in LAYOUT_KEYS} for lay in spec.layouts] or None,
                 "profiles": list(spec.profiles) or None,
                 "global_batch": spec.global_batch,
                 "batch": ("fixed global batch: micro-batch x accumulation x dp = global_batch" if spec.global_batch
                           else "fixed per-replica batch (the recipe's micro x microbatches_per_step): grows with dp"),
                 "rank": results[0].point.rank if results else spec.rank, "profile": emu.profile,
                 "seq_length": recipe.model.seq_length, "steps": {"total": recipe.steps.total,
                                                                  "warmup": recipe.steps.warmup}},
        "engine": engine,
        "definitions": {
            "step_time_s": "median of the measured emulated steps (virtual_time.step_times_s)",
            "tokens_per_s_per_gpu": "global_batch x seq_length / step_time_s / world_size",
            "mfu": "this rank's kernel FLOPs per step (torch flop registry: matmuls + attention) / step_time_s / "
                   "the GPU's dense bf16 peak",
            "compute_s": "mean per measured step: time a compute stream runs a kernel (timeline)",
            "exposed_comm_s": "mean per measured step: time a comm stream runs an op while no kernel runs",
            "bubble_s": "pipeline bubble: 0 at pp = 1",
            "other_s": "the rest of the step: no stream busy (host launch overhead, syncs)",
            "modelled_comm_s": "mean per measured step: time a comm stream runs an op, hidden or exposed",
            "device_total_bytes": "peak reserved + cuBLAS workspaces + NCCL buffers + CUDA context"},
        "plots": [str(p) for p in plots],
        "points": [r.to_dict() for r in results],
    }
