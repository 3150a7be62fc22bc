"""DeepSpeed's pipeline engine on virtual GPUs: stage 1 of a 2-stage transformer-MLP pipeline as rank 5 of 8 on a
virtual H100 (pp 2 x dp 4, ZeRO-1, bf16, 4 micro-batches of 1 x 2048 x 4096 per step).

The script (scripts/ds_pipe_virtual_gpu_train.py) is launched with plain ``python``; ``"device": "virtual-gpu"``
re-executes it with the CUDA device library. The engine's two data-dependent reads are answered by
`prism_plugin.adapters.deepspeed.pipe_values`: the parameter-count all-reduce of ``__init__`` (logging only) from
the PipelineModule's layer specs (exact: 2 stages x 2 blocks of Linear(h, 4h) + Linear(4h, h)), and stage 0's
tensor-meta message from ``"prism.pipe_activations"`` (stage 0 is virtual; the engine sizes its receive buffer
from it). Without the spec the read is refused naming the key.

Per-rank bytes (every tensor rounded to 512 B; P = this stage's parameters, dp = 4, u = one activation,
1 x 2048 x 4096 bf16 = 16 MiB), itemised from the allocator snapshot (``PRISM_MEMORY_SNAPSHOT``):
- after initialize: the bf16 flat parameters 2 P, the fp32 master partition 4 P / dp, three 0-dim engine
  tensors (``loss``, ``agg_loss``, ``dp_group_loss``);
- after each ``train_batch``: + AdamW's two moments 8 P / dp, 9 u (2 pipeline buffers each of labels, stage
  outputs, received-activation clones and their gradients, sent to stage 0; the receive buffer) and nine 0-dim
  tensors in place of the three (the 4 micro-batch MSE losses, ``total_loss``, ``agg_loss``, ``dp_group_loss``,
  ``agg_train_loss``, ZeRO's stashed grad norm).
The emulated step (virtual time: kernel model and emulated streams, the dgx-h100 profile) is modelled. The three runs
(stage 1, stage 0, stage 1 without the spec) start together (`integration_tests.at_once`: one core each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.at_once import at_once
from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_pipe_virtual_gpu_train.py"
HIDDEN, BLOCKS, SEQ, GAS, DP, STEPS = 4096, 4, 2048, 4, 4, 2


def ds_config(out: Path, pipe_activations: bool = True, rank: int = 5) -> dict:
    prism = {"world_size": 2 * DP, "real_ranks": [rank], "profile": "dgx-h100", "device": "virtual-gpu",
             "output": str(out), "timing": False}
    if pipe_activations:
        prism["pipe_activations"] = {"shape": [1, SEQ, HIDDEN], "dtype": "bfloat16"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "train_batch_size": GAS * DP,
            "bf16": {"enabled": True}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "prism": prism}


def run(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, str(SCRIPT), str(path), "--hidden", str(HIDDEN), "--blocks", str(BLOCKS),
                           "--seq", str(SEQ), "--steps", str(STEPS)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each test's run (its process and its folder), all three started together."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("stage1", "stage0", "no_spec")}
    configs = {"stage1": ds_config(folders["stage1"] / "out"), "stage0": ds_config(folders["stage0"] / "out", rank=2),
               "no_spec": ds_config(folders["no_spec"] / "out", pipe_activations=False)}
    procs = at_once(*(lambda name=name: run(folders[name], configs[name]) for name in folders))
    return {name: (proc, folders[name]) for name, proc in zip(folders, procs, strict=True)}


def test_pipeline_stage_1_as_rank_5_of_8_on_a_virtual_h100(runs: dict) -> None:
    proc, tmp_path = runs["stage1"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {" ".join(x.split()[:2]): x.split()[2] for x in proc.stdout.splitlines() if x.startswith(("MEM", "LOSS"))}
    block = 2 * (HIDDEN * 4 * HIDDEN) + 4 * HIDDEN + HIDDEN  # Linear(h, 4h) + Linear(4h, h)
    p = BLOCKS // 2 * block  # 268,476,416 parameters on this stage
    u = round_size(2 * SEQ * HIDDEN)
    after_init = round_size(2 * p) + round_size(4 * p // DP) + 3 * round_size(4)
    assert int(lines["MEM init"]) == after_init == 805_430_784
    workspaces = 2 * 32 * 2**20  # torch's cuBLAS workspaces: forward and autograd threads, held from the first GEMM
    after_step = after_init - 3 * 512 + 2 * round_size(4 * p // DP) + 9 * u + 9 * round_size(4) + workspaces
    for step in range(STEPS):
        assert lines[f"LOSS {step}"] == "1.0"  # the value policy's finite loss
        assert int(lines[f"MEM step{step}"]) == after_step == 1_560_490_496

    summary = json.loads((tmp_path / "out" / "rank5.summary.json").read_text())
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    vgpu = summary["virtual_gpu"]
    assert vgpu["gpu"] == "NVIDIA H100 80GB HBM3" and vgpu["devices"][0]["fits"]
    # p2p with virtual stage 0: 4 activations in and 4 gradients out per step, 16 MiB each; in: also stage 0's
    # tensor meta (int32[1024 / 4]) and the engine's fp32 loss handshake at start-up
    assert summary["op_counts"]["send"] == STEPS * GAS and summary["op_counts"]["recv"] == STEPS * GAS + 2
    assert summary["op_bytes"]["send"] == STEPS * GAS * 2 * SEQ * HIDDEN == 134_217_728
    assert summary["op_bytes"]["recv"] == STEPS * GAS * 2 * SEQ * HIDDEN + 1024 + 4
    # the emulated step (modelled), every step after the first
    assert vgpu["virtual_time"]["clock"] == "emulated"
    assert vgpu["virtual_time"]["step_times_s"] == [0.036235592] * (STEPS - 1)
    reads = {(s["site"].rsplit("/", 1)[-1], s["value"]): s["count"] for s in vgpu["values"]["by_site"]}
    total = BLOCKS * block
    assert reads[("engine.py:154 (__init__)",
                  f"{total}, {total} (pipeline parameter counts from the layer specs: exact)")] == 2
    meta = f"stage 0's tensor meta = prism.pipe_activations ([0, 5, 3, 1, {SEQ}, {HIDDEN}])"
    assert sum(n for (site, value), n in reads.items() if value == meta) == 6  # type, dtype, ndims, 3 dims


def test_pipeline_stage_0_as_rank_2_of_8_on_a_virtual_h100(runs: dict) -> None:
    """The first stage (rank 2: stage 0, data-parallel rank 2) sends its activations to virtual stage 1 and receives
    the gradients into the buffer it sizes from its own outputs: no tensor-meta read. After each step: the model
    states as on stage 1, 3 u (2 pipeline buffers of loaded inputs, the gradient receive buffer) and five 0-dim
    tensors (``loss``, ``agg_loss``, the two of the loss broadcast from the last stage, ZeRO's grad norm)."""
    proc, tmp_path = runs["stage0"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {" ".join(x.split()[:2]): x.split()[2] for x in proc.stdout.splitlines() if x.startswith(("MEM", "LOSS"))}
    p = BLOCKS // 2 * (2 * (HIDDEN * 4 * HIDDEN) + 4 * HIDDEN + HIDDEN)
    u = round_size(2 * SEQ * HIDDEN)
    after_init = round_size(2 * p) + round_size(4 * p // DP) + 3 * round_size(4)
    assert int(lines["MEM init"]) == after_init
    workspaces = 2 * 32 * 2**20  # torch's cuBLAS workspaces: forward and autograd threads, held from the first GEMM
    after_step = after_init - 3 * 512 + 2 * round_size(4 * p // DP) + 3 * u + 5 * round_size(4) + workspaces
    for step in range(STEPS):
        assert int(lines[f"MEM step{step}"]) == after_step == 1_459_825_152
    summary = json.loads((tmp_path / "out" / "rank2.summary.json").read_text())
    assert summary["op_counts"]["send"] == STEPS * GAS + 2 and summary["op_counts"]["recv"] == STEPS * GAS
    assert summary["op_bytes"]["send"] == STEPS * GAS * 2 * SEQ * HIDDEN + 1024 + 4  # + its tensor meta, handshake
    assert summary["op_bytes"]["recv"] == STEPS * GAS * 2 * SEQ * HIDDEN
    assert summary["virtual_gpu"]["virtual_time"]["step_times_s"] == [0.034195335] * (STEPS - 1)


def test_pipeline_stage_without_pipe_activations_is_refused_naming_the_key(runs: dict) -> None:
    proc, _ = runs["no_spec"]
    assert proc.returncode != 0
    assert "stage 0's tensor-meta message" in proc.stderr and '"pipe_activations"' in proc.stderr
