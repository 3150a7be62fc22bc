"""DeepSpeed on virtual GPUs: a plain ZeRO-2 script, ``"device": "virtual-gpu"``, as rank 5 of 1024 on a virtual H100.

The script (scripts/ds_virtual_gpu_train.py) is launched with plain ``python``; its ``init_distributed`` re-executes
the process once through ``python -m prism_plugin.deepspeed`` with the CUDA device library loaded before torch
(`prism_plugin.adapters.deepspeed.virtual_gpu`). DeepSpeed then selects its CUDA accelerator and runs its CUDA
code paths on fake tensors: a ~1.07 B-parameter MLP in bf16 (8 blocks of Linear(4096, 16384), Linear(16384, 4096))
uses no host memory.

Per-rank bytes after ``deepspeed.initialize`` (ZeRO 1/2, bf16, dp = 1024; every tensor rounded to 512 B by the
caching allocator): the bf16 parameters flattened into one buffer padded to ``2 * dp`` elements (held whole), and
this rank's fp32 master partition of ``flat / dp`` elements. After the steps, AdamW's two fp32 moments of the
partition are added (torch.optim.AdamW: ``"torch_adam": true``; FusedAdam is a CUDA extension and refused); its
step counters are host tensors (real, not on the device).

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (no offload) gives ``2 P + 18 P / dp``: 2 P for the bf16
parameters (ours: 2 * flat, the padding to 2 * dp elements), and 18 P / dp = 2 (bf16 gradient partition) + 4 (fp32
gradient) + 4 (fp32 master) + 8 (moments) per partition element. Ours holds between steps the parameters, master and
moments, and none of the estimate's gradients (ZeRO-2 frees them after each step). Between steps the device also
holds the script's batch ``x`` (1 x 1024 x 4096 bf16, 8 MiB), its fp32 loss (0-dim: 512 B) and ZeRO's stashed
global gradient norm (0-dim fp32: 512 B), so the figure after each step is exact too.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema
from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_virtual_gpu_train.py"
HIDDEN, LAYERS, DP = 4096, 8, 1024
SEQ = 1024


def ds_config(stage: int, out: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": DP,
            "bf16": {"enabled": True}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "prism": {"world_size": DP, "real_ranks": [5], "profile": "dgx-h100", "device": "virtual-gpu",
                      "output": str(out), "timing": False}}


def run(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, str(SCRIPT), str(path), "--hidden", str(HIDDEN), "--layers", str(LAYERS),
                           "--steps", "2", "--seq", str(SEQ)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)


def test_zero2_billion_parameter_mlp_as_rank_5_of_1024_on_a_virtual_h100(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    proc = run(tmp_path, ds_config(2, tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in proc.stdout.splitlines()
             if line.startswith(("MEM ", "LOSS ", "ACCELERATOR "))}
    assert lines["ACCELERATOR cuda"] == ["CUDA_Accelerator", "8"]  # DeepSpeed's CUDA code paths
    numels = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("NUMELS "))[7:])
    p = sum(numels)
    assert p == LAYERS * (2 * HIDDEN * 4 * HIDDEN + 5 * HIDDEN)  # 1,073,774,592 parameters
    align = 2 * DP
    flat = math.ceil(p / align) * align
    part = flat // DP
    after_init = round_size(2 * flat) + round_size(4 * part)
    assert int(lines["MEM init"][0]) == after_init
    model_states = after_init + 2 * round_size(4 * part)  # + AdamW's two moments
    for step in (0, 1):
        assert lines[f"LOSS {step}"] == ["1.0"]  # the value policy's finite loss
        held = int(lines[f"MEM step{step}"][0])
        # + the step's input, the loss, its norm, and torch's two cuBLAS workspaces (forward and autograd threads)
        assert held == model_states + round_size(2 * SEQ * HIDDEN) + round_size(4) + round_size(4) + 2 * 32 * 2**20
    _, estimate = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=8, num_nodes=DP // 8, cpu_offload=False)
    assert estimate == 2 * p + int(18 * p / DP)
    # the estimate less its 6 bytes/element of gradient partitions (freed between steps here) is the model states
    # up to our padding to 2 * dp elements and the allocator's 512 B rounding of the three tensors
    assert estimate - 6 * p // DP <= model_states <= estimate - 6 * p // DP + 2 * (flat - p) + 12 * DP + 3 * 512

    summary = json.loads((tmp_path / "out" / "rank5.summary.json").read_text())
    assert_published_schema(summary)  # DeepSpeed's: the policy defaults at the top, the virtual GPU's
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    vgpu = summary["virtual_gpu"]
    assert vgpu["gpu"] == "NVIDIA H100 80GB HBM3"
    device = vgpu["devices"][0]
    assert device["peak_allocated_bytes"] >= model_states and device["fits"]
    # ZeRO-2's overflow flag and invalid-norm check, answered "none" (the adapter's stated answers), the loss reads
    reads = {(s["site"].rsplit("/", 1)[-1], s["value"]) for s in vgpu["values"]["by_site"]}
    assert ("stage_1_and_2.py:3248 (has_overflow)", "0 (ZeRO overflow / invalid-norm flag)") in reads
    assert ("utils.py:233 (is_invalid_grad_norm)", "0 (ZeRO overflow / invalid-norm flag)") in reads
    assert summary["op_counts"]["all_gather"] >= 2 and summary["op_counts"]["all_reduce"] >= 2


def test_fused_adam_is_refused_before_the_reexec(tmp_path: Path) -> None:
    config = ds_config(2, tmp_path / "out")
    config["optimizer"]["params"].pop("torch_adam")
    proc = run(tmp_path, config)
    assert proc.returncode != 0
    assert '"torch_adam": true' in proc.stderr and "FusedAdam" in proc.stderr


@pytest.mark.heavy  # a 1B-parameter ZeRO-3 model built under zero.Init (about 2 min on a 2-core host); ZeRO-3's
# memory on a virtual GPU stays in CI in test_memory_validation_deepspeed's exact model-state test
def test_zero3_with_zero_init_as_rank_5_of_1024_on_a_virtual_h100(tmp_path: Path) -> None:
    """ZeRO-3, the model built under ``deepspeed.zero.Init``: every parameter partitioned into ceil(numel / dp)
    elements, S in all. After initialize the device holds at least the bf16 parameter partitions (2 S bytes),
    the fp32 master partitions (4 S), the bf16 gradient partitions (2 S), the reduce bucket (``reduce_bucket_size``
    bf16 elements) and the 1-byte overflow flag. OPEN: the measured figure exceeds that by 663,296 B (not yet
    itemised), so the upper bound here is 1 MiB above the lower one; the exact closed form is left to do."""
    config = ds_config(3, tmp_path / "out")
    bucket = 50_000_000
    config["zero_optimization"]["reduce_bucket_size"] = bucket
    proc = run(tmp_path, config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in proc.stdout.splitlines()
             if line.startswith(("MEM ", "LOSS ", "ACCELERATOR "))}
    assert lines["ACCELERATOR cuda"] == ["CUDA_Accelerator", "8"]
    numels = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("NUMELS "))[7:])
    assert sum(numels) == LAYERS * (2 * HIDDEN * 4 * HIDDEN + 5 * HIDDEN)  # ds_numel: the full sizes
    s = sum(math.ceil(n / DP) for n in numels)
    lower = round_size(2 * s) + round_size(4 * s) + round_size(2 * s) + round_size(2 * bucket) + round_size(1)
    assert lower <= int(lines["MEM init"][0]) <= lower + 2**20
    assert lines["LOSS 0"] == lines["LOSS 1"] == ["1.0"]
    summary = json.loads((tmp_path / "out" / "rank5.summary.json").read_text())
    assert_published_schema(summary)  # DeepSpeed's: the policy defaults at the top, the virtual GPU's
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    reads = {s["value"] for s in summary["virtual_gpu"]["values"]["by_site"]}
    assert "rank 0's list = this rank's (mirror)" in reads  # ZeRO-3's order checks with a virtual rank 0
