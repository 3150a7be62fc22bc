"""Multi-latent attention (``--multi-latent-attention``) on a virtual H100: Megatron's Triton rotary kernels run as
one fused kernel each (`prism_plugin.adapters.megatron.triton_kernels`), with the bytes the kernels move.

Before, the first MLA forward died in triton's driver (``libcuda.so cannot found``). The job: 2 layers of width
1024, 16 heads, q/kv LoRA ranks 256/128, qk head dim 64 + rotary 32, v head dim 64, seq 1024, micro-batch 2, as rank 0
of 8 (DP 8, one micro-batch per iteration), two iterations, the TransformerEngine spec. About 15 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
S, B, H, QK, EMB, V, HIDDEN = 1024, 2, 16, 64, 32, 64, 1024
ARGS = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", str(H), "--ffn-hidden-size",
        "3584", "--seq-length", str(S), "--max-position-embeddings", str(S), "--vocab-size", "32000",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--micro-batch-size", str(B), "--global-batch-size", str(8 * B), "--train-iters",
        "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000000", "--disable-gloo-process-groups",
        "--use-distributed-optimizer", "--multi-latent-attention", "--kv-lora-rank", "128", "--q-lora-rank", "256",
        "--qk-head-dim", str(QK), "--qk-pos-emb-head-dim", str(EMB), "--v-head-dim", str(V)]


def test_mla_trains_with_its_rotary_kernels_as_one_kernel_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, "--prism-world-size",
                           "8", "--prism-real-ranks", "0", "--prism-device", "virtual-gpu", "--prism-output",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "rank0.summary.json").read_text())
    assert summary["iterations_marked"] == 2
    fused = {k["op"]: k for k in summary["virtual_gpu"]["kernels"]["fused"]}
    bf16 = 2
    rows = 2 * S * EMB * bf16  # the cos and sin rows of the sequence's positions
    per_launch = {
        # in place on each head's rotary part: read and written
        "rotary_fwd_q_kernel": 2 * S * B * H * EMB * bf16 + rows,
        "rotary_bwd_q_kernel": 2 * S * B * H * EMB * bf16 + rows,
        # read kv and the positional key; write the key (k + rotary) and the value
        "rotary_fwd_kv_kernel": (S * B * H * (QK + V) + S * B * EMB + S * B * H * (QK + EMB) + S * B * H * V) * bf16
        + rows,
        # read the key's and value's gradients; write kv's and the positional key's
        "rotary_bwd_kv_kernel": (S * B * H * (QK + EMB) + S * B * H * V + S * B * H * (QK + V) + S * B * EMB) * bf16
        + rows,
    }
    for name, nbytes in per_launch.items():
        kernel = fused[f"fused::triton::{name}"]
        assert kernel["count"] == 2 * 2, name  # 2 layers x 2 iterations, one micro-batch each
        assert kernel["bytes"] == 4 * nbytes, name
        assert kernel["class"] == "elementwise" and kernel["total_s"] > 0, name
