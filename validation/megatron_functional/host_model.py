"""A host-time model by kind, fitted on the functional fit rows and checked once on the validate rows.

    python -m validation.megatron_functional.host_model [--out DIR]   # DIR: /tmp/prism_corpus/functional

The virtual clock charges the host one figure per launch (`validation.megatron_functional.fit`). This asks whether
a host that pays by kind explains NVIDIA's iteration times better: per iteration, launches, device ops (views and
metadata ops too), ops inside a backward, and ``nn.Module`` calls by origin, as each run's summary counts them
(``virtual_gpu.host_counts``, `prism_plugin.device.host_counts`).

Method. A functional case is host-bound (`fit`'s docstring), so a host that costs ``h = theta . x`` per iteration
(``x``: the row's counts per iteration, scaled as `fit.fit_row` scales launches) instead of ``c0 x launches``
predicts ``predicted + h - c0 x launches``. For each candidate form (`FORMS`: which counts it pays for) the
coefficients are a non-negative least-squares fit of ``measured - predicted + c0 x launches = theta . x`` on the
fit rows, each row weighted by 1 / measured (relative error). The form is chosen by leave-one-out error on the fit
rows alone; the validate rows are read once, after, for the chosen form and for the current one. Rows are left out
when their counts do not describe every iteration: a fast-forward skipped micro-batches, or CUDA graphs replay
what was counted once at capture. The result is linearised (a row that turns GPU-bound under the new figures
absorbs part of the change): adopting a form means running the rows again under it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from validation.kernels import least_squares
from validation.megatron_functional.fit import CORPUS_RUNS, case_run
from validation.megatron_functional.run import load_cases

__all__ = ["FORMS", "FEATURES", "row_counts", "fit_form", "evaluate", "main"]

FEATURES = ("launches", "non_launch_ops", "forward_ops", "backward_ops", "te_modules", "megatron_modules",
            "other_modules", "iteration")
"""The per-iteration counts a form may pay for (``iteration``: 1, a fixed cost per iteration)."""
FORMS: dict[str, tuple[str, ...]] = {
    "launch": ("launches",),
    "launch+iteration": ("launches", "iteration"),
    "launch+op": ("launches", "non_launch_ops"),
    "forward/backward op": ("forward_ops", "backward_ops"),
    "launch+modules": ("launches", "te_modules", "megatron_modules", "other_modules"),
    "forward/backward op+modules": ("forward_ops", "backward_ops", "te_modules", "megatron_modules"),
    "launch+op+modules": ("launches", "non_launch_ops", "te_modules", "megatron_modules"),
}
"""Candidate host models: the counts each pays a non-negative figure for."""


def row_counts(case: str, role: str, out: Path) -> dict[str, Any] | None:
    """Row `case`'s measured and predicted iteration, the host figure it ran under and its counts per iteration;
    None when it did not run, has no counts, or its counts do not describe every iteration."""
    run = case_run(case, out)
    if run is None:
        return None
    result, summary, scale = run
    gpu = summary["virtual_gpu"]
    counts = gpu.get("host_counts")
    skipped = (summary.get("megatron") or {}).get("fast_forward", {}).get("microbatches_skipped", 0)
    if counts is None or skipped or gpu.get("cuda_graphs"):
        return None
    clock, iterations = gpu["virtual_time"], summary["iterations_marked"]
    per = scale / iterations
    modules = counts["module_calls"]
    launches = clock["launches"] - clock.get("native_launches", 0)
    x = {"launches": per * launches, "non_launch_ops": per * max(counts["device_ops"] - launches, 0),
         "forward_ops": per * (counts["device_ops"] - counts["backward_device_ops"]),
         "backward_ops": per * counts["backward_device_ops"],
         "te_modules": per * modules.get("transformer_engine", 0),
         "megatron_modules": per * modules.get("megatron", 0),
         "other_modules": per * (modules.get("torch", 0) + modules.get("other", 0)), "iteration": scale}
    return {"case": case, "role": role, "measured_s": result["measured_iteration_time_s"],
            "predicted_s": result["predicted_iteration_time_s"], "c0_s": 1e-6 * float(clock["launch_overhead_us"]),
            "x": x}


def _nnls(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin |a theta - b| over theta >= 0, by trying every support (a few columns: exact and cheap)."""
    k = len(a[0])

    def residual(theta: list[float]) -> float:
        return sum((sum(x * t for x, t in zip(row, theta, strict=True)) - y) ** 2 for row, y in zip(a, b, strict=True))

    best, best_res = [0.0] * k, residual([0.0] * k)
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            try:
                sol = least_squares([[row[j] for j in support] for row in a], b)
            except ZeroDivisionError:  # a singular support (a count that is 0 on every row)
                continue
            if any(x < 0 for x in sol):
                continue
            theta = [0.0] * k
            for j, x in zip(support, sol, strict=True):
                theta[j] = x
            res = residual(theta)
            if res < best_res:
                best, best_res = theta, res
    return best


