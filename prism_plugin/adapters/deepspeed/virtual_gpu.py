"""DeepSpeed on virtual GPUs: ``"device": "virtual-gpu"`` in the ``"prism"`` section (DESIGN.md section 10).

What a DeepSpeed user does: add ``"device": "virtual-gpu"`` (and optionally ``"gpu": "h100-sxm"``; default
the profile's GPU) to the section and launch the script as before (``python``, ``torchrun`` or ``deepspeed``).
The device library must load before torch is imported (`cuda_runtime`), and a DeepSpeed script imports torch
before it reaches ``prism_plugin.deepspeed.init_distributed``, so that call re-executes the process once
(`reexec`, same pid, same environment plus the device library) as::

    python -m prism_plugin.deepspeed script.py args     # or: -m module args

`main`, that entry, preloads the library, starts the virtual GPU (shim + FakeTensorMode, `VirtualGpu`) and
then runs the script from the top: ``import deepspeed`` auto-detects CUDA (``torch.cuda.device_count() > 0 and
torch.cuda.is_available()``, answered by the shim) and selects DeepSpeed's ``CUDA_Accelerator``, whose calls
into torch.cuda the shim answers (``see_memory_usage`` prints the emulated allocator's figures). Everything the
script did before ``init_distributed`` runs twice (the first time on the CPU, discarded by the exec). When the
script ends, the entry ends the emulation (the summary gets ``device_mode`` and ``virtual_gpu``) and the process
with ``os._exit`` (`cuda_runtime.exit_now`: the program's own atexit handlers do not run).

Refused (`ConfigError`): a script started with ``python -c``; a process the re-exec did not give a virtual
device; ``prism run`` (its bootstrap runs its own emulation: use ``prism run --device virtual-gpu`` without a
"prism" section, or the section without ``prism run``); no GPU model. Interpreter options of the first
start (``python -X ...``) are not repeated.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any

from prism_plugin.config.emulation import ConfigError, EmulationConfig
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.device.active import Slot, slot

__all__ = ["ENTRY_ENV", "active_gpu", "main", "reexec"]

ENTRY_ENV = "PRISM_DS_VIRTUAL_GPU"
"""Set by `reexec` for the entry: the GPU model and the devices per process, as JSON."""
_ENTRY_MODULE = "prism_plugin.deepspeed"
_GPU: Slot[Any] = slot("deepspeed_virtual_gpu", permanent=True)
"""The entry's `VirtualGpu`: one per process, kept to its exit (`prism_plugin.device.active`)."""


def active_gpu() -> Any | None:
    """The `VirtualGpu` the entry started in this process, or None."""
    return _GPU.current()


def _target_argv() -> list[str]:
    """The program's own arguments from ``sys.orig_argv``: ``[script, args...]`` or ``["-m", module, args...]``."""
    argv = list(getattr(sys, "orig_argv", []))[1:]
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in ("-X", "-W") else 1  # interpreter options; the ones with a value take two
    rest = argv[i:]
    if not rest or rest[0] in ("-c", "-"):
        raise ConfigError('"prism.device": "virtual-gpu" re-executes the script with the virtual CUDA device; a '
                          "program given with python -c or on stdin cannot be re-executed: put it in a file")
    return rest


_EXTENSION_OPTIMIZERS = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muon")
"""DeepSpeed optimizers that exist only as CUDA extensions (FusedLamb, the 1-bit family, FusedLion, ...)."""


