"""MoE routing on virtual GPUs: the token counts per expert come from a stated routing policy (DESIGN §10).

Under fake tensors the router's top-k has no values, so how many tokens each expert receives (what the all-to-all
dispatcher reads on the host with ``.tolist()`` / ``.cpu()`` / ``.numpy()``: its ``input_splits``,
``output_splits``, ``output_splits_tp``, ``num_global_tokens_per_local_expert`` and the ``tokens_per_expert``
that shape the expert GEMMs) is data-dependent. The seam is ``MoEAlltoAllTokenDispatcher.preprocess``: it still
issues what a real rank issues on the GPU (the routing map's column sums and their all-gather over the TP x EP
group: the same collective, the same bytes), but the counts themselves, this rank's and every peer's in that group,
are computed on the host from the policy. They are real host values, so every later read (Megatron's own D2H copies
and syncs stay) is answered, the all-to-all splits, the received bytes and the expert GEMM shapes are those a real
rank would see, and the routing map's own (unknown) values are never read.

Policies (``--prism-moe-routing``, reaching each process as ``PRISM_MOE_ROUTING``):

- ``balanced`` (default; published MoE benchmarks force-balance too, cf. Megatron's
  ``--moe-router-force-load-balancing``): each source rank's T tokens x top-k assignments are split evenly,
  ``T*k // E`` per expert; the remainder ``R = T*k % E`` goes one each to experts ``(s*R + i) mod E``, i < R, for
  source s (its index in the TP x EP group), so that over the group it spreads evenly too;
- ``skew:SEED[,ALPHA]`` (a what-if): per MoE layer (the dispatcher, numbered in the order of first use), a seeded
  permutation ranks the experts and expert of rank j gets a share proportional to ``(j+1)**-ALPHA`` (Zipf;
  ALPHA defaults to 1.0, 0 is balanced), at most T (a token picks an expert once), largest remainder rounding;
  every source routes the same skewed counts (a global hot-expert pattern). Deterministic: the same seed gives the
  same counts in every run, for a recomputed forward too.

Every source is assumed to hold as many tokens as this rank (the same micro-batch and sequence shard).
Megatron's ``--moe-router-force-load-balancing`` alone does not suffice on virtual GPUs: it replaces the logits by
random normals, which fake tensors do not hold either, so the dispatcher's reads would still have no answer.

Refused at the seam (`NoValueError`, naming the read and the call site): ``--moe-expert-capacity-factor`` without
``--moe-pad-expert-input-to-capacity`` and ``--moe-router-padding-for-quantization`` (the dropped or padded
counts depend on the routing values). With padding to capacity Megatron's own path runs (its counts are the
capacity, no value read). The all-gather dispatcher (``--moe-token-dispatcher-type allgather``) is covered at its
``dispatch_postprocess`` (`RoutingPolicy.allgather_postprocess`: the gathered tokens of every TP x EP source, counted
by the policy for this rank's experts). The flex dispatcher is not: its reads raise as any unanswered read does
(`values.ValuePolicy.read`).

`install` also puts in a seam MoE training needs on virtual GPUs (undone with the adapter): Megatron's MoE loss
scale skips a no-op ``torch.as_tensor`` the virtual GPU's device calls assert on (`_loss_scale_on_device`). Expert
weights keep Megatron's ``allreduce = False`` marker through ``Module.cuda()`` because the virtual GPU's swap keeps
every parameter attribute (`runtime.virtual_gpu.device.VirtualGpu._swap_tensors`: without it the experts were
reduced and sharded as dense parameters).
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter
from typing import Any

from prism_plugin.config.program_options import ROUTING_ENV as ENV
from prism_plugin.config.program_options import RoutingSpec, parse_routing

__all__ = ["ENV", "RoutingPolicy", "parse_routing", "install"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def balanced_counts(tokens: int, topk: int, num_experts: int, source: int) -> list[int]:
    """Source `source`'s tokens per expert under the balanced policy (see the module docstring)."""
    base, rest = divmod(tokens * topk, num_experts)
    counts = [base] * num_experts
    for i in range(rest):
        counts[(source * rest + i) % num_experts] += 1
    return counts


