"""Run an unmodified torch.distributed script inside an emulation (used by `prism run`).

``python -m prism_plugin.runtime.bootstrap script.py args`` (or ``-m module args``) with PRISM_CONFIG,
PRISM_PROCESS_INDEX and PRISM_STORE_FILE set. The script's own ``init_process_group(backend=...)``
becomes `prism_plugin.activate` (through `lifecycle.EmulatedRun`): the requested backend and
init_method are not used, because a real rendezvous would wait for all N ranks; the timeout the script
asks for is kept. At exit (after the script's own atexit handlers) the session summary goes to stdout
(one JSON line, prefixed ``PRISM_SUMMARY``) and to ``<output_dir>/rank<R>.summary.json`` when an output
directory is configured, with the script's ``exit_code`` (and ``error`` when it raised). SIGTERM from the
launcher raises ``SystemExit(143)`` in the script once it is emulated, so the summary is still written.
A script that never calls ``init_process_group`` writes no summary.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from prism_plugin.runtime.launch import config_from_env
from prism_plugin.runtime.lifecycle import EmulatedRun, real_store

__all__ = ["install_init_hook", "main", "run_target"]


def install_init_hook() -> EmulatedRun:
    """Make `init_process_group` start the emulation configured in the environment; returns the run."""
    config = config_from_env(os.environ["PRISM_CONFIG"])
    process_index = int(os.environ.get("PRISM_PROCESS_INDEX", "0"))
    run = EmulatedRun(config, process_index, real_store(config.world.num_real, process_index))
    original = c10d.init_process_group

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
        run.start(init_timeout_s=timeout.total_seconds() if timeout is not None else None)

    dist.init_process_group = c10d.init_process_group = init_process_group
    run.finish_at_exit()
    return run


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m prism_plugin.runtime.bootstrap script.py [args] | -m module [args]")
    run = install_init_hook()
    with run.recording():
        run_target(args)


def run_target(args: list[str]) -> None:
    """Run ``script.py args`` or ``-m module args`` as ``__main__``, as ``python`` would."""
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("prism: -m needs a module name")
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
