"""One rank process's lifecycle for every entry point: the real processes' store, start -> run -> stop -> summary
(the launcher's child-watch loop is `prism_plugin.launch.processes`).

Four entry points run emulated processes: `prism run` (`launch` starts children that run `bootstrap`), the
Megatron wrapper (and its ``prism megatron`` self-launch), the native Megatron patch and the DeepSpeed
drop-in. They share these pieces:

- `real_store`: the store the k real processes share for their inner real groups (None for one real rank).
- `EmulatedRun`: activate -> the program -> deactivate -> the summary (a ``PRISM_SUMMARY <json>`` line on
  stdout and ``<output_dir>/rank<R>.summary.json``), with the adapters' extra summary parts and clean-ups.
  While it runs, SIGTERM raises ``SystemExit(143)`` in the program (unless the program installed its own
  handler), so a rank stopped by its launcher still writes its summary and flushes stdout. Before activating
  it refuses a world this machine cannot hold (`check_memory`); at the end it judges a hybrid run's graph
  (`prism_plugin.runtime.arrivals.check_graph_match`) and fails a run whose ops were not the graph's.
  Each summary carries ``run_id`` (``$PRISM_RUN_ID``, set by `prism run`'s launcher) when there is one, so a
  reader of a shared output directory can tell one run's summaries from another's.

Limits: a rank blocked inside a C++ call (a gloo wait) runs Python's SIGTERM handler only when the call
returns, so it may be SIGKILLed after the grace period without a summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from prism_plugin.config.emulation import (
    BASE_PROCESS_BYTES,
    BYTES_PER_VIRTUAL_RANK,
    ConfigError,
    EmulationConfig,
    VirtualWorld,
)
from prism_plugin.device.undo import Patches

if TYPE_CHECKING:
    import torch.distributed as dist

    from prism_plugin.runtime.session import Session

__all__ = ["GRAPH_MISMATCH_EXIT_CODE", "RUN_ID_ENV", "EmulatedRun", "available_memory_bytes", "check_memory",
           "real_store", "run_target", "write_summary"]

RUN_ID_ENV = "PRISM_RUN_ID"
"""The launch's id, recorded in every summary as ``run_id`` (`write_summary`)."""
GRAPH_MISMATCH_EXIT_CODE = 3
"""Exit status of a process whose program succeeded but whose ops did not follow its execution graph."""
FAULT_NEVER_FIRED_EXIT_CODE = 4
"""Exit status of a process whose program succeeded but whose ``strict=true`` hang or crash fault never fired."""



# -- the real processes' store ------------------------------------------------------------------------
def real_store(num_real: int, process_index: int, *, store: dist.Store | None = None,
               init_method: str | None = None) -> dist.Store | None:
    """The store shared by the `num_real` real processes only (None when there is one).

    In order: the `store` a caller passes; a FileStore at ``$PRISM_STORE_FILE`` (`prism run`, ``prism
    megatron``, the recipes); a FileStore at a ``file://`` `init_method`; the launcher's TCPStore at
    ``$MASTER_ADDR:$MASTER_PORT`` (torchrun, the deepspeed launcher) under a ``prism/`` key prefix.
    Raises `ConfigError` naming the options when none applies. Example: 2 real ranks under torchrun ->
    ``PrefixStore("prism", <torchrun's store>)``; 1 real rank -> None (no inner real group).
    """
    if num_real < 2:
        return None
    if store is not None:
        return store
    import torch.distributed as dist

    path = os.environ.get("PRISM_STORE_FILE")
    if path:
        return dist.FileStore(path, num_real)
    if init_method and init_method.startswith("file://"):
        return dist.FileStore(init_method[len("file://"):], num_real)
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise ConfigError(
            f"{num_real} real ranks need a store shared by the real processes: launch with `prism run` / "
            "`prism megatron` (PRISM_STORE_FILE), torchrun or the deepspeed launcher (MASTER_ADDR, MASTER_PORT), "
            "or pass store= or init_method='file:///path'"
        )
    tcp, _rank, _size = next(dist.rendezvous("env://", rank=process_index, world_size=num_real))
    return dist.PrefixStore("prism", tcp)


