"""TransformerEngine's fused MoE router kernels on virtual GPUs (Megatron's ``--moe-router-fusion``).

``transformer_engine.pytorch.router`` (TE 2.14) calls six functions of the compiled extension: the top-k with its
score function (softmax, sigmoid or sqrt-softplus; grouped top-k and an expert bias included), the scores for the
auxiliary loss, and the auxiliary loss itself, each forward and backward. Each allocates what TE's C++
(``csrc/extensions/router.cpp``) allocates, in its order: ``probs`` in the logits' dtype, a bool ``routing_map``
and an fp32 ``intermediate_output`` ([tokens, experts] each) for the top-k; fp32 ``scores``, ``routing_map`` and
``intermediate_output`` for the aux-loss scores; a scalar ``aux_loss`` in the probabilities' dtype and a 2-element
fp32 ``Const_buf`` for the loss, whose backward allocates ``grad_probs``. The two other backwards write the
``grad_logits`` TE's Python allocated. Each is one memory-bound kernel (`ops.pointwise`) of the bytes it reads and
writes.

Values: none. The routing map's values are never read: the MoE token dispatcher's counts come from the routing
policy (`prism_plugin.adapters.megatron.moe`), whichever router produced the map.

The fp32 ``intermediate_output`` and scores are inferred, not read from the 2.14 tag: TE's C++ made them fp32 in
the same change that moved ``grad_logits``' allocation to Python, which 2.14's Python does.
"""

from __future__ import annotations

from typing import Any

import torch

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device.te import ops

__all__ = ["names"]


def _empty(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _maps(logits: torch.Tensor, first: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (int(logits.shape[0]), int(logits.shape[1]))
    return _empty(shape, first, logits), _empty(shape, torch.bool, logits), _empty(shape, torch.float32, logits)


def fused_topk_with_score_function_fwd(logits: torch.Tensor, topk: int, use_pre_softmax: bool, num_groups: Any,
                                       group_topk: Any, scaling_factor: Any, score_function: str,
                                       expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(probs, routing_map, intermediate_output)``."""
    outputs = _maps(logits, logits.dtype)
    inputs = [logits] if expert_bias is None else [logits, expert_bias]
    ops.pointwise("router_topk_fwd")(inputs, outputs=list(outputs))
    return outputs


def fused_topk_with_score_function_bwd(num_tokens: int, num_experts: int, routing_map: torch.Tensor,
                                       intermediate_output: torch.Tensor, grad_probs: torch.Tensor,
                                       grad_logits: torch.Tensor, *rest: Any) -> None:
    ops.pointwise("router_topk_bwd")([routing_map, intermediate_output, grad_probs], outputs=[grad_logits])


def fused_score_for_moe_aux_loss_fwd(logits: torch.Tensor, topk: int,
                                     score_function: str) -> tuple[torch.Tensor, ...]:
    """``(scores, routing_map, intermediate_output)``, scores in fp32."""
    outputs = _maps(logits, torch.float32)
    ops.pointwise("router_aux_scores_fwd")([logits], outputs=list(outputs))
    return outputs


def fused_score_for_moe_aux_loss_bwd(num_tokens: int, num_experts: int, intermediate_output: torch.Tensor,
                                     grad_scores: torch.Tensor, grad_logits: torch.Tensor, topk: int,
                                     score_function: str) -> None:
    ops.pointwise("router_aux_scores_bwd")([intermediate_output, grad_scores], outputs=[grad_logits])


def fused_moe_aux_loss_fwd(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                           num_experts: int, num_rows: int, num_cols: int, topk: int,
                           coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux_loss, Const_buf)``: a scalar in the probabilities' dtype, and 2 fp32 constants for the backward."""
    aux_loss, const_buf = _empty((), probs.dtype, probs), _empty((2,), torch.float32, probs)
    ops.pointwise("router_aux_loss_fwd", KernelClass.REDUCTION)([probs, tokens_per_expert],
                                                                 outputs=[aux_loss, const_buf])
    return aux_loss, const_buf


def fused_moe_aux_loss_bwd(Const_buf: torch.Tensor, tokens_per_expert: torch.Tensor, num_rows: int,  # noqa: N803
                           num_cols: int, grad_aux_loss: torch.Tensor) -> torch.Tensor:
    """``grad_probs`` [rows, cols] in the loss gradient's dtype."""
    grad_probs = _empty((num_rows, num_cols), grad_aux_loss.dtype, grad_aux_loss)
    ops.pointwise("router_aux_loss_bwd")([Const_buf, tokens_per_expert, grad_aux_loss], outputs=[grad_probs])
    return grad_probs


def names() -> dict[str, Any]:
    """The extension's names this module answers."""
    return {f.__name__: f for f in (
        fused_topk_with_score_function_fwd, fused_topk_with_score_function_bwd, fused_score_for_moe_aux_loss_fwd,
        fused_score_for_moe_aux_loss_bwd, fused_moe_aux_loss_fwd, fused_moe_aux_loss_bwd)}
