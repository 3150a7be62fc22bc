"""The ``fit`` kernel model: per-class efficiencies fitted to measured step times (DESIGN.md section 11).

Input: runs, each a virtual-time summary of one real rank (``prism run --device virtual-gpu --output DIR``'s
``rank<R>.summary.json``, or one summary of ``prism run --json``) and the step time measured for that job on the
target hardware. A summary carries, for its steady (last) emulated step, the step time ``S`` and each kernel
class's modelled time ``T_c`` at the efficiencies it ran with (``virtual_gpu.kernels.step_by_class_s``,
``virtual_gpu.kernels.efficiency``), and the job's key (``virtual_gpu.kernels.job``: its program arguments and
world size, hashed), so the fit can name the runs it saw.

Model (linear, per fitted class ``c`` a time scale ``x_c``): ``step(x) = S - sum_c T_c + sum_c T_c * x_c``.
The fitted overlay divides *both* efficiencies of the class (compute and memory) by ``x_c``, so every roofline
kernel of the class, ``max(flops / (peak * e_comp), bytes / (hbm * e_mem), floor)``, lasts exactly ``x_c`` times
as long, whichever roof it meets (scaling the compute roof alone would make a class's time a max of two roofs,
not linear in anything). Least squares over the runs, ``min sum_r (step_r(x) - measured_r)^2``, with each fitted
efficiency bounded to ``(0, 1]`` (``x_c >= max(e_comp_c, e_mem_c)``); solved exactly by enumerating the active
bounds (at most 2^8 small normal-equation solves, in exact rational arithmetic). ``fit_efficiencies`` refuses
fewer runs than classes and runs whose class times cannot tell the classes apart (a singular system), naming the
fix.

When the linear model is exact, and when it is not (say so next to any figure): it is exact for kernels above
the ``min_kernel_us`` floor on a step whose critical path is the kernels themselves (a CPU-like device with
``CUDA_LAUNCH_BLOCKING=1``, or a device-bound GPU step). Floor-bound kernels do not scale, and on a GPU a kernel
hidden under host launch overhead or overlapped by communication shortens the step by less than its own change:
re-run a fitting job with ``--kernel-model fit`` to see the modelled step the overlay really gives (the overlay
keeps the linear prediction, ``fitted_step_s``, for that comparison).

Fitting rows are never validation: the overlay's ``fitted_on`` names every run (name, run id, job key,
arguments, world size, rank, measured and modelled step); a run under ``PRISM_KERNEL_MODEL=fit`` whose job key is
among them marks its summary ``fitting_row: true`` (`FitModel.is_fitting_row`). Pure: stdlib only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.kernels import KernelClass, KernelCost, KernelEfficiency, RooflineModel

__all__ = ["FIT_FORMAT", "FitModel", "FitResult", "FitRun", "fit_efficiencies", "job_key", "load_fit",
           "run_from_summary"]

FIT_FORMAT = "prism-kernel-fit"
FIT_VERSION = 1
_MAX_CLASSES = 8
_DROPPED_FLAGS = ("--prism-output", "--prism-trace", "--output")
"""Flags (with their value) left out of a job's key: where a run writes, not what it runs."""


