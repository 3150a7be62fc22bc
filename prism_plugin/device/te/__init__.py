"""TransformerEngine on virtual GPUs: TE's own PyTorch layer over a fake compiled extension (DESIGN.md section 12).

The route, decided by what installs on a CPU host: TE's PyTorch layer is pure Python (the ``transformer-engine``
wheel, ``py3-none-any``: modules, attention, quantizers, FP8 tensors, recipes); only its compiled extension
``transformer_engine_torch`` and the CUDA libraries TE ``ctypes``-loads need a GPU. So a virtual-GPU process runs
TE's own modules (their parameters, saved tensors, workspaces and autograd functions are TE's), and `extension`
answers the compiled extension's calls with fake kernels. A stand-in of the TE API would have to re-implement
what TE saves for backward and allocates; this route reproduces it by running it.

Where TE comes from: the release `TE_VERSION` (the newest megatron-core 0.19 checks: ``is_te_min_version
("2.14.0")``), installed by ``scripts/setup_env.sh`` into a private folder (`te_path`), not into site-packages:
an importable ``transformer_engine`` without its extension breaks Megatron-core's import on a CPU host (its
``try: import transformer_engine`` guards catch ``ImportError`` only). The folder goes on ``sys.path`` only in a
virtual-GPU process (`install`), before the program imports Megatron.

On a host where TE is really installed with its extension (a GPU machine), real ranks run real TE; `install` is
for virtual GPUs only and replaces the extension in that process.

``PRISM_TE=off`` in a virtual-GPU process's environment emulates a GPU host without TransformerEngine (Megatron
then takes its non-TE paths: the local spec's norms, torch's Adam, its own l2 norm), as a CPU run of the same job
does: for comparing a virtual-GPU run with a CPU recording of the same program. ``on`` (the default) installs TE.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from prism_plugin.device.active import Slot, slot

__all__ = ["FLASH_ATTN_VERSION", "TE_VERSION", "TeNotInstalled", "available", "flash_available", "install", "installed",
           "missing_message", "te_path"]

TE_VERSION = "2.14.0"
"""The TransformerEngine release whose PyTorch layer virtual GPUs run."""

FLASH_ATTN_VERSION = "2.8.3"
"""The flash-attn release whose Python layer virtual GPUs run for ``--attention-backend flash`` (TE 2.14's
``FlashAttentionUtils.max_version``; `prism_plugin.device.te.flash`)."""

_ENV = "PRISM_TE_PATH"


class TeNotInstalled(RuntimeError):
    """TE's PyTorch layer is not where virtual GPUs look for it; the message names the set-up command."""


def te_path() -> Path:
    """The folder holding TE's pure-Python package: ``$PRISM_TE_PATH``, else ``<sys.prefix>/share/prism_plugin/te``
    (where ``scripts/setup_env.sh`` installs it)."""
    named = os.environ.get(_ENV)
    return Path(named) if named else Path(sys.prefix) / "share" / "prism_plugin" / "te"


class _FakeExtension(types.ModuleType):
    """``transformer_engine_torch`` for virtual GPUs; an unknown name is a function that refuses when called."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        from prism_plugin.device.te.extension import _unsupported

        value = _unsupported(name, "this TransformerEngine kernel has no fake implementation yet")
        setattr(self, name, value)
        return value


class _TeFinder(importlib.abc.MetaPathFinder):
    """Runs a fix-up after each TE module in `_AFTER_IMPORT` loads (its import otherwise unchanged), and loads the
    stand-ins of `_STANDINS` instead of TE's module of that name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        build = _STANDINS.get(fullname)
        if build is not None:
            return importlib.util.spec_from_loader(fullname, _StandinLoader(build))
        after = _AFTER_IMPORT.get(fullname)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_fix(module: types.ModuleType) -> None:
            after(module, exec_module)

        spec.loader.exec_module = exec_then_fix  # type: ignore[method-assign]
        return spec


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, build: Any) -> None:
        self.build = build

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        self.build(module)