def skewed_counts(tokens: int, topk: int, num_experts: int, seed: int, alpha: float, layer: int) -> list[int]:
    """Tokens per expert of every source under ``skew:seed,alpha`` for the `layer`-th MoE layer."""
    order = list(range(num_experts))
    random.Random(f"prism-moe-skew:{seed}:{layer}").shuffle(order)  # order[j]: the expert of popularity rank j
    weight = [0.0] * num_experts
    for j, expert in enumerate(order):
        weight[expert] = (j + 1) ** -alpha
    total, counts = tokens * topk, [0] * num_experts
    free = set(range(num_experts))
    while True:  # water-filling: an expert gets at most `tokens` (one per token); the overflow goes to the rest
        left = total - sum(counts[e] for e in range(num_experts) if e not in free)
        mass = sum(weight[e] for e in free)
        share = {e: left * weight[e] / mass for e in free}
        full = {e for e in free if share[e] >= tokens}
        if not full:
            break
        for e in full:
            counts[e] = tokens
        free -= full
    floors = {e: int(share[e]) for e in free}
    rest = left - sum(floors.values())
    for e in sorted(free, key=lambda e: (floors[e] - share[e], e))[:rest]:  # largest remainder first
        floors[e] += 1
    for e in free:
        counts[e] = floors[e]
    return counts


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


