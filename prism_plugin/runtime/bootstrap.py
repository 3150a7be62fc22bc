"""Run an unmodified torch.distributed script inside an emulation (used by `prism run`).

``python -m prism_plugin.runtime.bootstrap script.py args`` (or ``-m module args``) with PRISM_CONFIG,
PRISM_PROCESS_INDEX and PRISM_STORE_FILE set. The script's own ``init_process_group(backend=...)``
becomes `prism_plugin.activate`: the requested backend and init_method are not used, because a
real rendezvous would wait for all N ranks; the timeout the script asks for is kept. At exit the
session summary goes to stdout (one JSON line, prefixed ``PRISM_SUMMARY``) and to
``<output_dir>/rank<R>.summary.json`` when an output directory is configured.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import prism_plugin.runtime.session as session_mod
from prism_plugin.runtime.launch import config_from_env

__all__ = ["install_init_hook", "main"]


def _real_store(num_real: int, process_index: int) -> dist.Store | None:
    if num_real < 2:
        return None
    path = os.environ.get("PRISM_STORE_FILE")
    if not path:
        raise RuntimeError("prism: PRISM_STORE_FILE is not set; launch with `prism run`")
    return dist.FileStore(path, num_real)


def _write_summary(summary: dict[str, Any] | None, output_dir: str | None) -> None:
    if summary is None:
        return
    print("PRISM_SUMMARY " + json.dumps(summary), flush=True)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, f"rank{summary['rank']}.summary.json"), "w") as fh:
            json.dump(summary, fh, indent=2)


def install_init_hook() -> None:
    """Make `init_process_group` activate the emulation configured in the environment."""
    config = config_from_env(os.environ["PRISM_CONFIG"])
    process_index = int(os.environ.get("PRISM_PROCESS_INDEX", "0"))
    real_store = _real_store(config.world.num_real, process_index)
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(backend: Any = None, init_method: Any = None, timeout: timedelta | None = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, **kwargs: Any) -> None:
        if world_size not in (-1, config.world.world_size):
            raise ValueError(
                f"prism: the script asks for world_size={world_size} but the emulation has "
                f"--world-size {config.world.world_size}; make them agree"
            )
        if rank not in (-1, config.world.real_ranks[process_index]):
            raise ValueError(
                f"prism: the script asks for rank={rank} but this process plays rank "
                f"{config.world.real_ranks[process_index]}; read RANK from the environment"
            )
        dist.init_process_group = c10d.init_process_group = original
        init_timeout = timeout.total_seconds() if timeout is not None else None
        session_mod.activate(config, process_index, real_store, init_timeout_s=init_timeout)

    dist.init_process_group = c10d.init_process_group = init_process_group

    def finish() -> None:
        _write_summary(session_mod.deactivate(), str(config.output_dir) if config.output_dir else None)

    atexit.register(finish)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m prism_plugin.runtime.bootstrap script.py [args] | -m module [args]")
    install_init_hook()
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
