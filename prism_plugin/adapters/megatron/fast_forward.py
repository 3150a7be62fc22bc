"""Megatron's 1F1B steady state, fast-forwarded on virtual GPUs (``--prism-fast-forward``, DESIGN.md section 14).

Megatron's non-interleaved pipeline schedule (``forward_backward_pipelining_without_interleaving``) runs, on a
stage with ``W`` warm-up micro-batches, ``M - W`` steady iterations of one forward, one exchange with the next
stage, one backward and one exchange with the previous stage, holding ``W`` micro-batches' activations in a
first-in first-out list. Those iterations repeat with a period of ``L = max(W, 1)``: after ``L`` iterations the
same blocks hold the same list positions. So this module drives `prism_plugin.device.fast_forward` at the
schedule level, through the schedule's own seams (``forward_step``, ``backward_step``,
``deallocate_output_tensor`` and the ``P2PCommunicator``'s two steady exchanges), and leaves the schedule's code
as it is:

- the boundary is the exchange with the previous stage (``send_backward_recv_forward``) of a steady iteration;
  every ``L``-th one, from the ``L``-th on, is a mark;
- once the last two periods are proven, the device advances by the ``n`` whole periods that still leave the last
  steady iteration to run (it ends the warm-down differently), the data iterator is advanced by what those
  micro-batches would have consumed, and the schedule's next ``n x L`` iterations call seams that return at once:
  each exchange and forward returns the objects of the list's head (the list turns by one per iteration, back
  to where it was after ``n x L``), each backward returns the gradient it returned at the boundary, so when the
  schedule resumes its locals and list hold the boundary's objects, which stand for the skipped work's last;
- objects the schedule let go at the boundary's next steps (the popped micro-batch's input and output, the
  forward's token count) are held meanwhile and let go where the program would have.

Not fast-forwarded (runs for real, counted in the summary): the interleaved and no-pipelining schedules,
forward-only passes (evaluation), a stage whose periods are not proven (the last stage keeps each micro-batch's
losses, so its memory grows: never proven).
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from typing import Any

from prism_plugin.device.fast_forward import FastForward

__all__ = ["ScheduleFastForward"]


class _Counting:
    """The schedule's data iterator, counting the micro-batches the program takes from it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.taken = 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        item = next(self._inner)
        self.taken += 1
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Run:
    """One call of the schedule."""

    def __init__(self, num_microbatches: int, data: _Counting | None) -> None:
        self.num_microbatches = num_microbatches
        self.data = data
        self.forwards = 0
        self.warmup: int | None = None
        """Forwards before the first steady exchange (None: still warming up)."""
        self.exchanges = 0
        """Steady ``send_backward_recv_forward`` calls so far."""
        self.fifo: deque[tuple[Any, Any]] = deque()
        self.popped: tuple[Any, Any] = (None, None)
        self.grad_out: Any = None
        self.grad_in: Any = None
        self.tokens: Any = None
        self.skipping = 0
        """Steady iterations still to skip (their forward, exchanges and backward)."""
        self.held: dict[str, Any] = {}
        self.silence: Any = None
        self.advanced = False

    @property
    def period(self) -> int:
        return max(self.warmup or 0, 1)


