"""``deepspeed.zero.Init`` under emulation on torch 2.13 (issue 11, item 7).

Inside its context ``zero.Init`` replaces ``torch.Tensor.__new__``; a first import of ``torch._dynamo``
there (here: a block constructor's ``torch.compiler.disable``) fails in dynamo's polyfills with
``Signature mismatch ... tensor_pynew``. The script (scripts/zero_init_train.py, ZeRO-3, model built
inside ``zero.Init(config_dict_or_path=...)``) shows:

1. plain DeepSpeed over gloo, no prism: the failure is upstream's (the control: the trigger is real);
2. the drop-in (``prism_plugin.deepspeed.init_distributed`` first): the emulation imported dynamo before
   Init was entered, and ZeRO-3 trains as rank 5 of 8 with finite losses;
3. the patched DeepSpeed, unmodified script: ``zero.Init``'s own ``init_distributed()`` reaches the
   "prism" section (PRISM_DEEPSPEED_CONFIG) in its constructor, before ``__enter__``; same result.

Each run is a fresh process: whether dynamo is already imported is process-wide state.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_ds_launch import _env, _patched_copy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "zero_init_train.py"


def _config(path: Path, *, prism: bool, output: Path) -> Path:
    doc: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**6}
    if prism:
        doc["prism"] = {"world_size": 8, "real_ranks": [5], "timing": False, "output": str(output)}
    path.write_text(json.dumps(doc))
    return path


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=240)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ZI_RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("ZI_RESULT "):])


def _assert_emulated_rank5(result: dict, output: Path) -> None:
    assert (result["rank"], result["world_size"]) == (5, 8)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in result["losses"])
    summary = json.loads((output / "rank5.summary.json").read_text())
    assert summary["world_size"] == 8 and summary["real_ranks"] == [5]
    # ZeRO-3 gathers its partitioned parameters (zero.Init partitioned them over the 8 emulated ranks)
    assert summary["op_counts"].get("all_gather_into_tensor", 0) + summary["op_counts"].get("all_gather", 0) > 0


@pytest.mark.heavy  # the upstream control (about 70 s on a 2-core host); the two prism runs below stay in CI
def test_plain_deepspeed_fails_when_dynamo_is_first_imported_inside_zero_init(tmp_path: Path) -> None:
    config = _config(tmp_path / "plain.json", prism=False, output=tmp_path / "unused")
    proc = _run(["--config", str(config), "--gloo", str(tmp_path / "store")], _env(LOCAL_RANK="0"), tmp_path)
    assert proc.returncode != 0 and "ZI_RESULT" not in proc.stdout
    assert "Signature mismatch" in proc.stderr and "tensor_pynew" in proc.stderr, proc.stderr[-3000:]


def test_dropin_imports_dynamo_before_zero_init(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = _config(tmp_path / "ds.json", prism=True, output=out)
    result = _result(_run(["--config", str(config), "--dropin"], _env(LOCAL_RANK="0"), tmp_path))
    assert result["dynamo_before_init"] is True
    _assert_emulated_rank5(result, out)


def test_patched_deepspeed_zero_init_reaches_the_section(tmp_path: Path) -> None:
    site = _patched_copy(tmp_path)
    out = tmp_path / "out"
    config = _config(tmp_path / "ds.json", prism=True, output=out)
    env = _env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), LOCAL_RANK="0", PRISM_DEEPSPEED_CONFIG=str(config))
    result = _result(_run(["--config", str(config)], env, tmp_path))
    assert result["dynamo_before_init"] is False  # the script imported nothing: zero.Init's constructor did
    _assert_emulated_rank5(result, out)
