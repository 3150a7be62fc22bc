"""Reports of recipe results: the rich table, PNG plots (matplotlib) and a Markdown summary linking them.

Per recipe (under its output folder): ``step_time.png`` (median step time, reference vs emulated, the
emulated bar split into modelled communication and the rest), ``memory.png`` (live tensor bytes over
time of each compared pair, step ends marked), ``errors.png`` (step-time error per emulation with its
spread over ranks, and the tolerance), ``summary.md``. Across recipes (`write_index`): ``errors.png``
and ``index.md`` in the parent folder.

matplotlib is optional (the ``reports`` extra): without it plots are skipped and the Markdown says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from prism_plugin.recipes.memory import gib
from prism_plugin.recipes.runner import RecipeResult

__all__ = ["expect_table", "memory_table", "plot_recipe", "result_table", "write_index", "write_summary"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _bytes(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _verdict(ok: bool | None) -> str:
    return "[green]pass[/]" if ok else ("[dim]report[/]" if ok is None else "[bold red]FAIL[/]")


def _step_verdict(c: Any) -> str:
    return "[yellow]noisy[/]" if c.step_noisy else _verdict(c.step_ok)


def band(tolerance: float) -> str:
    """The two-sided step-time band of `tolerance` (`compare.within`) as errors.

    >>> band(0.73)
    '-42%..+73%'
    """
    return f"-{100 * (1 - 1 / (1 + tolerance)):.0f}%..+{100 * tolerance:.0f}%"


def _tol_text(tol: Any) -> str:
    step = "report" if tol.step_time_rel is None else band(tol.step_time_rel)
    loss = "report" if tol.loss_rel is None else ("exact" if tol.loss_rel == 0 else f"{tol.loss_rel:g}")
    noise = "" if tol.noise is None else f" (noise {100 * tol.noise.spread_rel:.1f}%/{tol.noise.runs} runs)"
    return f"mem {tol.memory_bytes} B, step {step}{noise}, loss {loss}"


def result_table(result: RecipeResult) -> Table:
    """One row per compared pair: step times and errors, peak bytes, first loss, verdicts."""
    r = result.recipe
    table = Table(title=f"recipe {r.name}: emulated vs reference ({'PASS' if result.passed else 'FAIL'})")
    for c in ("pair", "median ms ref / emu", "err median", "err mean", "steady peak B ref", "mem err B",
              "max-step err B", "first loss ref / emu", "step", "mem", "loss"):
        table.add_column(c, justify="left" if c == "pair" else "right")
    for c in result.comparisons:
        adjusted = " adj" if c.adjustment_s else ""
        table.add_row(f"{c.emulation} vs {c.reference} {c.reference_rank}->{c.emulated_rank}",
                      f"{_ms(c.reference_median_s)} / {_ms(c.emulated_median_s)}{adjusted}",
                      _pct(c.step_error_median), _pct(c.step_error_mean), _bytes(c.reference_peak_bytes),
                      _bytes(c.memory_error_bytes), _bytes(c.max_peak_error_bytes),
                      f"{_loss(c.reference_loss)} / {_loss(c.emulated_loss)}",
                      _step_verdict(c), _verdict(c.memory_ok), _verdict(c.loss_ok))
    tols = "; ".join(f"{e.name}: {_tol_text(r.tolerances_for(e))}" for e in r.emulated)
    noise = [c.noise_rel for c in result.comparisons if c.noise_rel is not None]
    measured = f"; noise in this run up to {100 * max(noise):.1f}% ({result.machine.get('repeats')} repeats)" \
        if noise else ""
    table.caption = (f"tolerances {tols}. Steps {r.steps.total} ({r.steps.warmup} warm-up){measured}; "
                     f"load average {result.machine.get('before', {}).get('load_average_1m')}"
                     + ("; noisy: step time outside the tolerance but inside noise_factor x this run's noise "
                        "(not checkable here; never a pass)" if result.noisy else ""))
    return table


def memory_table(result: RecipeResult) -> Table | None:
    """Virtual-GPU memory, one row per rank and device (GiB and bytes); None without virtual-GPU emulations."""
    if not result.memory:
        return None
    table = Table(title=f"recipe {result.recipe.name}: virtual-GPU memory (modelled caching allocator)")
    for c in ("emulation", "rank", "device", "peak allocated", "peak reserved", "fragmentation", "device total",
              "GPU", "fits", "OOMs", "emulated step"):
        table.add_column(c, justify="left" if c in ("emulation", "GPU") else "right")
    for m in result.memory:
        table.add_row(m.emulation, str(m.rank), f"cuda:{m.device}" + ("" if m.own_device else " (other)"),
                      f"{gib(m.peak_allocated_bytes)} GiB\n{m.peak_allocated_bytes:,} B",
                      f"{gib(m.peak_reserved_bytes)} GiB\n{m.peak_reserved_bytes:,} B",
                      f"{100 * m.fragmentation_at_peak:.2f}%",
                      f"{gib(m.device_total_bytes)} GiB\n{m.device_total_bytes:,} B",
                      f"{m.gpu}\n{gib(m.gpu_memory_bytes)} GiB", "[green]yes[/]" if m.fits else "[bold red]no[/]",
                      str(m.ooms), _emulated(m.emulated_step_s))
    table.caption = ("device total = peak reserved + CUDA context; fits = device total <= the GPU's memory and no "
                     "OOM; emulated step = virtual time (kernel model + cost model on emulated CUDA streams: "
                     "modelled, not measured)")
    return table


def _emulated(step_s: float | None) -> str:
    return "n/a" if step_s is None else f"{1e3 * step_s:.3f} ms"


def expect_table(result: RecipeResult) -> RenderableType | None:
    """One row per expectation (`prism_plugin.recipes.expect`, `.memory`), below the virtual-GPU memory table when
    there is one (`memory_table`); None when the recipe states none."""
    memory = memory_table(result)
    if not result.expectations:
        return memory
    verdict = "PASS" if result.passed else "FAIL"
    what = "the faults" if any(e.faults for e in result.recipe.emulated) else "the emulations"
    table = Table(title=f"recipe {result.recipe.name}: what {what} must produce ({verdict})")
    for c in ("emulation", "rank", "check", "expected", "measured", "verdict"):
        table.add_column(c)
    for e in result.expectations:
        table.add_row(e.emulation, "run" if e.rank is None else str(e.rank), e.check, e.expected, e.measured,
                      _verdict(e.passed))
    faults = "; ".join(f"{emu.name}: {', '.join(emu.faults)}" for emu in result.recipe.emulated if emu.faults)
    table.caption = f"faults {faults}" if faults else None
    return table if memory is None else Group(memory, table)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_recipe(result: RecipeResult) -> list[Path]:
    """The recipe's three PNGs (empty list when matplotlib is missing)."""
    plt = _pyplot()
    if plt is None or not result.comparisons:
        return []
    out = result.output
    paths = [out / "step_time.png", out / "memory.png", out / "errors.png"]
    _plot_step_times(plt, result, paths[0])
    _plot_memory(plt, result, paths[1])
    _plot_errors(plt, [result], paths[2])
    return paths