def job_key(argv: Sequence[str], world_size: int | str | None) -> str:
    """The job's identity as fitting rows are matched: sha256 of its program arguments (less the output
    locations in `_DROPPED_FLAGS`) and world size, 16 hex digits. The rank is left out: every rank of a fitted
    job is a fitting row.

    >>> job_key(["train.py", "--lr", "0.1", "--prism-output", "a"], 8) == job_key(["train.py", "--lr", "0.1"], 8)
    True
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    text = json.dumps([kept, None if world_size is None else int(world_size)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class FitRun:
    """One fitting run: its steady step as modelled, per class, and what was measured."""

    name: str
    measured_step_s: float
    emulated_step_s: float
    class_step_s: Mapping[str, float]
    """Per kernel class: modelled kernel seconds in the emulated step, at `efficiency`."""
    efficiency: Mapping[str, tuple[float, float]]
    """Per kernel class: (compute, memory) efficiency the run used."""
    job: str = ""
    run_id: str = ""
    argv: tuple[str, ...] = ()
    world_size: int | None = None
    rank: int | None = None


def run_from_summary(summary: Mapping[str, Any], *, name: str, measured_step_s: float) -> FitRun:
    """A `FitRun` from one rank's summary (JSON data); `ConfigError` naming the missing field otherwise."""
    where = f"run {name!r}"
    if isinstance(measured_step_s, bool) or not isinstance(measured_step_s, int | float) \
            or not math.isfinite(measured_step_s) or measured_step_s <= 0:
        raise ConfigError(f"{where}: measured step time must be a number of seconds > 0, got {measured_step_s!r}")
    if "summaries" in summary and "virtual_gpu" not in summary:
        raise ConfigError(f"{where}: a `prism run --json` document holds several summaries; give one rank's "
                          "summary file (<output>/rank<R>.summary.json)")
    if "classes" in summary and "replay" in summary:
        raise ConfigError(f"{where}: an emulate report's step is the graph replay's, not one rank's kernels: "
                          "fit on the profiling run of the slowest class, <out>/run<i>/rank<R>.summary.json")
    vgpu = summary.get("virtual_gpu")
    if not isinstance(vgpu, Mapping):
        raise ConfigError(f"{where}: field `virtual_gpu` missing: not a virtual-GPU run's summary (run it with "
                          "prism run --device virtual-gpu)")
    kernels, vt = vgpu.get("kernels"), vgpu.get("virtual_time")
    if not isinstance(kernels, Mapping) or not isinstance(vt, Mapping):
        field = "kernels" if not isinstance(kernels, Mapping) else "virtual_time"
        raise ConfigError(f"{where}: field `virtual_gpu.{field}` missing: the run had no virtual time "
                          "(PRISM_VIRTUAL_TIME=on)")
    if kernels.get("model") == "table":
        raise ConfigError(f"{where}: `virtual_gpu.kernels.model` is table: measured kernel times have no "
                          "efficiencies to fit; fit runs of the roofline (or fit) model")
    steps, per_step = vt.get("step_times_s"), kernels.get("step_by_class_s")
    if not steps:
        raise ConfigError(f"{where}: field `virtual_gpu.virtual_time.step_times_s` is empty: the program marked "
                          "fewer than two optimizer steps; run at least two")
    if not isinstance(per_step, list) or len(per_step) != len(steps):
        raise ConfigError(f"{where}: field `virtual_gpu.kernels.step_by_class_s` missing or not one entry per "
                          "step: the summary predates fit support; re-run the job with this prism")
    efficiency = kernels.get("efficiency")
    if not isinstance(efficiency, Mapping):
        raise ConfigError(f"{where}: field `virtual_gpu.kernels.efficiency` missing; re-run the job with this prism")
    job = kernels.get("job") or {}
    return FitRun(name=name, measured_step_s=float(measured_step_s), emulated_step_s=float(steps[-1]),
                  class_step_s={str(k): float(v) for k, v in per_step[-1].items()},
                  efficiency={str(k): (float(v[0]), float(v[1])) for k, v in efficiency.items()},
                  job=str(job.get("key", "")), argv=tuple(job.get("argv", ())), run_id=str(summary.get("run_id", "")),
                  world_size=summary.get("world_size"), rank=summary.get("rank"))


@dataclass(frozen=True, kw_only=True, slots=True)
class FitResult:
    """Fitted scales and efficiencies, per class, and the linear model's step for each run."""

    classes: tuple[str, ...]
    scale: dict[str, float]
    """Per fitted class: the factor on its kernel time (``x_c``; < 1 faster than the profile said)."""
    efficiency: dict[str, tuple[float, float]]
    """Per fitted class: (compute, memory) efficiency after the fit, each in (0, 1]."""
    at_bound: tuple[str, ...]
    """Classes whose fitted efficiency is held at 1 (the measurement asked for more than peak)."""
    fitted_step_s: tuple[float, ...]
    residual_rms_s: float
    runs: tuple[FitRun, ...]

    def overlay(self) -> dict[str, Any]:
        """The overlay file's data (YAML/JSON): kernels section, scales, fitted_on; `load_fit` reads it."""
        return {
            "format": FIT_FORMAT, "version": FIT_VERSION,
            "model": "linear: step(x) = step - sum_c T_c + sum_c T_c * x_c, both efficiencies of class c / x_c; "
                     "least squares, efficiencies bounded to (0, 1]",
            "kernels": {c: {"compute_efficiency": self.efficiency[c][0], "memory_efficiency": self.efficiency[c][1]}
                        for c in self.classes},
            "scale": dict(self.scale), "at_bound": list(self.at_bound), "residual_rms_s": self.residual_rms_s,
            "fitted_on": [{"name": r.name, "run_id": r.run_id, "job": r.job, "argv": list(r.argv),
                           "world_size": r.world_size, "rank": r.rank, "measured_step_s": r.measured_step_s,
                           "emulated_step_s": r.emulated_step_s, "fitted_step_s": f}
                          for r, f in zip(self.runs, self.fitted_step_s, strict=True)],
        }