def check_config(ds_config: Mapping[str, Any]) -> None:
    """Refuse what fake execution cannot run, naming the key: DeepSpeed's custom CUDA extensions (DESIGN.md 10).

    Adam/AdamW is FusedAdam (a CUDA extension) unless ``"torch_adam": true`` selects ``torch.optim.Adam(W)``
    (the same state: two moments of each parameter's size, a step counter), or the optimizer is offloaded to the
    CPU: then it is DeepSpeedCPUAdam, whose step `offload` answers and times. ZeRO-3's parameter offload to the
    CPU runs (`offload.install_param_offload`); offloading to NVMe (ZeRO-Infinity's async I/O extension) is refused.
    """
    from prism_plugin.adapters.deepspeed.offload import offload_device

    optimizer = ds_config.get("optimizer") or {}
    name = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    offload = offload_device(ds_config, "offload_optimizer")
    if offload not in ("none", "", "cpu"):
        raise ConfigError(f'"prism.device": "virtual-gpu" with "zero_optimization.offload_optimizer.device": '
                          f"{offload!r}: offload to NVMe runs DeepSpeed's async I/O extension, which virtual GPUs do "
                          'not emulate; use "device": "cpu" (ZeRO-Offload) or drop it')
    param_offload = offload_device(ds_config, "offload_param")
    if param_offload not in ("none", "", "cpu"):
        raise ConfigError(f'"prism.device": "virtual-gpu" with "zero_optimization.offload_param.device": '
                          f"{param_offload!r}: offload to NVMe runs DeepSpeed's async I/O extension, which virtual "
                          'GPUs do not emulate; use "device": "cpu" (ZeRO-3 parameter offload) or drop it')
    if name in ("adam", "adamw") and offload == "cpu" and params.get("torch_adam") is True:
        raise ConfigError('"prism.device": "virtual-gpu" with "zero_optimization.offload_optimizer" and '
                          '"optimizer.params.torch_adam": true: torch.optim.AdamW would step on the host, whose CPU '
                          'time is not modelled; drop "torch_adam" (DeepSpeedCPUAdam, as ZeRO-Offload runs it)')
    if name in ("adam", "adamw") and offload != "cpu" and params.get("torch_adam") is not True:
        raise ConfigError(f'"prism.device": "virtual-gpu" with optimizer {optimizer.get("type")!r}: DeepSpeed runs '
                          "it as FusedAdam, a CUDA extension that fake execution cannot run; set "
                          '"optimizer": {"params": {"torch_adam": true}} (torch.optim.AdamW, the same state)')
    if name in _EXTENSION_OPTIMIZERS:
        raise ConfigError(f'"prism.device": "virtual-gpu" with optimizer {optimizer.get("type")!r}: DeepSpeed runs '
                          'it as a CUDA extension that fake execution cannot run; use "AdamW" with "torch_adam": true')


def reexec(config: EmulationConfig) -> None:
    """Start this process again through the entry, with the device library named (does not return)."""
    from prism_plugin.device import cuda_runtime
    from prism_plugin.runtime.device_session import VirtualTimeOptions, resolve_gpu

    if "PRISM_CONFIG" in os.environ:
        raise ConfigError('"prism.device": "virtual-gpu" in a script started by `prism run`: prism run emulates '
                          'the job itself; drop the "prism" section and use `prism run --device virtual-gpu`, or '
                          "launch the script with python/torchrun/deepspeed")
    if os.environ.get(ENTRY_ENV):
        raise ConfigError('"prism.device": "virtual-gpu": this process was re-executed for a virtual GPU but has '
                          "none (was the script started some other way than `python -m prism_plugin.deepspeed`?)")
    from prism_plugin.adapters.deepspeed.section import KEY_NAMES
    from prism_plugin.cost.gpu import GPUS

    gpu = resolve_gpu(config, flags=KEY_NAMES)  # no GPU model: refused before the exec, naming the keys
    model = next(key for key, spec in GPUS.items() if spec == gpu)
    num_devices = min(cuda_runtime.MAX_DEVICES, config.world.gpus_per_node)
    VirtualTimeOptions.from_env()  # bad PRISM_VIRTUAL_TIME / PRISM_KERNEL_* input: refused before the exec
    index = int(os.environ.get("RANK", "0"))
    rank = config.world.real_ranks[index] if index < config.world.num_real else index
    cuda_runtime.reexec(_ENTRY_MODULE, _target_argv(), {ENTRY_ENV: json.dumps(
        {"gpu": model, "num_devices": num_devices, "profile": config.profile, "rank": rank})})


def _start_gpu() -> Any:
    from prism_plugin.cost.allocator_config import AllocatorConfig
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.cost.profiles import load_profile
    from prism_plugin.device import snapshot
    from prism_plugin.device.device import VirtualGpu
    from prism_plugin.runtime.device_session import VirtualTimeOptions, start_virtual_time

    spec = json.loads(os.environ[ENTRY_ENV])
    num_devices = int(spec["num_devices"])
    device = int(os.environ.get("LOCAL_RANK", "0")) % num_devices
    allocator = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    vgpu = VirtualGpu(gpu_spec(spec["gpu"]), num_devices=num_devices, device=device, allocator=allocator)
    vgpu.values.real_device_hint = '"prism.device": "real"'  # how a NoValueError names the fix
    vgpu.start()
    vgpu.snapshot_path = snapshot.from_env(vgpu.allocators, rank=spec.get("rank"))
    options = VirtualTimeOptions.from_env()
    if options.enabled and spec.get("profile") is not None:
        start_virtual_time(vgpu, load_profile(spec["profile"]), options)
    _skip_no_op_swaps(vgpu)
    _GPU.enter(vgpu)
    return vgpu