class ScheduleFastForward:
    """The seams above, for virtual GPU `gpu` and its communication `session`."""

    def __init__(self, gpu: Any, session: Any) -> None:
        self.engine = FastForward(gpu, session)
        self.run: _Run | None = None
        self.calls: Counter[str] = Counter()
        """Schedule calls by outcome (fast-forwarded, or why not)."""
        self.microbatches_skipped = 0
        self.microbatches = 0

    def install(self, patches: Any) -> None:
        import megatron.core.pipeline_parallel.p2p_communication as p2p
        import megatron.core.pipeline_parallel.schedules as schedules

        self._schedules = schedules
        forward, backward, deallocate = schedules.forward_step, schedules.backward_step, \
            schedules.deallocate_output_tensor
        patches.setattr(schedules, "forward_step", functools.wraps(forward)(
            lambda *a, **k: self._forward(forward, *a, **k)))
        patches.setattr(schedules, "backward_step", functools.wraps(backward)(
            lambda *a, **k: self._backward(backward, *a, **k)))
        patches.setattr(schedules, "deallocate_output_tensor", functools.wraps(deallocate)(
            lambda *a, **k: None if self._skipping() else deallocate(*a, **k)))
        comm = p2p.P2PCommunicator
        down, up = comm.send_forward_recv_backward, comm.send_backward_recv_forward
        patches.setattr(comm, "send_forward_recv_backward", functools.wraps(down)(
            lambda s, *a, **k: self._send_forward_recv_backward(down, s, *a, **k)))
        patches.setattr(comm, "send_backward_recv_forward", functools.wraps(up)(
            lambda s, *a, **k: self._send_backward_recv_forward(up, s, *a, **k)))

    def wrap(self, schedule: Any) -> Any:
        """`schedule` (the non-interleaved one) driving the fast-forward for each call."""

        @functools.wraps(schedule)
        def driven(*args: Any, **kwargs: Any) -> Any:
            reason = self._why_not(kwargs)
            if reason is not None:
                self.calls[reason] += 1
                return schedule(*args, **kwargs)
            data = kwargs.get("data_iterator")
            if isinstance(data, list) and len(data) == 1:
                data = data[0]
            counting = _Counting(data) if data is not None and not isinstance(data, list) else None
            if counting is not None:
                kwargs["data_iterator"] = counting
            run = self.run = _Run(kwargs["num_microbatches"], counting)
            try:
                return schedule(*args, **kwargs)
            finally:
                self.run = None
                if run.silence is not None:  # the schedule raised while skipping
                    self.engine.gpu.silent = False
                self.engine.stop()
                self.microbatches += run.num_microbatches
                self.calls["fast-forwarded" if run.advanced else "not proven"] += 1

        return driven

    def _why_not(self, kwargs: dict[str, Any]) -> str | None:
        if self.run is not None:
            return "nested schedule call"
        if kwargs.get("forward_only"):
            return "forward only"
        if "num_microbatches" not in kwargs:
            return "num_microbatches not passed by name"
        return self.engine.unavailable()

    def _skipping(self) -> bool:
        return self.run is not None and self.run.skipping > 0

    # -- the seams -----------------------------------------------------------------------------------------------------
    def _forward(self, forward: Any, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
                 input_tensor: Any, forward_data_store: Any, config: Any, *rest: Any, **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return forward(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                           forward_data_store, config, *rest, **kwargs)
        if run.skipping:
            return run.fifo[0][1] if run.fifo else run.popped[1], run.tokens
        output, tokens = forward(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                                 forward_data_store, config, *rest, **kwargs)
        run.held.pop("output", None)  # the program let go of these here (the schedule's locals got new values)
        run.held.pop("tokens", None)
        run.forwards += 1
        run.fifo.append((input_tensor, output))
        run.tokens = tokens
        return output, tokens

    def _send_forward_recv_backward(self, exchange: Any, comm: Any, output_tensor: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return exchange(comm, output_tensor, *args, **kwargs)
        if run.skipping:
            return run.grad_out
        if run.warmup is None:
            run.warmup = run.forwards - 1
        run.grad_out = exchange(comm, output_tensor, *args, **kwargs)
        return run.grad_out

    def _backward(self, backward: Any, input_tensor: Any, output_tensor: Any, output_tensor_grad: Any,
                  config: Any, *rest: Any, **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return backward(input_tensor, output_tensor, output_tensor_grad, config, *rest, **kwargs)
        if run.skipping:
            if run.fifo:
                run.fifo.rotate(-1)
            run.skipping -= 1
            return run.grad_in
        if run.fifo and run.fifo[0][1] is output_tensor:
            run.popped = run.fifo.popleft()
        run.grad_in = backward(input_tensor, output_tensor, output_tensor_grad, config, *rest, **kwargs)
        return run.grad_in

    def _send_backward_recv_forward(self, exchange: Any, comm: Any, input_tensor_grad: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return exchange(comm, input_tensor_grad, *args, **kwargs)
        if run.skipping:
            run.exchanges += 1
            return run.fifo[0][0] if run.fifo else run.popped[0]
        if run.silence is not None:  # the first exchange after the skipped iterations: the device speaks again
            silence, run.silence = run.silence, None
            silence.__exit__(None, None, None)
        index, run.exchanges = run.exchanges, run.exchanges + 1
        if run.warmup is not None and not run.advanced and index % run.period == 1 % run.period:
            skipped = self._boundary(run, index)
            if skipped is not None:
                return skipped
        received = exchange(comm, input_tensor_grad, *args, **kwargs)
        run.held.pop("input", None)
        return received

    def _boundary(self, run: _Run, index: int) -> Any:
        """A mark before steady exchange `index`; when proven, advance and start skipping (returns what the
        skipped exchange returns), else None."""
        engine = self.engine
        engine.mark(data=run.data.taken if run.data is not None else 0)
        if not engine.proven():
            return None
        steady = run.num_microbatches - (run.warmup or 0)
        periods = (steady - 2 - index) // run.period
        if periods < 1:
            return None
        extra = engine.advance(periods)
        if run.data is not None:
            for _ in range(int(extra.get("data", 0))):
                next(run.data)
        run.advanced = True
        run.skipping = periods * run.period
        self.microbatches_skipped += run.skipping
        # held until the program would have let go of them: the popped micro-batch's input at the next exchange,
        # its output and the forward's token count at the next forward
        run.held = {"input": run.popped[0], "output": run.popped[1], "tokens": run.tokens}
        run.silence = engine.silent()
        run.silence.__enter__()
        return run.fifo[0][0] if run.fifo else run.popped[0]

    def summary(self) -> dict[str, Any]:
        return {"schedule_calls": dict(self.calls), "microbatches": self.microbatches,
                "microbatches_skipped": self.microbatches_skipped, **self.engine.summary()}
