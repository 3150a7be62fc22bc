"""Run Megatron-LM's H100 functional-test cases on a virtual H100 and compare with NVIDIA's golden values.

    python -m validation.megatron_functional.run [--cases NAME|GLOB ...] [--out DIR] [--timeout S]
        [--table-only] [--write-results [RESULTS_MD]] [--prism-root CHECKOUT]

Each case (``cases/<case>.yaml``, written by `collect`) runs its own arguments through the Megatron drop-in
(``python -m prism_plugin.megatron prism_plugin/programs/pretrain_gpt.py <args> --prism-world-size W
--prism-real-ranks W-1 --prism-profile dgx-h100 --prism-device virtual-gpu``), one real process playing the
last rank (the rank that logged the golden figures), with the case's ``ENV_VARS`` and ``--train-iters 3``
(`collect.TRAIN_ITERS`: iteration 1 allocates the optimizer state; the later ones are steady). A case with a
pipeline runs through ``prism emulate`` instead (`command`: one profiling run per stage, the execution graph's
replay for the iteration, whose last stage waits for the others). The drop-in is
the one of ``--prism-root`` (default: this repository; an exported tree of a commit keeps a long run away from
edits in progress).

Predicted figures, both modelled, read from ``<out>/<case>/rank<R>.summary.json``:

- peak allocated bytes: ``virtual_gpu.devices[*].peak_allocated_bytes`` of the device the rank uses (the
  running peak over the 3 iterations, as the golden value at step 3 is over its first 3; torch's cuBLAS
  workspaces among them, as on a GPU: `CaseResult.predicted_cublas_workspace_bytes`);
- iteration time: the last entry of ``virtual_gpu.virtual_time.step_times_s`` (the emulated time between the
  last two iteration marks; emulated time is deterministic, so one steady iteration is the figure; the golden
  value is a median over steady steps); with a pipeline, the replay's step (``<out>/<case>/emulate.json``) and
  the memory of the last stage's profiling run.

A case that does not run records why: the first error line of its log (a refused feature, a TransformerEngine
kernel the fake extension lacks, ...). Results accumulate in ``<out>/<case>.result.json``; the table (markdown,
then one line of JSON) is built from every result in ``<out>`` (measured figures read again from the rows) and
printed on stdout, and written to ``<out>/table.md`` and ``<out>/results.json``; ``--write-results`` also writes
them as ``validation/results/megatron_functional.json`` (`results_data`) and regenerates the results document
``recipes/RESULTS.md`` from it (`validation.results`; with ``--cases``, of those cases only: write it after a full run
or with ``--table-only``). Each row keeps its role (``fit`` or ``validate``, `collect.role`): the host time per
launch is fitted on the fit rows (`validation.megatron_functional.fit`), and errors are reported by role.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from validation.megatron_functional.collect import CASES_DIR, TRAIN_ITERS
from validation.results import DOC_PATH, write_source

__all__ = ["CaseResult", "CaseStatus", "load_cases", "command", "last_stage", "pipelined", "program_argv", "run_case",
           "results_data", "table_markdown", "main"]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "prism_plugin/programs/pretrain_gpt.py"
PROFILE = "dgx-h100"
DEFAULT_OUT = Path("/tmp/prism_megatron_functional")
FITTING = ("The fit rows (every third case by name) fit one figure, the dgx-h100 profile's host time per launch "
           "(`python -m validation.megatron_functional.fit`); nothing else is fitted on these rows, and peak "
           "allocated is fitted on none. The profile's 86.2 us was fitted when a pipelined case ran as its last rank "
           "alone (no bubble); on these runs (every stage replayed, CUDA-graph cases past their capture) the fit "
           "gives 86.5 us: converged, within 1 us.")
_ERROR_LINE = re.compile(r"^(prism: (invalid input|prism cannot emulate).*|[\w.]*(Error|Exception|Refusal)\b.*)$")


class CaseStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True, slots=True)
class CaseResult:
    """One case: the golden figures (measured by NVIDIA) and prism's (modelled), or why it did not run."""

    case: str
    status: CaseStatus
    """`CaseStatus.FAILED` comes with `reason`."""
    measured_peak_allocated_bytes: int
    measured_iteration_time_s: float
    predicted_peak_allocated_bytes: int | None = None
    """The allocator model's ``allocated_bytes.all.peak``: the program's tensors (TransformerEngine's own cuBLAS
    workspace included: TE allocates it as a tensor) and torch's cuBLAS workspaces."""
    predicted_cublas_workspace_bytes: int | None = None
    """torch's cuBLAS workspaces within that peak (the device's ``cublas_workspace_bytes``: one per handle and stream
    that ran a torch GEMM, forward and autograd threads), allocated through the caching allocator as torch does
    (``setWorkspaceForHandle`` in CublasHandlePool.cpp)."""
    predicted_iteration_time_s: float | None = None
    megatron_max_allocated_mb: float | None = None
    """Megatron's own ``max allocated`` log line of the last iteration (MB), from the allocator model."""
    reason: str | None = None
    wall_s: float = 0.0
    path: str = "drop-in"
    """What predicted the figures: ``emulate`` (a pipeline's stages and the graph's replay) or ``drop-in`` (the
    last rank alone; a pipelined case whose groups the execution graph cannot express: `graph_refusal`)."""
    graph_refusal: str | None = None
    """Why ``prism emulate`` refused a pipelined case (its first error line), when the drop-in predicted it."""

    @property
    def memory_error_pct(self) -> float | None:
        if self.predicted_peak_allocated_bytes is None:
            return None
        return 100.0 * (self.predicted_peak_allocated_bytes / self.measured_peak_allocated_bytes - 1.0)

    @property
    def time_error_pct(self) -> float | None:
        if self.predicted_iteration_time_s is None:
            return None
        return 100.0 * (self.predicted_iteration_time_s / self.measured_iteration_time_s - 1.0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "memory_error_pct": self.memory_error_pct, "time_error_pct": self.time_error_pct}


