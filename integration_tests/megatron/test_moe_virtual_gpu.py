"""Mixtral 8x7B width (2 layers) with expert parallelism on virtual H100s, as one rank of N (issue 12, items 2, 4).

The repo's upstream-style ``pretrain_gpt.py`` trains Mixtral's MoE (8 experts, top-2, EP8, all-to-all dispatcher;
hidden 4096, FFN 14336 per expert, GQA 32/8, seq 4096, vocab 32000, bf16, distributed optimizer, mock data) for 2
iterations. The router's top-k has no values on fake tensors: the token counts the dispatcher reads come from the
MoE routing policy (`adapters.megatron.moe`): balanced by default, ``--prism-moe-routing skew:SEED[,ALPHA]`` as a
what-if. The all-to-all splits, hence the bytes sent and received and the expert GEMM shapes, follow the policy;
the figures below are derived from it exactly (bytes, FLOPs), the memory figures are the allocator model's, pinned
to the byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from integration_tests.at_once import at_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
H, FFN, HEADS, GROUPS, VOCAB, SEQ, EXPERTS, TOPK = 4096, 14336, 32, 8, 32000, 4096, 8, 2
ARGS = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", str(H), "--ffn-hidden-size", str(FFN),
        "--num-attention-heads", str(HEADS), "--group-query-attention", "--num-query-groups", str(GROUPS),
        "--seq-length", str(SEQ), "--max-position-embeddings", "32768", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "1000", "--disable-gloo-process-groups", "--num-experts", str(EXPERTS),
        "--moe-router-topk", str(TOPK), "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall"]
_RUNS: dict[tuple[str, ...], tuple[subprocess.CompletedProcess[str], dict[str, Any]]] = {}
PINNED_ALLGATHER = (19_761_808_384, 20_199_768_064)
"""Peak allocated and reserved of the all-gather dispatcher's run (the allocator model's, measured on this tree)."""


def _run(tmp: Path, rank: int, n: int, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """One real rank of `n` (cached per argv within the session: the balanced run serves three tests)."""
    key = (str(rank), str(n), *extra)
    if key not in _RUNS:
        out = tmp / f"out-{len(_RUNS)}"
        proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra,
                               "--prism-world-size", str(n), "--prism-real-ranks", str(rank), "--prism-profile",
                               "dgx-h100", "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        path = out / f"rank{rank}.summary.json"
        _RUNS[key] = (proc, json.loads(path.read_text()) if path.is_file() else {})
    return _RUNS[key]


@pytest.fixture(scope="module")
def ep8_runs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The three runs of rank 0 of 8 the tests below read (balanced, skew:7, the all-gather dispatcher), started
    together into `_run`'s cache (one core each; every figure the tests check is the policy's, counted or modelled)."""
    folders = [tmp_path_factory.mktemp(name) for name in ("balanced", "skew", "allgather")]
    at_once(lambda: _run(folders[0], 0, 8), lambda: _run(folders[1], 0, 8, "--prism-moe-routing", "skew:7"),
            lambda: _run(folders[2], 0, 8, "--moe-token-dispatcher-type", "allgather"))


def _a2a_bytes(sent: int, received: int) -> int:
    """All-to-all bytes one MoE layer sends in one micro-batch: forward dispatch (bf16 tokens, bf16 probs) and
    combine (the experts' outputs go back), then backward the same two the other way round."""
    return 2 * (sent + received) * H * 2 + (sent + received) * 2


