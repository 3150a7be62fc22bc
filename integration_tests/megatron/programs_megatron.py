"""Megatron-core programs the integration workers run (cases for harness.Cluster).

Each case installs the Megatron adapter for the worker's current prism session, builds Megatron's
parallel state and a tiny GPT (local layer spec, fp32, no dropout) wrapped in Megatron's DDP with
its distributed optimizer, trains with ``get_forward_backward_func()`` and undoes everything, so
the next case (possibly another world) starts clean. Results are small CPU tensors and numbers.

Data: micro-batch (step, i) of data-parallel replica d is drawn from a generator seeded with
(d, step, i), so every rank of a replica (TP peers, pipeline stages) sees the same tokens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from harness import Ctx

SEQ, MICRO, VOCAB, HIDDEN = 16, 2, 64, 32


@contextlib.contextmanager
def megatron_world(ctx: Ctx, *, tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, ep: int = 1,
                   etp: int | None = None, gloo: bool = True, order: str = "tp-cp-ep-dp-pp") -> Iterator[Any]:
    """Adapter installed + ``initialize_model_parallel``; both undone on exit."""
    from prism_plugin.adapters.megatron.adapter import MegatronAdapter

    adapter = MegatronAdapter(ctx.session, import_training=False).install()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # a fresh process's Megatron state: the MoE loss scale is a class-level tensor that
    # set_loss_scale() creates once and then updates in place, so a reused worker would otherwise
    # hold 4 bytes fewer than a fresh one (workers are reused across cases)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        ps.initialize_model_parallel(tp, pp, vpp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp, create_gloo_process_groups=gloo, order=order)
        yield adapter
    finally:
        ps.destroy_model_parallel()
        adapter.uninstall()


def _config(tp: int, pp: int, vpp: int | None, sp: bool, layers: int, moe: dict[str, Any] | None) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(moe or {})
    return TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=2 * HIDDEN,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, bf16=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
        **extra,
    )


def build(tp: int, pp: int, vpp: int | None = None, sp: bool = False, layers: int = 4, distopt: bool = True,
          moe: dict[str, Any] | None = None) -> tuple[Any, list[Any], Any]:
    """(config, DDP model chunks, Megatron optimizer) for this rank's shard."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tensor_parallel.model_parallel_cuda_manual_seed(1234 + 100 * ps.get_pipeline_model_parallel_rank())
    torch.manual_seed(1234 + 100 * ps.get_pipeline_model_parallel_rank())
    config = _config(tp, pp, vpp, sp, layers, moe)
    spec = get_gpt_layer_local_spec(num_experts=(moe or {}).get("num_moe_experts"))
    chunks = []
    for v in range(vpp or 1):
        first = ps.is_pipeline_first_stage(ignore_virtual=True) and v == 0
        last = ps.is_pipeline_last_stage(ignore_virtual=True) and v == (vpp or 1) - 1
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=first, post_process=last, vp_stage=v if vpp else None)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt,
                                            overlap_grad_reduce=False)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp, module=model,
                                              disable_bucketing=v > 0))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distopt, bf16=False, fp16=False,
                        clip_grad=1.0),
        chunks,
    )
    return config, chunks, optimizer


