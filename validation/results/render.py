"""Markdown of the results document from its data: one section per source, tables and conclusions from the rows.

`markdown` takes the loaded data files (`validation.results.load_sources`) and returns ``recipes/RESULTS.md``. Each
section is a short fixed explanation (what the columns mean, how the figures were made), the run's date, command
and host conditions as the data file states them, the table rendered from the rows, and the conclusions computed
from the rows (counts within tolerance, mean errors, ranges): nothing here holds a figure of a run.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["SOURCES", "corpus_markdown", "markdown", "recipe_step_within", "step_tolerance_counts", "within_bound"]

Data = dict[str, Any]
SOURCES = ("recipes", "corpus", "virtual_vs_real", "megatron_functional")
"""The data files (``<source>.json``), in the document's order."""

_TIERS = ("ci", "small", "benchmark", "faults")


def _table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            *("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows)]


def _f(x: Any, spec: str = "") -> str:
    """A figure: ``-`` for none, ``lo-hi`` for a range (a two-element list)."""
    if x is None:
        return "-"
    if isinstance(x, list):
        return "-".join(_f(v, spec) for v in x)
    return format(x, spec)


def _run_line(data: Data) -> str:
    return f"Run: {data['date']}, `{data['command']}`; {data['conditions']}. {data['fitting']}"


def _notes(data: Data) -> list[str]:
    return [f"- {note}" for note in data.get("notes", [])]


# --- recipes ---------------------------------------------------------------------------------------------------


def _errors(cell: Mapping[str, Any] | None) -> list[float]:
    if cell is None:
        return []
    return [float(v) for v in cell["by_rank"]] if "by_rank" in cell else [float(cell["mean"]), float(cell["max"])]


def _mean_err(cell: Mapping[str, Any]) -> float:
    return statistics.fmean(abs(v) for v in cell["by_rank"]) if "by_rank" in cell else float(cell["mean"])


def _max_err(row: Mapping[str, Any]) -> float:
    return max(map(abs, _errors(row["step_err_median_pct"]) + _errors(row["step_err_mean_pct"])), default=0.0)


def recipe_step_within(row: Mapping[str, Any]) -> bool | None:
    """Whether every step-time error the row states is within its step tolerance; None when not checked (no
    tolerance: reported) or no error is stated."""
    stated = row["step_err_median_pct"] or row["step_err_mean_pct"]
    return None if row["step_tol_pct"] is None or not stated else _max_err(row) <= row["step_tol_pct"]


def step_tolerance_counts(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(comparisons within their step tolerance, comparisons checked)."""
    checked = [w for w in map(recipe_step_within, rows) if w is not None]
    return sum(checked), len(checked)


def _step_cell(cell: Mapping[str, Any] | None) -> str:
    if cell is None or "by_rank" in cell:
        return " / ".join(f"r{i} {v:+.1f}%" for i, v in enumerate(cell["by_rank"])) if cell else "-"
    return f"{cell['mean']:.1f}% / {cell['max']:.1f}%"


def _loss_cell(row: Mapping[str, Any]) -> str:
    if row["first_loss_err"] is None:
        return row.get("first_loss_note", "-")
    return "0 (exact)" if row["first_loss_err"] == 0 else f"{row['first_loss_err']:.3g}"


def _recipe_cells(row: Mapping[str, Any]) -> list[str]:
    tol = "report" if row["step_tol_pct"] is None else f"{row['step_tol_pct']:g}%"
    if row.get("step_tol_note"):
        tol += f" ({row['step_tol_note']})"
    verdict = {True: "yes", False: f"NO ({', '.join(row.get('failed_on', []))})", None: "-"}[row["passed"]]
    load = "-" if not row["load_avg"] else "-".join(map(str, row["load_avg"]))
    return [row["recipe"], row["tier"], row["comparison"], str(row["ranks"]), _step_cell(row["step_err_median_pct"]),
            _step_cell(row["step_err_mean_pct"]), _f(row["steady_peak_err_bytes"]),
            _f(row["max_step_peak_err_bytes"]), _loss_cell(row), tol, verdict, row["run"], load]


def _recipe_order(row: Mapping[str, Any]) -> tuple[int, list[Any]]:
    """Tier, then recipe name with its numbers as numbers (megatron-scale-8192 before -65536)."""
    name = [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", row["recipe"])]
    return (_TIERS.index(row["tier"]) if row["tier"] in _TIERS else len(_TIERS), name)


def _recipe_conclusions(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    n = len(rows)
    exact_mem = sum(r["steady_peak_err_bytes"] == 0 for r in rows)
    transients = [f"{r['recipe']} {r['max_step_peak_err_bytes']:+,} B" for r in rows if r["max_step_peak_err_bytes"]]
    stated_loss = [r for r in rows if r["first_loss_err"] is not None]
    inexact: dict[str, list[str]] = {}
    for r in stated_loss:
        if r["first_loss_err"]:
            inexact.setdefault(r["recipe"], []).append(f"{r['first_loss_err']:.3g}")
    n_inexact = sum(map(len, inexact.values()))
    within, checked = step_tolerance_counts(rows)
    misses = [f"{r['recipe']} {r['comparison']} ({_max_err(r):.1f}% against {r['step_tol_pct']:g}%)"
              for r in rows if recipe_step_within(r) is False]
    scale = [r for r in rows if r["recipe"].startswith("megatron-scale") and "vs real" not in r["comparison"]]
    lines = [
        f"- **Memory**: steady-peak error 0 B in {exact_mem} of {n} comparisons (every tier, N up to the scale "
        "recipes' 65,536, DP-sharded optimizers, ZeRO-1/3, MoE, 1F1B and interleaved pipelines)."
        + (f" The highest single step differs in {len(transients)} ({', '.join(transients)}): a timing-dependent "
           "transient of the *real* run (a buffer an in-flight asynchronous collective still holds), which the "
           "steady peak excludes (`prism_plugin/recipes/compare.py`)." if transients else ""),
        f"- **First-step loss**: bit-exact in {len(stated_loss) - n_inexact} of {len(stated_loss)} comparisons "
        "that state it" + ("; not exact: " + "; ".join(f"{k} {', '.join(v)}" for k, v in inexact.items())
                           if inexact else "") + ". Exact wherever the recorded "
        "policy replays the real run's payloads; under mirror a virtual TP peer contributes this rank's partial sums "
        "(the toy), and Megatron at N >= 1024 reads other samples (its mock dataset's shuffle depends on the global "
        "batch): reported, not checked.",
        f"- **Step time**: within the tolerance in {within} of {checked} checked comparisons"
        + (f"; missed: {'; '.join(misses)}" if misses else "") + ". The emulated rank is faster than the real one in "
        "almost every comparison: the real runs put 2 or 4 ranks on 2 cores, and a real rank waits at every "
        "collective for peers the scheduler has descheduled, which an emulated rank, whose virtual peers arrive with "
        "it, never does. The recorded policy's replay (copying every received payload) costs the emulated rank time; "
        "the mirror-policy scale recipes show the emulated step without it.",
    ]
    if scale:
        lines.append("- **Scale**: against the same ranks emulated at N=4, after removing the change in modelled "
                     "communication, the error of the median (mean over ranks) is " + ", ".join(
                         f"{_mean_err(r['step_err_median_pct']):.1f}% at {r['comparison'].split()[0]}" for r in scale)
                     + ", to be read against the run-to-run noise behind each tolerance.")
    return lines


def _recipes(data: Data) -> list[str]:
    rows = sorted(data["rows"], key=_recipe_order)
    runs = {run["id"]: run for run in data["runs"]}
    lines = ["## Measured errors of every recipe", "",
             "Each recipe (`recipes/*.yaml`, schema in `recipes/README.md`) pairs a real small run on this host's CPU "
             "with emulated runs of the same job and compares, per rank, step time, peak memory and the first "
             f"step's loss: every figure measured. Regenerate with `{data['command']}`. Runs (each row names its own; "
             "a recipe re-run replaces its rows):", ""]
    for rid, run in runs.items():
        lines += [f"- {rid}: {run['date']}, `{run['command']}`; {run['conditions']}.",
                  *(f"  - {note}" for note in run.get("notes", []))]
    lines += ["", data["fitting"], "",
              "Columns: step err = |emulated - reference| / reference of the median (and of the mean) step time, "
              "mean / max over the compared ranks (`rN`: rank N's signed error, where a run states it per rank); "
              "steady peak err = emulated - reference bytes of the peak every measured step reaches (the compared "
              "figure); max-step peak err = the same for the highest step (reported); first-loss err = relative "
              "error of the first step's loss; step tol = the step-time tolerance, 2 x the real run's measured noise "
              "(report: not checked); pass = the run's verdict (memory, loss and step time); load avg = the 1-minute "
              "load average before and after the recipe.", ""]
    lines += _table(["recipe", "tier", "emulation vs ref", "ranks", "step err of median: mean / max",
                     "step err of mean: mean / max", "steady peak err B (max)", "max-step peak err B (max)",
                     "first-loss err (max)", "step tol", "pass", "run", "load avg"], "lllrllrrlllll",
                    map(_recipe_cells, rows))
    lines += ["", *_recipe_conclusions(rows)]
    faults = sorted(data.get("fault_rows", []), key=lambda r: r["recipe"])
    if faults:
        lines += ["", "### Fault recipes", "",
                  "Each `tier: faults` recipe injects a fault into an emulated run and states what it must produce "
                  "(`expect`); `checked` is that statement, `measured` what the run produced.", ""]
        lines += _table(["recipe", "fault", "checked", "measured", "run"], "lllll", (
            [r["recipe"], r["fault"], r["checked"], r["measured"] + (" (**fails**)" if r.get("passed") is False
                                                                     else ""), r["run"]] for r in faults))
    return lines


# --- virtual time vs real CPU runs ---------------------------------------------------------------------------------


def within_bound(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(rank comparisons whose |error| is within their bound, rank comparisons)."""
    return sum(abs(r["error_pct"]) <= r["bound_pct"] for r in rows), len(rows)


def _virtual_cells(r: Mapping[str, Any]) -> list[str]:
    return [f"{r['job']}, {r['run']}", str(r["rank"]), ", ".join(f"{m:.3f}" for m in r["real_means_ms"]),
            f"{r['predicted_ms']:.3f}", f"{r['error_pct']:+.1f}% ({r['bound_pct']:g}%)",
            f"{r['recorded_kernels_ms']:.3f} / {_f(r['recorded_comm_ms'], '.3f')} / {r['recorded_per_launch_us']:g} us"]


def _virtual(data: Data) -> list[str]:
    rows = data["rows"]
    ok, n = within_bound(rows)
    errors = [r["error_pct"] for r in rows]
    lines = ["## Virtual time vs real CPU runs", "",
             "Each `tier: ci` recipe's tiny job (and a one-rank toy) is recorded on this CPU (`prism kernels record`), "
             "emulated rank by rank on virtual GPUs with `--kernel-model table`, the recorded host time per launch as "
             "`kernels.launch_overhead_us` and `CUDA_LAUNCH_BLOCKING=1`, and compared with separate real runs. The "
             "recorder alternates timed steps (every op timed under its dispatch mode) with plain steps (the mode off "
             "the dispatch stack) and takes the step, the time inside collective calls and the host time per launch "
             "from the plain steps: under the mode every small op pays a round trip, and a rank so slowed is waited "
             "out in its peer's collectives. With communication the prediction adds the recording's time inside "
             "collective calls to a free-comm run.", "", _run_line(data), "",
             "Columns (ms per step): real means = each rank's mean step after the warm-up, one per real run "
             "(measured); predicted = modelled from the recording; error against the median of the real means; bound "
             "= twice the real runs' spread (trimmed, for 2 ranks), at least 25% with communication, 10% without; "
             "each check gets up to three attempts (`integration_tests/attempts.py`); recorded per step: kernels / "
             "time inside collective calls / host time per launch.", ""]
    lines += _table(["job, run", "rank", "real means of the runs", "predicted", "error (bound)",
                     "recorded per step: kernels / comm / per launch"], "lrlrrl", map(_virtual_cells, rows))
    lines += ["", f"**{ok} of {n} rank comparisons within their bound** (errors {min(errors):+.1f}% .. "
              f"{max(errors):+.1f}%).", "", *_notes(data)]
    return lines


# --- Megatron-LM functional tests ----------------------------------------------------------------------------------


def _stats(name: str, errors: Sequence[float]) -> str:
    values = [abs(e) for e in errors]
    return (f"{name}: mean |error| {statistics.fmean(values):.2f}%, max {max(values):.2f}%, within 1%: "
            f"{sum(v <= 1.0 for v in values)} of {len(values)}.")


def _megatron(data: Data) -> list[str]:
    ran = [r for r in data["rows"] if r["ran"]]
    failed = [r for r in data["rows"] if not r["ran"]]
    lines = ["## Megatron-LM functional tests (DGX H100, core_r0.19.0)", "",
             "Megatron-LM's own functional tests, branch core_r0.19.0: the golden values NVIDIA **measured** on a DGX "
             "H100 (`mem-max-allocated-bytes` and `iteration-time` of the last rank, which logs them) against prism's "
             "**modelled** figures for the same rank on a virtual H100 (dgx-h100 profile, roofline kernel model). "
             "Rows, sources and arguments: `validation/megatron_functional/cases/`.", "",
             _run_line(data) + f" prism at {data['prism_commit']}.", "",
             "- peak allocated: measured, the golden value at step 3 (the running peak over iterations 1-3; fp16 "
             "cases: at the first optimizer step dynamic loss scaling applies, step 17 or 18); predicted, the "
             "allocator model's `allocated_bytes.all.peak` over the 3 iterations, torch's cuBLAS workspaces among "
             "them as on a GPU (one per cuBLAS handle and stream that ran a torch GEMM, forward and autograd threads, "
             "32 MiB each under `CUBLAS_WORKSPACE_CONFIG=:4096:8`, also torch's Hopper default);",
             "- iteration time: measured, the median over Megatron's steady window (steps 30-45, or 5-20 for runs of "
             "25 steps or fewer); predicted, the emulated time of the last complete iteration: of the last rank "
             "alone (`drop-in`: without a pipeline every rank runs the same timeline), or with a pipeline the "
             "execution graph's replay over one profiling run per stage (`emulate`: the last stage waits for the "
             "others, the bubble); a pipelined case whose groups the graph cannot express (an ad-hoc subgroup; "
             "none of these cases since expert groups became roles) is predicted by the drop-in, without the other "
             "stages, and listed below.", ""]
    by_role = sorted(ran, key=lambda r: (r["role"] != "validate", r["case"]))
    lines += _table(["case", "role", "predicted by", "peak allocated, measured (MiB)", "predicted (MiB)",
                     "of which cuBLAS workspaces (MiB)", "error", "iteration time, measured (s)", "predicted (s)",
                     "error"], "lllrrrrrrr", (
        [r["case"], r["role"], r.get("path", "drop-in"), f"{r['measured_peak_allocated_mib']:,.1f}",
         f"{r['predicted_peak_allocated_mib']:,.1f}", f"{r['predicted_cublas_workspace_mib']:,.1f}",
         f"{r['peak_allocated_error_pct']:+.2f}%", f"{r['measured_iteration_time_s']:.4f}",
         f"{r['predicted_iteration_time_s']:.4f}", f"{r['iteration_time_error_pct']:+.2f}%"] for r in by_role))
    if ran:
        lines += ["", f"**{len(ran)} of {len(data['rows'])} cases ran.**"]
        for role in ("validate", "fit"):
            mine = [r for r in ran if r["role"] == role]
            if mine:
                lines += ["", f"- **{role}** rows ({len(mine)}): "
                          + _stats("peak allocated", [r["peak_allocated_error_pct"] for r in mine]) + " "
                          + _stats("iteration time", [r["iteration_time_error_pct"] for r in mine])]
    refused = [r for r in ran if r.get("graph_refusal")]
    if refused:
        lines += ["", f"{len(refused)} pipelined cases predicted by the drop-in, their iteration without the other "
                  f"stages (`prism emulate`: {refused[0]['graph_refusal']}): {', '.join(r['case'] for r in refused)}."]
    if failed:
        reasons: dict[str, list[str]] = {}
        for r in failed:
            reasons.setdefault(r["reason"], []).append(r["case"])
        lines += ["", f"The {len(failed)} cases that did not run, by the first error line of their log:", ""]
        lines += _table(["first error line", "cases"], "ll", (
            [reason, f"{len(cases)}: {', '.join(cases)}"]
            for reason, cases in sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0]))))
    return lines + ["", *_notes(data)]


