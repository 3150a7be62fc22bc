"""The drop-in flags end to end: the example script, unmodified, through torchrun.

1. the wrapper: ``torchrun --standalone --nproc-per-node 2 -m prism_plugin.megatron pretrain_gpt.py
   <job args> --prism-world-size 16 --prism-real-ranks 3,12 --prism-output DIR``: Megatron's own
   training loop runs 2 iterations as ranks 3 and 12 of 16 (TP=2, PP=2, DP=4), the lowest real
   rank prints the last rank's log lines, each real rank writes its summary;
2. a refused feature fails up front (before any process group) with the flag to change;
3. the native patch: ``patches/megatron-core-0.19.2`` applied to a copy of the installed
   ``megatron/training``, the example run by plain torchrun with ``--prism-*`` flags that
   Megatron's own parser now knows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
JOB = ["--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
       "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "128", "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-iters", "0",
       "--eval-interval", "1000"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_wrapper_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "-m", "prism_plugin.megatron", str(SCRIPT), *JOB,
           "--prism-world-size", "16", "--prism-real-ranks", "3,12", "--prism-output", str(out)]
    proc = _run(cmd, _env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "rank 15 (the last rank, where Megatron logs) is virtual" in text
    assert "iteration        2/       2" in text
    for rank in (3, 12):
        summary = json.loads((out / f"rank{rank}.summary.json").read_text())
        assert summary["world_size"] == 16 and summary["real_ranks"] == [3, 12] and summary["exit_code"] == 0
        assert summary["iterations_marked"] == 2 and summary["memory"]["peak_bytes"] > 0
        assert summary["megatron"]["cpu_patches"] == [1, 2, 3, 5, 4, 6, 7, 8, 9, 10]
        assert summary["op_counts"]["send"] == summary["op_counts"]["recv"] > 0


def test_crashed_virtual_tp_peer_fails_megatron_in_its_own_code_path(tmp_path: Path) -> None:
    """``--prism-fault crash:rank=1,step=2``: real rank 0's TP peer dies at step 2. Megatron's own data
    broadcast over the TP group raises gloo's peer-death error there (as a real crash would make it), the
    job exits non-zero after iteration 1, and rank 0's summary still carries the fault event."""
    job = list(JOB)
    job[job.index("--train-iters") + 1] = "4"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *job, "--prism-world-size", "4",
           "--prism-real-ranks", "0", "--prism-output", str(out), "--prism-fault", "crash:rank=1,step=2"]
    proc = _run(cmd, _env(), timeout_s=180)
    assert proc.returncode != 0
    assert "Connection reset by peer" in proc.stderr and "get_batch_on_this_tp_rank" in proc.stderr
    assert "prism: fault crash:rank=1,step=2: rank 0 raises" in proc.stderr
    assert "iteration        1/       4" in proc.stdout and "iteration        2/       4" not in proc.stdout
    summary = json.loads((out / "rank0.summary.json").read_text())
    assert summary["exit_code"] == 1 and "Connection reset by peer" in summary["error"]
    events = summary["faults"]["events"]
    assert [(e["event"], e["rank"], e["step"]) for e in events] == [("crash", 1, 2)]


def test_refused_feature_fails_before_any_process_group() -> None:
    cmd = [sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, "--tp-comm-overlap",
           "--prism-world-size", "8", "--prism-real-ranks", "0"]
    proc = _run(cmd, _env())
    assert proc.returncode == 2
    assert "--tp-comm-overlap" in proc.stderr and "remove --tp-comm-overlap" in proc.stderr
    assert "initialized tensor model parallel" not in proc.stdout


def test_native_patch_applies_and_trains(tmp_path: Path) -> None:
    import megatron.core

    site = Path(megatron.core.__file__).resolve().parents[2]
    copy = tmp_path / "patched"
    shutil.copytree(site / "megatron" / "training", copy / "megatron" / "training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    patches = sorted((ROOT / "patches" / "megatron-core-0.19.2").glob("*.patch"))
    assert patches
    for patch in patches:
        applied = subprocess.run(["patch", "-p1", "-i", str(patch)], cwd=copy, capture_output=True, text=True)
        assert applied.returncode == 0, applied.stdout + applied.stderr
    out = tmp_path / "out"
    job = [a if a != "2" or i == 0 or JOB[i - 1] != "--train-iters" else "1" for i, a in enumerate(JOB)]
    cmd = [*TORCHRUN, "--nproc-per-node", "1", str(SCRIPT), *job,
           "--prism-world-size", "8", "--prism-real-ranks", "7", "--prism-output", str(out)]
    env = _env(PYTHONPATH=os.pathsep.join([str(copy), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = _run(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        1/       1" in proc.stdout + proc.stderr
    summary = json.loads((out / "rank7.summary.json").read_text())
    assert summary["rank"] == 7 and summary["world_size"] == 8 and summary["iterations_marked"] == 1


def test_hang_on_the_tp_group_named_in_the_users_words_fires_in_megatron(tmp_path: Path) -> None:
    """The documented example ``--prism-fault hang:rank=1,group=tp,op=3``: ``tp`` is Megatron's
    TENSOR_MODEL_PARALLEL_GROUP (its group_desc), so real rank 0's 3rd op on it times out with gloo's error
    after the 3 s timeout; the event names the group, and the run is not a silent success."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, "--prism-world-size", "4",
           "--prism-real-ranks", "0", "--prism-output", str(out), "--prism-timeout", "3",
           "--prism-fault", "hang:rank=1,group=tp,op=3"]
    proc = _run(cmd, _env(), timeout_s=180)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Timed out waiting 3000ms for recv operation to complete" in proc.stderr
    assert "prism: fault hang:rank=1,op=3,group=tp,step=0: rank 0 raises" in proc.stderr
    summary = json.loads((out / "rank0.summary.json").read_text())
    (event,) = summary["faults"]["events"]
    assert (event["event"], event["rank"], event["group_desc"]) == ("hang", 1, "TENSOR_MODEL_PARALLEL_GROUP")
    assert event["step"] == event["raised_at_step"] and summary["faults"]["never_fired"] == []


@pytest.mark.heavy
def test_hang_on_a_group_the_job_never_uses_says_never_fired_and_strict_fails(tmp_path: Path) -> None:
    """``group=cp`` with no context parallelism has a one-member group that carries no op: at exit the fault
    "never fired" (stderr and the summary); ``strict=true`` makes the run fail."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, "--prism-world-size", "4",
           "--prism-real-ranks", "0", "--prism-output", str(out), "--prism-fault", "hang:rank=1,group=cp,strict=true"]
    proc = _run(cmd, _env(), timeout_s=180)
    assert "prism: fault hang:rank=1,op=1,group=cp,step=0,strict=true: never fired on rank 0" in proc.stderr
    assert proc.returncode != 0 or "FaultNeverFiredError" in proc.stderr
