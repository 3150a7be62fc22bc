"""`pipe_values.stage_param_counts`: each pipeline stage's (num_params, unique_params) from the layer specs, as that
stage's `PipelineEngine` counts them (the exact answer to the engine's parameter-count all-reduce on virtual GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

from prism_plugin.adapters.deepspeed.pipe_values import stage_param_counts


def test_layer_specs_tied_modules_and_module_instances() -> None:
    shared = torch.nn.Linear(4, 4)  # 20 parameters, given twice on stage 1: counted once, as module.parameters()
    frozen = torch.nn.Linear(4, 2)
    frozen.weight.requires_grad_(False)  # 8 frozen + 2 trainable
    specs = [TiedLayerSpec("embed", torch.nn.Embedding, 10, 4),  # 40 parameters, on stages 0 and 2
             LayerSpec(torch.nn.Linear, 4, 8),  # 40
             shared, shared, frozen,
             LayerSpec(torch.nn.GELU),
             TiedLayerSpec("embed", torch.nn.Embedding, 10, 4), TiedLayerSpec("embed", torch.nn.Embedding, 10, 4)]
    module = SimpleNamespace(parts=[0, 2, 5, 8], _layer_specs=specs)
    # the tied embedding leaves `unique` on every stage holding it but the lowest (stage 0); twice on stage 2: once
    assert stage_param_counts(module) == [(80, 80), (22, 22), (40, 0)]


def test_a_tie_within_one_stage_only_is_not_subtracted() -> None:
    specs = [TiedLayerSpec("w", torch.nn.Linear, 3, 3), TiedLayerSpec("w", torch.nn.Linear, 3, 3),
             LayerSpec(torch.nn.Linear, 3, 1)]
    assert stage_param_counts(SimpleNamespace(parts=[0, 2, 3], _layer_specs=specs)) == [(12, 12), (4, 4)]
