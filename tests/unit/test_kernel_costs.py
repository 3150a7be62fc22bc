"""What each ATen op costs as a kernel (prism_plugin.device.kernels): FLOPs against torch's own
``FlopCounterMode``, bytes by hand, class and shape, no kernel for views; and the `KernelTimer` tallies.

CPU fake tensors under ``FakeTensorMode`` (no values, no virtual-GPU runtime), costed with
``device_types=("cpu",)``."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernel_table import TableModel
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel
from prism_plugin.cost.profiles import load_profile
from prism_plugin.device.kernel_timer import KernelTimer
from prism_plugin.device.kernels import kernel_cost

aten = torch.ops.aten
BF16 = torch.bfloat16
CPU = ("cpu",)


def _call(func, *args, **kwargs):
    """``func(*args, **kwargs)``, its kernel cost, and the FLOPs torch's FlopCounterMode counts for it."""
    with FlopCounterMode(display=False) as counter:
        out = func(*args, **kwargs)
    return out, kernel_cost(func, args, kwargs, out, device_types=CPU), counter.get_total_flops()


@pytest.fixture()
def fake():
    with FakeTensorMode() as mode:
        yield mode


def test_gemms(fake) -> None:
    a, b, bias = torch.randn(64, 32, dtype=BF16), torch.randn(32, 16, dtype=BF16), torch.randn(16, dtype=BF16)
    _, mm, flops = _call(aten.mm.default, a, b)
    assert (mm.op, mm.kernel_class, mm.dtype) == ("aten.mm.default", KernelClass.GEMM, "bfloat16")
    assert mm.shape == (64, 16, 32)  # (m, n, k)
    assert mm.flops == flops == 2 * 64 * 16 * 32
    assert mm.bytes == (64 * 32 + 32 * 16 + 64 * 16) * 2  # read a, b; write the (64, 16) output
    _, addmm, flops = _call(aten.addmm.default, bias, a, b)
    assert addmm.flops == flops == 2 * 64 * 16 * 32 and addmm.shape == (64, 16, 32)
    assert addmm.bytes == (16 + 64 * 32 + 32 * 16 + 64 * 16) * 2
    x, y = torch.randn(4, 64, 32), torch.randn(4, 32, 8)
    _, bmm, flops = _call(aten.bmm.default, x, y)
    assert bmm.flops == flops == 2 * 4 * 64 * 8 * 32 and bmm.shape == (4, 64, 8, 32) and bmm.dtype == "float32"
    assert bmm.bytes == (4 * 64 * 32 + 4 * 32 * 8 + 4 * 64 * 8) * 4
    out = torch.empty(64, 16, dtype=BF16)
    _, mm_out, _ = _call(aten.mm.out, a, b, out=out)
    assert mm_out.bytes == mm.bytes  # the out= argument is written, not read
    image, weight = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    _, conv, flops = _call(aten.convolution.default, image, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert conv.kernel_class is KernelClass.GEMM and conv.flops == flops == 2 * 512 * 8 * 27
    assert conv.shape == (2 * 16 * 16, 8, 3 * 3 * 3)  # implicit GEMM: output pixels x channels x weights/channel


def test_float32_gemm_is_tf32_when_the_program_allows_it(fake) -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _call(aten.mm.default, a, b)[1].dtype == "float32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _call(aten.mm.default, a, b)[1].dtype == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_attention(fake) -> None:
    q, k = torch.randn(2, 4, 128, 64, dtype=BF16), torch.randn(2, 4, 256, 64, dtype=BF16)
    tensor_bytes = 2 * 4 * 128 * 64 * 2  # one (2, 4, 128, 64) bf16 tensor: 131,072 B
    out, eff, flops = _call(aten._scaled_dot_product_efficient_attention.default, q, k, k, None, False)
    assert eff.kernel_class is KernelClass.ATTENTION and eff.shape == (2, 4, 128, 256, 64)
    assert eff.flops == flops == 4 * 2 * 4 * 128 * 256 * 64  # QK^T and PV: 2 GEMMs of 2*B*H*Sq*Skv*D
    assert eff.bytes == tensor_bytes * (1 + 2 + 2 + 1) + sum(t.numel() * t.element_size() for t in out[1:])
    # the CPU flash kernel sdpa dispatches to here: not in torch's registry, counted with the flash formula
    _, cpu_flash, _ = _call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, k)
    _, flash, flops = _call(aten._scaled_dot_product_flash_attention.default, q, k, k)
    assert cpu_flash.flops == flash.flops == flops == eff.flops and cpu_flash.shape == (2, 4, 128, 256, 64)
    # causal (torch's top-left mask): query i sees keys 0..i, 128 * 129 / 2 = 8256 of 128 * 256 pairs
    _, causal, full = _call(aten._scaled_dot_product_flash_attention.default, q, k, k, 0.0, True)
    assert full == flops and causal.flops == 4 * 2 * 4 * 64 * 8256 and causal.shape == (2, 4, 128, 256, 64, 1)
    _, eff_causal, _ = _call(aten._scaled_dot_product_efficient_attention.default, q, q, q, None, False,
                             is_causal=True)
    assert eff_causal.flops == 4 * 2 * 4 * 64 * (128 * 129 // 2)  # equal lengths: S(S+1)/2 of S^2 pairs


def test_norm_elementwise_reduction(fake) -> None:
    x = torch.randn(64, 32, dtype=BF16)
    w = torch.randn(32, dtype=BF16)
    out, ln, flops = _call(aten.native_layer_norm.default, x, [32], w, w, 1e-5)
    assert (ln.kernel_class, ln.flops, flops, ln.shape) == (KernelClass.NORM, 0, 0, (64, 32))
    assert ln.bytes == 64 * 32 * 2 + 2 * 32 * 2 + sum(t.numel() * t.element_size() for t in out)
    _, add, _ = _call(aten.add.Tensor, x, x)
    assert (add.kernel_class, add.bytes, add.flops) == (KernelClass.ELEMENTWISE, 3 * 64 * 32 * 2, 0)
    _, inplace, _ = _call(aten.add_.Tensor, x, x)
    assert inplace.bytes == 3 * 64 * 32 * 2  # reads self and other, writes self (returned: counted once)
    _, total, _ = _call(aten.sum.dim_IntList, x, [1])
    assert (total.kernel_class, total.bytes, total.shape) == (KernelClass.REDUCTION, 64 * 32 * 2 + 64 * 2, (64, 32))
    _, soft, _ = _call(aten._softmax.default, x, -1, False)
    assert soft.kernel_class is KernelClass.NORM and soft.bytes == 2 * 64 * 32 * 2


def test_foreach_copy_and_no_kernel(fake) -> None:
    params, grads = [torch.randn(10), torch.randn(20)], [torch.randn(10), torch.randn(20)]
    out, foreach, _ = _call(aten._foreach_add_.List, params, grads)
    assert out is None  # in place: the written params are counted from the schema's Tensor(a!) arguments
    assert (foreach.kernel_class, foreach.shape, foreach.bytes) == (KernelClass.OPTIMIZER, (2, 30), 3 * 30 * 4)
    dst, src = torch.empty(64, 32), torch.randn(64, 32, dtype=BF16)
    _, copy, _ = _call(aten.copy_.default, dst, src)
    assert (copy.kernel_class, copy.bytes, copy.dtype) == (KernelClass.MEMCPY, 64 * 32 * 2 + 64 * 32 * 4, "bfloat16")
    _, zero, _ = _call(aten.zero_.default, dst)
    assert (zero.kernel_class, zero.bytes) == (KernelClass.MEMCPY, 64 * 32 * 4)  # written only
    assert _call(aten.cat.default, [src, src])[1].bytes == 4 * 64 * 32 * 2
    for func, args in [(aten.view.default, (src, [32, 64])), (aten.t.default, (src,)),
                       (aten.expand.default, (torch.randn(1, 32), [8, 32])), (aten.detach.default, (src,)),
                       (aten.empty_strided.default, ([4, 4], [4, 1])), (aten.as_strided.default, (src, [2], [1]))]:
        assert _call(func, *args)[1] is None, func
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert kernel_cost(aten.mm.default, (a, b), {}, a @ b) is None  # host tensors: not a device kernel by default


class _Timed(TorchDispatchMode):
    """Times every op the way the virtual-time dispatch mode will."""

    def __init__(self, timer: KernelTimer) -> None:
        super().__init__()
        self.timer, self.seconds = timer, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seconds += self.timer.duration_s(func, args, kwargs, out) or 0.0
        return out


def test_timer_tallies_a_training_step(fake, tmp_path) -> None:
    roof = RooflineModel(gpu_spec("h100-sxm"), load_profile("dgx-h100").kernels)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512))
    x = torch.randn(128, 256)
    timer = KernelTimer(roof, device_types=CPU)
    with _Timed(timer) as timed:
        model(x).sum().backward()
    summary = timer.summary()
    assert summary.model == "roofline" and summary.defaults_used == ()
    assert summary.kernels == sum(t.count for t in timer.summary(top=100).top)
    assert summary.total_s == pytest.approx(timed.seconds, rel=1e-12)
    ops = {t.op: t for t in summary.top}
    assert "aten.addmm.default" in ops and not any("view" in op or op.endswith(".t.default") for op in ops)
    assert ops["aten.addmm.default"].flops == 2 * 128 * 512 * 256  # forward Linear
    assert list(summary.top) == sorted(summary.top, key=lambda t: (-t.total_s, t.op))
    assert summary.by_class_s["gemm"] > 0 and summary.misses == {}
    assert json.loads(json.dumps(summary.as_dict()))["model"] == "roofline"
    assert summary.lines()[0].startswith(f"kernel model roofline: {summary.kernels} kernels")
    # a table with no rows for these ops: every kernel falls back to the roofline and is reported as a miss
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "prism-kernel-table", "version": 1, "entries": [
        {"op": "aten.mm.default", "kernel_class": "gemm", "shape": [1, 1, 1], "dtype": "float16", "device": "cpu",
         "flops": 2, "bytes": 6, "duration_us": 1.0}]}))
    table_timer = KernelTimer(TableModel.from_json(path, roof), device_types=CPU)
    model.zero_grad(set_to_none=True)  # the same step again (not accumulating into .grad)
    with _Timed(table_timer):
        model(x).sum().backward()
    table_summary = table_timer.summary()
    assert table_summary.model == "table" and table_summary.total_s == pytest.approx(summary.total_s, rel=1e-12)
    assert sum(table_summary.misses.values()) == table_summary.kernels and "aten.addmm.default" in table_summary.misses
    assert any(line.startswith("  table misses") for line in table_summary.lines())
    # every kernel missed: the coverage says so and the run warns that its time is the roofline's
    coverage = table_summary.as_dict()["table"]
    assert coverage == {"source": str(path), "device": "cpu", "kernels": table_summary.kernels, "exact": 0,
                        "scaled": 0, "scaled_by": "gpu", "missed": table_summary.kernels, "missed_fraction": 1.0}
    warning = table_summary.table_warning()
    assert warning is not None and f"answered 0 of {table_summary.kernels} kernels" in warning
    assert "(100.0%) fell back to the roofline" in warning and any(warning in line for line in table_summary.lines())
    assert summary.table_warning() is None and "table" not in summary.as_dict()  # the roofline model has no table


