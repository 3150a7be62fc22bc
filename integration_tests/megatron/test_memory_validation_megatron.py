"""Issue 12, item 5(c), Megatron: the emulated rank's parameter, gradient and optimizer-state bytes at Llama-3-8B
width against Megatron's own theoretical report, every difference itemised and asserted exactly.

The emulated rank runs ``prism_plugin/programs/pretrain_gpt.py`` unmodified on a virtual H100 (2 layers of
Llama-3-8B width: hidden 4096, ffn 14336, 32 heads / 8 groups, vocab 128256, untied, bf16, distributed
optimizer) under ``scripts/model_state_gpt.py``, which reads the rank's own tensors after training: DDP's bf16
parameter and fp32 gradient buffers, the distributed optimizer's fp32 main-parameter shard and its two Adam moments
(fake ``cuda`` tensors: sizes exact, no values), and calls
``megatron.training.theoretical_memory_usage.compute_weight_and_optimizer_memory`` on the same arguments:
``P x (6 + 12 / dp)`` bytes for the most loaded shard's ``P`` parameters (2 B bf16 weight + 4 B fp32 gradient,
12 B of fp32 main weight and moments sharded over DP).

Differences, each from the rank's own structures:
- **padding**: DDP's buffer pads each bucket's end to lcm(dp, 128) elements (and each param start to 64): the
  padded elements hold 2 + 4 B of buffer each; the theory counts none;
- **DP shard**: the optimizer's shard is the padded bucket / dp, so a DP rank holds whole elements, the padding
  falling in the last DP rank's range (not P / dp, a fraction in the theory);
- **embedding and output-layer placement**: with PP the theory's "most loaded shard" is the first stage (1/pp of
  the layers + the embedding) and it spreads the final norm over the stages (/ pp); the last stage holds the
  output layer (the embedding's size, untied) and the whole final norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path

import pytest

from integration_tests.at_once import outcomes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "model_state_gpt.py"
H, FFN, HEADS, GROUPS, VOCAB, TP = 4096, 14336, 32, 8, 128256, 8
ARGS = ["--transformer-impl", "local", "--tensor-model-parallel-size", str(TP), "--num-layers", "2",
        "--hidden-size", str(H), "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
        "--group-query-attention", "--num-query-groups", str(GROUPS), "--seq-length", "4096",
        "--max-position-embeddings", "4096", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]
PADDED_VOCAB = -(-VOCAB // (128 * TP)) * 128 * TP  # 129024: --make-vocab-size-divisible-by 128 x TP
EMBEDDING = PADDED_VOCAB // TP * H  # the vocab-parallel shard, 66,060,288; the untied output layer the same
LAYER = ((HEADS + 2 * GROUPS) * (H // HEADS) // TP * H + H // TP * H + 3 * FFN // TP * H + 2 * H)


def _state(tmp_path: Path, world: int, rank: int, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra,
                           "--prism-world-size", str(world), "--prism-real-ranks", str(rank),
                           "--prism-profile", "dgx-h100", "--prism-device", "virtual-gpu",
                           "--prism-output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("MODEL_STATE ")]
    return json.loads(line.split(" ", 1)[1])


def _emulated_bytes(s: dict) -> int:
    assert s["cuda_step_bytes"] == 0  # torch Adam's step counters stay on the host (not capturable)
    return s["param_buffer_bytes"] + s["grad_buffer_bytes"] + s["main_param_bytes"] + s["moment_bytes"]


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[dict]]:
    """The two tests' runs, started together (one core each; sizes, not times)."""
    tp8_dp8, pp2_dp5 = tmp_path_factory.mktemp("tp8_dp8"), tmp_path_factory.mktemp("pp2_dp5")
    return outcomes(
        tp8_dp8=lambda: _state(tp8_dp8, 64, 7, "--global-batch-size", "8"),
        pp2_dp5=lambda: _state(pp2_dp5, 80, 79, "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
                               "--global-batch-size", "10"))


