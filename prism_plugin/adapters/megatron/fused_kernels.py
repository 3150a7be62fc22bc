"""Megatron's fused kernels on virtual GPUs: ``@jit_fuser`` functions and its CUDA extensions, one kernel each.

On a GPU, megatron-core runs as one kernel each: the functions it decorates with ``megatron.core.jit.jit_fuser``
(``torch.compile``: bias-GeLU, bias-SwiGLU, bias-GeGLU, bias-dropout-add, weighted squared ReLU, the fused
cross-entropy pieces, ...), apex's gradient-accumulation GEMM (``fused_weight_gradient_mlp_cuda``) and its masked
softmax extensions (``scaled_masked_softmax_cuda``, ``scaled_upper_triang_masked_softmax_cuda``,
``scaled_softmax_cuda``). On virtual GPUs (fake tensors on a CPU host) nothing compiles and no extension loads;
`install` makes each of them a fusion region of the virtual GPU (`prism_plugin.device.fusion`): one
kernel of its FLOPs and of the bytes of its inputs and outputs, its intermediates never allocated. Undone by the
`Patches` given:

1. ``torch.compile`` is the virtual GPU's (`fusion.compile`: a function becomes a region). ``jit_fuser`` is bound
   to ``torch.compile`` when ``megatron.core.jit`` is imported and each decorator runs at its module's import, so
   this must precede Megatron's import: the drop-in calls `install_for_process` before it parses the job's
   arguments with Megatron's parser (the first Megatron import);
2. the fake extensions (`extensions`) go into ``sys.modules`` (``megatron.core.tensor_parallel.layers`` imports
   ``fused_weight_gradient_mlp_cuda`` at its own import, the softmax classes import theirs when called);
3. Megatron modules imported before (the native patch's path, or a program that imported Megatron first) are
   mended in place: every compiled function (``torch.compile``'s wrapper, holding ``_torchdynamo_orig_callable``)
   in a ``megatron.*`` module or class becomes a region of the original function, ``jit_fuser`` itself the
   virtual GPU's compile, and the tensor-parallel layers see the gradient-accumulation extension.

The kernels (each a region of the eager math, so its shapes, dtypes and allocations are the extension's):

- ``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16`` (input ``(..., k)``, grad_output ``(..., n)``, main_grad
  ``(n, k)``): ``main_grad += grad_output^T @ input`` in place, one GEMM kernel at the inputs' dtype (cuBLAS with a
  float32 / half accumulator C), reading both operands and main_grad and writing main_grad: no allocation;
- the softmax forwards (scale, mask (``masked_fill`` with -10000, apex's value) or the causal upper triangle,
  softmax in float32, output in the input's half dtype) and backwards (in place into the output gradients, as
  apex's kernels compute it, returning them): one ``norm``-class kernel each;
- ``scaled_masked_softmax_cuda.get_batch_per_block``: the extension's own formula (no kernel).

Each kernel runs with autograd off, as an extension's kernel is invisible to autograd (`extension_kernel`).

Limitations: the extensions' argument checks are reduced to dtype and rank (apex also bounds the key length); in
CPU mode none of this is installed (the adapter switches those defaults off there instead).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from prism_plugin.cost.kernels import KernelClass
from prism_plugin.device import fusion
from prism_plugin.device.undo import Patches

__all__ = ["EXTENSIONS", "extension_kernel", "extensions", "install", "install_for_process", "mend_imported"]

EXTENSIONS = ("fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
              "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
_HALF = (torch.float16, torch.bfloat16)
_MASKED = -10000.0  # apex's scaled_masked_softmax fills masked scores with this value
_PROCESS = Patches()
"""The seams of a virtual-GPU Megatron process, for its whole life (`install_for_process`)."""


# -- gradient-accumulation fusion ------------------------------------------------------------------------------


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    k, n = total_input.shape[-1], grad_output.shape[-1]
    if tuple(main_grad.shape) != (n, k):
        raise ValueError(f"wgrad_gemm_accum: main_grad {tuple(main_grad.shape)} is not (grad_output's {n}, input's "
                         f"{k})")
    main_grad.add_(torch.mm(grad_output.reshape(-1, n).t(), total_input.reshape(-1, k)))


def extension_kernel(fn: Callable[..., Any], name: str, kernel_class: KernelClass | None = None) -> Callable[..., Any]:
    """`fn` as one extension kernel: a fusion region that autograd does not see. A CUDA extension's kernel records
    nothing in the autograd graph, whatever the grad mode; the eager math standing in for it would (Megatron's
    ``drain_embedding_wgrad_compute`` calls the wgrad GEMM in grad mode with an activation that requires grad: the
    graph it recorded hung on ``main_grad`` and kept every deferred ``grad_output`` alive, +45% peak)."""
    region = fusion.fused(fn, name, kernel_class=kernel_class)

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return region(*args, **kwargs)

    return kernel


def _wgrad(name: str, accumulator: tuple[torch.dtype, ...]) -> Callable[..., None]:
    region = extension_kernel(_wgrad_gemm_accum, name)

    def wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if main_grad.dtype not in accumulator:
            raise TypeError(f"fused_weight_gradient_mlp_cuda.{name}: main_grad is {main_grad.dtype}, the kernel "
                            f"accumulates into {' or '.join(str(d) for d in accumulator)}")
        region(total_input, grad_output, main_grad)

    wgrad.__name__ = wgrad.__qualname__ = name
    return wgrad


# -- masked softmax ----------------------------------------------------------------------------------------------


def _check(name: str, inputs: torch.Tensor, dims: int) -> None:
    if inputs.dtype not in _HALF or inputs.dim() != dims:
        raise TypeError(f"{name}: the kernel takes a {dims}-d float16/bfloat16 tensor, got {inputs.dim()}-d "
                        f"{inputs.dtype}")


def _scale(scale: Any) -> float:
    return float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)


def _upper_triang_forward(inputs: torch.Tensor, scale: Any) -> torch.Tensor:
    _check("scaled_upper_triang_masked_softmax_cuda.forward", inputs, 3)
    sq, sk = inputs.shape[-2], inputs.shape[-1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu(1)
    scores = (inputs.float() * _scale(scale)).masked_fill(causal, float("-inf"))
    return torch.softmax(scores, dim=-1).to(inputs.dtype)


def _masked_forward(inputs: torch.Tensor, mask: torch.Tensor, scale: Any) -> torch.Tensor:
    _check("scaled_masked_softmax_cuda.forward", inputs, 4)
    scores = (inputs.float() * _scale(scale)).masked_fill(mask.bool(), _MASKED)
    return torch.softmax(scores, dim=-1).to(inputs.dtype)


def _plain_forward(inputs: torch.Tensor, scale: Any) -> torch.Tensor:
    _check("scaled_softmax_cuda.forward", inputs, 4)
    return torch.softmax(inputs.float() * _scale(scale), dim=-1).to(inputs.dtype)


def _softmax_backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: Any) -> torch.Tensor:
    """d inputs = scale * y * (g - sum(g * y)), written into the (contiguous) output gradients."""
    grads = output_grads.contiguous()
    g, y = grads.float(), softmax_results.float()
    grads.copy_((g - (g * y).sum(dim=-1, keepdim=True)) * y * _scale(scale))
    return grads


def _batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """apex's ``get_batch_per_block``: 128 threads a block, a warp per row of up to 32 lanes, 2 rows a warp up
    to 128 keys. ``get_batch_per_block(4096, 4096, 1, 16)`` -> 4 (a 4096-key row: one row per 32-lane warp)."""
    next_power_of_two = 1 << max(int(key_seq_len) - 1, 0).bit_length()
    warp_size = min(next_power_of_two, 32)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp


def extensions() -> dict[str, types.ModuleType]:
    """The fake extension modules, by import name (see the module docstring)."""
    wgrad = types.ModuleType("fused_weight_gradient_mlp_cuda", "prism: apex's wgrad GEMM on virtual GPUs")
    wgrad.wgrad_gemm_accum_fp32 = _wgrad("wgrad_gemm_accum_fp32", (torch.float32,))  # type: ignore[attr-defined]
    wgrad.wgrad_gemm_accum_fp16 = _wgrad("wgrad_gemm_accum_fp16", _HALF)  # type: ignore[attr-defined]
    out = {"fused_weight_gradient_mlp_cuda": wgrad}
    for module, forward in (("scaled_upper_triang_masked_softmax_cuda", _upper_triang_forward),
                            ("scaled_masked_softmax_cuda", _masked_forward), ("scaled_softmax_cuda", _plain_forward)):
        fake = types.ModuleType(module, f"prism: {module} on virtual GPUs")
        fake.forward = extension_kernel(forward, f"{module}.forward", KernelClass.NORM)  # type: ignore[attr-defined]
        fake.backward = extension_kernel(_softmax_backward, f"{module}.backward", KernelClass.NORM)  # type: ignore[attr-defined]
        fake.get_batch_per_block = _batch_per_block  # type: ignore[attr-defined]
        out[module] = fake
    return out


# -- installation ------------------------------------------------------------------------------------------------


def install(patches: Patches) -> int:
    """Steps 1-3 of the module docstring, undone by `patches`; returns how many imported bindings were mended."""
    original = torch.compile
    if original is not fusion.compile:
        patches.setattr(torch, "compile", fusion.compile)
    for name, module in extensions().items():
        if not _is_ours(sys.modules.get(name)):
            _set_module(patches, name, module)
    return mend_imported(patches, original)


def _is_ours(module: Any) -> bool:
    return isinstance(module, types.ModuleType) and str(module.__doc__ or "").startswith("prism:")


def _set_module(patches: Patches, name: str, module: types.ModuleType) -> None:
    previous = sys.modules.get(name)
    sys.modules[name] = module
    if previous is None:
        patches.callback(sys.modules.pop, name, None)
    else:
        patches.callback(sys.modules.__setitem__, name, previous)


def install_for_process() -> int:
    """`install` for the rest of this process's life (a virtual-GPU Megatron process: it ends with ``os._exit``)."""
    return install(_PROCESS)


