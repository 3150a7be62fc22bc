"""`prism recipe`: run, list, check recipes and measure their real run's noise.

    prism recipe run recipes/toy-tp2-dp2.yaml [more.yaml ...] [--json out.json] [--output DIR]
    prism recipe run toy-tp2 --json                    # the result document on stdout (tables on stderr)
    prism recipe run toy-tp2-dp2                       # a name: looked up in ./recipes, then the repo's recipes/
    prism recipe run                                   # the default recipes, DEFAULT_RECIPES
    prism recipe list [--tier ci|small|benchmark|faults]
    prism recipe check recipes/*.yaml                  # validate only
    prism recipe noise recipes/toy-tp2-dp2.yaml --repeats 5

`run` exits 0 when every comparison is within its tolerances, 1 when one is not, 2 on invalid input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prism_plugin.config.errors import ConfigError
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.plans import PACKAGE_DIR
from prism_plugin.recipes.schema import Recipe, RecipeError, Tier

__all__ = ["DEFAULT_RECIPE", "DEFAULT_RECIPES", "add_recipe_parser", "find_recipe", "recipe_dirs"]

DEFAULT_RECIPE = "toy-tp2"
DEFAULT_RECIPES = (DEFAULT_RECIPE, "virtual-gpu-llama-1b")
"""What `prism recipe run` runs when no recipe is named: the paired CPU fidelity check (real vs emulated), then a
real-size job at target scale on this host (a 1.2 B decoder as rank 5 of 8192 on a virtual H100: exact memory and
the modelled step time)."""
"""What ``prism recipe run`` runs without a recipe argument (the README's first command)."""

console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)
out_console = Console(width=None if Console().is_terminal else 160)


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up: ./recipes, then the repository's recipes/ (next to the package)."""
    dirs = [Path.cwd() / "recipes", PACKAGE_DIR.parent / "recipes"]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d.resolve() not in {x.resolve() for x in dirs[:i]}]


