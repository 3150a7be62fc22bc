"""Checking what an emulation's faults must produce (`prism_plugin.recipes.schema.Expect`).

Two kinds of expectation:

- a failure (hang, crash, kill): the run (every process of every real-rank set) must end with a non-zero
  exit within ``within_s`` of its start and not before ``after_s``, and its output must contain the
  expected text, e.g. gloo's "Timed out waiting 3000ms for recv operation to complete". `check_failure`
  takes a `FailedRun` (what `prism_plugin.recipes.runner.execute_failing` saw).
- figures of a run that completes (straggler, link, jitter), on every compared emulated rank
  (`check_figures`): from the rank's prism summary (``faults.steps``: per step the wait on faulty ranks and
  the blame chain from this rank to the faulty one), the chain of every delayed step ends at
  ``blame_root``, no step before ``from_step`` waits, and the median over measured steps >= from_step of
  the per-step wait on ``blame_root`` lies in ``wait_ms`` (milliseconds) and, divided by the reference
  run's median step time (the fault-free compute a straggler factor scales), in ``wait_rel``; from the
  probe's metrics, every measured step's modelled communication with the faults' extra cost divided by
  the same step's fault-free modelled communication (``(modelled_comm_s + fault_extra_comm_s) /
  modelled_comm_s``: the session models each op's cost, the faults scale it) lies in ``comm_factor``,
  and those factors spread by at least ``min_comm_spread`` (max - min).

Each check is one `ExpectCheck` row (the result table, result.json). Pure: stdlib only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prism_plugin.recipes.schema import Emulation, Recipe

__all__ = ["ExpectCheck", "FailedRun", "check_failure", "check_figures"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpectCheck:
    """One expectation of one emulation (on one rank, or on the whole run for a failure)."""

    emulation: str
    rank: int | None
    """The emulated rank checked (None: the whole run, failure expectations)."""
    check: str
    """``failure``, ``blame``, ``wait``, ``wait_rel``, ``comm_factor`` or ``comm_spread``."""
    expected: str
    measured: str
    passed: bool
    values: dict[str, Any] = field(default_factory=dict)
    """The raw figures behind `measured` (seconds, factors)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailedRun:
    """How a run that was expected to fail ended."""

    label: str
    wall_s: float
    """From the start of its processes to the end of the last one (or to the stop, when one outlived within_s)."""
    exit_codes: tuple[int | None, ...]
    """Per process; None: still running at within_s (then stopped)."""
    output: str
    """Every process's output (logs concatenated)."""
    logs: tuple[str, ...] = ()
    """The processes' log files."""


def check_failure(emu: Emulation, run: FailedRun) -> ExpectCheck:
    """The run failed as expected: non-zero exit, the expected text, ended in [after_s, within_s]."""
    exp = emu.expect
    assert exp is not None and exp.failure is not None and exp.within_s is not None
    ended = all(c is not None for c in run.exit_codes)
    failed = ended and any(c != 0 for c in run.exit_codes)
    found = exp.failure in run.output
    in_time = ended and exp.after_s <= run.wall_s <= exp.within_s
    if not ended:
        state = f"still running after {exp.within_s:g} s (stopped)"
    else:
        state = f"exit codes {list(run.exit_codes)} after {run.wall_s:.1f} s"
    return ExpectCheck(
        emulation=emu.name, rank=None, check="failure",
        expected=f"fails with {exp.failure!r} in [{exp.after_s:g}, {exp.within_s:g}] s",
        measured=f"{run.label}: {state}; text {'found' if found else 'NOT found'}",
        passed=failed and found and in_time,
        values={"wall_s": round(run.wall_s, 3), "exit_codes": list(run.exit_codes), "text_found": found,
                "logs": list(run.logs)},
    )


def _pairs(emu: Emulation) -> tuple[tuple[int, int], ...]:
    return emu.ranks if emu.ranks is not None else tuple((r, r) for r in emu.real_ranks)


def check_figures(recipe: Recipe, emu: Emulation, summaries: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
                  docs: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]]) -> list[ExpectCheck]:
    """The figure expectations of `emu` on each compared emulated rank.

    `summaries[label][rank]`: that rank's prism summaries (one per repeat); `docs[label][rank]`: its probe
    metrics documents (one per repeat), with label ``real`` or an emulation name.
    """
    exp = emu.expect
    out: list[ExpectCheck] = []
    if exp is None or exp.failure is not None:
        return out
    for ref_rank, rank in _pairs(emu):
        if exp.blame_root is not None:
            out += _check_waits(recipe, emu, rank, summaries.get(emu.name, {}).get(rank, ()),
                                docs.get(emu.compare_with, {}).get(ref_rank, ()))
        if exp.comm_factor is not None:
            out += _check_comm(recipe, emu, rank, docs.get(emu.name, {}).get(rank, ()))
    return out