_ONNX_NAMES = ("torch_onnx_gemm_inf_op", "onnx_quantize_fp8_op", "onnx_dequantize_fp8_op", "onnx_quantize_mxfp8_op",
               "onnx_dequantize_mxfp8_op", "onnx_layernorm", "onnx_attention_mask_func", "onnx_gemm")
"""What ``transformer_engine.pytorch.export`` imports of ``onnx_extensions`` (TE 2.14), besides the table."""


class _NoOnnxTable(dict):
    """``te_translation_table`` of the stand-in: any use refuses."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_NO_ONNX)

    __getitem__ = __iter__ = __len__ = __contains__ = keys = items = values = get = copy = _refuse  # type: ignore[assignment]


_NO_ONNX = ("prism virtual GPUs train TransformerEngine's modules but do not export them to ONNX "
            "(TE's onnx_extensions needs onnxscript, which virtual-GPU processes do not load)")


def _onnx_extensions(module: types.ModuleType) -> None:
    """``transformer_engine.pytorch.onnx_extensions``: TE's ONNX-export ops (onnxscript functions, used only inside
    ``te.onnx_export(enabled=True)``). TE imports it unconditionally; onnxscript and its dependencies are 1.7 s of
    a 4.8 s TE import on a 2-core host (measured, ``-X importtime``), so virtual GPUs load this stand-in: each name
    refuses when called, naming why."""

    def refuse(name: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}: {_NO_ONNX}")

        refused.__name__ = name
        return refused

    for name in _ONNX_NAMES:
        setattr(module, name, refuse(name))
    module.te_translation_table = _NoOnnxTable()  # type: ignore[attr-defined]


_STANDINS = {"transformer_engine.pytorch.onnx_extensions": _onnx_extensions}


def _common(module: types.ModuleType, exec_module: Any) -> None:
    """``transformer_engine.common`` with its CUDA-library loading skipped (TE's own switch for building without
    CUDA, ``NVTE_PROJECT_BUILDING``) and its ``load_framework_extension`` answered by the fake extension."""
    saved = os.environ.get("NVTE_PROJECT_BUILDING")
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    try:
        exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("NVTE_PROJECT_BUILDING", None)
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = saved
    module.load_framework_extension = _load_framework_extension  # type: ignore[attr-defined]


def _grouped_mlp(module: types.ModuleType, exec_module: Any) -> None:
    """TE's ``ops.fused.forward_grouped_mlp`` and ``backward_grouped_mlp`` register their CuTe grouped-MLP fusions at
    import when ``NVTE_CUTEDSL_FUSED_GROUPED_MLP`` is set, after asking the device's compute capability, which fails
    in a process with no virtual GPU started yet (the launcher parsing Megatron's arguments). The fusions need
    cudnn-frontend's SM100 kernels, which no virtual-GPU process has, so TE would not register them there either:
    their imports run with the switch off."""
    saved = os.environ.pop("NVTE_CUTEDSL_FUSED_GROUPED_MLP", None)
    try:
        exec_module(module)
    finally:
        if saved is not None:
            os.environ["NVTE_CUTEDSL_FUSED_GROUPED_MLP"] = saved


def _cpu_offload_v1(module: types.ModuleType, exec_module: Any) -> None:
    """TE's activation-offload marking (``cpu_offload_v1.mark_activation_offload``, Megatron's fine-grained
    activation offloading) marks a plain tensor by exact type and takes anything else for a quantized tensor; a
    virtual GPU's tensors are ``FakeTensor``: they are marked as the plain tensors they stand for."""
    from torch._subclasses.fake_tensor import FakeTensor

    exec_module(module)
    mark = module.mark_activation_offload

    def mark_activation_offload(*tensors: Any) -> None:
        for tensor in tensors:
            if type(tensor) is FakeTensor:
                tensor.activation_offloading = True
        mark(*(t for t in tensors if type(t) is not FakeTensor))

    module.mark_activation_offload = mark_activation_offload  # type: ignore[attr-defined]


