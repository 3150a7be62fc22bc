"""TE's quantization kernels on virtual GPUs: FP8 (delayed and current scaling), MXFP8, FP8 block scaling.

`quantize` is ``transformer_engine_torch.quantize``: it creates the quantized tensor TE's C++ creates (the same
Python class: ``Float8Tensor``, or ``Float8TensorStorage`` for a quantizer marked ``internal``; the same buffers:
row-wise data, column-wise data where the GPU needs it, scale-inverses) and launches the kernels TE launches:

- delayed scaling (``Float8Quantizer``): one cast(-transpose) kernel, which also updates the quantizer's amax;
- current scaling (``Float8CurrentScalingQuantizer``): an amax kernel, the amax all-reduce (MAX) over the
  quantizer's reduction group as a real collective (``torch.distributed.all_reduce``, as TE's C++ calls the
  group's allreduce), a scale kernel, the cast(-transpose) kernel;
- MXFP8 and block scaling: one cast kernel (TE's Python ``make_empty`` gives their buffers).

Hopper has no FP8 GEMM in layouts other than TN, so FP8 tensors used column-wise hold a transpose there;
Blackwell (compute capability 10 and up) uses the data itself (TE's ``nvte_is_non_tn_fp8_gemm_supported``).

`operand` gives a GEMM the raw buffer of a quantized operand, viewed as its FP8 dtype (so the kernel model times
the GEMM at the FP8 peak), and its logical shape.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.te import ops
from prism_plugin.device.te.dtypes import TORCH_DTYPE, DType

__all__ = ["is_quantized", "operand", "quantize", "quantized_buffers"]

_FP8 = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
"""TE DType values (kFloat8E4M3, kFloat8E5M2) -> torch dtypes."""


def is_quantized(tensor: Any) -> bool:
    """A TE quantized tensor or storage (it carries a ``_quantizer`` and row-wise or column-wise buffers)."""
    return hasattr(tensor, "_quantizer") and (hasattr(tensor, "_data") or hasattr(tensor, "_rowwise_data"))


def _non_tn_supported() -> bool:
    major, _minor = torch.cuda.get_device_capability()
    return major >= 10


def quantized_buffers(tensor: Any) -> list[torch.Tensor]:
    """The device buffers a quantized tensor holds (what a kernel writing it writes)."""
    names = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
             "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise")
    return [t for t in (getattr(tensor, name, None) for name in names) if isinstance(t, torch.Tensor)]


def _fp8_view(buffer: torch.Tensor, fp8_dtype: Any) -> torch.Tensor:
    dtype = _FP8.get(int(fp8_dtype), torch.float8_e4m3fn) if fp8_dtype is not None else torch.float8_e4m3fn
    return buffer.view(dtype) if buffer.dtype == torch.uint8 else buffer


def operand(tensor: Any, rowwise: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the buffer a GEMM reads, the operand's logical shape) for a plain or quantized TE tensor; `rowwise`: the
    GEMM reads the operand as stored (else its transpose: the column-wise buffer where the tensor has one)."""
    if not is_quantized(tensor):
        return tensor, tuple(int(d) for d in tensor.shape)
    fp8_dtype = getattr(tensor, "_fp8_dtype", None)
    row = getattr(tensor, "_data", None)
    if row is None:
        row = getattr(tensor, "_rowwise_data", None)
    col = getattr(tensor, "_transpose", None)
    if col is None:
        col = getattr(tensor, "_columnwise_data", None)
    if row is not None:
        shape = tuple(int(d) for d in row.shape)
    elif (hasattr(tensor, "_transpose") or _block_scaled(tensor)) and col is not None:
        # a transpose, and FP8 block scaling's column-wise data (TE's ``get_columnwise_shape``: what Hopper's TN
        # GEMM reads), hold (last dim, other dims...)
        shape = (*(int(d) for d in col.shape[1:]), int(col.shape[0]))
    else:
        shape = tuple(int(d) for d in col.shape) if col is not None else ()
    buffer = row if (rowwise or col is None) else col
    if buffer is None:
        buffer = col
    return _fp8_view(buffer, fp8_dtype), shape


def _block_scaled(tensor: Any) -> bool:
    """FP8 block scaling (``Float8BlockwiseQTensor`` and its storage): 1x128 or 128x128 blocks, each with its scale."""
    return hasattr(tensor, "_is_2D_scaled")


def _transpose_shape(shape: Sequence[int]) -> list[int]:
    return [int(shape[-1]), *(int(d) for d in shape[:-1])] if shape else []