def _check_waits(recipe: Recipe, emu: Emulation, rank: int, summaries: Sequence[Mapping[str, Any]],
                 refs: Sequence[Mapping[str, Any]]) -> list[ExpectCheck]:
    exp = emu.expect
    assert exp is not None and exp.blame_root is not None
    root = exp.blame_root
    first = max(exp.from_step, recipe.steps.warmup)
    total = recipe.steps.total
    waits: list[float] = []  # per measured step >= from_step, every repeat: seconds waited on root
    roots: set[int] = set()
    early: list[tuple[int, float]] = []  # (step, waited_s) before from_step
    missing = not summaries
    for summary in summaries:
        faults = summary.get("faults")
        if faults is None:
            missing = True
            continue
        by_step = {int(e["step"]): e for e in faults.get("steps", ())}
        for step, e in by_step.items():
            if step >= total:  # after the last iteration mark: the program's closing barrier
                continue
            roots.add(int(e["blame_chain"][-1]))
            if step < exp.from_step and e["waited_s"] > 0:
                early.append((step, float(e["waited_s"])))
        for step in range(first, total):
            e = by_step.get(step)
            waits.append(sum(w["waited_s"] for w in e["waited_on"] if w["rank"] == root) if e else 0.0)
    name = emu.name
    if missing or not waits:
        why = "no faults section in its prism summary" if missing else f"no measured step >= {first}"
        return [ExpectCheck(emulation=name, rank=rank, check="wait", expected=f"waits on rank {root}",
                            measured=why, passed=False)]
    median_s = statistics.median(waits)
    steps = ", ".join(f"{1e3 * w:.1f}" for w in waits)
    blame = ExpectCheck(
        emulation=name, rank=rank, check="blame",
        expected=f"every delayed step blames rank {root}; none before step {exp.from_step}",
        measured=f"blame roots {sorted(roots) or 'none'}"
        + (f"; waits before step {exp.from_step}: {[(s, round(1e3 * w, 2)) for s, w in early]} ms" if early else ""),
        passed=roots == {root} and not early,
        values={"roots": sorted(roots), "early_waits_s": early})
    out = [blame]
    values = {"median_wait_ms": round(1e3 * median_s, 3), "waits_s": [round(w, 6) for w in waits]}
    if exp.wait_ms is not None:
        low, high = exp.wait_ms
        out.append(ExpectCheck(
            emulation=name, rank=rank, check="wait",
            expected=f"median wait on rank {root} per step {first}..{total - 1} in [{low:g}, {high:g}] ms",
            measured=f"{1e3 * median_s:.2f} ms (steps: {steps})", passed=low <= 1e3 * median_s <= high,
            values=values))
    if exp.wait_rel is not None:
        low, high = exp.wait_rel
        ref_times = [float(s["duration_s"]) for doc in refs for s in doc["steps"] if s["index"] >= recipe.steps.warmup]
        ref_s = statistics.median(ref_times) if ref_times else None
        rel = median_s / ref_s if ref_s else None
        measured = "no reference step times" if rel is None or ref_s is None else \
            f"{1e3 * median_s:.2f} ms / {1e3 * ref_s:.2f} ms = {rel:.3f} (steps: {steps} ms)"
        out.append(ExpectCheck(
            emulation=name, rank=rank, check="wait_rel",
            expected=f"median wait on rank {root} / {emu.compare_with}'s median step in [{low:g}, {high:g}]",
            measured=measured, passed=rel is not None and low <= rel <= high,
            values={**values, "reference_median_step_s": ref_s, "wait_rel": rel}))
    return out


def _check_comm(recipe: Recipe, emu: Emulation, rank: int, docs: Sequence[Mapping[str, Any]]) -> list[ExpectCheck]:
    exp = emu.expect
    assert exp is not None and exp.comm_factor is not None
    low, high = exp.comm_factor
    expected = f"modelled comm per step with the faults / without in [{low:g}, {high:g}]"
    factors: list[float] = []
    problem = "" if docs else "no metrics"
    for doc in docs:
        for step in doc["steps"]:
            if step["index"] < recipe.steps.warmup:
                continue
            base, extra = step.get("modelled_comm_s"), step.get("fault_extra_comm_s")
            if base is None or extra is None or base <= 0:
                problem = f"step {step['index']}: modelled communication {base}, faults' extra {extra}"
                break
            factors.append((base + extra) / base)
    if problem or not factors:
        return [ExpectCheck(emulation=emu.name, rank=rank, check="comm_factor", expected=expected,
                            measured=problem or "no measured step", passed=False)]
    spread = max(factors) - min(factors)
    out = [ExpectCheck(
        emulation=emu.name, rank=rank, check="comm_factor", expected=expected,
        measured=f"{min(factors):.4f} .. {max(factors):.4f} over {len(factors)} steps (mean "
                 f"{statistics.fmean(factors):.4f})",
        passed=all(low <= f <= high for f in factors),
        values={"factors": [round(f, 6) for f in factors]})]
    if exp.min_comm_spread:
        out.append(ExpectCheck(
            emulation=emu.name, rank=rank, check="comm_spread",
            expected=f"factors vary by >= {exp.min_comm_spread:g} (max - min)", measured=f"{spread:.4f}",
            passed=spread >= exp.min_comm_spread, values={"spread": round(spread, 6)}))
    return out