def _target(row: dict[str, Any]) -> float:
    return row["measured_s"] - row["predicted_s"] + row["c0_s"] * row["x"]["launches"]


def fit_form(rows: list[dict[str, Any]], form: tuple[str, ...]) -> dict[str, float]:
    """The form's non-negative figures (seconds per count) fitted on `rows`, relative error weighted."""
    a = [[r["x"][f] / r["measured_s"] for f in form] for r in rows]
    b = [_target(r) / r["measured_s"] for r in rows]
    return dict(zip(form, _nnls(a, b), strict=True))


def predict(row: dict[str, Any], theta: dict[str, float]) -> float:
    """Row's iteration under figures `theta` (linearised: the host-bound change only)."""
    return row["predicted_s"] - row["c0_s"] * row["x"]["launches"] + sum(v * row["x"][f] for f, v in theta.items())


def _errors(rows: list[dict[str, Any]], theta: dict[str, float]) -> list[float]:
    return [100 * (predict(r, theta) / r["measured_s"] - 1) for r in rows]


def _stats(errors: list[float]) -> dict[str, Any]:
    return {"rows": len(errors), "mean_abs_pct": round(statistics.fmean(abs(e) for e in errors), 1),
            "median_abs_pct": round(statistics.median(abs(e) for e in errors), 1),
            "within_10pct": sum(abs(e) <= 10 for e in errors), "max_abs_pct": round(max(map(abs, errors)), 1)}


def evaluate(out: Path) -> dict[str, Any]:
    """Every form's leave-one-out error on the fit rows; the chosen form's and the current model's validate error."""
    rows = [r for case in load_cases() if (r := row_counts(case["case"], case["role"], out)) is not None]
    fit_rows = [r for r in rows if r["role"] == "fit"]
    validate_rows = [r for r in rows if r["role"] == "validate"]
    if len(fit_rows) < 5:
        raise SystemExit(f"{len(fit_rows)} fit rows with host counts in {out}: run `python -m validation.corpus run "
                         "--kind functional` first")
    forms = {}
    for name, form in FORMS.items():
        loo = [_errors([r], fit_form(fit_rows[:i] + fit_rows[i + 1:], form))[0] for i, r in enumerate(fit_rows)]
        forms[name] = {"figures_us": {f: round(1e6 * v, 3) for f, v in fit_form(fit_rows, form).items()},
                       "fit_leave_one_out": _stats(loo)}
    chosen = min(forms, key=lambda n: forms[n]["fit_leave_one_out"]["mean_abs_pct"])
    theta = fit_form(fit_rows, FORMS[chosen])
    current = {"launches": fit_rows[0]["c0_s"]}
    return {"fit_rows": len(fit_rows), "validate_rows": len(validate_rows), "forms": forms, "chosen": chosen,
            "validate": {"chosen": _stats(_errors(validate_rows, theta)),
                         "current": _stats(_errors(validate_rows, current))}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CORPUS_RUNS, help=f"the runs' folder (default {CORPUS_RUNS})")
    ns = parser.parse_args(argv)
    json.dump(evaluate(ns.out), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
