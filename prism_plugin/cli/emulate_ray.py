"""``prism emulate --ray ADDRESS``: the profiling and hybrid runs as Ray tasks (issue 22, item 2).

Each run is one task (``num_cpus=1``) that starts the same command the local path starts (`emulate_runs.run_one`: one
virtual-GPU process in its own process group, dying with its parent), on whichever node Ray picks. ``--ray
local`` starts a Ray instance on this machine with ``--jobs`` CPUs; ``--ray HOST:PORT`` / ``ray://HOST:PORT`` /
``auto`` joins a cluster (checked to answer before any run: `prism_plugin.cli.sweep.check_ray_address`).

What the cluster must share with this machine: the Python environment at the same path (the command is this
interpreter, ``sys.executable``) and ``--output`` (each run writes its summary and trace into its folder there, and
the graph is built from them; a local instance shares both). A run whose summary this machine cannot read is
refused, naming that requirement. The job's settings travel with each task: the variables of this process that
prism, torch and the job read (`JOB_VARIABLES` prefixes) replace the worker's own.

The first failure (a run's exit, its ``--timeout``, a task Ray lost) cancels the other tasks (``force``: their
workers die, and each run dies with its worker) and is raised; so do Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["JOB_VARIABLES", "init_ray", "run_on_ray"]

_POLL_S = 0.5

JOB_VARIABLES = ("PRISM_", "CUDA_", "NCCL_", "PYTORCH_", "NVTE_", "TORCH_", "OMP_", "MKL_", "PYTHONPATH",
                 "PYTHONHASHSEED")
"""Prefixes of the variables a run inherits from ``prism emulate`` rather than from the Ray worker."""


def _job_environment(driver: Mapping[str, str], worker: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment without its job variables, plus the driver's job variables."""
    env = {k: v for k, v in worker.items() if not k.startswith(JOB_VARIABLES)}
    env.update({k: v for k, v in driver.items() if k.startswith(JOB_VARIABLES)})
    return env


def _remote_run(command: list[str], run_dir: str, rank: int, what: str, timeout_s: float,
                driver_env: dict[str, str], virtual_time: bool = True) -> dict[str, Any]:
    """One run on a Ray worker (`emulate_runs.run_one`), in the driver's job environment."""
    from prism_plugin.cli.emulate_runs import run_one

    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return run_one(command, folder, rank, what, timeout_s, env=_job_environment(driver_env, os.environ),
                   virtual_time=virtual_time)


def _import_ray() -> Any:
    from prism_plugin.config.errors import ConfigError

    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray, the optional `cluster` extra: pip install prism_plugin[cluster]") from None
    return ray


def init_ray(address: str, jobs: int) -> bool:
    """Start or join Ray at `address` unless this process already did: ``local`` is an instance for this command
    with `jobs` CPUs and no dashboard. True when this call initialised it (the caller shuts it down)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if address == "local":
        ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def run_on_ray(runs: list[tuple[list[str], Path, int, str]], address: str, *, jobs: int, timeout_s: float,
               progress: Callable[[str], None] | None = None, env: Mapping[str, str] | None = None,
               stop: threading.Event | None = None, virtual_time: bool = True) -> list[dict[str, Any]]:
    """Every run of `runs` ((command, run_dir, rank, what)) as a Ray task; results in order (as `emulate._run_all`).
    `env`: the driver's environment the job variables come from (default this process's); `stop` set from another
    thread cancels the tasks (`RunFailed`); `virtual_time` False: memory-only runs (`prism plan`). A Ray instance
    already initialised in this process (``prism plan --ray``) is used and left running."""
    import time

    from prism_plugin.cli.emulate_runs import RunFailed

    ray = _import_ray()
    started_here = init_ray(address, jobs)
    pending: dict[Any, int] = {}
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(_remote_run)
        driver_env = dict(os.environ if env is None else env)
        for i, (command, run_dir, rank, what) in enumerate(runs):
            pending[task.remote(command, str(run_dir), rank, what, timeout_s, driver_env, virtual_time)] = i
        if progress is not None:
            progress(f"{runs[0][3] if runs else 'runs'}: {len(runs)} on Ray ({address})")
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s + 60.0
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            if stop is not None and stop.is_set():
                raise RunFailed(f"prism emulate: {len(pending)} Ray run(s) stopped")
            if not done:
                if time.monotonic() > deadline:
                    raise RunFailed(f"prism emulate: no Ray task finished within --timeout {timeout_s:g} s (+60 s); "
                                    "are the cluster's workers alive?")
                continue
            deadline = time.monotonic() + timeout_s + 60.0
            for ref in done:
                i = pending.pop(ref)
                command, run_dir, rank, what = runs[i]
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the task's own error (RunFailed), or a lost worker
                    cause = getattr(exc, "cause", None) or exc
                    message = str(cause) if isinstance(cause, RunFailed) else \
                        f"prism emulate: {what} (rank {rank}): the Ray task failed: {type(cause).__name__}: {cause}"
                    raise RunFailed(message) from None
                if not (run_dir / f"rank{rank}.summary.json").is_file():
                    raise RunFailed(f"prism emulate: {what} (rank {rank}) ran on a Ray node whose {run_dir} this "
                                    "machine cannot see; --output must be on a filesystem every node shares")
                if progress is not None:
                    progress(f"{what} ({len(results)}/{len(runs)} done on Ray): rank {rank}")
        return [results[i] for i in range(len(runs))]
    except BaseException:
        for ref in pending:  # the first failure, Ctrl-C or SIGTERM: the other runs stop (each dies with its worker)
            ray.cancel(ref, force=True)
        raise
    finally:
        if started_here:
            ray.shutdown()
