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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.gpu import GpuSpec, gpu_spec
from prism_plugin.cost.profiles import HardwareProfile, load_profile
from prism_plugin.runtime.preflight import DEFAULT_PROFILE, RUN_FLAGS, spell
from prism_plugin.runtime.virtual_gpu import cuda_runtime, snapshot
from prism_plugin.runtime.virtual_gpu.clock import VirtualTime
from prism_plugin.runtime.virtual_gpu.device import VirtualGpu

__all__ = ["VirtualTimeOptions", "resolve_gpu", "start_virtual_gpu", "start_virtual_time"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VirtualTimeOptions:
    """How a virtual-GPU process keeps time, from its environment (`from_env`; the CLI sets these variables).

    ``PRISM_VIRTUAL_TIME``: ``on`` (the default: modelled kernel and communication time on emulated streams) or
    ``off`` (memory only: nothing takes time, step time is not modelled); ``PRISM_KERNEL_MODEL``: ``roofline``
    (the default), ``table`` with ``PRISM_KERNEL_TABLE`` (a table `prism kernels record` wrote) or ``fit`` with
    ``PRISM_KERNEL_FIT`` (an overlay `prism kernels fit` wrote);
    ``PRISM_PROGRAM_TIME``: ``wall`` (the default) or ``emulated`` (the program's ``time.time`` /
    ``perf_counter`` / ``monotonic`` read the emulated host clock, so its own logs print emulated figures);
    ``CUDA_LAUNCH_BLOCKING=1`` (CUDA's own meaning): each launch, kernel or collective, returns to the host only
    when its work has ended, as every op does on a CPU (the clock of `prism kernels record`'s CPU check).
    """

    enabled: bool = True
    kernel_model: str = "roofline"
    kernel_table: Path | None = None
    kernel_fit: Path | None = None
    program_time: bool = False
    launch_blocking: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 names: Mapping[str, str] | None = None) -> VirtualTimeOptions:
        """The options of `environ` (default ``os.environ``); a `ConfigError` naming each setting as `names` spells
        it (variable -> the entry point's flag, e.g. ``{"PRISM_KERNEL_MODEL": "--kernel-model"}``; the variable
        itself otherwise) and saying the fix."""
        env = os.environ if environ is None else environ

        def said(var: str, value: str | None = None) -> str:
            name = (names or {}).get(var, var)
            if value is None:
                return name
            return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"

        values = {name: env.get(name, default) for name, default in
                  (("PRISM_VIRTUAL_TIME", "on"), ("PRISM_KERNEL_MODEL", "roofline"), ("PRISM_PROGRAM_TIME", "wall"))}
        for name, allowed in (("PRISM_VIRTUAL_TIME", ("on", "off")),
                              ("PRISM_KERNEL_MODEL", ("roofline", "table", "fit")),
                              ("PRISM_PROGRAM_TIME", ("wall", "emulated"))):
            if values[name] not in allowed:
                raise ConfigError(f"{said(name, values[name])}: use one of {', '.join(allowed)}")
        model = values["PRISM_KERNEL_MODEL"]
        for var, wanted, source in (("PRISM_KERNEL_TABLE", "table", "`prism kernels record`"),
                                    ("PRISM_KERNEL_FIT", "fit", "`prism kernels fit`")):
            path = env.get(var) or None
            if path is not None and model != wanted:
                raise ConfigError(f"{said(var, path)} is read by the {wanted} kernel model, not by "
                                  f"{said('PRISM_KERNEL_MODEL', model)}: add {said('PRISM_KERNEL_MODEL', wanted)} "
                                  f"or drop {said(var)}")
            if path is None and model == wanted:
                raise ConfigError(f"{said('PRISM_KERNEL_MODEL', wanted)} needs {said(var, '<file>')} (a file "
                                  f"from {source})")
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{said(var, path)} is not a file; write one with {source}")
        if values["PRISM_VIRTUAL_TIME"] == "off":
            timed = [said(var, env[var]) for var in ("PRISM_KERNEL_MODEL", "PRISM_KERNEL_TABLE", "PRISM_KERNEL_FIT")
                     if env.get(var)]
            timed += [said("PRISM_PROGRAM_TIME", "emulated")] if values["PRISM_PROGRAM_TIME"] == "emulated" else []
            if timed:
                raise ConfigError(f"{said('PRISM_VIRTUAL_TIME', 'off')} keeps no time, so {' and '.join(timed)} "
                                  f"would do nothing: drop {said('PRISM_VIRTUAL_TIME', 'off')} or the time settings")
        table, fit = env.get("PRISM_KERNEL_TABLE") or None, env.get("PRISM_KERNEL_FIT") or None
        return cls(enabled=values["PRISM_VIRTUAL_TIME"] == "on", kernel_model=model,
                   kernel_table=Path(table) if table else None, kernel_fit=Path(fit) if fit else None,
                   program_time=values["PRISM_PROGRAM_TIME"] == "emulated",
                   launch_blocking=env.get("CUDA_LAUNCH_BLOCKING", "0") == "1")


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
    num_devices = min(cuda_runtime.MAX_DEVICES, config.world.gpus_per_node)
    device = int(os.environ.get("LOCAL_RANK", process_index)) % num_devices
    allocator = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    oom = os.environ.get("PRISM_VIRTUAL_GPU_OOM", "raise")
    if oom not in ("raise", "report"):
        raise ConfigError(f"PRISM_VIRTUAL_GPU_OOM={oom!r}: use raise (torch's OutOfMemoryError, the default) or "
                          "report (count each OOM in the summary and run on)")
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
    from prism_plugin.runtime.virtual_gpu.kernels import KernelTimer
    from prism_plugin.runtime.virtual_gpu.step_kernels import attach_step_figures

    timer = KernelTimer(kernel_model(options.kernel_model, vgpu.gpu, profile.kernels, options.kernel_table,
                                     fit_path=options.kernel_fit))
    clock = vgpu.start_time(timer.duration_s, profile.kernels.launch_overhead_s, program_time=options.program_time,
                            region_time=timer.region_duration_s)
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
