"""megatron.training features on virtual H100s (issue 12, item 4): activation recomputation and overlapped DP buckets.

The repo's upstream-style ``pretrain_gpt.py`` trains Llama-3-8B-width GPT (2 layers, seq 4096, TP8, bf16,
distributed optimizer, mock data) as rank 7 of 64 (TP rank 7, DP group [7, 15, ..., 63]) through
``python -m prism_plugin.megatron --prism-device virtual-gpu --prism-profile dgx-h100``, as in
``test_megatron_virtual_gpu_training.py``. The memory figures are the caching-allocator model's (deterministic, exact
to the byte); the step times are virtual time (kernel model and emulated streams: modelled, deterministic). The runs
a test compares start together (`integration_tests.at_once`): one core each, their figures all modelled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
H, FFN, HEADS, GROUPS, VOCAB, TP, SEQ, RANK = 4096, 14336, 32, 8, 128256, 8, 4096, 7
DP_GROUP = list(range(RANK, 64, TP))  # Megatron's default order tp-cp-ep-dp-pp: rank 7's DP peers are 7 + 8k
ARGS = ["--transformer-impl", "local", "--tensor-model-parallel-size", str(TP), "--num-layers", "2",
        "--hidden-size", str(H), "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
        "--group-query-attention", "--num-query-groups", str(GROUPS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]
RECOMPUTE = {"none": (),
             "selective": ("--recompute-granularity", "selective"),
             "full": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1")}
OVERLAP = ("--overlap-grad-reduce", "--overlap-param-gather")


def _train(tmp: Path, iterations: int, *extra: str) -> dict[str, Any]:
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, "--train-iters",
                           str(iterations), *extra, "--prism-world-size", "64", "--prism-real-ranks", str(RANK),
                           "--prism-profile", "dgx-h100", "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    logged = re.findall(rf"iteration\s+(\d)/\s+{iterations} \|.*\| lm loss: ([0-9.E+-]+) \|", proc.stdout)
    assert [i for i, _ in logged] == [str(i + 1) for i in range(iterations)]  # Megatron's own iteration lines
    summary = json.loads((out / f"rank{RANK}.summary.json").read_text())
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    assert summary["iterations_marked"] == iterations
    return summary


def _device(summary: dict[str, Any]) -> dict[str, Any]:
    return summary["virtual_gpu"]["devices"][0]


def _kernels(summary: dict[str, Any]) -> dict[str, int]:
    return {t["op"]: t["count"] for t in summary["virtual_gpu"]["kernels"]["top"]}


def _fused(summary: dict[str, Any]) -> dict[str, int]:
    """Kernels per fusion region (``fused::<name>``)."""
    return {t["op"]: t["count"] for t in summary["virtual_gpu"]["kernels"]["fused"]}


def _step_times(summary: dict[str, Any]) -> list[float]:
    return summary["virtual_gpu"]["virtual_time"]["step_times_s"]


@pytest.fixture(scope="module")
def recompute_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The three recompute settings' runs of 2 iterations, started together."""
    folders = {name: tmp_path_factory.mktemp(name) for name in RECOMPUTE}
    summaries = at_once(*(lambda name=name: _train(folders[name], 2, *RECOMPUTE[name]) for name in RECOMPUTE))
    return dict(zip(RECOMPUTE, summaries, strict=True))


