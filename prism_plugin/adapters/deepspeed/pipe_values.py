"""DeepSpeed's pipeline engine on virtual GPUs: its two data-dependent reads, answered exactly or refused.

Under fake tensors (DESIGN.md section 10) `PipelineEngine` reads values at two places (DeepSpeed 0.19.8,
``deepspeed/runtime/pipe/engine.py``); both are answered here from what the host knows, and every answer is
counted at its call site in the value policy's summary:

- ``__init__`` all-reduces ``[num_params, unique_params]`` over the model-parallel group and reads it with
  ``.tolist()``; the totals feed one ``logger.info`` line only (nothing else reads them). Answer: the sum over the
  pipeline stages, each stage's counts computed on the host from the `PipelineModule`'s layer specs (every rank
  holds all of them: ``_layer_specs``, partitioned by ``parts``) exactly as that stage builds them (a `LayerSpec`
  is built on the meta device, as DeepSpeed's own ``_count_layer_params`` builds it; a tied module counts once per
  stage, and its parameters leave ``unique`` on every stage but the lowest one holding it); this stage's own counts
  are the engine's. Exact, not invented. With tensor slicing (``model`` axis > 1) the slice peers' counts are not
  in the specs: each is taken as this rank's stage count (invented, counted as "mirror").
- ``_recv_tensor_meta`` receives an int32 description of the activations (type, dtype, ndims, shape) and reads it
  to size its buffers. No peer's value travels between fake tensors, so the description is the one
  ``_send_tensor_meta`` would send for the ``"pipe_activations"`` spec of the "prism" section (`pipe.encode_meta`,
  the user's statement of the previous stage's output); without it the read is refused naming the key.

Any other refused read in these methods is still refused (`NoValueError`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["install", "stage_param_counts"]

_ENGINE_FILE = "deepspeed/runtime/pipe/engine.py"


def _build_on_meta(spec: Any) -> torch.nn.Module:
    with torch.device("meta"):
        built = spec.build()
    off_meta = next((p.device for p in built.parameters() if p.device.type != "meta"), None)
    if off_meta is not None:
        raise RuntimeError(f"prism: counting the parameters of {spec!r} built them on {off_meta}, not the meta device "
                           "(the layer places its own parameters); the pipeline parameter counts cannot be derived")
    return built


def _count(module: torch.nn.Module, seen: set[int]) -> int:
    n = 0
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def stage_param_counts(module: Any) -> list[tuple[int, int]]:
    """``(num_params, unique_params)`` of every stage of a `PipelineModule`, as each stage's engine counts them.

    Layer specs are built on the meta device outside the fake (dispatch) modes: no host or virtual-GPU memory, no
    kernels, no values."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _stage_param_counts(module)


def _stage_param_counts(module: Any) -> list[tuple[int, int]]:
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    parts = list(module.parts)
    specs = list(module._layer_specs)
    tied_stages: dict[str, list[int]] = {}
    for stage in range(len(parts) - 1):
        for spec in specs[parts[stage]:parts[stage + 1]]:
            if isinstance(spec, TiedLayerSpec) and stage not in tied_stages.setdefault(spec.key, []):
                tied_stages[spec.key].append(stage)
    counts: list[tuple[int, int]] = []
    for stage in range(len(parts) - 1):
        seen: set[int] = set()
        tied: dict[str, int] = {}
        num = 0
        for spec in specs[parts[stage]:parts[stage + 1]]:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = _count(_build_on_meta(spec), set())
                    num += tied[spec.key]
            elif isinstance(spec, LayerSpec):
                num += _count(_build_on_meta(spec), set())
            elif isinstance(spec, torch.nn.Module):
                num += _count(spec, seen)
        # the tied module leaves `unique` on every stage but the lowest holding it (the engine's min(ranks))
        unique = num - sum(n for key, n in tied.items() if len(tied_stages[key]) > 1 and stage != tied_stages[key][0])
        counts.append((num, unique))
    return counts


