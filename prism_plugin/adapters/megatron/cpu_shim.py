"""CPU mode: numbered, undoable patches that let unmodified Megatron-core train on a CPU-only torch.

Purpose: functional debugging, memory figures and the whole test suite without a GPU. Megatron-core
0.19 assumes CUDA everywhere (``device=torch.cuda.current_device()`` at ~200 sites, CUDA RNG
trackers, streams, ``device="cuda"`` literals). Each patch below is the smallest change that makes
one observed failure go away (patch 9: a per-process cost); every one lists that failure, and
``integration_tests/megatron/test_megatron_adapter.py`` runs, for each, the Megatron code path it
fixes with all patches but that one (it fails as listed) and with the full shim (it passes).

Scope: `CpuShim.install()` is called by the Megatron adapter only in an emulated process whose
torch has no CUDA (it refuses to install when CUDA is available: real devices need no shim), and
`uninstall()` undoes every patch in reverse order. Nothing is patched at import.

Patches (the numbers are stable; `skip=` leaves some out, for ablation):

1. RNG: ``torch.cuda.{get_rng_state,set_rng_state,manual_seed,manual_seed_all}`` and megatron's
   ``tensor_parallel.random._{get,set}_cuda_rng_state`` act on the CPU default generator.
   Fixes ``model_parallel_cuda_manual_seed`` / ``CudaRNGStatesTracker.add/fork``:
   ``AssertionError: Torch not compiled with CUDA enabled``. Semantics: the CUDA generator *is*
   the CPU generator, so tracker forks still isolate model-parallel random streams.
2. ``torch.cuda.current_device() -> 0``: the ~200 ``device=torch.cuda.current_device()`` sites
   (GlobalMemoryBuffer, p2p receive buffers, DDP/optimizer buffers) and ``f"cuda:{...}"``
   formatting get a valid index; patch 3 maps that device to the CPU.
   Fixes ``AssertionError: Torch not compiled with CUDA enabled`` from ``_lazy_init``.
3. A TorchFunctionMode maps CUDA devices to the CPU: ``device=`` given as ``"cuda"``,
   ``"cuda:N"``, ``torch.device("cuda", N)`` or an int; ``Tensor.to(<cuda>)``; ``Tensor.cuda()``
   is the identity; ``pin_memory=True`` is dropped. Fixes e.g. schedules.py
   ``torch.zeros([], dtype=torch.int, device="cuda")`` (every pipeline schedule) and
   ``Tensor.cuda()`` in the training loop: ``Torch not compiled with CUDA enabled``. The mode is
   re-entered inside autograd's engine, so custom ``autograd.Function.backward`` code (the
   sequence-parallel linear layers) is mapped too: ``Cannot access accelerator device``.
4. ``torch.cuda.synchronize`` is a no-op (p2p_communication after batched isend/irecv:
   ``Torch not compiled with CUDA enabled``).
5. (inside the mode of 3) ``Tensor.type()`` reports ``torch.cuda.FloatTensor`` etc. for CPU
   tensors: the mixed-precision / distributed optimizers and clip_grads compare type strings:
   ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...``.
6. ``torch.cuda.{current_stream,default_stream,Stream,Event,stream}`` return inert stand-ins
   (DDP ``ParamAndGradBuffer.start_grad_sync/finish_grad_sync``, optimizer overlap, timers):
   ``Torch not compiled with CUDA enabled`` / ``RuntimeError: ... no CUDA GPUs``.
7. ``torch.cuda.is_available() -> True`` and ``torch.cuda.device_count() -> 1`` while the shim
   is installed: megatron.training asserts ``torch.cuda.is_available()`` ("Megatron requires
   CUDA.") and only runs ``initialize_model_parallel`` and the model-parallel seeding when
   ``torch.cuda.device_count() > 0``.
8. Device queries and memory statistics: ``get_device_properties`` / ``get_device_capability`` /
   ``get_device_name`` / ``set_device`` / ``reset_peak_memory_stats`` raise on a CPU-only torch
   (megatron.training's ``get_device_arch_version()`` in argument validation: ``Torch not compiled
   with CUDA enabled``); they answer for a "cpu" device (capability 0.0) instead. The memory
   statistics (``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
   ``max_memory_reserved``, ``memory_stats``), which silently report 0 there, report the CPU
   tensor-storage tracker of `prism_plugin.device.memory` when one runs, so Megatron's own memory report
   prints the emulated rank's figures.
9. ``torch.compile`` runs eagerly (``torch._dynamo.config.disable``): megatron.training's
   ``_warmup_jit_function`` and the ``jit_fuser`` fused bias-gelu/bias-dropout kernels would
   otherwise compile C++ with inductor on every process start (tens of seconds on 2 cores);
   eager results are the reference numerics on CPU anyway.
10. The local spec's norm (``WrappedTorchNorm``) accepts ``sequence_parallel`` and
    ``persist_layer_norm``: without apex, Megatron's local layer spec asserts
    ``sequence parallel not supported by torch LayerNorm`` / ``persist_layer_norm not supported``
    (the SP-capable ``FusedLayerNorm`` needs apex CUDA kernels). With either flag set it builds the
    same ``torch.nn.LayerNorm`` / ``RMSNorm`` and marks its weight and bias
    ``sequence_parallel`` as ``FusedLayerNorm`` does, so ``finalize_model_grads`` all-reduces
    their gradients over the TP group. ``persist_layer_norm`` only selects an apex kernel (same
    math). Zero-centred gamma and memory-efficient layer norm still hit Megatron's own asserts.

Limitations: memory figures of patch 8 are tensor storage bytes (no allocator rounding or
caching); ``torch.cuda.Event.elapsed_time`` is 0, so Megatron's own timers report host time
only; CUDA graphs, TransformerEngine, fused/Apex kernels and triton kernels are not shimmed and
must be disabled (the adapter's refusals name the flags).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.overrides

from prism_plugin.device.active import Slot, slot
from prism_plugin.device.undo import Patches

__all__ = ["CpuPatch", "CpuShim", "PATCHES", "active_shim", "install_sp_norm", "sp_norm_new"]


@dataclass(frozen=True, slots=True)
class CpuPatch:
    """One numbered CUDA->CPU patch and the failure it fixes."""

    number: int
    title: str
    fixes: str
    """The error Megatron raises on a CPU-only torch without this patch, and where."""


PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch(1, "CUDA RNG -> CPU generator", "model_parallel_cuda_manual_seed: Torch not compiled with CUDA enabled"),
    CpuPatch(2, "torch.cuda.current_device() -> 0", "device=torch.cuda.current_device(): no CUDA"),
    CpuPatch(3, "TorchFunctionMode: cuda devices -> cpu", "schedules.py torch.zeros(device='cuda'): no CUDA"),
    CpuPatch(4, "torch.cuda.synchronize no-op", "p2p_communication synchronize: no CUDA"),
    CpuPatch(5, "Tensor.type() -> torch.cuda.*", "optimizer: Wrapped parameters must be one of torch.cuda.*"),
    CpuPatch(6, "CUDA streams/events -> inert", "DDP grad sync current_stream(): no CUDA"),
    CpuPatch(7, "is_available/device_count -> True/1", "initialize_megatron: Megatron requires CUDA."),
    CpuPatch(8, "device queries, memory stats -> CPU", "get_device_arch_version: Torch not compiled with CUDA"),
    CpuPatch(9, "torch.compile -> eager", "_warmup_jit_function: inductor C++ compile per process"),
    CpuPatch(10, "torch norm with sequence parallel",
             "TransformerLayer: sequence parallel not supported by torch LayerNorm"),
)


class _Event:
    """Inert `torch.cuda.Event`: records nothing; elapsed time is 0 (host timers still work)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    """Inert `torch.cuda.Stream`: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = 0

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_DEFAULT_STREAM = _Stream()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Patch 3 (and 5): every CUDA device request becomes the CPU."""

    def __init__(self, cuda_type_strings: bool) -> None:
        super().__init__()
        self.cuda_type_strings = cuda_type_strings

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _SPECIAL:
            if func is _TENSOR_CUDA:
                return args[0]
            if func is _TENSOR_TYPE and self.cuda_type_strings and len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
        if not kwargs:
            return func(*args)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_SPECIAL = frozenset({_TENSOR_CUDA, _TENSOR_TYPE, _TENSOR_TO})


