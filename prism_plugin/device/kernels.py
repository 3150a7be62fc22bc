"""What each ATen op costs as a GPU kernel: class, FLOPs, bytes moved, dtype, shape (DESIGN.md section 11).

`kernel_cost(func, args, kwargs, out)` turns one op call seen by a dispatch mode (under ``FakeTensorMode``:
shapes, dtypes and devices only, never values) into a `prism_plugin.cost.kernels.KernelCost`, or None when the
op launches no kernel. `kernel_timer.KernelTimer` applies a kernel model to each (and to each fusion region's one
kernel, `fusion`) and keeps per-op tallies for the summary; the virtual-time clock (`clock.VirtualTime`) puts each
duration on the op's stream.

- FLOPs: ``torch.utils.flop_counter``'s registry (the formula `FlopCounterMode` applies, called the way it
  calls it), not a table of our own; an in-place variant (``addmm_``) uses its out-of-place formula, and the
  CPU flash-attention ops (``_scaled_dot_product_flash_attention_for_cpu[_backward]``) the flash formula. An op
  the registry has no formula for counts 0 FLOPs (its time is then its bytes'). Causal fused attention
  (``is_causal``, ``custom_mask_type``) counts the registry's FLOPs times the unmasked fraction of the score
  matrix (``S(S+1)/2`` of ``S^2`` pairs for equal lengths): fused kernels skip masked blocks, as torch's own
  flex-attention formula scales by its block sparsity; its shape then ends in a causal flag 1.
- Bytes: every tensor argument read, plus every output and every in-place (``Tensor(a!)``) argument written;
  an argument the op only writes (``copy_``/``fill_``/``zero_``/RNG fills' self, ``out=`` arguments) is not read.
  ``numel * element_size`` per tensor (a broadcast view counts as its full size).
- Class: by op name (`_GEMM`, `_NORM`, ... below); every other op with a tensor output is elementwise.
- No kernel (None): view and metadata ops (the schema's alias annotations: view, t, transpose, expand,
  detach, as_strided...), allocations without a fill (empty, empty_strided, new_empty...), ``record_stream``,
  ``set_``/``resize_``, ops of the ``prim``/``profiler`` and c10d namespaces (collectives are the comm cost
  model's), and ops that write no tensor on a device of `device_types` (host ops; default ``cuda``).

Limitations: an op's FLOPs are its flop formula's (an explicit ``attn_mask`` counts as full attention); a
composite op that reaches the dispatcher undecomposed (``linear``, ``matmul``) and has no formula counts 0 FLOPs;
a float32 GEMM runs at the TF32 rate when ``torch.backends.cuda.matmul.allow_tf32`` (convolutions:
``torch.backends.cudnn.allow_tf32``) is on when it is called; a ``copy_`` between host and device, either way,
is one ``host_copy`` kernel over the host link (PCIe), but a move by ``.to()`` / ``.cuda()`` / ``.cpu()`` is
made without one (`prism_plugin.device.calls`: a new tensor on the other side, no kernel). Non-goal: timing
(the cost layer's models).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from prism_plugin.cost.kernels import KernelClass, KernelCost

__all__ = ["CustomKernel", "kernel_cost", "kernel_workspaces", "register_kernel", "tensor_accesses", "uses_cublas"]

_aten = torch.ops.aten
_GEMM = frozenset({
    "mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "matmul", "linear", "_scaled_mm",
    "_int_mm", "convolution", "_convolution", "convolution_backward", "cudnn_convolution",
    "convolution_overrideable", "_slow_conv2d_forward",
})
_CUBLAS = frozenset({
    "mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "mv", "addmv", "addmv_", "dot",
    "vdot", "_scaled_mm", "_int_mm", "_addmm_activation",
})
"""ATen ops whose CUDA kernels run through torch's cuBLAS / cuBLASLt handle (``at::cuda::blas``): the first on a
handle and stream allocates that pair's workspace (`prism_plugin.cost.gpu.cublas_workspace_bytes`)."""
_ATTENTION = frozenset({
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "scaled_dot_product_attention",
})  # and every `_scaled_dot_product_*`
_NORM = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "layer_norm", "rms_norm", "_fused_rms_norm",
    "_fused_rms_norm_backward", "native_group_norm", "native_group_norm_backward", "native_batch_norm",
    "native_batch_norm_backward", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "batch_norm_backward", "_softmax", "_softmax_backward_data",
    "_log_softmax", "_log_softmax_backward_data", "softmax", "log_softmax", "_safe_softmax",
})
_REDUCTION = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "var_mean",
    "std_mean", "prod", "any", "all", "argmax", "argmin", "logsumexp", "aminmax", "count_nonzero", "nansum",
    "cumsum", "cumprod", "nll_loss_forward", "nll_loss2d_forward",
})
_MEMCPY = frozenset({
    "copy_", "copy", "_to_copy", "_copy_from", "_copy_from_and_resize", "cat", "stack", "clone", "fill_", "fill",
    "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full",
    "scalar_tensor", "lift_fresh_copy", "constant_pad_nd", "contiguous",
})
_OTHER = frozenset({
    "embedding", "embedding_dense_backward", "index", "index_put", "index_put_", "_index_put_impl_",
    "index_select", "index_add", "index_add_", "index_copy", "index_copy_", "gather", "scatter", "scatter_",
    "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "sort", "topk", "nonzero", "unique",
    "_unique2", "unique_consecutive", "unique_dim", "searchsorted", "bincount", "histc", "masked_select",
    "masked_scatter", "masked_scatter_", "multinomial", "randperm", "_embedding_bag", "_embedding_bag_backward",
})
_NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_",
    "resize_as_", "set_", "record_stream", "lift_fresh", "_unsafe_view", "_reshape_alias", "alias", "detach",
    "detach_", "_assert_async", "_assert_scalar", "_make_dep_token", "_functional_sym_constrain_range",
})
_NO_KERNEL_NAMESPACES = frozenset({"prim", "profiler", "c10d", "_c10d_functional", "_c10d_functional_autograd",
                                   "_dtensor"})
