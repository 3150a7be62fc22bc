"""DeepSpeed under emulation: `init_distributed(config)`, the drop-in for ``deepspeed.init_distributed()``.

Usage (the training script's one change; or apply ``patches/deepspeed-0.19.8`` and change nothing)::

    import prism_plugin.deepspeed as prism_ds
    prism_ds.init_distributed("ds_config.json")   # instead of deepspeed.init_distributed()
    net = PipelineModule(...)                      # unmodified from here on
    engine, *_ = deepspeed.initialize(model=net, config="ds_config.json")

With a ``"prism"`` section (see `section`) process i plays virtual rank ``real_ranks[i]`` of N; without
one this calls ``deepspeed.init_distributed`` unchanged. Launch with ``torchrun --nproc-per-node k`` or
``deepspeed --num_gpus k``: the launcher's RANK is the process index, its WORLD_SIZE must equal k.

Seams (each installed here, held by one `Patches` and undone by `shutdown`):
- ``deepspeed.comm.comm.cdb``: a `TorchBackend` over the initialised prism world (DeepSpeed keeps a
  pre-set, initialised cdb). Its shared-memory all-reduce op is not built: it would initialise shared
  memory for N local ranks and wait for the absent ones (it only serves ``inference_all_reduce``,
  which then falls back to ``torch.distributed.all_reduce``).
- device: ``deepspeed.accelerator.set_accelerator`` pins the detected accelerator (CPU here; CUDA on virtual GPUs,
  ``"device": "virtual-gpu"``, see `virtual_gpu`: the process is re-executed once through its entry), and the
  process's physical device is ``LOCAL_RANK`` (set when the launcher did not). Environment seen by
  the program afterwards: RANK = virtual rank, WORLD_SIZE = N, LOCAL_RANK = physical index.
- pipeline: `grid` (closed-form topology queries; same groups, linear set-up) and `pipe` (tensor-meta
  handshake from a virtual previous stage); ZeRO-3: `zero` (its rank-0 consistency broadcasts, and
  ``torch._dynamo`` imported before ``deepspeed.zero.Init`` can be entered: on torch 2.13 a first
  dynamo import inside that context fails with a ``tensor_pynew`` signature mismatch).

Limitations: one emulation per process at a time; ``dist_backend`` is not used (the inner real groups
are gloo for CPU tensors, NCCL for CUDA tensors); MPI discovery is not attempted. ``"graph"`` turns on
hybrid emulation (virtual participants arrive when the graph's replay says, re-anchored at every
optimizer step); ``"trace"`` records the real ranks' traces for ``prism graph build``.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

import prism_plugin.runtime.session as session_mod
from prism_plugin.adapters.deepspeed.section import PrismSection, parse_section
from prism_plugin.config.emulation import ConfigError
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.device.active import Slot, slot
from prism_plugin.runtime.lifecycle import EmulatedRun, real_store

__all__ = ["DeepSpeedEmulation", "init_distributed", "shutdown", "active", "maybe_init_distributed"]

_EMULATION: Slot[DeepSpeedEmulation] = slot("deepspeed_emulation")
"""The emulation this process runs under (`prism_plugin.device.active`)."""
_ATEXIT_REGISTERED = False


def active() -> DeepSpeedEmulation | None:
    """The emulation this process runs under, if any."""
    return _EMULATION.current()


class DeepSpeedEmulation:
    """Process-wide owner of the DeepSpeed seams of one emulation (one per process).

    Its `run` (`lifecycle.EmulatedRun`) activates and ends the session and writes the summary file (no
    stdout line: DeepSpeed runs never printed one); `patches` (the run's clean-up) holds every seam.
    """

    def __init__(self, section: PrismSection, process_index: int, store: dist.Store | None = None) -> None:
        self.section = section
        self.process_index = process_index
        self.run = EmulatedRun(section.emulation, process_index, store, print_summary=False)
        self.patches = self.run.cleanup
        self.summary: dict[str, Any] | None = None
        self.cpu_adam: Any = None
        """ZeRO-Offload's answered CPU Adam on a virtual GPU (`virtual_gpu.install`), for the summary."""
        self.fast_forward: Any = None
        """Virtual GPUs: the pipeline engine's fast-forward (`fast_forward.PipeFastForward`), when on."""

    @property
    def session(self) -> session_mod.Session | None:
        return self.run.session

    @property
    def rank(self) -> int:
        return self.section.real_ranks[self.process_index]

    def _set_env(self, key: str, value: str) -> None:
        old = os.environ.get(key)
        os.environ[key] = value
        self.patches.callback(_restore_env, key, old)

    def install(self, local_world_size: int) -> None:
        from deepspeed import accelerator as ds_accelerator
        from deepspeed.comm import comm as ds_comm

        from prism_plugin.adapters.deepspeed import grid, pipe, zero

        zero.prepare_zero_init()
        self.patches.callback(_forget_deepspeed_state)  # runs last, after every seam is undone
        world = self.section.emulation.world
        device_index = world.device_of(self.process_index, local_world_size)
        self._set_env("RANK", str(self.rank))
        self._set_env("WORLD_SIZE", str(world.world_size))
        if "LOCAL_RANK" not in os.environ or world.devices is not None:
            self._set_env("LOCAL_RANK", str(device_index))
        accel = ds_accelerator.get_accelerator()
        if self.section.emulation.device is DeviceMode.VIRTUAL_GPU and accel.device_name() != "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

            accel = CUDA_Accelerator()  # virtual GPUs answer torch.cuda: DeepSpeed's CUDA code paths
        ds_accelerator.set_accelerator(accel)
        if accel.device_name() != "cpu":
            accel.set_device(int(os.environ["LOCAL_RANK"]))
        self.patches.setattr(ds_comm, "cdb", _torch_backend(self.section.emulation.timeout_s))
        grid.install(self)
        pipe.install(self)
        zero.install(self)
        if self.section.emulation.device is DeviceMode.VIRTUAL_GPU:
            from prism_plugin.adapters.deepspeed import virtual_gpu

            self.cpu_adam = virtual_gpu.install(self.patches, virtual_gpu.active_gpu(),
                                                profile=self.section.emulation.profile,
                                                ds_config=self.section.ds_config)
            self.fast_forward = self._start_fast_forward(virtual_gpu.active_gpu())

    def _start_fast_forward(self, gpu: Any) -> Any:
        """Virtual GPUs (with virtual time or memory only) and ``"fast_forward"`` on (the default): the pipeline
        engine's schedule, driven (`fast_forward.PipeFastForward`); its figures in the summary's
        ``deepspeed.fast_forward``."""
        from prism_plugin.config.virtual_time import VirtualTimeOptions

        if gpu is None or not VirtualTimeOptions.from_env().fast_forward:
            return None
        from prism_plugin.adapters.deepspeed.fast_forward import PipeFastForward

        driver = PipeFastForward(gpu, self.session)
        driver.install(self.patches)
        # only where a pipeline engine trained: ZeRO's engines are never fast-forwarded
        self.run.add_summary(lambda: {"deepspeed": {"fast_forward": driver.summary()}} if driver.calls else {})
        return driver

    def close(self) -> dict[str, Any] | None:
        """End the session, undo every seam, reset DeepSpeed's cached groups; returns the session summary."""
        self.summary = self.run.finish()
        return self.summary


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _forget_deepspeed_state() -> None:
    from deepspeed.comm import comm as ds_comm

    ds_comm.cdb = None
    _reset_deepspeed_globals()


def _torch_backend(timeout_s: float) -> Any:
    """DeepSpeed's TorchBackend over the already-initialised world, without its shm all-reduce op."""
    ds_torch = sys.modules.get("deepspeed.comm.torch")
    if ds_torch is None:
        import deepspeed.comm.torch  # noqa: F401

        ds_torch = sys.modules["deepspeed.comm.torch"]  # `import a.b.torch as x` would yield torch itself
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        return ds_torch.TorchBackend(dist.get_backend(), timedelta(seconds=timeout_s), None)
    finally:
        ds_torch.build_shm_op = build


def _reset_deepspeed_globals() -> None:
    """Forget groups DeepSpeed cached in module globals (they belonged to the world just destroyed)."""
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups

    p2p._groups = None
    p2p._grid = None
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")) and name.isupper():
            setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mpu = None
    groups.mesh_device = None
    # ZeRO-3 numbers modules and parameters with process-wide counters (a mutable default argument and
    # a class attribute); a process that runs a second job would number them differently from a fresh
    # one, and ZeRO-3 compares these ids across ranks
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    defaults = parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if defaults and isinstance(defaults[0], list) and defaults[0]:
        defaults[0][0] = 0
    partition_parameters.Init.param_id = 0


def _launcher_process() -> tuple[int, int | None]:
    """(this process's index among the real processes, how many the launcher started or None)."""
    if "PRISM_PROCESS_INDEX" in os.environ:  # `prism run`: RANK is already the virtual rank
        return int(os.environ["PRISM_PROCESS_INDEX"]), None
    index = int(os.environ.get("RANK", "0"))
    count = os.environ.get("WORLD_SIZE")
    return index, int(count) if count else None


def init_distributed(config: Mapping[str, Any] | str | Path | None = None, *, store: dist.Store | None = None,
                     dist_backend: str | None = None, timeout: timedelta | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     process_index: int | None = None, **deepspeed_kwargs: Any) -> DeepSpeedEmulation | None:
    """Drop-in for ``deepspeed.init_distributed()`` that honours the config's ``"prism"`` section.

    `config` is the ds_config dict or path. With a "prism" section: validates it (errors before any process
    group exists), activates the emulation as rank ``real_ranks[i]`` of N and installs DeepSpeed's seams;
    returns the `DeepSpeedEmulation`. Without one (or `config` None): ``deepspeed.init_distributed(...)``
    with the same arguments, returning None. `rank`/`world_size`, when given, must be the virtual rank
    and N. `store` (or ``init_method="file://..."``) overrides the real processes' rendezvous; by default
    it is the launcher's MASTER_ADDR:MASTER_PORT. `process_index` overrides the launcher's RANK.
    """
    global _ATEXIT_REGISTERED
    section = parse_section(config, required=False) if config is not None else None
    if section is None:
        import deepspeed

        kwargs = dict(deepspeed_kwargs, dist_backend=dist_backend, init_method=init_method, rank=rank,
                      world_size=world_size)
        if timeout is not None:
            kwargs["timeout"] = timeout
        deepspeed.init_distributed(**kwargs)
        return None
    running = active()
    if running is not None:
        if running.section.emulation == section.emulation:
            return running  # DeepSpeed scripts may initialise twice
        raise RuntimeError("prism: an emulation with another \"prism\" section is active; call shutdown() first")
    index, launched = _launcher_process()
    if process_index is not None:
        index, launched = process_index, None
    world = section.emulation.world
    if launched is not None and launched != world.num_real:
        raise ConfigError(
            f"prism.real_ranks lists {world.num_real} ranks but the launcher started {launched} processes; "
            f"launch {world.num_real} (torchrun --nproc-per-node {world.num_real}) or list {launched} real ranks"
        )
    if not 0 <= index < world.num_real:
        raise ConfigError(f"process index {index} has no entry in prism.real_ranks ({world.num_real} entries)")
    if world_size not in (-1, world.world_size):
        raise ConfigError(f"init_distributed(world_size={world_size}) but prism.world_size is {world.world_size}")
    if rank not in (-1, world.real_ranks[index]):
        raise ConfigError(f"init_distributed(rank={rank}) but this process plays rank {world.real_ranks[index]}")
    if timeout is not None:
        section = replace(section, emulation=replace(section.emulation, timeout_s=timeout.total_seconds()))
    os.environ.update(section.environ)  # the section's settings the rank process reads (and a re-executed one)
    vgpu = _virtual_gpu(section, index)
    emulation = DeepSpeedEmulation(section, index, real_store(world.num_real, index, store=store,
                                                              init_method=init_method))
    emulation.run.start()
    if vgpu is not None:
        from prism_plugin.adapters.deepspeed.virtual_gpu import summary_part

        emulation.run.add_summary(lambda: {**summary_part(vgpu, emulation.run.session, emulation.cpu_adam),
                                           "policy_defaults": list(section.policy_defaults)})
    try:
        emulation.install(int(os.environ.get("LOCAL_WORLD_SIZE", world.num_real)))
    except BaseException:
        emulation.close()
        raise
    _EMULATION.enter(emulation)
    if not _ATEXIT_REGISTERED:
        atexit.register(shutdown)
        _ATEXIT_REGISTERED = True
    return emulation


def _virtual_gpu(section: PrismSection, index: int = 0) -> Any | None:
    """``"device": "virtual-gpu"``: the entry's virtual GPU; re-executes the process through the entry when it
    has none (`virtual_gpu.reexec`, before any process group exists; process `index` 0 says first which profile a
    section without ``"profile"`` and ``"gpu"`` runs on). None for ``"device": "real"``."""
    if section.emulation.device is not DeviceMode.VIRTUAL_GPU:
        return None
    from prism_plugin.adapters.deepspeed import virtual_gpu

    virtual_gpu.check_config(section.ds_config or {})
    vgpu = virtual_gpu.active_gpu()
    if vgpu is None:
        if section.policy_defaults and index == 0:
            from prism_plugin.adapters.deepspeed.section import KEY_NAMES
            from prism_plugin.launch.preflight import default_profile_note

            print(default_profile_note(KEY_NAMES), file=sys.stderr, flush=True)
        virtual_gpu.reexec(section.emulation)
    return vgpu


def maybe_init_distributed(config: Any) -> bool:
    """The patched DeepSpeed entry points' hook: emulate when `config` carries a "prism" section.

    `config` may be a dict, a path, or a ``DeepSpeedConfig`` (its ``_param_dict``). Returns True when
    an emulation is (now) active, False when the config has no section (DeepSpeed proceeds as usual).
    """
    if config is None:
        return active() is not None
    param_dict = getattr(config, "_param_dict", None)
    if isinstance(param_dict, Mapping):
        config = param_dict
    if isinstance(config, Mapping) and "prism" not in config:
        return active() is not None
    section = parse_section(config, required=False)
    if section is None:
        return active() is not None
    if active() is None and dist.is_initialized():
        raise RuntimeError('prism: torch.distributed was initialised before the "prism" section was read; '
                           "pass the config to the first init_distributed call")
    init_distributed(config)
    return True


def shutdown() -> dict[str, Any] | None:
    """End the emulation: undo the seams, destroy the groups; returns the session summary (None if inactive)."""
    emulation = active()
    if emulation is None:
        return None
    _EMULATION.leave(emulation)
    return emulation.close()
