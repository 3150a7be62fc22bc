"""The launcher's child-watch loop (the parent process of every entry point that starts real ranks itself).

`launch_processes` is modelled on torchrun's elastic agent. Each real rank is started in its own session
(process group) and signalled as a group, so its DataLoader workers and other children go with it; SIGTERM /
SIGINT / SIGHUP to the launcher are forwarded to every group; the first rank to fail is named and the others get
SIGTERM, then SIGKILL after `grace_s` (a program that ignores SIGTERM cannot hang the job); a child killed by
signal S counts as exit code 128 + S. On Linux each child also dies with the launcher (``PR_SET_PDEATHSIG``,
`die_with_parent`), so a SIGKILLed launcher leaves no orphans; elsewhere it may.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["DEFAULT_GRACE_S", "RealProcess", "die_with_parent", "exit_code_of", "launch_processes"]

DEFAULT_GRACE_S = 5.0
"""Seconds between the SIGTERM a stopping launcher sends and its SIGKILL (torchrun's agent waits 30 s)."""
_POLL_S = 0.05
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# -- the launcher ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class RealProcess:
    """One real rank a launcher starts: its command and environment, and the names the launcher reports."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    virtual_rank: int
    """The rank of N this process plays (``real_ranks[process_index]``)."""
    process_index: int
    """Its index among the k real processes (LOCAL_RANK)."""


def exit_code_of(returncode: int) -> int:
    """A child's exit status as a shell reports it: killed by signal S (returncode -S) -> 128 + S.

    Examples: 0 -> 0; 1 -> 1; -9 (SIGKILL) -> 137; -15 (SIGTERM) -> 143.
    """
    return 128 - returncode if returncode < 0 else returncode


REFUSED = 2
"""A rank's exit code when it refused its input (one line on stderr naming the flag and the fix, before any process
group): the launcher adds nothing when no other rank is left to stop."""


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name}, exit code {exit_code_of(returncode)})"
    return f"exit code {returncode}"


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies (Linux ``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the launcher died before the call
            os._exit(1)

    return preexec


class _Watch:
    """The state of one launch: the children, the first failure, the pending SIGKILL deadline."""

    def __init__(self, specs: Sequence[RealProcess], launcher: str, grace_s: float) -> None:
        self.specs = list(specs)
        self.launcher = launcher
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ended: dict[int, int] = {}
        self.code = 0
        self.signalled: int | None = None
        self.kill_at: float | None = None

    def say(self, text: str) -> None:
        print(f"{self.launcher}: {text}", file=sys.stderr, flush=True)

    def start(self) -> None:
        preexec = die_with_parent()
        for spec in self.specs:
            if self.signalled is not None:  # stopped while starting: start no more
                break
            self.procs.append(subprocess.Popen(list(spec.argv), env=dict(spec.env), start_new_session=True,
                                               preexec_fn=preexec))

    def running(self) -> list[int]:
        return [i for i in range(len(self.procs)) if i not in self.ended]

    def signal_groups(self, sig: int) -> None:
        """Send `sig` to every child's process group (an ended rank's leftover children included)."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)

    def stop(self, sig: int) -> None:
        """Signal every group; SIGKILL follows after the grace period unless already pending."""
        self.signal_groups(sig)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_s

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signalled is not None:  # asked twice: no more grace
            self.say(f"received {name} again; killing the {len(self.running())} running real rank(s)")
            self.signal_groups(signal.SIGKILL)
            return
        self.signalled = signum
        self.say(f"received {name}; forwarding it to the {len(self.running())} running real rank(s)")
        self.stop(signum)

    def poll(self) -> None:
        for i in self.running():
            rc = self.procs[i].poll()
            if rc is None:
                continue
            self.ended[i] = rc
            if rc != 0 and self.code == 0 and self.signalled is None:
                self.code = exit_code_of(rc)
                spec = self.specs[i]
                if rc != REFUSED or self.running():  # a lone refusal (exit 2) has printed its one line
                    self.say(f"real rank {spec.virtual_rank} (process {spec.process_index}) ended with {_how(rc)}; "
                             f"stopping the other {len(self.running())} real rank(s)")
                self.stop(signal.SIGTERM)  # a failed real rank ends the job: never a silent hang

    def kill_stragglers(self) -> None:
        for i in self.running():
            spec = self.specs[i]
            self.say(f"real rank {spec.virtual_rank} (process {spec.process_index}) did not stop within "
                     f"{self.grace_s:g} s; sending SIGKILL")
        self.signal_groups(signal.SIGKILL)

    def wait(self, timeout_s: float | None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll()
            if not self.running():
                break
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self.kill_stragglers()
                self.kill_at = float("inf")
            if deadline is not None and now > deadline:
                self.say(f"the job ran past its {timeout_s:g} s limit; killing {len(self.running())} real rank(s)")
                self.signal_groups(signal.SIGKILL)
                for p in self.procs:
                    p.wait()
                return 124
            time.sleep(_POLL_S)
        if self.kill_at is not None:  # stopping: leftovers of groups whose leader already ended go too
            self.signal_groups(signal.SIGKILL)
        return 128 + self.signalled if self.signalled is not None else self.code


def launch_processes(processes: Sequence[RealProcess], *, launcher: str, timeout_s: float | None = None,
                     grace_s: float = DEFAULT_GRACE_S, remove: Sequence[Path] = ()) -> int:
    """Start the real ranks, watch them to the end and return the job's exit code; remove `remove` at exit.

    Exit code: 0 when every rank exits 0; else the first failed rank's (`exit_code_of`: 137 for SIGKILL);
    128 + S when the launcher itself got signal S (SIGTERM 143, SIGINT 130, SIGHUP 129); 124 past
    `timeout_s` (every group SIGKILLed). `launcher` prefixes the messages on stderr, e.g. ``prism run:
    real rank 5 (process 1) ended with exit code 1; stopping the other 1 real rank(s)``. The launcher's
    signal handlers are installed only when called from the main thread, and restored on return.
    """
    watch = _Watch(processes, launcher, grace_s)
    previous: dict[int, Any] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                previous[sig] = signal.signal(sig, watch.on_signal)
        watch.start()
        return watch.wait(timeout_s)
    except BaseException:
        watch.signal_groups(signal.SIGKILL)  # never leave real ranks behind
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in watch.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace_s)
        for path in remove:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