# --- the validation corpus ------------------------------------------------------------------------------------


def _blank(x: Any, spec: str) -> str:
    """A figure, or nothing for none."""
    return "" if x is None else format(x, spec)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f}"


def _corpus_cells(e: Mapping[str, Any]) -> list[str]:
    measured = _blank(e["measured_step_s"], ".4g") + (" (from tok/s)" if e["measured_step_derived"] else "")
    if e["outcome"] == "ran":
        predicted, error = _blank(e.get("predicted_step_s"), ".4g"), _blank(e.get("step_error_pct"), "+.1f")
    else:
        reason = e.get("reason") or ""
        predicted = e["outcome"] + (f": {reason[:100]}{'...' if len(reason) > 100 else ''}" if reason else "")
        error = ""
    memory = ""
    if e.get("measured_peak_allocated_bytes"):
        memory = f"{_gib(e['measured_peak_allocated_bytes'])} / {_gib(e.get('predicted_peak_allocated_bytes'))}"
        if e.get("memory_error_pct") is not None:
            memory += f" ({e['memory_error_pct']:+.2f}%)"
    computed = ""
    if e["outcome"] != "not run":
        computed = f"{e.get('fingerprint') or 'no fingerprint'} @ {e.get('prism_commit')}"
        computed += f" **stale** ({e['stale_because']})" if e["stale"] else ""
    name = e["row"] + (" (NVIDIA CI: broken)" if e.get("ci_broken") else "")
    return [name, e["role"], e["model"], str(e["gpus"]), e["precision"], e["layout"], measured, predicted, error,
            memory, computed]