def load_cases(patterns: list[str] | None = None, cases_dir: Path = CASES_DIR) -> list[dict[str, Any]]:
    """The rows whose case name matches any of ``patterns`` (exact names or shell globs); all when None."""
    rows = [yaml.safe_load(p.read_text()) for p in sorted(cases_dir.glob("*.yaml"))]
    if not patterns:
        return rows
    chosen = [r for r in rows if any(fnmatch.fnmatchcase(r["case"], p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r["case"], p) for r in rows)]
    if unknown:
        raise ValueError(f"no case matches {unknown}; the cases are the file names in {cases_dir}")
    return chosen


def program_argv(row: dict[str, Any]) -> list[str]:
    """The program and the case's Megatron arguments, as a command line."""
    argv = [PROGRAM]
    for flag, value in row["args"].items():
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def pipelined(row: dict[str, Any]) -> bool:
    """Whether the case runs a pipeline (its iteration holds the other stages' bubble: `command`)."""
    return int(row["args"].get("--pipeline-model-parallel-size", 1)) > 1


def iterations(row: dict[str, Any]) -> int:
    """The iterations a case runs in full: `TRAIN_ITERS`, or one past its CUDA graphs' capture.

    With ``--cuda-graph-impl transformer_engine`` Megatron captures the graphs at the top of iteration ``W``
    (0-based; ``--cuda-graph-warmup-steps``, default 3), so step ``W + 1``'s time holds the capture with TE's warm-up
    runs of every graphed callable (on the scoped-graph MoE case: 2.67 s against 1.30 s for the steps before). The
    golden value is an average over the case's 50-100 iterations, where that one step weighs a percent or two; the
    predicted iteration is the step after it, the first that replays the graphs."""
    args = row["args"]
    if args.get("--cuda-graph-impl") != "transformer_engine":
        return TRAIN_ITERS
    return max(TRAIN_ITERS, int(args.get("--cuda-graph-warmup-steps", 3)) + 2)


def command(row: dict[str, Any], out_dir: Path, *, graph: bool | None = None) -> list[str]:
    """The command line of one row: the drop-in as its last rank, or `prism emulate` for a pipeline.

    Without a pipeline every rank of a case runs the same timeline (TP, CP, DP and EP peers are symmetric), so the
    last rank alone, its peers arriving with it, is the iteration. A pipeline's stages differ, and the last waits
    for the others (the bubble, and the first stage's embedding against the last's loss): its iteration is the
    execution graph's replay over one profiling run per stage, as `prism emulate` gives it; ``--warmup 2`` runs the
    case's 3 iterations in full, as the drop-in does (``--train-iters 4``: the run stops where the fourth starts),
    and builds the graph from the third (a case with CUDA graphs: from the step after their capture, `iterations`).
    ``graph``: force one form (default: emulate for a pipeline)."""
    n = iterations(row)
    if pipelined(row) if graph is None else graph:
        one_more = {**row, "args": {**row["args"], "--train-iters": str(n + 1)}}
        return [sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", str(row["world_size"]),
                "--profile", PROFILE, "--output", str(out_dir), "--overwrite", "--warmup", str(n - 1),
                "--", *program_argv(one_more)]
    row = {**row, "args": {**row["args"], "--train-iters": str(n)}}
    return [sys.executable, "-m", "prism_plugin.megatron", *program_argv(row),
            "--prism-world-size", str(row["world_size"]), "--prism-real-ranks", str(row["rank"]),
            "--prism-profile", PROFILE, "--prism-device", "virtual-gpu", "--prism-output", str(out_dir)]


