"""Megatron's fine-grained activation offloading (``--fine-grained-activation-offloading``) on virtual GPUs.

``pipeline_parallel/fine_grained_activation_offload.py`` offloads a layer group's saved activations to pinned host
memory during the forward and reloads them for the backward. It manages only device tensors that are not
"stray": ``ChunkOffloadHandler._can_manage_tensor_for_offload`` refuses a ``FakeTensor`` (one a ``torch.compile``
trace makes, which holds no data to move). On a virtual GPU every device tensor of the program is a FakeTensor, so
nothing was offloaded: the device kept every activation (a functional case's modelled peak was +112% of its golden
value) and a case with multi-token prediction stopped at "Chunk mismatch" (its backward found no offloaded group).
`install` makes a FakeTensor on the CUDA device manageable like the real tensor it stands for (a FunctionalTensor,
a Parameter or a host tensor is still refused); the copies then run as the program issues them: device to host
and back, timed on the host link, the device blocks freed and allocated by the allocator model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install"]


def install(patches: Any) -> None:
    """Patch ``ChunkOffloadHandler._can_manage_tensor_for_offload`` (when Megatron has it) for this process."""
    import torch

    try:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload
    except ImportError:  # a megatron-core without the feature
        return
    handler = getattr(offload, "ChunkOffloadHandler", None)
    if handler is None or "_can_manage_tensor_for_offload" not in vars(handler):
        return

    def _can_manage_tensor_for_offload(tensor: Any) -> bool:
        """A device activation, the virtual GPU's fake ones included (not a Parameter, not a functional tensor)."""
        return (not isinstance(tensor, torch.nn.Parameter)
                and not isinstance(tensor, torch._subclasses.functional_tensor.FunctionalTensor)
                and tensor.device.type == "cuda")

    patches.setattr(handler, "_can_manage_tensor_for_offload", staticmethod(_can_manage_tensor_for_offload))
