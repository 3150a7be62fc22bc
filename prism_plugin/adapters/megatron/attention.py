"""A fused-attention stand-in for Megatron's local ``DotProductAttention`` on virtual GPUs (``--prism-attention
flash``, or ``PRISM_ATTENTION=flash`` in the environment of ``prism emulate``); the default ``local`` runs the
program's own kernels.

Megatron's local spec (``--transformer-impl local``, the only spec on a host without TransformerEngine) computes
core attention as baddbmm + masked softmax + bmm: it materialises the s x s scores (and a global s x s buffer) and
keeps the probabilities for backward, which is why it needs ``--recompute-granularity selective`` at scale. The
published NeMo runs use TransformerEngine's fused (flash) attention. With the stand-in, the local spec's module
keeps its inputs and output (``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key/value, ``[sq, b, np * hn]`` out)
and computes:

- **context parallelism 1**: ``torch.nn.functional.scaled_dot_product_attention`` on ``[b, heads, s, hn]`` views
  (``is_causal`` for a causal layer, ``scale`` = the module's softmax scale, ``dropout_p`` = its attention dropout
  while training, ``enable_gqa``: key/value groups are never repeated), which a virtual GPU runs as torch does on
  an H100: ``aten._scaled_dot_product_flash_attention`` (output and fp32 log-sum-exp saved, no s x s buffer);
- **context parallelism > 1**, TransformerEngine's ``cp_comm_type all_gather`` (``AttnFuncWithCPAndKVAllGather``):
  the sequence arrives in Megatron's load-balanced layout (rank r holds chunks r and 2cp-1-r of 2cp); forward
  all-gathers K and V over Megatron's CP group (``torch.distributed.all_gather_into_tensor``, so prism times
  them), reorders the chunks into sequence order (``index_select``), and runs one flash kernel per local query
  chunk c against keys ``[0, (c+1) L)`` (``aten._flash_attention_forward``, causal aligned bottom-right, as
  flash-attention does); backward all-gathers K and V again (TE saves only the local ones), runs the flash
  backward per chunk, accumulates dK/dV in sequence order, reorders them and reduce-scatters them over the CP
  group (``reduce_scatter_tensor``). ``--cp-comm-type p2p`` (Megatron's default: TE's ring) runs this all-gather
  form too, and the summary says so (``cp_comm_type`` ran vs requested).

Refused loudly (`AttentionNotSupported`): packed sequences, attention bias, window attention, off-by-one /
learnable softmax, padding / arbitrary masks, inputs flash attention does not take (not fp16/bf16, head dim not
a multiple of 8 or over 256, flash disabled), ``a2a`` CP, and the stand-in outside virtual-GPU mode. A causal
layer ignores the dataloader's mask tensor, as ``TEDotProductAttention`` does (its values are the causal mask).

Limitations: no TE-style overlap of the K/V all-gather with the attention kernels (they run one after the other
on the compute stream); the flash kernel's time is the kernel model's attention class, not a measured kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from prism_plugin.config.program_options import ATTENTION_ENV, AttentionMode, parse_attention
from prism_plugin.device.undo import Patches

__all__ = ["ENV", "AttentionMode", "AttentionNotSupported", "FlashAttentionStandin", "attention_mode",
           "check_job", "install"]

ENV = ATTENTION_ENV
"""The environment variable the mode travels in (the drop-in sets it from ``--prism-attention``)."""


class AttentionNotSupported(NotImplementedError):
    """A feature of the attention layer the stand-in does not compute; the message names it and the way out."""


def attention_mode(value: str | None = None) -> AttentionMode:
    """The mode named by `value`, else by ``PRISM_ATTENTION``, else local (ConfigError naming both when invalid)."""
    return parse_attention(value if value is not None else os.environ.get(ENV, AttentionMode.LOCAL.value))


_CP_COMM_TYPES = {"all_gather": "all_gather", "allgather": "all_gather", "p2p": "p2p"}


def check_job(ns: Any, mode: AttentionMode, *, virtual_gpu: bool) -> None:
    """Before any process group: the stand-in only on virtual GPUs; context parallelism with the local spec needs
    it; CP communication types it does not run are refused (a `Refusal` naming the flag)."""
    from prism_plugin.adapters.megatron.refusals import Refusal

    if mode is AttentionMode.FLASH and not virtual_gpu:
        raise Refusal("--prism-attention flash is a stand-in for virtual GPUs (--prism-device virtual-gpu); on a "
                      "CPU host Megatron's local attention runs as written, on a real GPU use TransformerEngine "
                      "(--transformer-impl transformer_engine)")
    cp = int(getattr(ns, "context_parallel_size", 1) or 1)
    if cp <= 1 or getattr(ns, "transformer_impl", "local") != "local":
        return
    if mode is not AttentionMode.FLASH:
        raise Refusal(f"--context-parallel-size {cp}: Megatron's local DotProductAttention has no context "
                      "parallelism (only TEDotProductAttention); on virtual GPUs pass --prism-attention flash "
                      f"(or {ENV}=flash), whose stand-in runs TE's all-gather context parallelism")
    types = getattr(ns, "cp_comm_type", None) or ["p2p"]
    for t in [types] if isinstance(types, str) else types:
        if t not in _CP_COMM_TYPES:
            raise Refusal(f"--cp-comm-type {t}: the flash stand-in runs context parallelism as all_gather (p2p "
                          "runs as all_gather too); pass --cp-comm-type all_gather")


@dataclass(slots=True)
class FlashAttentionStandin:
    """What the stand-in replaced and ran, for the summary (``megatron.attention``)."""

    modules_replaced: int = 0
    """DotProductAttention modules built with the stand-in's forward."""
    forwards: int = 0
    cp_forwards: int = 0
    """Forwards with context parallelism > 1 (all-gathered K/V)."""
    context_parallel_size: int = 1
    cp_comm_requested: list[str] = field(default_factory=list)
    selective_recompute: bool = False
    """The job kept ``--recompute-granularity selective`` (unnecessary with the stand-in: it recomputes the
    flash forward in backward)."""

    def summary(self) -> dict[str, Any]:
        cp: dict[str, Any] | None = None
        if self.context_parallel_size > 1:
            requested = sorted(set(self.cp_comm_requested))
            cp = {"size": self.context_parallel_size, "cp_comm_type": "all_gather", "requested": requested,
                  "forwards": self.cp_forwards,
                  "note": "K/V all-gathered in forward and backward, dK/dV reduce-scattered, over Megatron's CP "
                          "group (TransformerEngine's all_gather form)"
                          + ("; p2p (TE's ring) was requested and ran as all_gather" if "p2p" in requested else "")}
        return {"implementation": "flash", "replaces": "megatron.core.transformer.dot_product_attention."
                                                       "DotProductAttention",
                "kernel": "aten._scaled_dot_product_flash_attention (CP 1), aten._flash_attention_forward per "
                          "query chunk (CP > 1)",
                "modules_replaced": self.modules_replaced, "forwards": self.forwards,
                "selective_recompute": self.selective_recompute, "context_parallel": cp}


