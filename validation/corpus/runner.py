"""Predict rows: run each row's prism command and keep its figures, stamped with the model that computed them.

A row's result is ``validation/corpus/results/<row>.json``: the row's command as it ran, the outcome (``ran``,
``out_of_memory``, ``failed``), the predicted figures, the host and wall time, and `validation.corpus.fingerprint`'s
version, commit and model fingerprint. Measured figures are not copied there: the row file is their only home.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from validation.corpus.fingerprint import ROOT, model_fingerprint, prism_commit, prism_version
from validation.corpus.rows import Row

__all__ = ["RESULTS_DIR", "WORK_DIR", "load_result", "run_row", "stamp", "write_result"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORK_DIR = Path("/tmp/prism_corpus")
"""Where the runs write their outputs (profiling runs, graphs, logs); only the results are kept."""


def stamp() -> dict[str, Any]:
    """What computed a result: prism's version and commit, the model fingerprint, the date and the host."""
    return {"prism_version": prism_version(), "prism_commit": prism_commit(), "fingerprint": model_fingerprint(),
            "date": datetime.now(UTC).date().isoformat(),
            "host": {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)}}


def load_result(name: str, folder: Path = RESULTS_DIR) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_result(result: dict[str, Any], folder: Path = RESULTS_DIR) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result['row']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _classes(report: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("class", "rank", "ranks_like_it", "step_ms", "compute_ms", "exposed_comm_ms", "bubble_ms",
            "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "fits", "profiling_run_wall_s")
    return [{k: c.get(k) for k in keys} for c in report["classes"]]


def _out_of_memory(out: Path) -> dict[str, Any] | None:
    """The device figures of the last profiling run under ``out`` when it ran out of the virtual GPU's memory."""
    summaries = sorted(out.glob("run*/rank*.summary.json"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        return None
    summary = json.loads(summaries[-1].read_text())
    device = max(summary["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])
    if not device["ooms"]:
        return None
    return {"rank": summary["rank"], "profiling_run": summaries[-1].parent.name,
            "iteration": summary["iterations_marked"] + 1, "failed_request_bytes": device["ooms"][0]["alloc_size"],
            **{key: device[key] for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes")}}


def _run_throughput(row: Row, work: Path, progress: Callable[[str], None], jobs: int = 1) -> dict[str, Any]:
    from prism_plugin.cli.emulate import emulate
    from prism_plugin.config.errors import ConfigError

    out = work / row.name
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **row.env}
    try:
        report = emulate(list(row.argv), world_size=row.gpus, profile=row.data["hardware"]["profile"], out=out,
                         overwrite=True, warmup=1, env=env, jobs=jobs,
                         progress=lambda text: progress(f"[{row.name}] {text}"))
    except ConfigError as exc:
        return {"outcome": "failed", "reason": f"refused: {str(exc).splitlines()[0]}"}
    except RuntimeError as exc:
        oom = _out_of_memory(out)
        if oom is not None:
            return {"outcome": "out_of_memory", "reason": f"rank {oom['rank']} runs out of the GPU's memory in "
                    f"iteration {oom['iteration']}", "out_of_memory": oom}
        return {"outcome": "failed", "reason": str(exc).splitlines()[0]}
    classes = _classes(report)
    return {"outcome": "ran", "predicted": {
        "step_s": report["step_ms"] / 1000, "tokens_per_s_per_gpu": report["tokens_per_s_per_gpu"],
        "model_tflops_per_s_per_gpu": report["model_tflops_per_s_per_gpu"], "mfu": report["mfu"],
        "model_flops_per_iteration": report["model_flops_per_iteration"],
        "peak_allocated_bytes": max(c["peak_allocated_bytes"] for c in classes)},
        "kernel_model": report["kernel_model"], "profiling_runs": report["profiling_runs"], "classes": classes}


def _run_functional(row: Row, work: Path, timeout_s: float) -> dict[str, Any]:
    from validation.megatron_functional.run import CaseStatus, run_case

    result = run_case(dict(row.data), work / "functional", timeout_s=timeout_s, prism_root=ROOT)
    if result.status is not CaseStatus.OK:
        return {"outcome": "failed", "reason": result.reason}
    return {"outcome": "ran", "predicted": {
        "step_s": result.predicted_iteration_time_s, "peak_allocated_bytes": result.predicted_peak_allocated_bytes,
        "cublas_workspace_bytes": result.predicted_cublas_workspace_bytes}, "path": result.path,
        **({"graph_refusal": result.graph_refusal} if result.graph_refusal else {})}


def run_row(row: Row, *, work: Path = WORK_DIR, timeout_s: float = 3600.0, jobs: int = 1,
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one row's prediction and return its result (`write_result` keeps it). `jobs`: a throughput row's
    profiling runs at a time (the prediction does not depend on it)."""
    before = stamp()
    start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    if row.kind == "throughput":
        body = _run_throughput(row, work, progress, jobs)
    else:
        body = _run_functional(row, work, timeout_s)
    return {"row": row.name, "kind": row.kind, "command": row.command, **before,
            "wall_s": round(time.monotonic() - start, 1), **body}