_WRITE_ONLY_SELF = frozenset({
    "copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_",
    "cauchy_", "log_normal_",
})
_FLOP_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": _aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _aten._scaled_dot_product_flash_attention_backward,
}


def _classify(name: str) -> KernelClass:
    if name in _GEMM:
        return KernelClass.GEMM
    if name in _ATTENTION or name.startswith("_scaled_dot_product_"):
        return KernelClass.ATTENTION
    if name in _NORM:
        return KernelClass.NORM
    if name.startswith(("_foreach_", "_fused_adam", "_fused_sgd", "_fused_adagrad")):
        return KernelClass.OPTIMIZER
    if name in _MEMCPY:
        return KernelClass.MEMCPY
    if name in _REDUCTION:
        return KernelClass.REDUCTION
    if name in _OTHER:
        return KernelClass.OTHER
    return KernelClass.ELEMENTWISE


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What one overload's schema says, computed once per overload."""

    op: str
    name: str
    kernel_class: KernelClass | None
    """None: the op launches no kernel."""
    flop_formula: Callable[..., int] | None
    positional: tuple[str, ...]
    """Schema argument names in order (to name the positional arguments)."""
    mutated: frozenset[str]
    """Arguments the op writes in place (``Tensor(a!)``)."""
    write_only: frozenset[str]
    """Mutated arguments it does not read: ``out=`` arguments, the self of copy_/fill_/zero_/RNG fills."""
    custom: CustomKernel | None = None
    """How a registered custom operator is costed (`register_kernel`); None for ATen's."""
    cublas: bool = False
    """An ATen op run by torch's cuBLAS handle (`_CUBLAS`)."""


_INFO: dict[Any, _OpInfo] = {}


@dataclass(frozen=True, slots=True)
class CustomKernel:
    """How a custom operator (``torch.library``: a fake kernel of an extension, e.g. TransformerEngine's) is costed:
    its class, and optionally its FLOPs and table shape from its arguments (by schema name), and the workspaces its
    C++ allocates and frees around the kernel (bytes each, held while it runs: they count in the peak)."""

    kernel_class: KernelClass
    flops: Callable[[dict[str, Any]], int] | None = None
    shape: Callable[[dict[str, Any]], tuple[int, ...]] | None = None
    workspace: Callable[[dict[str, Any]], list[int]] | None = None


_CUSTOM: dict[str, CustomKernel] = {}


def register_kernel(qualified_name: str, kernel: CustomKernel) -> None:
    """Cost custom operator `qualified_name` (``"namespace::name"``) as `kernel` (its bytes as any op's: tensors read
    plus tensors written)."""
    _CUSTOM[qualified_name] = kernel


