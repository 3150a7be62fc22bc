"""Megatron's 1F1B steady state, fast-forwarded on virtual GPUs (``--prism-fast-forward``, DESIGN.md section 14).

Megatron's non-interleaved pipeline schedule (``forward_backward_pipelining_without_interleaving``) runs, on a
stage with ``W`` warm-up micro-batches, ``M - W`` steady iterations of one forward, one exchange with the next
stage, one backward and one exchange with the previous stage, holding ``W`` micro-batches' activations in a
first-in first-out list. Each steady iteration repeats the one before (once the micro-batches it frees were made
in steady iterations themselves); the list is back in its order after ``L = max(W, 1)`` of them. So this module
drives `prism_plugin.device.fast_forward` at the schedule level, through the schedule's own seams
(``forward_step``, ``backward_step``, ``deallocate_output_tensor`` and the ``P2PCommunicator``'s two steady
exchanges), and leaves the schedule's code as it is:

- the boundary is the exchange with the previous stage (``send_backward_recv_forward``) of a steady iteration;
  each one is a mark, and the proof's window reaches back to the micro-batch the last iteration frees;
- once the last two iterations are proven, the device advances by the most iterations that are a multiple of
  ``L`` (the list back in its order) and still leave the last steady iteration to run (it ends the warm-down
  differently), the data iterator is advanced by what those micro-batches would have consumed, and the
  schedule's next ``n x L`` iterations call seams that return at once:
  each exchange and forward returns the objects of the list's head (the list turns by one per iteration, back
  to where it was after ``n x L``), each backward returns the gradient it returned at the boundary, so when the
  schedule resumes its locals and list hold the boundary's objects, which stand for the skipped work's last;
- objects the schedule let go at the boundary's next steps (the popped micro-batch's input and output, the
  forward's token count) are held meanwhile and let go where the program would have;
- the last stage appends each micro-batch's reported losses to the schedule's ``forward_data_store``, kept until
  the step ends: its storages are the engine's *held* ones (left out of the proof's live storages), and each
  skipped forward appends a copy of the boundary's entry whose tensors own the blocks the allocator's replay
  left unowned (`FastForward.orphans`), in malloc order (`ScheduleFastForward._adopt`).

The no-pipelining schedule (``forward_backward_no_pipelining``) is driven through the same seams with a period of
one micro-batch (`ScheduleFastForward._forward_unpipelined`).

Not fast-forwarded (runs for real, counted in the summary): the interleaved schedule, the combined 1F1B and
hybrid-context-parallel paths of the no-pipelining one, forward-only passes (evaluation), a stage whose periods
are not proven.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from typing import Any

from prism_plugin.adapters.megatron.interleaved import InterleavedRun, unsupported
from prism_plugin.device.fast_forward import FastForward, FastForwardBroken, held_storages

__all__ = ["ScheduleFastForward"]


def _config(kwargs: dict[str, Any]) -> Any:
    from megatron.core.utils import get_model_config

    model = kwargs.get("model")
    return get_model_config(model[0] if isinstance(model, list) else model)


def _combined(kwargs: dict[str, Any]) -> str | None:
    """Why the no-pipelining schedule would not run its plain loop (None: it does): the combined 1F1B schedule
    (``--overlap-moe-expert-parallel-comm``) and hybrid context parallelism take other paths."""
    config = _config(kwargs)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "the combined 1F1B schedule (--overlap-moe-expert-parallel-comm)"
    if getattr(config, "hybrid_context_parallel", False):
        return "hybrid context parallelism"
    return None


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

    def __init__(self, num_microbatches: int, data: _Counting | None, *, pipelined: bool = True) -> None:
        self.num_microbatches = num_microbatches
        self.pipelined = pipelined
        """False: the no-pipelining schedule (one forward and one backward per micro-batch, a period of one)."""
        self.skip_backward = False
        self.data = data
        self.forwards = 0
        self.warmup: int | None = None
        """Forwards before the first steady exchange (None: still warming up)."""
        self.exchanges = 0
        """Steady ``send_backward_recv_forward`` calls so far: the index of the steady iteration under way."""
        self.fifo: deque[tuple[Any, Any]] = deque()
        """The micro-batches in flight (input, output), as the schedule's own two lists hold them."""
        self.popped: tuple[Any, Any] = (None, None)
        self.grad_out: Any = None
        """The popped micro-batch and the received gradient, kept only from a steady iteration's backward (its
        exchange) to its boundary exchange, where the schedule's locals hold them too: any longer would change
        when the program's objects die."""
        self.grad_in: Any = None
        self.tokens: Any = None
        self.skipping = 0
        """Steady iterations still to skip (their forward, exchanges and backward)."""
        self.held: dict[str, Any] = {}
        self.silence: Any = None
        self.advanced = False
        self.store: list[Any] | None = None
        """The schedule's ``forward_data_store``: the last stage appends each micro-batch's reported losses, kept
        until the step ends (a container that grows by the same objects every period)."""
        self.pending: deque[Any] = deque()
        """The entries the skipped forwards append to the store, made at the boundary (`ScheduleFastForward._adopt`)."""
        self.per_forward = 0

    @property
    def period(self) -> int:
        """Steady iterations after which the in-flight list is back in its order: what a skip is a multiple of."""
        return max(self.warmup or 0, 1)

    def at_mark(self) -> bool:
        """Whether the steady iteration under way ends at a mark (its exchange with the previous stage): every one
        is, each a period of the proof."""
        return (self.warmup is not None and not self.advanced
                and self.exchanges < self.num_microbatches - self.warmup - 1)


