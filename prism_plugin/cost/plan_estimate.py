"""A closed-form guess of each `prism plan` candidate's memory and speed, used only to choose the order in which
candidates are tried, never to exclude one.

`prism plan` emulates at most ``--max-candidates`` layouts (each one a memory run and a whole ``prism emulate``),
and a model on a thousand GPUs has thousands of valid layouts (`prism_plugin.topology.plan_space`). So it tries
them best-guess first: `order` sorts the candidates the guess says fit the GPU before those it says do not, and
each group by guessed tokens/s/GPU. Whether a candidate fits, and how fast it runs, is then decided by its
virtual-GPU runs alone; a guess that is wrong costs an emulation or a place in the queue, never a candidate.

The guess, per GPU of the first pipeline stage (the stage that holds the most activations under 1F1B):

- **model state**: the stage's parameters (its layers / tp, with the experts / ep and / etp; the embedding / tp
  on the first stage) x (2 bytes of bf16 weight + 4 of fp32 main gradient + 12 of fp32 master weight and Adam
  moments, the last divided by dp with the distributed optimizer): Megatron's mixed-precision Adam;
- **activations**: Korthikanti et al. 2022 (arXiv:2205.05198, table 2), with sequence parallelism, per layer
  and micro-batch: s b h (34 + 5 a s / h) / tp bytes with no recompute, 34 s b h / tp selective, 2 s b h / tp
  full (the layer input), divided by cp; with fused (flash) attention, TransformerEngine's default, the softmax
  is never stored and no recompute is 34 s b h / tp as well; the first stage holds pp micro-batches in flight
  (interleaving adds (pp - 1) / vp stages' worth), as that paper's section 4.2;
- **time**: 6 x the active (routed) parameters x tokens FLOPs per iteration (8 x with full recompute: the forward
  again) at the bf16 (or fp8) peak, plus causal attention's 6 x 2 x s^2 h per sequence and layer (halved for the
  causal mask; 8 x with selective or full recompute, which run its forward again) at the bf16 peak, both times a
  flat `EFFICIENCY`; stretched by the pipeline bubble (pp - 1) / (vp x micro-batches per data rank) and by
  `PARALLEL_OVERHEAD` per doubling of tp and of cp (the exposed share of the tensor- and context-parallel
  communication).

All of it is a modelled figure with no fitted parameter: the constants are stated once here, and changing them
changes only the order of the queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prism_plugin.config.models import (
    ModelPreset,
    attention_parameters,
    embedding_parameters,
    mlp_parameters,
)
from prism_plugin.cost.gpu import GpuSpec
from prism_plugin.topology.plan_space import Candidate, Recompute

__all__ = ["EFFICIENCY", "PARALLEL_OVERHEAD", "Guess", "guess", "order"]

EFFICIENCY = 0.5
"""The flat share of the tensor-core peak the guess assumes for every candidate (an ordering constant)."""
PARALLEL_OVERHEAD = 0.04
"""The share of step time the guess adds per doubling of tp and of cp (their exposed communication)."""


@dataclass(frozen=True, slots=True)
class Guess:
    """The closed-form guess for one candidate: bytes on a first-stage GPU, seconds per step, tokens/s/GPU."""

    memory_bytes: int
    step_s: float
    tokens_per_s_per_gpu: float

    def fits(self, gpu: GpuSpec) -> bool:
        """Whether the guessed bytes, with the CUDA context, are within the GPU's memory."""
        return self.memory_bytes + gpu.context_bytes <= gpu.total_memory_bytes


def _stage_parameters(model: ModelPreset, c: Candidate) -> float:
    """Parameters held by one first-stage GPU: its layers' attention / tp, MLPs / tp (experts / (ep x etp)),
    norms, and the input embedding / tp."""
    layers = model.num_layers / c.pp
    mlp = mlp_parameters(model) / c.tp
    if model.num_experts is not None:
        mlp = model.num_experts * mlp_parameters(model) / (c.ep * c.etp) + model.hidden_size * model.num_experts
    return layers * (attention_parameters(model) / c.tp + mlp + 2 * model.hidden_size) + \
        embedding_parameters(model) / c.tp


