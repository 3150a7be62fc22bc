"""GPU models and their profiles (prism_plugin.cost.gpu, profiles dgx-h200 / dgx-b200): per-dtype peaks, the
roofline durations of a bf16 and an fp8 GEMM, the B200's datasheet figures, the GPU and profile aliases, and
``prism profiles dgx-b200``.

The fp8 GEMM is costed as the virtual GPU costs it: ``aten._scaled_mm`` on CPU fake tensors through
`prism_plugin.device.kernels.kernel_cost`, whose dtype (torch's ``float8_e4m3fn``) the roofline maps
to the float8 peak."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from prism_plugin.cli.main import main
from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import GPU_ALIASES, GPUS, MiB, gpu_name, gpu_spec
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel, peak_dtype
from prism_plugin.cost.profiles import ProfileError, load_profile, profile_from_yaml, profile_to_yaml
from prism_plugin.device.kernels import kernel_cost

aten = torch.ops.aten
M = N = K = 4096
GEMM_FLOPS = 2 * M * N * K  # 137,438,953,472
H100_ROOF = RooflineModel(gpu_spec("h100-sxm"), load_profile("dgx-h100").kernels)
B200_ROOF = RooflineModel(gpu_spec("b200-sxm"), load_profile("dgx-b200").kernels)


def _gemm(dtype: str, operand_bytes: int, op: str = "aten.mm.default") -> KernelCost:
    return KernelCost(op=op, kernel_class=KernelClass.GEMM, flops=GEMM_FLOPS,
                      bytes=(M * K + K * N) * operand_bytes + M * N * 2, dtype=dtype, shape=(M, N, K))


def _scaled_mm_cost(a_dtype: torch.dtype, b_dtype: torch.dtype) -> KernelCost:
    """The virtual GPU's cost of an fp8 ``_scaled_mm`` (M, K) x (K, N) -> bf16 with per-tensor scales."""
    with FakeTensorMode():
        a, b = torch.empty(M, K, dtype=a_dtype), torch.empty(N, K, dtype=b_dtype).t()
        scale_a, scale_b = torch.ones((), dtype=torch.float32), torch.ones((), dtype=torch.float32)
        out = aten._scaled_mm.default(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
        cost = kernel_cost(aten._scaled_mm.default, (a, b, scale_a, scale_b), {"out_dtype": torch.bfloat16}, out,
                           device_types=("cpu",))
    assert cost is not None
    return cost


# -- H100: a bf16 and an fp8 GEMM of one shape --------------------------------------------------------------


def test_h100_bf16_and_fp8_gemm_roofline() -> None:
    # 4096^3 on 132 SMs in 128x128 tiles: 1024 tiles, 8 waves, utilization 1024 / 1056; dgx-h100 GEMM
    # compute_efficiency 0.7291 and k factor 4096 / (4096 + 272); FP8 at float8_factor 0.8674 of that; both
    # compute-bound (bytes / (3.35e12 * 0.8) is 37.6 us at most)
    bf16 = H100_ROOF.duration_s(_gemm("bfloat16", 2))
    assert bf16 == GEMM_FLOPS / (989.4e12 * 0.7291 * ((1024 / 1056) * (4096 / 4368)))
    assert bf16 == pytest.approx(209.526e-6, rel=1e-5)
    fp8 = _scaled_mm_cost(torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert (fp8.op, fp8.kernel_class, fp8.dtype, fp8.shape) == (
        "aten._scaled_mm.default", KernelClass.GEMM, "float8_e4m3fn", (M, N, K))
    assert fp8.flops == GEMM_FLOPS and fp8.bytes == (M * K + K * N) * 1 + M * N * 2 + 2 * 4  # + the two scales
    # the fp8 peak
    assert H100_ROOF.duration_s(fp8) == GEMM_FLOPS / (1978.9e12 * 0.7291 * ((1024 / 1056) * (0.8674 * (4096 / 4368))))
    assert H100_ROOF.duration_s(fp8) == pytest.approx(120.772e-6, rel=1e-5)
    # hybrid FP8 (E4M3 forward, E5M2 gradients): the first operand's dtype names the kernel, one rate for both
    hybrid = _scaled_mm_cost(torch.float8_e5m2, torch.float8_e4m3fn)
    assert hybrid.dtype == "float8_e5m2" and H100_ROOF.duration_s(hybrid) == H100_ROOF.duration_s(fp8)


def test_peak_dtype_names() -> None:
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "mxfp8", "float4_e2m1fn_x2", "nvfp4", "mxfp4", "fp4",
             "bfloat16", "tf32", "int8")
    assert [peak_dtype(n) for n in names] == ["float8", "float8", "float8", "mxfp8", "fp4", "fp4", "fp4", "fp4",
                                              "bfloat16", "tf32", "float32"]


def test_hopper_has_no_block_scaled_peaks() -> None:
    for name in ("h100-sxm", "h200-sxm"):
        peaks = gpu_spec(name).peak_flops_per_s
        assert peaks["float8"] == 1978.9e12 and "mxfp8" not in peaks and "fp4" not in peaks
    with pytest.raises(ConfigError, match="has no mxfp8 peak"):
        H100_ROOF.duration_s(_gemm("mxfp8", 1))
    with pytest.raises(ConfigError, match="has no fp4 peak"):
        H100_ROOF.duration_s(_gemm("float4_e2m1fn_x2", 1))


# -- B200 --------------------------------------------------------------------------------------------------


def test_b200_datasheet_figures() -> None:
    b200 = gpu_spec("b200-sxm")
    assert (b200.name, b200.capability, b200.multi_processor_count) == ("NVIDIA B200", (10, 0), 148)
    assert b200.total_memory_bytes == 182642 * MiB == 191_514_017_792
    assert b200.peak_flops_per_s == {"float64": 37e12, "float32": 75e12, "tf32": 1.125e15, "bfloat16": 2.25e15,
                                     "float16": 2.25e15, "float8": 4.5e15, "mxfp8": 4.5e15, "fp4": 9e15}
    assert b200.hbm_bytes_per_s == 8e12 and b200.context_bytes == 512 * MiB


def test_b200_gemm_roofline() -> None:
    # 1024 tiles on 148 SMs: 7 waves of 148, utilization 1024 / 1036
    util = 1024 / 1036
    assert B200_ROOF.duration_s(_gemm("bfloat16", 2)) == GEMM_FLOPS / (2.25e15 * 0.75 * util)
    fp8 = B200_ROOF.duration_s(_gemm("float8_e4m3fn", 1, "aten._scaled_mm.default"))
    assert fp8 == GEMM_FLOPS / (4.5e15 * 0.75 * util) == B200_ROOF.duration_s(_gemm("mxfp8", 1))
    assert fp8 == pytest.approx(41.200e-6, rel=1e-5)
    fp4 = dataclasses.replace(_gemm("float4_e2m1fn_x2", 1), bytes=(M * K + K * N) // 2 + M * N * 2)
    compute_s, memory_s = GEMM_FLOPS / (9e15 * 0.75 * util), fp4.bytes / (8e12 * 0.8)
    assert B200_ROOF.duration_s(fp4) == max(compute_s, memory_s) == compute_s


# -- names, profiles, CLI ----------------------------------------------------------------------------------


def test_gpu_aliases_resolve_like_the_keys() -> None:
    assert GPU_ALIASES == {"h100": "h100-sxm", "h200": "h200-sxm", "a100": "a100-sxm-80gb", "b200": "b200-sxm"}
    for alias, key in GPU_ALIASES.items():
        assert gpu_spec(alias) is gpu_spec(alias.upper()) is gpu_spec(key) is GPUS[key]
    assert gpu_name("B200-SXM") == "b200-sxm"
    with pytest.raises(ConfigError, match=r"gpu='b300' is not a known GPU model.*b200 -> b200-sxm"):
        gpu_spec("b300")


def test_h200_and_b200_profiles_load() -> None:
    b200, h200 = load_profile("dgx-b200"), load_profile("dgx-h200")
    assert load_profile("B200") == b200 and load_profile("h200") == h200
    assert (b200.gpu, b200.gpus_per_node) == ("b200-sxm", 8)
    assert (b200.intra_node.bandwidth_gbytes_per_s, b200.inter_node.bandwidth_gbytes_per_s) == (900.0, 50.0)
    assert (h200.gpu, h200.gpus_per_node) == ("h200-sxm", 8)
    assert (h200.intra_node.bandwidth_gbytes_per_s, h200.inter_node.bandwidth_gbytes_per_s) == (450.0, 50.0)
    assert h200.kernels == load_profile("dgx-h100").kernels  # the H100's compute: its efficiency estimates
    for profile in (b200, h200):
        assert profile.kernels.defaults_used == () and profile_from_yaml(profile_to_yaml(profile)) == profile
    # a profile may name its GPU by alias; it keeps the key
    text = profile_to_yaml(b200).replace("gpu: b200-sxm", "gpu: B200")
    assert profile_from_yaml(text) == b200
    with pytest.raises(ProfileError, match="`gpu: b300`.*not a known GPU model"):
        profile_from_yaml(profile_to_yaml(b200).replace("gpu: b200-sxm", "gpu: b300"), source="mine.yaml")


def test_prism_profiles_prints_dgx_b200(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "dgx-b200"]) == 0
    text = capsys.readouterr().out
    assert profile_from_yaml(text) == load_profile("dgx-b200")
    assert "name: dgx-b200" in text and "gpu: b200-sxm" in text and "bandwidth_gbytes_per_s: 900.0" in text


def test_doctests() -> None:
    import doctest

    import prism_plugin.cost.gpu as module

    assert doctest.testmod(module).failed == 0
