"""Pure comparison of a recipe's runs: per-rank figures, errors against the reference, pass/fail.

Inputs are the probe's metrics documents (`prism_plugin.recipes.probe.METRICS_SCHEMA`), one per rank
and run. Figures per rank, over the measured steps (index >= warm-up): median and mean step time,
modelled communication per step (emulations), peak tensor bytes; and the first-step loss. The peak
compared is the steady one: the bytes every measured step reaches (the lowest of their per-step
peaks). Not part of it: set-up and warm-up transients (a framework's first-step buffers, lazily built
caches), and transients whose lifetime depends on timing: measured here, a buffer an in-flight
asynchronous collective holds a little longer in one step than in another (+15,868 B in some steps of
Megatron TP2's real run, whose backward overlaps the input-gradient all-reduce with the weight-gradient
GEMM; +197,628 B in some steps of plain DeepSpeed ZeRO-1 over gloo). The highest step peak and the
whole-run peak are reported beside it.

Errors: step time ``(emulated - reference) / reference`` for the median and for the mean, after the
optional ``modelled_comm`` adjustment (the emulated step minus the change in mean modelled
communication per step between the two emulations); memory ``emulated - reference`` bytes; loss
``|emulated - reference| / |reference|``, where both runs have a loss on that rank (an earlier
pipeline stage has none; Megatron's logged loss appears only on the rank that logs). A comparison
passes when memory is within ``tolerances.memory_bytes``, the median step time is within ``step_time_rel`` (if
set; the mean is reported: it carries the steps a shared host descheduled, which the spread of repeat medians
does not measure) and the loss within ``loss_rel`` (if set); an emulation whose `loss_rel` is set but none of
whose pairs has a loss on both sides is an error.

Step time is two-sided (`within`): a tolerance ``t`` passes emulated / reference between ``1 / (1 + t)`` and
``1 + t``, so every width fails on both sides (before, ``|error| <= t`` with ``t >= 1`` could never fail low: an
emulated step of 0 passed). Its width is held against the noise measured in the same run: with 3 or more
repeats, each rank's run-to-run spread (`noise_spread` over its repeats' medians). A step time outside the band
but inside the wider band of ``noise_factor`` x the larger spread of the two compared ranks is *noisy*: this run
cannot tell a model error from the machine's noise (``step_ok`` None, ``step_noisy`` True; never a pass). Outside
both, or with no spread measured (fewer than 3 repeats), it fails: the run's noise does not explain it.

Pure: stdlib only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prism_plugin.recipes.schema import Recipe, StepAdjust

__all__ = ["Comparison", "RankFigures", "compare", "noise_spread", "rank_figures", "summarise", "within"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFigures:
    """One rank's figures in one run (measured steps only)."""

    rank: int
    steps: int
    """Optimizer steps per run (each run's probe saw exactly the recipe's steps.total)."""
    step_times_s: tuple[float, ...]
    """Measured step times, every repeat pooled."""
    median_step_s: float
    mean_step_s: float
    modelled_comm_step_s: float | None
    """Mean modelled communication per measured step (None outside an emulation)."""
    peak_bytes: int | None
    """Steady peak: the live tensor bytes every measured step reaches (the lowest of the measured steps'
    peaks, every repeat): what is compared, exactly."""
    max_peak_bytes: int | None
    """The highest measured step's peak (reported): above `peak_bytes` only by transients whose lifetime
    depends on timing, e.g. a buffer an in-flight asynchronous collective still holds."""
    run_peak_bytes: int | None
    """Peak from the program's start to its last step end, warm-up and set-up included (reported)."""
    first_loss: float | None
    repeat_medians_s: tuple[float, ...] = ()
    """The median measured step of each repeat, in run order (the run-to-run noise of this run)."""

    @property
    def noise_rel(self) -> float | None:
        """This rank's run-to-run spread in this run (`noise_spread`); None with fewer than 3 repeats."""
        return noise_spread({self.rank: self.repeat_medians_s}) if len(self.repeat_medians_s) >= 3 else None


def within(ratio: float, tolerance: float) -> bool:
    """Whether emulated / reference `ratio` is within the two-sided `tolerance`: from 1 / (1 + t) to 1 + t.

    >>> within(1.5, 0.5), within(0.7, 0.5), within(0.6, 0.5), within(0.0, 1.53)
    (True, True, False, False)
    """
    return 1.0 / (1.0 + tolerance) <= ratio <= 1.0 + tolerance