def first_error_line(log: str) -> str:
    """The first line of ``log`` that names an error (the root exception of a traceback, prism's refusal with
    its listed flags joined), else the last non-empty line."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if _ERROR_LINE.match(line.strip()):
            items = []
            for follow in lines[i + 1:]:
                if not follow.startswith("  - "):
                    break
                items.append(follow[4:].strip())
            return "; ".join([line.strip(), *items])[:600]
    return lines[-1].strip()[:600] if lines else "no output"


def _megatron_max_allocated_mb(log: str) -> float | None:
    found = re.findall(r"max allocated: ([0-9.]+)", log)
    return float(found[-1]) if found else None


GRAPH_REFUSALS = ("is not a group of the layout",)
"""The first error lines of ``prism emulate`` that say the execution graph cannot express the job's groups (an
ad-hoc subgroup: dense, embedding and expert groups are roles of the graph). Such a pipelined case is predicted
by the drop-in, and its row says so (`CaseResult.path`, `CaseResult.graph_refusal`): its iteration lacks the other
stages."""


def run_case(row: dict[str, Any], out: Path, *, timeout_s: float, prism_root: Path = ROOT) -> CaseResult:
    """Run one row (`command`) with the prism checkout at ``prism_root``; the result is also written to
    ``<out>/<case>.result.json``. A pipelined case the execution graph refuses (`GRAPH_REFUSALS`) runs again
    through the drop-in."""
    result = _run(row, out, timeout_s=timeout_s, prism_root=prism_root, graph=pipelined(row))
    if result.path == "emulate" and result.status is CaseStatus.FAILED \
            and any(text in (result.reason or "") for text in GRAPH_REFUSALS):
        refusal = result.reason
        result = replace(_run(row, out, timeout_s=timeout_s, prism_root=prism_root, graph=False),
                         graph_refusal=refusal)
    (out / f"{row['case']}.result.json").write_text(json.dumps(result.to_json(), indent=1))
    return result


def _run(row: dict[str, Any], out: Path, *, timeout_s: float, prism_root: Path, graph: bool) -> CaseResult:
    case_dir = out / row["case"]
    case_dir.mkdir(parents=True, exist_ok=True)
    summary_path = case_dir / ("emulate.json" if graph else f"rank{row['rank']}.summary.json")
    summary_path.unlink(missing_ok=True)
    env = {**os.environ, **{k: str(v) for k, v in (row.get("env") or {}).items()},
           "PYTHONPATH": os.pathsep.join([str(prism_root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    measured = row["measured"]
    base = {"case": row["case"], "measured_peak_allocated_bytes": int(measured["peak_allocated_bytes"]),
            "measured_iteration_time_s": float(measured["iteration_time_s"])}
    start = time.monotonic()
    try:
        proc = subprocess.run(command(row, case_dir, graph=graph), cwd=prism_root, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        code = None
    wall = round(time.monotonic() - start, 1)
    (out / f"{row['case']}.log").write_text(log)
    path = "emulate" if graph else "drop-in"
    if code is None:
        return CaseResult(**base, status=CaseStatus.FAILED, reason=f"timed out after {timeout_s:.0f} s", wall_s=wall,
                          path=path)
    if code != 0 or not summary_path.is_file():
        return CaseResult(**base, status=CaseStatus.FAILED, reason=first_error_line(log), wall_s=wall, path=path)
    if graph:
        return _from_emulate(base, json.loads(summary_path.read_text()), case_dir, wall)
    return _from_summary(base, json.loads(summary_path.read_text()), log, wall)


def _from_summary(base: dict[str, Any], summary: dict[str, Any], log: str, wall: float) -> CaseResult:
    vg = summary["virtual_gpu"]
    device = max(vg["devices"], key=lambda d: d["peak_allocated_bytes"])  # the one this rank used
    peak = int(device["peak_allocated_bytes"])
    workspaces = int(device["cublas_workspace_bytes"])
    steps = vg["virtual_time"]["step_times_s"]
    if not steps:
        return CaseResult(**base, status=CaseStatus.FAILED, reason="no complete emulated iteration in the summary",
                          predicted_peak_allocated_bytes=peak, predicted_cublas_workspace_bytes=workspaces,
                          wall_s=wall)
    return CaseResult(**base, status=CaseStatus.OK, predicted_peak_allocated_bytes=peak,
                      predicted_cublas_workspace_bytes=workspaces, predicted_iteration_time_s=float(steps[-1]),
                      megatron_max_allocated_mb=_megatron_max_allocated_mb(log), wall_s=wall)


def last_stage(report: dict[str, Any], case_dir: Path) -> tuple[dict[str, Any], Path]:
    """The last pipeline stage's class in a `prism emulate` report, and its profiling run's summary."""
    stages = {int(m.group(1)): c for c in report["classes"] if (m := re.fullmatch(r"pp=(\d+)", c["class"]))}
    if len(stages) != len(report["classes"]):
        raise ValueError(f"classes {[c['class'] for c in report['classes']]} are not one per pipeline stage")
    last = stages[max(stages)]
    (summary_path,) = case_dir.glob(f"run*/rank{last['rank']}.summary.json")
    return last, summary_path


def _from_emulate(base: dict[str, Any], report: dict[str, Any], case_dir: Path, wall: float) -> CaseResult:
    """A pipelined case's figures from its `prism emulate` report: the job's step (the replay), and the memory of the
    last stage's class from its profiling run (every rank of a class has the last rank's memory: DP, TP, CP and EP
    peers are symmetric)."""
    last, summary_path = last_stage(report, case_dir)
    result = _from_summary(base, json.loads(summary_path.read_text()), (summary_path.parent / "log.txt").read_text(),
                           wall)
    if result.status is not CaseStatus.OK:
        return result
    assert result.predicted_peak_allocated_bytes == last["peak_allocated_bytes"]
    return replace(result, predicted_iteration_time_s=round(report["replay"]["step_us"] / 1e6, 9), path="emulate")


def _commit(prism_root: Path) -> str:
    """The commit the cases ran under: ``PRISM_COMMIT`` in the checkout (an exported tree), else git's HEAD."""
    marker = prism_root / "PRISM_COMMIT"
    if marker.is_file():
        return marker.read_text().strip()[:12]
    proc = subprocess.run(["git", "-C", str(prism_root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or "unknown"


def _load_results(out: Path) -> list[CaseResult]:
    """The results in ``out``, their measured figures read again from the case rows (the rows are the source)."""
    fields = set(CaseResult.__dataclass_fields__)
    rows = {r["case"]: r for r in load_cases()}
    results = []
    for path in sorted(out.glob("*.result.json")):
        data = {k: v for k, v in json.loads(path.read_text()).items() if k in fields}
        row = rows.get(data["case"])
        if row is not None:
            data["measured_peak_allocated_bytes"] = int(row["measured"]["peak_allocated_bytes"])
            data["measured_iteration_time_s"] = float(row["measured"]["iteration_time_s"])
        data["status"] = CaseStatus(data["status"])
        results.append(CaseResult(**data))
    return results


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.2f}%"


def table_markdown(results: list[CaseResult]) -> str:
    """Measured (NVIDIA, DGX H100) vs predicted (prism, modelled) per case; the cases that did not run after."""
    ran = [r for r in results if r.status is CaseStatus.OK]
    failed = [r for r in results if r.status is not CaseStatus.OK]
    lines = ["| case | peak allocated, measured (MiB) | predicted (MiB) | of which cuBLAS workspaces (MiB) | error | "
             "iteration time, measured (s) | predicted (s) | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ran:
        lines.append(f"| {r.case} | {_mib(r.measured_peak_allocated_bytes)} | "
                     f"{_mib(r.predicted_peak_allocated_bytes)} | {_mib(r.predicted_cublas_workspace_bytes)} | "
                     f"{_pct(r.memory_error_pct)} | {r.measured_iteration_time_s:.4f} | "
                     f"{r.predicted_iteration_time_s:.4f} | {_pct(r.time_error_pct)} |")
    if ran:
        lines.append(f"\n{len(ran)} of {len(results)} cases ran. " + _mean_max("Peak allocated", [
            r.memory_error_pct for r in ran]) + " " + _mean_max("Iteration time", [
            r.time_error_pct for r in ran]))
    if failed:
        lines += ["", "| case that did not run | first error line |", "|---|---|"]
        lines += [f"| {r.case} | {(r.reason or '').replace('|', '/')} |" for r in failed]
    return "\n".join(lines)


def _mean_max(name: str, errors: list[float | None]) -> str:
    values = [abs(e) for e in errors if e is not None]
    if not values:
        return ""
    return (f"{name}: mean |error| {sum(values) / len(values):.2f}%, max {max(values):.2f}%, "
            f"within 1%: {sum(v <= 1.0 for v in values)} of {len(values)}.")


def results_data(results: list[CaseResult], prism_commit: str) -> dict[str, Any]:
    """The data file of the results document (``validation/results/megatron_functional.json``): the run, then one
    row per case with its role (the golden values are measured by NVIDIA; only the fit rows' iteration times are
    fitted on)."""
    roles = {row["case"]: row["role"] for row in load_cases()}
    rows: list[dict[str, Any]] = []
    for r in sorted(results, key=lambda r: r.case):
        if r.status is CaseStatus.OK and r.predicted_peak_allocated_bytes is not None \
                and r.predicted_iteration_time_s is not None:
            rows.append({"case": r.case, "role": roles[r.case], "ran": True,
                         "measured_peak_allocated_mib": round(r.measured_peak_allocated_bytes / 2**20, 3),
                         "predicted_peak_allocated_mib": round(r.predicted_peak_allocated_bytes / 2**20, 3),
                         "predicted_cublas_workspace_mib": round((r.predicted_cublas_workspace_bytes or 0) / 2**20, 3),
                         "peak_allocated_error_pct": round(r.memory_error_pct or 0.0, 4),
                         "measured_iteration_time_s": r.measured_iteration_time_s,
                         "predicted_iteration_time_s": r.predicted_iteration_time_s,
                         "iteration_time_error_pct": round(r.time_error_pct or 0.0, 4), "path": r.path,
                         **({"graph_refusal": r.graph_refusal} if r.graph_refusal else {})})
        else:
            rows.append({"case": r.case, "role": roles[r.case], "ran": False, "reason": r.reason or "no result"})
    return {"source": "megatron_functional", "date": datetime.now(UTC).date().isoformat(),
            "command": "python -m validation.megatron_functional.run --write-results", "prism_commit": prism_commit,
            "conditions": "each case `--train-iters 3` (with TE CUDA graphs: one step past their capture) as its last "
                          "rank (the rank that logged the golden values) on a "
                          "virtual H100, a case with a pipeline through `prism emulate` (every stage, the graph's "
                          f"replay), on a host of {os.cpu_count()} CPU cores (both predicted figures are "
                          "modelled: the host's load does not move them); golden values measured by NVIDIA on a DGX "
                          "H100 (8 GPUs)",
            "fitting": FITTING,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="case names or shell globs (default: every case)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per case (default 1200)")
    parser.add_argument("--table-only", action="store_true", help="print the table of the results in --out")
    parser.add_argument("--write-results", type=Path, nargs="?", const=DOC_PATH, metavar="RESULTS_MD",
                        help="also write validation/results/megatron_functional.json and regenerate the results "
                             "document from it (default recipes/RESULTS.md)")
    parser.add_argument("--prism-root", type=Path, default=ROOT,
                        help="the prism checkout whose drop-in runs the cases (default: this repository)")
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    if not ns.table_only:
        for row in load_cases(ns.cases):
            result = run_case(row, ns.out, timeout_s=ns.timeout, prism_root=ns.prism_root.resolve())
            print(f"{result.case}: {result.status} ({result.wall_s:.0f} s) memory {_pct(result.memory_error_pct)} "
                  f"time {_pct(result.time_error_pct)} {result.reason or ''}", file=sys.stderr, flush=True)
    results = _load_results(ns.out)
    if ns.cases:
        names = {r["case"] for r in load_cases(ns.cases)}
        results = [r for r in results if r.case in names]
    markdown = table_markdown(results)
    (ns.out / "table.md").write_text(markdown + "\n")
    payload = [r.to_json() for r in results]
    (ns.out / "results.json").write_text(json.dumps(payload, indent=1))
    print(markdown)
    print(json.dumps(payload))
    if ns.write_results is not None:
        write_source("megatron_functional", results_data(results, _commit(ns.prism_root)), doc=ns.write_results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
