"""``--tp-comm-overlap`` on a virtual H100: TE's userbuffers, ring-exchange chunks overlapped with GEMM chunks.

The same Megatron job (TE spec, TP2 with sequence parallelism, 2 layers at Llama-3-8B width, seq 4096) runs as rank
1 of 64 with and without the flag. With it, TE's userbuffers take over the TP all-gathers before the QKV and FC1
GEMMs (forward) and the reduce-scatters after the projection and FC2 GEMMs (forward): each becomes ``tp - 1`` ring
steps (a send and a receive on the TP group) beside GEMM chunks, and the GEMMs' FLOPs are unchanged (the chunks add
up to the GEMM); one extension call, they pay the host's time per launch once. Each of the 12 userbuffers TE
creates holds ``seq x hidden`` bf16 elements outside the caching allocator, counted in the device total. The two
runs start together (`integration_tests.at_once`: one core each, every figure compared counted or modelled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.at_once import at_once
from integration_tests.profiles import launch_light_profile

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
TP, LAYERS, ITERATIONS, SEQ, H = 2, 2, 2, 4096, 4096
JOB = ["--tensor-model-parallel-size", str(TP), "--sequence-parallel", "--num-layers", str(LAYERS), "--hidden-size",
       str(H), "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
       "--num-query-groups", "8", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
       "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "32",
       "--train-iters", str(ITERATIONS), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "128256", "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
       "--eval-interval", "1000"]


def _run(out: Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, *extra,
                           "--prism-world-size", "64", "--prism-real-ranks", "1", "--prism-profile", "dgx-h100",
                           "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads((out / "rank1.summary.json").read_text())


def test_tp_comm_overlap_runs_te_userbuffers_as_ring_steps_beside_gemm_chunks(tmp_path: Path) -> None:
    plain, overlap = at_once(lambda: _run(tmp_path / "plain"), lambda: _run(tmp_path / "overlap", "--tp-comm-overlap"))
    ops, ops_plain = overlap["op_counts"], plain["op_counts"]
    ring_gemms = 4  # per layer and iteration: QKV and FC1 (all-gather), projection and FC2 (reduce-scatter), forward
    backward_ag = 2  # projection and FC2 dgrad read all-gathered gradients through userbuffers too
    steps = ITERATIONS * LAYERS * (ring_gemms + backward_ag) * (TP - 1)
    assert ops["send"] == ops["recv"] == steps == 24 and "send" not in ops_plain
    assert ops_plain["all_gather"] - ops["all_gather"] == ITERATIONS * LAYERS * 4
    assert ops_plain["reduce_scatter"] - ops["reduce_scatter"] == ITERATIONS * LAYERS * 2
    gemm = {t["op"]: t for t in overlap["virtual_gpu"]["kernels"]["top"]}["prism_te.gemm.default"]
    gemm_plain = {t["op"]: t for t in plain["virtual_gpu"]["kernels"]["top"]}["prism_te.gemm.default"]
    assert gemm["flops"] == gemm_plain["flops"] and gemm["count"] > gemm_plain["count"]
    # one GEMM call runs its chunks and ring steps as TE's C++ does: every launch after the call's first pays the
    # driver's figure, not the host's per-launch one (both sides of each ring step, the chunk GEMMs after the first)
    native = overlap["virtual_gpu"]["virtual_time"]["native_launches"]
    assert native >= 2 * steps + gemm["count"] - gemm_plain["count"]
    device = next(d for d in overlap["virtual_gpu"]["devices"] if d["peak_allocated_bytes"])
    assert device["device_total"]["userbuffer_bytes"] == 12 * SEQ * H * 2
    plain_device = next(d for d in plain["virtual_gpu"]["devices"] if d["peak_allocated_bytes"])
    assert "userbuffer_bytes" not in plain_device["device_total"]


SMALL = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-layers", "2", "--hidden-size", "1024",
         "--ffn-hidden-size", "4096", "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups",
         "4", "--seq-length", "2048", "--max-position-embeddings", "2048", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "32000", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
         "--eval-iters", "0", "--eval-interval", "1000", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
         "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
"""A small job with the FP8 flags of the Llama-3-8B done-when job (test_te_fp8_virtual_gpu, marked heavy)."""


def test_a_te_fp8_job_runs_in_hybrid_mode_against_its_graph(tmp_path: Path) -> None:
    """``prism emulate --hybrid``: rank 1 runs as a real process against the graph built from rank 0's profiling
    run; TE's kernels replay in step with the graph (the same step to the microsecond)."""
    # a launch-light host (5 us a launch): the replay's compute spans are the GPU's, so it reproduces a live step
    # where the GPU bounds it (integration_tests/profiles.py)
    profile = str(launch_light_profile(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "8", "--profile",
                           profile, "--warmup", "0", "--hybrid", "1", "--out", str(tmp_path / "emulate"), "--json",
                           "--", str(SCRIPT), *SMALL], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    (hybrid,) = report["hybrid"]
    assert hybrid["rank"] == 1 and hybrid["graph"]["ops_not_in_graph"] == 0
    # rank 1 (TP rank 1) gets its batches from virtual TP rank 0's broadcasts: the valid batch the adapter writes
    # into them is their data, no launch of its own, so it runs rank 0's kernels (36 more when they were timed)
    assert hybrid["kernels"] == hybrid["representative"]["kernels"]
    # the live step, kept to the nanosecond, is the replay's to within that rounding (0.001 us)
    assert abs(hybrid["difference_us"]) <= 0.001 and round(hybrid["step_ms"], 3) == report["step_ms"]
