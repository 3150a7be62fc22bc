"""`prism_plugin/programs/pretrain_gpt.py` with Megatron's local-spec torch norm accepting ``--sequence-parallel``.

A validation-only workaround, not part of prism: NVIDIA's published H100 recipes with tensor parallelism all run
with sequence parallelism (NeMo's default for TP > 1), and without it their activations do not fit in 80 GB.
Megatron's local layer spec (``--transformer-impl local``, the only spec on a host without TransformerEngine)
asserts ``sequence parallel not supported by torch LayerNorm``: the SP-capable norm is apex's ``FusedLayerNorm``.
Prism's CPU shim lifts that assertion in CPU mode (its patch 10); in virtual-GPU mode it is not applied, so this
script applies the same replacement before running the unmodified program: with ``--sequence-parallel`` the norm
is the same ``torch.nn.LayerNorm`` / ``RMSNorm`` (the math of ``FusedLayerNorm``), and its weight and bias are
marked ``sequence_parallel`` as ``FusedLayerNorm`` marks them, so ``finalize_model_grads`` all-reduces their
gradients over the tensor-parallel group. Everything else (the sequence-parallel linear layers' all-gather /
reduce-scatter, the schedules, the optimizer) is Megatron's own code.

    prism emulate --world-size N -- validation/sp_pretrain_gpt.py <Megatron arguments> --sequence-parallel
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm

_PROGRAM = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "pretrain_gpt.py"
_original_new = WrappedTorchNorm.__new__


def _norm_new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
    if not config.sequence_parallel or config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
        return _original_new(cls, config, hidden_size, eps, *args, **kwargs)
    norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    if config.normalization not in norms:
        return _original_new(cls, config, hidden_size, eps, *args, **kwargs)
    norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


WrappedTorchNorm.__new__ = staticmethod(_norm_new)

if __name__ == "__main__":
    sys.argv[0] = str(_PROGRAM)
    runpy.run_path(str(_PROGRAM), run_name="__main__")