def _skip_no_op_swaps(vgpu: Any) -> None:
    """``Module.to`` / ``_apply`` swap every fake parameter (`torch.utils.swap_tensors`), even when the conversion
    changes nothing and the new parameter aliases the old one; the swap refuses a tensor with a weak reference,
    and DeepSpeed's engine puts one on every parameter (``deepspeed.utils.debug.param_names``, a `WeakIdNameMap`
    with finalizers), so its ``module.to(device)`` of a model already there failed ("Couldn't swap
    Linear.weight"). Such a swap (same storage, same metadata) is skipped: it would exchange two equal tensors."""
    import torch

    swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if (isinstance(t1, torch.Tensor) and isinstance(t2, torch.Tensor) and t1.device == t2.device
                and t1.dtype == t2.dtype and t1.shape == t2.shape and t1.stride() == t2.stride()
                and t1.storage_offset() == t2.storage_offset() and t1.requires_grad == t2.requires_grad
                and t1.untyped_storage()._cdata == t2.untyped_storage()._cdata):
            return
        swap(t1, t2)

    vgpu.shim._patches.setattr(torch.utils, "swap_tensors", swap_tensors)  # undone by vgpu.stop()
    record_stream = torch.Tensor.record_stream

    def record_stream_on_virtual_gpu(self: torch.Tensor, stream: Any) -> None:
        """ZeRO-3's ``free_param`` records the current stream (the shim's stream object, which torch's C++ call
        refuses: "unknown parameter type"). Without virtual time every stream's work is complete when the block
        is freed, so recording it changes nothing: a no-op for fake tensors."""
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(self, FakeTensor):
            return None
        return record_stream(self, stream)

    vgpu.shim._patches.setattr(torch.Tensor, "record_stream", record_stream_on_virtual_gpu)