def _batch(dp_rank: int, step: int, i: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(10_000 * dp_rank + 100 * step + i)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens, positions, mask, labels


def _forward_step(data_iterator: Any, model: Any) -> Any:
    tokens, positions, mask, labels = next(data_iterator)
    output = model(tokens, positions, mask, labels=labels)

    def loss_func(out: torch.Tensor) -> Any:
        loss = out.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def train(chunks: list[Any], optimizer: Any, *, steps: int = 3, microbatches: int = 4,
          tracker: Any = None) -> dict[str, Any]:
    """`steps` training steps; per step the losses, grad buffers, params and grad norm (copies not tracked)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = ps.get_data_parallel_rank()
    fb = get_forward_backward_func()
    out: dict[str, Any] = {"losses": [], "grads": [], "params": [], "grad_norm": [], "finite": True}
    pause = tracker.paused if tracker is not None else contextlib.nullcontext
    for step in range(steps):
        batches = [_batch(dp_rank, step, i) for i in range(microbatches)]
        iterators: Any = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fb(forward_step_func=_forward_step, data_iterator=iterators,
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=microbatches,
                    seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
        with pause():
            grads = [b.grad_data.clone() for c in chunks for b in c.buffers]
        _ok, grad_norm, _ = optimizer.step()
        with pause():
            out["losses"].append([float(x["lm loss"]) for x in losses])
            out["grads"].append(grads)
            out["params"].append([b.param_data.clone() for c in chunks for b in c.buffers])
            out["grad_norm"].append(float(grad_norm))
            out["finite"] = out["finite"] and all(math.isfinite(v) for v in out["losses"][-1]) \
                and math.isfinite(float(grad_norm)) and all(bool(torch.isfinite(g).all()) for g in grads)
    return out


_GLOO_OPS = ("allreduce", "allreduce_coalesced", "_reduce_scatter_base", "reduce_scatter", "allgather",
             "_allgather_base", "allgather_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base", "gather",
             "scatter", "send", "recv", "barrier")


@contextlib.contextmanager
def gloo_internals_untracked(tracker: Any) -> Iterator[None]:
    """Do not count what gloo allocates inside its own collectives (in the calling thread).

    In the real run, ranks exchange through real gloo groups, and gloo's ``_reduce_scatter_base``
    clones its whole input in the caller's thread (4 KiB here), a temporary NCCL, the target
    backend, does not make and the emulator rightly does not reproduce. Both runs therefore count
    the program's tensors only: allocations made while a ProcessGroupGloo call runs are not counted.
    """
    import torch.distributed as dist

    if tracker is None:
        yield
        return
    saved = {name: getattr(dist.ProcessGroupGloo, name) for name in _GLOO_OPS}

    def untracked(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker.paused():
                return original(self, *args, **kwargs)

        return call

    for name, original in saved.items():
        setattr(dist.ProcessGroupGloo, name, untracked(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist.ProcessGroupGloo, name, original)


# -- cases ---------------------------------------------------------------------------------------------
def train_case(ctx: Ctx, *, tp: int = 1, pp: int = 1, vpp: int | None = None, sp: bool = False, steps: int = 3,
               microbatches: int = 4, layers: int = 4, distopt: bool = True, track_memory: bool = True,
               moe: dict[str, Any] | None = None, ep: int = 1) -> dict[str, Any]:
    """Train and report losses, grads, params and the peak tensor memory (model build included)."""
    from prism_plugin.device.memory import StorageTracker

    with megatron_world(ctx, tp=tp, pp=pp, vpp=vpp, ep=ep) as adapter:
        tracker = StorageTracker().start() if track_memory else None
        try:
            with gloo_internals_untracked(tracker):
                _config_, chunks, optimizer = build(tp, pp, vpp, sp, layers, distopt, moe)
                result = train(chunks, optimizer, steps=steps, microbatches=microbatches, tracker=tracker)
        finally:
            if tracker is not None:
                tracker.stop()
        from megatron.core import parallel_state as ps

        result["peak_bytes"] = tracker.peak_bytes if tracker is not None else None
        result["late_free_bytes"] = tracker.late_free_bytes if tracker is not None else None
        result["pp_rank"] = ps.get_pipeline_model_parallel_rank()
        result["dp_size"] = ps.get_data_parallel_world_size()
        result["optimizer_state_bytes"] = _optimizer_state_bytes(optimizer)
        result["expected_state_bytes"] = 8 * _shard_elements(chunks, ps.get_data_parallel_rank(),
                                                             ps.get_data_parallel_world_size()) if distopt else None
        result["grad_buffer_numel"] = sum(b.grad_data.numel() for c in chunks for b in c.buffers)
        result["adapter"] = adapter.summary()
    result["ops"] = {str(k): v for k, v in ctx.session.op_counts.items()}
    result["op_bytes"] = {str(k): v for k, v in ctx.session.op_bytes.items()}
    return result


def _shard_elements(chunks: list[Any], dp_rank: int, dp: int) -> int:
    """Parameter elements in this rank's distributed-optimizer shard, from the DDP buffer layout.

    Megatron shards each bucket of each grad buffer into `dp` equal ranges; the optimizer keeps
    state for the parts of parameters inside this rank's range (padding holds none).
    """
    total = 0
    for chunk in chunks:
        for buf in chunk.buffers:
            for start, end in buf.bucket_indices:
                shard = (end - start) // dp
                lo, hi = start + dp_rank * shard, start + (dp_rank + 1) * shard
                for p_start, p_end, _bucket in buf.param_index_map.values():
                    total += max(0, min(p_end, hi) - max(p_start, lo))
    return total


def _optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of Adam state tensors (exp_avg, exp_avg_sq) this rank holds."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
    return total


def groups_case(ctx: Ctx, *, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None,
                gloo: bool = True, order: str = "tp-cp-ep-dp-pp") -> dict[str, Any]:
    """Memberships Megatron built under prism, and those its own RankGenerator computes, for this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from prism_plugin.adapters.megatron.groups import expected_memberships, megatron_memberships

    with megatron_world(ctx, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, gloo=gloo, order=order):
        seen = megatron_memberships()
        expected = expected_memberships(ctx.world_size, ctx.rank, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
        twins = {}
        if gloo:
            dp_gloo = ps.get_data_parallel_group_gloo()
            twins["dp_gloo"] = tuple(dist.get_process_group_ranks(dp_gloo))
            twins["dp_gloo_backend"] = type(dp_gloo).__name__
            t = torch.ones(3)
            dist.all_reduce(t, group=dp_gloo)
            twins["dp_gloo_all_reduce"] = t.tolist()
    return {"seen": seen, "expected": expected, "twins": twins, "groups_created": ctx.session.groups_created}