def install(patches: Patches, *, virtual_gpu: bool) -> FlashAttentionStandin:
    """Give Megatron's ``DotProductAttention`` the stand-in's ``__init__`` and ``forward`` until `patches` closes
    (modules built before keep working: the class itself is patched)."""
    if not virtual_gpu:
        raise AttentionNotSupported("--prism-attention flash runs only on virtual GPUs (--prism-device virtual-gpu)")
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    stats = FlashAttentionStandin()
    _CHUNK_IDS.clear()  # device tensors of an earlier virtual GPU
    original_init = DotProductAttention.__init__

    def __init__(self: Any, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        _refuse_config(config, layer_number)
        cp = int(config.context_parallel_size)
        config.context_parallel_size = 1  # the original asserts CP 1 ("only supported by TEDotProductAttention")
        try:
            original_init(self, config, layer_number, attn_mask_type, attention_type,
                          attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                          cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        finally:
            config.context_parallel_size = cp
        self._prism_cp_size = cp
        self._prism_cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        stats.modules_replaced += 1
        stats.context_parallel_size = max(stats.context_parallel_size, cp)
        stats.selective_recompute = config.recompute_granularity == "selective"
        if cp > 1:
            stats.cp_comm_requested.append(_CP_COMM_TYPES.get(cp_comm_type or "p2p", cp_comm_type or "p2p"))

    def forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        stats.forwards += 1
        if self._prism_cp_size > 1:
            stats.cp_forwards += 1
        return _forward(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params)

    patches.setattr(DotProductAttention, "__init__", __init__)
    patches.setattr(DotProductAttention, "forward", forward)
    return stats


def _refuse_config(config: Any, layer_number: int) -> None:
    from megatron.core.transformer.utils import is_layer_window_attention

    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, max(1, layer_number)):
        raise AttentionNotSupported(f"--prism-attention flash: window attention (window_size {config.window_size}) "
                                    "is not computed by the stand-in; drop --window-size or --prism-attention")
    if config.softmax_type != "vanilla":
        raise AttentionNotSupported(f"--prism-attention flash: softmax_type {config.softmax_type!r} (off-by-one / "
                                    "learnable softmax) is not computed by the stand-in; use --softmax-type "
                                    "vanilla or drop --prism-attention")


def _forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask_type: Any,
             attention_bias: torch.Tensor | None, packed_seq_params: Any) -> torch.Tensor:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    if packed_seq_params is not None:
        raise AttentionNotSupported("--prism-attention flash: packed sequences (packed_seq_params, THD) are not "
                                    "computed by the stand-in; drop sequence packing or --prism-attention")
    if attention_bias is not None:
        raise AttentionNotSupported("--prism-attention flash: an attention bias is not computed by the stand-in")
    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
        raise AttentionNotSupported(f"--prism-attention flash: attention mask type {mask_type.name} is not computed "
                                    "by the stand-in (causal and no_mask are)")
    _check_flash(query, key)
    causal = mask_type is AttnMaskType.causal
    # Megatron divides the scale by the layer number with query-key layer scaling and its softmax multiplies it back
    scale = module.softmax_scale * (module.layer_number if module.config.apply_query_key_layer_scaling else 1)
    dropout_p = float(module.attention_dropout.p) if module.training else 0.0
    sq, b, heads, dim = query.shape
    fork = dropout_p > 0 and not module.config.sequence_parallel  # Megatron's RNG-tracker fork around dropout
    with tensor_parallel.get_cuda_rng_tracker().fork() if fork else _nothing():
        if module._prism_cp_size > 1:
            group = module._prism_cp_group or _cp_group()
            context = _AllGatherContextParallel.apply(query, key, value, group, scale, dropout_p, causal)
            return context.view(sq, b, heads * dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), dropout_p=dropout_p,
            is_causal=causal, scale=scale, enable_gqa=key.size(2) != heads)
    # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, hp]
    return out.permute(2, 0, 1, 3).contiguous().view(sq, b, heads * dim)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _check_flash(query: torch.Tensor, key: torch.Tensor) -> None:
    """torch's flash rules (sdp_utils): fp16/bf16, head dim a multiple of 8 up to 256, flash enabled, query heads
    a multiple of the key/value groups; otherwise SDPA would take the unfused math path (s x s scores)."""
    dim = query.size(-1)
    if (query.dtype not in (torch.float16, torch.bfloat16) or dim % 8 or dim > 256
            or not torch.backends.cuda.flash_sdp_enabled() or query.size(2) % key.size(2)):
        raise AttentionNotSupported(
            f"--prism-attention flash: flash attention does not take {query.dtype} query/key with head dim {dim}, "
            f"{query.size(2)} heads over {key.size(2)} key/value groups (needs fp16/bf16: --bf16; head dim a "
            "multiple of 8 up to 256; flash SDPA enabled)")


