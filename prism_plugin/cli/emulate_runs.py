"""One profiling or hybrid run of `prism emulate`: a virtual-GPU process in its own process group that dies with
its parent, its log, its timeout and its stop event (`emulate._run_all` runs them locally, `emulate_ray` as Ray
tasks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["RunFailed", "run_one"]


class RunFailed(RuntimeError):
    """A profiling or hybrid run that exited non-zero or overran ``--timeout``; the message names its log."""


def run_one(command: list[str], run_dir: Path, rank: int, what: str, timeout_s: float,
         stop: threading.Event | None = None, env: Mapping[str, str] | None = None, *,
         virtual_time: bool = True) -> dict[str, Any]:
    """Run one virtual-GPU process with virtual time (or, `virtual_time` False, memory only: `prism plan`'s memory
    runs); its summary (`RunFailed` naming its log on failure). `stop` set from another thread (a sibling run
    failed, Ctrl-C): the run's group is killed and `RunFailed` raised. `env`: the run's environment (default this
    process's; a Ray task passes the driver's job variables)."""
    from prism_plugin.launch.processes import die_with_parent

    log = run_dir / "log.txt"
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    with log.open("w") as f:
        # its own process group (Ctrl-C here reaches emulate, which stops the whole group) that dies with emulate
        # (SIGKILL of emulate left its profiling runs running)
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ if env is None else env,
                                         PRISM_VIRTUAL_TIME="on" if virtual_time else "off"),
                                start_new_session=True, preexec_fn=die_with_parent())
        try:
            while True:
                try:
                    rc = proc.wait(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if stop is not None and stop.is_set():
                        raise RunFailed(f"prism emulate: {what} (rank {rank}) stopped; its log: {log}") from None
                    if time.monotonic() > deadline:
                        raise RunFailed(f"prism emulate: {what} (rank {rank}) ran past --timeout {timeout_s:g} s "
                                        f"and was stopped; its log: {log}; give a longer --timeout") from None
        except BaseException:  # --timeout, stop, Ctrl-C, SIGTERM (as SystemExit): the run's whole group goes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RunFailed(f"prism emulate: {what} (rank {rank}) exited {rc}; its log: {log}; the log ends:\n{tail}")
    return {"rank": rank, "wall_s": round(time.perf_counter() - t0, 3),
            "summary": json.loads((run_dir / f"rank{rank}.summary.json").read_text())}


_POLL_S = 0.2

