"""The fused-attention stand-in (``--prism-attention flash``) and context parallelism through it, on virtual H100s.

Llama-3-8B width (hidden 4096, 32 heads over 8 key/value groups, head dim 128), 2 layers, seq 8192, TP2, bf16,
distributed optimizer, attention dropout 0.1 (Megatron's default), 2 iterations, as rank 1 of 8 with virtual
time: the local spec's own attention (baddbmm + softmax + bmm), the stand-in at CP 1, and the stand-in at CP 2
(TE's all_gather form). Figures are modelled (kernel model ``roofline`` of dgx-h100, allocator model) and exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import outcomes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
H, FFN, HEADS, GROUPS, VOCAB, TP, SEQ = 4096, 14336, 32, 8, 128256, 2, 8192
ARGS = ["--transformer-impl", "local", "--tensor-model-parallel-size", str(TP), "--num-layers", "2",
        "--hidden-size", str(H), "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
        "--group-query-attention", "--num-query-groups", str(GROUPS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]
GiB, MiB = 2**30, 2**20


def _run(out: Path, *extra: str, device: tuple[str, ...] = ("--prism-device", "virtual-gpu")) \
        -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra,
                           "--prism-world-size", "8", "--prism-real-ranks", "1", "--prism-profile", "dgx-h100",
                           *device, "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PRISM_VIRTUAL_TIME": "on"})


def _summary(tmp: Path, *extra: str) -> dict[str, Any]:
    proc = _run(tmp / "out", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    summary = json.loads((tmp / "out" / "rank1.summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["iterations_marked"] == 2
    return summary


@pytest.fixture(scope="module")
def standin_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[dict[str, Any]]]:
    """The local spec's run and the flash stand-in's, started together (one core each; figures modelled)."""
    local, flash = tmp_path_factory.mktemp("local"), tmp_path_factory.mktemp("flash")
    return outcomes(local=lambda: _summary(local), flash=lambda: _summary(flash, "--prism-attention", "flash"))


@pytest.fixture(scope="module")
def local(standin_runs: dict[str, Future[dict[str, Any]]]) -> dict[str, Any]:
    return standin_runs["local"].result()


@pytest.fixture(scope="module")
def flash(standin_runs: dict[str, Future[dict[str, Any]]]) -> dict[str, Any]:
    return standin_runs["flash"].result()


def _ops(summary: dict[str, Any]) -> dict[str, int]:
    return {t["op"]: t["count"] for t in summary["virtual_gpu"]["kernels"]["top"]}


def _device(summary: dict[str, Any]) -> dict[str, Any]:
    return summary["virtual_gpu"]["devices"][0]


def test_local_spec_attention_is_the_programs_own(local: dict[str, Any]) -> None:
    assert "attention" not in local["megatron"]
    ops = _ops(local)  # 2 layers x 2 iterations: the scores' baddbmm and softmax, forward and backward
    # (torch's softmax: Megatron's fused masked-softmax kernel takes at most 4096 keys, and seq is 8192)
    assert ops["aten.baddbmm.default"] == 4 and ops["aten._softmax.default"] == 4
    assert ops["aten._softmax_backward_data.default"] == 4
    assert local["virtual_gpu"]["virtual_time"]["step_times_s"] == [0.127983944]


def test_flash_standin_replaces_each_layers_attention_with_one_fused_kernel(flash: dict[str, Any]) -> None:
    standin = flash["megatron"]["attention"]
    assert standin["implementation"] == "flash" and standin["modules_replaced"] == 2  # one per layer
    assert standin["forwards"] == 4 and standin["context_parallel"] is None
    assert standin["selective_recompute"] is False
    ops = _ops(flash)  # the 15 ops of most kernel time
    # F.scaled_dot_product_attention on the virtual H100: FlashAttention, forward and backward once per layer and
    # iteration; the only attention-class kernels (the forward's 4 are outside the top 15)
    assert ops["aten._scaled_dot_product_flash_attention_backward.default"] == 4
    assert not {"aten.baddbmm.default", "aten._softmax.default", "aten.bmm.default"} & set(ops)
    assert flash["virtual_gpu"]["kernels"]["by_class_s"]["attention"] == 0.009488175867
    assert flash["virtual_gpu"]["virtual_time"]["step_times_s"] == [0.088177536]


def test_the_standins_saving_is_the_unfused_attentions_time(local: dict[str, Any], flash: dict[str, Any]) -> None:
    # everything else is the same program: the step difference is the local spec's attention core (scores'
    # GEMMs, masked softmax, dropout on the scores, forward and backward) less the flash kernels, where the GPU
    # bounds the step (at 8192 keys every one of those kernels outlasts its launch)
    steps = [s["virtual_gpu"]["virtual_time"]["step_times_s"][0] for s in (local, flash)]
    assert round(steps[0] - steps[1], 9) == 0.039806408


def test_flash_standin_holds_no_s_by_s_tensor(local: dict[str, Any], flash: dict[str, Any]) -> None:
    b, heads_per_rank = 1, HEADS // TP
    scores = b * heads_per_rank * SEQ * SEQ * 2  # one [b, np, s, s] bf16 tensor: 2 GiB
    assert scores == 2 * GiB
    # after training the local spec still holds Megatron's global [b * np, sq, sk] buffer for baddbmm
    assert _device(local)["allocated_bytes"] - _device(flash)["allocated_bytes"] == scores
    # at the peak the local spec holds, per layer, the softmax output, the dropout mask (1 B per score) and the
    # dropped-out probabilities kept for the bmm's backward, and the global buffer; the last 15 MiB - 2 KiB are
    # the repeated (GQA) key/value copies less flash's saved output and log-sum-exp (not itemised further)
    s_by_s = 2 * (scores + scores // 2 + scores) + scores
    assert s_by_s == 12 * GiB
    assert _device(local)["peak_allocated_bytes"] - _device(flash)["peak_allocated_bytes"] == s_by_s + 15 * MiB - 2048
    assert _device(flash)["peak_allocated_bytes"] == 13_412_161_024


def test_context_parallel_2_all_gathers_kv_and_reduce_scatters_their_grads(tmp_path: Path) -> None:
    """TP2 CP2 (rank 1: TP rank 1, CP rank 0, CP group [1, 3]): the sequence is split in Megatron's load-balanced
    2 x CP chunks; the stand-in all-gathers K and V over the CP group in forward and in backward, and
    reduce-scatters dK and dV."""
    summary = _summary(tmp_path, "--context-parallel-size", "2", "--prism-attention", "flash",
                       "--prism-trace", str(tmp_path / "trace"))
    cp = summary["megatron"]["attention"]["context_parallel"]
    assert cp["size"] == 2 and cp["cp_comm_type"] == "all_gather" and cp["requested"] == ["p2p"]
    assert "ran as all_gather" in cp["note"]
    # global batch 4 over DP 8 / (2 x 2) = 2: 2 micro-batches x 2 layers x 2 iterations
    assert cp["forwards"] == 8
    ops = _ops(summary)
    # one flash kernel per local query chunk (2) and micro-batch, forward and backward
    assert ops["aten._flash_attention_backward.default"] == 16
    trace = json.loads((tmp_path / "trace" / "rank1.trace.json").read_text())
    (iteration,) = trace["iterations"]  # the traced iteration (the first is warm-up)
    on_cp = Counter((op[0], op[3]) for op in iteration["ops"] if trace["groups"][op[1]] == [1, 3])
    kv_bytes = SEQ * 1 * (GROUPS // TP) * (H // HEADS) * 2  # [s, b, ng, hn] bf16 gathered over CP: 8 MiB
    assert kv_bytes == 8 * MiB
    # per micro-batch and layer: K, V gathered in forward and again in backward; dK, dV reduce-scattered
    assert on_cp == {("all_gather", kv_bytes): 2 * 2 * 4, ("reduce_scatter", kv_bytes): 2 * 2 * 2}
    assert summary["virtual_gpu"]["virtual_time"]["step_times_s"] == [0.097613155]
    device = _device(summary)
    assert device["peak_allocated_bytes"] == 10_493_081_088 and device["fits"]


def test_context_parallel_without_the_standin_is_refused_naming_the_flag(tmp_path: Path) -> None:
    proc = _run(tmp_path / "out", "--context-parallel-size", "2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "--prism-attention flash" in proc.stderr and "Traceback" not in proc.stderr


def test_the_standin_is_refused_off_virtual_gpus(tmp_path: Path) -> None:
    proc = _run(tmp_path / "out", "--prism-attention", "flash", device=())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "--prism-device virtual-gpu" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.heavy
def test_prism_emulate_predicts_the_cp_job_with_the_standin_from_the_environment(tmp_path: Path) -> None:
    """``PRISM_ATTENTION=flash prism emulate`` (its profiling runs inherit the variable): the TP2 CP2 job at N = 8
    is one class of ranks (the load-balanced chunks give every CP rank the same attention work), replayed."""
    args = list(ARGS)
    i = args.index("--train-iters")
    args[i + 1] = "3"  # emulate drops one warm-up iteration
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "8", "--out",
                           str(tmp_path / "em"), "--json", "--", str(SCRIPT), *args, "--context-parallel-size", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PRISM_ATTENTION": "flash"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["layout"] == "tp=2,pp=1,cp=2,ep=1,dp=2" and report["classes_of_ranks"] == 1
    (rank_class,) = report["classes"]
    assert rank_class["ranks_like_it"] == 8 and rank_class["fits"]
    assert rank_class["peak_allocated_bytes"] == 10_493_081_088  # as rank 1 through the drop-in: same work, CP rank 0
    # modelled; 96.035 ms at 85 us a launch, 88.134 ms until the host time per launch was fitted (2026-12-05),
    # 84.576 ms before the H200 GEMM fit (e20845c); the exposed communication 11.319 ms until comm's own data steps
    # stopped being kernels
    assert report["step_ms"] == 96.234 and rank_class["exposed_comm_ms"] == 11.274
