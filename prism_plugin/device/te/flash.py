"""flash-attn 2 on virtual GPUs: its own Python layer over a fake compiled extension (``--attention-backend flash``).

TransformerEngine's ``FlashAttention`` backend (and its context-parallel ring with flash) calls the flash-attn
package. As for TE (`prism_plugin.device.te`), the route is the package's own Python layer: flash-attn's release
`FLASH_ATTN_VERSION` (the newest TE 2.14 accepts) installs on a CPU host with its CUDA build skipped
(``FLASH_ATTENTION_SKIP_CUDA_BUILD``; ``scripts/setup_env.sh`` puts it in TE's private folder). Its kernels are
``torch.library`` custom operators (``flash_attn::_flash_attn_forward`` ...) with flash-attn's own fake
implementations, so on fake tensors the outputs (``out``, ``softmax_lse``, ``rng_state``; ``softmax_d`` and the
gradients written in place) are flash-attn's shapes and dtypes, saved for backward by flash-attn's autograd
functions, and the compiled extension is never called: ``flash_attn_2_cuda`` here is a module whose functions
refuse when called.

What this module adds is what the fake implementations leave out:

- **time**: each operator is one attention kernel of the kernel model (FLOPs of dense attention times the share of
  (query, key) pairs a causal mask keeps, bottom-right aligned as flash-attn's masks are since 2.1);
- **memory**: the buffers the C++ (``csrc/flash_attn/flash_api.cpp``) allocates and frees around its kernel, held
  while it runs: the forward's split-KV accumulators when its occupancy heuristic splits (no dropout, few query
  blocks), and the backward's fp32 ``dq_accum`` (``nsplits`` of them, zeroed, when deterministic) and, with
  grouped-query attention, ``dk_expanded`` / ``dv_expanded`` at the query's head count.

Refused when called (a `NotImplementedError` naming the argument): sliding windows, soft-capping, ALiBi, and the
variable-length (THD, packed sequences) operators, whose costs depend on the values of ``cu_seqlens``.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.kernels import CustomKernel, _unmasked_pairs, register_kernel
from prism_plugin.device.te import FLASH_ATTN_VERSION

__all__ = ["FLASH_ATTN_VERSION", "extension_module", "register_costs"]

_FP32 = 4


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _head_size_rounded(head_size: int) -> int:
    size = _round(head_size, 8)
    return _round(size, 32) if size <= 192 else 256


def _supported(named: dict[str, Any], op: str) -> None:
    for name, plain in (("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
                        ("alibi_slopes", None)):
        value = named.get(name, plain)
        if name == "window_size_right" and named.get("causal") and value == 0:
            continue
        if value != plain:
            raise NotImplementedError(f"flash-attn {op} on a virtual GPU: {name}={value!r} is not emulated (full and "
                                      "causal attention without ALiBi or soft-capping are)")


def _dims(named: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """(batch, heads, heads of k, seq q, seq k, head dim, value head dim) of q [b, sq, h, d], k/v [b, sk, hk, d]."""
    q, k, v = named["q"], named["k"], named["v"]
    b, sq, h, d = (int(x) for x in q.shape)
    return b, h, int(k.shape[2]), sq, int(k.shape[1]), d, int(v.shape[3])


def _causal_share(named: dict[str, Any], flops: int, sq: int, sk: int) -> int:
    return flops * _unmasked_pairs(sq, sk, "bottom_right") // (sq * sk) if named["causal"] else flops


def _forward_flops(named: dict[str, Any]) -> int:
    _supported(named, "forward")
    b, h, _hk, sq, sk, d, dv = _dims(named)
    return _causal_share(named, int(sdpa_flop_count((b, h, sq, d), (b, h, sk, d), (b, h, sk, dv))), sq, sk)


def _backward_flops(named: dict[str, Any]) -> int:
    _supported(named, "backward")
    b, h, _hk, sq, sk, d, dv = _dims(named)
    dense = sdpa_backward_flop_count((b, h, sq, dv), (b, h, sq, d), (b, h, sk, d), (b, h, sk, dv))
    return _causal_share(named, int(dense), sq, sk)


def _shape(named: dict[str, Any]) -> tuple[int, ...]:
    b, h, _hk, sq, sk, d, _dv = _dims(named)
    return (b, h, sq, sk, d, 1) if named["causal"] else (b, h, sq, sk, d)


def _sms(t: torch.Tensor) -> int:
    return int(torch.cuda.get_device_properties(t.device).multi_processor_count)


def num_splits(batch_heads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash-attn's ``num_splits_heuristic``: the fewest key splits within 85% of the best wave efficiency (1 when the
    query blocks almost fill the SMs).

    >>> num_splits(1024, 264, 16, 128), num_splits(8, 264, 16, 128), num_splits(100, 264, 4, 128)
    (1, 16, 2)
    """
    if batch_heads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or math.ceil(num_n_blocks / n) != math.ceil(num_n_blocks / (n - 1))

    efficiency = {n: (w := batch_heads_mblocks * n / num_sms) / math.ceil(w)
                  for n in range(1, max_splits + 1) if eligible(n)}
    best = max(efficiency.values(), default=0.0)
    return next((n for n, eff in efficiency.items() if eff >= 0.85 * best), 1)