def install(patches: Any, vgpu: Any, *, profile: str | None = None, ds_config: Any = None) -> Any:
    """DeepSpeed's seams on a virtual GPU (held by the emulation's `patches`): ZeRO's overflow flags are answered;
    with the optimizer offloaded to the CPU (`ds_config`), ZeRO-Offload runs (`offload.install`) on the
    `profile`'s ``host:`` figures (None: their policy defaults) and its CPU Adam op is returned (None without
    offload), for the rank's summary.

    ZeRO 1/2 and 3 sum ``isinf/isnan`` of the gradient partitions into a flag, all-reduce it (MAX) over the
    data-parallel group and read it (``overflow_gpu[0].item()``, a uint8). The value policy answers "no inf/NaN
    found" for the checks themselves, but the flag passes through ops that carry no answer (``add_`` on a zeros
    tensor, indexing), so the read would be refused. The stated answer is derivable: under the policy every
    rank's gradients are finite, so every rank's flag is 0 and their MAX is 0 (no overflow: the optimizer steps).
    The whole check still runs, collectives included; the answer is counted at DeepSpeed's call site like the
    policy's own answers. Likewise ``is_invalid_grad_norm(norm)`` (``~isfinite(norm) | (norm < 0)``): the policy's
    grad norm is finite and positive (1.0), so the flag is False. Any other refused read there is still refused.
    """
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    from prism_plugin.adapters.deepspeed import offload, pipe_values
    from prism_plugin.device import values as values_mod

    pipe_values.install(patches, vgpu)  # the pipeline engine's reads; first: the answers below restore to it
    policy = vgpu.values
    read = policy.read

    def read_overflow_flag(tensor: Any) -> Any:
        try:
            return read(tensor)
        except values_mod.NoValueError:
            if str(tensor.dtype) not in ("torch.uint8", "torch.bool"):
                raise
            policy.answers[(values_mod._call_site(), "0 (ZeRO overflow / invalid-norm flag)")] += 1
            return 0

    def answering(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            policy.read = read_overflow_flag
            try:
                return original(*args, **kwargs)
            finally:
                policy.read = read

        return call

    _keep_client_optimizer_on_moved_params(patches, policy)
    for cls in (stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3):
        patches.setattr(cls, "has_overflow", answering(cls.has_overflow))
    _answer_rank0_lists(patches, policy, read)
    for module in (stage_1_and_2, stage3):  # each binds utils.is_invalid_grad_norm by name
        patches.setattr(module, "is_invalid_grad_norm", answering(module.is_invalid_grad_norm))
    if offload.offloads_params(ds_config):
        offload.install_param_offload(patches, vgpu)
    if not offload.offloads_optimizer(ds_config):
        return None
    from prism_plugin.cost.host import HostSpec
    from prism_plugin.cost.profiles import load_profile

    return offload.install(patches, vgpu, load_profile(profile).host if profile is not None else HostSpec())


def _keep_client_optimizer_on_moved_params(patches: Any, policy: Any) -> None:
    """The engine's ``module.to(device)`` keeps each parameter's identity on a GPU (``param.data`` is swapped in
    place), so an optimizer the caller built on the CPU model (the Hugging Face Trainer builds its AdamW before
    ``deepspeed.initialize``) still holds the model's parameters. A real CPU parameter cannot take a fake device
    tensor as its ``.data``, so torch gives the module a new ``Parameter`` instead, and ZeRO's mapping of the
    optimizer's parameters to names failed (``KeyError: Parameter containing: ...``). After the move, the
    client optimizer's groups (and any state) are re-pointed, in place, at the moved parameters of the same names:
    what identity would have given. Counted in the values summary (one per parameter re-pointed)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    configure = DeepSpeedEngine._configure_distributed_model

    def _configure_distributed_model(self: Any, model: Any) -> Any:
        before = list(model.named_parameters())
        out = configure(self, model)
        after = dict(self.module.named_parameters())
        moved = {id(p): after[name] for name, p in before if name in after and after[name] is not p}
        optimizer = self.client_optimizer
        if moved and hasattr(optimizer, "param_groups"):
            repointed = 0
            for group in optimizer.param_groups:
                repointed += sum(id(p) in moved for p in group["params"])
                group["params"] = [moved.get(id(p), p) for p in group["params"]]
            state = getattr(optimizer, "state", None)
            for old in [p for p in list(state or ()) if id(p) in moved]:
                state[moved[id(old)]] = state.pop(old)
            site = ("deepspeed/runtime/engine.py:_configure_distributed_model",
                    "the client optimizer follows its parameters to the virtual GPU (identity kept on a GPU)")
            policy.answers[site] += repointed
        return out

    patches.setattr(DeepSpeedEngine, "_configure_distributed_model", _configure_distributed_model)


def _answer_rank0_lists(patches: Any, policy: Any, read: Any) -> None:
    """ZeRO-3's order checks (``assert_lst_len_same_as_other_ranks``, ``get_lst_from_rank0``) broadcast rank 0's
    list into a cuda tensor and read it back; a fake tensor carries no values. Answer: this rank's own list (the
    mirror rule of `zero`: rank 0 traced what this rank traced). The broadcasts still run. Limitation: on virtual
    GPUs a real rank 0 that traced another order is not detected."""
    from deepspeed.runtime.zero import utils as zero_utils

    from prism_plugin.device import values as values_mod

    def answering(original: Any, answers_of: Any) -> Any:
        def call(lst: list[int]) -> Any:
            answers = iter(answers_of(lst))

            def read_mirror(tensor: Any) -> Any:
                value = next(answers)
                policy.answers[(values_mod._call_site(), "rank 0's list = this rank's (mirror)")] += 1
                return value

            policy.read = read_mirror
            try:
                return original(lst)
            finally:
                policy.read = read

        return call

    patches.setattr(zero_utils, "assert_lst_len_same_as_other_ranks",
                    answering(zero_utils.assert_lst_len_same_as_other_ranks, lambda lst: [len(lst)]))
    patches.setattr(zero_utils, "get_lst_from_rank0", answering(zero_utils.get_lst_from_rank0, list))


def summary_part(vgpu: Any, session: Any = None, cpu_adam: Any = None) -> dict[str, Any]:
    """The rank summary's device part; with ZeRO-Offload's CPU Adam (`cpu_adam`, if it stepped) its figures."""
    part = {"device_mode": DeviceMode.VIRTUAL_GPU.value, "virtual_gpu": vgpu.summary(session)}
    if cpu_adam is not None and cpu_adam.steps:
        part["virtual_gpu"]["cpu_adam"] = cpu_adam.summary()
    return part


def main(args: list[str]) -> None:
    """The entry (after `cuda_runtime.preload`): the script on a virtual GPU, then the summary and ``os._exit``."""
    from prism_plugin.adapters.deepspeed import runtime
    from prism_plugin.device import cuda_runtime

    if not args:
        raise SystemExit("usage: python -m prism_plugin.deepspeed script.py [args] | -m module [args]")
    if not os.environ.get(ENTRY_ENV):
        raise SystemExit(f"prism: python -m {_ENTRY_MODULE} is started by init_distributed for "
                         '"device": "virtual-gpu"; launch the script itself')
    vgpu = _start_gpu()
    code: int = 0
    error: BaseException | None = None
    try:
        from prism_plugin.runtime.lifecycle import run_target  # after the device library: imports torch

        run_target(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        error = exc
    except BaseException as exc:
        traceback.print_exc()
        code, error = 1, exc
    emulation = runtime.active()
    if emulation is not None:
        emulation.run.record_exit(error)
        try:
            runtime.shutdown()
        except BaseException:
            traceback.print_exc()
            code = code or 1
    else:
        print("prism: the script never called prism_plugin.deepspeed.init_distributed: nothing was emulated",
              file=sys.stderr, flush=True)
    vgpu.stop()
    cuda_runtime.exit_now(code)