class RoutingPolicy:
    """Answers the all-to-all dispatcher's token counts (`preprocess`) and counts every answer by call site."""

    def __init__(self, spec: RoutingSpec) -> None:
        self.spec = spec
        self.calls: Counter[str] = Counter()
        self._layers: dict[int, int] = {}  # id(dispatcher) -> its MoE layer index (order of first use)
        self.tokens_sent = 0
        self.tokens_received = 0
        self.last: dict[str, Any] = {}
        """The last answer: the counts and splits of one call (what the tests and the summary show)."""
        self.by_layer: dict[int, dict[str, Any]] = {}

    def source_counts(self, tokens: int, topk: int, num_experts: int, source: int, layer: int) -> list[int]:
        """Tokens per expert that source `source` (its TP x EP group index) routes in MoE layer `layer`."""
        if self.spec.kind == "skew":
            return skewed_counts(tokens, topk, num_experts, self.spec.seed, self.spec.alpha, layer)
        return balanced_counts(tokens, topk, num_experts, source)

    def preprocess(self, dispatcher: Any, routing_map: Any) -> Any:
        """`MoEAlltoAllTokenDispatcher.preprocess` with the counts from the policy (dropless routing)."""
        import torch
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        config = dispatcher.config
        site = _call_site()
        self._dropless_only(config, site, "MoEAlltoAllTokenDispatcher.preprocess")
        tokens, experts, topk = int(routing_map.size(0)), dispatcher.num_experts, config.moe_router_topk
        ep, tp, local = dispatcher.ep_size, dispatcher.tp_size, dispatcher.num_local_experts
        layer = self._layers.setdefault(id(dispatcher), len(self._layers))
        me = dispatcher.ep_rank * tp + dispatcher.tp_rank  # as Megatron's gather orders the group: EP-major
        # what a real rank computes and sends on the GPU: the column sums and their gather over TP x EP
        local_on_device = routing_map.sum(dim=0).long()
        dispatcher.num_out_tokens = tokens * topk
        gathered = local_on_device
        if ep * tp > 1:
            gathered = gather_from_sequence_parallel_region(local_on_device, group=dispatcher.tp_ep_group)
        # the values, on the host: [ep, tp, experts], source (e, t) at group index e * tp + t
        counts = torch.tensor([self.source_counts(tokens, topk, experts, s, layer) for s in range(ep * tp)],
                              dtype=torch.long, device="cpu").reshape(ep, tp, experts)
        first = dispatcher.local_expert_indices[0]
        mine = counts[:, :, first:first + local].transpose(0, 1).contiguous()  # [tp, ep, local]
        per_rank = mine.sum(dim=2)  # [tp, ep]: tokens for my local experts from each source
        own = counts.reshape(ep * tp, experts)[me]
        input_splits = own.reshape(ep, local).sum(dim=1)
        if ep > 1 or tp > 1:
            dispatcher.input_splits = input_splits.numpy()  # what Megatron's D2H copies make of them (as_numpy)
            dispatcher.output_splits = per_rank[dispatcher.tp_rank].numpy()
            dispatcher.output_splits_tp = per_rank.sum(dim=1).numpy()
            per_local_expert = mine.sum(dim=(0, 1))
            global_per_local = mine
        else:
            per_local_expert = own
            global_per_local = own.reshape(experts)
        if local > 1 and config.moe_permute_fusion:
            # TE's fused chunk sort takes the counts on the device, as Megatron leaves them with the fusion: its own
            # slice of the gathered sums (the device tensor a real rank holds; the values are the host's below)
            on_device = gathered.reshape(ep, tp, experts).transpose(0, 1)[:, :, first:first + local].contiguous()
            dispatcher.num_global_tokens_per_local_expert = on_device.view(-1, local)
        elif local > 1:
            dispatcher.num_global_tokens_per_local_expert = global_per_local.reshape(-1, local)
        sent, received = int(input_splits.sum()), int(mine.sum())
        self.calls[site] += 1
        self.tokens_sent += sent
        self.tokens_received += received
        self.last = {"tokens": tokens, "source": me, "counts": own.tolist(), "input_splits": input_splits.tolist(),
                     "output_splits": per_rank[dispatcher.tp_rank].tolist(),
                     "output_splits_tp": per_rank.sum(dim=1).tolist(), "tokens_per_local_expert":
                     per_local_expert.tolist()}
        self.by_layer.setdefault(layer, {"calls": 0, **self.last})["calls"] += 1
        return per_local_expert

    def _dropless_only(self, config: Any, site: str, seam: str) -> None:
        for flag, on in (("--moe-expert-capacity-factor (without --moe-pad-expert-input-to-capacity)",
                          config.moe_expert_capacity_factor is not None),
                         ("--moe-router-padding-for-quantization", config.moe_router_padding_for_quantization)):
            if on:
                from prism_plugin.device.values import NoValueError

                raise NoValueError(
                    f"prism virtual GPU: {site} ({seam}) reads the number of tokens kept per expert under {flag}, "
                    f"which depends on the routing values; the MoE routing policy (--prism-moe-routing "
                    f"{self.spec.name}) answers dropless routing only: drop the flag on virtual GPUs")

    def allgather_postprocess(self, dispatcher: Any, hidden_states: Any, probs: Any) -> Any:
        """`MoEAllGatherTokenDispatcher.dispatch_postprocess` with the counts from the policy.

        The gathered routing map holds every TP x EP source's tokens; a real rank sums its local experts' columns on
        the GPU and copies them to the host (``tokens_per_expert``), permutes the gathered tokens with that total
        (Megatron's argsort permute: fixed shapes once the total is known) and selects its local probabilities with
        ``masked_select``. Here the same kernels run on the same shapes, the total is the policy's, and the
        selection is a copy of the same size (its values are unknown either way)."""
        import torch
        from megatron.core.transformer.moe import token_dispatcher as td

        site = _call_site()
        self._dropless_only(dispatcher.config, site, "MoEAllGatherTokenDispatcher.dispatch_postprocess")
        sources = dispatcher.tp_size * dispatcher.ep_size
        gathered = int(dispatcher.routing_map.size(0))
        tokens, experts = gathered // sources, int(dispatcher.routing_map.size(1))
        layer = self._layers.setdefault(id(dispatcher), len(self._layers))
        first, local = dispatcher.local_expert_indices[0], dispatcher.num_local_experts
        dispatcher.hidden_shape_before_permute = hidden_states.shape
        dispatcher.local_map = dispatcher.routing_map[:, first:first + local].contiguous()
        dispatcher.local_probs = probs[:, first:first + local].contiguous()
        dispatcher.local_map.sum(dim=0).long()  # the column sums a real rank computes before its D2H copy
        counts = torch.tensor([self.source_counts(tokens, dispatcher.router_topk, experts, s, layer)
                               for s in range(sources)], dtype=torch.long, device="cpu")
        tokens_per_expert = counts[:, first:first + local].sum(dim=0)
        received = int(tokens_per_expert.sum())
        permuted, _, dispatcher.reversed_local_input_permutation_mapping, _, _ = td.permute(
            hidden_states, dispatcher.local_map, num_out_tokens=received, fused=dispatcher.config.moe_permute_fusion)
        probs_by_expert = dispatcher.local_probs.T.contiguous()
        dispatcher.local_map.T.contiguous()  # masked_select's mask, as Megatron passes it
        dispatcher.local_probs = probs_by_expert.reshape(-1)[:received].clone()  # masked_select's [received] output
        dispatcher.routing_map = None
        self.calls[site] += 1
        self.tokens_received += received
        self.last = {"tokens": tokens, "sources": sources, "tokens_per_local_expert": tokens_per_expert.tolist()}
        self.by_layer.setdefault(layer, {"calls": 0, **self.last})["calls"] += 1
        return permuted, tokens_per_expert, dispatcher.local_probs

    def summary(self) -> dict[str, Any]:
        """The policy, its answers per call site, the tokens sent / received, and each MoE layer's counts."""
        return {"policy": self.spec.name, "answers": sum(self.calls.values()),
                "by_site": [{"site": site, "count": n} for site, n in sorted(self.calls.items())],
                "tokens_sent": self.tokens_sent, "tokens_received": self.tokens_received,
                "layers": [self.by_layer[k] for k in sorted(self.by_layer)]}


