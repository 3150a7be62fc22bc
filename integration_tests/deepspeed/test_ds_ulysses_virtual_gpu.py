"""DeepSpeed-Ulysses sequence parallelism on a virtual GPU: rank 5 of 64, sp = 4, dp = 16, on a virtual H100.

The script (scripts/ds_ulysses_train.py) is DeepSpeed's ``DistributedAttention`` around torch's attention, its
sequence-parallel group from the (dp, sp) device mesh ``deepspeed.initialize(mesh_param=...)`` builds. Each rank
holds 4096 / 4 = 1024 tokens of all 16 heads; Ulysses' all-to-alls over the group of 4 give it the whole sequence
of 4 heads for attention, and take the output back. Nothing is emulation-specific but the section and the drop-in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_ulysses_train.py"
HIDDEN, HEADS, SEQ, SP, DP, STEPS = 1024, 16, 4096, 4, 16, 2


def test_ulysses_attention_over_a_sequence_parallel_group_of_4(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": DP,
              "bf16": {"enabled": True}, "steps_per_print": 1000,
              "sequence_parallel_size": SP, "data_parallel_size": DP,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 1},
              "prism": {"world_size": SP * DP, "real_ranks": [5], "profile": "dgx-h100", "device": "virtual-gpu",
                        "output": str(tmp_path / "out")}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "ds_config.json"), "--hidden", str(HIDDEN),
                           "--heads", str(HEADS), "--seq", str(SEQ), "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SP_GROUP 4" in proc.stdout
    summary = json.loads((tmp_path / "out" / "rank5.summary.json").read_text())
    assert_published_schema(summary)
    # per step 8 all-to-alls of one [1024, 1, 16, 64] bf16 shard each: the forward's q, k, v and its output, the
    # backward's output gradient and q, k, v gradients
    shard = SEQ // SP * HIDDEN * 2
    assert summary["op_counts"]["all_to_all"] == STEPS * 8
    assert summary["op_bytes"]["all_to_all"] == STEPS * 8 * shard
    kernels = {t["op"]: t for t in summary["virtual_gpu"]["kernels"]["top"] if t["class"] == "attention"}
    forward = kernels["aten._scaled_dot_product_flash_attention.default"]
    # the whole sequence of HEADS / SP heads: 4 * b * h * s^2 * d FLOPs, causal: the unmasked s(s+1)/2 of s^2
    heads, d = HEADS // SP, HIDDEN // HEADS
    assert forward["count"] == STEPS
    assert forward["flops"] == STEPS * 4 * heads * SEQ * SEQ * d * (SEQ + 1) // (2 * SEQ)
    assert kernels["aten._scaled_dot_product_flash_attention_backward.default"]["flops"] == forward["flops"] * 5 // 2
    assert summary["virtual_gpu"]["virtual_time"]["step_times_s"] == [0.0112922]  # modelled, exact
