"""Megatron's GPU-only fusions on a CPU host (issue 11, item 6b): which are switched off, which refused.

Pure: the decisions are functions of Megatron's parsed arguments (dest -> value), checked here without
Megatron. The end-to-end runs are in integration_tests/megatron/test_upstream_script.py.
"""

from __future__ import annotations

import argparse

import pytest

from prism_plugin.adapters.megatron.refusals import Refusal, check_args, refusals_for, switch_offs

# Megatron 0.19's defaults for the fusion dests (megatron.training.arguments)
DEFAULTS = {"transformer_impl": "local", "gradient_accumulation_fusion": True, "masked_softmax_fusion": True,
            "apply_rope_fusion": True, "bias_gelu_fusion": True, "bias_swiglu_fusion": True,
            "bias_dropout_fusion": True, "position_embedding_type": "learned_absolute", "bf16": False, "fp16": False,
            "moe_permute_fusion": False, "moe_router_fusion": False, "moe_grouped_gemm": False}


def _flags(options: dict) -> list[str]:
    return [off.flag for off in switch_offs({**DEFAULTS, **options})]


def test_fp32_job_switches_off_gradient_accumulation_fusion_only() -> None:
    assert _flags({}) == ["--no-gradient-accumulation-fusion"]


@pytest.mark.parametrize("options,expected", [
    ({"bf16": True}, ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]),
    ({"fp16": True}, ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]),
    ({"position_embedding_type": "rope"}, ["--no-gradient-accumulation-fusion", "--no-rope-fusion"]),
    ({"bf16": True, "position_embedding_type": "rope"},
     ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"]),
    ({"gradient_accumulation_fusion": False, "bf16": True, "masked_softmax_fusion": False}, []),
])
def test_cuda_kernel_defaults_are_switched_off(options: dict, expected: list[str]) -> None:
    assert _flags(options) == expected


def test_switch_off_line_names_the_flag_and_the_memory_caveat() -> None:
    (off,) = switch_offs(argparse.Namespace(**DEFAULTS))
    assert off.dest == "gradient_accumulation_fusion"
    line = off.line()
    assert "\n" not in line and "fused_weight_gradient_mlp_cuda" in line and "--no-gradient-accumulation-fusion" in line
    assert "memory figures" in line


def test_gpu_only_fusions_asked_for_are_refused_together_in_cpu_mode_only() -> None:
    job = {**DEFAULTS, "moe_permute_fusion": True, "moe_router_fusion": True, "moe_grouped_gemm": True}
    assert refusals_for(job, cpu_mode=False) == []
    with pytest.raises(Refusal) as info:
        check_args(job, cpu_mode=True)
    text = str(info.value)
    for flag in ("--moe-permute-fusion", "--moe-router-fusion", "--moe-grouped-gemm"):
        assert f"drop {flag} for CPU mode" in text
    assert text.count("\n  - ") == 3


def test_defaults_that_run_on_cpu_are_neither_refused_nor_switched() -> None:
    assert refusals_for(DEFAULTS, cpu_mode=True) == []
    flags = _flags({"bias_gelu_fusion": True, "bias_swiglu_fusion": True, "bias_dropout_fusion": True})
    assert flags == ["--no-gradient-accumulation-fusion"]


def test_virtual_gpus_keep_the_fusions_whose_kernels_they_fake() -> None:
    # gradient-accumulation fusion, masked softmax and the persistent layer norm stay on (apex's extensions are fake
    # kernels there: adapters/megatron/fused_kernels.py); RoPE fusion with the local spec is still switched off
    job = {**DEFAULTS, "bf16": True, "position_embedding_type": "rope", "persist_layer_norm": True}
    assert [off.flag for off in switch_offs(job, virtual_gpu=True)] == ["--no-rope-fusion"]
    assert [off.flag for off in switch_offs({**DEFAULTS, "bf16": True}, virtual_gpu=True)] == []


def test_virtual_gpus_switch_off_the_data_loader_workers_with_their_own_line() -> None:
    (off,) = switch_offs({**DEFAULTS, "num_workers": 6}, virtual_gpu=True)
    assert (off.dest, off.flag, off.value) == ("num_workers", "--num-workers 0", 0)
    assert off.line("virtual GPU").startswith("prism: virtual GPU: --num-workers 6 -> 0: the batches load in the main")
    assert "unfused" not in off.line("virtual GPU")  # not a fused kernel's line
    assert switch_offs({**DEFAULTS, "num_workers": 0}, virtual_gpu=True) == []
    assert "--num-workers 0" not in _flags({"num_workers": 6})  # CPU mode: the workers load real batches
