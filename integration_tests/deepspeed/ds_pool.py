"""Long-lived worker processes for the DeepSpeed integration tests (reused across tests).

A `Pool` spawns at most `max_workers` processes once (multiprocessing *spawn*; each imports torch and
DeepSpeed once, which dominates a job's cost on this 2-core machine). A *job* runs one function
``fn(**kwargs_i)`` on workers 0..k-1 at the same time (worker i gets ``kwargs_list[i]``) and returns
their results in order. Jobs bring their own world: the functions call
``prism_plugin.deepspeed.init_distributed`` and ``shutdown`` (rendezvous: a fresh FileStore file per
job, never a port). A job that raises on any worker fails with that worker's traceback; a worker
that stops answering fails the job with a timeout; either way every worker is killed and respawned
at the next job (peers of a failed collective may be stuck in it).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Pool", "JobError"]

_HERE = str(Path(__file__).resolve().parent)


class JobError(RuntimeError):
    """A job raised on a worker (the message carries its traceback), died or timed out."""


def _resolve(ref: str) -> Callable[..., Any]:
    module_name, _, name = ref.partition(":")
    return getattr(importlib.import_module(module_name), name)


def _worker_main(conn: Any, path_entries: list[str]) -> None:
    for entry in reversed(path_entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(1)  # 2 cores shared by up to 4 workers
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "exit":
            conn.send(("ok", None))
            return
        _, ref, kwargs = msg
        try:
            conn.send(("ok", _resolve(ref)(**kwargs)))
        except BaseException as exc:  # reported to the parent, the worker lives on
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Pool:
    """Up to `max_workers` reusable processes running jobs (see module doc)."""

    def __init__(self, tmp_dir: Path, max_workers: int = 4, timeout_s: float = 120.0) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._files = itertools.count()
        self.spawned = 0

    def store_path(self) -> str:
        """A fresh FileStore file for one job's real processes."""
        path = self.tmp_dir / f"store-{next(self._files)}"
        path.unlink(missing_ok=True)
        return str(path)

    def _ensure(self, count: int) -> None:
        if count > self.max_workers:
            raise ValueError(f"job needs {count} workers, the pool allows {self.max_workers}")
        while len(self._procs) < count:
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(child, [_HERE, *sys.path]), daemon=True,
                                     name=f"prism-ds-worker{len(self._procs)}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self.spawned += 1

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def run(self, fn: Callable[..., Any], kwargs_list: Sequence[dict[str, Any]],
            timeout_s: float | None = None) -> list[Any]:
        """Run `fn` on len(kwargs_list) workers at once; their results in worker order."""
        ref = f"{fn.__module__}:{fn.__name__}"
        count = len(kwargs_list)
        self._ensure(count)
        try:
            for i, kwargs in enumerate(kwargs_list):
                self._conns[i].send(("job", ref, dict(kwargs)))
            results: dict[int, Any] = {}
            pending = {self._conns[i]: i for i in range(count)}
            deadline = time.monotonic() + (timeout_s or self.timeout_s)
            while pending:
                for conn in mp_connection.wait(list(pending), timeout=0.2):
                    i = pending.pop(conn)
                    status, payload = conn.recv()
                    if status == "error":
                        raise JobError(f"{ref} failed on worker {i}:\n{payload}")
                    results[i] = payload
                for i in pending.values():
                    if not self._procs[i].is_alive():
                        raise JobError(f"{ref}: worker {i} died (exit code {self._procs[i].exitcode})")
                if pending and time.monotonic() > deadline:
                    raise JobError(f"{ref}: workers {sorted(pending.values())} did not answer in time")
            return [results[i] for i in range(count)]
        except BaseException:
            self.kill()
            raise

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Ask the workers to exit; their exit codes (0 when clean)."""
        for conn in self._conns:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        codes = []
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if conn.poll(timeout_s):
                try:
                    conn.recv()
                except EOFError:
                    pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            codes.append(proc.exitcode)
            conn.close()
        self._procs, self._conns = [], []
        return codes