def _solve(gram: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """Gaussian elimination in exact rational arithmetic (the inputs' floats are exact rationals, so a system
    with an exact answer gets it to the last bit); None when singular or nearly so (relative pivot < 1e-9)."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(gram)]
    scale = max((abs(v) for row in gram for v in row), default=Fraction(0))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= Fraction(1, 10**9) * scale or a[pivot][col] == 0:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [Fraction(0)] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def fit_efficiencies(runs: Sequence[FitRun], classes: Sequence[str] = ("gemm",)) -> FitResult:
    """Least-squares time scales of `classes` over `runs` (module docstring), bounded so efficiencies stay <= 1.

    Example: one run, GEMMs 6 ms of a 10 ms step, measured 13 ms: ``x_gemm = 1.5`` (GEMMs took 9 ms), and a
    GEMM compute efficiency of 0.75 becomes 0.5.
    """
    if not runs:
        raise ConfigError("kernels fit: no runs; give at least one --run SUMMARY.json:MEASURED_S")
    known = [c.value for c in KernelClass]
    classes = tuple(dict.fromkeys(classes))
    for c in classes:
        if c not in known:
            raise ConfigError(f"kernels fit: class {c!r} is not a kernel class; use one of {', '.join(known)}")
    if not classes or len(classes) > _MAX_CLASSES:
        raise ConfigError(f"kernels fit: name 1..{_MAX_CLASSES} classes to fit (--classes gemm,attention)")
    if len(runs) < len(classes):
        raise ConfigError(f"kernels fit: {len(runs)} run(s) cannot determine {len(classes)} classes "
                          f"({', '.join(classes)}); give at least {len(classes)} runs or fit fewer --classes")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"kernels fit: run names repeat ({names}); name each run once")
    lows = []
    for c in classes:
        if any(c not in r.efficiency for r in runs):
            raise ConfigError(f"kernels fit: a run has no `efficiency.{c}` in its summary; re-run it with this prism")
        effs = {r.efficiency[c] for r in runs}
        if len(effs) != 1:
            raise ConfigError(f"kernels fit: the runs used different {c} efficiencies ({sorted(effs)}): fit runs of "
                              "one profile")
        lows.append(max(next(iter(effs))))
    a = [[Fraction(r.class_step_s.get(c, 0.0)) for c in classes] for r in runs]
    b = [Fraction(r.measured_step_s) - Fraction(r.emulated_step_s) + sum(row) for r, row in zip(runs, a, strict=True)]
    for j, c in enumerate(classes):
        if all(row[j] == 0 for row in a):
            raise ConfigError(f"kernels fit: no run has {c} kernels in its step; drop {c} from --classes")
    k = len(classes)
    if _solve([[sum((row[i] * row[j] for row in a), Fraction(0)) for j in range(k)] for i in range(k)],
              [Fraction(0)] * k) is None:
        raise ConfigError(f"kernels fit: the runs' class times cannot tell {', '.join(classes)} apart (a singular "
                          "system); add runs whose class shares differ, or fit fewer --classes")
    best: tuple[Fraction, list[Fraction]] | None = None
    low = [Fraction(v) for v in lows]
    for clamped in itertools.chain.from_iterable(itertools.combinations(range(k), n) for n in range(k + 1)):
        free = [j for j in range(k) if j not in clamped]
        x = [low[j] if j in clamped else Fraction(0) for j in range(k)]
        if free:
            resid = [bi - sum((row[j] * x[j] for j in clamped), Fraction(0)) for row, bi in zip(a, b, strict=True)]
            sol = _solve([[sum((row[i] * row[j] for row in a), Fraction(0)) for j in free] for i in free],
                         [sum((row[i] * ri for row, ri in zip(a, resid, strict=True)), Fraction(0)) for i in free])
            if sol is None or any(s < low[j] for s, j in zip(sol, free, strict=True)):
                continue
            for s, j in zip(sol, free, strict=True):
                x[j] = s
        sse = sum(((sum((row[j] * x[j] for j in range(k)), Fraction(0)) - bi) ** 2
                   for row, bi in zip(a, b, strict=True)), Fraction(0))
        if best is None or sse < best[0]:
            best = (sse, x)
    assert best is not None  # the all-clamped candidate is always feasible
    sse, x = best
    used = {c: next(iter({r.efficiency[c] for r in runs})) for c in classes}
    fitted = tuple(float(Fraction(r.emulated_step_s) + sum(row[j] * (x[j] - 1) for j in range(k)))
                   for r, row in zip(runs, a, strict=True))
    return FitResult(
        classes=classes, scale={c: float(x[j]) for j, c in enumerate(classes)},
        efficiency={c: (float(min(Fraction(1), Fraction(used[c][0]) / x[j])),
                        float(min(Fraction(1), Fraction(used[c][1]) / x[j]))) for j, c in enumerate(classes)},
        at_bound=tuple(c for j, c in enumerate(classes) if x[j] <= low[j]), fitted_step_s=fitted,
        residual_rms_s=math.sqrt(sse / len(runs)), runs=tuple(runs))


# -- using an overlay ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Fit:
    kernels: Mapping[str, Any]
    fitted_on: tuple[Mapping[str, Any], ...]
    source: str


def load_fit(path: str | Path) -> _Fit:
    """Read an overlay `prism kernels fit` wrote (YAML or JSON); `ConfigError` naming the file and field."""
    import yaml  # PyYAML: the config layer's dependency, not a framework

    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read kernel fit {source!r} ({exc.strerror or exc}); write one with "
                          "`prism kernels fit --run SUMMARY.json:MEASURED_S --output FILE`") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: malformed YAML ({exc})") from None
    if not isinstance(data, Mapping) or data.get("format") != FIT_FORMAT:
        raise ConfigError(f"{source}: not a kernel fit (expected a mapping with format: {FIT_FORMAT!r})")
    if data.get("version") != FIT_VERSION:
        raise ConfigError(f"{source}: kernel fit version {data.get('version')!r}; this build reads {FIT_VERSION}")
    fitted_on = data.get("fitted_on")
    if not isinstance(fitted_on, list) or not fitted_on or not all(
            isinstance(r, Mapping) and r.get("name") and "job" in r for r in fitted_on):
        raise ConfigError(f"{source}: `fitted_on` must list the fitting runs (name, job, measured_step_s); a fit "
                          "that does not name its runs cannot keep them out of validation")
    kernels = data.get("kernels")
    KernelEfficiency.from_mapping(kernels, where=source)  # validated: (0, 1] fractions, known classes
    return _Fit(kernels=kernels or {}, fitted_on=tuple(fitted_on), source=source)


def _merged(base: KernelEfficiency, overlay: Mapping[str, Any]) -> KernelEfficiency:
    merged = base.to_mapping()
    for key, value in overlay.items():
        if isinstance(value, Mapping):
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return KernelEfficiency.from_mapping(merged)


class FitModel:
    """The roofline with a fit's efficiencies laid over the profile's; named ``fit`` with its runs.

    Example: ``FitModel(gpu, profile.kernels, "fit.yaml").efficiency.compute_efficiency(KernelClass.GEMM)`` is
    the fitted GEMM efficiency; `fitted_on` names the runs (``name``, ``job``, measured step).
    """

    name = "fit"

    def __init__(self, gpu: Any, base: KernelEfficiency, path: str | Path) -> None:
        fit = load_fit(path)
        self.source, self.fitted_on = fit.source, fit.fitted_on
        self.roofline = RooflineModel(gpu, _merged(base, fit.kernels))
        self.efficiency = self.roofline.efficiency

    def duration_s(self, cost: KernelCost) -> float:
        return self.roofline.duration_s(cost)

    def is_fitting_row(self, job: str) -> bool:
        """Whether the job of key `job` (`job_key`) is one this fit saw: its figures are not validation."""
        return any(r.get("job") == job for r in self.fitted_on)

    def report(self, job: str) -> dict[str, Any]:
        """What a summary says of the fit: the file, the runs it was fitted on, whether this run is one."""
        return {"file": self.source, "fitting_row": self.is_fitting_row(job),
                "fitted_on": [{k: r.get(k) for k in ("name", "run_id", "job", "world_size", "rank",
                                                      "measured_step_s")} for r in self.fitted_on]}
