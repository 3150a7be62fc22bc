"""Pipeline transfers with virtual stages: the tensor-meta handshake from a virtual previous stage.

`PipelineEngine` sends activations with blocking ``p2p.send/recv`` on the world group; the backend
emulates the virtual side (a receive from a virtual stage mirrors the last tensor this rank sent with
the same shape and dtype, else zeros: gradients from a virtual next stage mirror the activations
sent to it, which have their shape). The exception is the first receive from the previous stage:
``_recv_tensor_meta`` reads an int32[256] description (type, dtype, ndims, shape of each tensor) and
allocates the activation buffers from it. No earlier send of this rank can stand in for it, and
zeros describe a 0-dim tensor, so a real middle or last stage would run its layers on scalars.

This module supplies that description when the previous stage is virtual:
- policy RECORDED: nothing to do, the recorded handshake is replayed bit for bit;
- otherwise: the ``"pipe_activations"`` spec of the "prism" section, encoded exactly as
  ``_send_tensor_meta`` encodes it and handed to the backend as the payload of that receive;
- neither: `NotImplementedError` naming both fixes (never a guessed shape).

On a virtual GPU no value travels between fake tensors: there `pipe_values` answers the reads of the
description from the same spec (for any previous stage, real or virtual) and no payload is handed over.

The activations themselves then arrive as the backend's mirror values (zeros for the first micro-batch
of a stage that has not sent that shape yet; valid, finite).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prism_plugin.adapters.deepspeed.section import TensorSpec
from prism_plugin.config.kinds import DataPolicy

if TYPE_CHECKING:
    from prism_plugin.adapters.deepspeed.runtime import DeepSpeedEmulation

__all__ = ["install", "encode_meta"]


def encode_meta(spec: TensorSpec | tuple[TensorSpec, ...], dtype_to_id: dict[torch.dtype, int],
                size: int) -> torch.Tensor:
    """The int32 meta buffer DeepSpeed's ``_send_tensor_meta`` sends for tensors of `spec`.

    >>> ids = {torch.float32: 0}
    >>> encode_meta(TensorSpec(shape=(2, 8)), ids, 8).tolist()
    [0, 0, 2, 2, 8, 0, 0, 0]
    """
    if isinstance(spec, TensorSpec):
        values = [0, dtype_to_id[getattr(torch, spec.dtype)], len(spec.shape), *spec.shape]
    else:
        values = [2, len(spec)]
        for s in spec:
            values += [dtype_to_id[getattr(torch, s.dtype)], len(s.shape), *s.shape]
    if len(values) > size:
        raise ValueError(f"prism.pipe_activations needs {len(values)} meta entries; DeepSpeed's buffer has {size}")
    out = torch.zeros(size, dtype=torch.int32)
    out[: len(values)] = torch.tensor(values, dtype=torch.int32)
    return out


def install(emulation: DeepSpeedEmulation) -> None:
    from deepspeed.runtime.pipe import engine as pipe_engine

    from prism_plugin.adapters.deepspeed import virtual_gpu

    cls = pipe_engine.PipelineEngine
    original = vars(cls)["_recv_tensor_meta"]
    section = emulation.section
    world = section.emulation.world
    recorded = section.emulation.data_policy is DataPolicy.RECORDED

    def _recv_tensor_meta(self: Any, send_stage: int) -> Any:
        src = self.grid.stage_to_global(stage_id=send_stage)
        if recorded or world.is_real(src) or virtual_gpu.active_gpu() is not None:
            return original(self, send_stage)  # on a virtual GPU `pipe_values` answers the meta reads
        spec = section.pipe_activations
        if spec is None:
            raise NotImplementedError(
                f"prism: pipeline stage {self.stage_id} (rank {self.global_rank}) receives its activations from "
                f"stage {send_stage} (rank {src}), which is virtual, and DeepSpeed sizes its receive buffers from "
                'that stage\'s tensor-meta message. Give the shapes in the "prism" section, e.g. "pipe_activations": '
                '{"shape": [micro_batch, hidden], "dtype": "float32"} (a list for a tuple of tensors), or replay a '
                'recording ("data_policy": "recorded"), or make that rank real.'
            )
        payload = encode_meta(spec, self.DTYPE_TO_ID, pipe_engine.TENSOR_META_SIZE).to(self.device)
        dist.group.WORLD.vg.pending_root_payloads.append(payload)
        return original(self, send_stage)

    emulation.patches.setattr(cls, "_recv_tensor_meta", _recv_tensor_meta)
