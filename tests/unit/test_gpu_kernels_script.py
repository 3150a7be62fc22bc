"""benchmarks/gpu_kernels.py, the GPU kernel sweep whose output the Hopper profiles' GEMM figures are fitted on:
the GEMM each pass of a linear runs, and a smoke run on this CPU writing the document `validation.kernels` reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_kernels  # noqa: E402


def test_each_pass_of_a_linear_is_the_gemm_a_training_step_runs() -> None:
    shapes = {(where, p): (m, n, k) for where, p, m, n, k in gpu_kernels.gemm_shapes(smoke=False)}
    # Llama 3 8B fc1 at TP1, 8192 tokens: W [2 x 14336, 4096]; forward X W^T, input gradient dY W, weight
    # gradient dY^T X (k = the tokens)
    fc1 = "llama3-8b tp1 t8192 fc1"
    assert shapes[(f"{fc1} fwd", "fwd")] == (8192, 28672, 4096)
    assert shapes[(f"{fc1} dgrad", "dgrad")] == (8192, 4096, 28672)
    assert shapes[(f"{fc1} wgrad", "wgrad")] == (28672, 4096, 8192)
    # GPT-3 175B at TP8: 96 heads of 128 with as many key-value heads: qkv n = 3 x 12288 / 8
    assert shapes[("gpt3-175b tp8 t2048 qkv fwd", "fwd")] == (2048, 4608, 12288)
    # a shape two linears share is measured once, under the first
    assert len(shapes) == len({(m, n, k, p) for (_, p), (m, n, k) in shapes.items()}) >= 150


def test_a_smoke_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--out", str(out), "--smoke",
                    "--only", "gemm,memory,sustained", "--sustain-s", "0.05"], check=True, timeout=120,
                   capture_output=True)
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and set(doc["section_s"]) == {"gemm", "memory", "sustained"}
    assert [(r["pass"], r["m"], r["n"], r["k"]) for r in doc["gemm"]] == [
        ("fwd", 64, 48, 32), ("dgrad", 64, 32, 48), ("wgrad", 48, 32, 64)]
    assert all(r["us"] > 0 for r in doc["gemm"])
    ops = {r["op"]: r for r in doc["memory"]}
    assert ops["add"]["bytes"] == 3 * 64 * 48 * 4 and ops["fused_adam"]["bytes"] == 28 * 4096
    assert doc["sustained"] and all(r["tflops"] >= 0 for r in doc["sustained"])


@pytest.mark.parametrize("section", ["gemm", "fp8"])
def test_the_committed_sweep_holds_every_shape_the_script_measures(section: str) -> None:
    measured = json.loads((ROOT / "validation" / "kernels" / "h200_sweep.json").read_text())["measured"]
    got = {(r["where"], r["pass"], r["m"], r["n"], r["k"]) for r in measured[section] if "error" not in r}
    assert got == set(gpu_kernels.gemm_shapes(smoke=False))