def _cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


_CHUNK_IDS: dict[tuple[int, str, bool], torch.Tensor] = {}


def _chunk_ids(cp: int, device: torch.device, to_sequence: bool) -> torch.Tensor:
    """Index of the 2cp chunks: all-gathered layout (rank r's chunks r and 2cp-1-r, rank after rank) -> sequence
    order (`to_sequence`), or back. cp=2: gathered [0, 3, 1, 2] -> sequence via [0, 2, 3, 1]; back via [0, 3, 1, 2].
    """
    key = (cp, str(device), to_sequence)
    if key not in _CHUNK_IDS:
        gathered = [r if j == 0 else 2 * cp - 1 - r for r in range(cp) for j in (0, 1)]  # chunk at each position
        ids = [gathered.index(c) for c in range(2 * cp)] if to_sequence else gathered
        _CHUNK_IDS[key] = torch.tensor(ids, dtype=torch.int64, device=device)
    return _CHUNK_IDS[key]


def _query_chunks(rank: int, cp: int, chunk: int, causal: bool) -> list[tuple[slice, int]]:
    """(rows of the local query, keys it attends: ``k_seq[:keys]``) for CP rank `rank`'s two chunks, r and 2cp-1-r.
    Causal: chunk c sees keys ``[0, (c+1) chunk)``, the mask aligned bottom-right. cp=2, rank 1, chunk 4:
    [(rows 0-3, 8 keys), (rows 4-7, 12 keys)]."""
    ids = (rank, 2 * cp - 1 - rank)
    return [(slice(j * chunk, (j + 1) * chunk), (c + 1) * chunk if causal else 2 * cp * chunk)
            for j, c in enumerate(ids)]