def test_a_fusion_region_is_one_tallied_kernel_and_a_table_without_it_sums_its_ops(tmp_path) -> None:
    roof = RooflineModel(gpu_spec("h100-sxm"), load_profile("dgx-h100").kernels)
    parts = (KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=2 * 64 * 32 * 16,
                        bytes=(64 * 16 + 16 * 32 + 64 * 32) * 2, dtype="bfloat16", shape=(64, 32, 16)),
             KernelCost(op="aten.add_.Tensor", kernel_class=KernelClass.ELEMENTWISE, flops=0,
                        bytes=3 * 64 * 32 * 4, dtype="float32", shape=(64, 32)))
    region = KernelCost(op="fused::wgrad", kernel_class=KernelClass.GEMM, flops=parts[0].flops,
                        bytes=(64 * 16 + 16 * 32) * 2 + 2 * 64 * 32 * 4, dtype="bfloat16", shape=(64, 32, 16))
    timer = KernelTimer(roof)
    assert timer.region_duration_s(region, parts) == roof.duration_s(region)  # the roofline times the one kernel
    summary = timer.summary()
    assert [(t.op, t.count, t.flops, t.bytes) for t in summary.fused] == [("fused::wgrad", 1, region.flops,
                                                                          region.bytes)]
    assert summary.kernels == 1 and summary.as_dict()["fused"][0]["class"] == "gemm"
    # a table recorded where the region ran op by op has rows of its ops, none of the fused kernel: their sum
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "prism-kernel-table", "version": 1, "entries": [
        {"op": p.op, "kernel_class": p.kernel_class.value, "shape": list(p.shape), "dtype": p.dtype, "device": "cpu",
         "flops": p.flops, "bytes": p.bytes, "duration_us": us} for p, us in zip(parts, (3.0, 5.0), strict=True)]}))
    table = TableModel.from_json(path, roof)
    table_timer = KernelTimer(table)
    assert table_timer.region_duration_s(region, parts) == pytest.approx(8e-6, rel=1e-12)
    assert table.hits() == {"aten.add_.Tensor": 1, "aten.mm.default": 1} and table.misses() == {}
    assert [(t.op, t.count) for t in table_timer.summary().fused] == [("fused::wgrad", 1)]
    assert table_timer.summary().table_warning() is None  # both kernels answered by the table


def test_doctests() -> None:
    import doctest

    import prism_plugin.device.kernels as module

    assert doctest.testmod(module).failed == 0