def find_recipe(name_or_path: str) -> Path:
    """A path as given, or ``<dir>/<name>.yaml`` in `recipe_dirs` (RecipeError listing what exists)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise RecipeError(f"no recipe file {str(p)!r}; see `prism recipe list`")
        return p
    for d in recipe_dirs():
        candidate = d / f"{name_or_path}.yaml"
        if candidate.exists():
            return candidate
    known = sorted({f.stem for d in recipe_dirs() for f in d.glob("*.yaml")})
    raise RecipeError(f"no recipe named {name_or_path!r}; known: {', '.join(known) or '(none)'}")


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps"), TimeElapsedColumn(), console=console, transient=True)


def _cmd_run(args: argparse.Namespace) -> int:
    from prism_plugin.recipes.report import expect_table, plot_recipe, result_table, write_index, write_summary
    from prism_plugin.recipes.runner import RunFailed, run_recipe

    names = args.recipes or list(DEFAULT_RECIPES)
    recipes = [load_recipe(find_recipe(x)) for x in names]  # all validated before anything runs
    results = []
    failed_runs = []
    for recipe in recipes:
        out = args.output / recipe.name
        console.print(f"[bold]recipe {recipe.name}[/] ({recipe.framework.value}): real run of "
                      f"{recipe.real.world_size} processes, then {len(recipe.emulated)} emulation(s); output {out}")
        with _progress() as bar:
            tasks: dict[str, Any] = {}

            def progress(label: str, done: int, total: int, _bar: Progress = bar,
                         _tasks: dict[str, Any] = tasks) -> None:
                if label not in _tasks:
                    _tasks[label] = _bar.add_task(label, total=total)
                _bar.update(_tasks[label], completed=done)

            try:
                result = run_recipe(recipe, out, timeout_s=args.timeout, repeats=args.repeats, progress=progress)
            except RunFailed as exc:
                console.print(f"[bold red]recipe {recipe.name}: {exc}")
                failed_runs.append(recipe.name)
                continue
        plots = [] if args.no_plots else plot_recipe(result)
        summary = write_summary(result, plots)
        if result.comparisons:
            console.print(result_table(result))
        expectations = expect_table(result)
        if expectations is not None:
            console.print(expectations)
        console.print(f"report: {summary}")
        results.append(result)
    if len(results) > 1:
        console.print(f"index: {write_index(results, args.output)}")
    if args.json is not None:
        docs = [r.to_dict() for r in results]
        write_json(args.json, docs[0] if len(docs) == 1 and not failed_runs else
                   {"results": docs, "failed_runs": failed_runs})
    if failed_runs:
        return 1
    return 0 if all(r.passed for r in results) else 1


def write_json(dest: Path, doc: Any) -> None:
    """`doc` as indented JSON into `dest`, or on stdout when `dest` is ``-`` (``--json`` without a path: the
    tables and progress are on stderr, so stdout is the document alone)."""
    text = json.dumps(doc, indent=2)
    if str(dest) == "-":
        print(text)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)


def _all_recipes() -> list[Path]:
    seen: dict[str, Path] = {}
    for d in recipe_dirs():
        for f in sorted(d.glob("*.yaml")):
            seen.setdefault(f.stem, f)
    return list(seen.values())


def _cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="recipes")
    for col in ("name", "framework", "tier", "layout", "real", "emulated", "step tol", "file"):
        table.add_column(col)
    bad = 0
    for path in _all_recipes():
        try:
            r = load_recipe(path)
        except ConfigError as exc:  # RecipeError, or a profile / fault spec it names
            table.add_row(path.stem, "-", "-", "-", "-", f"[red]invalid: {exc}", "-", str(path))
            bad += 1
            continue
        if args.tier and r.tier.value != args.tier:
            continue
        lay = r.layout
        layout = " ".join(f"{k}{v}" for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp), ("ep", lay.ep),
                                                 ("vpp", lay.vpp), ("zero", lay.zero_stage)) if v not in (None, 1)
                          or k == "zero" and v is not None) or "dp only"
        emus = ", ".join(f"{e.name}: N={e.world_size} x{len(e.runs)}" for e in r.emulated)
        tol = r.tolerances.step_time_rel
        table.add_row(r.name, r.framework.value, r.tier.value, layout, str(r.real.world_size), emus,
                      "report" if tol is None else f"{100 * tol:.0f}%", _short(path))
    out_console.print(table)
    return 1 if bad else 0


def _short(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _cmd_check(args: argparse.Namespace) -> int:
    for x in args.recipes:
        r: Recipe = load_recipe(find_recipe(x))
        console.print(f"[green]ok[/] {r.name} ({_short(r.source) if r.source else x})")
    return 0


def _cmd_noise(args: argparse.Namespace) -> int:
    from prism_plugin.recipes.runner import measure_noise

    recipe = load_recipe(find_recipe(args.recipe))
    with _progress() as bar:
        task = bar.add_task(f"{recipe.name}: real run x{args.repeats}", total=args.repeats * recipe.real.world_size
                            * recipe.steps.total)
        base = [0]

        def progress(label: str, done: int, total: int) -> None:
            if done >= total:
                base[0] += total
                done = 0
            bar.update(task, completed=base[0] + done)

        noise = measure_noise(recipe, args.output / recipe.name / "noise", repeats=args.repeats,
                              timeout_s=args.timeout, progress=progress)
    factor = recipe.tolerances.noise_factor
    spread = noise["spread_rel"]
    print(json.dumps(noise, indent=2))
    m = noise["machine"]
    console.print(f"paste into {recipe.name}'s tolerances (step_time_rel >= {factor:g} x spread):\n"
                  f"  step_time_rel: {max(0.01, round(factor * spread + 0.005, 2)):.2f}\n"
                  f"  noise: {{runs: {noise['runs']}, spread_rel: {spread:.4f}, measured_on: "
                  f"\"{m['cpus']}-core {m['host']}, load {m['load_average_1m']}, {noise['discarded_runs']} "
                  f"farthest run discarded (untrimmed {noise['untrimmed_spread_rel']:.4f})\"}}")
    return 0


def add_recipe_parser(subparsers: Any) -> None:
    """Add ``prism recipe {run,list,check,noise}`` to the `prism` command's subparsers."""
    rec = subparsers.add_parser("recipe", help="run paired real vs emulated recipes (the fidelity harness)")
    sub = rec.add_subparsers(dest="recipe_command", required=True)
    run = sub.add_parser("run", help="run recipes and compare step time, peak memory and loss")
    run.add_argument("recipes", nargs="*", help=f"recipe files or names (see `prism recipe list`; default "
                                                f"{' then '.join(DEFAULT_RECIPES)})")
    run.add_argument("--output", type=Path, default=Path("prism_output") / "recipes",
                     help="results go to OUTPUT/<recipe>/ (default prism_output/recipes)")
    run.add_argument("--json", type=Path, nargs="?", const=Path("-"), default=None, metavar="PATH",
                     help="also write the result(s) as JSON into PATH; --json alone: on stdout (tables on stderr)")
    run.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default 900)")
    run.add_argument("--repeats", type=int, default=None,
                     help="run the real/emulated sequence this many times, interleaved (default: the recipe's)")
    run.set_defaults(func=_cmd_run)
    lst = sub.add_parser("list", help="list the recipes (./recipes and the repository's recipes/)")
    lst.add_argument("--tier", choices=[t.value for t in Tier], default=None)
    lst.set_defaults(func=_cmd_list)
    chk = sub.add_parser("check", help="validate recipe files without running them")
    chk.add_argument("recipes", nargs="+")
    chk.set_defaults(func=_cmd_check)
    noise = sub.add_parser("noise", help="repeat a recipe's real run and measure its run-to-run step-time noise")
    noise.add_argument("recipe")
    noise.add_argument("--repeats", type=int, default=5)
    noise.add_argument("--output", type=Path, default=Path("prism_output") / "recipes")
    noise.add_argument("--timeout", type=float, default=900.0)
    noise.set_defaults(func=_cmd_noise)
