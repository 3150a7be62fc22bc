"""megatron.training on virtual H100s through the drop-in: ``--prism-device virtual-gpu`` (issue 12, item 1).

The repo's upstream-style ``pretrain_gpt.py`` trains Llama-3-8B-width GPT (2 layers, TP8, bf16, distributed
optimizer, mock data) for 2 iterations as one real rank of 64: Megatron takes its GPU paths on fake ``cuda``
tensors (no CPU shim), prints its own iteration and ``memory (MB)`` log lines (the memory figures are the
allocator model's, the loss the value policy's), and the summary carries the virtual GPU's memory. Rank 7 is TP
rank 7 of a group whose TP rank 0 is virtual (the valid-batch fill); rank 63 is the last rank (Megatron's logs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.at_once import at_once
from integration_tests.summary_schema import assert_published_schema

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
H, FFN, HEADS, GROUPS, VOCAB, TP, SEQ = 4096, 14336, 32, 8, 128256, 8, 4096
ARGS = ["--transformer-impl", "local", "--tensor-model-parallel-size", str(TP), "--num-layers", "2",
        "--hidden-size", str(H), "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
        "--group-query-attention", "--num-query-groups", str(GROUPS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]


def _run(tmp_path: Path, rank: int, *extra: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    return subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra,
                           "--prism-world-size", "64", "--prism-real-ranks", str(rank), "--prism-profile", "dgx-h100",
                           "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def _parameters_per_tp_rank() -> int:
    padded_vocab = -(-VOCAB // (128 * TP)) * 128 * TP  # Megatron pads to --make-vocab-size-divisible-by 128 x TP
    embedding = padded_vocab // TP * H  # 16128 x 4096, the vocab-parallel shard; the untied output layer is the same
    layer = ((HEADS + 2 * GROUPS) * (H // HEADS) // TP * H  # fused QKV: 32 query heads + 2 x 8 key/value groups
             + H // TP * H  # attention output projection
             + 2 * FFN // TP * H + FFN // TP * H  # SwiGLU fc1 (gate and up) and fc2
             + 2 * H)  # the two RMSNorms
    return 2 * embedding + 2 * layer + H  # + the final norm


@pytest.mark.parametrize("rank", [pytest.param(7, marks=pytest.mark.heavy), 63])
def test_pretrain_gpt_trains_llama3_8b_width_tp8_on_a_virtual_h100(tmp_path: Path, rank: int) -> None:
    proc = _run(tmp_path, rank)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    log = proc.stdout
    params = _parameters_per_tp_rank()
    assert params == 186_667_008
    counted = re.findall(r"number of parameters on \(tensor, gtp_remat, pipeline\) model parallel rank "
                         rf"\({rank % TP}, 0, 0\): (\d+)", log)
    # Megatron prints the count and its memory line on data-parallel rank 0 only (rank 7: DP 0; rank 63: DP 7)
    assert counted == ([str(params)] if rank == 7 else [])
    iterations = re.findall(r"iteration\s+(\d)/\s+2 \|.*\| lm loss: ([0-9.E+-]+) \|.*grad norm: ([0-9.]+) \|", log)
    assert [i for i, _, _ in iterations] == ["1", "2"]
    assert float(iterations[0][1]) == 1.0  # the value policy's finite loss (no value is computed)
    # grad norm: with TransformerEngine importable (as on a GPU host with TE) Megatron takes TE's multi-tensor l2
    # norm, which stays on the device: its value is unknown until the one host read of the all-reduced total, which
    # the value policy answers (1.0). (Megatron's local l2 norm read each rank's norm on the host first, and the
    # mirrored sum over the 64 ranks gave sqrt(64 x 1.0) = 8.)
    assert all(float(grad) == 1.0 for _, _, grad in iterations)
    memory = re.findall(r"\(after (\d) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+) "
                        r"\| reserved: ([\d.]+) \| max reserved: ([\d.]+)", log)
    assert [m[0] for m in memory] == (["1", "2"] if rank == 7 else [])
    summary = json.loads((tmp_path / "out" / f"rank{rank}.summary.json").read_text())
    assert_published_schema(summary)  # the drop-in's: the megatron section, the virtual GPU's
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    assert summary["iterations_marked"] == 2
    device = summary["virtual_gpu"]["devices"][0]
    mib = 2 ** 20
    if memory:  # Megatron's own memory line reads torch.cuda.memory_allocated & co: the allocator model's figures
        assert float(memory[-1][1]) == round(device["allocated_bytes"] / mib, 2)
        assert float(memory[-1][2]) == round(device["peak_allocated_bytes"] / mib, 2)
        assert float(memory[-1][4]) == round(device["peak_reserved_bytes"] / mib, 2)
    # at least the bf16 weights, their fp32 main-grad buffer and this DP rank's fp32 Adam state (1/8 of 3 copies)
    assert device["peak_allocated_bytes"] >= params * (2 + 4) + params * 12 // 8
    assert device["peak_reserved_bytes"] >= device["peak_allocated_bytes"] and device["fits"]
    megatron = summary["megatron"]
    assert megatron["virtual_gpu"] and not megatron["cpu_mode"] and megatron["cpu_patches"] == []
    # only RoPE fusion (TransformerEngine's kernel, with the local spec); the other fusion defaults are fake kernels
    # and the data-loader workers (host processes the emulation never times: the batches load in the main process)
    assert megatron["switched_off"] == ["--no-rope-fusion", "--num-workers 0"]
    # rank 7: TP rank 7 whose TP rank 0 (rank 0) is virtual gets a valid batch per micro-batch; rank 63 likewise
    assert megatron["tp_batches_filled"] == 2
    assert megatron["last_rank_logs_by"] == (None if rank == 63 else rank)


def test_an_unmodelled_checkpoint_kind_is_refused_up_front_on_virtual_gpus(tmp_path: Path) -> None:
    """--save runs on virtual GPUs (test_virtual_gpu_checkpoints.py); a legacy save of the distributed optimizer
    (its state gathered to data-parallel rank 0) is not modelled and is refused, naming the flag."""
    proc = _run(tmp_path, 7, "--save", str(tmp_path / "ckpt"), "--ckpt-format", "torch")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "--ckpt-format torch with --use-distributed-optimizer" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "ckpt").exists()


def test_pipeline_last_stage_trains_on_a_virtual_h100(tmp_path: Path) -> None:
    """TP8 PP2 as rank 63 of 64: the last stage, whose activations come from a virtual first stage."""
    proc = _run(tmp_path, 63, "--pipeline-model-parallel-size", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    iterations = re.findall(r"iteration\s+(\d)/\s+2 \|.*\| lm loss: ([0-9.E+-]+) \|", proc.stdout)
    assert [i for i, _ in iterations] == ["1", "2"] and float(iterations[0][1]) == 1.0
    summary = json.loads((tmp_path / "out" / "rank63.summary.json").read_text())
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    assert summary["iterations_marked"] == 2
    # global batch 8 over DP 64 / (8 x 2) = 4 ranks: 2 micro-batches per iteration, each filled (TP rank 0 virtual)
    assert summary["megatron"]["tp_batches_filled"] == 4
    assert summary["megatron"]["p2p_virtual_receives_filled"] == 0  # fake tensors: nothing to un-degenerate
    padded_vocab = -(-VOCAB // (128 * TP)) * 128 * TP
    stage = (_parameters_per_tp_rank() - 2 * padded_vocab // TP * H - H) // 2 + padded_vocab // TP * H + H
    assert stage == 93_335_552  # one layer, the final norm and the output layer
    device = summary["virtual_gpu"]["devices"][0]
    assert device["peak_allocated_bytes"] >= stage * (2 + 4) + stage * 12 // 4


def test_torchrun_form_reexecutes_once_with_the_device_library(tmp_path: Path) -> None:
    """Under torchrun the worker re-executes itself (same pid) with PRISM_VIRTUAL_CUDA_LIB set, before torch."""
    out = tmp_path / "out"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "localhost:0", "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, "--prism-world-size", "64",
                           "--prism-real-ranks", "7", "--prism-profile", "dgx-h100", "--prism-device", "virtual-gpu",
                           "--prism-output", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    summary = json.loads((out / "rank7.summary.json").read_text())
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    peak = re.findall(r"\(after 2 iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: ([\d.]+)",
                      proc.stdout)
    assert [float(p) for p in peak] == [round(summary["virtual_gpu"]["devices"][0]["peak_allocated_bytes"] / 2**20, 2)]


def test_sequence_parallel_trains_on_a_virtual_h100_and_shards_the_activations(tmp_path: Path) -> None:
    """TP8 + sequence parallelism (the local spec's norm takes it as on a GPU with apex: the CPU shim's patch 10,
    applied alone on virtual GPUs): it trains, its linear layers gather and scatter the sequence over TP, and the
    peak is lower than without SP (the layer-norm
    and dropout activations are 1/TP of the sequence)."""
    runs = {}
    jobs = (("sp", ("--sequence-parallel",)), ("plain", ()))
    procs = at_once(*(lambda name=name, extra=extra: _run(tmp_path / name, 7, *extra) for name, extra in jobs))
    for (name, _), proc in zip(jobs, procs, strict=True):  # the two runs at once (one core each; figures modelled)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        runs[name] = json.loads((tmp_path / name / "out" / "rank7.summary.json").read_text())
    sp, plain = runs["sp"], runs["plain"]
    assert sp["exit_code"] == 0 and sp["megatron"]["virtual_gpu"]
    # SP's linear layers all-gather / reduce-scatter the sequence over TP (the distributed optimizer's own
    # reduce-scatters are in both runs)
    assert sp["op_counts"]["reduce_scatter"] > plain["op_counts"].get("reduce_scatter", 0)
    assert sp["op_counts"]["all_gather"] > plain["op_counts"]["all_gather"]
    peak = {k: r["virtual_gpu"]["devices"][0]["peak_allocated_bytes"] for k, r in runs.items()}
    assert peak["sp"] < peak["plain"], peak
