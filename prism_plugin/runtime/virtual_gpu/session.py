"""A virtual GPU for one real process of an emulation: the GPU model, device index and allocator options.

`resolve_gpu` picks the model (``EmulationConfig.gpu``, else the hardware profile's ``gpu``) and refuses a
virtual-GPU run without one before any process starts; `start_virtual_gpu` starts this process's virtual
GPUs: one node's worth (``gpus_per_node``, at most 8), the current one ``LOCAL_RANK`` modulo that, with the
allocator options of ``PYTORCH_CUDA_ALLOC_CONF`` as torch would read them. ``PRISM_VIRTUAL_GPU_OOM=report``
reports an allocation that crosses the GPU's memory (counted in the summary's ``ooms``, served beyond the device)
instead of raising torch's ``OutOfMemoryError`` there (the default, ``raise``): a job that does not fit still
runs to its end and reports how much it needs.
"""

from __future__ import annotations

import os

from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.gpu import GpuSpec, gpu_spec
from prism_plugin.cost.profiles import HardwareProfile, load_profile
from prism_plugin.runtime.virtual_gpu import cuda_runtime
from prism_plugin.runtime.virtual_gpu.device import VirtualGpu

__all__ = ["resolve_gpu", "start_virtual_gpu"]


def resolve_gpu(config: EmulationConfig, profile: HardwareProfile | None = None) -> GpuSpec:
    """The GPU model of `config`'s virtual GPUs (a `ConfigError` naming the fix when there is none)."""
    profile = profile or load_profile(config.profile)
    name = config.gpu or profile.gpu
    if name is None:
        raise ConfigError(f"device virtual-gpu needs a GPU model: profile {profile.name!r} names none; use a GPU "
                          "profile (--profile dgx-h100) or name the model (--gpu h100-sxm)")
    return gpu_spec(name)


def start_virtual_gpu(config: EmulationConfig, process_index: int) -> VirtualGpu:
    """Start this process's virtual GPUs (the device library must already be loaded: `cuda_runtime.preload`)."""
    num_devices = min(cuda_runtime.MAX_DEVICES, config.world.gpus_per_node)
    device = int(os.environ.get("LOCAL_RANK", process_index)) % num_devices
    allocator = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    oom = os.environ.get("PRISM_VIRTUAL_GPU_OOM", "raise")
    if oom not in ("raise", "report"):
        raise ConfigError(f"PRISM_VIRTUAL_GPU_OOM={oom!r}: use raise (torch's OutOfMemoryError, the default) or "
                          "report (count each OOM in the summary and run on)")
    return VirtualGpu(resolve_gpu(config), num_devices=num_devices, device=device, allocator=allocator,
                      raise_oom=oom == "raise").start()
