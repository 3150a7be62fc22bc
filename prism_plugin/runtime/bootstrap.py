"""Run an unmodified torch.distributed script inside an emulation (used by `prism run`).

``python -m prism_plugin.runtime.bootstrap script.py args`` (or ``-m module args``) with PRISM_CONFIG,
PRISM_PROCESS_INDEX and PRISM_STORE_FILE set. The script's own ``init_process_group(backend=...)``
becomes `prism_plugin.activate` (through `lifecycle.EmulatedRun`): the requested backend and
init_method are not used, because a real rendezvous would wait for all N ranks; the timeout the script
asks for is kept. At exit (after the script's own atexit handlers) the session summary goes to stdout
(one JSON line, prefixed ``PRISM_SUMMARY``) and to ``<output_dir>/rank<R>.summary.json`` when an output
directory is configured, with the script's ``exit_code`` (and ``error`` when it raised). SIGTERM from the
launcher raises ``SystemExit(143)`` in the script once it is emulated, so the summary is still written.
A script that never calls ``init_process_group`` is reported: a line on stderr and a summary with
``"emulated": false`` (its exit code is kept: nothing distributed ran, which is not an error in itself). A
hybrid run whose ops did not follow the graph exits with `lifecycle.GRAPH_MISMATCH_EXIT_CODE`.
"""

from __future__ import annotations

import os

from prism_plugin.device import cuda_runtime

cuda_runtime.preload_if_launched()  # device virtual-gpu: the CUDA device library loads before torch

import atexit  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

from prism_plugin.config.channel import config_from_env  # noqa: E402
from prism_plugin.config.kinds import DeviceMode  # noqa: E402
from prism_plugin.runtime.lifecycle import EmulatedRun, real_store, run_target, write_summary  # noqa: E402

__all__ = ["install_init_hook", "main", "run_target"]


def install_init_hook() -> EmulatedRun:
    """Make `init_process_group` start the emulation configured in the environment; returns the run."""
    config = config_from_env(os.environ["PRISM_CONFIG"])
    process_index = int(os.environ.get("PRISM_PROCESS_INDEX", "0"))
    run = EmulatedRun(config, process_index, real_store(config.world.num_real, process_index))
    original = c10d.init_process_group
    called: list[bool] = []

    @functools.wraps(original)
    def init_process_group(backend: Any = None, init_method: Any = None, timeout: timedelta | None = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, **kwargs: Any) -> None:
        if world_size not in (-1, config.world.world_size):
            raise ValueError(
                f"prism: the script asks for world_size={world_size} but the emulation has "
                f"--world-size {config.world.world_size}; make them agree"
            )
        if rank not in (-1, run.rank):
            raise ValueError(
                f"prism: the script asks for rank={rank} but this process plays rank {run.rank}; "
                "read RANK from the environment"
            )
        dist.init_process_group = c10d.init_process_group = original
        called.append(True)
        run.start(init_timeout_s=timeout.total_seconds() if timeout is not None else None,
                  backend=_requested_backend(backend))

    dist.init_process_group = c10d.init_process_group = init_process_group
    atexit.register(_finish_at_exit, run, called)  # after the script's own atexit handlers
    return run


def _finish_at_exit(run: EmulatedRun, init_called: list[bool]) -> None:
    if not init_called:
        report_not_initialized(run)
        return
    run.finish_or_exit()


def report_not_initialized(run: EmulatedRun, extra: dict[str, Any] | None = None, code: int | None = None) -> None:
    """Say on stderr and in the summary that the script never called ``init_process_group`` (nothing emulated)."""
    if code is None:
        recorded = run.recorded_exit
        code = 0 if recorded is None or recorded[0] is None else recorded[0]
    note = "the program never called torch.distributed.init_process_group: nothing was emulated"
    print(f"prism: rank {run.rank}: {note}", file=sys.stderr, flush=True)
    world = run.config.world
    write_summary({"rank": run.rank, "world_size": world.world_size, "real_ranks": list(world.real_ranks),
                   "emulated": False, **(extra or {}), "exit_code": code, "note": note},
                  run.config.output_dir, rank=run.rank)


def _requested_backend(backend: Any) -> str | None:
    """The backend name the script asked for ("nccl", "gloo", "cpu:gloo,cuda:nccl" -> its device's), or None."""
    if backend is None:
        return None
    text = str(backend).lower()
    if ":" in text:  # device:backend pairs: the one for the program's device
        pairs = dict(item.split(":", 1) for item in text.split(",") if ":" in item)
        return pairs.get("cuda") or pairs.get("cpu") or next(iter(pairs.values()), None)
    return text


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m prism_plugin.runtime.bootstrap script.py [args] | -m module [args]")
    run = install_init_hook()
    if run.config.device is not DeviceMode.VIRTUAL_GPU:
        with run.recording():
            run_target(args)
        return
    _run_on_virtual_gpu(run, args)


def _run_on_virtual_gpu(run: EmulatedRun, args: list[str]) -> None:
    """The program on virtual GPUs; the summary carries their memory; the process ends with ``os._exit``
    (`cuda_runtime.exit_now`: the program's own atexit handlers do not run)."""
    from prism_plugin.device import cuda_runtime
    from prism_plugin.runtime.device_session import start_virtual_gpu

    vgpu = start_virtual_gpu(run.config, run.process_index)
    run.add_summary(lambda: {"device_mode": DeviceMode.VIRTUAL_GPU.value, "virtual_gpu": vgpu.summary(run.session)})
    code: int = 0
    try:
        with run.recording():
            run_target(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    if run.finish_or_exit() is None:  # the program never called init_process_group: its memory is still reported
        report_not_initialized(run, {"device_mode": DeviceMode.VIRTUAL_GPU.value, "virtual_gpu": vgpu.summary()}, code)
    vgpu.stop()
    cuda_runtime.exit_now(code)


if __name__ == "__main__":
    main()