def _engine_frame() -> Any | None:
    """The first frame outside torch and prism_plugin when it is in DeepSpeed's pipeline engine, else None."""
    from prism_plugin.device import values as values_mod

    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(values_mod._SKIP_DIRS) and not path.startswith(values_mod._OWN_DIR) \
                and "<frozen" not in path:
            return frame if path.replace("\\", "/").endswith(_ENGINE_FILE) else None
        frame = frame.f_back
    return None


def _param_answers(frame: Any) -> tuple[list[int], str]:
    engine = frame.f_locals["self"]
    num, unique = int(frame.f_locals["num_params"]), int(frame.f_locals["unique_params"])
    counts = stage_param_counts(engine.module)
    counts[engine.stage_id] = (num, unique)
    total, total_unique = sum(c[0] for c in counts), sum(c[1] for c in counts)
    slices = engine.grid.get_slice_parallel_world_size()
    if slices > 1:  # slice peers: not in the specs
        total += (slices - 1) * num
        total_unique += (slices - 1) * unique
        return [total, total_unique], (f"{total}, {total_unique} (pipeline parameter counts from the layer specs; "
                                       f"{slices - 1} tensor-slice peers mirror this rank's)")
    return [total, total_unique], f"{total}, {total_unique} (pipeline parameter counts from the layer specs: exact)"


def _meta_answers(frame: Any) -> tuple[list[int], str]:
    from deepspeed.runtime.pipe import engine as pipe_engine

    from prism_plugin.adapters.deepspeed import runtime
    from prism_plugin.adapters.deepspeed.pipe import encode_meta

    engine, send_stage = frame.f_locals["self"], frame.f_locals["send_stage"]
    emulation = runtime.active()
    spec = emulation.section.pipe_activations if emulation is not None else None
    if spec is None:
        raise NotImplementedError(
            f"prism virtual GPU: pipeline stage {engine.stage_id} (rank {engine.global_rank}) sizes its activation "
            f"buffers from stage {send_stage}'s tensor-meta message, and fake tensors carry no values. Give the "
            'shapes in the "prism" section, e.g. "pipe_activations": {"shape": [micro_batch, seq, hidden], '
            '"dtype": "bfloat16"} (a list for a tuple of tensors)')
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        values = encode_meta(spec, engine.DTYPE_TO_ID, pipe_engine.TENSOR_META_SIZE).tolist()
    used = 3 + values[2] if values[0] == 0 else _tuple_length(values)
    return values[:used], f"stage {send_stage}'s tensor meta = prism.pipe_activations ({values[:used]})"


def _tuple_length(values: list[int]) -> int:
    offset = 2
    for _ in range(values[1]):
        offset += 2 + values[offset + 1]
    return offset


def install(patches: Any, vgpu: Any) -> None:
    """Answer the pipeline engine's reads (module docstring); installed before the ZeRO answers capture ``read``."""
    from prism_plugin.device import values as values_mod

    policy = vgpu.values
    read = policy.read
    pending: dict[int, tuple[Iterator[int], str]] = {}  # id(engine frame) -> answers left, label (no frame refs:
    # a held frame would keep DeepSpeed's meta buffer and params tensor alive)

    def read_pipeline(tensor: Any) -> Any:
        frame = _engine_frame()
        name = frame.f_code.co_name if frame is not None else None
        if name == "__init__":
            if not isinstance(frame.f_locals.get("params_tensor"), torch.Tensor):  # only the .tolist() of the counts
                return read(tensor)
        elif name != "_recv_tensor_meta":
            return read(tensor)
        key = id(frame)
        if key not in pending:
            answers, label = _param_answers(frame) if name == "__init__" else _meta_answers(frame)
            pending[key] = (iter(answers), label)
        answers_left, label = pending[key]
        del frame
        value = next(answers_left, None)
        if value is None:  # every answer given; DeepSpeed reads no more there: refuse rather than guess
            pending.pop(key, None)
            return read(tensor)
        policy.answers[(values_mod._call_site(), label)] += 1
        return value

    patches.setattr(policy, "read", read_pipeline)
