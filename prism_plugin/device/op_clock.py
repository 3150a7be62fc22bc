"""The clocks of one real process: the op clock comm reads and waits on, and the iteration anchor.

`WallClock` is comm's `OpClock` (`prism_plugin.comm.context`) on this host: seconds of
`time.perf_counter()`; waits sleep (then spin the tail) until an op's emulated completion and record how
late they woke (`WakeupStats`). The session builds one and hands it to comm through its op context; an
emulated (virtual-time) clock with the same two methods replaces it there, in one line.

`EmulationClock` anchors the op clock's time at the start of each iteration. An execution graph's
replay gives virtual participants' arrivals as offsets from the iteration start; `anchor()` (called
by adapters at each training step) makes those offsets line up with this process's own timeline, so
error does not accumulate from step to step.

Limitations: on GPU the host runs ahead of the device, so a host timestamp is when the op was
enqueued, not when the stream reached it (DESIGN.md section 5); this clock is the CPU path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

__all__ = ["EmulationClock", "WakeupStats", "WallClock"]

_SPIN_S = 200e-6  # below this, time.sleep overshoots by more than it saves: spin instead


class WakeupStats:
    """How late emulated completions were delivered: each wait that slept until an op's emulated end, by
    how much it woke after that deadline (this host's scheduling, the emulator's own timing error).

    Keeps the count, the maximum and a uniform sample of at most `CAP` values (deterministic reservoir).
    """

    CAP = 4096
    __slots__ = ("count", "max_s", "_sample", "_rng")

    def __init__(self) -> None:
        self.count = 0
        self.max_s = 0.0
        self._sample: list[float] = []
        self._rng = random.Random(0)

    def add(self, late_s: float) -> None:
        self.count += 1
        if late_s > self.max_s:
            self.max_s = late_s
        if len(self._sample) < self.CAP:
            self._sample.append(late_s)
        else:
            j = self._rng.randrange(self.count)
            if j < self.CAP:
                self._sample[j] = late_s

    def summary(self) -> dict[str, float | int | None]:
        """``waits_slept`` and the median / 90th percentile / maximum lateness in microseconds (None: none)."""
        if not self._sample:
            return {"waits_slept": 0, "late_median_us": None, "late_p90_us": None, "late_max_us": None}
        xs = sorted(self._sample)
        return {"waits_slept": self.count, "late_median_us": round(1e6 * xs[len(xs) // 2], 1),
                "late_p90_us": round(1e6 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], 1),
                "late_max_us": round(1e6 * self.max_s, 1)}


class WallClock:
    """The host's wall clock as comm's op clock: `now_s` is `time.perf_counter()`; `sleep_until` blocks until
    a deadline and, for an op's emulated completion, records in `wakeups` how late it woke.

    Not an op observer: wall time advances by itself.
    """

    __slots__ = ("wakeups",)

    now_s = staticmethod(time.perf_counter)

    def __init__(self, wakeups: WakeupStats | None = None) -> None:
        self.wakeups = WakeupStats() if wakeups is None else wakeups
        """How late each wait that slept woke past the emulated completion it waited for."""

    def sleep_until(self, deadline_s: float, record: bool = True) -> None:
        """Block until perf_counter() >= deadline_s (sleep, then spin the tail); `record`: note the lateness
        when it slept (a deadline already passed is not a wait)."""
        remaining = deadline_s - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > _SPIN_S:
            time.sleep(remaining - _SPIN_S)
        now = time.perf_counter()
        while now < deadline_s:
            now = time.perf_counter()
        if record:
            self.wakeups.add(now - deadline_s)


class EmulationClock:
    """Iteration-anchored clock of one real process, on the time of `now_s` (the op clock's)."""

    __slots__ = ("iteration", "iteration_start_s", "_start_s", "now_s")

    def __init__(self, now_s: Callable[[], float] = time.perf_counter) -> None:
        self.now_s = now_s
        self._start_s = now_s()
        self.iteration = 0
        self.iteration_start_s = self._start_s

    def anchor(self, iteration: int | None = None) -> None:
        """Mark the start of a training iteration (offsets of the replay count from here)."""
        self.iteration = self.iteration + 1 if iteration is None else iteration
        self.iteration_start_s = self.now_s()

    def offset_s(self, t_s: float) -> float:
        """`t_s` as an offset from the current iteration's start."""
        return t_s - self.iteration_start_s

    def at_offset_s(self, offset_s: float) -> float:
        """The absolute time of an offset within the current iteration."""
        return self.iteration_start_s + offset_s
