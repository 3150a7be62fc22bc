"""`prism plan` end to end on a small Megatron GPT job (2 layers of width 1024, TransformerEngine spec, 4 virtual
H100s, global batch 16): two candidates (tp 1 and tp 2), each a memory run and a whole `prism emulate`.

One test, in two acts: the plan is stopped with SIGTERM once its first candidate is done (every run it started
ends with it; the finished candidate stays cached), then run again into the same output, where it reads the
cached candidate, runs the other and ranks both. Every figure is modelled, so the steps are pinned to the
microsecond, and the memory run of each candidate (two iterations, no virtual time) must give rank 0's peak to
the byte that its emulation's rank-0 profiling run gives (three iterations, virtual time). About 60-90 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "pretrain_gpt.py"
JOB = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
       "--num-query-groups", "8", "--ffn-hidden-size", "3584", "--seq-length", "1024", "--max-position-embeddings",
       "1024", "--vocab-size", "32000", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0.0",
       "--hidden-dropout", "0.0", "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "100",
       "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16", "--log-interval", "1",
       "--eval-iters", "0", "--eval-interval", "1000000", "--disable-gloo-process-groups"]
SPACE = "tp=1,2;pp=1;cp=1;mbs=1;recompute=none;dopt=on;fp8=off"


def _command(out: Path, space: str = SPACE, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prism_plugin.cli.main", "plan", "--gpus", "4", "--space", space, "--output",
            str(out), "--json", *extra, "--", str(SCRIPT), *JOB]


def _runs_left(out: Path) -> list[str]:
    """Processes whose command line names `out` (the plan's runs write there)."""
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmdline:
                left.append(f"{proc.name}: {cmdline[:200]}")
    return left


def test_a_plan_stopped_midway_keeps_its_finished_candidate_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    log = (tmp_path / "first.err").open("w")
    first = subprocess.Popen(_command(out), stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 600
    while "[1/2]" not in (tmp_path / "first.err").read_text() and first.poll() is None:
        assert time.monotonic() < deadline, (tmp_path / "first.err").read_text()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 143, (tmp_path / "first.err").read_text()[-3000:]
    log.close()
    assert _runs_left(out) == []
    cached = [p.parent.name for p in (out / "candidates").glob("*/result.json")]
    assert cached == ["tp1_pp1_vp1_cp1_ep1_mbs1_norc_dopt_bf16"]  # the guess runs tp 1 first, alone (--jobs 1)

    second = subprocess.run(_command(out), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming" in second.stderr and "(cached)" in second.stderr
    doc = json.loads(second.stdout)
    assert doc == json.loads((out / "plan.json").read_text())
    assert (doc["candidates"], doc["tried"], doc["cached"]) == (2, 2, 1)
    by_label = {r["label"]: r for r in doc["results"]}
    assert set(by_label) == {"tp1 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16", "tp2 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16"}
    for label, r in by_label.items():
        assert r["status"] == "fits" and r["argv"][r["argv"].index("--micro-batch-size") + 1] == "1", label
        rank0 = json.loads((out / "candidates" / label.replace(" ", "_") / "emulate" / "emulate.json").read_text())
        profiled = next(c for c in rank0["classes"] if c["rank"] == 0)
        assert r["memory_run"]["peak_allocated_bytes"] == profiled["peak_allocated_bytes"], label  # to the byte
        assert r["emulation"]["step_ms"] == PINNED_STEP_MS[label], label  # modelled, deterministic
    speeds = [by_label[label]["emulation"]["tokens_per_s_per_gpu"] for label in doc["ranking"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 2
    assert (out / "plan.md").read_text().count("| fits") == 2 and (out / "memory_vs_throughput.png").stat().st_size
    assert os.path.isdir(out / "candidates" / "tp2_pp1_vp1_cp1_ep1_mbs1_norc_dopt_bf16" / "memory")


PINNED_STEP_MS = {"tp1 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16": 47.336, "tp2 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16": 105.004}
"""Each candidate's modelled step (prism emulate's report, rounded to the microsecond)."""


@pytest.mark.heavy  # ~45-60 s; test_emulate.py's Ray test takes the Ray path (run_on_ray, the same figures) in CI
def test_the_runs_go_to_ray_with_the_same_figures(tmp_path: Path) -> None:
    """``--ray local``: the memory run and the profiling runs are Ray tasks; the figures are the local runs'."""
    pytest.importorskip("ray")
    out = tmp_path / "plan"
    proc = subprocess.run(_command(out, SPACE.replace("tp=1,2", "tp=1"), "--ray", "local"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on Ray (local)" in proc.stderr
    (r,) = json.loads(proc.stdout)["results"]
    assert r["label"] == "tp1 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16" and r["status"] == "fits"
    assert r["emulation"]["step_ms"] == PINNED_STEP_MS[r["label"]]
    rank0 = json.loads((out / "candidates" / r["label"].replace(" ", "_") / "emulate" / "emulate.json").read_text())
    assert r["memory_run"]["peak_allocated_bytes"] == rank0["classes"][0]["peak_allocated_bytes"]
