"""Importing Megatron-core 0.19 on this project's platforms: Python 3.11 and triton-less hosts.

Two import-time gaps, each closed here explicitly and nowhere else:

- `megatron.training` (0.19) does ``from typing import override`` (Python >= 3.12). On 3.11,
  `ensure_typing_override()` adds ``typing.override = typing_extensions.override`` (the same
  decorator; a no-op at run time). It only *adds* a missing name, so it is left in place.
- `megatron.core` imports `triton` unconditionally (``megatron/core/transformer/moe/ops/
  paged_stash.py``, reached from ``megatron/core/__init__.py``). With real triton installed (the
  normal case, also on CPU-only hosts) nothing is done. Without it, `import_megatron_core()`
  imports megatron.core against a scoped stub: torch's own triton probes run first (so torch caches
  "no triton"), the stub sits in ``sys.modules`` only while megatron.core imports, then it is
  removed. Torch's inductor modules are imported before the stub goes in (they read
  ``triton.__version__`` at import when a `triton` module exists). Launching any stubbed kernel
  raises `NotImplementedError` naming the kernel.

- megatron-core wheels ship the dataset index helpers prebuilt (``helpers_cpp*.so``) but not the
  Makefile, while ``megatron.training``'s initialisation calls
  ``megatron.core.datasets.utils.compile_helpers()`` on rank 0, which runs ``make`` and
  ``sys.exit(1)``s when it fails. `skip_prebuilt_dataset_helpers_compile()` makes that call a no-op
  when the prebuilt module imports (and is left alone otherwise). A packaging gap, not an emulation
  one: a plain torchrun of a pip-installed Megatron hits it too.

Limitations: the stub covers module-level ``triton.jit`` / ``triton.language`` use; megatron paths
that launch triton kernels (paged MoE stash, the SSM ops, batch-invariant kernels) need real triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
import typing
from typing import Any

__all__ = ["ensure_typing_override", "import_megatron_core", "import_megatron_training", "triton_is_real",
           "skip_prebuilt_dataset_helpers_compile"]


def ensure_typing_override() -> bool:
    """Give Python 3.11's `typing` the `override` decorator megatron.training imports; True if added."""
    if hasattr(typing, "override"):
        return False
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    return True


def triton_is_real() -> bool:
    """Whether a real `triton` package is importable."""
    module = sys.modules.get("triton")
    if module is not None:
        return not getattr(module, "__prism_stub__", False)
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses triton: it is not importable
        return False


class _StubKernel:
    """What ``@triton.jit`` returns in the stub: refuses to launch, naming the kernel."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"prism: triton kernel {self.__name__!r} cannot run: triton is not installed (megatron-core was "
            "imported against prism's import-time stub). Install triton (`pip install triton`) or disable the "
            "feature that launches this kernel"
        )

    __call__ = _refuse

    def __getitem__(self, grid: Any) -> Any:
        return self._refuse


def _stub_decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _StubKernel(args[0])
    return lambda fn: _StubKernel(fn)


class _Anything:
    """A placeholder for any other triton attribute used at module level (types, constexpr, ...)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _StubKernel(args[0])
        return _Anything(f"{self._name}(...)")

    def __getitem__(self, key: Any) -> _Anything:
        return self

    def __repr__(self) -> str:
        return f"<prism triton stub {self._name}>"


def _stub_attribute(module_name: str, attr: str) -> _Anything:
    if attr.startswith("__"):  # __file__, __spec__ ...: inspect and importlib probe these
        raise AttributeError(attr)
    return _Anything(f"{module_name}.{attr}")


def _make_stub() -> dict[str, types.ModuleType]:
    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__prism_stub__ = True  # type: ignore[attr-defined]
        mod.__path__ = []  # type: ignore[attr-defined]  # a package, so submodule imports resolve here
        mod.__getattr__ = functools.partial(_stub_attribute, name)  # type: ignore[attr-defined]
        return mod

    triton = module("triton")
    language = module("triton.language")
    # a version below every real triton: optional users (megatron's fused_indices_converter) then
    # switch their triton paths off, as they do for an old triton on a CPU host
    triton.__version__ = "0.0.0"  # type: ignore[attr-defined]
    triton.jit = _stub_decorator  # type: ignore[attr-defined]
    triton.autotune = lambda *a, **k: _stub_decorator  # type: ignore[attr-defined]
    triton.heuristics = lambda *a, **k: _stub_decorator  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    language.constexpr = _Anything("triton.language.constexpr")  # type: ignore[attr-defined]
    return {"triton": triton, "triton.language": language}


def import_megatron_core() -> bool:
    """Import megatron.core (and its pipeline schedules); True when the triton stub was needed."""
    if "megatron.core.pipeline_parallel.schedules" in sys.modules or triton_is_real():
        importlib.import_module("megatron.core")
        importlib.import_module("megatron.core.pipeline_parallel.schedules")
        return False
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()  # cached: torch now knows there is no triton
    for name in ("torch._dynamo", "torch._inductor.runtime.triton_compat", "torch._functorch.aot_autograd",
                 "torch._inductor.codecache", "torch._inductor.utils", "torch._inductor.compile_fx",
                 "torch._inductor.kernel"):
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - older torch layouts
            pass
    stub = _make_stub()
    saved = {name: sys.modules.get(name) for name in stub}
    sys.modules.update(stub)
    try:
        importlib.import_module("megatron.core")
        importlib.import_module("megatron.core.pipeline_parallel.schedules")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return True


def skip_prebuilt_dataset_helpers_compile() -> bool:
    """No-op ``compile_helpers()`` when megatron-core's prebuilt ``helpers_cpp`` imports; True if done."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    if getattr(dataset_utils.compile_helpers, "__prism_noop__", False):
        return True

    def compile_helpers() -> None:
        """Prebuilt helpers_cpp found (prism compat): nothing to compile."""

    compile_helpers.__prism_noop__ = True  # type: ignore[attr-defined]
    dataset_utils.compile_helpers = compile_helpers
    return True


def import_megatron_training() -> None:
    """Import megatron.training (after `import_megatron_core` and the 3.11 `typing.override` fix)."""
    ensure_typing_override()
    import_megatron_core()
    importlib.import_module("megatron.training")
    importlib.import_module("megatron.training.training")
    skip_prebuilt_dataset_helpers_compile()