def kernel_workspaces(func: Any, args: tuple, kwargs: dict | None) -> list[int]:
    """The bytes of each workspace custom operator `func` holds while its kernel runs (none for other ops)."""
    if not isinstance(func, torch._ops.OpOverload):
        return []
    custom = _op_info(func).custom
    if custom is None or custom.workspace is None:
        return []
    named = dict(zip(_op_info(func).positional, args, strict=False))
    named.update(kwargs or {})
    return [n for n in custom.workspace(named) if n > 0]


def _op_info(func: Any) -> _OpInfo:
    info = _INFO.get(func)
    if info is not None:
        return info
    schema = func._schema
    namespace, _, name = schema.name.partition("::")
    arguments = tuple(schema.arguments)
    mutated = frozenset(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)
    write_only = frozenset(a.name for a in arguments if a.name in mutated and (
        a.kwarg_only or (a.name == "self" and name in _WRITE_ONLY_SELF)))
    no_kernel = namespace in _NO_KERNEL_NAMESPACES or name in _NO_KERNEL or func.is_view
    packet = func._overloadpacket
    formula = flop_registry.get(packet)
    if formula is None and name in _FLOP_ALIASES:
        formula = flop_registry.get(_FLOP_ALIASES[name])
    if formula is None and name.endswith("_") and hasattr(_aten, name[:-1]):
        formula = flop_registry.get(getattr(_aten, name[:-1]))
    custom = _CUSTOM.get(schema.name)
    kernel_class = custom.kernel_class if custom is not None else _classify(name)
    info = _OpInfo(op=str(func), name=name, kernel_class=None if no_kernel else kernel_class,
                   flop_formula=formula, positional=tuple(a.name for a in arguments),
                   mutated=mutated, write_only=write_only, custom=custom,
                   cublas=namespace == "aten" and name in _CUBLAS)
    _INFO[func] = info
    return info


