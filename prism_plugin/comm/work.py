"""Work handles of the `prism` backend: real handles that complete at the emulated time.

A `TimedWork` is done when (1) the real exchanges among real members (inner gloo/NCCL works) have
finished, (2) the finishing step that writes the virtual members' share into the outputs has run,
and (3) the emulated completion time `deadline_s` has passed. Issuing one never blocks; `wait()`
blocks only for what is left, so computation issued between the op and its wait overlaps the
emulated communication exactly as it would overlap a real one.

Every time a handle reads or waits on comes from the `OpClock` of its op (`prism_plugin.comm.context`),
so an emulated clock replaces the wall clock without touching this module.

Non-goals: no CUDA-stream semantics here (the host blocks); `wait(timeout)` honours the timeout
only for the emulated delay, not for inner real works, which carry their group's own timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from prism_plugin.comm.context import Finish, OpClock, OpFailure, WaitTrace, data_steps

__all__ = ["TimedWork", "completed_work"]


class TimedWork(dist.Work):
    """A handle that completes once its inner works are done, `finish` ran and `deadline_s` passed."""

    trace: WaitTrace | None = None
    """Trace capture's record of this op (`prism_plugin.runtime.tracer.OpRecord`): wait() stamps its wait point."""
    failure: OpFailure | None = None
    """A fault (`prism_plugin.runtime.live_faults.OpFailure`): wait() raises its error at its time, never completes."""

    def __init__(
        self,
        clock: OpClock,
        result: Any,
        arrival_s: float = 0.0,
        cost_s: float = 0.0,
        inner: Sequence[dist.Work] = (),
        finish: Finish | None = None,
        on_complete: Callable[[TimedWork], None] | None = None,
        observe_inner: bool = True,
    ) -> None:
        super().__init__()
        self._clock = clock
        self._result = result
        self.arrival_s = arrival_s
        self.cost_s = cost_s
        self._inner = list(inner)
        self._finish = finish
        self._on_complete = on_complete
        self._lock = threading.Lock() if inner else None
        self._done = False
        # Real members' arrival is observed as the completion of the inner exchange (it cannot
        # finish before the last real member issued it); virtual members arrive with this rank.
        # `observe_inner` False: an emulated clock already exchanged the real members' arrivals (the
        # inner exchange's completion on the host says nothing about emulated time).
        self.deadline_s = arrival_s + cost_s
        self._stamped = not observe_inner
        if self._inner and observe_inner:
            try:
                self._inner[-1].get_future().then(self._stamp_inner_done)
            except RuntimeError:
                # gloo send/recv works (all_to_all, gather, scatter, p2p between real members)
                # raise "Work::getFuture not implemented": the completion is stamped in
                # `_complete_inner` instead. (Raising here left the inner sends/recvs posted and
                # orphaned, which desynchronised every later op of the inner group.)
                pass
        else:
            self._run_finish()

    def _stamp_inner_done(self, _future: torch.futures.Future[Any] | None = None) -> None:
        self._stamped = True
        self.deadline_s = max(self.arrival_s, self._clock.now_s()) + self.cost_s

    # -- completion -------------------------------------------------------------------------
    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            grad_enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # finishes write in place into autograd leaves
            try:
                with data_steps(self._clock):
                    finish()
            finally:
                torch._C._set_grad_enabled(grad_enabled)

    def _complete_inner(self) -> None:
        if self._inner:
            # Without a future, the completion time is observed here: exact when the exchange was
            # still running at wait(); when it had already finished, arrival + cost (a lower bound).
            pending = not self._stamped and not all(w.is_completed() for w in self._inner)
            for work in self._inner:
                work.wait()
            self._inner = []
            if pending and not self._stamped:
                self._stamp_inner_done()
        self._run_finish()

    def _mark_done(self) -> None:
        if not self._done:
            self._done = True
            callback, self._on_complete = self._on_complete, None
            if callback is not None:
                callback(self)

    def fail_at(self, failure: OpFailure) -> None:
        """Make this op fail as a faulty peer makes it fail (a hang times out, a crash raises at once)."""
        self.failure = failure

    def _raise_failure(self, failure: OpFailure, timeout: timedelta | None) -> None:
        raise_at = failure.raise_at_s
        if timeout is not None and timeout.total_seconds() > 0:
            raise_at = min(raise_at, self._clock.now_s() + timeout.total_seconds())
        self._clock.sleep_until(raise_at, record=False)
        failure.raised()
        raise type(failure.error)(*failure.error.args)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.failure is not None:
            self._raise_failure(self.failure, timeout)
        rec = self.trace
        if rec is not None:
            rec.on_wait(self._clock)
        if self._lock is not None:
            with self._lock:
                self._complete_inner()
        deadline = self.deadline_s
        if deadline > 0:
            self._clock.sleep_until(deadline)
        self._mark_done()
        if rec is not None:
            rec.on_done(self._clock)
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self.failure is not None:  # a failed op is never completed; wait() raises its error
            return False
        if self._inner and not all(w.is_completed() for w in self._inner):
            return False
        if self._clock.now_s() < self.deadline_s:
            return False
        self.wait()
        return True

    def is_completed_flag(self) -> bool:
        """Whether wait() (or a completed poll) has finished this work; never blocks, never polls."""
        return self._done

    def is_success(self) -> bool:
        return self.failure is None and self.is_completed()

    def exception(self) -> None:
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes with the results when this work completes (on the wall clock a thread waits
        for it; on an emulated clock with ``on_future`` it is complete at once, the clock placing the wait)."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        on_future = getattr(self._clock, "on_future", None)
        if on_future is not None and self.failure is None:
            # an emulated clock: the host never waits for the op; the clock makes the stream wait for it where
            # the future's consumer would (`prism_plugin.device.clock.VirtualTime.on_future`)
            if self._lock is not None:
                with self._lock:
                    self._complete_inner()
            on_future(self.deadline_s)
            self._mark_done()
            future.set_result(self._result)
            return future
        if self.is_completed():
            future.set_result(self._result)
            return future

        def resolve() -> None:
            try:
                self.wait()
            except RuntimeError as exc:  # a fault (hang, crash): the future fails as the real backend's does
                future.set_exception(exc)
                return
            future.set_result(self._result)

        threading.Thread(target=resolve, name="prism-future", daemon=True).start()
        return future

    def synchronize(self) -> None:
        self.wait()


def completed_work(clock: OpClock, result: Any = None) -> TimedWork:
    """A handle that is already complete (zero emulated cost)."""
    return TimedWork(clock, result)
