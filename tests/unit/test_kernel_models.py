"""Kernel-time models (prism_plugin.cost.kernels): exact roofline figures, the table's lookup rules, the profile's
``kernels:`` section and the factory's errors. Pure: no torch, no processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import GpuSpec, gpu_spec
from prism_plugin.cost.kernel_models import kernel_model
from prism_plugin.cost.kernel_table import TableModel
from prism_plugin.cost.kernels import (
    KernelClass,
    KernelCost,
    KernelEfficiency,
    RooflineModel,
    gemm_wave_utilization,
    peak_dtype,
)
from prism_plugin.cost.profiles import ProfileError, load_profile, override_profile, profile_from_yaml, profile_to_yaml

H100 = gpu_spec("h100-sxm")
H100_PROFILE = load_profile("dgx-h100")
ROOF = RooflineModel(H100, H100_PROFILE.kernels)
H100_NAME = "NVIDIA H100 80GB HBM3"


def _gemm(m: int, n: int, k: int, dtype: str = "bfloat16", size: int = 2, op: str = "aten.mm.default") -> KernelCost:
    return KernelCost(op=op, kernel_class=KernelClass.GEMM, flops=2 * m * n * k,
                      bytes=(m * k + k * n + m * n) * size, dtype=dtype, shape=(m, n, k))


def _add(numel: int) -> KernelCost:
    return KernelCost(op="aten.add.Tensor", kernel_class=KernelClass.ELEMENTWISE, flops=0, bytes=3 * numel * 2,
                      dtype="bfloat16", shape=(numel,))


# -- GPU figures --------------------------------------------------------------------------------------------


def test_gpu_datasheet_peaks() -> None:
    h200, a100 = gpu_spec("h200-sxm"), gpu_spec("a100-sxm-80gb")
    assert H100.peak_flops_per_s["bfloat16"] == H100.peak_flops_per_s["float16"] == h200.peak_flops_per_s[
        "bfloat16"] == 989.4e12
    assert (H100.peak_flops_per_s["tf32"], H100.peak_flops_per_s["float32"], H100.peak_flops_per_s["float8"]) == (
        494.7e12, 66.9e12, 1978.9e12)
    assert (H100.hbm_bytes_per_s, h200.hbm_bytes_per_s, a100.hbm_bytes_per_s) == (3.35e12, 4.8e12, 2.039e12)
    assert a100.peak_flops_per_s["bfloat16"] == 312e12 and "float8" not in a100.peak_flops_per_s
    assert hash(H100) == hash(gpu_spec("h100-sxm"))  # still usable as a key
    bare = GpuSpec(name="x", total_memory_bytes=1 << 30, capability=(9, 0), multi_processor_count=1, context_bytes=0)
    assert bare.peak_flops_per_s == {} and bare.hbm_bytes_per_s == 0.0
    with pytest.raises(ConfigError, match="roofline kernel model needs"):
        RooflineModel(bare)
    with pytest.raises(ConfigError, match="peak_flops_per_s: unknown dtype 'fp16'"):
        dataclasses.replace(bare, peak_flops_per_s={"fp16": 1e12})


# -- roofline -----------------------------------------------------------------------------------------------


def test_wave_utilization() -> None:
    tile = (128, 128)
    assert gemm_wave_utilization((4096, 4096, 4096), 132, tile, 256) == 1024 / 1056  # 32*32 tiles, 8 waves
    assert gemm_wave_utilization((4224, 4224, 4096), 132, tile, 256) == 1089 / 1188  # 33*33 tiles, 9 waves
    assert gemm_wave_utilization((128, 128, 4096), 132, tile, 256) == 16 / 132  # 1 tile, split-K 4096 // 256 = 16
    assert gemm_wave_utilization((256, 256, 100), 132, tile, 256) == 4 / 132  # k too shallow to split
    assert gemm_wave_utilization((8, 512, 512, 64), 132, tile, 256) == 128 / 132  # batched: 8 * 4*4 tiles
    assert gemm_wave_utilization((), 132, tile, 256) == 1.0


def test_roofline_gemm_4096_cubed_bf16_on_h100() -> None:
    # 2 * 4096^3 = 137,438,953,472 FLOPs at 989.4e12 * 0.7291 (dgx-h100 gemm.compute_efficiency) * 1024/1056
    # (wave utilization) * 4096/(4096 + 272) (gemm.k_half) = 6.5595245...e14 FLOP/s -> 209.525786038 us; bytes
    # 3 * 4096^2 * 2 = 100,663,296 at 3.35e12 * 0.8 = 2.68e12 B/s would take 37.56 us: compute-bound.
    cost = _gemm(4096, 4096, 4096)
    assert cost.flops == 137_438_953_472 and cost.bytes == 100_663_296
    assert ROOF.duration_s(cost) == 137_438_953_472 / (989.4e12 * 0.7291 * (1024 / 1056) * (4096 / 4368))
    assert ROOF.duration_s(cost) == pytest.approx(209.525786038e-6, rel=1e-10)
    assert ROOF.name == "roofline"


def test_roofline_memory_bound_gemm_tf32_and_floor() -> None:
    # (16, 16384, 16384) bf16: 8.59e9 FLOPs take 12.5 us (128 tiles on 132 SMs, k factor 16384/16656), but
    # 537,919,488 bytes at 2.68e12 B/s take 200.7 us
    skinny = _gemm(16, 16384, 16384)
    assert skinny.bytes == (16 * 16384 + 16384 * 16384 + 16 * 16384) * 2 == 537_919_488
    assert ROOF.duration_s(skinny) == 537_919_488 / (3.35e12 * 0.8)
    # float32 GEMM the program allows on TF32 tensor cores: 494.7e12, not the 66.9e12 CUDA-core rate
    tf32 = dataclasses.replace(_gemm(4096, 4096, 4096, size=4), dtype="tf32")
    assert ROOF.duration_s(tf32) == 137_438_953_472 / (494.7e12 * 0.7291 * (1024 / 1056) * (4096 / 4368))
    fp32 = dataclasses.replace(tf32, dtype="float32")
    assert ROOF.duration_s(fp32) == 137_438_953_472 / (66.9e12 * 0.7291 * (1024 / 1056) * (4096 / 4368))
    # a (64, 16, 32) mm: 65,536 FLOPs and 7,168 bytes, both far under the 2.5 us floor (min_kernel_us)
    assert ROOF.duration_s(_gemm(64, 16, 32)) == 2.5e-6


def test_roofline_memory_bound_elementwise() -> None:
    # add of two bf16 tensors of 2^28 elements: reads 2 * 2^29 B, writes 2^29 B = 1,610,612,736 B at
    # 3.35e12 * 0.85 (elementwise.memory_efficiency) = 2.8475e12 B/s -> 565.62 us
    assert ROOF.duration_s(_add(2**28)) == 1_610_612_736 / (3.35e12 * 0.85)
    assert ROOF.duration_s(_add(2**28)) == pytest.approx(565.6234e-6, rel=1e-6)
    h200 = RooflineModel(gpu_spec("h200-sxm"), H100_PROFILE.kernels)
    assert h200.duration_s(_add(2**28)) == 1_610_612_736 / (4.8e12 * 0.85)  # HBM3e


def test_dtype_peaks_and_missing_float8_on_a100() -> None:
    assert [peak_dtype(d) for d in ("float8_e5m2", "float16", "int32", "bool", "tf32")] == [
        "float8", "float16", "float32", "float32", "tf32"]
    fp8 = dataclasses.replace(_gemm(4096, 4096, 4096, size=1), dtype="float8_e4m3fn", op="aten._scaled_mm.default")
    # FP8: the float8 peak at gemm.float8_factor (0.8674) of the BF16 efficiency
    assert ROOF.duration_s(fp8) == 137_438_953_472 / (1978.9e12 * 0.7291 * ((1024 / 1056) * (0.8674 * (4096 / 4368))))
    a100 = RooflineModel(gpu_spec("a100-sxm-80gb"), load_profile("dgx-a100").kernels)
    with pytest.raises(ConfigError, match="has no float8 peak"):
        a100.duration_s(fp8)
    # A100: 108 SMs -> 1024 tiles in 10 waves (1080 slots); 312e12 * 0.85 (dgx-a100 gemm.compute_efficiency)
    assert a100.duration_s(_gemm(4096, 4096, 4096)) == 137_438_953_472 / (312e12 * 0.85 * 1024 / 1080)


# -- table --------------------------------------------------------------------------------------------------


def _row(cost: KernelCost, us: float, device: str = H100_NAME) -> dict:
    return {"op": cost.op, "kernel_class": cost.kernel_class.value, "shape": list(cost.shape), "dtype": cost.dtype,
            "device": device, "flops": cost.flops, "bytes": cost.bytes, "duration_us": us}


def _table(tmp_path, rows: list[dict], **kw) -> TableModel:
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"format": "prism-kernel-table", "version": 1, "entries": rows}))
    return TableModel.from_json(path, ROOF, **kw)


def test_table_exact_interpolated_and_miss(tmp_path) -> None:
    big, small = _gemm(4096, 4096, 4096), _gemm(1024, 1024, 1024)
    table = _table(tmp_path, [_row(big, 200.0), _row(small, 20.0),
                              _row(_add(1024), 30.0), _row(_add(1024), 10.0), _row(_add(1024), 20.0)])
    assert table.name == "table" and table.device == H100_NAME
    assert table.duration_s(big) == 200e-6 and table.duration_s(small) == 20e-6  # exact keys
    assert table.duration_s(_add(1024)) == 20e-6  # repeated key: the median of 10, 20, 30 us
    # 8192^3: nearest is 4096^3 (8x the FLOPs, 4x the bytes); both compute-bound at the same wave utilization
    # (64*64 tiles in 32 waves = 4096/4224 = 1024/1056), so the roofline ratio is 8 times the k factors' ratio
    # (gemm.k_half 272: 4096/4368 against 8192/8464): 200 us * 8 * 0.93773 / 0.96786
    assert table.duration_s(_gemm(8192, 8192, 8192)) == pytest.approx(1600e-6 * (4096 / 4368) / (8192 / 8464),
                                                                       rel=1e-12)
    # no entry of aten.mm in float16, none of aten.mul: the fallback roofline answers, counted per op
    fp16 = dataclasses.replace(big, dtype="float16")
    assert table.duration_s(fp16) == ROOF.duration_s(fp16) > 0
    mul = dataclasses.replace(_add(4096), op="aten.mul.Tensor")
    assert table.duration_s(mul) == table.duration_s(mul) == ROOF.duration_s(mul) == 2.5e-6
    assert table.misses() == {"aten.mm.default": 1, "aten.mul.Tensor": 2}
    assert table.interpolated() == {"aten.mm.default": 1}
    assert table.hits() == {"aten.add.Tensor": 1, "aten.mm.default": 2}


def test_a_table_from_another_device_scales_by_its_own_roofline(tmp_path) -> None:
    """A CPU-recorded table emulating an H100 by name: a near shape scales by what the table measured (4x the FLOPs
    of a compute-bound GEMM: 4x its time), not by the H100's roofline, on which the larger keeps 4x the SMs busy
    (split-K) and so takes no longer."""
    gemm, big = _gemm(64, 2048, 512, "float32", 4), _gemm(64, 4096, 1024, "float32", 4)
    add, add2 = _add(64 * 512), _add(64 * 1024)
    rows = [_row(gemm, 4000.0, device="cpu"), _row(add, 20.0, device="cpu"), _row(_add(64 * 2048), 25.0, device="cpu")]
    on_cpu = _table(tmp_path, rows, target_device=H100_NAME)
    assert on_cpu.scaled_by == "measured"
    assert on_cpu.duration_s(big) == pytest.approx(16000e-6, rel=1e-12)
    # the adds: the best measured bandwidth is the 64 x 2048 one's (768 KiB in 25 us); 64 x 1024's bytes at it
    # take 12.5 us, under the table's floor (its shortest entry, 20 us): 20 us x 20 / 20
    assert on_cpu.duration_s(add2) == pytest.approx(20e-6, rel=1e-12)
    assert ROOF.duration_s(big) <= ROOF.duration_s(gemm)  # what the H100's roofline would have scaled by: <= 1
    same = _table(tmp_path, rows)  # no target named: the table is taken to be the GPU's (the fallback scales)
    assert same.scaled_by == "gpu" and same.duration_s(big) == pytest.approx(
        4000e-6 * ROOF.duration_s(big) / ROOF.duration_s(gemm), rel=1e-12)


def test_table_devices_and_bad_files(tmp_path) -> None:
    big = _gemm(4096, 4096, 4096)
    rows = [_row(big, 200.0), _row(big, 9000.0, device="cpu")]
    with pytest.raises(ConfigError, match=r"holds devices \['NVIDIA H100 80GB HBM3', 'cpu'\]"):
        _table(tmp_path, rows)
    assert _table(tmp_path, rows, device="cpu").duration_s(big) == 9000e-6
    with pytest.raises(ConfigError, match="no entries for device 'A100'"):
        _table(tmp_path, rows, device="A100")
    bad = _row(big, 200.0)
    bad["duration_us"] = 0
    with pytest.raises(ConfigError, match=r"entries\[0\]: `duration_us` must be a number > 0"):
        _table(tmp_path, [bad])
    del bad["dtype"]
    with pytest.raises(ConfigError, match=r"entries\[0\]: missing field `dtype`"):
        _table(tmp_path, [bad])
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json:1:2: malformed JSON"):
        TableModel.from_json(path, ROOF)
    with pytest.raises(ConfigError, match="cannot read kernel table"):
        TableModel.from_json(tmp_path / "absent.json", ROOF)


# -- the profile's kernels: section and the factory -----------------------------------------------------------


def test_efficiency_defaults_are_reported() -> None:
    everything = KernelEfficiency()
    assert "gemm.compute_efficiency" in everything.defaults_used and "min_kernel_us" in everything.defaults_used
    assert everything.compute_efficiency(KernelClass.GEMM) == 0.75
    assert H100_PROFILE.kernels.defaults_used == () == load_profile("dgx-a100").kernels.defaults_used
    assert load_profile("local-cpu-gloo").kernels == everything  # no section: all policy defaults
    part = KernelEfficiency.from_mapping({"gemm": {"compute_efficiency": 0.7}, "min_kernel_us": 3})
    assert part.compute_efficiency(KernelClass.GEMM) == 0.7 and part.value("min_kernel_us") == 3.0
    assert "gemm.compute_efficiency" not in part.defaults_used and "gemm.memory_efficiency" in part.defaults_used
    assert part.to_mapping() == {"gemm": {"compute_efficiency": 0.7}, "min_kernel_us": 3.0}
    assert KernelEfficiency.from_mapping(part.to_mapping()) == part


def test_profile_kernels_round_trip_and_override() -> None:
    assert profile_from_yaml(profile_to_yaml(H100_PROFILE)) == H100_PROFILE
    data = yaml.safe_load(profile_to_yaml(H100_PROFILE))
    assert data["kernels"]["gemm"] == {"compute_efficiency": 0.7291, "float8_factor": 0.8674, "k_half": 272.0,
                                       "memory_efficiency": 0.8}
    assert data["kernels"]["gemm_tile"] == [128, 128]
    slower = override_profile(H100_PROFILE, {"kernels.gemm.compute_efficiency": 0.6, "kernels.min_kernel_us": 4})
    assert slower.kernels.compute_efficiency(KernelClass.GEMM) == 0.6 and slower.kernels.value("min_kernel_us") == 4
    assert "kernels" not in yaml.safe_load(profile_to_yaml(load_profile("local-cpu-gloo")))
    with pytest.raises(ProfileError, match="did you mean `kernels.gemm.compute_efficiency`"):
        override_profile(H100_PROFILE, {"kernels.gemm.compute_eff": 0.6})


@pytest.mark.parametrize(("section", "message"), [
    ({"gemm": {"compute_efficiency": 1.5}}, "`kernels.gemm.compute_efficiency` must be a fraction in (0, 1]"),
    ({"gemm": {"compute": 0.5}},
     "unknown field `kernels.gemm.compute`; did you mean `kernels.gemm.compute_efficiency`"),
    ({"gemmm": {"compute_efficiency": 0.5}}, "unknown field `kernels.gemmm`; did you mean `kernels.gemm`"),
    ({"gemm_tile": [128]}, "`kernels.gemm_tile` must be two positive integers"),
    ({"gemm": {"k_half": -1}}, "`kernels.gemm.k_half` must be >= 0"),
    ({"gemm": {"float8_factor": 0}}, "`kernels.gemm.float8_factor` must be > 0"),
    ({"gemm": {"k_halve": 1}}, "did you mean `kernels.gemm.k_half`"),
    ({"min_kernel_us": 0}, "`kernels.min_kernel_us` must be > 0 microseconds"),
    ({"norm": 0.7}, "`kernels.norm` must be a mapping of compute_efficiency and memory_efficiency"),
    ({"elementwise": {"memory_efficiency": "fast"}}, "`kernels.elementwise.memory_efficiency` must be a finite number"),
    (5, "`kernels` must be a mapping"),
])
def test_bad_kernels_section_names_field_and_file(tmp_path, section: object, message: str) -> None:
    data = yaml.safe_load(profile_to_yaml(H100_PROFILE))
    data["kernels"] = section
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert message in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match="kernels"):  # the factory validates a raw mapping the same way
        kernel_model("roofline", H100, section)  # type: ignore[arg-type]


def test_kernel_model_factory(tmp_path) -> None:
    model = kernel_model("roofline", H100, H100_PROFILE.kernels)
    assert model.name == "roofline" and model.duration_s(_gemm(4096, 4096, 4096)) == ROOF.duration_s(
        _gemm(4096, 4096, 4096))
    assert kernel_model("roofline", H100, None).efficiency == KernelEfficiency()  # type: ignore[attr-defined]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "prism-kernel-table", "version": 1,
                                "entries": [_row(_gemm(4096, 4096, 4096), 200.0)]}))
    table = kernel_model("table", H100, {"gemm": {"compute_efficiency": 0.75}}, path)
    assert table.name == "table" and table.duration_s(_gemm(4096, 4096, 4096)) == 200e-6
    with pytest.raises(ConfigError, match="kernel_model='rofline' is not one of roofline, table, fit"):
        kernel_model("rofline", H100, None)
    with pytest.raises(ConfigError, match="kernel_model=fit goes with a fit overlay"):
        kernel_model("fit", H100, None)
    with pytest.raises(ConfigError, match="kernel_model=table needs a kernel table file"):
        kernel_model("table", H100, None)
    with pytest.raises(ConfigError, match="kernel_model=roofline reads no table"):
        kernel_model("roofline", H100, None, path)


def test_doctests() -> None:
    import doctest

    import prism_plugin.cost.kernel_table as table
    import prism_plugin.cost.kernels as module

    assert doctest.testmod(module).failed == 0
    assert doctest.testmod(table).failed == 0 and doctest.testmod(table).attempted >= 3