def _parameters() -> tuple[int, int]:
    """(dense, expert) parameters of one EP8 TP1 rank: everything but its one expert per layer, and that expert."""
    layer = ((HEADS + 2 * GROUPS) * (H // HEADS) * H + H * H  # fused QKV (32 + 2 x 8 heads of 128), projection
             + EXPERTS * H + 2 * H)  # the router, the two RMSNorms
    dense = 2 * VOCAB * H + 2 * layer + H  # embedding, untied output layer (32000 = 250 x 128: no padding), final norm
    return dense, 2 * (2 * FFN * H + FFN * H)  # SwiGLU fc1 (gate and up) and fc2 of one expert, 2 layers


def test_mixtral_width_ep8_trains_as_rank_0_of_8_with_exactly_balanced_routing(tmp_path_factory: Any,
                                                                              ep8_runs: None) -> None:
    proc, summary = _run(tmp_path_factory.mktemp("balanced"), 0, 8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    log = proc.stdout
    dense, expert = _parameters()
    assert re.findall(r"number of parameters on \(tensor, gtp_remat, pipeline\) model parallel rank \(0, 0, 0\): "
                      r"(\d+)", log) == [str(dense + expert)] == ["698437632"]
    iterations = re.findall(r"iteration\s+(\d)/\s+2 \|.*\| lm loss: ([0-9.E+-]+) \|", log)
    assert [i for i, _ in iterations] == ["1", "2"] and float(iterations[0][1]) == 1.0
    assert summary["exit_code"] == 0 and summary["iterations_marked"] == 2
    routing = summary["megatron"]["moe_routing"]
    tokens = SEQ  # micro-batch 1 x seq 4096, no sequence parallelism
    per_expert = tokens * TOPK // EXPERTS  # 1024, no remainder
    # 2 layers x 2 iterations x 1 micro-batch (global 8 / DP 8), each answered at the dispatcher's preprocess
    assert routing["policy"] == "balanced" and routing["answers"] == 4
    assert [(s["site"].rsplit("/", 1)[1].split(":")[0], s["count"]) for s in routing["by_site"]] == \
        [("token_dispatcher.py", 4)]
    for layer in routing["layers"]:  # this rank sends 1024 tokens to each expert's rank, and gets 1024 from each
        assert layer == {"calls": 2, "tokens": tokens, "source": 0, "counts": [per_expert] * 8,
                         "input_splits": [per_expert] * 8, "output_splits": [per_expert] * 8,
                         "output_splits_tp": [8 * per_expert], "tokens_per_local_expert": [8 * per_expert]}
    assert routing["tokens_sent"] == routing["tokens_received"] == 4 * tokens * TOPK
    # the all-to-alls' bytes follow the splits exactly: 6 per layer and micro-batch
    assert summary["op_counts"]["all_to_all"] == 24
    assert summary["op_bytes"]["all_to_all"] == 4 * _a2a_bytes(tokens * TOPK, tokens * TOPK) == 1_073_872_896
    device = summary["virtual_gpu"]["devices"][0]
    # the allocator model's figures, exact (measured on this tree, Megatron's fused kernels one kernel each and the
    # dummy wgrad buffers it takes from TE with gradient-accumulation fusion kept); Megatron's memory line reads them
    assert (device["allocated_bytes"], device["peak_allocated_bytes"], device["peak_reserved_bytes"],
            device["device_total_bytes"]) == (10_812_844_544, 19_762_463_744, 20_333_985_792, 21_641_560_064)
    memory = re.findall(r"\(after 2 iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)",
                        log)
    assert [tuple(map(float, m)) for m in memory] == [(round(device["allocated_bytes"] / 2**20, 2),
                                                       round(device["peak_allocated_bytes"] / 2**20, 2))]
    # what stays after training holds at least the bf16 weights and fp32 gradient buffers of both, the expert's
    # whole fp32 main copy and Adam moments (its expert-data-parallel group is this one rank: it has its own
    # buffers and optimizer) and 1/8 of the dense part's (DP 8)
    assert device["allocated_bytes"] >= (dense + expert) * (2 + 4) + expert * 12 + dense // 8 * 12 == 8_937_658_368
    assert device["fits"]


def test_skew_routing_is_seeded_and_the_expert_gemms_and_bytes_follow_it(tmp_path_factory: Any,
                                                                         ep8_runs: None) -> None:
    tmp = tmp_path_factory.mktemp("skew")
    proc, summary = _run(tmp, 0, 8, "--prism-moe-routing", "skew:7")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    _, balanced = _run(tmp_path_factory.mktemp("balanced"), 0, 8)
    routing = summary["megatron"]["moe_routing"]
    assert routing["policy"] == "skew:7,1" and routing["answers"] == 4
    tokens = SEQ
    layers = routing["layers"]
    # the seed fixes each layer's hot experts (Zipf, alpha 1): the same in every run
    assert [layer["counts"] for layer in layers] == [[3014, 753, 377, 431, 1507, 1005, 502, 603],
                                                     [753, 603, 3014, 502, 431, 377, 1507, 1005]]
    received = []
    for layer in layers:  # every source routes the same counts: expert 0 (this rank's) gets 8 x counts[0]
        assert sum(layer["counts"]) == tokens * TOPK and layer["input_splits"] == layer["counts"]
        assert layer["output_splits"] == [layer["counts"][0]] * 8
        assert layer["tokens_per_local_expert"] == [8 * layer["counts"][0]]
        received.append(8 * layer["counts"][0])
    assert routing["tokens_received"] == 2 * sum(received)
    assert summary["op_bytes"]["all_to_all"] == sum(2 * _a2a_bytes(tokens * TOPK, r) for r in received)
    # the expert GEMMs take the received tokens: fc1 (H -> 2 FFN) and fc2 (FFN -> H), forward and the two backward
    # GEMMs of each, 2 iterations; every other GEMM is the balanced run's
    flops = {name: s["virtual_gpu"]["kernels"]["flops"] for name, s in (("skew", summary), ("balanced", balanced))}
    per_token = 3 * (2 * H * 2 * FFN + 2 * FFN * H)
    assert flops["skew"] - flops["balanced"] == 2 * (sum(received) - 2 * 8 * 1024) * per_token
    # more tokens on this rank's expert: a higher peak than balanced routing
    peaks = [s["virtual_gpu"]["devices"][0]["peak_allocated_bytes"] for s in (summary, balanced)]
    assert peaks == [21_059_023_360, 19_762_463_744]


@pytest.mark.heavy
def test_skew_with_tp2_sequence_parallel_splits_over_tp_and_ep(tmp_path_factory: Any) -> None:
    """TP2 + SP (expert TP 2) x EP8 as rank 5 of 16: TP rank 1, EP rank 2 (expert 2); 2048 tokens per rank."""
    proc, summary = _run(tmp_path_factory.mktemp("tp2"), 5, 16, "--tensor-model-parallel-size", "2",
                         "--sequence-parallel", "--prism-moe-routing", "skew:7")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    layers = summary["megatron"]["moe_routing"]["layers"]
    tokens = SEQ // 2
    assert [layer["counts"] for layer in layers] == [[1507, 377, 188, 215, 754, 502, 251, 302],
                                                     [377, 302, 1507, 251, 215, 188, 754, 502]]
    for layer in layers:
        mine = layer["counts"][2]
        assert layer["tokens"] == tokens and layer["source"] == 2 * 2 + 1  # EP rank 2 x TP 2 + TP rank 1
        assert layer["output_splits"] == [mine] * 8  # from each EP rank at this TP rank
        assert layer["output_splits_tp"] == [8 * mine] * 2  # then gathered over expert TP
        assert layer["tokens_per_local_expert"] == [16 * mine]
    # the all-to-all is over EP (TP gathers after it): it receives output_splits rows of the full hidden size
    assert summary["op_bytes"]["all_to_all"] == sum(
        2 * _a2a_bytes(tokens * TOPK, sum(layer["output_splits"])) for layer in layers) == 712_856_544
    device = summary["virtual_gpu"]["devices"][0]
    assert (device["peak_allocated_bytes"], device["peak_reserved_bytes"]) == (10_753_712_640, 12_205_424_640)


def test_the_allgather_dispatcher_takes_its_counts_from_the_policy(tmp_path_factory: Any, ep8_runs: None) -> None:
    """``--moe-token-dispatcher-type allgather``: every rank gathers all 8 ranks' tokens and keeps its expert's. The
    count it reads on the host (``tokens_per_expert``) is the policy's: 8 sources x 1024 balanced tokens; the
    expert GEMMs then take what the all-to-all run's do (the same FLOPs), only the communication differs."""
    proc, summary = _run(tmp_path_factory.mktemp("allgather"), 0, 8, "--moe-token-dispatcher-type", "allgather")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    _, alltoall = _run(tmp_path_factory.mktemp("balanced"), 0, 8)
    routing = summary["megatron"]["moe_routing"]
    per_expert = SEQ * TOPK // EXPERTS
    assert routing["answers"] == 4 and [(s["site"].rsplit("/", 1)[1].split(":")[0], s["count"])
                                        for s in routing["by_site"]] == [("moe_layer.py", 4)]
    assert [layer["tokens_per_local_expert"] for layer in routing["layers"]] == [[8 * per_expert]] * 2
    assert routing["tokens_received"] == 4 * 8 * per_expert
    ops = {name: s["op_counts"] for name, s in (("allgather", summary), ("alltoall", alltoall))}
    assert "all_to_all" not in ops["allgather"]  # gathered over TP x EP, combined by a reduce-scatter
    assert ops["allgather"]["reduce_scatter"] > ops["alltoall"].get("reduce_scatter", 0)
    kernels = {name: s["virtual_gpu"]["kernels"] for name, s in (("allgather", summary), ("alltoall", alltoall))}
    assert kernels["allgather"]["flops"] == kernels["alltoall"]["flops"]
    device = summary["virtual_gpu"]["devices"][0]
    assert (device["peak_allocated_bytes"], device["peak_reserved_bytes"]) == PINNED_ALLGATHER


def test_token_dropping_is_refused_at_the_dispatcher_and_a_bad_policy_at_the_flag() -> None:
    from prism_plugin.adapters.megatron.moe import RoutingPolicy, parse_routing
    from prism_plugin.device.values import NoValueError

    dispatcher = SimpleNamespace(config=SimpleNamespace(moe_expert_capacity_factor=1.25,
                                                        moe_router_padding_for_quantization=False))
    with pytest.raises(NoValueError, match=r"test_moe_virtual_gpu\.py:\d+ .*MoEAlltoAllTokenDispatcher\.preprocess"
                                           r".*--moe-expert-capacity-factor"):
        RoutingPolicy(parse_routing("balanced")).preprocess(dispatcher, None)
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), "--prism-world-size", "8",
                           "--prism-real-ranks", "0", "--prism-moe-routing", "skew:x"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--prism-moe-routing skew:x: expected 'balanced' or 'skew:SEED" in proc.stderr