def _plot_step_times(plt: Any, result: RecipeResult, path: Path) -> None:
    comps = result.comparisons
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(comps) + 2), 4.0))
    xs = range(len(comps))
    ref = [1e3 * c.reference_median_s for c in comps]
    comm = []
    for c in comps:
        fig_e = result.figures[c.emulation][c.emulated_rank]
        comm.append(1e3 * (fig_e.modelled_comm_step_s or 0.0))
    emu = [1e3 * c.emulated_median_s for c in comps]
    rest = [max(0.0, e - m) for e, m in zip(emu, comm, strict=True)]
    w = 0.38
    ax.bar([x - w / 2 for x in xs], ref, w, label="reference (measured)", color="#4c72b0")
    ax.bar([x + w / 2 for x in xs], rest, w, label="emulated: compute + overhead", color="#dd8452")
    ax.bar([x + w / 2 for x in xs], comm, w, bottom=rest, label="emulated: modelled communication", color="#c44e52")
    ax.set_xticks(list(xs), [f"{c.emulation}\n{c.reference_rank}->{c.emulated_rank}" for c in comps], fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{result.recipe.name}: step time, reference vs emulated")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory(plt: Any, result: RecipeResult, path: Path) -> None:
    comps = result.comparisons[:4]
    fig, axes = plt.subplots(len(comps), 1, figsize=(8.0, 2.6 * len(comps)), squeeze=False)
    for ax, c in zip(axes[:, 0], comps, strict=True):
        for label, rank, style in ((c.reference, c.reference_rank, "-"), (c.emulation, c.emulated_rank, "--")):
            doc = _doc(result, label, rank)
            if doc is None or not doc["timeline"]["t_s"]:
                continue
            t = _step_coordinates(doc["timeline"]["t_s"], [s["end_s"] for s in doc["steps"]])
            ax.step(t, [b / 2**20 for b in doc["timeline"]["live_bytes"]], style, where="post",
                    label=f"{label} rank {rank} (peak {_bytes(doc['peak_bytes'])} B)")
        for k in range(result.recipe.steps.total):
            ax.axvline(k, color="#bbbbbb", linewidth=0.5)
        ax.set_ylabel("live MiB")
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("training step (k = end of step k; -1..0: program start to the end of step 0)")
    axes[0, 0].set_title(f"{result.recipe.name}: live tensor memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _step_coordinates(times: Sequence[float], ends: Sequence[float]) -> list[float]:
    """Map times to step coordinates (runs of different speed line up): end of step k -> k, linear in between;
    from the first time to the end of step 0 -> -1..0. Example: ends [1, 2], t 1.5 -> 0.5."""
    if not ends:
        return list(times)
    import bisect

    start = min(times[0], ends[0]) if times else 0.0
    marks = [start, *ends]
    out = []
    for t in times:
        i = min(max(bisect.bisect_right(marks, t) - 1, 0), len(marks) - 2)
        lo, hi = marks[i], marks[i + 1]
        out.append(i - 1 + (t - lo) / (hi - lo) if hi > lo else float(i))
    return out


def _doc(result: RecipeResult, label: str, rank: int) -> dict[str, Any] | None:
    for o in result.outcomes.get(label, []):
        if rank in o.docs:
            return o.docs[rank]
    return None


def _plot_errors(plt: Any, results: Sequence[RecipeResult], path: Path) -> None:
    names, centre, lo, hi, tols = [], [], [], [], []
    for r in results:
        for emu in r.summary:
            rows = [c for c in r.comparisons if c.emulation == emu]
            errs = [100 * c.step_error_median for c in rows]
            names.append(f"{r.recipe.name}\n{emu}")
            mid = sum(errs) / len(errs)
            centre.append(mid)
            lo.append(mid - min(errs))
            hi.append(max(errs) - mid)
            tol = r.recipe.tolerances_for(r.recipe.emulation(emu)).step_time_rel
            tols.append(None if tol is None else 100 * tol)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.0))
    xs = list(range(len(names)))
    ax.errorbar(xs, centre, yerr=[lo, hi], fmt="o", capsize=4, label="median step-time error (range over ranks)")
    for x, t in zip(xs, tols, strict=True):
        if t is not None:
            ax.hlines([t, -100 * (1 - 1 / (1 + t / 100))], x - 0.35, x + 0.35, colors="#c44e52",
                      linestyles="dashed")
    ax.axhline(0, color="#888888", linewidth=0.8)
    ax.set_xticks(xs, names, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("error (%)")
    ax.set_title("step-time error per recipe (dashed: tolerance)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _md_rows(result: RecipeResult) -> list[str]:
    rows = ["| emulation | ranks | ref median ms | emu median ms | err median | err mean | ref steady peak B "
            "| emu steady peak B | mem err B | max-step peak err B | ref loss | emu loss | pass |", "|" + "---|" * 13]
    for c in result.comparisons:
        rows.append(f"| {c.emulation} vs {c.reference} | {c.reference_rank}->{c.emulated_rank} | "
                    f"{_ms(c.reference_median_s)} | {_ms(c.emulated_median_s)} | {_pct(c.step_error_median)} | "
                    f"{_pct(c.step_error_mean)} | {_bytes(c.reference_peak_bytes)} | {_bytes(c.emulated_peak_bytes)} | "
                    f"{_bytes(c.memory_error_bytes)} | {_bytes(c.max_peak_error_bytes)} | {_loss(c.reference_loss)} | "
                    f"{_loss(c.emulated_loss)} | "
                    f"{'yes' if c.passed else 'NO'} |")
    return rows


def write_summary(result: RecipeResult, plots: Sequence[Path]) -> Path:
    """``summary.md`` of one recipe, linking its plots, metrics and traces (relative links)."""
    r, out = result.recipe, result.output
    tol = r.tolerances
    lines = [f"# Recipe `{r.name}`: {'PASS' if result.passed else 'FAIL'}", "", r.description.strip(), "",
             f"- framework: {r.framework.value}; layout: tp={r.layout.tp} pp={r.layout.pp} cp={r.layout.cp} "
             f"ep={r.layout.ep} vpp={r.layout.vpp} zero={r.layout.zero_stage}",
             f"- real run: {r.real.world_size} processes ({r.real.launcher.value}); steps {r.steps.total}, "
             f"{r.steps.warmup} warm-up",
             f"- tolerances: {_tol_text(tol)}" + ("" if tol.noise is None else f", noise measured on "
                                                             f"{tol.noise.measured_on}"),
             f"- machine: {json.dumps(result.machine)}", ""]
    for emu in r.emulated:
        lines.append(f"- emulation `{emu.name}`: N={emu.world_size}, runs {[list(x) for x in emu.runs]}, profile "
                     f"`{emu.profile}`, policy {emu.data_policy.value}, vs {emu.compare_with}"
                     + (", step time adjusted by modelled communication" if emu.step_time_adjust.value != "none"
                        else "") + ("" if emu.tolerances is None else f"; tolerances {_tol_text(emu.tolerances)}")
                     + (f"; faults `{'`, `'.join(emu.faults)}`" if emu.faults else "")
                     + ("" if emu.timeout is None else f"; timeout {emu.timeout:g} s"))
    lines += ["", *(_md_rows(result) if result.comparisons else ["(nothing compared: every emulation was expected "
                                                                 "to fail or states its own figures)"]), ""]
    if result.memory:
        lines += ["## Virtual-GPU memory", "", "| emulation | rank | device | peak allocated | peak reserved | "
                  "fragmentation at peak | device total | GPU | fits | OOMs | emulated step |", "|" + "---|" * 11]
        lines += [f"| {m.emulation} | {m.rank} | cuda:{m.device}{'' if m.own_device else ' (other)'} | "
                  f"{gib(m.peak_allocated_bytes)} GiB ({m.peak_allocated_bytes:,} B) | "
                  f"{gib(m.peak_reserved_bytes)} GiB ({m.peak_reserved_bytes:,} B) | "
                  f"{100 * m.fragmentation_at_peak:.2f}% | "
                  f"{gib(m.device_total_bytes)} GiB ({m.device_total_bytes:,} B) | "
                  f"{m.gpu}, {gib(m.gpu_memory_bytes)} GiB | {'yes' if m.fits else 'NO'} | {m.ooms} | "
                  f"{_emulated(m.emulated_step_s)} |" for m in result.memory]
        lines += ["", "device total = peak reserved + CUDA context; emulated step = virtual time (modelled).", ""]
    if result.expectations:
        heading = "## Fault expectations" if any(e.faults for e in r.emulated) else "## Expectations"
        lines += [heading, "", "| emulation | rank | check | expected | measured | pass |",
                  "|" + "---|" * 6]
        lines += [f"| {e.emulation} | {'run' if e.rank is None else e.rank} | {e.check} | {e.expected} | "
                  f"{e.measured} | {'yes' if e.passed else 'NO'} |" for e in result.expectations]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    elif not result.comparisons:
        lines += ["(no plots: nothing compared)", ""]
    else:
        lines += ["(plots skipped: install the `reports` extra for matplotlib)", ""]
    lines += ["## Per-rank metrics and Chrome traces (open in chrome://tracing or ui.perfetto.dev)", ""]
    for outs in result.outcomes.values():
        for o in outs:
            for rank in sorted(o.docs):
                rel = (o.folder / "metrics").relative_to(out)
                lines.append(f"- {o.label} rank {rank}: [metrics]({rel}/rank{rank}.metrics.json), "
                             f"[trace]({rel}/rank{rank}.trace.json)")
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_index(results: Sequence[RecipeResult], folder: Path) -> Path:
    """``index.md`` (and ``errors.png``) over several recipes: one line per emulation, linking each summary."""
    folder.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    plot = None
    if plt is not None and any(r.comparisons for r in results):
        plot = folder / "errors.png"
        _plot_errors(plt, results, plot)
    lines = ["# Recipe results", "", "| recipe | emulation | ranks | step err median (mean / max) | "
             "step err mean (mean / max) | mem err max B | loss err max | tolerance | pass |", "|" + "---|" * 9]
    for r in results:
        for emu, s in r.summary.items():
            tol = r.recipe.tolerances_for(r.recipe.emulation(emu)).step_time_rel
            rel = (r.output / "summary.md").relative_to(folder) if r.output.is_relative_to(folder) else r.output
            loss = "-" if s["loss_error_max"] is None else f"{s['loss_error_max']:.2g}"
            lines.append(
                f"| [{r.recipe.name}]({rel}) | {emu} | {s['compared_ranks']} | "
                f"{100 * s['step_error_median_mean']:.1f}% / {100 * s['step_error_median_max']:.1f}% | "
                f"{100 * s['step_error_mean_mean']:.1f}% / {100 * s['step_error_mean_max']:.1f}% | "
                f"{_bytes(s['memory_error_bytes_max'])} | {loss} | "
                f"{'report' if tol is None else band(tol)} | "
                f"{('yes' if not s['step_noisy'] else 'noisy') if s['passed'] else 'NO'} |")
    checks = [(r, e) for r in results for e in r.expectations]
    if checks:
        lines += ["", "| recipe | emulation | rank | check | measured | pass |", "|" + "---|" * 6]
        lines += [f"| {r.recipe.name} | {e.emulation} | {'run' if e.rank is None else e.rank} | {e.check} | "
                  f"{e.measured} | {'yes' if e.passed else 'NO'} |" for r, e in checks]
    if plot is not None:
        lines += ["", f"![errors]({plot.name})"]
    path = folder / "index.md"
    path.write_text("\n".join(lines) + "\n")
    return path
