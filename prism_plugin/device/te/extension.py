"""A fake ``transformer_engine_torch``: TransformerEngine's compiled PyTorch extension, for virtual GPUs.

TE's PyTorch layer (the pure-Python ``transformer_engine`` package, the release `TE_VERSION`) calls its compiled
extension for every kernel. This module answers those calls on fake tensors: each function allocates the outputs
TE's C++ allocates (same shapes, dtypes, order; ``torch.empty`` on the input's device, so the caching-allocator
model holds them) and launches its kernels as ``prism_te`` operators (`ops`), one per kernel TE launches, so the
kernel model times them. The enums and classes keep TE's names; their values need only be consistent here. Each function
is one call into TE's C++ for virtual time (`VirtualTime.native_call`): its launches after the first pay the
driver's host time alone, as TE's C++ loops (the userbuffers chunks) do.

What is answered: GEMMs (``generic_gemm``: BF16/FP16/FP32 and FP8 operands, with bias, GeLU epilogue, accumulation
into an existing output: Megatron's gradient-accumulation fusion, and FP8 output), layer and RMS norms (zero-centred
gamma included; FP8 output), quantization (`quantize`: delayed and current scaling, MXFP8, block scaling), cuDNN
fused attention forward and backward (BSHD/SBHD layouts, causal and no mask, GQA; BF16/FP16), fused RoPE, the fused
MoE router (`router`), the activations and their backward, multi-tensor optimizer kernels (TE's FusedAdam, scale,
l2norm), and the version queries TE makes (a policy answer each: `CUDNN_VERSION`, `CUBLASLT_VERSION`). What is not
answered raises `NotImplementedError` naming the function when it is called (never at import): userbuffers
(TP-communication overlap), NVSHMEM, THD (packed) attention, FP8 attention.
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.clock import native_call
from prism_plugin.device.te import ops, quantize, router, userbuffers
from prism_plugin.device.te.dtypes import TORCH_DTYPE, DType

__all__ = ["CUBLASLT_VERSION", "CUDNN_VERSION", "build_module"]

CUDNN_VERSION = 91400
"""cuDNN 9.14.0, encoded as cuDNN encodes it (what TE's fused-attention backend checks read): a policy answer."""
CUBLASLT_VERSION = 120900
"""cuBLASLt 12.9 (CUDA 12.9), encoded as cuBLASLt encodes it: a policy answer."""


_ENUMS: dict[str, Sequence[str]] = {
    "NVTE_Bias_Type": ("NVTE_NO_BIAS", "NVTE_PRE_SCALE_BIAS", "NVTE_POST_SCALE_BIAS", "NVTE_ALIBI"),
    "NVTE_Mask_Type": ("NVTE_NO_MASK", "NVTE_PADDING_MASK", "NVTE_CAUSAL_MASK", "NVTE_PADDING_CAUSAL_MASK",
                       "NVTE_CAUSAL_BOTTOM_RIGHT_MASK", "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK"),
    "NVTE_Softmax_Type": ("NVTE_VANILLA_SOFTMAX", "NVTE_OFF_BY_ONE_SOFTMAX", "NVTE_LEARNABLE_SOFTMAX"),
    "NVTE_QKV_Format": ("NVTE_SBHD", "NVTE_BSHD", "NVTE_THD", "NVTE_SBHD_2BSHD", "NVTE_BSHD_2SBHD",
                        "NVTE_THD_2BSHD", "NVTE_THD_2SBHD"),
    "NVTE_QKV_Layout": (
        "NVTE_SB3HD", "NVTE_SBH3D", "NVTE_SBHD_SB2HD", "NVTE_SBHD_SBH2D", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD",
        "NVTE_BSH3D", "NVTE_BSHD_BS2HD", "NVTE_BSHD_BSH2D", "NVTE_BSHD_BSHD_BSHD", "NVTE_T3HD", "NVTE_TH3D",
        "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD", "NVTE_SBHD_BSHD_BSHD", "NVTE_BSHD_SBHD_SBHD",
        "NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD", "NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_SBHD_SBHD",
        "NVTE_Paged_KV_SBHD_BSHD_BSHD", "NVTE_Paged_KV_SBHD_SBHD_SBHD", "NVTE_Paged_KV_THD_BSHD_BSHD",
        "NVTE_Paged_KV_THD_SBHD_SBHD"),
    "NVTE_Fused_Attn_Backend": ("NVTE_F16_max512_seqlen", "NVTE_F16_arbitrary_seqlen", "NVTE_FP8",
                                "NVTE_No_Backend"),
    "Float8BlockScaleTensorFormat": ("GEMM_READY", "COMPACT", "INVALID"),
    "CommOverlapType": ("RS", "AG"),
    "CommOverlapAlgo": ("BULK_OVERLAP_AG", "BULK_OVERLAP_RS", "SPLIT_PIPELINED_AG_P2P", "SPLIT_PIPELINED_RS",
                        "SPLIT_PIPELINED_RS_P2P", "ATOMIC_GEMM_RS", "ATOMIC_GEMM_AG_P2P", "ATOMIC_GEMM_RS_P2P",
                        "EXTERNAL_BULK_OVERLAP_AG"),
    "FP8FwdTensors": ("GEMM1_INPUT", "GEMM1_WEIGHT", "GEMM1_OUTPUT", "GEMM2_INPUT", "GEMM2_WEIGHT", "GEMM2_OUTPUT",
                      "GEMM3_INPUT", "GEMM3_WEIGHT", "GEMM3_OUTPUT"),
    "FP8BwdTensors": ("GRAD_OUTPUT1", "GRAD_INPUT1", "GRAD_OUTPUT2", "GRAD_INPUT2", "GRAD_OUTPUT3", "GRAD_INPUT3"),
}
"""TE's other pybind enums, values in declaration order (``NVTE_Fused_Attn_Backend.NVTE_No_Backend`` is -1 in C++:
only compared by identity in TE's Python)."""


class FP8TensorMeta:
    """The per-module FP8 scaling state TE's delayed-scaling recipe keeps (``scale``, ``scale_inv``,
    ``amax_history``: tensors TE's Python assigns)."""

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.scale_inv: torch.Tensor | None = None
        self.amax_history: torch.Tensor | None = None


def _unsupported(name: str, why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"transformer_engine_torch.{name} on a virtual GPU: {why}")

    refuse.__name__ = name
    return refuse


# -- helpers ------------------------------------------------------------------------------------------------------

def _torch_dtype(dtype: Any) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else TORCH_DTYPE[DType(int(dtype))]


def _plain(tensor: Any, name: str) -> torch.Tensor:
    """The tensor a memory-bound kernel reads: a plain tensor, or a quantized one's row-wise buffer."""
    if quantize.is_quantized(tensor):
        return quantize.operand(tensor, rowwise=True)[0]
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"transformer_engine_torch on a virtual GPU: {name} is a {type(tensor).__name__}")
    return tensor