def uses_cublas(func: Any) -> bool:
    """Whether `func` (an ATen overload) runs through torch's cuBLAS handle, and so needs its workspace."""
    return isinstance(func, torch._ops.OpOverload) and _op_info(func).cublas


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an ATen argument or result: a tensor, or (nested) lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _shapes(value: Any) -> Any:
    """`value` with each tensor replaced by its shape (what flop_counter's `get_shape` does through a pytree)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, list | tuple):
        return type(value)(_shapes(item) for item in value) if value else value
    return value


def _flops(info: _OpInfo, args: tuple, kwargs: dict, out: Any) -> int:
    """The registry formula called as FlopCounterMode calls it; a shape formula (wrapped by flop_counter's
    `shape_wrapper`) directly on shapes, which skips the pytree walk of every call. A formula that fails is
    reported with the op, not skipped."""
    formula = info.flop_formula
    assert formula is not None
    shape_formula = getattr(formula, "__wrapped__", None)
    if info.name in ("_flash_attention_forward", "_flash_attention_backward"):
        dense = _dense_flash_flops(info.name, args)
        if dense is not None:
            return dense
    try:
        if shape_formula is None:  # registered with get_raw=True: it takes the tensors
            return int(formula(*args, **kwargs, out_val=out))
        return int(shape_formula(*_shapes(args), out_shape=_shapes(out),
                                 **{k: _shapes(v) for k, v in kwargs.items()}))
    except Exception as exc:
        raise RuntimeError(f"prism kernel cost: torch.utils.flop_counter's formula for {info.op} failed on "
                           f"argument shapes {_shapes(args)!r}: {exc}") from exc


def _dense_flash_flops(name: str, args: tuple) -> int | None:
    """flash-attention's own ops on dense (B, S, H, D) inputs (no cumulative sequence lengths, or empty ones): the
    SDPA formulas on the (B, H, S, D) shapes. torch's formulas for these ops are written for their nested-tensor
    calls and read a dense input's sequence as its heads (and count an empty ``cum_seq_q`` as no sequences)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    first, cum = (1, 6) if name.endswith("backward") else (0, 3)
    tensors = args[first:first + 3]
    seqlens = args[cum] if len(args) > cum else None
    if len(tensors) < 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors) or (
            isinstance(seqlens, torch.Tensor) and seqlens.numel()):
        return None
    q, k, v = (tuple(int(d) for d in t.transpose(1, 2).shape) for t in tensors)
    if first:
        return int(sdpa_backward_flop_count(q, q, k, v))  # grad_out has the query's shape
    return int(sdpa_flop_count(q, k, v))


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_cost(func: Any, args: tuple, kwargs: dict | None, out: Any,
                *, device_types: Collection[str] = ("cuda",)) -> KernelCost | None:
    """The `KernelCost` of ATen overload `func` called as ``func(*args, **kwargs)`` returning `out`, or None
    when it launches no kernel (see the module docstring). `device_types`: the device types whose tensors are
    on the GPU (``("cuda",)`` under virtual GPUs; ``("cpu",)`` to cost CPU fakes or a CPU recording).

    Example (cpu fakes): ``kernel_cost(aten.mm.default, (a, b), {}, a @ b, device_types=("cpu",))`` with bf16
    a: (64, 32), b: (32, 16) -> gemm, flops 2*64*16*32 = 65536, bytes (64*32 + 32*16 + 64*16) * 2 = 7168,
    shape (64, 16, 32).
    """
    if not isinstance(func, torch._ops.OpOverload):  # a higher-order operator: its body's ops are costed
        return None
    info = _op_info(func)
    if info.kernel_class is None:
        return None
    if info.name == "copy_":
        host_copy = _host_copy(info.op, args, device_types)
        if host_copy is not None:
            return host_copy
    kwargs = kwargs or {}
    named = dict(zip(info.positional, args, strict=False))
    named.update(kwargs)
    read_bytes = write_bytes = 0
    written_ids: set[int] = set()
    device_write = False
    largest: torch.Tensor | None = None
    first_input: torch.Tensor | None = None
    written: torch.Tensor | None = None
    for arg_name, value in named.items():
        for t in _tensors(value):
            size = _nbytes(t)
            if arg_name not in info.write_only and (first_input is None or (
                    t.is_floating_point() and not first_input.is_floating_point())):
                first_input = t
            if largest is None or t.numel() > largest.numel():
                largest = t
            if arg_name not in info.write_only:
                read_bytes += size
            if arg_name in info.mutated:
                write_bytes += size
                written_ids.add(id(t))
                written = t
                device_write = device_write or t.device.type in device_types
    outputs = _tensors(out)
    for t in outputs:
        if id(t) in written_ids:
            continue
        write_bytes += _nbytes(t)
        device_write = device_write or t.device.type in device_types
        if largest is None or t.numel() > largest.numel():
            largest = t
    if not device_write:
        return None
    kernel_class = info.kernel_class
    custom = info.custom
    if custom is not None:
        flops = custom.flops(named) if custom.flops is not None else 0
    else:
        flops = _flops(info, args, kwargs, out) if info.flop_formula is not None else 0
    source = first_input if first_input is not None else (outputs[0] if outputs else written)
    assert source is not None  # a device tensor was written
    dtype = _dtype_name(source.dtype)
    if kernel_class is KernelClass.GEMM and source.dtype == torch.float32 and _tf32(info.name):
        dtype = "tf32"
    if custom is not None and custom.shape is not None:
        shape = custom.shape(named)
    elif kernel_class is KernelClass.GEMM:
        shape = _gemm_shape(info.name, args, outputs)
    elif kernel_class is KernelClass.ATTENTION:
        shape = _attention_shape(info.name, args)
        causal = _causal_alignment(info.name, named)
        if causal and len(shape) == 5:
            flops = flops * _unmasked_pairs(shape[2], shape[3], causal) // (shape[2] * shape[3])
            shape = (*shape, 1)
    elif info.name.startswith("_foreach_"):
        first = _tensors(args[0]) if args else []
        shape = (len(first), sum(int(t.numel()) for t in first))
    else:
        shape = tuple(int(d) for d in largest.shape) if largest is not None else ()
    return KernelCost(op=info.op, kernel_class=kernel_class, flops=flops, bytes=read_bytes + write_bytes,
                      dtype=dtype, shape=shape)


