"""`prism recipe run virtual-gpu-llama-1b` end to end: a Llama-3.2-1B-class job as rank 5 of 8192 on a virtual H100.

The recipe is emulation only (``real: none``): its run is ``prism run --device virtual-gpu`` of
``prism_plugin/programs/llama_ddp.py``, and the report's memory table (rich, result.json, summary.md) must show
the modelled figures the recipe states. The persistent state after each step is derived here from the
architecture; the peak (activations, AdamW's foreach temporaries) is pinned as measured in the recipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

HIDDEN, LAYERS, HEADS, KV, FFN, VOCAB = 2048, 16, 32, 8, 8192, 128256
KV_DIM = HIDDEN // HEADS * KV  # 512


def _parameter_shapes() -> list[int]:
    """numel of every parameter of llama_ddp.Llama at the recipe's sizes."""
    layer = [HIDDEN, HIDDEN * HIDDEN, HIDDEN * KV_DIM, HIDDEN * KV_DIM, HIDDEN * HIDDEN, HIDDEN,
             HIDDEN * FFN, HIDDEN * FFN, FFN * HIDDEN]  # norms, wq, wk, wv, wo, SwiGLU w1, w3, w2
    return [VOCAB * HIDDEN, *layer * LAYERS, HIDDEN, HIDDEN * VOCAB]


def test_the_fitting_virtual_gpu_recipe_runs_and_reports_its_memory_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "recipe", "run", "virtual-gpu-llama-1b",
                           "--output", str(out), "--json", str(tmp_path / "result.json")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    shapes = _parameter_shapes()
    assert sum(shapes) == 1_498_482_688
    # after each step: bf16 parameters (2 B) + fp32 main parameters and AdamW's two fp32 moments (3 x 4 B), each
    # tensor rounded by the caching allocator (gradients are freed), the step's int64 tokens (1 x 4097), the
    # fp32 loss and torch's two cuBLAS workspaces (forward and autograd threads, 32 MiB each on sm90); AdamW's step
    # counters live on the host
    derived = (sum(round_size(2 * n) + 3 * round_size(4 * n) for n in shapes) + round_size(8 * 4097) + round_size(4)
               + 2 * 32 * 2**20)
    persistent = derived + 2 * 2**20  # measured: 2 MiB more are live after each step that this test does not derive
    log = (out / "virtual-gpu-llama-1b" / "n8192" / "run0" / "launcher.log").read_text()
    steps = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith("LLAMA_STEP ")]
    assert [s["step"] for s in steps] == [0, 1, 2] and {s["params"] for s in steps} == {sum(shapes)}
    assert {s["allocated_bytes"] for s in steps} == {persistent}
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["passed"] and result["comparisons"] == [] and result["runs"]["real"] == []
    (row,) = result["virtual_gpu_memory"]
    assert (row["emulation"], row["rank"], row["device"], row["own_device"]) == ("n8192", 5, 0, True)
    assert row["peak_allocated_bytes"] == 34_542_679_552 == steps[-1]["max_allocated_bytes"]  # measured, pinned
    assert row["peak_allocated_bytes"] > persistent + sum(round_size(2 * n) for n in shapes)  # + bf16 grads at least
    assert row["peak_reserved_bytes"] == 36_507_222_016 and row["ooms"] == 0 and row["fits"]
    # + the world group's NCCL buffers (1,024 nodes: ring + tree, 16 channels x 4 connections x 9,633,792 B) + the
    # 512 MiB context
    assert row["device_total_bytes"] == row["peak_reserved_bytes"] + 616_562_688 + 512 * 2**20
    assert row["device_total_bytes"] == 37_660_655_616 <= row["gpu_memory_bytes"]
    assert row["gpu_memory_bytes"] == 81559 * 2**20 and row["gpu"] == "NVIDIA H100 80GB HBM3"
    checks = {(e["check"], e["passed"]) for e in result["expectations"]}
    assert checks == {("peak_allocated_bytes", True), ("peak_reserved_bytes", True), ("fits", True), ("ooms", True),
                      ("emulated_step_s", True)}  # virtual time: deterministic to the ns
    shown = proc.stdout + proc.stderr  # the rich tables (prism recipe run prints them on stderr)
    assert "virtual-GPU memory" in shown and "34,542,679,552 B" in shown and "32.17 GiB" in shown
    md = (out / "virtual-gpu-llama-1b" / "summary.md").read_text()
    assert "## Virtual-GPU memory" in md and "| n8192 | 5 | cuda:0 | 32.17 GiB (34,542,679,552 B) |" in md
