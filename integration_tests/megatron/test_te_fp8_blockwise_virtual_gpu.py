"""FP8 block scaling (``--fp8-recipe blockwise``) with ``--fp8-param-gather`` on a virtual H100, through the drop-in.

A small Megatron job on the TE spec (2 layers, hidden 1024, seq 2048, TP2 with sequence parallelism, the
distributed optimizer over DP 4) as rank 1 of 8. Its FP8 weights and activations are TE's block-scaled tensors: every
cast is one ``quantize_float8block`` kernel, every TE GEMM reads FP8 operands, and after each optimizer step the
distributed optimizer casts this rank's fragment of each master weight into the FP8 weights through TE's
``cast_master_weights_to_fp8``: one partial-amax and one partial-cast kernel per fragment. The same job with
per-tensor current scaling (``tensorwise``) runs the same GEMMs: the same count and FLOPs (counted, exact).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
JOB = ["--num-layers", "2", "--hidden-size", "1024", "--ffn-hidden-size", "4096", "--num-attention-heads", "16",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size",
       "8", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--bf16",
       "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer", "--log-interval",
       "1", "--eval-iters", "0", "--eval-interval", "1000", "--train-iters", "2", "--fp8-format", "e4m3",
       "--fp8-param-gather"]


def _run(tmp: Path, recipe: str) -> tuple[dict[str, Any], collections.Counter[str]]:
    out = tmp / recipe
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, "--fp8-recipe", recipe,
                           "--prism-world-size", "8", "--prism-real-ranks", "1", "--prism-profile", "dgx-h100",
                           "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    summary = json.loads((out / "rank1.summary.json").read_text())
    timeline = json.loads((out / "timeline" / "rank1.timeline.json").read_text())
    events = timeline["traceEvents"] if isinstance(timeline, dict) else timeline
    kernels = collections.Counter(e["name"] for e in events if str(e.get("name", "")).startswith("prism_te."))
    return summary, kernels


def test_block_scaled_fp8_runs_its_gemms_casts_and_master_weight_casts(tmp_path: Path) -> None:
    summary, kernels = _run(tmp_path, "blockwise")
    assert summary["exit_code"] == 0 and summary["iterations_marked"] == 2
    assert kernels["prism_te.quantize_float8block.default"] > 0
    assert not any("cast_transpose_fp8" in name or "compute_amax" in name for name in kernels)  # no per-tensor path
    amax = kernels["prism_te.fp8_block_scaling_compute_partial_amax.default"]
    assert amax > 0 and kernels["prism_te.fp8_block_scaling_partial_cast.default"] == amax  # one of each a fragment
    tensorwise, per_tensor = _run(tmp_path, "tensorwise")
    gemms = [{k: n for k, n in counted.items() if ".gemm" in k} for counted in (kernels, per_tensor)]
    assert gemms[0] == gemms[1] and sum(gemms[0].values()) > 0
    # every kernel's FLOPs (GEMMs and attention; casts count none): the same work in both
    assert summary["virtual_gpu"]["kernels"]["flops"] == tensorwise["virtual_gpu"]["kernels"]["flops"] > 0