def _empty(shape: Sequence[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(int(d) for d in shape), dtype=dtype, device=like.device)


def _rows(t: torch.Tensor) -> int:
    return math.prod(int(d) for d in t.shape[:-1]) if t.dim() else 1


# -- GEMM ---------------------------------------------------------------------------------------------------------

def gemm_output_shape(a_shape: Sequence[int], transa: bool, b_shape: Sequence[int], transb: bool) -> list[int]:
    """TE's ``getGemmOutputShape``: A and B flattened to 2-D (outer dims, last dim); D is ``(B1 if transb else B's
    outer dims..., A0 if transa else A1)``.

    >>> gemm_output_shape((96, 64), True, (8, 2, 64), False)
    [8, 2, 96]
    """
    a0, a1 = math.prod(a_shape[:-1]), a_shape[-1]
    b0, b1 = math.prod(b_shape[:-1]), b_shape[-1]
    if (a1 if transa else a0) != (b0 if transb else b1):
        raise RuntimeError(f"Invalid matrix dimensions for GEMM (A=({a0},{a1}), transa={transa}, B=({b0},{b1}), "
                           f"transb={transb})")
    rows = [int(b1)] if transb else [int(d) for d in b_shape[:-1]]
    return [*rows, int(a0 if transa else a1)]


def generic_gemm(A: Any, transa: bool, B: Any, transb: bool, D: Any, quantizer: Any, out_dtype: Any, bias: Any,
                 bias_type: Any, gelu: bool, gelu_in: Any, grad: bool, workspace: torch.Tensor,
                 workspace_size: int, accumulate: bool, use_split_accumulator: bool, comm_overlap: Any = None,
                 comm_type: Any = None, extra_output: Any = None, bulk_overlap: bool = False, alpha: float = 1.0,
                 beta: float | None = None) -> list[Any]:
    """TE's ``gemm`` (extensions/gemm.cpp): D = op(B) x op(A)^T in TE's column-major terms, with the bias / GeLU
    epilogues; returns ``[D, bias_grad, pre_gelu_out, extra_output]``."""
    a, a_shape = quantize.operand(A, rowwise=transa)
    b, b_shape = quantize.operand(B, rowwise=not transb)
    shape = gemm_output_shape(a_shape, transa, b_shape, transb)
    n = shape[-1]
    k = int(a_shape[-1]) if transa else math.prod(a_shape[:-1])
    low_precision = quantize.is_quantized(A) or quantize.is_quantized(B)
    dtype = _torch_dtype(out_dtype) if out_dtype is not None else (torch.bfloat16 if low_precision else a.dtype)
    fused_cast = (quantizer is not None and type(quantizer).__name__ == "Float8Quantizer" and low_precision
                  and D is None)
    if D is not None:
        out, written = D, quantize.quantized_buffers(D) if quantize.is_quantized(D) else [D]
    elif fused_cast:  # TE writes FP8 straight from the GEMM's epilogue (delayed scaling, per-tensor inputs)
        out = quantize._create(quantizer, shape, dtype, b.device)
        written = [*quantize.quantized_buffers(out), quantizer.amax]
    else:
        out = _empty(shape, dtype, b)
        written = [out]
    epilogue: list[torch.Tensor] = written[1:]
    bias_grad = pre_gelu = None
    if bias is not None and grad:
        bias_grad = _empty((int(b_shape[-1]),), dtype, b)
        epilogue.append(bias_grad)
    if gelu and not grad:
        pre_gelu = _empty(shape, dtype, b)
        epilogue.append(pre_gelu)
    elif gelu and gelu_in is not None:
        pre_gelu = gelu_in
    read_bias = bias if bias is not None and not grad else None

    def run_gemm(a_part: torch.Tensor, b_part: torch.Tensor, out_part: torch.Tensor) -> None:
        # a userbuffers chunk is a row block of a B read as stored (its buffer's shape is its logical shape)
        part_shape = shape if b_part is b else gemm_output_shape(a_shape, transa, tuple(b_part.shape), transb)
        rows = math.prod(part_shape[:-1])
        if accumulate:
            ops.gemm(True)(a_part, b_part, rows, n, k, read_bias, out_part, epilogue=epilogue)
        else:
            ops.gemm(False)(a_part, b_part, rows, n, k, read_bias, out=out_part, epilogue=epilogue)

    if comm_overlap is not None:
        if transb and not bulk_overlap:
            raise NotImplementedError("transformer_engine_torch.generic_gemm on a virtual GPU: split userbuffers "
                                      "overlap of a transposed B operand is not emulated")
        userbuffers.overlapped_gemm(comm_overlap, comm_type, bulk_overlap, run_gemm, a, b, written[0],
                                    extra_output)
    elif a.numel() and b.numel():
        run_gemm(a, b, written[0])
    elif written[0].numel() and not accumulate:
        ops.pointwise("zero")([], outputs=[written[0]])
    if quantizer is not None and D is None and not fused_cast:  # the unfused cast of TE's GEMM output
        out = quantize.quantize(out, quantizer)
    return [out, bias_grad, pre_gelu, extra_output]


def te_general_grouped_gemm(A: Sequence[Any], transa: bool, B: Sequence[Any], transb: bool, D: Any, D_type: Any,
                            m_splits: Sequence[int], bias: Sequence[torch.Tensor], bias_type: Any,
                            single_output: bool, pre_gelu_out: Sequence[torch.Tensor], grad: bool,
                            workspace: Any, workspace_size: int, accumulate: bool, use_split_accumulator: bool,
                            math_sm_count: int) -> Any:
    """TE's grouped GEMM (TEGroupedLinear, ``--moe-grouped-gemm``): one GEMM per group into the outputs the caller
    allocated (one tensor split by `m_splits` rows when `single_output`), as TE launches them; groups with no
    rows launch nothing. Returns `bias` (the bias gradients, written when `grad`)."""
    outs = list(torch.split(D[0], [int(m) for m in m_splits])) if single_output else list(D)
    for i, (a_in, b_in) in enumerate(zip(A, B, strict=True)):
        a, a_shape = quantize.operand(a_in, rowwise=transa)
        b, b_shape = quantize.operand(b_in, rowwise=not transb)
        if not a.numel() or not b.numel():
            continue
        shape = gemm_output_shape(a_shape, transa, b_shape, transb)
        m, n = math.prod(shape[:-1]), shape[-1]
        k = int(a_shape[-1]) if transa else math.prod(a_shape[:-1])
        target = outs[i]
        written = quantize.quantized_buffers(target) if quantize.is_quantized(target) else [target]
        epilogue = [*written[1:]] + ([bias[i]] if grad and bias[i].numel() else [])
        read_bias = bias[i] if bias[i].numel() and not grad else None
        if accumulate:
            ops.gemm(True)(a, b, m, n, k, read_bias, written[0], epilogue=epilogue)
        else:
            ops.gemm(False)(a, b, m, n, k, read_bias, out=written[0], epilogue=epilogue)
    return bias


# -- normalization ------------------------------------------------------------------------------------------------

def _norm_fwd(name: str, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, ln_out: Any,
              quantizer: Any, otype: Any, with_mu: bool) -> list[Any]:
    x = _plain(x, "input")
    mu = _empty((_rows(x),), torch.float32, x) if with_mu else None
    rsigma = _empty((_rows(x),), torch.float32, x)
    stats = [t for t in (mu, rsigma) if t is not None]
    inputs = [x, gamma] + ([beta] if beta is not None else [])
    if ln_out is not None:
        written = quantize.quantized_buffers(ln_out) if quantize.is_quantized(ln_out) else [ln_out]
        ops.pointwise(name, KernelClass.NORM)(inputs, outputs=[*written, *stats])
        return [ln_out, mu, rsigma]
    out = quantize.fused_output(name, inputs, tuple(x.shape), _torch_dtype(otype), quantizer, x, extra=stats,
                                kernel_class=KernelClass.NORM)
    return [out, mu, rsigma]


def layernorm_fwd(input: Any, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, ln_out: Any,
                  quantizer: Any, out_dtype: Any, sm_margin: int, zero_centered_gamma: bool) -> list[Any]:
    """``[ln_out, mu, rsigma]`` (mu, rsigma: fp32, one per row)."""
    return _norm_fwd("layernorm_fwd", input, weight, bias, ln_out, quantizer, out_dtype, with_mu=True)


def rmsnorm_fwd(input: Any, weight: torch.Tensor, eps: float, ln_out: Any, quantizer: Any, otype: Any,
                sm_margin: int, zero_centered_gamma: bool) -> list[Any]:
    """``[ln_out, None, rsigma]``."""
    return _norm_fwd("rmsnorm_fwd", input, weight, None, ln_out, quantizer, otype, with_mu=False)


def layernorm_bwd(dz: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                  sm_margin: int, zero_centered_gamma: bool) -> list[Any]:
    """``[dx, dgamma, dbeta]``."""
    grads = [_empty(x.shape, x.dtype, x), _empty(gamma.shape, gamma.dtype, gamma),
             _empty(gamma.shape, gamma.dtype, gamma)]
    ops.pointwise("layernorm_bwd", KernelClass.NORM)([dz, x, mu, rsigma, gamma], outputs=grads)
    return grads


def rmsnorm_bwd(dz: torch.Tensor, x: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor, sm_margin: int,
                zero_centered_gamma: bool) -> list[Any]:
    """``[dx, dgamma]``."""
    grads = [_empty(x.shape, x.dtype, x), _empty(gamma.shape, gamma.dtype, gamma)]
    ops.pointwise("rmsnorm_bwd", KernelClass.NORM)([dz, x, rsigma, gamma], outputs=grads)
    return grads


def rmsnorm_bwd_add(dz: torch.Tensor, x: torch.Tensor, add: torch.Tensor, rsigma: torch.Tensor,
                    gamma: torch.Tensor, sm_margin: int, zero_centered_gamma: bool) -> list[Any]:
    """``[dx + add, dgamma]``."""
    grads = [_empty(x.shape, x.dtype, x), _empty(gamma.shape, gamma.dtype, gamma)]
    ops.pointwise("rmsnorm_bwd_add", KernelClass.NORM)([dz, x, add, rsigma, gamma], outputs=grads)
    return grads


# -- activations ----------------------------------------------------------------------------------------------------

_GATED = frozenset({"glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"})
_ACTIVATIONS = ("glu", "gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu",
                "clamped_swiglu")


def _activation(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def forward(input: torch.Tensor, quantizer: Any, *args: Any) -> Any:
        shape = list(input.shape)
        if name in _GATED:
            shape[-1] //= 2
        return quantize.fused_output(name, [input], shape, input.dtype, quantizer, input)

    def backward(grad: torch.Tensor, input: torch.Tensor, quantizer: Any, *args: Any) -> Any:
        return quantize.fused_output(f"d{name}", [grad, input], tuple(input.shape), input.dtype, quantizer, input)

    forward.__name__, backward.__name__ = name, f"d{name}"
    return forward, backward


def _dbias_dact(name: str) -> Callable[..., Any]:
    def dbias_dact(grad_output: torch.Tensor, act_input: torch.Tensor, quantizer: Any) -> list[Any]:
        dbias = _empty((int(act_input.shape[-1]),), act_input.dtype, act_input)
        dx = quantize.fused_output(f"dbias_{name}", [grad_output, act_input], tuple(act_input.shape),
                                   act_input.dtype, quantizer, act_input, extra=[dbias])
        return [dbias, dx]

    dbias_dact.__name__ = f"dbias_{name}"
    return dbias_dact


def bgrad_quantize(input: torch.Tensor, quantizer: Any) -> list[Any]:
    """``[bias_grad, input quantized]`` (the bias gradient is the column sum, fused into the cast)."""
    dbias = _empty((int(input.shape[-1]),), input.dtype, input)
    out = quantize.fused_output("bgrad_quantize", [input], tuple(input.shape), input.dtype, quantizer, input,
                                extra=[dbias])
    return [dbias, out]


def split_quantize(tensor: torch.Tensor, split_sections: Sequence[int], quantizer_list: Sequence[Any],
                   disable_bulk_allocation: bool = False) -> list[Any]:
    """The first-dimension splits of `tensor`, each quantized by its quantizer (one cast kernel per split)."""
    parts = torch.split(tensor, [int(n) for n in split_sections])
    return [quantize.quantize(part, q) for part, q in zip(parts, quantizer_list, strict=True)]


# -- fused attention -----------------------------------------------------------------------------------------------

def get_fused_attn_backend(is_training: bool, q_dtype: Any, kv_dtype: Any, qkv_layout: Any, bias_type: Any,
                           attn_mask_type: Any, softmax_type: Any, p_dropout: float, num_attn_heads: int,
                           num_gqa_groups: int, max_seqlen_q: int, max_seqlen_kv: int, head_dim_qk: int,
                           head_dim_v: int, window_size_left: int, window_size_right: int, *args: Any) -> Any:
    """cuDNN's arbitrary-sequence-length F16 backend for BF16/FP16 BSHD/SBHD attention with no bias, causal or no
    mask and vanilla softmax (what the fake kernels emulate); no backend otherwise (TE then falls back)."""
    enums = _MODULE_ENUMS
    backend = enums["NVTE_Fused_Attn_Backend"]
    layout = enums["NVTE_QKV_Layout"](int(qkv_layout)).name
    mask = enums["NVTE_Mask_Type"](int(attn_mask_type)).name
    supported = (DType(int(q_dtype)) in (DType.kBFloat16, DType.kFloat16) and int(q_dtype) == int(kv_dtype)
                 and "THD" not in layout and "Paged" not in layout
                 and enums["NVTE_Bias_Type"](int(bias_type)).name == "NVTE_NO_BIAS"
                 and mask in ("NVTE_NO_MASK", "NVTE_CAUSAL_MASK", "NVTE_CAUSAL_BOTTOM_RIGHT_MASK")
                 and enums["NVTE_Softmax_Type"](int(softmax_type)).name == "NVTE_VANILLA_SOFTMAX"
                 and head_dim_qk <= 256 and head_dim_v <= 256 and head_dim_qk % 8 == 0 and head_dim_v % 8 == 0)
    return backend.NVTE_F16_arbitrary_seqlen if supported else backend.NVTE_No_Backend


def _bshd(t: torch.Tensor, layout: str, which: int) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim) of q/k/v in `layout` (``sbhd_*`` or ``bshd_*`` families; the 3/2 packings
    hold the heads' dim at the same place)."""
    part = layout.removeprefix("NVTE_").lower().split("_")[min(which, len(layout.split("_")) - 2)]
    s0, s1 = int(t.shape[0]), int(t.shape[1])
    heads, dim = int(t.shape[-2]), int(t.shape[-1])
    if part.startswith("sb"):
        return s1, s0, heads, dim
    return s0, s1, heads, dim


def _causal(mask: Any) -> bool:
    name = _MODULE_ENUMS["NVTE_Mask_Type"](int(mask)).name
    if name not in ("NVTE_NO_MASK", "NVTE_CAUSAL_MASK", "NVTE_CAUSAL_BOTTOM_RIGHT_MASK"):
        raise NotImplementedError(f"transformer_engine_torch fused attention on a virtual GPU: mask {name} is not "
                                  "emulated (no mask and causal masks are)")
    return name != "NVTE_NO_MASK"


def fused_attn_fwd(max_seqlen_q: int, max_seqlen_kv: int, is_training: bool, attn_scale: float, p_dropout: float,
                   set_zero: bool, qkv_layout: Any, bias_type: Any, attn_mask_type: Any, softmax_type: Any,
                   window_size: Sequence[int], bottom_right_diagonal: bool, cu_seqlens_q: Any, cu_seqlens_kv: Any,
                   Q: Any, K: Any, V: Any, fake_dtype: Any, *rest: Any) -> list[Any]:
    """``[O, softmax_stats (b, h, sq, 1) fp32, rng_state (2,) int64]``, as extensions/attention.cpp returns them."""
    q, k, v = _plain(Q, "Q"), _plain(K, "K"), _plain(V, "V")
    layout = _MODULE_ENUMS["NVTE_QKV_Layout"](int(qkv_layout)).name
    b, sq, h, d = _bshd(q, layout, 0)
    _b, skv, _hk, _d = _bshd(k, layout, 1)
    dv = int(v.shape[-1])
    out = _empty((*q.shape[:-1], dv), q.dtype, q)
    stats = _empty((b, h, sq, 1), torch.float32, q)
    rng_state = _empty((2,), torch.int64, q)
    ops.attention_forward()(q, k, v, b, h, sq, skv, d, dv, _causal(attn_mask_type), out=out, aux=[stats, rng_state])
    return [out, stats, rng_state]


def fused_attn_bwd(max_seqlen_q: int, max_seqlen_kv: int, attn_scale: float, p_dropout: float, set_zero: bool,
                   qkv_layout: Any, bias_type: Any, attn_mask_type: Any, softmax_type: Any,
                   window_size: Sequence[int], bottom_right_diagonal: bool, deterministic: bool, cu_seqlens_q: Any,
                   cu_seqlens_kv: Any, Q: Any, K: Any, V: Any, O: Any, dO: Any,  # noqa: E741 (TE's names)
                   fake_dtype: Any, dqkv_type: Any, aux_ctx_tensors: Sequence[torch.Tensor], *rest: Any) -> list[Any]:
    """``[dQ, dK, dV, dBias, dSoftmaxOffset]`` (the last two None: neither is emulated)."""
    q, k, v, o, do = (_plain(t, n) for t, n in ((Q, "Q"), (K, "K"), (V, "V"), (O, "O"), (dO, "dO")))
    layout = _MODULE_ENUMS["NVTE_QKV_Layout"](int(qkv_layout)).name
    b, sq, h, d = _bshd(q, layout, 0)
    _b, skv, _hk, _d = _bshd(k, layout, 1)
    grads = _attention_grads(layout, q, k, v)
    ops.attention_backward()(q, k, v, o, do, list(aux_ctx_tensors), b, h, sq, skv, d, int(v.shape[-1]),
                             _causal(attn_mask_type), grads=grads)
    return [*grads, None, None]  # no bias or softmax-offset gradient (neither is emulated)


def _attention_grads(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """dQ, dK, dV as TE's C++ allocates them: one tensor for a packed group (``3hd`` / ``h3d``: q, k and v;
    ``2hd`` / ``h2d``: k and v), whose slices are the gradients, else one tensor each."""
    packing = layout.removeprefix("NVTE_").lower().split("_")
    packed = next((part for part in packing if "3" in part or "2" in part), None)
    if packed is None:
        return [_empty(t.shape, t.dtype, t) for t in (q, k, v)]
    group = (q, k, v) if "3" in packed else (k, v)
    n = len(group)
    heads, dim = int(group[0].shape[-2]), int(group[0].shape[-1])
    if packed.endswith(("3hd", "2hd")):  # (..., n, h, d)
        whole = _empty((*group[0].shape[:-2], n, heads, dim), group[0].dtype, group[0])
        parts = [whole.select(-3, i) for i in range(n)]
    else:  # (..., h, n, d)
        whole = _empty((*group[0].shape[:-2], heads, n, dim), group[0].dtype, group[0])
        parts = [whole.select(-2, i) for i in range(n)]
    return parts if n == 3 else [_empty(q.shape, q.dtype, q), *parts]


# -- TE's fused softmax (UnfusedDotProductAttention, --attention-backend unfused) ---------------------------------

def _softmax_forward(name: str) -> Callable[..., Any]:
    def forward(input: torch.Tensor, *rest: Any) -> torch.Tensor:
        mask = [t for t in rest if isinstance(t, torch.Tensor)]
        out = _empty(input.shape, input.dtype, input)  # softmax_results, as TE's C++ allocates them
        ops.pointwise(name, KernelClass.NORM)([input, *mask], outputs=[out])
        return out

    forward.__name__ = name
    return forward


def _softmax_backward(name: str) -> Callable[..., Any]:
    def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, *rest: Any) -> torch.Tensor:
        ops.pointwise(name, KernelClass.NORM)([output_grads, softmax_results], outputs=[output_grads])
        return output_grads  # in place, as TE's C++ returns it

    backward.__name__ = name
    return backward


_SOFTMAXES = ("scaled_softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
              "scaled_aligned_causal_masked_softmax")


# -- RoPE, multi-tensor kernels, amax -------------------------------------------------------------------------------

def fused_rope_forward(input: torch.Tensor, freqs: torch.Tensor, start_positions: Any, qkv_format: Any,
                       interleaved: bool, cu_seqlens: Any, cp_size: int, cp_rank: int) -> torch.Tensor:
    out = _empty(input.shape, input.dtype, input)
    ops.pointwise("fused_rope_forward")([input, freqs], outputs=[out])
    return out


def fused_rope_backward(output_grads: torch.Tensor, freqs: torch.Tensor, start_positions: Any, qkv_format: Any,
                        interleaved: bool, cu_seqlens: Any, cp_size: int, cp_rank: int) -> torch.Tensor:
    out = _empty(output_grads.shape, output_grads.dtype, output_grads)
    ops.pointwise("fused_rope_backward")([output_grads, freqs], outputs=[out])
    return out


def _multi_tensor(name: str, kernel_class: KernelClass, writes: Callable[[list[list[torch.Tensor]]], list[int]],
                  result: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A multi-tensor-apply kernel ``fn(chunk_size, noop_flag, tensor_lists, *args)``: reads every list, writes the
    lists `writes` names (indices), in place."""
    def kernel(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], *args: Any) -> Any:
        inputs = [t for group in tensor_lists for t in group]
        outputs = [t for i in writes(tensor_lists) for t in tensor_lists[i]]
        extra = result(tensor_lists, *args) if result is not None else None
        if extra is not None:
            outputs = outputs + [t for t in extra if isinstance(t, torch.Tensor)]
        if inputs:
            ops.pointwise(name, kernel_class)(inputs, outputs=outputs)
        return extra

    kernel.__name__ = name
    return kernel


def _l2norm_result(tensor_lists: list[list[torch.Tensor]], *args: Any) -> tuple[Any, Any]:
    """``(norm (1,), per-tensor norms (n,) or (0,))`` in fp32, as ``multi_tensor_l2norm_cuda`` returns them (the
    last argument: per_tensor)."""
    first = tensor_lists[0][0] if tensor_lists and tensor_lists[0] else None
    if first is None:
        return (None, None)
    per_tensor = bool(args[-1]) if args else False
    norm = _empty((1,), torch.float32, first)
    per = _empty((len(tensor_lists[0]) if per_tensor else 0,), torch.float32, first)
    return (norm, per)


def compute_amax(tensor: torch.Tensor, amax: torch.Tensor) -> None:
    ops.pointwise("compute_amax", KernelClass.REDUCTION)([tensor], outputs=[amax])


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer: torch.Tensor,
                                                amax_histories: Sequence[torch.Tensor],
                                                scales: Sequence[torch.Tensor], amax_compute_algo: str,
                                                fp8_dtype: Any, margin: float) -> None:
    tensors = [*amax_histories, *scales]
    ops.pointwise("fused_amax_and_scale_update")([amax_reduction_buffer, *tensors], outputs=tensors)


def fp8_block_scaling_compute_partial_amax(master_weight: torch.Tensor, amax: torch.Tensor, h: int, w: int,
                                           start_offset: int, block_len: int) -> None:
    """The block amaxes of this rank's fragment of a block-scaled FP8 weight (``--fp8-param-gather``, TE's
    ``cast_master_weights_to_fp8``): one kernel reading the fp32 master fragment, writing ``amax`` in place."""
    ops.pointwise("fp8_block_scaling_compute_partial_amax", KernelClass.REDUCTION)([master_weight], outputs=[amax])


def fp8_block_scaling_partial_cast(master_weight: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, h: int,
                                   w: int, start_offset: int, block_len: int, out_dtype: Any) -> None:
    """The cast of this rank's master fragment into its slice of the FP8 weight, each block by its scale: one
    kernel, in place."""
    ops.pointwise("fp8_block_scaling_partial_cast")([master_weight, scale], outputs=[out])


def _supports_multicast(device_id: int = -1) -> bool:
    """CUDA multicast (NVLink SHARP) is on Hopper and later: the virtual GPU's compute capability decides."""
    return torch.cuda.get_device_capability()[0] >= 9


# -- the module -------------------------------------------------------------------------------------------------------

_MODULE_ENUMS: dict[str, type[enum.IntEnum]] = {
    name: enum.IntEnum(name, {value: i for i, value in enumerate(values)})  # type: ignore[misc]
    for name, values in _ENUMS.items()}

_REFUSED = {
    "userbuffers (TP-communication overlap, --tp-comm-overlap) move data outside torch.distributed; not emulated "
    "yet": ("bulk_overlap_ag_with_external_gemm", "init_nvshmem_backend", "create_nvshmem_tensor",
            "nvshmem_send_on_current_stream", "nvshmem_wait_on_current_stream", "nvshmem_finalize"),
    "THD (packed-sequence) attention is not emulated": (
        "thd_read_half_tensor", "thd_second_half_lse_correction", "thd_read_second_half_lse", "thd_out_correction",
        "thd_grad_correction", "thd_get_partitioned_indices", "convert_thd_to_bshd", "convert_bshd_to_thd",
        "fa_prepare_fwd", "fa_prepare_bwd", "copy_to_kv_cache"),
}


def _one_call(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` as one call into the compiled extension: virtual time charges its launches after the first at
    the driver's figure (`prism_plugin.device.clock.VirtualTime.native_call`)."""
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with native_call():
            return function(*args, **kwargs)

    return call


def build_module(module: Any) -> None:
    """Fill `module` (a new ``transformer_engine_torch`` module object) with the fake extension's names."""
    names: dict[str, Any] = {
        "DType": DType, "FP8TensorMeta": FP8TensorMeta, **_MODULE_ENUMS,
        "generic_gemm": generic_gemm, "te_general_grouped_gemm": te_general_grouped_gemm,
        "quantize": quantize.quantize, "dequantize": quantize.dequantize,
        "fp8_transpose": quantize.fp8_transpose,
        "swap_first_dims": quantize.swap_first_dims, "bgrad_quantize": bgrad_quantize, "split_quantize": split_quantize,
        "layernorm_fwd": layernorm_fwd, "rmsnorm_fwd": rmsnorm_fwd,
        "layernorm_bwd": layernorm_bwd, "rmsnorm_bwd": rmsnorm_bwd, "rmsnorm_bwd_add": rmsnorm_bwd_add,
        "get_fused_attn_backend": get_fused_attn_backend, "fused_attn_fwd": fused_attn_fwd,
        "fused_attn_bwd": fused_attn_bwd, "fused_rope_forward": fused_rope_forward,
        "fused_rope_backward": fused_rope_backward, "compute_amax": compute_amax,
        "fused_amax_and_scale_update_after_reduction": fused_amax_and_scale_update_after_reduction,
        "fp8_block_scaling_compute_partial_amax": fp8_block_scaling_compute_partial_amax,
        "fp8_block_scaling_partial_cast": fp8_block_scaling_partial_cast,
        "get_cudnn_version": lambda: CUDNN_VERSION, "get_cublasLt_version": lambda: CUBLASLT_VERSION,
        "get_num_cublas_streams": lambda: 4, "device_supports_multicast": _supports_multicast,
        "get_stream_priority_range": lambda device_id=-1: (0, -5), "ubuf_built_with_mpi": lambda: False,
        "multi_tensor_scale": _multi_tensor("multi_tensor_scale", KernelClass.OPTIMIZER, lambda lists: [1]),
        "multi_tensor_scale_tensor": _multi_tensor("multi_tensor_scale_tensor", KernelClass.OPTIMIZER,
                                                   lambda lists: [1]),
        "multi_tensor_l2norm": _multi_tensor("multi_tensor_l2norm", KernelClass.REDUCTION, lambda lists: [],
                                             _l2norm_result),
        "multi_tensor_unscale_l2norm": _multi_tensor("multi_tensor_unscale_l2norm", KernelClass.REDUCTION,
                                                     lambda lists: [], _l2norm_result),
        "multi_tensor_adam_capturable": _multi_tensor("multi_tensor_adam_capturable", KernelClass.OPTIMIZER,
                                                      lambda lists: list(range(1, len(lists)))),
        "multi_tensor_adam_capturable_master": _multi_tensor("multi_tensor_adam_capturable_master",
                                                             KernelClass.OPTIMIZER,
                                                             lambda lists: list(range(1, len(lists)))),
        "multi_tensor_adam": _multi_tensor("multi_tensor_adam", KernelClass.OPTIMIZER,
                                           lambda lists: list(range(1, len(lists)))),
        "multi_tensor_adam_param_remainder": _multi_tensor("multi_tensor_adam_param_remainder",
                                                           KernelClass.OPTIMIZER,
                                                           lambda lists: list(range(1, len(lists)))),
        "multi_tensor_sgd": _multi_tensor("multi_tensor_sgd", KernelClass.OPTIMIZER,
                                          lambda lists: list(range(1, len(lists)))),
        # FP8 primary weights' scaling (tensor/utils.py): lists [amaxes, scales, scale_invs] and [amaxes, scale_invs]
        "multi_tensor_compute_scale_and_scale_inv": _multi_tensor("multi_tensor_compute_scale_and_scale_inv",
                                                                  KernelClass.ELEMENTWISE, lambda lists: [1, 2]),
        "multi_tensor_compute_scale_inv_e8m0": _multi_tensor("multi_tensor_compute_scale_inv_e8m0",
                                                             KernelClass.ELEMENTWISE, lambda lists: [1]),
    }
    names.update(router.names())  # --moe-router-fusion
    for name in _ACTIVATIONS:
        forward, backward = _activation(name)
        names[name], names[f"d{name}"] = forward, backward
    for name in _SOFTMAXES:
        names[f"{name}_forward"] = _softmax_forward(f"{name}_forward")
        names[f"{name}_backward"] = _softmax_backward(f"{name}_backward")
    for name in ("dgelu", "dsilu", "drelu", "dqgelu", "dsrelu"):
        names[f"dbias_{name}"] = _dbias_dact(name)
    for why, refused in _REFUSED.items():
        for name in refused:
            names[name] = _unsupported(name, why)
    for name in ("CommOverlapCore", "CommOverlapBase", "CommOverlapP2PBase"):
        names[name] = userbuffers._UserbufferCore
    names.update(CommOverlap=userbuffers.CommOverlap, CommOverlapP2P=userbuffers.CommOverlapP2P,
                 CommOverlapHelper=userbuffers.CommOverlapHelper)
    for name, value in names.items():
        setattr(module, name, _one_call(value) if inspect.isfunction(value) else value)
