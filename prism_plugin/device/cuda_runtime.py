"""A CUDA device for the CPU-only torch wheel: device guard and hooks, so fake ``cuda`` tensors run everywhere.

Fake tensors alone stop at three places on a CPU wheel: the autograd engine needs a device guard to run the
backward of ``cuda`` tensors (without one the process aborts), and ``torch.device(<int>)`` / integer device
arguments resolve through the accelerator API, which finds no CUDA. This module builds (once, with torch's
``cpp_extension``, cached) a small library that registers c10's own ``FakeGuardImpl`` (the test device guard
of c10: a current device and stream ids per thread, events that are always complete, 8 devices) as the CUDA
device guard, and CUDA hooks that report CUDA present. No kernel exists: every op must run under
``FakeTensorMode`` (the virtual GPU), and a real ``cuda`` tensor op fails as before.

The hooks are read once per process, at the first question torch asks of them (during ``import torch``), so
`preload()` must load the library *before* torch is imported: `prism run --device virtual-gpu` starts every
real process that way. Importing this module does not import torch.

Limitations: at most 8 devices per process (c10's fake guard); a process whose autograd engine ran a
backward on virtual GPUs must end with ``os._exit`` (the engine's CUDA worker threads abort C++ static
destruction otherwise): `exit_now()`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from prism_plugin.device.active import Slot, slot

__all__ = ["MAX_DEVICES", "build", "exit_now", "library_env", "library_path", "preload", "preload_if_launched",
           "preloaded", "reexec", "set_device"]

MAX_DEVICES = 8
_NAME = "prism_virtual_cuda"
_ENV = "PRISM_VIRTUAL_CUDA_LIB"
_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
using Guard = c10::impl::FakeGuardImpl<DeviceType::CUDA>;

// CUDA present, 8 devices, the guard's current device: enough for the accelerator API and autograd.
struct PrismVirtualCUDAHooks : public CUDAHooksInterface {
  PrismVirtualCUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  DeviceIndex current_device() const override { return Guard::getDeviceIndex(); }
  DeviceIndex getCurrentDevice() const override { return Guard::getDeviceIndex(); }
  void setCurrentDevice(DeviceIndex d) const override { Guard::setDeviceIndex(d); }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, PrismVirtualCUDAHooks)
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, at::Guard);

bool prism_virtual_cuda_active() { return at::detail::getCUDAHooks().hasCUDA(); }
void prism_virtual_cuda_set_device(int64_t index) { at::Guard::setDeviceIndex(static_cast<c10::DeviceIndex>(index)); }
"""


def _build_dir() -> Path:
    """Per installed torch version (the library links torch's C++ ABI): ``~/.cache/prism_plugin/virtual_cuda-<v>``."""
    from importlib.metadata import version

    root = os.environ.get("PRISM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "prism_plugin")
    return Path(root) / f"virtual_cuda-{version('torch')}"


def library_path() -> Path | None:
    """The built library, if it exists (``PRISM_VIRTUAL_CUDA_LIB`` names it in the processes prism starts)."""
    named = os.environ.get(_ENV)
    if named:
        return Path(named)
    found = sorted(_build_dir().glob(f"{_NAME}*.so"))
    return found[0] if found else None


def build(verbose: bool = False) -> Path:
    """Compile the library (about 20 s once; cached) and return its path. Needs a C++ compiler and ninja."""
    from torch.utils.cpp_extension import load_inline

    folder = _build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(folder / "lock")
    module = load_inline(_NAME, cpp_sources=_SOURCE, build_directory=str(folder), verbose=verbose,
                         functions=["prism_virtual_cuda_active", "prism_virtual_cuda_set_device"])
    return Path(module.__file__)


_STALE_LOCK_S = 600.0
"""A build takes about 20 s: a lock file older than this was left by a build that was killed."""


def _drop_stale_lock(lock: Path) -> None:
    """torch's build lock (``FileBaton``) of a killed build stays, and every later build waits on it forever."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        print(f"prism: removing {lock}, left {age:.0f} s ago by a device-library build that did not finish",
              file=sys.stderr)
        lock.unlink(missing_ok=True)


def library_env() -> dict[str, str]:
    """The variable that makes a fresh process load the device library before torch (`preload_if_launched`):
    the one this process was given, else the cached library (built once)."""
    path = os.environ.get(_ENV) or library_path()
    if path is None or not Path(path).exists():
        path = build()
    return {_ENV: str(path)}


def preload_if_launched() -> bool:
    """The one pre-torch preload every entry runs first thing: load the library when this process was started
    for a virtual GPU (`library_env` in its environment) and torch is not imported yet; True when it did."""
    if not os.environ.get(_ENV) or "torch" in sys.modules:
        return False
    preload()
    return True


def reexec(module: str, args: list[str], env: dict[str, str] | None = None) -> None:
    """Replace this process (same pid: a launcher watching it still does) by ``python -m module args`` with the
    device library named (`library_env`) and `env` added; never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **library_env(), **(env or {})})


def preload(path: Path | None = None) -> None:
    """Load the library and torch's C++ libraries it links, before ``import torch`` (see the module docstring)."""
    if "torch" in sys.modules:
        raise RuntimeError("prism virtual GPU: the CUDA device library must load before torch is imported; start "
                           "the program with `prism run --device virtual-gpu` (or call preload() first thing)")
    path = path or library_path()
    if path is None or not path.exists():
        raise RuntimeError(f"prism virtual GPU: no device library at {path or _build_dir()}; build it with "
                           "`python -m prism_plugin.device.cuda_runtime`")
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None, "torch is not installed"
    lib = Path(spec.origin).parent / "lib"
    for name in ("libc10.so", "libtorch_cpu.so", "libtorch.so", "libtorch_python.so"):
        if (lib / name).exists():
            ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    os.environ[_ENV] = str(path)
    from prism_plugin.device import gpu_packages, te

    te.install()  # before the program (or an adapter's argument parsing) imports Megatron, which probes TE once
    gpu_packages.install()


_LIBRARY: Slot[ModuleType] = slot("virtual_cuda_library", permanent=True)
"""The device library, once loaded into this process (`prism_plugin.device.active`)."""


def _module() -> object | None:
    loaded = _LIBRARY.current()
    if loaded is not None:
        return loaded
    path = library_path()
    if path is None or "torch" not in sys.modules:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LIBRARY.enter(module)
    return module


def preloaded() -> bool:
    """Whether this process's torch sees the virtual CUDA device (the library loaded before torch)."""
    module = _module()
    return module is not None and bool(module.prism_virtual_cuda_active())  # type: ignore[attr-defined]


def set_device(index: int) -> None:
    """Make `index` the device guard's current device (``torch.cuda.set_device`` of a virtual GPU)."""
    module = _module()
    assert module is not None, "the virtual CUDA library is not loaded"
    module.prism_virtual_cuda_set_device(index)  # type: ignore[attr-defined]


def exit_now(code: int) -> None:
    """Flush and end the process with `code`, skipping C++ static destruction (see Limitations)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv))
