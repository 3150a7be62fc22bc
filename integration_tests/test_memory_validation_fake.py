"""Issue 12, item 5(a): fake execution on the CPU device allocates what real execution on the CPU does, to the byte,
step by step, for the tiny recipe programs of every framework.

Each case is a recipe's own emulated run of one rank (`prism_plugin.recipes.plans.emulation_plan`: the recipe's
program under the metrics probe, through its framework's launcher, mirror data policy), run twice: as planned
(real CPU tensors) and with ``-m prism_plugin.runtime.fake_cpu`` before the probe (fake CPU tensors: no storage, no
compute; data-dependent reads answered by the value policy). The probe's tensor-storage tracker
(`prism_plugin.device.memory.StorageTracker`) measures both the same way; each step's peak and the bytes live at
its end, the run's peak and its final figure must be equal. This checks fake execution itself: the virtual GPU's
memory is the same fake execution on ``cuda`` tensors, which no real run here can check.

One difference was found and is corrected in the tracker, not here: ``F.mse_loss`` (and ``smooth_l1_loss``,
``binary_cross_entropy``) with a reduction returns, from the real kernel, a 0-dim result whose storage keeps the
unreduced loss's size (toy_train: 131,072 B for a 64 x 512 fp32 batch), where FakeTensorMode's meta makes 4 B;
``memory._FULL_STORAGE_LOSSES`` counts the fake output at the real size (the toy case fails without it, by
131,068 B in every step). And a tensor made from data (``torch.tensor``, ``as_tensor``: AdamW's step counters)
reaches the dispatcher only as ``aten.lift_fresh`` of a storage made outside it, which a real run's tracker cannot
see; under FakeTensorMode that is a new fake storage, which the tracker now leaves out too (DeepSpeed's case
differed by AdamW's 4 B step counter without it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from integration_tests.at_once import at_once
from prism_plugin.config.kinds import DataPolicy
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.plans import RunPlan, emulation_plan

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FAKE = ("-m", "prism_plugin.runtime.fake_cpu")
FAKE_DEEPSPEED = ("-m", "prism_plugin.adapters.deepspeed.fake_cpu")  # with ZeRO's overflow flags: the adapter's answers


def _fake(argv: tuple[str, ...], prefix: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` with the fake-CPU prefix before the metrics probe (the probe's tracker then sits above the fake mode)."""
    i = next(i for i in range(len(argv) - 1) if argv[i:i + 2] == ("-m", "prism_plugin.recipes.probe"))
    return (*argv[:i], *prefix, *argv[i:])


def _run(plan: RunPlan, fake: bool, prefix: tuple[str, ...] = FAKE) -> dict:
    for path, text in plan.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    plan.probe_dir.mkdir(parents=True, exist_ok=True)
    (proc_spec,) = plan.processes
    argv = _fake(proc_spec.argv, prefix) if fake else proc_spec.argv
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, **proc_spec.env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("PRISM_FAKE_CPU " in proc.stdout) == fake
    (rank,) = plan.ranks
    return json.loads((plan.probe_dir / f"rank{rank}.metrics.json").read_text())


def _compare(tmp_path: Path, name: str, steps: int, prefix: tuple[str, ...] = FAKE) -> tuple[dict, dict]:
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    recipe = dataclasses.replace(recipe, steps=dataclasses.replace(recipe.steps, total=steps, warmup=1))
    emu = dataclasses.replace(recipe.emulated[0], data_policy=DataPolicy.MIRROR)
    plans = {name: emulation_plan(recipe, emu, 0, tmp_path / name, None) for name in ("real", "fake")}
    real, fake = at_once(lambda: _run(plans["real"], fake=False),  # both at once: bytes do not depend on the load
                         lambda: _run(plans["fake"], fake=True, prefix=prefix))
    assert real["memory_source"] == fake["memory_source"] == "cpu tensor-storage tracker (prism_plugin.device.memory)"
    assert len(real["steps"]) == len(fake["steps"]) == steps
    by_step = [(s["peak_bytes"], s["live_bytes"]) for s in real["steps"]]
    assert [(s["peak_bytes"], s["live_bytes"]) for s in fake["steps"]] == by_step  # step by step, to the byte
    assert fake["peak_bytes"] == real["peak_bytes"] and fake["steps"][-1]["live_bytes"] == by_step[-1][1]  # final
    return real, fake


def test_toy_tp2_fake_cpu_allocates_what_real_cpu_does(tmp_path: Path) -> None:
    real, fake = _compare(tmp_path, "toy-tp2", 4)
    # w1, w2 (2 MiB each), their gradients and SGD's nothing; the batch, its target and the loss between steps
    assert real["peak_bytes"] == 9_568_260 and real["steps"][-1]["live_bytes"] == 8_912_900
    assert fake["first_loss"] == 1.0  # the value policy's answer: nothing is computed


@pytest.mark.heavy
def test_deepspeed_zero1_mlp_fake_cpu_allocates_what_real_cpu_does(tmp_path: Path) -> None:
    real, _ = _compare(tmp_path, "deepspeed-zero1", 3, FAKE_DEEPSPEED)
    # measured (both runs): the 4 x Linear(256, 256) MLP's fp32 parameters (1,052,672 B) and ZeRO-1's state
    assert [(s["peak_bytes"], s["live_bytes"]) for s in real["steps"]] == [
        (7_179_276, 3_182_600), (8_231_952, 3_182_604), (8_231_952, 3_182_604)]


def test_megatron_gpt_tiny_fake_cpu_allocates_what_real_cpu_does(tmp_path: Path) -> None:
    # the CPU shim's Megatron (TP2 rank 0 of 4, mirror), fake: the run flags' and DataLoader seed's reads get values
    real, _ = _compare(tmp_path, "megatron-tp2", 3)
    assert [(s["peak_bytes"], s["live_bytes"]) for s in real["steps"]] == [
        (1_084_816, 997_264), (1_475_564, 997_272), (1_475_560, 997_268)]  # measured (both runs)
