"""Run recipes (default: the benchmark tier, the scale recipes) and print one JSON object of their errors.

    .venv/bin/python benchmarks/recipes.py [--tier benchmark|small|ci|faults|all] [--output DIR] [names...]

Per recipe and emulation: compared ranks, step-time error of the median and of the mean (mean and max of
|error| over ranks), max |memory error| in bytes, max loss error, pass/fail, wall time; plus the machine's
load average before and after (step times on a shared machine wander with it). Also writes
<output>/index.md and errors.png (the error bars across recipes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prism_plugin.cli.recipes import recipe_dirs
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.report import plot_recipe, write_index, write_summary
from prism_plugin.recipes.runner import RunFailed, run_recipe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", help="recipe names (default: every recipe of --tier)")
    ap.add_argument("--tier", default="benchmark", choices=["ci", "small", "benchmark", "faults", "all"])
    ap.add_argument("--output", type=Path, default=Path("prism_output") / "recipes")
    ap.add_argument("--timeout", type=float, default=1800.0)
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
    print(json.dumps(out, indent=1))
    return 0 if all(r.passed for r in results) and len(results) == len(recipes) else 1


if __name__ == "__main__":
    sys.exit(main())