class ScheduleFastForward:
    """The seams above, for virtual GPU `gpu` and its communication `session`."""

    def __init__(self, gpu: Any, session: Any, *, routing: Any = None, host_calls: Any = None,
                 attention: Any = None) -> None:
        self.engine = FastForward(gpu, session)
        self.routing = routing
        """The MoE routing policy (`moe.RoutingPolicy`): its answer counts are the adapter's running totals."""
        self.attention = attention
        """The flash-attention stand-in's counts (`attention.FlashAttentionStandin`, ``--prism-attention flash``):
        running totals too."""
        self.host_calls = host_calls
        """The skipped host-hardware calls (`host_calls.HostCalls`): counted per call, so running totals too."""
        self.run: _Run | None = None
        self.calls: Counter[str] = Counter()
        """Schedule calls by outcome (fast-forwarded, or why not)."""
        self.microbatches_skipped = 0
        self.microbatches = 0

    def install(self, patches: Any) -> None:
        import megatron.core.pipeline_parallel.p2p_communication as p2p
        import megatron.core.pipeline_parallel.schedules as schedules

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
        for name in ("send_forward_recv_forward", "send_backward_recv_backward",
                     "send_forward_backward_recv_forward_backward"):  # the interleaved schedule's steady exchanges
            patches.setattr(comm, name, self._interleaved_exchange(name, getattr(comm, name)))

    def _interleaved_exchange(self, name: str, exchange: Any) -> Any:
        @functools.wraps(exchange)
        def seam(comm: Any, *args: Any, **kwargs: Any) -> Any:
            run = self.run
            if not isinstance(run, InterleavedRun):
                return exchange(comm, *args, **kwargs)
            return run.exchange(name, lambda: exchange(comm, *args, **kwargs))

        return seam

    def wrap(self, schedule: Any, *, pipelined: bool = True, interleaved: bool = False) -> Any:
        """`schedule` (the non-interleaved one; the no-pipelining one when not `pipelined`; the interleaved one
        when `interleaved`) driving the fast-forward for each call."""

        @functools.wraps(schedule)
        def driven(*args: Any, **kwargs: Any) -> Any:
            reason = self._why_not(kwargs) or (None if pipelined else _combined(kwargs))
            if reason is None and interleaved:
                reason = unsupported(_config(kwargs))
            if reason is not None:
                self.calls[reason] += 1
                return schedule(*args, **kwargs)
            data = kwargs.get("data_iterator")
            run: _Run | InterleavedRun
            if interleaved:
                datas = [None if d is None else _Counting(d) for d in data]
                kwargs["data_iterator"] = [d if c is None else c for d, c in zip(data, datas, strict=True)]
                run = InterleavedRun(self, kwargs["num_microbatches"], len(kwargs["model"]), datas)
            else:
                if isinstance(data, list) and len(data) == 1:
                    data = data[0]
                counting = _Counting(data) if data is not None and not isinstance(data, list) else None
                if counting is not None:
                    kwargs["data_iterator"] = counting
                run = _Run(kwargs["num_microbatches"], counting, pipelined=pipelined)
            self.run = run
            run.store = kwargs.get("forward_data_store")
            self.engine.mark(**self._totals(run))  # the recording starts with the warm-up: every block is numbered
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

    @staticmethod
    def held(store: list[Any] | None) -> frozenset[int]:
        """The storages the schedule's ``forward_data_store`` holds: the engine's *held* ones."""
        return held_storages(store)

    def _skipping(self) -> bool:
        return self.run is not None and self.run.skipping > 0

    # -- the seams -----------------------------------------------------------------------------------------------------
    def _forward(self, forward: Any, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
                 input_tensor: Any, forward_data_store: Any, config: Any, *rest: Any, **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return forward(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                           forward_data_store, config, *rest, **kwargs)
        if isinstance(run, InterleavedRun):
            return run.forward(functools.partial(forward, forward_step_func, data_iterator, model, num_microbatches,
                                                 input_tensor, forward_data_store, config, *rest, **kwargs),
                               config, forward_data_store)
        if not run.pipelined:
            return self._forward_unpipelined(run, functools.partial(
                forward, forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                config, *rest, **kwargs), forward_data_store)
        if run.skipping:
            for _ in range(run.per_forward):
                forward_data_store.append(run.pending.popleft())
            return run.fifo[0][1] if run.fifo else run.held["output"], run.tokens
        run.store = forward_data_store
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
            return run.held["grad_out"]
        if run.warmup is None:
            run.warmup = run.forwards - 1
        received = exchange(comm, output_tensor, *args, **kwargs)
        if run.at_mark():
            run.grad_out = received
        return received

    def _backward(self, backward: Any, input_tensor: Any, output_tensor: Any, output_tensor_grad: Any,
                  config: Any, *rest: Any, **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return backward(input_tensor, output_tensor, output_tensor_grad, config, *rest, **kwargs)
        if isinstance(run, InterleavedRun):
            return run.backward(functools.partial(backward, input_tensor, output_tensor, output_tensor_grad, config,
                                                  *rest, **kwargs))
        if run.skip_backward:  # the no-pipelining schedule's, after a skipped forward
            run.skip_backward = False
            return None
        if run.skipping:
            if run.fifo:
                run.fifo.rotate(-1)
            run.skipping -= 1
            return run.grad_in
        pair = run.fifo.popleft() if run.fifo and run.fifo[0][1] is output_tensor else (None, None)
        run.grad_in = backward(input_tensor, output_tensor, output_tensor_grad, config, *rest, **kwargs)
        if run.at_mark():
            run.popped = pair
        return run.grad_in

    def _send_backward_recv_forward(self, exchange: Any, comm: Any, input_tensor_grad: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        run = self.run
        if run is None:
            return exchange(comm, input_tensor_grad, *args, **kwargs)
        if run.skipping:
            run.exchanges += 1
            return run.fifo[0][0] if run.fifo else run.held["input"]
        if run.silence is not None:  # the first exchange after the skipped iterations: the device speaks again
            self._speak(run)
            run.held.pop("grad_out")  # the schedule's own local holds it now, as at the boundary
        marked = run.at_mark()
        popped, grad_out = run.popped, run.grad_out
        run.popped, run.grad_out = (None, None), None
        index, run.exchanges = run.exchanges, run.exchanges + 1
        if marked:
            skipped = self._boundary(run, index, popped, grad_out)
            if skipped is not None:
                return skipped
        del popped, grad_out
        received = exchange(comm, input_tensor_grad, *args, **kwargs)
        run.held.pop("input", None)
        return received

    def _boundary(self, run: _Run, index: int, popped: tuple[Any, Any], grad_out: Any) -> Any:
        """A mark before steady exchange `index` (`popped`, `grad_out`: the schedule's locals there); when proven,
        advance and start skipping (returns what the skipped exchange returns), else None."""
        engine = self.engine
        # a micro-batch lives `warmup` iterations, its output one more: the proof looks that far back
        engine.mark(held=held_storages(run.store), keep=run.period + 3, **self._totals(run))
        if len(run.fifo) != run.warmup or (run.warmup == 0 and popped[1] is None):
            # the schedule's forwards and backwards did not all pass the seams (a multi-module backward): the
            # skipped calls could not return the objects the program holds
            engine.not_proven["the schedule's forward or backward passed by the seams"] += 1
            return None
        if not engine.proven():
            return None
        steady = run.num_microbatches - (run.warmup or 0)
        iterations = (steady - 2 - index) // run.period * run.period  # whole turns of the in-flight list
        iterations = engine.allowed(iterations, run.period) if iterations >= 1 else 0
        if iterations < 1:
            return None
        # held until the program would have let go of them: the popped micro-batch's input at the next exchange,
        # its output and the forward's token count at the next forward; the gradient until the schedule holds it
        run.held = {"input": popped[0], "output": popped[1], "tokens": run.tokens, "grad_out": grad_out}
        self._start_skipping(run, iterations, iterations)
        return run.fifo[0][0] if run.fifo else run.held["input"]

    def _forward_unpipelined(self, run: _Run, forward: Any, store: list[Any]) -> Any:
        """A forward of the no-pipelining schedule: micro-batch ``i`` runs its forward then its backward, so every
        forward from the second on (``i = 1``: the first micro-batch is special, e.g. TransformerEngine's FP8
        weight caching) is a mark; once proven, micro-batches up to the last one inside ``no_sync`` are skipped
        (that one runs, then the last, which syncs the gradients)."""
        if run.skipping:
            return self._skip_unpipelined(run, store)
        if run.silence is not None:  # the first forward after the skipped ones: the device speaks again
            self._speak(run)
        index = run.forwards
        run.store = store
        if not run.advanced and 1 <= index <= run.num_microbatches - 3:
            self.engine.mark(held=held_storages(store), **self._totals(run))
            periods = run.num_microbatches - 2 - index
            if self.engine.proven() and periods >= 1 and (periods := self.engine.allowed(periods)) >= 1:
                self._start_skipping(run, periods, periods)
                return self._skip_unpipelined(run, store)
        output, tokens = forward()
        run.forwards += 1
        run.tokens = tokens  # the schedule's local holds it until the next forward returns
        return output, tokens

    def _start_skipping(self, run: Any, periods: int, microbatches: int, adopt_per_forward: bool = True) -> None:
        """Advance the device by `periods` proven periods (`microbatches` of the schedule's), grow the adapter's
        totals with it, make the store's entries of the skipped forwards, and silence the device while the
        schedule's skipped calls return."""
        grown = self.engine.advance(periods)
        entries = int(grown.pop("store", 0))
        self._advance(run, grown)
        run.advanced = True
        run.skipping = microbatches
        self.microbatches_skipped += microbatches
        if entries:
            self._adopt(run, entries)
            if adopt_per_forward:  # each skipped forward appends as many (the one-chunk schedules)
                if entries % microbatches:
                    raise FastForwardBroken(
                        f"prism fast-forward: the {microbatches} skipped micro-batches append {entries} entries to "
                        "the schedule's forward_data_store, not as many each; run with --prism-fast-forward off "
                        "and report the job")
                run.per_forward = entries // microbatches
        run.silence = self.engine.silent()
        run.silence.__enter__()

    @staticmethod
    def _speak(run: Any) -> None:
        """The first real call after the skipped ones: the device is no longer silent (raises if it was touched)."""
        silence, run.silence = run.silence, None
        silence.__exit__(None, None, None)

    def _skip_unpipelined(self, run: _Run, store: list[Any]) -> Any:
        """A skipped micro-batch of the no-pipelining schedule: its entries in the store, no output (its skipped
        backward ignores it), the last real forward's token count (the schedule adds it in silence)."""
        run.skipping -= 1
        run.skip_backward = True
        for _ in range(run.per_forward):
            store.append(run.pending.popleft())
        return None, run.tokens

    def _totals(self, run: Any) -> dict[str, float]:
        """The adapter's running totals a micro-batch adds to: data taken (each model chunk's, interleaved), MoE
        routing answers, host calls, the flash-attention stand-in's forwards."""
        totals: dict[str, float] = {"data": run.data.taken if run.data is not None else 0,
                                    "store": len(run.store) if run.store is not None else 0}
        for chunk, data in enumerate(getattr(run, "datas", ())):
            if data is not None:
                totals[f"data.{chunk}"] = data.taken
        routing = self.routing
        if routing is not None:
            totals["moe.tokens_sent"], totals["moe.tokens_received"] = routing.tokens_sent, routing.tokens_received
            totals.update({f"moe.site.{site}": n for site, n in routing.calls.items()})
            totals.update({f"moe.layer.{layer}": entry["calls"] for layer, entry in routing.by_layer.items()})
        if self.host_calls is not None:
            totals.update({f"host.{name}": n for name, n in self.host_calls.skipped.items()})
        if self.attention is not None:
            totals["attention.forwards"] = self.attention.forwards
            totals["attention.cp_forwards"] = self.attention.cp_forwards
        return totals

    def _advance(self, run: Any, grown: dict[str, float]) -> None:
        """Apply the adapter's totals grown over the advanced periods (`_totals`' keys)."""
        for key, amount in grown.items():
            count = int(amount)
            kind, _, name = key.partition(".")
            if key == "data" and run.data is not None:
                for _ in range(count):
                    next(run.data)
            elif kind == "data" and name:
                for _ in range(count):
                    next(run.datas[int(name)])
            elif key in ("moe.tokens_sent", "moe.tokens_received"):
                setattr(self.routing, name, getattr(self.routing, name) + count)
            elif key.startswith("moe.site."):
                self.routing.calls[key.removeprefix("moe.site.")] += count
            elif key.startswith("moe.layer."):
                self.routing.by_layer[int(key.removeprefix("moe.layer."))]["calls"] += count
            elif kind == "host":
                self.host_calls.skipped[name] += count
            elif kind == "attention":
                setattr(self.attention, name, getattr(self.attention, name) + count)

    def _adopt(self, run: Any, entries: int) -> None:
        """The `entries` objects the skipped forwards would have appended to the store (`FastForward.adopted`)."""
        assert run.store
        run.pending.extend(self.engine.adopted(run.store[-1], entries, "run with --prism-fast-forward off and "
                                                                         "report the job"))

    def summary(self) -> dict[str, Any]:
        return {"schedule_calls": dict(self.calls), "microbatches": self.microbatches,
                "microbatches_skipped": self.microbatches_skipped, **self.engine.summary()}
