"""Megatron's Triton kernels on virtual GPUs: each launch is one fused kernel of the same reads and writes.

A Triton kernel writes into the tensors it is given (``kernel[grid](*args)``) and returns nothing; on a virtual
GPU (fake tensors on a CPU host) there is no driver to compile or launch it (triton asserts ``libcuda.so cannot
found``). `install` replaces each kernel that a training job reaches with a launcher whose launch runs eager math
with the kernel's reads and writes, as a fusion region (`prism_plugin.device.fusion`, through
`fused_kernels.extension_kernel`): one kernel of the bytes it reads and writes, its intermediates never
allocated, invisible to autograd. The tensors it writes are the caller's, so memory is the caller's allocations.

The kernels (megatron-core 0.19, ``megatron/core/fusions/fused_mla_yarn_rope_apply.py``: multi-latent
attention's rotary embedding with ``--multi-latent-attention`` and rope fusion, Megatron's default):

- ``rotary_fwd_q_kernel`` / ``rotary_bwd_q_kernel``: in place on the rotary part (the last ``emb_dim``) of each
  query head (or its gradient), reading the cos and sin rows of its positions;
- ``rotary_fwd_kv_kernel``: the key (its ``k_dim`` part, then the rotated shared positional key, broadcast over
  heads) and the value, split out of the compressed ``kv`` into the two outputs the caller allocated;
- ``rotary_bwd_kv_kernel``: the gradient of ``kv`` (key and value parts) and of the positional key (the rotary
  part's gradient summed over heads).

The values are not YaRN's (fake tensors hold none); shapes, dtypes, bytes and the tensors written are the
kernels'.

TransformerEngine's MoE permutation kernels (``--moe-permute-fusion``: TE 2.14's
``transformer_engine/pytorch/triton/permutation.py``, whose wrappers allocate every output and then launch) are
given by which of their arguments they read and which they write (`TE_PERMUTATION`): the launch reads each input
(a reduction over it, an intermediate) and writes each output in place, one kernel of those bytes. The row map's
three passes, the permute and unpermute (forward, and backward with merging probabilities) and the chunk sort.

Limitations: the packed (``thd``) format reads the first ``total`` cos / sin rows, where the kernel reads each
sequence's own positions (the same bytes); a permutation kernel is charged every byte of its inputs, where the
kernel reads only the routed rows of some (the same order of bytes: each token is read by its top-k experts);
other Triton kernels in megatron-core (the paged MoE stash, the SSM ops, batch-invariant kernels, inference) and
TE's fused router (``--moe-router-fusion``, a compiled-extension kernel) are not covered.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from prism_plugin.adapters.megatron.fused_kernels import extension_kernel
from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.undo import Patches

__all__ = ["KERNELS", "TE_PERMUTATION", "Launcher", "install"]

MLA_ROPE = "megatron.core.fusions.fused_mla_yarn_rope_apply"


class Launcher:
    """A Triton kernel's stand-in: ``launcher[grid](*args)`` runs `fn` on the launch's arguments as one kernel."""

    def __init__(self, fn: Callable[..., None], name: str) -> None:
        self.name = name
        self._kernel = extension_kernel(fn, name, KernelClass.ELEMENTWISE)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> None:
        self._kernel(*args)

    def __repr__(self) -> str:
        return f"<prism Triton stand-in {self.name}>"


def _rows(total: int, batch_size: int | None) -> int:
    """Positions of a launch: sequence length (sbhd: rows of batch_size tokens), or every token (thd)."""
    return total // batch_size if batch_size else total


def _rotate(x: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor, batch_size: int | None) -> torch.Tensor:
    """Rotary embedding of `x` ([tokens, ..., emb]) at its positions: reads the cos and sin rows it needs."""
    emb, total = x.shape[-1], x.shape[0]
    rows = _rows(total, batch_size)
    cos = table_cos.reshape(-1, emb)[:rows]
    sin = table_sin.reshape(-1, emb)[:rows]
    if batch_size:  # sbhd: token t is position t // batch_size
        grouped = x.unflatten(0, (rows, batch_size))
        view = (rows,) + (1,) * (grouped.dim() - 2) + (emb,)
        return (grouped * cos.view(view) + grouped.flip(-1) * sin.view(view)).flatten(0, 1)
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (emb,)
    return x * cos.view(view) + x.flip(-1) * sin.view(view)


def _q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_head_dim: int, emb_dim: int, head_num: int,
       batch_size: int | None, *_: Any) -> None:
    part = q[..., qk_head_dim:qk_head_dim + emb_dim]
    part.copy_(_rotate(part, cos, sin, batch_size))


def _kv_forward(kv: torch.Tensor, k_pos_emb: torch.Tensor, o_key: torch.Tensor, o_value: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, emb_dim: int, k_dim: int, v_dim: int, head_num: int,
                batch_size: int | None, *_: Any) -> None:
    o_key[..., :k_dim].copy_(kv[..., :k_dim])
    rotated = _rotate(k_pos_emb.reshape(kv.shape[0], emb_dim), cos, sin, batch_size)
    o_key[..., k_dim:].copy_(rotated.unsqueeze(1).expand(-1, o_key.shape[1], -1))
    o_value.copy_(kv[..., k_dim:k_dim + v_dim])


def _kv_backward(dk: torch.Tensor, dv: torch.Tensor, dkv: torch.Tensor, demb: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, emb_dim: int, k_dim: int, v_dim: int, head_num: int, batch_size: int | None,
                 *_: Any) -> None:
    dkv[..., :k_dim].copy_(dk[..., :k_dim])
    dkv[..., k_dim:].copy_(dv)
    grad = _rotate(dk[..., k_dim:], cos, sin, batch_size).sum(1)
    demb.view(dk.shape[0], emb_dim).copy_(grad)


def _reads_writes(reads: tuple[int, ...], writes: tuple[int, ...]) -> Callable[..., None]:
    """A kernel that reads the tensors at positions `reads` and writes those at `writes` (None arguments: absent)."""

    def kernel(*args: Any) -> None:
        for i in reads:
            if isinstance(args[i], torch.Tensor):
                args[i].sum()  # read (an intermediate: never allocated in the region)
        for i in writes:
            if isinstance(args[i], torch.Tensor):
                args[i].zero_()  # written in place (the caller allocated it)

    return kernel


TE_PERMUTATION_MODULE = "transformer_engine.pytorch.triton.permutation"
TE_PERMUTATION: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "_row_id_map_pass_1_kernel": ((0,), (6, 7)),  # routing_map -> row_id_map, workspace
    "_row_id_map_pass_2_kernel": ((0, 1), (0,)),  # row_id_map, workspace -> row_id_map
    "_row_id_map_pass_3_kernel": ((0,), (0,)),
    "_permute_kernel": ((0, 1, 2, 3, 5), (4, 6, 7)),  # inp, map, probs, scale, pad -> scale, output, probs
    "_unpermute_kernel": ((0, 1, 2, 3, 4), (5, 6)),  # inp, map, merging, probs, pad -> output, probs
    "_unpermute_bwd_with_merging_probs_kernel": ((0, 1, 2, 3, 4), (17, 18)),  # -> act_grad, merging_probs_grad
    "_make_chunk_sort_map_kernel": ((0, 1), (2,)),  # split_sizes, sorted_indices -> row_id_map
    "_sort_chunks_by_map_kernel": ((0, 1, 2), (3, 11)),  # inp, map, probs -> output, permuted_probs
}
"""TE's permutation kernels: (positions read, positions written) of each launch's arguments."""

KERNELS: dict[str, Callable[..., None]] = {
    "rotary_fwd_q_kernel": _q, "rotary_bwd_q_kernel": _q,
    "rotary_fwd_kv_kernel": _kv_forward, "rotary_bwd_kv_kernel": _kv_backward,
}
"""The kernels of `MLA_ROPE` and the eager math of each (its arguments positional, as the module launches it)."""


def install(patches: Patches) -> int:
    """Replace the kernels of `KERNELS` and, where TransformerEngine is importable (virtual GPUs run TE's own
    layer), of `TE_PERMUTATION`, in the modules that launch them, undone by `patches`; returns how many."""
    count = _replace(patches, MLA_ROPE, KERNELS)
    if importlib.util.find_spec("transformer_engine") is not None:
        count += _replace(patches, TE_PERMUTATION_MODULE,
                          {name: _reads_writes(*spec) for name, spec in TE_PERMUTATION.items()})
    return count


def _replace(patches: Patches, module_name: str, kernels: dict[str, Callable[..., None]]) -> int:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # not in this megatron-core or TE release
        return 0
    count = 0
    for name, fn in kernels.items():
        if hasattr(module, name) and not isinstance(getattr(module, name), Launcher):
            patches.setattr(module, name, Launcher(fn, f"triton::{name.strip('_')}"))
            count += 1
    return count
