"""MoE options of Megatron's functional tests on a virtual H100.

- ``--moe-permute-fusion``: TransformerEngine's Triton permutation kernels run as one fused kernel each
  (`prism_plugin.adapters.megatron.triton_kernels.TE_PERMUTATION`), reading and writing the tensors the kernels do;
  before, the flag was refused.
- ``--overlap-moe-expert-parallel-comm``: Megatron's combined 1F1B schedule (the program's ``forward_step`` builds
  the schedule plan, as upstream's; the all-to-all's inputs are recorded on a virtual stream): the all-to-alls of
  one micro-batch hide behind the other's compute, so the modelled step is shorter.

The job: 2 layers of width 1024, 4 experts top-2, grouped GEMM, the all-to-all dispatcher, EP 2, micro-batch 2 of
seq 1024, rank 0 of 8, two iterations, the TransformerEngine spec. About 60 s of runs; each test's two start
together (`integration_tests.at_once`: one core each, every figure compared modelled or counted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once
from integration_tests.profiles import launch_light_profile

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
S, B, HIDDEN, EXPERTS, TOPK = 1024, 2, 1024, 4, 2
ARGS = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "16", "--ffn-hidden-size",
        "3584", "--seq-length", str(S), "--max-position-embeddings", str(S), "--vocab-size", "32000",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--micro-batch-size", str(B), "--train-iters", "2",
        "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000000", "--disable-gloo-process-groups",
        "--use-distributed-optimizer", "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
        "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"]


def _run(tmp: Path, *extra: str, global_batch: int = 16, profile: str = "dgx-h100") -> dict[str, Any]:
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, "--global-batch-size",
                           str(global_batch), *extra,
                           "--prism-world-size", "8", "--prism-real-ranks", "0", "--prism-device", "virtual-gpu",
                           "--prism-profile", profile, "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "rank0.summary.json").read_text())


def _triton(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k["op"]: k for k in summary["virtual_gpu"]["kernels"]["fused"] if k["op"].startswith("fused::triton")}


def test_the_fused_permutation_runs_as_te_kernels(tmp_path: Path) -> None:
    plain, fused = at_once(lambda: _run(tmp_path / "plain"), lambda: _run(tmp_path / "fused", "--moe-permute-fusion"))
    assert _triton(plain) == {}
    kernels = _triton(fused)
    layers_x_iterations = 2 * 2
    tokens = S * B  # this rank's tokens; each goes to TOPK experts (balanced routing policy)
    bf16, int32 = 2, 4
    row_id_map = tokens * (2 * EXPERTS + 1) * int32
    probs, permuted_probs = tokens * EXPERTS * bf16, tokens * TOPK * bf16
    hidden_in, hidden_out = tokens * HIDDEN * bf16, tokens * TOPK * HIDDEN * bf16
    # forward: the tokens, the map and the router's probs in; the permuted tokens and probs out. Backward (the
    # unpermute's gradient): the same without probs
    forward = hidden_in + row_id_map + probs + hidden_out + permuted_probs
    backward = forward - probs - permuted_probs
    permute = kernels["fused::triton::permute_kernel"]
    assert permute["count"] == 2 * layers_x_iterations
    assert permute["bytes"] == layers_x_iterations * (forward + backward)
    for name in ("row_id_map_pass_1_kernel", "row_id_map_pass_2_kernel", "row_id_map_pass_3_kernel"):
        assert kernels[f"fused::triton::{name}"]["count"] == layers_x_iterations, name
    assert kernels["fused::triton::unpermute_kernel"]["count"] == 2 * layers_x_iterations
    assert kernels["fused::triton::sort_chunks_by_map_kernel"]["count"] == 4 * layers_x_iterations
    assert all(k["class"] == "elementwise" and k["total_s"] > 0 for k in kernels.values())
    # the same job otherwise: the same routing (the policy's counts), the same expert GEMMs
    assert fused["megatron"]["moe_routing"]["tokens_sent"] == plain["megatron"]["moe_routing"]["tokens_sent"]


def test_the_all_to_all_overlap_schedule_hides_communication(tmp_path: Path) -> None:
    # 4 micro-batches per data rank (global batch 64): the combined schedule pairs them. With a launch-light host
    # (5 us a launch) the GPU bounds this toy's step, as it does a real-size job's: at dgx-h100's 85 us the host
    # does, and the overlap's extra launches cost more than the communication it hides
    profile = str(launch_light_profile(tmp_path))
    plain, overlap = at_once(lambda: _run(tmp_path / "plain", global_batch=64, profile=profile),
                             lambda: _run(tmp_path / "overlap", "--overlap-moe-expert-parallel-comm", global_batch=64,
                                          profile=profile))
    assert plain["op_counts"]["all_to_all"] == overlap["op_counts"]["all_to_all"] == 2 * 2 * 4 * 6
    steps = [s["virtual_gpu"]["virtual_time"]["step_times_s"] for s in (plain, overlap)]
    assert steps == [[0.023116386], [0.022205089]]  # modelled, deterministic: 0.91 ms of all-to-all hidden