def _corpus_summary_line(s: Mapping[str, Any], goal: Mapping[str, float]) -> str:
    head = (f"**{s['role']}** rows: {s['rows']} ({s['current']} with a current result, {s['stale']} stale, "
            f"{s['not_run']} never run; {s['did_not_run']} of the current did not run)")
    if not s["step_rows"]:
        return head + "; no current step-time figure."
    text = (f"{head}; step time over {s['step_rows']}: mean |error| {s['mean_abs_step_error_pct']:.1f}%, max "
            f"{s['max_abs_step_error_pct']:.1f}%, {s['step_within_10_pct']} within 10%")
    if s["memory_rows"]:
        text += f"; peak allocated over {s['memory_rows']}: {s['memory_within_1_pct']} within 1%"
    if s["role"] == "validate":
        holds = (s["mean_abs_step_error_pct"] <= goal["mean_abs_step_error_pct"]
                 and s["max_abs_step_error_pct"] <= goal["max_abs_step_error_pct"])
        text += f". The goal (mean <= 5%, no row beyond 10%) {'holds' if holds else 'does not hold'} on them"
    return text + "."


def corpus_markdown(data: Mapping[str, Any]) -> list[str]:
    """The results document's section of the corpus."""
    lines = ["## Validation corpus", "",
             "One row per measured figure (`validation/corpus/rows/*.yaml`: published H100 training throughputs; "
             "`validation/megatron_functional/cases/*.yaml`: Megatron-LM's H100 functional tests and their golden "
             "values), each with its source, its prism command and a role, `fit` or `validate`. **Measured**: the "
             "source's figures. **Predicted**: modelled by prism (`prism emulate` for a throughput row, the drop-in "
             "as the logging rank for a functional row). Regenerated by one command: "
             f"`{data['command']}` (`--rows GLOB` for some, `--stale` for the stale and never-run ones). A result "
             "computed under another model fingerprint than the current "
             f"(`{data['fingerprint']}`, prism {data['prism_version']}; `validation/corpus/fingerprint.py`), or by "
             "another command than the row's, is **stale**: shown, and left out of the summaries.", "",
             f"{data['fitting']}", "",
             *(f"- {_corpus_summary_line(s, data['goal'])}" for s in data["summaries"]), "",
             "Step: the measured step time (a throughput row that prints only tokens/s/GPU: seq x GBS / (tokens/s/GPU "
             "x GPUs)) against the predicted; error = predicted / measured - 1. Memory: measured / predicted peak "
             "allocated GiB where a measured figure exists. (NVIDIA CI: broken): Megatron-LM's H100 recipe lists the "
             "case only in broken scopes (`mr-broken`, the row's `source.ci_scope`), so its golden values may "
             "predate the branch's code.", ""]
    for series in data.get("weak_scaling", []):
        worst = max(s["miss_points"] for s in series["scales"])
        lines += [f"Weak scaling, {series['model']} {series['precision']} ({series['layout']}, validate rows): per-GPU "
                  f"throughput against {series['base_gpus']} GPUs, measured / predicted: "
                  + ", ".join(f"{s['gpus']} GPUs {s['measured_pct']:+.1f}% / {s['predicted_pct']:+.1f}%"
                              for s in series["scales"])
                  + f"; the predicted trend misses by at most {worst:.1f} points of that percentage (MFU moves by the "
                  "same fraction).", ""]
    by_role = sorted(data["rows"], key=lambda e: (e["role"] != "validate", e["kind"], e["row"]))
    lines += _table(["row", "role", "model", "GPUs", "precision", "layout", "measured step s", "predicted step s",
                     "error %", "peak allocated GiB (measured / predicted)", "model fingerprint @ commit"],
                    "lllrlllrrrl", map(_corpus_cells, by_role))
    classes = [(e["row"], c) for e in data["rows"] for c in e.get("classes", ())]
    if classes:
        lines += ["", "Throughput rows: time and memory per class of ranks (modelled; device total = peak reserved + "
                  "the modelled NCCL buffers + the CUDA context):", ""]
        lines += _table(["row", "class", "step ms", "compute / exposed comm / bubble ms", "peak allocated GiB",
                         "peak reserved GiB", "device total GiB", "fits"], "llrlrrrl",
                        ([name, str(c["class"]), _blank(c["step_ms"], ".1f"),
                          f"{_blank(c['compute_ms'], '.1f')} / {_blank(c['exposed_comm_ms'], '.1f')} / "
                          f"{_blank(c['bubble_ms'], '.1f')}", _gib(c["peak_allocated_bytes"]),
                          _gib(c["peak_reserved_bytes"]), _gib(c["device_total_bytes"]), str(c.get("fits"))]
                         for name, c in classes))
    return lines