def _mode_active(mode: torch.overrides.TorchFunctionMode) -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(m is mode for m in _get_current_function_mode_stack())


def _cuda_memory_stats() -> dict[str, int]:
    from prism_plugin.device import memory

    tracker = memory.current_tracker()
    current = tracker.current_bytes if tracker is not None else 0
    peak = tracker.peak_bytes if tracker is not None else 0
    return {
        "allocated_bytes.all.current": current,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": current,
        "reserved_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


class _DeviceProperties:
    name = "cpu (prism CPU mode)"
    major = 0
    minor = 0
    total_memory = 0
    multi_processor_count = 1


def sp_norm_new(original: Any) -> Any:
    """Patch 10's ``WrappedTorchNorm.__new__``: with ``sequence_parallel`` (or ``persist_layer_norm``) the local
    spec's norm is the same ``torch.nn.LayerNorm`` / ``RMSNorm`` (the math of apex's ``FusedLayerNorm``), its
    parameters marked ``sequence_parallel`` as ``FusedLayerNorm`` marks them (so ``finalize_model_grads``
    all-reduces their gradients over the TP group); anything else goes to `original`. Also used on virtual GPUs
    (`install_sp_norm`), where the rest of the CPU shim is not."""

    def norm_new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        plain = not (config.sequence_parallel or config.persist_layer_norm)
        if plain or config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm

    return norm_new


def install_sp_norm(patches: Patches) -> None:
    """Patch 10 alone (virtual GPUs: sequence parallelism with the local spec), undone by `patches`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    patches.setattr(WrappedTorchNorm, "__new__", staticmethod(sp_norm_new(WrappedTorchNorm.__new__)))


class CpuShim:
    """The set of installed patches; `install()` / `uninstall()` are exact inverses."""

    def __init__(self, skip: Iterable[int] = ()) -> None:
        self.skip = frozenset(int(s) for s in skip)
        unknown = self.skip - {p.number for p in PATCHES}
        if unknown:
            raise ValueError(f"CpuShim(skip={sorted(unknown)}): no such patch; patches are 1..{len(PATCHES)}")
        self.applied: list[int] = []
        self._patches = Patches()
        self._mode: _CudaToCpuMode | None = None

    # -- bookkeeping -----------------------------------------------------------------------------
    def _set(self, number: int, owner: Any, name: str, value: Any) -> None:
        self._patches.setattr(owner, name, value)
        if number not in self.applied:
            self.applied.append(number)

    def _on(self, number: int) -> bool:
        return number not in self.skip

    # -- install / uninstall -----------------------------------------------------------------------
    def install(self) -> CpuShim:
        with _LOCK:
            if _SHIM.current() is not None:
                raise RuntimeError("prism: the Megatron CPU shim is already installed in this process")
            if torch.cuda.is_available():
                raise RuntimeError(
                    "prism: the Megatron CPU shim is for CPU-only torch; CUDA is available here, so real devices "
                    "are used and no shim is needed"
                )
            self._install()
            _SHIM.enter(self)
        return self

    def _install(self) -> None:
        cuda = torch.cuda
        if self._on(1):
            import megatron.core.tensor_parallel.random as mrandom

            gen = torch.random.default_generator
            self._set(1, cuda, "get_rng_state", lambda device="cuda": gen.get_state())
            self._set(1, cuda, "set_rng_state", lambda new_state, device="cuda": gen.set_state(new_state))
            self._set(1, cuda, "manual_seed", lambda seed: gen.manual_seed(int(seed)))
            self._set(1, cuda, "manual_seed_all", lambda seed: gen.manual_seed(int(seed)))
            self._set(1, mrandom, "_get_cuda_rng_state", lambda *a, **k: gen.get_state())
            self._set(1, mrandom, "_set_cuda_rng_state", lambda new_state, *a, **k: gen.set_state(new_state))
        if self._on(2):
            self._set(2, cuda, "current_device", lambda: 0)
        if self._on(3):
            mode = _CudaToCpuMode(cuda_type_strings=self._on(5))
            mode.__enter__()
            self._mode = mode
            self._patches.callback(self._exit_mode)
            self.applied.append(3)
            if self._on(5):
                self.applied.append(5)
            self._install_backward_mode(mode)
        if self._on(4):
            self._set(4, cuda, "synchronize", lambda device=None: None)
        if self._on(6):
            self._set(6, cuda, "current_stream", lambda device=None: _DEFAULT_STREAM)
            self._set(6, cuda, "default_stream", lambda device=None: _DEFAULT_STREAM)
            self._set(6, cuda, "Stream", _Stream)
            self._set(6, cuda, "Event", _Event)
            self._set(6, cuda, "stream", lambda stream=None: contextlib.nullcontext())
        if self._on(7):
            self._set(7, cuda, "is_available", lambda: True)
            self._set(7, cuda, "device_count", lambda: 1)
        if self._on(8):
            self._install_memory_stats()
        if self._on(9):
            dynamo_config = importlib.import_module("torch._dynamo.config")
            self._set(9, dynamo_config, "disable", True)
        if self._on(10):
            self._install_sp_norm()

    def _install_memory_stats(self) -> None:
        cuda = torch.cuda
        stats = _cuda_memory_stats
        self._set(8, cuda, "memory_stats", lambda device=None: stats())
        self._set(8, cuda, "memory_allocated", lambda device=None: stats()["allocated_bytes.all.current"])
        self._set(8, cuda, "max_memory_allocated", lambda device=None: stats()["allocated_bytes.all.peak"])
        self._set(8, cuda, "memory_reserved", lambda device=None: stats()["reserved_bytes.all.current"])
        self._set(8, cuda, "max_memory_reserved", lambda device=None: stats()["reserved_bytes.all.peak"])
        self._set(8, cuda, "reset_peak_memory_stats", lambda device=None: _reset_peak())
        self._set(8, cuda, "empty_cache", lambda: None)
        self._set(8, cuda, "set_device", lambda device: None)
        self._set(8, cuda, "get_device_properties", lambda device=None: _DeviceProperties())
        self._set(8, cuda, "get_device_capability", lambda device=None: (0, 0))
        self._set(8, cuda, "get_device_name", lambda device=None: _DeviceProperties.name)

    def _install_backward_mode(self, mode: _CudaToCpuMode) -> None:
        """Keep the mode active inside autograd backward.

        ``torch.autograd.backward`` is itself overridable, so it reaches the mode's handler, and a
        mode is off while its own handler runs: the engine would then capture an empty mode stack
        and custom ``autograd.Function.backward`` code (Megatron's sequence-parallel linear layers:
        ``torch.empty(..., device=torch.cuda.current_device())``) would run unmapped. The engine
        entry point re-enters the mode when it is not active.
        """
        import torch.autograd as autograd
        import torch.autograd.graph as graph

        original = graph._engine_run_backward

        def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
            if _mode_active(mode):
                return original(*args, **kwargs)
            with mode:
                return original(*args, **kwargs)

        self._set(3, graph, "_engine_run_backward", _engine_run_backward)
        self._set(3, autograd, "_engine_run_backward", _engine_run_backward)

    def _install_sp_norm(self) -> None:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        self._set(10, WrappedTorchNorm, "__new__", staticmethod(sp_norm_new(WrappedTorchNorm.__new__)))

    def _exit_mode(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def uninstall(self) -> None:
        with _LOCK:
            self._patches.close()
            self.applied = []
            _SHIM.leave(self)


def _reset_peak() -> None:
    from prism_plugin.device import memory

    tracker = memory.current_tracker()
    if tracker is not None:
        tracker.reset_peak()


_SHIM: Slot[CpuShim] = slot("megatron_cpu_shim")
"""The installed shim of this process (`prism_plugin.device.active`)."""
_LOCK = threading.Lock()


def active_shim() -> CpuShim | None:
    """The installed shim of this process, if any."""
    return _SHIM.current()
