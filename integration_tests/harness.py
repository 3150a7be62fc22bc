"""A reusable pool of long-lived worker processes that run torch.distributed programs ("cases").

Why: spawning a process and importing torch costs seconds on a 2-core machine, and a rendezvous per
test would dominate the suite. A `Cluster` spawns at most `max_workers` processes once (multiprocessing
*spawn* context), and re-configures them in place: a `Setup` says which world the workers join
(`GLOO`: a plain ``init_process_group("gloo")`` over N processes, the REAL run; `PRISM`:
``prism_plugin.activate`` with k real processes playing `real_ranks` of N). The rendezvous is a
`FileStore` in a fresh file of the cluster's tmp dir (never a port); `BARE`: no world, the case brings
its own (a DeepSpeed job calling ``prism_plugin.deepspeed.init_distributed``). A case is a plain function
``fn(ctx, **kwargs)`` of an importable module (``programs``), run by every active worker; it returns
picklable results (CPU tensors, lists, dicts, plain objects). `Cluster.run_jobs` runs a *job*, a plain
function ``fn(**kwargs_i)`` that brings its own world, on workers 0..k-1 with one kwargs each.

Failure handling (tests must fail, never hang): every receive from a worker polls with a timeout; a
case that raises is reported with the worker's traceback as a `WorkerError`. After an error or a
timeout the cluster kills its workers and respawns them lazily at the next use, since peers of a
failed collective may be stuck inside it. `close()` asks workers to exit and returns their exit codes
(0 = clean). Workers are only started when the pool is short of them: at first use and after a kill
(`spawned` <= `max_workers` x (1 + `kills`)), never per test.

Non-goals: workers run one setup at a time (a process has one default group); cases of one batch
run in order and in lockstep on all active workers; results travel pickled through pipes, so keep
them small (kilobytes to a few megabytes).
"""

from __future__ import annotations

import enum
import importlib
import itertools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["Mode", "Setup", "Cluster", "WorkerError", "WorkerTimeout", "CaseError", "Ctx", "case_ref",
           "all_subsets"]

_HERE = str(Path(__file__).resolve().parent)


class Mode(enum.StrEnum):
    GLOO = "gloo"
    """Plain torch.distributed over gloo: every rank is a real process (the reference run)."""
    PRISM = "prism"
    """prism_plugin.activate: `real_ranks` run as processes, the other ranks are virtual."""
    BARE = "bare"
    """No world: `world_size` workers, each case brings up (and tears down) its own (see `Cluster.run_jobs`)."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One configuration of the workers; equal setups are reused without re-initialising."""

    mode: Mode
    world_size: int = 4
    """N, the world size the program sees (BARE: the number of workers)."""
    real_ranks: tuple[int, ...] = ()
    """PRISM: ranks run by processes 0..k-1 (GLOO: always range(world_size))."""
    data_policy: str = "mirror"
    record_dir: str | None = None
    replay_dir: str | None = None
    timing: bool = False
    """PRISM: model time (off for functional cases: they complete as soon as data is ready)."""
    profile: str = "local-cpu-gloo"
    gpus_per_node: int = 8
    delegation: bool = True
    """PRISM: False runs with PRISM_NEW_GROUP_DELEGATION=0 (the older-torch new_group path)."""
    groups: tuple[tuple[str, tuple[int, ...], str | None], ...] = ()
    """Groups every worker creates after init, in this order: (name, global ranks, backend)."""
    timeout_s: float = 30.0
    """Timeout of the real gloo groups (the default group in GLOO mode, inner groups in PRISM)."""
    label: str = ""
    """Free text to make otherwise-equal setups distinct (e.g. to force a fresh world)."""
    backend: str | None = None
    """PRISM: the backend the program asks for, which the emulation reports and whose refusals it makes (None:
    gloo); "prism" emulates no backend's refusals (every path prism implements is reachable)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Rank played by each active worker, in worker order."""
        return self.real_ranks if self.mode is Mode.PRISM else tuple(range(self.world_size))

    @property
    def num_workers(self) -> int:
        return len(self.ranks)

    def with_(self, **changes: Any) -> Setup:
        return replace(self, **changes)

    def __str__(self) -> str:
        if self.mode is not Mode.PRISM:
            return f"{self.mode.value}{self.world_size}"
        extra = "" if self.delegation else ",nodeleg"
        pol = "" if self.data_policy == "mirror" else f",{self.data_policy}"
        return f"prism{self.world_size}{list(self.real_ranks)}{pol}{extra}{self.label}"


class WorkerError(RuntimeError):
    """A worker raised (the message carries its traceback) or died."""


