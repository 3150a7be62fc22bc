"""An upstream-style launch script through both drop-in forms (issue 11, item 6).

scripts/upstream_style_gpt.py is laid out like Megatron-LM's ``pretrain_gpt.py``: ``get_batch_on_this_tp_rank``
bound at module level of ``__main__`` (before Megatron parses its arguments, where the native patch
activates the emulation), ``pretrain(...)`` from megatron.training, and upstream's fatal NaN/Inf check of
the local loss. The job is TP2 PP2 as ranks 0 and 8191 of 8192; rank 8191 is TP rank 1 of the last stage and
its TP rank 0 (8190) is virtual, so every batch it trains on is the adapter's valid-batch fill.

1. the native patch (``patches/megatron-core-0.19.2`` on a copy of megatron/training, plain torchrun) and
   the wrapper (``-m prism_plugin.megatron``) train 3 iterations with the same finite losses; rank 8191's
   summary counts one filled batch per iteration (before the fix the native form's fill never reached
   ``__main__``'s binding: ``lm loss: INF`` at iteration 1);
2. Megatron's GPU-only fusion defaults on this CPU host (the job passes ``--bf16`` and RoPE and leaves
   gradient-accumulation fusion on): each is switched off with one printed line and listed in the summary,
   in both forms;
3. GPU-only fusions the job asks for are refused in one message naming every flag, before any process group.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_megatron_dropin import ROOT, TORCHRUN, _env, _run

from integration_tests.at_once import at_once

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "upstream_style_gpt.py"
JOB = ["--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2",
       "--global-batch-size", "4096",  # micro 2 * DP 2048 (8192 / (TP2 * PP2)) = one micro-batch per step
       "--train-iters", "3", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "128", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
       "--bf16", "--position-embedding-type", "rope"]
PRISM = ["--prism-world-size", "8192", "--prism-real-ranks", "0,8191"]
SWITCHED_OFF = ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"]


@pytest.fixture(scope="module")
def patched_training(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the installed megatron/training with the native patch applied (no fuzz, no offset)."""
    import megatron.core

    site = Path(megatron.core.__file__).resolve().parents[2]
    copy = tmp_path_factory.mktemp("patched")
    shutil.copytree(site / "megatron" / "training", copy / "megatron" / "training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in sorted((ROOT / "patches" / "megatron-core-0.19.2").glob("*.patch")):
        applied = subprocess.run(["patch", "-p1", "-i", str(patch)], cwd=copy, capture_output=True, text=True)
        assert applied.returncode == 0 and "fuzz" not in applied.stdout and "offset" not in applied.stdout, \
            applied.stdout + applied.stderr
    return copy


def _native_env(copy: Path) -> dict[str, str]:
    return _env(PYTHONPATH=os.pathsep.join([str(copy), str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _losses(text: str) -> list[str]:
    return re.findall(r"iteration +\d+/ +3 \|.*?\| lm loss: ([^ |]+)", text)


def _check_run(proc: subprocess.CompletedProcess[str], out: Path) -> list[str]:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _losses(text)
    assert len(losses) == 3 and all(math.isfinite(float(x)) for x in losses), losses
    for flag in SWITCHED_OFF:  # one line each (printed by the first real process only)
        assert text.count(f"switched off (as {flag})") == 1, text[-3000:]
    for rank, filled in ((0, 0), (8191, 3)):  # rank 0 is TP rank 0: it reads its own data
        summary = json.loads((out / f"rank{rank}.summary.json").read_text())
        assert summary["world_size"] == 8192 and summary["iterations_marked"] == 3
        assert summary["megatron"]["tp_batches_filled"] == filled
        assert summary["megatron"]["switched_off"] == SWITCHED_OFF
    return losses


def test_upstream_style_script_native_and_wrapper(tmp_path: Path, patched_training: Path) -> None:
    arguments = (patched_training / "megatron" / "training" / "arguments.py").read_text()
    assert "--prism-graph" in arguments and "later version" not in arguments and "hybrid" in arguments

    native_out, wrapper_out = tmp_path / "native", tmp_path / "wrapper"
    native = _run([*TORCHRUN, "--nproc-per-node", "2", str(SCRIPT), *JOB, *PRISM, "--prism-output", str(native_out)],
                  _native_env(patched_training))
    wrapper = _run([*TORCHRUN, "--nproc-per-node", "2", "-m", "prism_plugin.megatron", str(SCRIPT), *JOB, *PRISM,
                    "--prism-output", str(wrapper_out)], _env())
    assert _check_run(native, native_out) == _check_run(wrapper, wrapper_out)


def test_gpu_only_fusions_asked_for_are_refused_in_one_message(patched_training: Path) -> None:
    job = [*JOB, "--moe-permute-fusion", "--moe-grouped-gemm"]
    wrapper, native = at_once(  # one process each: both at once
        lambda: _run([*TORCHRUN, "--nproc-per-node", "1", "-m", "prism_plugin.megatron", str(SCRIPT), *job,
                      "--prism-world-size", "8", "--prism-real-ranks", "7"], _env(), timeout_s=120),
        lambda: _run([*TORCHRUN, "--nproc-per-node", "1", str(SCRIPT), *job, "--prism-world-size", "8",
                      "--prism-real-ranks", "7"], _native_env(patched_training), timeout_s=120))
    # the wrapper's usage-error exit (2), which torchrun's agent reports for the rank and turns into its own 1;
    # natively the refusal is raised in parse_args
    assert wrapper.returncode != 0 and "exitcode  : 2" in wrapper.stderr, wrapper.stderr[-3000:]
    for proc in (wrapper, native):
        assert proc.returncode != 0 and "prism cannot emulate this Megatron job" in proc.stderr, proc.stderr[-3000:]
        for flag in ("--moe-permute-fusion", "--moe-grouped-gemm"):
            assert f"drop {flag} for CPU mode" in proc.stderr, proc.stderr[-3000:]
        assert "initialized tensor model parallel" not in proc.stdout