class _PickleFakesAsZeros:
    """``pickle`` as TE's ``module/base.py`` sees it on virtual GPUs: ``dumps`` writes a fake tensor (the FP8 scaling
    state ``get_extra_state`` copies to the host for a checkpoint) as a real zero tensor of its shape and dtype, as
    many bytes as the real one (fake tensors hold no values and do not pickle); everything else is ``pickle``'s."""

    def __getattr__(self, name: str) -> Any:
        import pickle

        return getattr(pickle, name)

    @staticmethod
    def dumps(obj: Any, protocol: int | None = None) -> bytes:
        import io
        import pickle

        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        proto = pickle.DEFAULT_PROTOCOL if protocol is None else protocol

        class Pickler(pickle.Pickler):
            def reducer_override(self, value: Any) -> Any:
                if not isinstance(value, FakeTensor):
                    return NotImplemented
                with _disable_current_modes():
                    return torch.zeros(value.shape, dtype=value.dtype).__reduce_ex__(proto)

        buffer = io.BytesIO()
        Pickler(buffer, proto).dump(obj)
        return buffer.getvalue()


def _module_base(module: types.ModuleType, exec_module: Any) -> None:
    """``transformer_engine.pytorch.module.base`` pickling its FP8 state for a checkpoint (`_PickleFakesAsZeros`): a
    checkpoint save of an FP8 job (emulated: nothing is written) stopped on pickling fake tensors."""
    exec_module(module)
    module.pickle = _PickleFakesAsZeros()  # type: ignore[attr-defined]


def _attention_utils(module: types.ModuleType, exec_module: Any) -> None:
    """TE's attention-backend choice with the q/k/v type a GPU run has: TE accepts ``torch.Tensor`` and
    ``Float8Tensor`` by exact type, and a virtual GPU's tensors are ``FakeTensor`` (FusedAttention would be
    disabled for the type alone)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor

    exec_module(module)
    choose = module.get_attention_backend

    def get_attention_backend(attention_params: Any) -> Any:
        if attention_params.qkv_type is FakeTensor:
            attention_params = dataclasses.replace(attention_params, qkv_type=torch_tensor())
        return choose(attention_params)

    module.get_attention_backend = get_attention_backend  # type: ignore[attr-defined]


def _inner_dispatch_on_fakes() -> None:
    """TE's quantized tensors run an op on their buffers as ``data.__torch_dispatch__(func, types, args, kwargs)``
    with the outer call's `types` (``Float8Tensor`` among them). On a GPU ``torch.Tensor.__torch_dispatch__`` just
    runs `func`; ``FakeTensor``'s refuses types it does not know (``NotImplemented``). When every tensor argument
    is a fake tensor, such a call is run as the plain tensor's would be: `func` through the active modes."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    dispatch = FakeTensor.__dict__["__torch_dispatch__"].__func__

    def __torch_dispatch__(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        foreign = [t for t in types if not issubclass(t, FakeTensor) and t is not torch_tensor()]
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch_tensor())]
        if foreign and tensors and all(type(t) is FakeTensor for t in tensors):
            return func(*args, **kwargs)
        return dispatch(cls, func, types, args, kwargs)

    FakeTensor.__torch_dispatch__ = classmethod(__torch_dispatch__)  # type: ignore[method-assign,assignment]


def torch_tensor() -> type:
    import torch

    return torch.Tensor


_AFTER_IMPORT = {
    "transformer_engine.common": _common,
    "transformer_engine.pytorch.attention.dot_product_attention.utils": _attention_utils,
    "transformer_engine.pytorch.ops.fused.forward_grouped_mlp": _grouped_mlp,
    "transformer_engine.pytorch.ops.fused.backward_grouped_mlp": _grouped_mlp,
    "transformer_engine.pytorch.cpu_offload_v1": _cpu_offload_v1,
    "transformer_engine.pytorch.module.base": _module_base,
}


def _load_framework_extension(framework: str) -> None:
    if framework != "torch":
        raise ImportError(f"transformer_engine_{framework}: virtual GPUs emulate TE's PyTorch extension only")