@pytest.fixture(scope="module")
def recompute_none(recompute_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return recompute_runs["none"]


@pytest.fixture(scope="module")
def recompute_selective(recompute_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return recompute_runs["selective"]


@pytest.fixture(scope="module")
def recompute_full(recompute_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return recompute_runs["full"]


def test_recompute_lowers_the_peak_none_over_selective_over_full(recompute_none: dict[str, Any],
                                                                 recompute_selective: dict[str, Any],
                                                                 recompute_full: dict[str, Any]) -> None:
    peak = {name: _device(s)["peak_allocated_bytes"]
            for name, s in (("none", recompute_none), ("selective", recompute_selective), ("full", recompute_full))}
    assert peak["none"] > peak["selective"] > peak["full"], peak
    assert peak == {"none": 3_862_394_368, "selective": 3_188_170_240, "full": 2_901_622_784}
    # selective drops, per layer, the [b, np, s, s] core-attention tensors kept for backward (the fused softmax's
    # bf16 output 128 MiB, dropout mask 64 MiB, dropped-out probabilities 128 MiB with np = 32 / TP8 = 4 heads): at
    # least 2 x 320 MiB (measured: 674,224,128 B; the rest, 3,135,488 B, is not itemised)
    assert peak["none"] - peak["selective"] >= 2 * 320 * 2**20
    # after training all three hold the same model and optimizer states, and the weight-gradient stand-ins Megatron
    # takes from TransformerEngine's get_dummy_wgrad with gradient-accumulation fusion (one bf16 buffer per weight
    # shape, kept: QKV 768 x 4096, projection 4096 x 512, fc1 3584 x 4096, fc2 4096 x 1792, output 16128 x 4096)
    dummy_wgrads = 2 * (768 * 4096 + 4096 * 512 + 3584 * 4096 + 4096 * 1792 + 16128 * 4096)
    assert dummy_wgrads == 186_646_528
    assert {_device(s)["allocated_bytes"] for s in (recompute_none, recompute_selective, recompute_full)} == {
        1_790_074_368}  # 1,536,318,464 B of states + the stand-ins + 512 B + torch's two 32 MiB cuBLAS workspaces
    assert all(_device(s)["fits"] for s in (recompute_none, recompute_selective, recompute_full))


def test_full_recompute_reruns_the_forward_and_selective_the_core_attention(recompute_none: dict[str, Any],
                                                                           recompute_selective: dict[str, Any],
                                                                           recompute_full: dict[str, Any]) -> None:
    none, selective, full = (_kernels(s) for s in (recompute_none, recompute_selective, recompute_full))
    # the weight gradients are fused GEMMs accumulated into main_grad (gradient-accumulation fusion): 4 linears x 2
    # layers + the output layer = 9 per iteration; the other GEMMs are mm's
    assert {_fused(s)["fused::wgrad_gemm_accum_fp32"] for s in (recompute_none, recompute_selective,
                                                              recompute_full)} == {9 * 2}
    # full: each layer's forward runs again in backward: 4 GEMMs (QKV, attention output, fc1, fc2) x 2 layers x 2
    # iterations more; the output layer is not recomputed
    assert none["aten.mm.default"] == 36 and full["aten.mm.default"] == 36 + 4 * 2 * 2
    # selective: only the core attention (the scores' baddbmm and the fused masked softmax: 2 layers x 2 iterations,
    # as the local spec runs them in test_attention_standin.py) runs again; the GEMMs of the linear layers do not
    softmax = "fused::scaled_upper_triang_masked_softmax_cuda.forward"
    assert selective["aten.mm.default"] == 36
    assert _fused(recompute_none)[softmax] == 2 * 2
    assert selective["aten.baddbmm.default"] == _fused(recompute_selective)[softmax] == 2 * 2 * 2
    assert full["aten.baddbmm.default"] == _fused(recompute_full)[softmax] == 2 * 2 * 2
    kernels = {k: s["virtual_gpu"]["virtual_time"]["kernels"]
               for k, s in (("none", recompute_none), ("selective", recompute_selective), ("full", recompute_full))}
    assert kernels == {"none": 757, "selective": 789, "full": 973}
    # the recomputed forward's row-parallel layers all-reduce over TP again: 2 per layer x 2 layers x 2 iterations
    assert recompute_full["op_counts"]["all_reduce"] == recompute_none["op_counts"]["all_reduce"] + 2 * 2 * 2
    assert recompute_selective["op_counts"] == recompute_none["op_counts"]
    # recomputation costs virtual time (modelled, deterministic)
    steps = {k: _step_times(s) for k, s in (("none", recompute_none), ("selective", recompute_selective),
                                           ("full", recompute_full))}
    assert steps == {"none": [0.057732414], "selective": [0.059111614], "full": [0.067386814]}


def _dp_collectives(trace_dir: Path) -> list[list[tuple[str, int]]]:
    """Per traced iteration, the (op, bytes) of the reduce-scatters and all-gathers, each checked on the DP group."""
    trace = json.loads((trace_dir / f"rank{RANK}.trace.json").read_text())
    iterations = []
    for iteration in trace["iterations"]:
        ops = [op for op in iteration["ops"] if op[0] in ("reduce_scatter", "all_gather")]
        assert all(trace["groups"][op[1]] == DP_GROUP for op in ops), ops
        iterations.append([(op[0], op[3]) for op in ops])
    return iterations


def test_overlapped_dp_buckets_train_on_the_dp_group_and_shorten_the_step(tmp_path: Path) -> None:
    """``--overlap-grad-reduce --overlap-param-gather`` with the distributed optimizer at DP 8, 3 iterations (the
    trace holds iterations 2 and 3; the first is warm-up): the gradients are reduce-scattered in 3 buckets during
    backward and the parameters all-gathered in 3 buckets during the next forward, all on the DP group, and the
    emulated step is shorter than with one reduce-scatter and one all-gather after backward."""
    plain, overlap = at_once(
        lambda: _train(tmp_path / "plain", 3, "--prism-trace", str(tmp_path / "plain" / "trace")),
        lambda: _train(tmp_path / "overlap", 3, *OVERLAP, "--prism-trace", str(tmp_path / "overlap" / "trace")))
    grads, params = 746_668_032, 373_334_016  # this rank's fp32 main grads and bf16 parameters (186,667,008 each)
    assert grads == 186_667_008 * 4 and params == 186_667_008 * 2
    assert _dp_collectives(tmp_path / "plain" / "trace") == [[("reduce_scatter", grads), ("all_gather", params)]] * 2
    buckets = _dp_collectives(tmp_path / "overlap" / "trace")
    rs = [("reduce_scatter", b) for b in (264_241_152, 197_181_440, 285_245_440)]
    ag = [("all_gather", b) for b in (142_622_720, 98_590_720, 132_120_576)]
    # iteration 2 gathers its parameters in the warm-up iteration's window (after its optimizer step); iteration 3
    # gathers them in its own forward, bucket by bucket, before its reduce-scatters
    assert buckets == [rs, ag + rs]
    assert sum(b for _, b in rs) == grads and sum(b for _, b in ag) == params
    # over the run: 3 buckets in place of 1 in each of 3 iterations: 6 more of each; the same bytes in all
    assert overlap["op_counts"]["reduce_scatter"] == plain["op_counts"]["reduce_scatter"] + 3 * 2 == 9
    assert overlap["op_counts"]["all_gather"] == plain["op_counts"]["all_gather"] + 3 * 2 == 14
    assert overlap["op_bytes"] == plain["op_bytes"]
    # virtual time (modelled, deterministic): the buckets' communication hides behind backward and forward
    assert _step_times(plain) == [0.057732414, 0.057242957]
    assert _step_times(overlap) == [0.051467532, 0.041790576]
    assert all(o <= p for o, p in zip(_step_times(overlap), _step_times(plain), strict=True))
    assert _device(plain)["peak_allocated_bytes"] == 3_862_394_368
    assert _device(overlap)["peak_allocated_bytes"] == 3_862_435_328 and _device(overlap)["fits"]