def _host_copy(op: str, args: tuple, device_types: Collection[str]) -> KernelCost | None:
    """``dst.copy_(src)`` between host memory and the GPU: one kernel of class ``host_copy`` moving ``dst``'s bytes
    once over the host link, whichever side is the host (a copy to the host writes no device tensor, yet the GPU's
    copy engine runs it on the stream). None: both on the GPU, or both on the host."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return None
    dst, src = args[0], args[1]
    if (dst.device.type in device_types) == (src.device.type in device_types):
        return None
    return KernelCost(op=op, kernel_class=KernelClass.HOST_COPY, flops=0, bytes=_nbytes(dst),
                      dtype=_dtype_name(dst.dtype), shape=tuple(int(d) for d in dst.shape))


def _tf32(name: str) -> bool:
    if "conv" in name:
        return bool(torch.backends.cudnn.allow_tf32)
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _gemm_shape(name: str, args: tuple, outputs: list[torch.Tensor]) -> tuple[int, ...]:
    """``(m, n, k)``, or ``(b, m, n, k)`` for a batched GEMM; a convolution's implicit GEMM ``(N * output pixels,
    output channels, weight elements per output channel)``; () when the operands are not matrices."""
    if "conv" in name:
        x = args[0] if name == "convolution_backward" else (outputs[0] if outputs else None)
        weight = args[2] if name == "convolution_backward" else args[1]
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() < 3:
            return ()
        n = int(x.shape[1])
        return (int(x.shape[0]) * math.prod(int(d) for d in x.shape[2:]), n, int(weight.numel()) // max(n, 1))
    if name == "linear":  # input (..., k), weight (n, k)
        x, weight = args[0], args[1]
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return ()
        return (int(x.numel()) // max(int(x.shape[-1]), 1), int(weight.shape[0]), int(x.shape[-1]))
    a, b = (args[1], args[2]) if name.startswith(("addmm", "baddbmm", "addbmm")) else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() not in (2, 3):
        return ()
    m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    return (m, n, k) if a.dim() == 2 else (int(a.shape[0]), m, n, k)


def _causal_alignment(name: str, named: dict[str, Any]) -> str:
    """'' for full attention; 'top_left' (torch's ``is_causal``: query i sees keys j <= i) or 'bottom_right'
    (flash-attention's own ops, ``custom_mask_type=2``: the mask's diagonal ends at the last key)."""
    mask_type = named.get("custom_mask_type")
    if mask_type is not None:
        return {1: "top_left", 2: "bottom_right"}.get(int(mask_type), "")
    if not named.get("is_causal"):
        return ""
    return "bottom_right" if name.startswith("_flash_attention") else "top_left"


def _unmasked_pairs(seq_q: int, seq_kv: int, alignment: str) -> int:
    """(query, key) pairs a causal mask keeps: the work a fused kernel does (it skips masked blocks). Row i keeps
    ``clamp(i + 1 + offset, 0, seq_kv)`` keys, offset 0 top-left, ``seq_kv - seq_q`` bottom-right.

    >>> _unmasked_pairs(4, 4, "top_left"), _unmasked_pairs(2, 4, "top_left"), _unmasked_pairs(2, 4, "bottom_right")
    (10, 3, 7)
    >>> _unmasked_pairs(4, 2, "top_left"), _unmasked_pairs(4, 2, "bottom_right")
    (7, 3)
    """
    offset = seq_kv - seq_q if alignment == "bottom_right" else 0
    lo = min(seq_q, max(0, -offset))  # rows before lo keep no key
    full = max(lo, min(seq_q, seq_kv - offset))  # rows from `full` on keep all seq_kv keys
    ramp = (lo + 1 + offset + full + offset) * (full - lo) // 2  # rows lo..full-1: an arithmetic series
    return ramp + (seq_q - full) * seq_kv


def _attention_shape(name: str, args: tuple) -> tuple[int, ...]:
    """``(batch, heads, seq_q, seq_kv, head_dim)``: sdpa ops take (B, H, S, D), flash/efficient (B, S, H, D)."""
    first = 1 if "backward" in name else 0
    q, k = (args[first], args[first + 1]) if len(args) > first + 1 else (None, None)
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return ()
    if q.dim() != 4 or k.dim() != 4:
        return tuple(int(d) for d in q.shape)
    if name.startswith("_scaled_dot_product_") or name == "scaled_dot_product_attention":
        (batch, heads, seq_q, dim), seq_kv = q.shape, k.shape[2]
    else:
        (batch, seq_q, heads, dim), seq_kv = q.shape, k.shape[1]
    return (int(batch), int(heads), int(seq_q), int(seq_kv), int(dim))


def tensor_accesses(func: Any, args: tuple, kwargs: dict | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the tensor arguments ATen overload `func` reads, those it writes in place), by its schema as
    `kernel_cost` counts them: an argument it only writes (``out=``, the self of ``copy_``/``fill_``) is not read;
    its returned new tensors are neither."""
    if not isinstance(func, torch._ops.OpOverload):
        return [], []
    info = _op_info(func)
    named = dict(zip(info.positional, args, strict=False))
    named.update(kwargs or {})
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    for arg_name, value in named.items():
        tensors = _tensors(value)
        if arg_name not in info.write_only:
            reads.extend(tensors)
        if arg_name in info.mutated:
            writes.extend(tensors)
    return reads, writes