def _forward_workspace(named: dict[str, Any]) -> list[int]:
    """The split-KV accumulators ``set_params_splitkv`` allocates (no dropout only): fp32 ``softmax_lse_accum``
    [splits, b, h, sq] and ``out_accum`` [splits, b, h, sq, dv rounded]."""
    if float(named["dropout_p"]) != 0.0:
        return []
    b, h, _hk, sq, sk, d, dv = _dims(named)
    head = max(_round(d, 8), _round(dv, 8))
    block_n = 256 if head <= 64 else 128 if head <= 128 else 64
    splits = num_splits(b * h * math.ceil(sq / 64), 2 * _sms(named["q"]), math.ceil(sk / block_n), 128)
    if splits <= 1:
        return []
    return [splits * b * h * sq * _FP32, splits * b * h * sq * _head_size_rounded(dv) * _FP32]


def _backward_workspace(named: dict[str, Any]) -> list[int]:
    """``dq_accum`` (fp32 [b, sq rounded to 128, h, d rounded]; ``nsplits`` = ceil(SMs / (b h)) of them when
    deterministic), then, for grouped-query attention, ``dk_expanded`` and ``dv_expanded`` [b, sk, h, d]."""
    b, h, hk, sq, sk, d, dv = _dims(named)
    splits = math.ceil(_sms(named["q"]) / (b * h)) if named["deterministic"] else 1
    held = [splits * b * _round(sq, 128) * h * _head_size_rounded(d) * _FP32]
    if hk != h:
        size = named["q"].element_size()
        held += [b * sk * h * d * size, b * sk * h * dv * size]
    return held


def _varlen(named: dict[str, Any]) -> int:
    raise NotImplementedError("flash-attn's variable-length (THD, packed-sequence) attention on a virtual GPU: its "
                              "cost depends on the values of cu_seqlens, which fake tensors do not hold; use the "
                              "sbhd/bshd formats")


def register_costs() -> None:
    """Cost flash-attn's operators as attention kernels, with their C++ workspaces (idempotent)."""
    register_kernel("flash_attn::_flash_attn_forward", CustomKernel(
        KernelClass.ATTENTION, flops=_forward_flops, shape=_shape, workspace=_forward_workspace))
    register_kernel("flash_attn::_flash_attn_backward", CustomKernel(
        KernelClass.ATTENTION, flops=_backward_flops, shape=_shape, workspace=_backward_workspace))
    for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"):
        register_kernel(f"flash_attn::{name}", CustomKernel(KernelClass.ATTENTION, flops=_varlen))


class _Extension(types.ModuleType):
    """``flash_attn_2_cuda`` on a virtual GPU: never called (flash-attn's fake implementations answer its operators
    on fake tensors); any function of it refuses when called."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"flash_attn_2_cuda.{name} on a virtual GPU: flash-attn's compiled kernels do "
                                      "not run here (its operators are answered by their fake implementations)")

        return refuse


def extension_module() -> types.ModuleType:
    """The fake ``flash_attn_2_cuda`` (put in ``sys.modules`` before flash-attn is imported)."""
    return _Extension("flash_attn_2_cuda", __doc__)
