"""The validation table: every row's measured and predicted figures, fit and validate errors apart, stale marked.

`corpus_data` joins each row (the measured figures) with its result (the predicted ones) into the data of the
results document's "Validation corpus" section (``validation/results/corpus.json``); `corpus_markdown` renders it.
A result is *stale* when the model fingerprint it was computed under is not the current one, or the row's command
changed since: its figures are shown, marked, and kept out of the error summaries, which count current results
only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from validation.corpus.fingerprint import model_fingerprint, prism_version
from validation.corpus.rows import ROLES, Row
from validation.corpus.runner import RESULTS_DIR, load_result
from validation.results.render import _table

__all__ = ["COMMAND", "corpus_data", "corpus_markdown", "row_entry", "stale_because", "summary"]

COMMAND = "python -m validation.corpus run --write-results"
GOAL = {"mean_abs_step_error_pct": 5.0, "max_abs_step_error_pct": 10.0, "max_abs_memory_error_pct": 1.0}
"""Issue 21's goal on the validate rows: step time mean |error| <= 5%, no row beyond 10%; peak allocated within 1%."""


def _pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    return round(100.0 * (predicted / measured - 1.0), 2)


def stale_because(row: Row, result: Mapping[str, Any], fingerprint: str) -> str | None:
    """Why a result no longer stands for its row: computed under another model, or by another command than the
    row's (None: current)."""
    if result.get("fingerprint") != fingerprint:
        return "model"
    if result.get("command") != row.command:
        return "command"
    return None


def row_entry(row: Row, result: Mapping[str, Any] | None, fingerprint: str) -> dict[str, Any]:
    """One row of the table: the row's measured figures, its result's predicted ones and their errors."""
    entry: dict[str, Any] = {
        "row": row.name, "kind": row.kind, "role": row.role, "model": row.model, "gpus": row.gpus,
        "precision": row.precision, "layout": row.layout, "source": row.source,
        "measured_step_s": row.measured_step_s, "measured_step_derived": row.measured_step_derived,
        "measured_tokens_per_s_per_gpu": row.measured_tokens_per_s_per_gpu,
        "measured_peak_allocated_bytes": row.measured_peak_allocated_bytes,
        "outcome": "not run", "stale": False}
    if result is None:
        return entry
    predicted = result.get("predicted") or {}
    entry.update(outcome=result["outcome"], reason=result.get("reason"), fingerprint=result.get("fingerprint"),
                 prism_commit=result.get("prism_commit"), date=result.get("date"), wall_s=result.get("wall_s"),
                 stale=stale_because(row, result, fingerprint) is not None,
                 stale_because=stale_because(row, result, fingerprint),
                 predicted_step_s=predicted.get("step_s"),
                 predicted_tokens_per_s_per_gpu=predicted.get("tokens_per_s_per_gpu"),
                 predicted_peak_allocated_bytes=predicted.get("peak_allocated_bytes"),
                 step_error_pct=_pct(predicted.get("step_s"), row.measured_step_s),
                 memory_error_pct=_pct(predicted.get("peak_allocated_bytes"), row.measured_peak_allocated_bytes))
    if result.get("classes"):
        entry["classes"] = result["classes"]
    return entry


def summary(entries: Sequence[Mapping[str, Any]], role: str) -> dict[str, Any]:
    """The error figures of one role's rows with a current result (stale ones counted apart)."""
    mine = [e for e in entries if e["role"] == role]
    current = [e for e in mine if e["outcome"] != "not run" and not e["stale"]]
    steps = [abs(e["step_error_pct"]) for e in current if e.get("step_error_pct") is not None]
    memory = [abs(e["memory_error_pct"]) for e in current if e.get("memory_error_pct") is not None]
    out: dict[str, Any] = {
        "role": role, "rows": len(mine), "current": len(current),
        "stale": sum(e["stale"] for e in mine), "not_run": sum(e["outcome"] == "not run" for e in mine),
        "did_not_run": sum(e["outcome"] in ("failed", "out_of_memory") for e in current),
        "step_rows": len(steps), "memory_rows": len(memory)}
    if steps:
        out.update(mean_abs_step_error_pct=round(statistics.fmean(steps), 2), max_abs_step_error_pct=max(steps),
                   step_within_10_pct=sum(s <= 10 for s in steps))
    if memory:
        out.update(max_abs_memory_error_pct=max(memory), memory_within_1_pct=sum(m <= 1 for m in memory))
    return out


def corpus_data(rows: Sequence[Row], *, results: Path = RESULTS_DIR, date: str) -> dict[str, Any]:
    """``validation/results/corpus.json``: every row with its latest result, and the fit and validate summaries."""
    fingerprint = model_fingerprint()
    entries = [row_entry(r, load_result(r.name, results), fingerprint) for r in rows]
    return {"source": "corpus", "date": date, "command": COMMAND, "prism_version": prism_version(),
            "fingerprint": fingerprint, "goal": GOAL,
            "fitting": "No row is fitted on: the kernel model is the hardware profile's (its H100 attention figures "
                       "fitted to published kernel measurements, validation/kernels/, never to a row). Rows marked fit "
                       "may be used by a fit; their errors are reported apart and never called validation.",
            "summaries": [summary(entries, role) for role in ROLES], "rows": entries}


def _f(x: Any, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f}"


def _cells(e: Mapping[str, Any]) -> list[str]:
    measured = _f(e["measured_step_s"], ".4g") + (" (from tok/s)" if e["measured_step_derived"] else "")
    if e["outcome"] == "ran":
        predicted, error = _f(e.get("predicted_step_s"), ".4g"), _f(e.get("step_error_pct"), "+.1f")
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
    return [e["row"], e["role"], e["model"], str(e["gpus"]), e["precision"], e["layout"], measured, predicted, error,
            memory, computed]


def _summary_line(s: Mapping[str, Any], goal: Mapping[str, float]) -> str:
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
             *(f"- {_summary_line(s, data['goal'])}" for s in data["summaries"]), "",
             "Step: the measured step time (a throughput row that prints only tokens/s/GPU: seq x GBS / (tokens/s/GPU "
             "x GPUs)) against the predicted; error = predicted / measured - 1. Memory: measured / predicted peak "
             "allocated GiB where a measured figure exists.", ""]
    by_role = sorted(data["rows"], key=lambda e: (e["role"] != "validate", e["kind"], e["row"]))
    lines += _table(["row", "role", "model", "GPUs", "precision", "layout", "measured step s", "predicted step s",
                     "error %", "peak allocated GiB (measured / predicted)", "model fingerprint @ commit"],
                    "lllrlllrrrl", map(_cells, by_role))
    classes = [(e["row"], c) for e in data["rows"] for c in e.get("classes", ())]
    if classes:
        lines += ["", "Throughput rows: time and memory per class of ranks (modelled; device total = peak reserved + "
                  "the modelled NCCL buffers + the CUDA context):", ""]
        lines += _table(["row", "class", "step ms", "compute / exposed comm / bubble ms", "peak allocated GiB",
                         "peak reserved GiB", "device total GiB", "fits"], "llrlrrrl",
                        ([name, str(c["class"]), _f(c["step_ms"], ".1f"),
                          f"{_f(c['compute_ms'], '.1f')} / {_f(c['exposed_comm_ms'], '.1f')} / "
                          f"{_f(c['bubble_ms'], '.1f')}", _gib(c["peak_allocated_bytes"]),
                          _gib(c["peak_reserved_bytes"]), _gib(c["device_total_bytes"]), str(c.get("fits"))]
                         for name, c in classes))
    return lines

