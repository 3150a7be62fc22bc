"""A virtual GPU for one real process of an emulation: the GPU model, device index and allocator options.

`resolve_gpu` picks the model (``EmulationConfig.gpu``, else the hardware profile's ``gpu``) and refuses a
virtual-GPU run without one before any process starts, naming the settings as the entry point spells them (an
entry point whose launch names neither a profile nor a GPU model runs on `preflight.DEFAULT_PROFILE` instead);
`start_virtual_gpu` starts this process's virtual GPUs: one node's worth (``gpus_per_node``, at most 8), the current
one ``LOCAL_RANK`` modulo that, with the
allocator options of ``PYTORCH_CUDA_ALLOC_CONF`` as torch would read them. ``PRISM_VIRTUAL_GPU_OOM=report``
reports an allocation that crosses the GPU's memory (counted in the summary's ``ooms``, served beyond the device)
instead of raising torch's ``OutOfMemoryError`` there (the default, ``raise``): a job that does not fit still
runs to its end and reports how much it needs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.respell import DEFAULT_PROFILE, RUN_FLAGS, spell
from prism_plugin.config.settings import from_environ
from prism_plugin.config.virtual_time import VirtualTimeOptions
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.gpu import GpuSpec, gpu_spec
from prism_plugin.cost.profiles import HardwareProfile, load_profile
from prism_plugin.device import cuda_runtime

if TYPE_CHECKING:  # torch: imported where a virtual GPU starts, not by the launchers that only resolve its model
    from prism_plugin.device.clock import VirtualTime
    from prism_plugin.device.device import VirtualGpu

__all__ = ["VirtualTimeOptions", "resolve_gpu", "start_virtual_gpu", "start_virtual_time"]


def resolve_gpu(config: EmulationConfig, profile: HardwareProfile | None = None,
                flags: Mapping[str, str] = RUN_FLAGS) -> GpuSpec:
    """The GPU model of `config`'s virtual GPUs (a `ConfigError` naming the fix, with the settings spelled as
    `flags` spells them, when there is none)."""
    profile = profile or load_profile(config.profile)
    name = config.gpu or profile.gpu
    if name is None:
        raise ConfigError(f"{spell(flags, 'device', 'virtual-gpu')} needs a GPU model: profile {profile.name!r} "
                          f"names none; use a GPU profile ({spell(flags, 'profile', DEFAULT_PROFILE)}) or name the "
                          f"model ({spell(flags, 'gpu', 'h100-sxm')})")
    return gpu_spec(name)


def start_virtual_gpu(config: EmulationConfig, process_index: int) -> VirtualGpu:
    """Start this process's virtual GPUs (the device library must already be loaded: `cuda_runtime.preload`)."""
    from prism_plugin.device import snapshot
    from prism_plugin.device.device import VirtualGpu

    num_devices = min(cuda_runtime.MAX_DEVICES, config.world.gpus_per_node)
    device = int(os.environ.get("LOCAL_RANK", process_index)) % num_devices
    allocator = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    oom = from_environ("oom")  # the table's parser: raise or report
    options = VirtualTimeOptions.from_env()
    profile = load_profile(config.profile)
    vgpu = VirtualGpu(resolve_gpu(config, profile), num_devices=num_devices, device=device, allocator=allocator,
                      raise_oom=oom == "raise").start()
    vgpu.snapshot_path = snapshot.from_env(vgpu.allocators, rank=config.world.real_ranks[process_index])
    if options.enabled:
        start_virtual_time(vgpu, profile, options)
    return vgpu


def start_virtual_time(vgpu: VirtualGpu, profile: HardwareProfile, options: VirtualTimeOptions) -> None:
    """Give `vgpu` virtual time: the options' kernel model on the profile's GPU figures and efficiencies."""
    from prism_plugin.cost.kernel_models import kernel_model
    from prism_plugin.device.kernel_timer import KernelTimer
    from prism_plugin.device.step_kernels import attach_step_figures

    model = kernel_model(options.kernel_model, vgpu.gpu, profile.kernels, options.kernel_table,
                         fit_path=options.kernel_fit)
    table_device = getattr(model, "device", None)
    if options.kernel_model == "table" and table_device != vgpu.gpu.name:
        print(f"prism: kernel table {options.kernel_table} was measured on {table_device!r}, not on this run's "
              f"{vgpu.gpu.name!r}: its kernels take that device's times", file=sys.stderr, flush=True)
    timer = KernelTimer(model)
    vgpu.kernel_timer = timer
    clock = vgpu.start_time(timer.duration_s, profile.kernels.launch_overhead_s, program_time=options.program_time,
                            native_launch_s=profile.kernels.native_launch_s, region_time=timer.region_duration_s)
    attach_step_figures(vgpu, timer, clock)  # per-step class times, efficiencies, job key (and fit) for the summary
    if options.launch_blocking:
        _block_each_launch(clock)


def _block_each_launch(clock: VirtualTime) -> None:
    """``CUDA_LAUNCH_BLOCKING=1``: after each kernel or collective the host resumes at its end, then pays the
    launch overhead before the next launch (host and device run one after the other, as on a CPU)."""
    kernel, on_op = clock.kernel, clock.on_op

    def blocking_kernel(stream: Any, duration_s: float, name: str = "") -> float:
        end = kernel(stream, duration_s, name)
        clock.host_s = max(clock.host_s, end + clock.launch_overhead_s)
        return end

    def blocking_op(event: Any) -> None:
        on_op(event)
        clock.host_s = max(clock.host_s, event.arrival_s + event.cost_s + clock.launch_overhead_s)

    clock.kernel = blocking_kernel  # type: ignore[method-assign]
    clock.on_op = blocking_op  # type: ignore[method-assign]
