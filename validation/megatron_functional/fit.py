"""Fit a hardware profile's host time per launch on the functional-test fit rows' iteration times.

    python -m validation.megatron_functional.fit [--out DIR]   # DIR: /tmp/prism_corpus/functional by default

The fit rows are the cases whose row file says ``role: fit`` (`collect.role`: every third case by name, a split
declared before anything was fitted). ``DIR`` holds their runs, as `run` writes them (``<case>.result.json`` and
``<case>/rank<R>.summary.json``). Prints one JSON object: per fit row, its measured and predicted iteration time,
its launches per iteration and the host time per launch that would make them equal; then the fitted figure. The
validate rows are not read.

Mechanism. These cases are small models (hidden 512-1024, a few thousand kernels of microseconds each per
iteration): on an H100 the GPU waits for the host, so an iteration lasts as long as the host takes to issue it. The
virtual clock charges the host ``kernels.launch_overhead_us`` per launch (a kernel, a collective or a copy:
``virtual_gpu.virtual_time.launches``, less the ``native_launches`` after the first of one TransformerEngine
extension call, which pay the driver's ``kernels.native_launch_us``); the rest of a host-bound iteration is the
host's waits at its synchronisations. Raising the figure from ``c`` to ``c'`` lengthens a host-bound iteration by
``(c' - c)`` times its launches (a pipelined case, predicted by the replay over every stage: the last stage's
launches times the replay's step over that stage's own, the critical path's share beyond it), so the figure that
makes row ``i``'s prediction its measured time is ``c_i = c + (measured_i - predicted_i) / launches_i``. The fit is
the median of ``c_i`` over the fit rows: robust to the rows whose measured time holds more than host time (NVIDIA's
runs of identical programs differ by up to 60% between cases). A row still GPU-bound under ``c`` absorbs part of a
rise, so its ``c_i`` overstates the figure: run the fit rows again under the new figure and fit again, until it
moves by less than `TOLERANCE_US` (``converged``).

What the figure stands for: everything the host spends per launch in Megatron-LM and TransformerEngine's Python,
PyTorch's dispatcher and autograd engine, and the CUDA driver, on the host of NVIDIA's CI (a DGX H100's Xeon
8480C, 8 ranks to a node). One figure per host, not per op: the model's limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from validation.corpus.runner import WORK_DIR
from validation.megatron_functional.run import DEFAULT_OUT, last_stage, load_cases

__all__ = ["TOLERANCE_US", "case_run", "fit_row", "fit", "main"]

CORPUS_RUNS = WORK_DIR / "functional"
"""Where the corpus's one command runs the functional cases (the fit's default input)."""
TOLERANCE_US = 1.0
"""The fit has converged when the fitted figure is within this of the one the rows ran under."""


def case_run(case: str, out: Path) -> tuple[dict[str, Any], dict[str, Any], float] | None:
    """A case's run in `out`: its result, the summary of the rank it was predicted from, and the scale from that
    rank's own iteration to the predicted one (a pipelined case: the last stage's profiling run, scaled to the
    replay's critical path; else 1); None when it did not run."""
    result_path = out / f"{case}.result.json"
    if not result_path.is_file():
        return None
    result = json.loads(result_path.read_text())
    if result["status"] != "ok":
        return None
    if result.get("path") == "emulate":
        report = json.loads((out / case / "emulate.json").read_text())
        _, summary_path = last_stage(report, out / case)
        summary = json.loads(summary_path.read_text())
        steps = summary["virtual_gpu"]["virtual_time"]["step_times_s"]
        return result, summary, report["replay"]["step_us"] / 1e6 / steps[-1]
    summaries = sorted((out / case).glob("rank*.summary.json"))
    if not summaries:
        return None
    return result, json.loads(summaries[0].read_text()), 1.0


def fit_row(case: str, out: Path) -> dict[str, Any] | None:
    """One fit row's figures from its run in `out`; None when it did not run."""
    run = case_run(case, out)
    if run is None:
        return None
    result, summary, scale = run
    clock = summary["virtual_gpu"]["virtual_time"]
    # the launches that pay the figure: not those after the first of one TE extension call (the driver's figure)
    launches = scale * (clock["launches"] - clock.get("native_launches", 0)) / summary["iterations_marked"]
    measured, predicted = result["measured_iteration_time_s"], result["predicted_iteration_time_s"]
    used_us = float(clock["launch_overhead_us"])
    return {"case": case, "measured_s": measured, "predicted_s": predicted, "launches_per_iteration": round(launches),
            "launch_overhead_us": used_us,
            "implied_launch_overhead_us": round(used_us + 1e6 * (measured - predicted) / launches, 3)}


def fit(out: Path) -> dict[str, Any]:
    """The fitted host time per launch (µs) from the fit rows' runs in `out`, with each row's figures."""
    cases = [row["case"] for row in load_cases() if row["role"] == "fit"]
    rows = [r for r in (fit_row(case, out) for case in cases) if r is not None]
    if not rows:
        raise SystemExit(f"no fit row has a run in {out}: run `python -m validation.megatron_functional.run "
                         f"--cases {' '.join(cases)} --out {out}` first")
    used = {r["launch_overhead_us"] for r in rows}
    if len(used) != 1:
        raise SystemExit(f"the fit rows in {out} ran under different host times per launch {sorted(used)}: "
                         "run them again under one profile")
    (used_us,) = used
    fitted = round(statistics.median(r["implied_launch_overhead_us"] for r in rows), 1)
    errors = [100 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    return {"fit_rows": len(cases), "ran": len(rows), "not_ran": sorted(set(cases) - {r["case"] for r in rows}),
            "launch_overhead_us_used": used_us,
            "fit_error_mean_abs_pct": round(statistics.fmean(abs(e) for e in errors), 2),
            "fitted_launch_overhead_us": fitted, "converged": abs(fitted - used_us) < TOLERANCE_US, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CORPUS_RUNS,
                        help=f"the runs' folder (default {CORPUS_RUNS}, where `python -m validation.corpus run --kind "
                        f"functional` puts them; `run.py`'s own default is {DEFAULT_OUT})")
    ns = parser.parse_args(argv)
    json.dump(fit(ns.out), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