def _create(quantizer: Any, shape: Sequence[int], fake_dtype: torch.dtype, device: torch.device) -> Any:
    """The quantized tensor TE's C++ ``create_tensor`` makes for `quantizer` (buffers allocated, not written)."""
    kind = type(quantizer).__name__
    if kind not in ("Float8Quantizer", "Float8CurrentScalingQuantizer"):
        return quantizer.make_empty(list(shape), dtype=fake_dtype, device=device)
    te_module = sys.modules[type(quantizer).__module__]  # TE's float8_tensor module: the classes its C++ builds
    Float8Tensor, Float8TensorStorage = te_module.Float8Tensor, te_module.Float8TensorStorage  # noqa: N806

    non_tn = _non_tn_supported()
    with_data = quantizer.rowwise_usage or non_tn
    with_transpose = quantizer.columnwise_usage and not non_tn
    data = torch.empty(list(shape), dtype=torch.uint8, device=device) if with_data else None
    transpose = torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=device) if with_transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    if quantizer.internal:
        return Float8TensorStorage(data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype,
                                   data_transpose=transpose, quantizer=quantizer, fake_dtype=fake_dtype)
    stride, running = [], 1
    for d in reversed(list(shape)):
        stride.insert(0, running)
        running *= int(d)
    return Float8Tensor(shape=list(shape), stride=stride, dtype=fake_dtype, data=data, fp8_scale_inv=scale_inv,
                        fp8_dtype=quantizer.dtype, data_transpose=transpose, quantizer=quantizer, device=device)


def _amax_reduce(quantizer: Any) -> None:
    if not getattr(quantizer, "with_amax_reduction", False):
        return
    import torch.distributed as dist

    group = quantizer._canonicalized_amax_reduction_group()
    dist.all_reduce(quantizer.amax, op=dist.ReduceOp.MAX, group=group)


def quantize(tensor: torch.Tensor, quantizer: Any, output: Any = None, noop_flag: Any = None) -> Any:
    """``transformer_engine_torch.quantize``: `tensor` quantized into `output` (created when None, as TE does);
    returns the quantized tensor."""
    if quantizer is None:
        return tensor
    out = output if output is not None else _create(quantizer, tuple(tensor.shape), tensor.dtype, tensor.device)
    if tensor.numel() == 0:
        return out
    kind = type(quantizer).__name__
    written = quantized_buffers(out)
    if kind == "Float8Quantizer":
        ops.pointwise("cast_transpose_fp8")([tensor, quantizer.scale], outputs=[*written, quantizer.amax])
    elif kind == "Float8CurrentScalingQuantizer":
        ops.pointwise("compute_amax", KernelClass.REDUCTION)([tensor], outputs=[quantizer.amax])
        _amax_reduce(quantizer)
        ops.pointwise("compute_scale_from_amax")([quantizer.amax], outputs=[quantizer.scale])
        ops.pointwise("cast_transpose_fp8")([tensor, quantizer.scale], outputs=written)
    else:
        ops.pointwise(f"quantize_{kind.removesuffix('Quantizer').lower()}")([tensor], outputs=written)
    return out


def fused_output(kernel: str, inputs: list[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
                 quantizer: Any, like: torch.Tensor, extra: Sequence[torch.Tensor] = (),
                 kernel_class: KernelClass = KernelClass.ELEMENTWISE) -> Any:
    """A kernel that writes a tensor of `shape` (and `extra` outputs): into a high-precision tensor, or quantized.
    TE fuses the cast into the kernel for delayed scaling (the amax is updated in the same pass); other recipes
    write the high-precision tensor and quantize it after (TE's unfused path, as for current scaling, whose
    scale needs the whole tensor's amax first)."""
    if quantizer is not None and type(quantizer).__name__ == "Float8Quantizer":
        out = _create(quantizer, shape, dtype, like.device)
        ops.pointwise(kernel, kernel_class)([*inputs, quantizer.scale],
                                            outputs=[*quantized_buffers(out), quantizer.amax, *extra])
        return out
    high = torch.empty([int(d) for d in shape], dtype=dtype, device=like.device)
    ops.pointwise(kernel, kernel_class)(inputs, outputs=[high, *extra])
    return quantize(high, quantizer) if quantizer is not None else high


def dequantize(input: Any, otype: Any) -> torch.Tensor:
    """``transformer_engine_torch.dequantize``: the high-precision tensor (dtype `otype`)."""
    buffer, shape = operand(input, rowwise=True)
    out = torch.empty(list(shape), dtype=TORCH_DTYPE[DType(int(otype))], device=buffer.device)
    ops.pointwise("dequantize")([buffer], outputs=[out])
    return out


def fp8_transpose(input: torch.Tensor, dtype: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """``transformer_engine_torch.fp8_transpose``: the (last dim, other dims) transpose of FP8 data."""
    if out is None:
        out = torch.empty(_transpose_shape(tuple(input.shape)), dtype=input.dtype, device=input.device)
    ops.pointwise("fp8_transpose")([input], outputs=[out])
    return out


def swap_first_dims(tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``transformer_engine_torch.swap_first_dims``: `tensor` with its first two dimensions swapped (block-scaled
    data gathered column-wise)."""
    if out is None:
        shape = list(tensor.shape)
        shape[0], shape[1] = shape[1], shape[0]
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    ops.pointwise("swap_first_dims")([tensor], outputs=[out])
    return out