def test_tp8_dp8_rank_holds_exactly_megatrons_theoretical_weight_and_optimizer_bytes(states: dict) -> None:
    s = states["tp8_dp8"].result()  # TP rank 7, DP rank 0 of 8
    theory = s["theory"]
    params = 2 * EMBEDDING + 2 * LAYER + H  # embedding + output layer + 2 layers + the final norm
    assert params == s["params"] == theory["parameters"] == 186_667_008  # Megatron's count (18 B / param) agrees
    # no padding: every param starts on 64 elements, the single bucket (no --overlap-grad-reduce) divides by
    # lcm(8, 128) = 128; the DP shard is exactly P / 8
    assert (s["start_pad_elements"], s["bucket_pad_elements"]) == (0, 0) and theory["bucket_divisor"] == 128
    assert s["param_buffer_bytes"] == 2 * params and s["grad_buffer_bytes"] == 4 * params  # bf16 weights, fp32 grads
    assert s["shard_elements"] == params // 8 == 23_333_376
    assert s["main_param_bytes"] == 4 * s["shard_elements"] and s["moment_bytes"] == 8 * s["shard_elements"]
    assert _emulated_bytes(s) == theory["weight_and_optimizer_bytes"] == 1_400_002_560  # 7.5 B / param, exact


def test_pp2_dp5_last_stage_differs_from_the_theory_by_padding_shard_and_placement(states: dict) -> None:
    # TP8 PP2 DP5 (world 80), rank 79: the last stage's TP rank 7, DP rank 4 of 5 (the last), buckets overlapped
    s = states["pp2_dp5"].result()
    theory, dp = s["theory"], 5
    params = LAYER + EMBEDDING + H  # one layer, the output layer, the whole final norm
    assert params == s["params"] == 93_335_552
    # placement: Megatron's most loaded shard is the first stage (1 layer + the embedding, of the same size as the
    # output layer) with the final norm spread over the stages (H / pp): the last stage holds H / 2 more
    theory_params = Fraction(theory["parameters"])
    assert theory_params == LAYER + EMBEDDING + Fraction(H, 2) == 93_333_504
    placement = params - theory_params
    assert placement == 2048
    # padding: the bucket's end rounds up to lcm(5, 128) = 640 elements (93,335,552 -> 93,335,680); starts aligned
    assert theory["bucket_divisor"] == 640 and s["start_pad_elements"] == 0
    padded = -(-params // 640) * 640
    assert s["bucket_pad_elements"] == padded - params == 128
    assert s["param_buffer_bytes"] == 2 * padded and s["grad_buffer_bytes"] == 4 * padded
    # DP shard: each DP rank owns padded / 5 elements of the buffer; the 128 padded ones fall in the last rank's
    # range, so this rank's optimizer holds 18,667,136 - 128 elements, against the theory's P / 5
    assert s["shard_elements"] == padded // dp - 128 == 18_667_008
    assert s["main_param_bytes"] == 4 * s["shard_elements"] and s["moment_bytes"] == 8 * s["shard_elements"]
    shard = s["shard_elements"] - theory_params / dp  # 307.2 elements
    # the whole difference, itemised: the placed elements' weight and gradient (6 B each; their optimizer share is in
    # the shard term), the padding's weight and gradient buffer (6 B each), the shard's 12 B per element over P / dp
    emulated, modelled = _emulated_bytes(s), Fraction(theory["weight_and_optimizer_bytes"]).limit_denominator(10)
    assert modelled == theory_params * (6 + Fraction(12, dp))
    difference = emulated - modelled
    assert difference == 6 * placement + 6 * s["bucket_pad_elements"] + 12 * shard
    assert (6 * placement, 6 * s["bucket_pad_elements"], 12 * shard) == (12_288, 768, Fraction(18_432, 5))
    assert difference == Fraction(83_712, 5)  # 16,742.4 B on 784,018,176 B
    assert emulated == 784_018_176
