"""Run a recipe: the paired real run, then each emulation (its real-rank sets together), then compare.

`run_recipe(recipe, output)` returns a `RecipeResult` and writes, under ``output``::

    real/metrics/rank<R>.metrics.json, rank<R>.trace.json     the probe's figures and Chrome trace per rank
    real/process<i>.log (or launcher.log)                      each process's output
    <emulation>/run<i>/metrics/..., prism/rank<R>.summary.json  the same per emulated real rank, plus prism's summary
    result.json                                                comparisons, summary, machine load

Processes are started in their own process groups, so a failed or timed-out run is stopped whole
(launchers and their children) and reported with the tail of its log. An emulation whose `expect`
states a failure (a hang, crash or kill fault) is run by `execute_failing` instead: its failure is
checked (`prism_plugin.recipes.expect`), not raised, and it has no figures to compare; one that does
not fail in time fails the recipe. Figure expectations (straggler waits, modelled-communication
factors) are checked after every run, and `RecipeResult.passed` needs them too. `measure_noise` repeats the
real run to measure its run-to-run noise (``prism recipe noise``). A recipe with ``real: none`` runs only its
emulations; ``device: virtual-gpu`` runs have no probe: their figures are prism's summaries, checked against
the stated memory (`prism_plugin.recipes.memory`) and kept as `RecipeResult.memory`.

Limitations: one machine; on a machine with fewer cores than processes, step times depend on the
load (see the recipe's `runs` and the recorded noise); runs are sequential (real first).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_plugin.config.kinds import DataPolicy
from prism_plugin.recipes.compare import Comparison, RankFigures, compare, noise_spread, rank_figures, summarise
from prism_plugin.recipes.expect import ExpectCheck, FailedRun, check_failure, check_figures
from prism_plugin.recipes.memory import MemoryRow, check_memory, memory_rows
from prism_plugin.recipes.plans import RunPlan, emulation_plan, logged_first_loss, real_plan
from prism_plugin.recipes.schema import Recipe, RecipeError

__all__ = ["RecipeResult", "RunFailed", "RunOutcome", "execute", "execute_failing", "measure_noise", "run_recipe"]

Progress = Callable[[str, int, int], None]
"""progress(label, steps done, steps expected) (called while runs are going)."""


STOP = threading.Event()
"""Set from another thread (a sweep interrupted by Ctrl-C or SIGTERM): every `execute` in progress stops its
processes and raises `RunFailed`, and none starts; the setter clears it."""


class RunFailed(RuntimeError):
    """A run's process exited with an error or timed out; the message carries the log tail."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    label: str
    wall_s: float
    docs: dict[int, dict[str, Any]]
    """rank -> metrics document."""
    summaries: dict[int, dict[str, Any]]
    """rank -> prism session summary (prism runs)."""
    folder: Path


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeResult:
    recipe: Recipe
    output: Path
    outcomes: dict[str, list[RunOutcome]]
    """"real" / emulation name -> its runs."""
    figures: dict[str, dict[int, RankFigures]]
    comparisons: list[Comparison]
    summary: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=dict)
    expectations: list[ExpectCheck] = field(default_factory=list)
    """What the emulations' faults had to produce (`prism_plugin.recipes.expect`), one row per check."""
    memory: list[MemoryRow] = field(default_factory=list)
    """Virtual-GPU memory per rank and device (`prism_plugin.recipes.memory`); empty without virtual GPUs."""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons) and all(e.passed for e in self.expectations)

    @property
    def noisy(self) -> list[Comparison]:
        """Comparisons whose step time this run could not check: outside the tolerance, inside the run's noise."""
        return [c for c in self.comparisons if c.step_noisy]

    def to_dict(self) -> dict[str, Any]:
        r = self.recipe
        tol = r.tolerances
        return {
            "schema": "prism-recipe-result/1",
            "recipe": r.name, "source": str(r.source) if r.source else None, "framework": r.framework.value,
            "tier": r.tier.value, "passed": self.passed,
            "tolerances": {"memory_bytes": tol.memory_bytes, "step_time_rel": tol.step_time_rel,
                           "loss_rel": tol.loss_rel,
                           "noise": None if tol.noise is None else {"runs": tol.noise.runs,
                                                                    "spread_rel": tol.noise.spread_rel,
                                                                    "measured_on": tol.noise.measured_on}},
            "summary": self.summary,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "expectations": [e.to_dict() for e in self.expectations],
            "virtual_gpu_memory": [m.to_dict() for m in self.memory],
            "runs": {label: [{"label": o.label, "wall_s": round(o.wall_s, 3), "folder": str(o.folder),
                              "ranks": sorted(o.docs)} for o in outs] for label, outs in self.outcomes.items()},
            "figures": {label: {str(rank): {"median_step_s": f.median_step_s, "mean_step_s": f.mean_step_s,
                                            "step_times_s": list(f.step_times_s), "peak_bytes": f.peak_bytes,
                                            "max_peak_bytes": f.max_peak_bytes, "run_peak_bytes": f.run_peak_bytes,
                                            "first_loss": f.first_loss,
                                            "modelled_comm_step_s": f.modelled_comm_step_s}
                                for rank, f in ranks.items()} for label, ranks in self.figures.items()},
            "machine": self.machine,
        }


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average_1m": None if load is None else round(load[0], 2)}