_EXTENSION: Slot[types.ModuleType] = slot("transformer_engine", permanent=True)
"""The fake ``transformer_engine_torch`` once `install` put it in ``sys.modules`` (`prism_plugin.device.active`)."""


def _switch() -> str:
    """``PRISM_TE`` as given (``on`` when unset), lower-cased."""
    return os.environ.get("PRISM_TE", "on").strip().lower()


def available() -> bool:
    """Whether `install` would find TE's pure-Python package of release `TE_VERSION` (in `te_path`, or importable);
    changes nothing (the launcher asks before any rank starts). False under ``PRISM_TE=off``."""
    if _switch() == "off":
        return False
    if (te_path() / f"transformer_engine-{TE_VERSION}.dist-info").is_dir():
        return True
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformer-engine") == TE_VERSION
    except PackageNotFoundError:
        return False


def flash_available() -> bool:
    """Whether flash-attn's Python layer (release `FLASH_ATTN_VERSION`) is in `te_path`, beside TE: what
    ``--attention-backend flash`` needs on virtual GPUs. False when TE is not `available`."""
    return available() and (te_path() / f"flash_attn-{FLASH_ATTN_VERSION}.dist-info").is_dir()


def missing_message() -> str:
    """What to do when TE is not `available` (the set-up command, or the switch that turned it off)."""
    if _switch() == "off":
        return "PRISM_TE=off emulates a GPU host without TransformerEngine; unset it to run TE"
    folder = te_path()
    return (f"TransformerEngine {TE_VERSION}'s PyTorch layer is not installed where virtual GPUs look for it "
            f"({folder}); run `bash scripts/setup_env.sh` (or `pip install --no-deps --target {folder} "
            f"transformer-engine=={TE_VERSION}`), or set {_ENV} to such a folder")


def installed() -> bool:
    """Whether this process runs TE over the fake extension."""
    return _EXTENSION.current() is not None


def install(*, required: bool = False) -> bool:
    """Make ``import transformer_engine`` in this process load TE's PyTorch layer over the fake extension; True when
    done. Call before the program imports TE or Megatron (TE modules imported earlier keep what they found).
    Without TE's pure-Python package in `te_path` (and no importable ``transformer_engine`` of release
    `TE_VERSION`) nothing changes and the answer is False, or, `required`, `TeNotInstalled` names the set-up
    command."""
    if installed():
        return True
    switch = _switch()
    if switch not in ("on", "off"):
        raise TeNotInstalled(f"PRISM_TE={switch!r}: use on (TransformerEngine on virtual GPUs, the default) or off "
                             "(a GPU host without TransformerEngine)")
    if switch == "off":
        return False
    if "transformer_engine" in sys.modules or "transformer_engine_torch" in sys.modules:
        raise RuntimeError("TransformerEngine was imported before the virtual GPU started; start it first")
    folder = te_path()
    added = (folder / "transformer_engine").is_dir()
    if added:
        sys.path.insert(0, str(folder))
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("transformer-engine")
    except PackageNotFoundError:
        found = None
    if found != TE_VERSION:
        if added:
            sys.path.remove(str(folder))
        if not required:
            return False
        raise TeNotInstalled(missing_message() + (f"; found {found}" if found else ""))
    from prism_plugin.device.te import extension

    module = _FakeExtension("transformer_engine_torch")
    module.__doc__ = extension.__doc__
    extension.build_module(module)
    sys.modules["transformer_engine_torch"] = module
    if flash_available():  # TE's FlashAttention backend: flash-attn's Python layer over a fake extension
        from prism_plugin.device.te import flash

        sys.modules.setdefault("flash_attn_2_cuda", flash.extension_module())
        flash.register_costs()
    sys.meta_path.insert(0, _TeFinder())
    _inner_dispatch_on_fakes()
    import warnings

    # TE compares q/k/v storage pointers to find its layout; a fake storage's pointer is 0 for all, and torch warns
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    _EXTENSION.enter(module)
    return True
