"""The validation table: every row's measured and predicted figures, fit and validate errors apart, stale marked.

`corpus_data` joins each row (the measured figures) with its result (the predicted ones) into the data of the
results document's "Validation corpus" section (``validation/results/corpus.json``);
`validation.results.render.corpus_markdown` renders it.
A result is *stale* when the model fingerprint it was computed under is not the current one, or the row's command
changed since: its figures are shown, marked, and kept out of the error summaries, which count current results
only.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from validation.corpus.fingerprint import model_fingerprint, prism_version
from validation.corpus.rows import ROLES, Row
from validation.corpus.runner import RESULTS_DIR, load_result

__all__ = ["COMMAND", "corpus_data", "row_entry", "stale_because", "summary", "weak_scaling"]

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
    scopes = (row.data.get("source") or {}).get("ci_scope") if row.kind == "functional" else None
    if scopes:
        # NVIDIA's CI lists the case in broken scopes only (``mr-broken``): its golden values may predate the code
        entry["ci_broken"] = all(str(s).endswith("-broken") for s in scopes)
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


def _gbs(layout: str) -> int | None:
    match = re.search(r"\bGBS(\d+)\b", layout)
    return int(match.group(1)) if match else None


def weak_scaling(entries: Sequence[Mapping[str, Any]], role: str = "validate") -> list[dict[str, Any]]:
    """Weak-scaling series among one role's current throughput rows: the same model, precision and layout but for
    the global batch, which grows with the GPUs (the same global batch per GPU, so the same work per GPU), at two
    scales or more. Per scale, the per-GPU throughput against the smallest scale's, measured and predicted, in %
    (``step(smallest) / step(N) - 1``; MFU moves by the same fraction), and the predicted trend's miss in points of
    that percentage.

    >>> e = [{"role": "validate", "kind": "throughput", "outcome": "ran", "stale": False, "model": "m",
    ...       "precision": "bf16", "layout": f"TP4 GBS{4 * n}", "gpus": n, "measured_step_s": m,
    ...       "predicted_step_s": p} for n, m, p in ((16, 2.8, 2.5), (2048, 2.9, 2.5))]
    >>> weak_scaling(e)[0]["scales"][0]
    {'gpus': 2048, 'measured_pct': -3.45, 'predicted_pct': 0.0, 'miss_points': 3.45}
    """
    series: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for e in entries:
        if (e["role"] == role and e["kind"] == "throughput" and e["outcome"] == "ran" and not e["stale"]
                and e.get("predicted_step_s") and e.get("measured_step_s") and _gbs(e["layout"])):
            key = (e["model"], e["precision"], re.sub(r"\bGBS\d+\b", "GBS", e["layout"]), _gbs(e["layout"]) / e["gpus"])
            series.setdefault(key, []).append(e)
    out = []
    for (model, precision, layout, _), members in sorted(series.items()):
        members = sorted(members, key=lambda e: e["gpus"])
        if len({e["gpus"] for e in members}) != len(members) or len(members) < 2:
            continue
        base = members[0]
        scales = []
        for e in members[1:]:
            measured = 100.0 * (base["measured_step_s"] / e["measured_step_s"] - 1.0)
            predicted = 100.0 * (base["predicted_step_s"] / e["predicted_step_s"] - 1.0)
            scales.append({"gpus": e["gpus"], "measured_pct": round(measured, 2), "predicted_pct": round(predicted, 2),
                           "miss_points": round(abs(predicted - measured), 2)})
        out.append({"model": model, "precision": precision, "layout": layout, "base_gpus": base["gpus"],
                    "scales": scales})
    return out


def corpus_data(rows: Sequence[Row], *, results: Path = RESULTS_DIR, date: str) -> dict[str, Any]:
    """``validation/results/corpus.json``: every row with its latest result, and the fit and validate summaries."""
    fingerprint = model_fingerprint()
    entries = [row_entry(r, load_result(r.name, results), fingerprint) for r in rows]
    return {"source": "corpus", "date": date, "command": COMMAND, "prism_version": prism_version(),
            "fingerprint": fingerprint, "goal": GOAL,
            "fitting": "One figure is fitted on rows: the host time per launch (kernels.launch_overhead_us), on the "
                       "functional fit rows' iteration times (python -m validation.megatron_functional.fit). The "
                       "kernel model is the hardware profile's (its H100 attention figures fitted to published "
                       "kernel measurements and its GEMM figures to this project's H200 kernel sweep, "
                       "validation/kernels/, never to a row). Fit rows' errors are reported apart and never called "
                       "validation.",
            "summaries": [summary(entries, role) for role in ROLES], "weak_scaling": weak_scaling(entries),
            "rows": entries}