class ForeignCpu:
    """CPU time that processes other than this one and its children used while the recipe ran.

    The machine's busy time (``/proc/stat``) minus this process's and its reaped children's CPU time
    (`resource.getrusage`), in cores (busy seconds / wall seconds). A run that shares its cores with other
    work has step times that say more about that work than about the emulator: `run_recipe` records it as
    ``machine["foreign_cpu_cores"]`` (None where ``/proc/stat`` is absent) so checks can tell a quiet machine.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy = (user + nice + system + irq + softirq + steal) / ticks
        own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return busy, own, time.monotonic()

    def cores(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        foreign = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return round(max(foreign, 0.0) / (end[2] - self._start[2]), 3)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


def _prepare(plans: Sequence[RunPlan]) -> None:
    for plan in plans:
        folder = plan.probe_dir.parent
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for path, text in plan.files.items():
            Path(path).write_text(text)


def _start(plans: Sequence[RunPlan], started: list[tuple[RunPlan, subprocess.Popen[bytes], Path]]) -> None:
    for plan in plans:
        for spec in plan.processes:
            with open(spec.log, "wb") as log:
                proc = subprocess.Popen(list(spec.argv), env={**os.environ, **spec.env}, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            started.append((plan, proc, spec.log))


def execute_failing(plans: Sequence[RunPlan], *, within_s: float) -> FailedRun:
    """Start every process of every plan at once (a run whose faults must make it fail) and wait until all have
    ended or `within_s` has passed (then stop them); how they ended, for `check_failure`."""
    started: list[tuple[RunPlan, subprocess.Popen[bytes], Path]] = []
    _prepare(plans)
    t0 = time.monotonic()
    try:
        _start(plans, started)
        while any(p.poll() is None for _, p, _ in started) and time.monotonic() - t0 <= within_s:
            time.sleep(0.05)
        wall = time.monotonic() - t0
        codes = tuple(p.poll() for _, p, _ in started)
    finally:
        _stop([p for _, p, _ in started])
    output = "\n".join(f"==> {log} <==\n{_tail(log, 10**6)}" for _, _, log in started)
    return FailedRun(label=" + ".join(p.label for p in plans), wall_s=wall, exit_codes=codes, output=output,
                     logs=tuple(str(log) for _, _, log in started))


def execute(plans: Sequence[RunPlan], *, steps_total: int, timeout_s: float,
            progress: Progress | None = None) -> list[RunOutcome]:
    """Start every process of every plan at once, wait for all; RunFailed on an error or the timeout."""
    started: list[tuple[RunPlan, subprocess.Popen[bytes], Path]] = []
    label = " + ".join(p.label for p in plans)
    if STOP.is_set():
        raise RunFailed(f"run {label}: not started (stopped)")
    _prepare(plans)
    t0 = time.monotonic()
    try:
        _start(plans, started)
        expected = sum(len(p.ranks) for p in plans) * steps_total
        while True:
            if STOP.is_set():
                raise RunFailed(f"run {label}: stopped")
            codes = [p.poll() for _, p, _ in started]
            for (plan, _, log), code in zip(started, codes, strict=True):
                if code not in (None, 0):
                    raise RunFailed(f"run {plan.label}: a process exited with code {code}; log {log}:\n{_tail(log)}")
            if progress is not None:
                done = sum(_progress_count(p.probe_dir) for p in plans)
                progress(label, min(done, expected), expected)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - t0 > timeout_s:
                raise RunFailed(f"runs {label}: not done after {timeout_s:g} s (--timeout); last log "
                                f"{started[0][2]}:\n{_tail(started[0][2])}")
            time.sleep(0.1)
    finally:
        _stop([p for _, p, _ in started])
    wall = time.monotonic() - t0
    return [_collect(plan, wall) for plan in plans]


def _progress_count(folder: Path) -> int:
    total = 0
    for f in folder.glob("rank*.progress") if folder.exists() else ():
        try:
            total += f.read_text().count("\n")
        except OSError:
            pass
    return total


def _collect(plan: RunPlan, wall_s: float) -> RunOutcome:
    docs: dict[int, dict[str, Any]] = {}
    for rank in plan.ranks if plan.probe else ():
        path = plan.probe_dir / f"rank{rank}.metrics.json"
        if not path.exists():
            logs = ", ".join(str(p.log) for p in plan.processes)
            raise RunFailed(f"run {plan.label}: rank {rank} wrote no metrics ({path}); see {logs}")
        docs[rank] = json.loads(path.read_text())
    if plan.loss_from_log:  # one process per rank (Megatron plans)
        for rank, spec in zip(plan.ranks, plan.processes, strict=True):
            docs[rank]["first_loss"] = logged_first_loss(_tail(spec.log, 10**7))
            docs[rank]["first_loss_source"] = "Megatron training log: lm loss of iteration 1"
    summaries: dict[int, dict[str, Any]] = {}
    if plan.summary_dir is not None:
        for rank in plan.ranks:
            path = plan.summary_dir / f"rank{rank}.summary.json"
            if path.exists():
                summaries[rank] = json.loads(path.read_text())
            elif not plan.probe:
                logs = ", ".join(str(p.log) for p in plan.processes)
                raise RunFailed(f"run {plan.label}: rank {rank} wrote no prism summary ({path}); see {logs}")
    return RunOutcome(label=plan.label, wall_s=wall_s, docs=docs, summaries=summaries, folder=plan.probe_dir.parent)


def _figures(recipe: Recipe, label: str, outcomes: Sequence[RunOutcome]) -> dict[int, RankFigures]:
    docs: dict[int, list[dict[str, Any]]] = {}
    for o in outcomes:
        for rank, doc in o.docs.items():
            docs.setdefault(rank, []).append(doc)
    return {rank: rank_figures(ds, warmup=recipe.steps.warmup, total=recipe.steps.total,
                               where=f"{recipe.name}: run {label}") for rank, ds in docs.items()}


def _per_rank(maps: Any) -> dict[int, list[dict[str, Any]]]:
    """rank -> its documents over runs and repeats (in run order)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for m in maps:
        for rank, doc in m.items():
            out.setdefault(rank, []).append(doc)
    return out