def mend_imported(patches: Patches, compile_fn: Any = None) -> int:
    """Step 3: compiled functions in loaded ``megatron.*`` modules and their classes become regions, ``jit_fuser``
    bindings equal to `compile_fn` (torch's compile) the virtual GPU's; returns how many bindings changed."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            if compile_fn is not None and value is compile_fn:
                patches.setattr(module, attr, fusion.compile)
                count += 1
            elif _compiled(value) is not None:
                patches.setattr(module, attr, fusion.fused(_compiled(value), compiled=True))
                count += 1
            elif isinstance(value, type) and value.__module__ == name:
                for member, function in list(vars(value).items()):
                    if _compiled(function) is not None:
                        patches.setattr(value, member, fusion.fused(_compiled(function), compiled=True))
                        count += 1
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is not None and not getattr(layers, "_grad_accum_fusion_available", True):
        patches.setattr(layers, "_grad_accum_fusion_available", True)
        patches.setattr(layers, "fused_weight_gradient_mlp_cuda", sys.modules["fused_weight_gradient_mlp_cuda"])
        count += 1
    return count


def _compiled(value: Any) -> Callable[..., Any] | None:
    """The original function of a ``torch.compile``d one (None: `value` is not one)."""
    if not callable(value) or isinstance(value, type):
        return None
    original = getattr(value, "_torchdynamo_orig_callable", None)
    return original if callable(original) and getattr(value, "__prism_fused__", None) is None else None
