"""`prism run`: launch k real processes of an N-rank torch.distributed program, like torchrun.

Physical process i plays virtual rank ``real_ranks[i]``. Each process runs the unmodified script
through `prism_plugin.runtime.bootstrap`, which turns the script's own ``init_process_group(...)`` call
(any backend, env:// or not) into `prism_plugin.activate`. The real processes share a FileStore
in the output directory (no ports), used only for their inner real groups.

Environment the script sees: RANK = its virtual rank, WORLD_SIZE = N, LOCAL_RANK = i (the
physical device index, so ``torch.cuda.set_device(LOCAL_RANK)`` picks real device i),
LOCAL_WORLD_SIZE = k, plus PRISM_CONFIG (JSON), PRISM_PROCESS_INDEX and PRISM_STORE_FILE.

Start, watch and stop are `prism_plugin.launch.processes.launch_processes` (shared with ``prism
megatron``): each real rank is its own process group; signals to the launcher reach every group.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prism_plugin.config.channel import config_to_env
from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.launch.preflight import check_launch
from prism_plugin.launch.processes import DEFAULT_GRACE_S, RealProcess, launch_processes

__all__ = ["LaunchSpec", "launch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    config: EmulationConfig
    target: list[str]
    """`script.py args...` or `-m module args...`."""
    store_dir: Path | None = None
    """Where the real processes' FileStore lives (default: a temporary directory, removed at exit)."""
    grace_s: float = DEFAULT_GRACE_S
    """Seconds a stopping job waits after SIGTERM before it SIGKILLs the real ranks still running."""


def launch(spec: LaunchSpec, *, timeout_s: float | None = None) -> int:
    """Run the k real processes to completion (`processes.launch_processes`); returns the job's exit code.

    First, once, the launch's pre-checks (`preflight.check_launch`: the program exists, the output, record and
    trace directories can be created, the graph and the recording describe this N): a `ConfigError` before any
    process starts or any directory is created.

    The first failure stops the others (SIGTERM, SIGKILL after ``spec.grace_s``); a rank killed by signal S
    counts as 128 + S; SIGTERM / SIGINT / SIGHUP to this process are forwarded to every real rank; 124
    past `timeout_s`. The store file (and the temporary directory holding it) is removed at exit.
    """
    config = spec.config
    check_launch(config, spec.target)  # once, here: one message, before any process or directory exists
    extra: dict[str, str] = {}
    if config.device is DeviceMode.VIRTUAL_GPU:  # built once here (cached), loaded by each child before torch
        from prism_plugin.device import cuda_runtime

        extra["PRISM_VIRTUAL_CUDA_LIB"] = str(cuda_runtime.build())
    k = config.world.num_real
    created = spec.store_dir is None
    store_dir = Path(spec.store_dir or tempfile.mkdtemp(prefix="prism-store-"))
    store_dir.mkdir(parents=True, exist_ok=True)
    store_file = store_dir / f"store-{os.getpid()}-{time.time_ns()}"
    cfg_json = config_to_env(config)
    processes = []
    for i, rank in enumerate(config.world.real_ranks):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank),
            "WORLD_SIZE": str(config.world.world_size),
            "LOCAL_RANK": str(i),
            "LOCAL_WORLD_SIZE": str(k),
            "GROUP_RANK": "0",
            "PRISM_CONFIG": cfg_json,
            "PRISM_PROCESS_INDEX": str(i),
            "PRISM_STORE_FILE": str(store_file),
            "PRISM_RUN_ID": os.environ.get("PRISM_RUN_ID") or store_file.name,  # one id per launch, in each summary
            "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
            **extra,
        })
        argv = (sys.executable, "-m", "prism_plugin.runtime.bootstrap", *spec.target)
        processes.append(RealProcess(argv=argv, env=env, virtual_rank=rank, process_index=i))
    return launch_processes(processes, launcher="prism run", timeout_s=timeout_s, grace_s=spec.grace_s,
                            remove=[store_dir if created else store_file])
