"""Run recipes (default: the benchmark tier, the scale recipes) and print one JSON object of their errors.

    .venv/bin/python benchmarks/recipes.py [--tier benchmark|small|ci|faults|all] [--output DIR] [--write-results]
        [names...]

Per recipe and emulation: compared ranks, step-time error of the median and of the mean (mean and max of
|error| over ranks), max |memory error| in bytes, max loss error, pass/fail, wall time; plus the machine's
load average before and after (step times on a shared machine wander with it). Also writes
<output>/index.md and errors.png (the error bars across recipes).

``--write-results``: the same figures as rows of ``validation/results/recipes.json`` (one per recipe and
emulation; the fault recipes' checks as fault rows), replacing the rows of every recipe that ran, with this run's
date, command and host load; then regenerates ``recipes/RESULTS.md`` (`validation.results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prism_plugin.cli.recipes import recipe_dirs
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.report import plot_recipe, write_index, write_summary
from prism_plugin.recipes.runner import RecipeResult, RunFailed, run_recipe

ROOT = Path(__file__).resolve().parents[1]


def result_rows(result: RecipeResult) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``validation/results/recipes.json`` of one recipe's run: one per emulation compared (errors in
    percent, bytes, the tolerance, the verdict and what failed, the load before and after), and one per check of
    an emulation with faults."""
    recipe = result.recipe
    load = [result.machine.get(k, {}).get("load_average_1m") for k in ("before", "after")]
    rows = []
    for name, s in result.summary.items():
        emu = recipe.emulation(name)
        comparisons = [c for c in result.comparisons if c.emulation == name]
        tol = recipe.tolerances_for(emu).step_time_rel
        failed = [what for what, bad in (("step", any(c.step_ok is False for c in comparisons)),
                                         ("memory", any(not c.memory_ok for c in comparisons)),
                                         ("loss", any(c.loss_ok is False for c in comparisons))) if bad]
        rows.append({
            "recipe": recipe.name, "tier": recipe.tier.value,
            "comparison": f"{name} vs {emu.compare_with}" + (" (adj)" if emu.step_time_adjust.value != "none" else ""),
            "ranks": s["compared_ranks"],
            "step_err_median_pct": {"mean": round(100 * s["step_error_median_mean"], 2),
                                    "max": round(100 * s["step_error_median_max"], 2)},
            "step_err_mean_pct": {"mean": round(100 * s["step_error_mean_mean"], 2),
                                  "max": round(100 * s["step_error_mean_max"], 2)},
            "steady_peak_err_bytes": s["memory_error_bytes_max"],
            "max_step_peak_err_bytes": s["max_step_peak_error_bytes_max"],
            "first_loss_err": s["loss_error_max"], "step_tol_pct": None if tol is None else round(100 * tol, 1),
            "passed": s["passed"], **({"failed_on": failed} if failed else {}),
            "load_avg": None if None in load else load})
    faults = [{"recipe": recipe.name, "fault": ", ".join(f"`{f}`" for f in recipe.emulation(e.emulation).faults),
               "checked": f"{e.check}{'' if e.rank is None else f' (rank {e.rank})'}: {e.expected}",
               "measured": e.measured, "passed": e.passed}
              for e in result.expectations if recipe.emulation(e.emulation).faults]
    return rows, faults


def write_results(results: list[RecipeResult], argv: list[str]) -> Path:
    """Replace the ran recipes' rows of ``validation/results/recipes.json`` and regenerate recipes/RESULTS.md."""
    sys.path.insert(0, str(ROOT))  # the repository's validation package (this file runs as a script)
    from validation.results import DATA_DIR, merge_recipe_run, write_source

    rows: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    for result in results:
        r, f = result_rows(result)
        rows += r
        faults += f
    loads = [v for r in results for k in ("before", "after")
             if (v := r.machine.get(k, {}).get("load_average_1m")) is not None]
    foreign = [v for r in results if (v := r.machine.get("foreign_cpu_cores")) is not None]
    conditions = f"a host of {os.cpu_count()} CPU cores"
    if loads:
        conditions += f", 1-minute load average {min(loads)}-{max(loads)} (per row: before and after the recipe)"
    if foreign:
        conditions += f", other work's CPU use {min(foreign):.2f}-{max(foreign):.2f} cores (measured by the runner)"
    path = DATA_DIR / "recipes.json"
    data = merge_recipe_run(json.loads(path.read_text()) if path.is_file() else None, {
        "date": datetime.now(UTC).date().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/recipes.py", *argv]), "conditions": conditions}, rows, faults)
    return write_source("recipes", data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", help="recipe names (default: every recipe of --tier)")
    ap.add_argument("--tier", default="benchmark", choices=["ci", "small", "benchmark", "faults", "all"])
    ap.add_argument("--output", type=Path, default=Path("prism_output") / "recipes")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--write-results", action="store_true",
                    help="also write the figures to validation/results/recipes.json and regenerate recipes/RESULTS.md")
    args = ap.parse_args()
    paths = {p.stem: p for d in reversed(recipe_dirs()) for p in d.glob("*.yaml")}
    recipes = [load_recipe(paths[n]) for n in args.names] if args.names else \
        [r for r in (load_recipe(p) for _, p in sorted(paths.items())) if args.tier in ("all", r.tier.value)]
    out: dict[str, object] = {"benchmark": "recipes", "tier": args.tier, "recipes": {}}
    results = []
    for recipe in recipes:
        t0 = time.monotonic()
        try:
            result = run_recipe(recipe, args.output / recipe.name, timeout_s=args.timeout)
        except (RunFailed, ValueError) as exc:
            out["recipes"][recipe.name] = {"error": str(exc)[-2000:]}  # type: ignore[index]
            continue
        write_summary(result, plot_recipe(result))
        results.append(result)
        out["recipes"][recipe.name] = {  # type: ignore[index]
            "passed": result.passed, "wall_s": round(time.monotonic() - t0, 1), "summary": result.summary,
            "load_average_1m": [result.machine[k]["load_average_1m"] for k in ("before", "after")],
            **({"expectations": [e.to_dict() for e in result.expectations]} if result.expectations else {}),
        }
        print(f"{recipe.name}: {'pass' if result.passed else 'FAIL'}", file=sys.stderr, flush=True)
    if results:
        out["index"] = str(write_index(results, args.output))
        if args.write_results:
            out["results"] = str(write_results(results, sys.argv[1:]))
    print(json.dumps(out, indent=1))
    return 0 if all(r.passed for r in results) and len(results) == len(recipes) else 1


if __name__ == "__main__":
    sys.exit(main())
