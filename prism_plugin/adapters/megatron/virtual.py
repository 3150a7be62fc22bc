"""The drop-in on virtual GPUs: ``--prism-device virtual-gpu [--prism-gpu MODEL]`` (DESIGN §10).

Megatron then trains on fake ``cuda`` tensors (`prism_plugin.device`): no CPU shim, Megatron's GPU
code paths, exact per-device memory from the caching-allocator model (``torch.cuda.memory_allocated`` and
Megatron's ``memory (MB)`` log line read it), data-dependent reads answered by the value policy. The adapter's
other seams (TP valid-batch fill, rank N-1 logs, iteration marks) stay.

The device library must load before torch is imported, so the process that runs Megatron starts fresh with
``PRISM_VIRTUAL_CUDA_LIB`` set:

- without torchrun (``python -m prism_plugin.megatron`` / ``prism megatron``, any K, also K = 1) the wrapper
  builds the library (cached) and starts the K processes itself with the variable set;
- under torchrun, each process re-executes itself once (``os.execv``, same pid, so torchrun's agent still
  watches it) with the variable set; nothing of Megatron has run before.

TransformerEngine (Megatron's default ``--transformer-impl``) runs its own layer over fake kernels
(`prism_plugin.device.te`, installed by the device library's preload before Megatron is imported).
CUDA graphs run through TE (``--cuda-graph-impl transformer_engine``: `prism_plugin.device.graphs`).
Refused up front in this mode (`refusals.virtual_gpu_refusals`): Megatron's own CUDA graph managers, GPU-only
opt-in kernels TE does not provide, checkpoint kinds the virtual-GPU checkpoint path does not model (``--save`` /
``--load`` themselves run: `checkpoint`). Switched off (as in CPU mode, one line each): RoPE fusion with the
local spec. Megatron's other fusion defaults stay on, one kernel each (`fused_kernels`).

Data-dependent reads Megatron's logging options make have stated answers (`log_values`: ``--log-num-zeros-in-grad``
reads 0); a read with no answer names ``--prism-device real``.

Limitations: the process ends with ``os._exit`` after the summary (`cuda_runtime.exit_now`: the autograd engine's
CUDA worker threads would abort C++ static destruction), so the program's own atexit handlers do not run; no step
time is modelled (timing is off in this mode).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Any

from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.kinds import DeviceMode

__all__ = ["library_env", "reexec", "run_script"]


def library_env(config: EmulationConfig) -> dict[str, str]:
    """The environment a fresh Megatron process needs: the device library (built once, cached). Checks first
    that the run names a GPU model (`session.resolve_gpu`: a `ConfigError` naming the ``--prism-*`` fix)."""
    from prism_plugin.adapters.megatron.wrapper import FLAG_NAMES
    from prism_plugin.device import cuda_runtime
    from prism_plugin.runtime.device_session import resolve_gpu

    resolve_gpu(config, flags=FLAG_NAMES)
    return cuda_runtime.library_env()


def reexec(argv: list[str], config: EmulationConfig) -> None:
    """Replace this process by ``python -m prism_plugin.megatron argv`` with the device library named (never
    returns). Used under torchrun, whose process imported nothing of torch yet only by accident."""
    from prism_plugin.device import cuda_runtime

    library_env(config)  # the GPU model first: refused naming the --prism-* flags
    cuda_runtime.reexec("prism_plugin.megatron", argv)


def run_script(config: EmulationConfig, script_argv: list[str], process_index: int, k: int, *,
               policy_defaults: tuple[dict[str, str], ...] = (), stop_at_iteration: int | None = None) -> None:
    """Run the script on this process's virtual GPUs; write the summary and end the process (``os._exit``).
    `policy_defaults`: the settings the launch left to a policy default (the summary lists them);
    `stop_at_iteration`: ``--prism-stop-at-iteration`` (`MegatronAdapter`)."""
    from prism_plugin.adapters.megatron import log_values
    from prism_plugin.adapters.megatron.wrapper import FLAG_NAMES, start_run
    from prism_plugin.device import cuda_runtime
    from prism_plugin.launch.preflight import spell
    from prism_plugin.runtime.device_session import start_virtual_gpu

    vgpu = start_virtual_gpu(config, process_index)
    vgpu.values.real_device_hint = spell(FLAG_NAMES, "device", "real")
    log_values.state_answers(vgpu.values)
    log_values.answer_weight_hash_check(vgpu.values)
    code: int = 0
    try:
        emulated = start_run(config, process_index, k, cpu_mode=False, cuda_peak=False, virtual_gpu=True,
                             policy_defaults=policy_defaults, stop_at_iteration=stop_at_iteration)
        emulated.add_summary(lambda: _device_summary(vgpu, emulated.session))
        with emulated:
            sys.argv = list(script_argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
            runpy.run_path(script_argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    vgpu.stop()
    cuda_runtime.exit_now(code)


def _device_summary(vgpu: Any, session: Any = None) -> dict[str, Any]:
    return {"device_mode": DeviceMode.VIRTUAL_GPU.value, "virtual_gpu": vgpu.summary(session)}
