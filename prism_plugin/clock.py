"""The emulation clock: wall time on this host, anchored at the start of each iteration.

Times are seconds from `time.perf_counter()`. An execution graph's replay gives virtual
participants' arrivals as offsets from the iteration start; `anchor()` (called by adapters at
each training step) makes those offsets line up with this process's own timeline, so error does
not accumulate from step to step.

Limitations: on GPU the host runs ahead of the device, so a host timestamp is when the op was
enqueued, not when the stream reached it (DESIGN.md section 5); this clock is the CPU path.
"""

from __future__ import annotations

import time

__all__ = ["EmulationClock", "sleep_until"]

_SPIN_S = 200e-6  # below this, time.sleep overshoots by more than it saves: spin instead


def sleep_until(deadline_s: float) -> None:
    """Block the calling thread until perf_counter() >= deadline_s (sleep, then spin the tail)."""
    remaining = deadline_s - time.perf_counter()
    if remaining <= 0:
        return
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.perf_counter() < deadline_s:
        pass


class EmulationClock:
    """Iteration-anchored clock of one real process."""

    __slots__ = ("iteration", "iteration_start_s", "_start_s")

    def __init__(self) -> None:
        self._start_s = time.perf_counter()
        self.iteration = 0
        self.iteration_start_s = self._start_s

    @staticmethod
    def now_s() -> float:
        return time.perf_counter()

    def anchor(self, iteration: int | None = None) -> None:
        """Mark the start of a training iteration (offsets of the replay count from here)."""
        self.iteration = self.iteration + 1 if iteration is None else iteration
        self.iteration_start_s = time.perf_counter()

    def offset_s(self, t_s: float) -> float:
        """`t_s` as an offset from the current iteration's start."""
        return t_s - self.iteration_start_s

    def at_offset_s(self, offset_s: float) -> float:
        """The absolute time of an offset within the current iteration."""
        return self.iteration_start_s + offset_s
