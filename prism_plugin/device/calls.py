"""The torch-function layer of a virtual GPU: integer devices, moves between devices, tensors from data.

`DeviceCalls` is the `TorchFunctionMode` `prism_plugin.device.device.VirtualGpu` enters above its dispatch mode:
calls the CPU wheel would refuse before any dispatch (an integer device goes to its accelerator API,
``Tensor.to(cuda)`` initialises CUDA) are answered here, and ``F.scaled_dot_product_attention`` takes torch's
FlashAttention kernel as a GPU's torch would pick it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from prism_plugin.device.leaves import leaves
from prism_plugin.device.values import ValuePolicy

__all__ = ["DeviceCalls"]

_FROM_DATA = {torch.tensor, torch.as_tensor}
_DEVICE_ARG = {torch.Tensor.to: 1, torch.Tensor.cuda: 1, torch._C._nn._parse_to: 0}
"""Calls whose positional argument at this index may be a device (Module.to(i) parses through _parse_to)."""


class DeviceCalls(TorchFunctionMode):
    """Resolve an integer device into ``cuda:<i>`` and move tensors to a virtual GPU without the CUDA runtime.

    The CPU wheel refuses both before any dispatch: an int device goes to its accelerator API, and
    ``Tensor.to(cuda)`` / ``.cuda()`` initialise CUDA. A move to another device becomes a new fake tensor of
    the same shape, dtype and layout there (fake tensors hold no values to copy); limitation: it is a leaf, so
    no gradient flows back through the move (parameter moves run under no_grad, batches need none). A move of
    host memory the emulator holds as fake (no constant: ZeRO's offloaded partitions and host buffers) to the GPU
    is the H2D copy a GPU runs, one ``host_copy`` kernel (``copy_``); a move of a real host tensor (data the
    program read: a batch) and a move to the host (``_to_copy``) are still made without a kernel.
    """

    def __init__(self, values: ValuePolicy) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, int) and not isinstance(device, bool):
            kwargs = {**kwargs, "device": torch.device("cuda", device)}
            device = kwargs["device"]
        if kwargs.get("pin_memory"):  # pinned host memory needs the CUDA library: the same host tensor, unpinned
            # (Megatron's RoPE CP index, .cuda()'d next; its activation offloading's host pool, torch.empty)
            kwargs = {**kwargs, "pin_memory": False}
        if func in _FROM_DATA and args and _holds_cuda_fakes(args[0]):
            # torch.tensor([gpu scalars]) reads each element's value in C++, below every mode (Megatron's
            # local_multi_tensor_l2_norm): the same tensor from the elements, made on the host, values unknown
            return _stack_on(args[0], kwargs.get("dtype"), torch.device(device) if device is not None
                             else torch.device("cpu"))
        if func in _FROM_DATA and device is not None and torch.device(device).type == "cuda":
            # torch.tensor(data, device="cuda") builds on the CPU and copies below any mode: build the CPU fake,
            # move it, and keep the data's real values (small tensors only) for later reads
            host_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            moved = _move(func(*args, **host_kwargs), (device,), {})
            assert moved is not None
            try:
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    real = func(*args, **host_kwargs)
            except Exception:  # the data holds fake tensors: no real values to keep
                return moved
            self.values.tag_data(moved, real)
            return moved
        if func is torch.nn.functional.scaled_dot_product_attention:
            flash = _flash_attention(args, kwargs)
            if flash is not None:
                return flash
        if func is torch.Tensor.numpy and args and isinstance(args[0], FakeTensor):
            return self._numpy(args[0])
        i = _DEVICE_ARG.get(func)
        if i is not None and len(args) > i and isinstance(args[i], int) and not isinstance(args[i], bool):
            args = (*args[:i], torch.device("cuda", args[i]), *args[i + 1:])
        if func is torch.Tensor.cuda:
            target = args[1] if len(args) > 1 else kwargs.get("device")
            args, kwargs = (args[0], torch.device("cuda") if target is None else torch.device(target)), {}
            func = torch.Tensor.to
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            moved = _move(args[0], args[1:], kwargs)
            if moved is not None:
                return self._moved(args[0], moved)
        return func(*args, **kwargs)

    def _numpy(self, tensor: FakeTensor) -> Any:
        """``Tensor.numpy()``: torch refuses it for any tensor subclass; a host fake's values come from the value
        policy (counted); a GPU tensor is refused as torch refuses it."""
        if tensor.device.type != "cpu":
            raise TypeError(f"can't convert {tensor.device} device type tensor to numpy. Use Tensor.cpu() to copy "
                            "the tensor to host memory first.")
        return self.values.read_array(tensor)

    def _moved(self, source: torch.Tensor, moved: torch.Tensor | None) -> torch.Tensor:
        """`moved` keeps a small `source`'s values (a constant the program made from data) for later reads."""
        assert moved is not None
        constant = self.values._data_of(source)
        if constant is not None:
            with _disable_current_modes():  # the constant is a real tensor: copy it outside the fake modes
                self.values.tag_data(moved, constant.clone())
        return moved


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _flash_attention(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention`` as torch runs it on an sm80+ GPU when FlashAttention applies: the fused
    ``aten._scaled_dot_product_flash_attention`` (saves the output and log-sum-exp, not the s x s scores; one
    kernel forward, one backward). torch picks its backend in C++ from the device's kernels, which the CPU wheel
    lacks for cuda (it would take the unfused math path); this is the choice of torch's sdp_utils for flash:
    fp16/bf16, no explicit mask, head dim a multiple of 8 up to 256, 4-d inputs, flash enabled
    (``torch.backends.cuda.flash_sdp_enabled()``); key/value heads dividing the query heads (GQA). Anything else
    (None) runs the call as given."""
    bound = dict(zip(_SDPA_ARGS, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in (q, k, v)):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if (bound.get("attn_mask") is not None or not torch.backends.cuda.flash_sdp_enabled()
            or q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype
            or q.dim() != 4 or k.dim() != 4 or q.size(-1) % 8 or q.size(-1) > 256 or q.size(-1) != k.size(-1)):
        return None
    if q.size(1) != k.size(1) and (not bound.get("enable_gqa") or q.size(1) % k.size(1)):
        return None
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, float(bound.get("dropout_p") or 0.0), bool(bound.get("is_causal")), False,
        scale=bound.get("scale"))
    return out[0]


def _holds_cuda_fakes(data: Any) -> bool:
    return isinstance(data, list | tuple) and any(
        isinstance(x, FakeTensor) and x.device.type == "cuda" for x in leaves(data))


def _stack_on(data: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """What ``torch.tensor(data)`` makes of nested lists of (fake) tensors: their stack, on `device`."""
    if isinstance(data, torch.Tensor):
        out = _move(data, (device,), {}) if data.device.type != device.type else data
        return (data if out is None else out).to(dtype) if dtype is not None else (data if out is None else out)
    if isinstance(data, list | tuple):
        return torch.stack([_stack_on(x, dtype, device) for x in data])
    return torch.tensor(data, dtype=dtype, device=device)


def _move(t: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        device, dtype = args[0].device, args[0].dtype
        memory_format = torch.preserve_format
    else:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is None or torch.device(device).type == t.device.type:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype or t.dtype
    if device.type == "cpu" and isinstance(t, FakeTensor):
        # to the host: the copy ``.cpu()`` makes (a blocking copy kernel; a host fake, whose reads the value policy
        # answers). A factory here would run for real on the host (host-only ops do) and hand the program
        # uninitialised memory as values
        return torch.ops.aten._to_copy.default(t, dtype=dtype, device=device)
    # a factory, not empty_like(t): FakeTensorMode would run empty_like on t's constant (a real CPU tensor)
    if memory_format in (None, torch.preserve_format) and is_non_overlapping_and_dense_or_false(t):
        out = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=device)
    else:
        out = torch.empty(t.size(), dtype=dtype, device=device,
                          memory_format=torch.contiguous_format if memory_format in (None, torch.preserve_format)
                          else memory_format)
    if isinstance(t, FakeTensor) and t.device.type == "cpu" and device.type == "cuda" and t.constant is None:
        # host memory the emulator holds as fake (ZeRO-Infinity's offloaded parameter partitions, a framework's
        # host staging buffers): the move is the H2D copy a GPU runs, one host_copy kernel over the host link
        with torch.no_grad():
            out.copy_(t)
    return out.requires_grad_(t.requires_grad) if out.is_floating_point() else out
