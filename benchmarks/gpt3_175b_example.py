"""Megatron-LM's GPT-3 175B example through the drop-in: wall time to its first logged iteration (issue 22's target).

    python benchmarks/gpt3_175b_example.py [--repeats 3] [--iterations 2] [--rank 0] [--timeout 1200]

The job is ``examples/gpt3/train_gpt3_175b_distributed.sh`` of NVIDIA/Megatron-LM (`SOURCE`): its own model,
training, parallel, data and logging arguments (`ARGS`), unchanged, with the script's five path arguments given
paths that do not exist here, ``--tokenizer-type GPT2BPETokenizer`` added (megatron-core 0.19 builds no tokenizer
without a type; the script predates that), and the prism flags: ``--prism-world-size 1024`` (TP8 x PP16 x DP8),
``--prism-real-ranks R``, ``--prism-device virtual-gpu`` and ``--prism-iterations K`` (its first K of 500,000
iterations). Absent data becomes Megatron's mock data with GPT-2's vocabulary (one line says so). megatron-core 0.19
accepts ``--rampup-batch-size`` but no longer ramps (its training loop passes no ramp-up to the micro-batch
calculator): iteration 1 runs the full 1,536-sample batch, 192 micro-batches per data-parallel rank.

Each repeat is one process started from scratch. Prints one JSON object: ``first_iteration_s`` (median over repeats
of the wall seconds from the process's start to Megatron's iteration-1 log line, measured) against ``target_s``
(60), ``startup_s`` (to the "before the start of training step" line), the per-repeat figures, the host's load, and
from rank R's summary the modelled step times and peak allocated bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh "
          "(commit 157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9)")
ARGS = [
    # GPT_MODEL_ARGS
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    # TRAINING_ARGS
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    # DATA_ARGS ($DATA_PATH, $VOCAB_FILE, $MERGE_FILE: absent here)
    "--data-path", "/data/my-gpt3_00_text_document", "--vocab-file", "/data/gpt2-vocab.json",
    "--merge-file", "/data/gpt2-merges.txt", "--split", "949,50,1",
    # EVAL_AND_LOGGING_ARGS ($CHECKPOINT_PATH, $TENSORBOARD_LOGS_PATH: under the run's folder)
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "{ckpt}",
    "--load", "{ckpt}", "--eval-iters", "10", "--tensorboard-dir", "{tensorboard}",
]
ADDED = ["--tokenizer-type", "GPT2BPETokenizer"]
TARGET_S = 60.0


def command(folder: Path, rank: int, iterations: int) -> list[str]:
    args = [a.format(ckpt=folder / "ckpt", tensorboard=folder / "tb") for a in ARGS]
    return [sys.executable, "-m", "prism_plugin.megatron", "prism_plugin/programs/pretrain_gpt.py", *args, *ADDED,
            "--prism-world-size", "1024", "--prism-real-ranks", str(rank), "--prism-device", "virtual-gpu",
            "--prism-iterations", str(iterations), "--prism-output", str(folder / "out")]


def one_run(rank: int, iterations: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="prism_175b_") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        start = time.perf_counter()
        marks: dict[str, float] = {}
        proc = subprocess.Popen(command(folder, rank, iterations), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            now = time.perf_counter() - start
            if "before the start of training step" in line:
                marks.setdefault("startup_s", now)
            if "iteration        1/" in line:
                marks.setdefault("first_iteration_s", now)
            tail = (tail + [line])[-20:]
            if now > timeout_s:
                proc.kill()
                break
        code = proc.wait()
        wall = time.perf_counter() - start
        summaries = sorted((folder / "out").glob("rank*.summary.json"))
        summary = json.loads(summaries[0].read_text()) if summaries else {}
        device = (summary.get("virtual_gpu", {}).get("devices") or [{}])[0]
        return {"exit_code": code, "wall_s": round(wall, 1), **{k: round(v, 1) for k, v in marks.items()},
                "modelled_step_times_s": summary.get("virtual_gpu", {}).get("virtual_time", {}).get("step_times_s"),
                "peak_allocated_bytes": device.get("peak_allocated_bytes"),
                "log_tail": None if "first_iteration_s" in marks else "".join(tail)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    ns = parser.parse_args()
    load_before = os.getloadavg()[0]
    runs = [one_run(ns.rank, ns.iterations, ns.timeout) for _ in range(ns.repeats)]
    firsts = [r["first_iteration_s"] for r in runs if "first_iteration_s" in r]
    starts = [r["startup_s"] for r in runs if "startup_s" in r]
    first = statistics.median(firsts) if len(firsts) == len(runs) else None
    print(json.dumps({
        "benchmark": "gpt3_175b_example", "source": SOURCE, "added": ADDED, "rank": ns.rank, "world_size": 1024,
        "iterations": ns.iterations, "repeats": ns.repeats, "first_iteration_s": first, "target_s": TARGET_S,
        "met": first is not None and first < TARGET_S,
        "startup_s": statistics.median(starts) if starts else None,
        "load_average_at_start": round(load_before, 2), "load_average": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(), "runs": runs}, indent=1))
    return 0 if first is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
