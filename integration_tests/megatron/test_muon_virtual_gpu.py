"""Megatron's Muon (``--optimizer muon``, NVIDIA's emerging-optimizers package) on a virtual H100 (issue 20, item 5).

emerging-optimizers declares Python >= 3.12; on this 3.11 host it lives in the virtual GPUs' private package folder
(`prism_plugin.device.gpu_packages`). A 2-layer TE GPT trains 2 iterations as rank 1 of 2 through the drop-in,
once with Adam and once with Muon, started together (`integration_tests.at_once`); every figure checked is modelled
(the allocator model, virtual time, kernel counts), so exact.

What Muon changes, derived from Megatron's and emerging-optimizers' code:
- it orthogonalizes each 2-D weight that is not an embedding or output layer (Megatron's
  ``_is_nonlinear_or_embedding``): per layer q, k and v (``linear_qkv`` split by ``--muon-split-qkv``, the
  default), ``linear_proj``, ``linear_fc1`` and ``linear_fc2``, and the learned position embeddings: 13 per
  iteration, each by 5 Newton-Schulz steps (``--muon-num-ns-steps``) of one ``mm`` and two ``addmm``;
- it keeps one fp32 momentum buffer per such weight where Adam keeps two moments; the other parameters stay on
  Adam, in a second optimizer of Megatron's chain, which holds its own 4-byte unity scale (``_scale_one``, one
  512-byte block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once
from integration_tests.megatron.drop_in import train
from prism_plugin.device import gpu_packages

pytestmark = pytest.mark.slow

H, LAYERS, SEQ, ITERATIONS, NS_STEPS = 256, 2, 256, 2, 5
ARGS = ["--transformer-impl", "transformer_engine", "--num-layers", str(LAYERS), "--hidden-size", str(H),
        "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "1024", "--bf16", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "1000", "--train-iters", str(ITERATIONS), "--disable-bias-linear"]
LAYER_WEIGHTS = (3 * H * H) + (H * H) + (4 * H * H) + (4 * H * H)  # linear_qkv, linear_proj, linear_fc1, fc2
MUON_ELEMENTS = LAYERS * LAYER_WEIGHTS + SEQ * H  # and the learned position embeddings
ORTHOGONALIZED = LAYERS * 6 + 1  # q, k, v, proj, fc1, fc2 per layer; position embeddings


def _train(tmp: Path, optimizer: str) -> dict[str, Any]:
    return train(tmp / optimizer, [*ARGS, "--optimizer", optimizer], iterations=ITERATIONS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    if not any(gpu_packages.packages_path().glob("emerging_optimizers-*.dist-info")):
        pytest.fail(f"emerging-optimizers is not in {gpu_packages.packages_path()}: run bash scripts/setup_env.sh")
    tmp = tmp_path_factory.mktemp("muon")
    adam, muon = at_once(lambda: _train(tmp, "adam"), lambda: _train(tmp, "muon"))
    return {"adam": adam, "muon": muon}


def test_muon_orthogonalizes_each_weight_matrix_by_newton_schulz(runs: dict[str, dict[str, Any]]) -> None:
    top = {t["op"]: t["count"] for t in runs["muon"]["virtual_gpu"]["kernels"]["top"]}
    assert top["aten.addmm.default"] == 2 * NS_STEPS * ORTHOGONALIZED * ITERATIONS
    assert top["aten.mm.default"] >= NS_STEPS * ORTHOGONALIZED * ITERATIONS
    adam_top = {t["op"]: t["count"] for t in runs["adam"]["virtual_gpu"]["kernels"]["top"]}
    assert "prism_te.multi_tensor_adam.default" in adam_top and "aten.addmm.default" not in adam_top


def test_muon_holds_one_moment_per_weight_matrix_where_adam_holds_two(runs: dict[str, dict[str, Any]]) -> None:
    adam, muon = (runs[o]["virtual_gpu"]["devices"][0] for o in ("adam", "muon"))
    saved = 4 * MUON_ELEMENTS - 512  # Adam's second fp32 moment, less the second optimizer's unity scale block
    assert adam["allocated_bytes"] - muon["allocated_bytes"] == saved == 6_553_088
    assert adam["peak_allocated_bytes"] - muon["peak_allocated_bytes"] == saved
    assert (adam["peak_allocated_bytes"], muon["peak_allocated_bytes"]) == (149_412_864, 142_859_776)


def test_the_newton_schulz_gemms_lengthen_the_step(runs: dict[str, dict[str, Any]]) -> None:
    steps = {o: runs[o]["virtual_gpu"]["virtual_time"]["step_times_s"] for o in ("adam", "muon")}
    # virtual time: modelled, exact; host-bound at 85 us a launch (228 and 547 launches: Newton-Schulz's GEMMs and
    # their elementwise steps are launches too)
    assert steps == {"adam": [0.0196536], "muon": [0.0471514]}
