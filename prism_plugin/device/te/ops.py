"""TransformerEngine's kernels as custom operators of the dispatcher (``prism_te::*``), for virtual GPUs.

Each TE kernel the fake extension (`extension`) launches is one call of one operator here, so the virtual GPU's
dispatch mode sees it as it sees an ATen op: one kernel on the current stream, costed by the kernel model
(`kernels.register_kernel`: class, FLOPs, table shape), in the op tally, the timeline and the recorder. The
operators only *write* tensors the caller allocated (``Tensor(a!)`` arguments): TE's C++ allocates its outputs
with ``at::empty`` before its kernels run, and the extension does the same with ``torch.empty`` (fake storage,
so the caching-allocator model sees every output TE allocates, in TE's order). Arguments after ``*`` are written
only; the others are read (an accumulating GEMM reads its output).

Non-goal: values. The operators have fake implementations only (they run under ``FakeTensorMode``); called on
real tensors they raise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.kernels import CustomKernel, _unmasked_pairs, register_kernel

__all__ = ["NAMESPACE", "attention_backward", "attention_forward", "gemm", "pointwise"]

NAMESPACE = "prism_te"
_LIB = torch.library.Library(NAMESPACE, "DEF")
_DEFINED: set[str] = set()


def _define(name: str, schema: str, kernel: CustomKernel) -> Any:
    """Define ``prism_te::name`` once (fake implementation: nothing to compute) and register its cost."""
    if name not in _DEFINED:
        _LIB.define(f"{name}{schema}")
        _LIB.impl(name, _no_values, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_LIB)(_nothing)
        register_kernel(f"{NAMESPACE}::{name}", kernel)
        _DEFINED.add(name)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _no_values(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("prism_te operators are TransformerEngine's kernels on virtual GPUs (fake tensors); "
                              "they compute no values on real tensors")


# -- GEMM -----------------------------------------------------------------------------------------------------

def _gemm_flops(named: dict[str, Any]) -> int:
    return 2 * int(named["m"]) * int(named["n"]) * int(named["k"])


def _gemm_shape(named: dict[str, Any]) -> tuple[int, ...]:
    return (int(named["m"]), int(named["n"]), int(named["k"]))


_GEMM = CustomKernel(KernelClass.GEMM, flops=_gemm_flops, shape=_gemm_shape)


def gemm(accumulate: bool) -> Any:
    """``prism_te::gemm`` (D = op(B) op(A), written) or ``prism_te::gemm_accumulate`` (D += ..., read and written):
    ``(a, b, m, n, k, bias, [out,] *, [out,] epilogue)``; `epilogue` holds the tensors the GEMM's epilogue writes
    (bias gradient, GeLU input)."""
    if accumulate:
        return _define("gemm_accumulate", "(Tensor a, Tensor b, int m, int n, int k, Tensor? bias, Tensor(a!) out, "
                       "*, Tensor(b!)[] epilogue) -> ()", _GEMM)
    return _define("gemm", "(Tensor a, Tensor b, int m, int n, int k, Tensor? bias, *, Tensor(a!) out, "
                   "Tensor(b!)[] epilogue) -> ()", _GEMM)


# -- fused attention --------------------------------------------------------------------------------------------

def _attention_dims(named: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    return tuple(int(named[key]) for key in ("b", "h", "sq", "skv", "d", "dv"))  # type: ignore[return-value]


def _attention_shape(named: dict[str, Any]) -> tuple[int, ...]:
    b, h, sq, skv, d, _dv = _attention_dims(named)
    return (b, h, sq, skv, d, 1) if named["causal"] else (b, h, sq, skv, d)


def _causal_fraction(named: dict[str, Any], flops: int) -> int:
    """Fused kernels skip masked blocks: FLOPs times the unmasked fraction (bottom-right aligned, as TE's causal
    masks with cuDNN are for equal lengths)."""
    if not named["causal"]:
        return flops
    _b, _h, sq, skv, _d, _dv = _attention_dims(named)
    return flops * _unmasked_pairs(sq, skv, "bottom_right") // (sq * skv)


def _attention_forward_flops(named: dict[str, Any]) -> int:
    b, h, sq, skv, d, dv = _attention_dims(named)
    return _causal_fraction(named, int(sdpa_flop_count((b, h, sq, d), (b, h, skv, d), (b, h, skv, dv))))


def _attention_backward_flops(named: dict[str, Any]) -> int:
    b, h, sq, skv, d, dv = _attention_dims(named)
    dense = sdpa_backward_flop_count((b, h, sq, dv), (b, h, sq, d), (b, h, skv, d), (b, h, skv, dv))
    return _causal_fraction(named, int(dense))


_DIMS = "int b, int h, int sq, int skv, int d, int dv, bool causal"


def attention_forward() -> Any:
    """``prism_te::fused_attn_fwd(q, k, v, dims..., *, out, aux)``: cuDNN's fused attention forward (`aux`: the
    softmax statistics and the RNG state it writes)."""
    return _define("fused_attn_fwd", f"(Tensor q, Tensor k, Tensor v, {_DIMS}, *, Tensor(a!) out, "
                   "Tensor(b!)[] aux) -> ()",
                   CustomKernel(KernelClass.ATTENTION, flops=_attention_forward_flops, shape=_attention_shape))


def attention_backward() -> Any:
    """``prism_te::fused_attn_bwd(q, k, v, o, do, stats, dims..., *, grads)``: the fused attention backward."""
    return _define("fused_attn_bwd", f"(Tensor q, Tensor k, Tensor v, Tensor o, Tensor do, Tensor[] aux, {_DIMS}, "
                   "*, Tensor(a!)[] grads) -> ()",
                   CustomKernel(KernelClass.ATTENTION, flops=_attention_backward_flops, shape=_attention_shape))


# -- memory-bound kernels ---------------------------------------------------------------------------------------

def pointwise(name: str, kernel_class: KernelClass = KernelClass.ELEMENTWISE) -> Any:
    """``prism_te::<name>(inputs, *, outputs)``: one memory-bound TE kernel that reads `inputs` and writes
    `outputs` (a norm, an activation, a cast, a transpose, RoPE, an amax, a multi-tensor optimizer step). An
    in-place kernel names its tensor in both lists."""
    return _define(name, "(Tensor[] inputs, *, Tensor(a!)[] outputs) -> ()", CustomKernel(kernel_class))