def _active_parameters(model: ModelPreset) -> float:
    """Parameters one token's forward runs through (top-k experts of a mixture; the output layer counts)."""
    mlp = mlp_parameters(model) * (model.moe_router_topk or 1)
    return model.num_layers * (attention_parameters(model) + mlp) + model.vocab_size * model.hidden_size


def guess(model: ModelPreset, c: Candidate, gpu: GpuSpec, global_batch: int, seq: int, *,
          fused_attention: bool = True) -> Guess:
    """The module docstring's guess for candidate `c` of `model` on `gpu` at `global_batch` sequences of `seq`
    (`fused_attention` False: Megatron's local spec, whose attention stores the softmax).

    >>> from prism_plugin.config.models import preset
    >>> from prism_plugin.cost.gpu import gpu_spec
    >>> c = Candidate(tp=4, pp=4, vp=5, cp=2, ep=1, etp=4, dp=4, micro_batch=1, recompute=Recompute.NONE,
    ...               distributed_optimizer=True, fp8=False)
    >>> g = guess(preset("llama3-70b"), c, gpu_spec("h100-sxm"), 128, 8192)
    >>> round(g.memory_bytes / 2**30, 1), round(g.tokens_per_s_per_gpu)
    (62.5, 965)
    """
    s, b, h, a = seq, c.micro_batch, model.hidden_size, model.num_attention_heads
    params = _stage_parameters(model, c)
    optimizer = 12 / c.dp if c.distributed_optimizer else 12
    state = params * (2 + 4 + optimizer)
    stored_softmax = 0 if fused_attention else 5 * a * s / h
    per_layer = {Recompute.NONE: s * b * h * (34 + stored_softmax), Recompute.SELECTIVE: 34 * s * b * h,
                 Recompute.FULL: 2 * s * b * h}[c.recompute] / c.tp / c.cp
    in_flight = c.pp + ((c.pp - 1) / c.vp if c.vp else 0)
    activations = per_layer * model.num_layers / c.pp * in_flight
    tokens = global_batch * s
    passes = 8 if c.recompute is Recompute.FULL else 6
    bf16 = gpu.peak_flops_per_s["bfloat16"]
    gemm_peak = gpu.peak_flops_per_s.get("float8", bf16) if c.fp8 else bf16
    gpus = c.tp * c.pp * c.cp * c.dp
    attention_passes = 6 if c.recompute is Recompute.NONE else 8  # selective recomputes core attention too
    seconds = passes * _active_parameters(model) * tokens / gemm_peak + \
        attention_passes * model.num_layers * global_batch * s * s * h / bf16
    compute = seconds / gpus / EFFICIENCY
    micro = global_batch // (c.micro_batch * c.dp)
    bubble = (c.pp - 1) / ((c.vp or 1) * micro)
    step = compute * (1 + bubble) * (1 + PARALLEL_OVERHEAD * math.log2(c.tp * c.cp))
    return Guess(int(state + activations), step, tokens / step / gpus)


def order(model: ModelPreset, candidates: Sequence[Candidate], gpu: GpuSpec, global_batch: int, seq: int, *,
          fused_attention: bool = True) -> list[tuple[Candidate, Guess]]:
    """Every candidate with its guess, best first: guessed to fit before guessed not to, then by guessed
    tokens/s/GPU (highest first), then by guessed memory (lowest first); ties keep the enumeration's order."""
    guessed = [(c, guess(model, c, gpu, global_batch, seq, fused_attention=fused_attention)) for c in candidates]
    return sorted(guessed, key=lambda cg: (not cg[1].fits(gpu), -cg[1].tokens_per_s_per_gpu, cg[1].memory_bytes))