# -- memory: refuse a world this machine cannot hold --------------------------------------------------------
def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room_bytes() -> int | None:
    """What this process's memory cgroup (v2, else v1) still allows; None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max" or int(limit_text) >= 2**60:
                return None
            return max(0, int(limit_text) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_memory_bytes() -> int | None:
    """Bytes a new process can still take: ``MemAvailable`` of /proc/meminfo, capped by the memory cgroup's room;
    None where neither can be read (no check is made then)."""
    figures = [b for b in (_meminfo_available_bytes(), _cgroup_room_bytes()) if b is not None]
    return min(figures) if figures else None


def check_memory(world: VirtualWorld, processes: int = 1, *, available_bytes: int | None = None) -> int:
    """Refuse (a `ConfigError` with both figures) when `processes` real processes of `world` need more memory
    than is available; returns the estimate. Cheap: arithmetic (`VirtualWorld.estimated_bytes_per_process`) and
    one read of /proc/meminfo, nothing proportional to N.

    Example: world_size = 10^9 -> 256 MiB + 176 B x 10^9 = 176,268,435,456 bytes for one process: refused on a
    machine with 23 GB available (N = 10^9 was OOM-killed after 47 s before this check).
    """
    per_process = world.estimated_bytes_per_process
    need = per_process * processes
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    if avail is not None and need > avail:
        raise ConfigError(
            f"world_size={world.world_size} needs about {need:,} bytes ({need / 1e9:.1f} GB: {processes} real "
            f"process(es) x (base {BASE_PROCESS_BYTES:,} + {BYTES_PER_VIRTUAL_RANK} B x {world.world_size:,} "
            f"ranks)) but {avail:,} bytes ({avail / 1e9:.1f} GB) are available; emulate fewer ranks "
            "(--world-size) or fewer real ranks at once, or use a machine with more memory"
        )
    return need


# -- the summary ----------------------------------------------------------------------------------------
def write_summary(summary: Mapping[str, Any], output_dir: str | Path | None, *, rank: int | str = "x",
                  stdout: bool = True) -> Path | None:
    """Print ``PRISM_SUMMARY <one-line json>`` (when `stdout`) and write ``<output_dir>/rank<R>.summary.json``
    (indented; R is ``summary["rank"]``, else `rank`). Returns the file written, if any. Values JSON cannot
    encode are written as ``str(value)``. With ``$PRISM_RUN_ID`` set (`prism run`), ``run_id`` is added when
    the summary has none."""
    run_id = os.environ.get(RUN_ID_ENV)
    if run_id and "run_id" not in summary:
        summary = {**summary, "run_id": run_id}
    from prism_plugin.runtime.summary import check

    mismatch = check(summary)  # the published schema (docs/summary.schema.json): said, never fatal
    if mismatch is not None:
        print(f"prism: the summary of rank {summary.get('rank', rank)} does not match its schema "
              f"(prism_plugin.runtime.summary): {mismatch}", file=sys.stderr, flush=True)
    if stdout:
        print("PRISM_SUMMARY " + json.dumps(summary, default=str), flush=True)
    if output_dir is None:
        return None
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{summary.get('rank', rank)}.summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    return path


class EmulatedRun:
    """One real process's emulation: `start` (activate) -> the program -> `finish` (deactivate, summary).

    Entry points that run the program themselves use it as a context manager around the program (the
    exit status and error are recorded, the summary written, the program's exception re-raised; a clean
    ``SystemExit`` is absorbed); those that do not (the native Megatron patch, DeepSpeed, `bootstrap`)
    call `finish` at exit or on shutdown. Adapters add to it: `on_stop` (before deactivate, e.g. stop a
    memory tracker), `add_summary` (fields merged into the summary after deactivate) and `cleanup`
    (a `Patches` closed after the summary parts, e.g. an adapter's uninstall).

    Summary fields beyond the session's: those of the parts, then ``exit_code`` (the program's
    ``SystemExit`` code; 1 when it raised, 130 on KeyboardInterrupt, 143 on the SIGTERM this class turns into
    ``SystemExit``) and ``error`` (``"Type: message"``, only when it raised), both only when the exit was
    recorded. Not thread-safe; one per process at a time (the session's own rule).
    """

    def __init__(self, config: EmulationConfig, process_index: int = 0, store: dist.Store | None = None, *,
                 num_processes: int | None = None, print_summary: bool = True) -> None:
        self.config = config
        self.process_index = process_index
        self.store = store
        self.num_processes = num_processes
        self.print_summary = print_summary
        self.session: Session | None = None
        self.summary: dict[str, Any] | None = None
        self.cleanup = Patches()
        self._on_stop: list[Callable[[], None]] = []
        self._parts: list[Callable[[], Mapping[str, Any]]] = []
        self._exit: tuple[Any, BaseException | None] | None = None
        self._finished = False
        self._max_outside: float | None = None

    @property
    def rank(self) -> int:
        """The virtual rank this process plays."""
        return self.config.world.real_ranks[self.process_index]

    def start(self, *, init_timeout_s: float | None = None, backend: str | None = None) -> Session:
        """Activate the emulation (`prism_plugin.activate`) and turn SIGTERM into ``SystemExit(143)``.

        `backend`: what the program asked ``init_process_group`` for (its groups report and refuse as it does)."""
        from prism_plugin.runtime import session as session_mod

        if self.session is not None or self._finished:
            raise RuntimeError("prism: EmulatedRun.start() runs once per run")
        check_memory(self.config.world)  # before any process group: N too large for this machine
        if self.config.graph is not None:
            from prism_plugin.runtime.arrivals import max_outside_fraction

            self._max_outside = max_outside_fraction(os.environ)  # a malformed override fails here
        self.session = session_mod.activate(self.config, self.process_index, self.store,
                                            init_timeout_s=init_timeout_s, num_processes=self.num_processes,
                                            backend=backend)
        _exit_on_sigterm(self.cleanup)
        return self.session

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call `fn` when the program has ended, before the session is deactivated."""
        self._on_stop.append(fn)

    def add_summary(self, part: Callable[[], Mapping[str, Any]]) -> None:
        """Merge ``part()`` into the summary (after deactivate, before `cleanup`), in the order added."""
        self._parts.append(part)

    def record_exit(self, exc: BaseException | None) -> None:
        """Record how the program ended: None (it returned), its ``SystemExit``, or the exception it raised."""
        if exc is None:
            self._exit = (0, None)
        elif isinstance(exc, SystemExit):
            self._exit = (exc.code, None)
        else:
            self._exit = (130 if isinstance(exc, KeyboardInterrupt) else 1, exc)

    @property
    def recorded_exit(self) -> tuple[Any, BaseException | None] | None:
        """How the program ended (`record_exit`): ``(exit code, exception or None)``, None if not recorded."""
        return self._exit

    @contextlib.contextmanager
    def recording(self) -> Iterator[EmulatedRun]:
        """Record the exit of the block's program (`record_exit`) without finishing the run."""
        try:
            yield self
        except BaseException as exc:
            self.record_exit(exc)
            raise
        self.record_exit(None)

    def finish_at_exit(self) -> None:
        """Finish the run when the interpreter exits (after the program's own atexit handlers)."""
        import atexit

        atexit.register(self.finish_or_exit)

    def finish_or_exit(self) -> dict[str, Any] | None:
        """`finish`; a `GraphMismatchError` ends the process with `GRAPH_MISMATCH_EXIT_CODE`, a strict fault that never
        fired with `FAULT_NEVER_FIRED_EXIT_CODE` (for atexit, where an exception would not change the exit status)."""
        from prism_plugin.runtime.arrivals import GraphMismatchError
        from prism_plugin.runtime.live_faults import FaultNeverFiredError

        try:
            return self.finish()
        except (GraphMismatchError, FaultNeverFiredError) as exc:
            print(f"prism: rank {self.rank}: {exc}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(GRAPH_MISMATCH_EXIT_CODE if isinstance(exc, GraphMismatchError) else FAULT_NEVER_FIRED_EXIT_CODE)

    def finish(self) -> dict[str, Any] | None:
        """Deactivate and write the summary (once; later calls return it). None when never started.

        A hybrid run's summary gets ``graph_check`` (`prism_plugin.runtime.arrivals.check_graph_match`); when it
        is refused and the program itself succeeded, the summary's ``error`` says why and `GraphMismatchError`
        is raised after the summary is written."""
        if self._finished:
            return self.summary
        self._finished = True
        if self.session is None:
            self.cleanup.close()
            return None
        from prism_plugin.runtime import session as session_mod
        from prism_plugin.runtime.live_faults import FaultNeverFiredError

        never_fired: FaultNeverFiredError | None = None
        try:
            try:
                for fn in self._on_stop:
                    fn()
            finally:
                try:
                    summary = session_mod.deactivate() or {}
                except FaultNeverFiredError as exc:  # strict=true: written below, then raised
                    never_fired, summary = exc, dict(exc.summary or {})
            for part in self._parts:
                summary.update(part())
        finally:
            self.cleanup.close()
        if self._exit is not None:
            summary["exit_code"], error = self._exit
            if error is not None:
                summary["error"] = f"{type(error).__name__}: {error}"
        refusal = self._judge_graph(summary)
        program_ok = self._exit is None or self._exit[0] in (0, None)
        if never_fired is not None and program_ok and refusal is None:
            summary["error"] = f"FaultNeverFiredError: {never_fired}"
        self.summary = summary
        write_summary(summary, self.config.output_dir, rank=self.rank, stdout=self.print_summary)
        sys.stderr.flush()
        if refusal is not None:
            from prism_plugin.runtime.arrivals import GraphMismatchError

            raise GraphMismatchError(refusal)
        if never_fired is not None and program_ok:
            raise never_fired
        return summary

    def _judge_graph(self, summary: dict[str, Any]) -> str | None:
        """Add ``graph_check`` to a hybrid run's summary; the refusal text when the run must fail."""
        if not isinstance(summary.get("graph"), Mapping):
            return None
        from prism_plugin.runtime.arrivals import DEFAULT_MAX_OUTSIDE_FRACTION, check_graph_match

        limit = DEFAULT_MAX_OUTSIDE_FRACTION if self._max_outside is None else self._max_outside
        verdict = summary["graph_check"] = check_graph_match(summary["graph"], limit)
        program_ok = self._exit is None or self._exit[0] in (0, None)
        if verdict["verdict"] != "refused" or not program_ok:
            return None
        text = f"the execution graph {summary['graph'].get('path')} does not match the program: {verdict['reason']}"
        summary["error"] = f"GraphMismatchError: {text}"
        return text

    def __enter__(self) -> EmulatedRun:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self.record_exit(exc)
        self.finish()  # a GraphMismatchError (the program succeeded, its ops were not the graph's) propagates
        return isinstance(exc, SystemExit) and exc.code in (0, None)


def _raise_system_exit(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    # the launcher stops the rank's whole process group: its DataLoader workers die of the same SIGTERM, and
    # torch's SIGCHLD handler would raise "DataLoader worker ... is killed by signal" in every iterator's teardown
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def _exit_on_sigterm(cleanup: Patches) -> None:
    """SIGTERM -> ``SystemExit(143)`` in the main thread until `cleanup` closes; a program's own handler wins."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGTERM, _raise_system_exit)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is _raise_system_exit:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    cleanup.callback(restore)


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
