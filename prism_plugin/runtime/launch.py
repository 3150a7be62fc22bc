"""`prism run`: launch k real processes of an N-rank torch.distributed program, like torchrun.

Physical process i plays virtual rank ``real_ranks[i]``. Each process runs the unmodified script
through `prism_plugin.runtime.bootstrap`, which turns the script's own ``init_process_group(...)`` call
(any backend, env:// or not) into `prism_plugin.activate`. The real processes share a FileStore
in the output directory (no ports), used only for their inner real groups.

Environment the script sees: RANK = its virtual rank, WORLD_SIZE = N, LOCAL_RANK = i (the
physical device index, so ``torch.cuda.set_device(LOCAL_RANK)`` picks real device i),
LOCAL_WORLD_SIZE = k, plus PRISM_CONFIG (JSON) and PRISM_PROCESS_INDEX.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prism_plugin.config.emulation import EmulationConfig

__all__ = ["LaunchSpec", "config_to_env", "config_from_env", "launch"]


def config_to_env(config: EmulationConfig) -> str:
    w = config.world
    return json.dumps({
        "world_size": w.world_size,
        "real_ranks": list(w.real_ranks),
        "gpus_per_node": w.gpus_per_node,
        "devices": list(w.devices) if w.devices is not None else None,
        "profile": config.profile,
        "data_policy": config.data_policy.value,
        "record_dir": str(config.record_dir) if config.record_dir else None,
        "replay_dir": str(config.replay_dir) if config.replay_dir else None,
        "timing": config.timing,
        "timeout_s": config.timeout_s,
        "output_dir": str(config.output_dir) if config.output_dir else None,
        "trace_dir": str(config.trace_dir) if config.trace_dir else None,
        "trace_max_iterations": config.trace_max_iterations,
        "graph": str(config.graph) if config.graph else None,
        "iteration_marker": config.iteration_marker.value,
        "faults": [f.to_text() for f in config.faults],
    })


def config_from_env(text: str) -> EmulationConfig:
    from prism_plugin.config.emulation import VirtualWorld

    data = json.loads(text)
    devices = data.pop("devices")
    world = VirtualWorld(
        world_size=data.pop("world_size"),
        real_ranks=tuple(data.pop("real_ranks")),
        gpus_per_node=data.pop("gpus_per_node"),
        devices=tuple(devices) if devices is not None else None,
    )
    data["faults"] = tuple(data.get("faults") or ())
    return EmulationConfig(world=world, **data)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    config: EmulationConfig
    target: list[str]
    """`script.py args...` or `-m module args...`."""
    store_dir: Path | None = None


def launch(spec: LaunchSpec, *, timeout_s: float | None = None) -> int:
    """Run the k real processes to completion; the first failure stops the others. Returns the exit code."""
    config = spec.config
    k = config.world.num_real
    store_dir = Path(spec.store_dir or tempfile.mkdtemp(prefix="prism-store-"))
    store_dir.mkdir(parents=True, exist_ok=True)
    store_file = store_dir / f"store-{os.getpid()}-{time.time_ns()}"
    cfg_json = config_to_env(config)
    procs: list[subprocess.Popen[bytes]] = []
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
            "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
        })
        cmd = [sys.executable, "-m", "prism_plugin.runtime.bootstrap", *spec.target]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    code = 0
    try:
        alive = list(procs)
        while alive:
            for p in list(alive):
                rc = p.poll()
                if rc is None:
                    continue
                alive.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    rank = config.world.real_ranks[procs.index(p)]
                    why = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
                    print(f"prism run: real rank {rank} (process {procs.index(p)}) ended with {why}; stopping the "
                          f"other {len(alive)} real rank(s)", file=sys.stderr, flush=True)
                    for other in alive:  # a failed real rank ends the job: never a silent hang
                        other.send_signal(signal.SIGTERM)
            if deadline is not None and time.monotonic() > deadline:
                for p in alive:
                    p.kill()
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    finally:
        try:
            store_file.unlink(missing_ok=True)
        except OSError:
            pass
    return code