def run_recipe(recipe: Recipe, output: Path, *, timeout_s: float = 900.0, repeats: int | None = None,
               progress: Progress | None = None) -> RecipeResult:
    """The real run, each emulation, the comparisons; writes ``output/result.json``.

    With `repeats` > 1 (default: the recipe's), the whole sequence (real run, then each emulation) runs that
    many times, interleaved, and each rank's measured steps are pooled over the repeats: slow drifts of the
    machine's load then affect the real and the emulated runs alike.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    repeats = recipe.repeats if repeats is None else repeats
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    machine = {"before": _machine()}
    foreign = ForeignCpu()
    needs_recording = any(e.data_policy is DataPolicy.RECORDED for e in recipe.emulated)
    outcomes: dict[str, list[RunOutcome]] = {"real": [], **{e.name: [] for e in recipe.emulated}}
    checks: list[ExpectCheck] = []
    for rep in range(repeats):
        base = output if repeats == 1 else output / f"repeat{rep}"
        real_dir = base / "real"
        record_dir = real_dir / "recording" if needs_recording else None  # execute() empties real_dir first
        if recipe.real.exists:
            plan = real_plan(recipe, real_dir, record_dir=record_dir)
            outcomes["real"] += execute([plan], steps_total=recipe.steps.total, timeout_s=timeout_s,
                                        progress=progress)
        for emu in recipe.emulated:
            plans = [emulation_plan(recipe, emu, i, base / emu.name / f"run{i}", record_dir)
                     for i in range(len(emu.runs))]
            if emu.expects_failure:  # its faults must make it fail: not an error, and nothing to compare
                assert emu.expect is not None and emu.expect.within_s is not None
                checks.append(check_failure(emu, execute_failing(plans, within_s=min(emu.expect.within_s,
                                                                                     timeout_s))))
                continue
            outcomes[emu.name] += execute(plans, steps_total=recipe.steps.total, timeout_s=timeout_s,
                                          progress=progress)
    machine["after"] = _machine()
    machine["foreign_cpu_cores"] = foreign.cores()
    machine["repeats"] = repeats
    figures = {label: _figures(recipe, label, outs) for label, outs in outcomes.items() if outs}
    comparisons = compare(recipe, figures)
    summaries = {label: _per_rank(o.summaries for o in outs) for label, outs in outcomes.items()}
    docs = {label: _per_rank(o.docs for o in outs) for label, outs in outcomes.items()}
    memory = memory_rows(recipe, summaries)
    for emu in recipe.emulated:
        checks += check_figures(recipe, emu, summaries, docs)
        checks += check_memory(recipe, emu, memory)
    result = RecipeResult(recipe=recipe, output=output, outcomes=outcomes, figures=figures, comparisons=comparisons,
                          summary=summarise(comparisons), machine=machine, expectations=checks, memory=memory)
    (output / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def measure_noise(recipe: Recipe, output: Path, *, repeats: int, timeout_s: float = 900.0,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Repeat the real run `repeats` times; the run-to-run spread of each compared rank's median step time
    (with >= 5 repeats the run farthest from the median is discarded: see `noise_spread`)."""
    if repeats < 3:
        raise ValueError("noise: repeats must be >= 3")
    if not recipe.real.exists:
        raise RecipeError(f"recipe {recipe.name} has real: none: no real run to measure the noise of")
    ranks = sorted({ref for emu in recipe.emulated if emu.compare_with == "real"
                    for ref, _ in (emu.ranks or tuple((r, r) for r in emu.real_ranks))})
    medians: dict[int, list[float]] = {r: [] for r in ranks}
    for i in range(repeats):
        plan = real_plan(recipe, Path(output) / f"repeat{i}")
        (outcome,) = execute([plan], steps_total=recipe.steps.total, timeout_s=timeout_s, progress=progress)
        figs = _figures(recipe, "real", [outcome])
        for r in ranks:
            medians[r].append(figs[r].median_step_s)  # one run's median
    discard = 1 if repeats >= 5 else 0
    return {"runs": repeats, "spread_rel": noise_spread(medians, discard=discard), "discarded_runs": discard,
            "untrimmed_spread_rel": noise_spread(medians), "medians_s": {str(r): m for r, m in medians.items()},
            "machine": _machine()}