class WorkerTimeout(WorkerError):
    """A worker did not answer in time (a hang: e.g. a collective some peer never joined)."""


@dataclass
class CaseError:
    """A case that raised inside a worker, returned in place of its result by `run_batch`."""

    type_name: str
    message: str
    traceback: str

    def __repr__(self) -> str:
        return f"CaseError({self.type_name}: {self.message})"


def case_ref(fn: Callable[..., Any] | str) -> str:
    """``"module:qualname"`` of a case function (importable in the workers)."""
    if isinstance(fn, str):
        return fn
    return f"{fn.__module__}:{fn.__qualname__}"


# -- worker side ------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What a case sees inside a worker."""

    setup: Setup
    process_index: int
    rank: int
    world_size: int
    groups: dict[str, Any] = field(default_factory=dict)
    """name -> ProcessGroup (or None where this rank is not a member; 'world' is the default group)."""
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    session: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-setup state a case may keep between calls."""

    @property
    def is_prism(self) -> bool:
        return self.setup.mode is Mode.PRISM

    @property
    def real_ranks(self) -> tuple[int, ...]:
        return self.setup.ranks


def _resolve(ref: str) -> Callable[..., Any]:
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.ctx: Ctx | None = None
        self.saved_env: dict[str, str | None] = {}

    def setup(self, setup: Setup, store_path: str) -> dict[str, Any]:
        from datetime import timedelta

        import torch.distributed as dist

        rank = setup.ranks[self.index]
        if setup.mode is Mode.BARE:  # no world: the jobs bring their own
            self.ctx = Ctx(setup=setup, process_index=self.index, rank=rank, world_size=setup.world_size)
            return {"rank": rank, "world_size": setup.world_size}
        env = {"PRISM_NEW_GROUP_DELEGATION": "1" if setup.delegation else "0"}
        self.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        session = None
        if setup.mode is Mode.GLOO:
            store = dist.FileStore(store_path, setup.world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=setup.world_size,
                                    timeout=timedelta(seconds=setup.timeout_s))
        else:
            import prism_plugin as P

            cfg = P.EmulationConfig(
                world=P.VirtualWorld(world_size=setup.world_size, real_ranks=setup.real_ranks,
                                     gpus_per_node=setup.gpus_per_node),
                profile=setup.profile, data_policy=setup.data_policy, record_dir=setup.record_dir,
                replay_dir=setup.replay_dir, timing=setup.timing, timeout_s=setup.timeout_s,
            )
            store = dist.FileStore(store_path, setup.num_workers) if setup.num_workers > 1 else None
            session = P.activate(cfg, process_index=self.index, real_store=store, backend=setup.backend)
        ctx = Ctx(setup=setup, process_index=self.index, rank=dist.get_rank(),
                  world_size=dist.get_world_size(), session=session)
        ctx.groups["world"] = dist.group.WORLD
        ctx.group_ranks["world"] = tuple(range(setup.world_size))
        for name, ranks, backend in setup.groups:
            pg = dist.new_group(list(ranks), backend=backend)
            ctx.groups[name] = pg if ctx.rank in ranks else None
            ctx.group_ranks[name] = tuple(sorted(ranks))
        self.ctx = ctx
        return {"rank": ctx.rank, "world_size": ctx.world_size}

    def teardown(self) -> Any:
        import torch.distributed as dist

        summary = None
        if self.ctx is not None:
            if self.ctx.setup.mode is Mode.PRISM:
                import prism_plugin as P

                summary = P.deactivate()
            elif self.ctx.setup.mode is Mode.GLOO and dist.is_initialized():  # BARE: the jobs tore theirs down
                dist.destroy_process_group()
        self.ctx = None
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved_env = {}
        return summary


def run_job(ctx: Ctx, ref: str, per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """BARE case of `Cluster.run_jobs`: worker i runs job `ref` with ``per_worker[i]``.

    Also reports whether the job left a torch.distributed world behind (it must tear down its own).
    """
    import torch.distributed as dist

    result = _resolve(ref)(**per_worker[ctx.process_index])
    return {"result": result, "left_world": dist.is_initialized()}


def _worker_main(index: int, conn: Any, path_entries: list[str]) -> None:
    for entry in reversed(path_entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(1)  # 2 cores shared by up to 4 workers: no intra-op thread pools
    worker = _Worker(index)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        try:
            if kind == "exit":
                worker.teardown()
                conn.send(("ok", None))
                conn.close()
                return
            if kind == "setup":
                conn.send(("ok", worker.setup(msg[1], msg[2])))
            elif kind == "teardown":
                conn.send(("ok", worker.teardown()))
            elif kind == "batch":
                assert worker.ctx is not None, "batch before setup"
                for ref, kwargs in msg[1]:
                    try:
                        result = _resolve(ref)(worker.ctx, **kwargs)
                        reply = ("ok", result)
                    except Exception as exc:  # reported per case; the batch goes on
                        reply = ("case_error", CaseError(type(exc).__name__, str(exc), traceback.format_exc()))
                    conn.send(reply)
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# -- parent side ------------------------------------------------------------------------------------
class Cluster:
    """Up to `max_workers` long-lived worker processes, configured by `Setup`s (see module doc)."""

    def __init__(self, tmp_dir: Path, max_workers: int = 4, timeout_s: float = 60.0,
                 spawn_timeout_s: float = 120.0, error_grace_s: float = 5.0) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.spawn_timeout_s = spawn_timeout_s
        self.error_grace_s = error_grace_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._setup: Setup | None = None
        self._stores = itertools.count()
        self.spawned = 0
        """Processes started over the cluster's life (the suite should need only a few)."""
        self.kills = 0
        """Kills of the workers (after an error or a hang); each may cost up to `max_workers` respawns."""
        self.setups = 0
        """Setups entered over the cluster's life (world initialisations, and BARE setups)."""
        self.exit_codes: list[int | None] = []
        """Exit codes of the workers of the last `close()`."""

    # -- lifecycle -----------------------------------------------------------------------------------
    def _ensure_workers(self, count: int) -> None:
        if count > self.max_workers:
            raise ValueError(f"setup needs {count} workers, the cluster allows {self.max_workers}")
        path = [_HERE, *sys.path]
        while len(self._procs) < count:
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(len(self._procs), child, path),
                                     name=f"prism-it-worker{len(self._procs)}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self.spawned += 1

    def _recv(self, i: int, timeout_s: float) -> Any:
        conn, proc = self._conns[i], self._procs[i]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.05):
            if not proc.is_alive():
                raise WorkerError(f"worker {i} died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise WorkerTimeout(f"worker {i} did not answer within {timeout_s:.0f} s")
        try:
            status, payload = conn.recv()
        except EOFError:
            raise WorkerError(f"worker {i} closed its pipe (exit code {proc.exitcode})") from None
        if status == "error":
            raise WorkerError(f"worker {i}: {payload}")
        return status, payload

    def _all(self, count: int, message: tuple[Any, ...], timeout_s: float) -> list[Any]:
        for i in range(count):
            self._conns[i].send(message)
        return [self._recv(i, timeout_s)[1] for i in range(count)]

    def kill(self) -> None:
        """Kill every worker at once (after an error or a hang); they respawn at the next use."""
        if self._procs:
            self.kills += 1
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._setup = [], [], None

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Ask workers to tear down and exit; returns their exit codes (0 each when clean)."""
        codes: list[int | None] = []
        for conn in self._conns:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for i, proc in enumerate(self._procs):
            try:
                self._recv(i, timeout_s)
            except WorkerError:
                pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            codes.append(proc.exitcode)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._setup = [], [], None
        self.exit_codes = codes
        return codes

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException:
            self.kill()
            raise

    # -- configuration -------------------------------------------------------------------------------
    @property
    def current(self) -> Setup | None:
        return self._setup

    def teardown(self) -> list[Any]:
        """Leave the current setup; returns each worker's teardown result (prism: the summary)."""
        if self._setup is None:
            return []
        count = self._setup.num_workers
        self._setup = None
        return self._guard(lambda: self._all(count, ("teardown",), self.timeout_s))

    def store_path(self) -> str:
        """A fresh FileStore file: per setup, or for a job's own world (see `run_jobs`).

        Fresh each time: a FileStore file left by an earlier (killed) world would hand the new one
        stale peer addresses.
        """
        store_file = self.tmp_dir / f"store-{os.getpid()}-{next(self._stores)}"
        store_file.unlink(missing_ok=True)
        return str(store_file)

    def setup(self, setup: Setup) -> None:
        """Bring the workers into `setup` (a no-op when already there)."""
        if self._setup == setup:
            return
        self.teardown()
        self._ensure_workers(setup.num_workers)
        store_path = self.store_path()
        self._guard(lambda: self._all(setup.num_workers, ("setup", setup, store_path), self.spawn_timeout_s))
        self._setup = setup
        self.setups += 1

    # -- running cases -------------------------------------------------------------------------------
    def _gather_case(self, setup: Setup, index: int, ref: str, kwargs: dict[str, Any],
                     timeout_s: float) -> dict[int, Any]:
        """Collect one case's result from every active worker, whichever answers first.

        Once a worker's case raised, the others may be stuck in a collective it never joined:
        they get `error_grace_s` more, then the batch fails with the first traceback.
        """
        ranks = setup.ranks
        pending = {self._conns[i]: i for i in range(setup.num_workers)}
        per_rank: dict[int, Any] = {}
        first_error: CaseError | None = None
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = mp_connection.wait(list(pending), timeout=0.1)
            for conn in ready:
                i = pending.pop(conn)
                _status, payload = self._recv(i, 1.0)
                if isinstance(payload, CaseError) and first_error is None:
                    first_error = payload
                    deadline = min(deadline, time.monotonic() + self.error_grace_s)
                per_rank[ranks[i]] = payload
            for i in pending.values():
                if not self._procs[i].is_alive():
                    raise WorkerError(f"worker {i} died (exit code {self._procs[i].exitcode}) in case "
                                      f"{index} {ref}({kwargs}) under {setup}")
            if pending and time.monotonic() > deadline:
                stuck = sorted(pending.values())
                if first_error is not None:
                    raise WorkerError(
                        f"case {index} {ref}({kwargs}) raised on some workers and left workers {stuck} "
                        f"waiting under {setup}:\n{first_error.traceback}"
                    )
                raise WorkerTimeout(f"case {index} {ref}({kwargs}): workers {stuck} did not answer "
                                    f"within {timeout_s:.0f} s under {setup}")
        return per_rank

    def run_batch(self, setup: Setup, cases: Sequence[tuple[Callable[..., Any] | str, dict[str, Any]]],
                  case_timeout_s: float | None = None) -> list[dict[int, Any]]:
        """Run `cases` in order on every worker of `setup`; per case, {rank: result or CaseError}.

        A case that raises on some workers is reported as a `CaseError` for them and the batch
        goes on; a worker that stops answering fails the whole batch with `WorkerTimeout`.
        """
        self.setup(setup)
        wire = [(case_ref(fn), dict(kwargs)) for fn, kwargs in cases]
        count = setup.num_workers
        timeout = case_timeout_s or self.timeout_s

        def go() -> list[dict[int, Any]]:
            for i in range(count):
                self._conns[i].send(("batch", wire))
            return [self._gather_case(setup, index, ref, kwargs, timeout)
                    for index, (ref, kwargs) in enumerate(wire)]

        return self._guard(go)

    def run(self, setup: Setup, fn: Callable[..., Any] | str, case_timeout_s: float | None = None,
            **kwargs: Any) -> dict[int, Any]:
        """Run one case; {rank: result}. Raises `WorkerError` when any worker's case raised."""
        (per_rank,) = self.run_batch(setup, [(fn, kwargs)], case_timeout_s)
        errors = {r: v for r, v in per_rank.items() if isinstance(v, CaseError)}
        if errors:
            rank, err = next(iter(errors.items()))
            raise WorkerError(f"{case_ref(fn)} failed on rank {rank} under {setup}:\n{err.traceback}")
        return per_rank


    def run_jobs(self, fn: Callable[..., Any] | str, kwargs_list: Sequence[dict[str, Any]],
                 timeout_s: float = 120.0) -> list[Any]:
        """Run job `fn` on workers 0..k-1 at once (worker i: ``fn(**kwargs_list[i])``); results in worker order.

        A job brings its own world (e.g. ``prism_plugin.deepspeed.init_distributed`` and ``shutdown``) in a
        `BARE` setup. A job that raises fails with that worker's traceback (`WorkerError`), one that stops
        answering with `WorkerTimeout`; either way, and when a job returns with torch.distributed still
        initialised, every worker is killed (respawned at the next use): a half set-up world or
        framework global must not leak into the next test.
        """
        setup = Setup(mode=Mode.BARE, world_size=len(kwargs_list))
        try:
            per_worker = self.run(setup, run_job, case_timeout_s=timeout_s, ref=case_ref(fn),
                                  per_worker=[dict(kwargs) for kwargs in kwargs_list])
        except WorkerError:
            self.kill()
            raise
        leaked = [i for i, out in per_worker.items() if out["left_world"]]
        if leaked:
            self.kill()
            raise WorkerError(f"{case_ref(fn)} left torch.distributed initialised on workers {leaked}")
        return [per_worker[i]["result"] for i in range(len(kwargs_list))]


def all_subsets(n: int) -> Iterable[tuple[int, ...]]:
    """Every non-empty subset of range(n), sorted, in a fixed order."""
    for size in range(1, n + 1):
        yield from itertools.combinations(range(n), size)