# --- the document ------------------------------------------------------------------------------------------------

_HEADER = [
    "# Results",
    "",
    "The latest measured and modelled figures of this project's fidelity checks: the recipes, the validation "
    "corpus, virtual time against real CPU runs, Megatron-LM's functional tests. **Generated** by `python -m "
    "validation.results` from one data file per producer in `validation/results/` (each with its run's date, command "
    "and host conditions); do not edit by hand. A producer's `--write-results` rewrites its data file and this "
    "document; `python -m validation.results --check` says whether this file is current (the unit tests run it). "
    "Earlier figures are in git history (`git log -p -- validation/results`).",
    "",
    "**Measured**: wall-clock times, bytes and losses of real runs on this project's 2-core CPU development VM "
    "(shared with other work, so step times wander with its load), or figures NVIDIA published from its GPUs. "
    "**Modelled**: what the emulator computes (allocator model, cost and kernel models, virtual time).",
]
_SECTIONS = {"recipes": _recipes, "corpus": corpus_markdown, "virtual_vs_real": _virtual,
             "megatron_functional": _megatron}


def markdown(sources: Mapping[str, Data]) -> str:
    """The results document from the data of each source (those present, in `SOURCES` order)."""
    lines = list(_HEADER)
    for name in SOURCES:
        if name in sources:
            lines += ["", *_SECTIONS[name](sources[name])]
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"