def _reorder(t: torch.Tensor, cp: int, to_sequence: bool) -> torch.Tensor:
    chunks = t.view(2 * cp, t.size(0) // (2 * cp), *t.shape[1:])
    return torch.index_select(chunks, 0, _chunk_ids(cp, t.device, to_sequence)).view(t.shape)


def _all_gather(t: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    out = torch.empty((cp * t.size(0), *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _reduce_scatter(t: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    out = torch.empty((t.size(0) // cp, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


class _AllGatherContextParallel(torch.autograd.Function):
    """Core attention of one CP rank, TE's all_gather form (module docstring); tensors ``[s, b, heads, hn]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                dropout_p: float, causal: bool) -> torch.Tensor:
        cp, rank = group.size(), group.rank()
        chunk = q.size(0) // 2
        k_seq = _reorder(_all_gather(k, group, cp), cp, to_sequence=True)
        v_seq = _reorder(_all_gather(v, group, cp), cp, to_sequence=True)
        out = torch.empty_like(q)
        saved: list[torch.Tensor] = []
        for rows, keys in _query_chunks(rank, cp, chunk, causal):  # this rank's two query chunks
            o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q[rows].transpose(0, 1), k_seq[:keys].transpose(0, 1), v_seq[:keys].transpose(0, 1), None, None,
                chunk, keys, dropout_p, causal, False, scale=scale)
            out[rows].copy_(o.transpose(0, 1))
            saved += [o, lse, rng, unused]
        ctx.save_for_backward(q, k, v, *saved)
        ctx.cp, ctx.rank, ctx.group, ctx.scale, ctx.dropout_p, ctx.causal = cp, rank, group, scale, dropout_p, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *saved = ctx.saved_tensors
        cp, group, chunk = ctx.cp, ctx.group, q.size(0) // 2
        k_seq = _reorder(_all_gather(k, group, cp), cp, to_sequence=True)  # TE re-gathers: only local K/V saved
        v_seq = _reorder(_all_gather(v, group, cp), cp, to_sequence=True)
        dq = torch.empty_like(q)
        dk_seq, dv_seq = torch.zeros_like(k_seq), torch.zeros_like(v_seq)
        no_seqlens = torch.empty(0, dtype=torch.int32, device=q.device)
        for j, (rows, keys) in enumerate(_query_chunks(ctx.rank, cp, chunk, ctx.causal)):
            o, lse, rng, unused = saved[4 * j:4 * j + 4]
            dqj, dkj, dvj = torch.ops.aten._flash_attention_backward(
                grad[rows].transpose(0, 1), q[rows].transpose(0, 1), k_seq[:keys].transpose(0, 1),
                v_seq[:keys].transpose(0, 1), o, lse, no_seqlens, no_seqlens, chunk, keys, ctx.dropout_p,
                ctx.causal, rng, unused, scale=ctx.scale)
            dq[rows].copy_(dqj.transpose(0, 1))
            dk_seq[:keys].add_(dkj.transpose(0, 1))
            dv_seq[:keys].add_(dvj.transpose(0, 1))
        dk = _reduce_scatter(_reorder(dk_seq, cp, to_sequence=False), group, cp)
        dv = _reduce_scatter(_reorder(dv_seq, cp, to_sequence=False), group, cp)
        return dq, dk, dv, None, None, None, None