def install(patches: Any, text: str | None = None) -> RoutingPolicy:
    """Replace the all-to-all dispatcher's count computation and the all-gather dispatcher's post-processing by the
    policy's (`text`: the policy, else
    ``PRISM_MOE_ROUTING``, else balanced); undone when `patches` closes."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    policy = RoutingPolicy(parse_routing(os.environ.get(ENV) if text is None else text))
    original = MoEAlltoAllTokenDispatcher.preprocess

    def preprocess(self: Any, routing_map: Any) -> Any:
        if self.drop_and_pad:  # counts are the capacity: Megatron's own path reads no value
            return original(self, routing_map)
        return policy.preprocess(self, routing_map)

    patches.setattr(MoEAlltoAllTokenDispatcher, "preprocess", preprocess)
    patches.setattr(MoEAllGatherTokenDispatcher, "dispatch_postprocess",
                    lambda self, hidden_states, probs: policy.allgather_postprocess(self, hidden_states, probs))
    _loss_scale_on_device(patches)
    return policy


def _loss_scale_on_device(patches: Any) -> None:
    """Megatron's MoE loss scale (``schedules._normalize_loss_scale``) calls ``torch.as_tensor(t, device=d)`` on a
    tensor already on `d`; the virtual GPU's device calls (`runtime.virtual_gpu.device`) assert on that no-op move
    (its ``torch.as_tensor`` path expects host data). Here the no-op is skipped, as ``as_tensor`` itself would."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import torch

    original = schedules._normalize_loss_scale

    def normalize(loss_scale: Any, device: Any, scale_func_name: str) -> Any:
        if isinstance(loss_scale, torch.Tensor) and loss_scale.device == torch.device(device) \
                and loss_scale.numel() == 1:
            return loss_scale
        return original(loss_scale, device, scale_func_name)  # anything else, and Megatron's own error

    patches.setattr(schedules, "_normalize_loss_scale", normalize)