def rank_figures(docs: Sequence[Mapping[str, Any]], *, warmup: int, total: int, where: str) -> RankFigures:
    """Figures of one rank from its metrics documents (one per repeat of the run: measured steps pooled).

    ValueError (naming `where`) when a run did not train `total` steps, or repeats disagree on peak memory.
    """
    times: list[float] = []
    comm: list[float | None] = []
    medians: list[float] = []
    for doc in docs:
        steps = doc["steps"]
        if len(steps) != total:
            raise ValueError(f"{where}: rank {doc['rank']} made {len(steps)} optimizer steps, the recipe expects "
                             f"steps.total={total}; check the program's log (an optimizer stepping twice per step, "
                             "or a run that stopped early)")
        measured = [s for s in steps if s["index"] >= warmup]
        times += [float(s["duration_s"]) for s in measured]
        medians.append(statistics.median(float(s["duration_s"]) for s in measured))
        comm += [s.get("modelled_comm_s") for s in measured]
    step_peaks = [s["peak_bytes"] for doc in docs for s in doc["steps"] if s["index"] >= warmup]
    run_peaks = [doc.get("peak_bytes") for doc in docs]
    return RankFigures(
        rank=int(docs[0]["rank"]), steps=total, step_times_s=tuple(times), median_step_s=statistics.median(times),
        mean_step_s=statistics.fmean(times),
        modelled_comm_step_s=None if any(c is None for c in comm) else statistics.fmean(comm),  # type: ignore[arg-type]
        peak_bytes=None if None in step_peaks else min(step_peaks),
        max_peak_bytes=None if None in step_peaks else max(step_peaks),
        run_peak_bytes=None if None in run_peaks else max(run_peaks),  # type: ignore[type-var]
        first_loss=docs[0].get("first_loss"), repeat_medians_s=tuple(medians),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """One emulated rank against its reference rank."""

    emulation: str
    reference: str
    """``real`` or the name of the emulation compared with."""
    reference_rank: int
    emulated_rank: int
    reference_median_s: float
    reference_mean_s: float
    emulated_median_s: float
    """After the adjustment (if any)."""
    emulated_mean_s: float
    adjustment_s: float
    """Subtracted from the emulated step times (modelled_comm adjustment; 0 otherwise)."""
    step_error_median: float
    step_error_mean: float
    reference_peak_bytes: int | None
    emulated_peak_bytes: int | None
    memory_error_bytes: int | None
    """Emulated - reference steady peak (`RankFigures.peak_bytes`): compared with tolerances.memory_bytes."""
    max_peak_error_bytes: int | None
    """Emulated - reference highest step peak (reported: timing-dependent transients)."""
    reference_loss: float | None
    emulated_loss: float | None
    loss_error: float | None
    step_ok: bool | None
    """None: step time not checked (no tolerance), or noisy (`step_noisy`)."""
    memory_ok: bool
    loss_ok: bool | None
    noise_rel: float | None = None
    """The larger run-to-run spread of the two ranks in this run (`RankFigures.noise_rel`; None: < 3 repeats)."""
    step_noisy: bool = False
    """Step time outside the tolerance but inside noise_factor x `noise_rel`: not checkable in this run."""

    @property
    def passed(self) -> bool:
        return self.memory_ok and self.step_ok is not False and self.loss_ok is not False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _rel(a: float, b: float) -> float:
    return (a - b) / b if b else math.inf


def compare(recipe: Recipe, figures: Mapping[str, Mapping[int, RankFigures]]) -> list[Comparison]:
    """Every comparison the recipe asks for; `figures[label][rank]` with label ``real`` or an emulation name."""
    out = []
    for emu in recipe.emulated:
        if emu.expects_failure or emu.compare_with == "none":  # nothing to compare: its expect states what to check
            continue
        tol = recipe.tolerances_for(emu)
        first = len(out)
        pairs = emu.ranks if emu.ranks is not None else tuple((r, r) for r in emu.real_ranks)
        for ref_rank, emu_rank in pairs:
            ref = _lookup(figures, emu.compare_with, ref_rank)
            got = _lookup(figures, emu.name, emu_rank)
            adjust = 0.0
            if emu.step_time_adjust is StepAdjust.MODELLED_COMM:
                if got.modelled_comm_step_s is None or ref.modelled_comm_step_s is None:
                    raise ValueError(f"emulated[{emu.name}]: step_time_adjust needs modelled communication of both "
                                     "emulations (were they run under prism?)")
                adjust = got.modelled_comm_step_s - ref.modelled_comm_step_s
            med, mean = got.median_step_s - adjust, got.mean_step_s - adjust
            err_med, err_mean = _rel(med, ref.median_step_s), _rel(mean, ref.mean_step_s)
            mem_err = max_err = None
            if ref.peak_bytes is not None and got.peak_bytes is not None:
                mem_err = got.peak_bytes - ref.peak_bytes
                max_err = got.max_peak_bytes - ref.max_peak_bytes  # type: ignore[operator]
            loss_err = None
            if ref.first_loss is not None and got.first_loss is not None:
                loss_err = abs(got.first_loss - ref.first_loss) / abs(ref.first_loss) if ref.first_loss else \
                    abs(got.first_loss)
            spreads = [n for n in (ref.noise_rel, got.noise_rel) if n is not None]
            noise = max(spreads) if spreads else None
            step_ok, noisy = None, False
            if tol.step_time_rel is not None:
                inside = within(1 + err_med, tol.step_time_rel)  # the median: what the noise is measured on
                # a miss the run's own noise explains (inside noise_factor x noise, wider than the band) is noisy
                noisy = not inside and noise is not None and within(1 + err_med, tol.noise_factor * noise)
                step_ok = None if noisy else inside
            loss_ok = None
            if tol.loss_rel is not None and loss_err is not None:  # checked where both runs have a loss
                loss_ok = loss_err <= tol.loss_rel
            out.append(Comparison(
                emulation=emu.name, reference=emu.compare_with, reference_rank=ref_rank, emulated_rank=emu_rank,
                reference_median_s=ref.median_step_s, reference_mean_s=ref.mean_step_s, emulated_median_s=med,
                emulated_mean_s=mean, adjustment_s=adjust, step_error_median=err_med, step_error_mean=err_mean,
                reference_peak_bytes=ref.peak_bytes, emulated_peak_bytes=got.peak_bytes, memory_error_bytes=mem_err,
                max_peak_error_bytes=max_err,
                reference_loss=ref.first_loss, emulated_loss=got.first_loss, loss_error=loss_err, step_ok=step_ok,
                noise_rel=noise, step_noisy=noisy,
                memory_ok=mem_err is not None and abs(mem_err) <= tol.memory_bytes, loss_ok=loss_ok,
            ))
        if tol.loss_rel is not None and all(c.loss_error is None for c in out[first:]):
            raise ValueError(f"emulated[{emu.name}]: tolerances.loss_rel is set but no compared rank has a first-step "
                             "loss in both runs (compare a rank that computes the loss, or set loss_rel: null)")
    return out


def _lookup(figures: Mapping[str, Mapping[int, RankFigures]], label: str, rank: int) -> RankFigures:
    try:
        return figures[label][rank]
    except KeyError:
        have = sorted(figures.get(label, {}))
        raise ValueError(f"no metrics for rank {rank} of run {label!r} (have ranks {have}); did the run fail?") \
            from None


def summarise(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """Per emulation: mean and max |step error| (median and mean step time), max |memory error|, pass."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(c.emulation for c in comparisons):
        rows = [c for c in comparisons if c.emulation == name]
        med = [abs(c.step_error_median) for c in rows]
        mean = [abs(c.step_error_mean) for c in rows]
        mem = [abs(c.memory_error_bytes) for c in rows if c.memory_error_bytes is not None]
        max_mem = [abs(c.max_peak_error_bytes) for c in rows if c.max_peak_error_bytes is not None]
        loss = [c.loss_error for c in rows if c.loss_error is not None]
        out[name] = {
            "compared_ranks": len(rows),
            "step_error_median_mean": statistics.fmean(med), "step_error_median_max": max(med),
            "step_error_mean_mean": statistics.fmean(mean), "step_error_mean_max": max(mean),
            "memory_error_bytes_max": max(mem) if mem else None,
            "max_step_peak_error_bytes_max": max(max_mem) if max_mem else None,
            "loss_error_max": max(loss) if loss else None,
            "step_noisy": sum(c.step_noisy for c in rows),
            "passed": all(c.passed for c in rows),
        }
    return out


def noise_spread(medians_by_rank: Mapping[int, Sequence[float]], *, discard: int = 0) -> float:
    """Run-to-run noise: max over ranks of max_i |m_i - median(m)| / median(m), m = one run's median step time,
    after discarding the `discard` runs farthest from the median (a load burst from another user of a shared
    machine: `prism recipe noise` discards 1 of >= 5 runs and reports the untrimmed figure beside it).

    Example: {0: [10.0, 11.0, 9.5]} -> max(0, 1, 0.5) / 10 = 0.1; with discard=1 -> 0.5 / 10 = 0.05.
    """
    spread = 0.0
    for rank, medians in medians_by_rank.items():
        if len(medians) - discard < 2:
            raise ValueError(f"rank {rank}: noise needs >= {discard + 2} runs, got {len(medians)}")
        centre = statistics.median(medians)
        deviations = sorted(abs(m - centre) for m in medians)
        spread = max(spread, deviations[len(deviations) - 1 - discard] / centre)
    return spread
