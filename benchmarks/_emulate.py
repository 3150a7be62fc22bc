"""``prism emulate`` of one Megatron job, timed as a whole command: shared by the benchmarks of issue 22's
``prism emulate`` targets (`gpt3_175b_example`, `virtual_gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def emulate_once(job: list[str], *, world_size: int, jobs: int, timeout_s: float, env: dict[str, str],
                 options: tuple[str, ...] = ()) -> dict:
    """One ``prism emulate --world-size N --jobs J [options] -- job`` in a fresh folder: the command's wall
    seconds (measured), the report's modelled step and largest peak allocated, and each profiling run's wall
    seconds and fast-forward figures (micro-batches, how many skipped)."""
    with tempfile.TemporaryDirectory(prefix="prism_bench_emulate_") as tmp:
        folder = Path(tmp)
        command = [sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", str(world_size),
                   "--jobs", str(jobs), "--timeout", str(timeout_s), "--output", str(folder / "emulate"), "--json",
                   *options, "--", *job]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"exit_code": proc.returncode, "wall_s": round(wall, 1), "log_tail": proc.stderr[-3000:]}
        report = json.loads(proc.stdout)
        runs = []
        for run_dir in sorted((folder / "emulate").glob("run*"), key=lambda d: int(d.name[3:])):
            [summary] = run_dir.glob("rank*.summary.json")
            ff = json.loads(summary.read_text()).get("megatron", {}).get("fast_forward") or {}
            runs.append({"run": run_dir.name, "microbatches": ff.get("microbatches"),
                         "microbatches_skipped": ff.get("microbatches_skipped")})
        for run, cls in zip(runs, report["classes"], strict=False):
            run["profiling_run_wall_s"] = cls.get("profiling_run_wall_s")
        return {"exit_code": 0, "wall_s": round(wall, 1), "step_ms": report["step_ms"],
                "peak_allocated_bytes": max(c["peak_allocated_bytes"] for c in report["classes"]),
                "profiling_runs": report["profiling_runs"], "runs": runs}
