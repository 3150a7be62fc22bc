"""DeepSpeed's pipeline engine, fast-forwarded on virtual GPUs (``"fast_forward"``, DESIGN.md section 14).

``PipelineEngine.train_batch`` executes a ``TrainSchedule``: ``2 (M + S - 1)`` steps of instructions (receive,
load, forward, send; receive, backward, send), a forward step and a backward step per micro-batch in the steady
state, each micro-batch in the pipeline buffer ``micro_batch % B`` (``B = num_pipe_buffers()``). All the state the
instructions keep is the engine's own: the buffers' slots, the last stage's ``loss`` and ``fwd_outputs``, in-place
totals, and integer counters on the engine and its optimizer. So the driver runs the steps itself
(`_exec_schedule`'s loop):

- the steady steps are those whose instructions (with their buffer ids) repeat those ``2B`` steps earlier and whose
  kinds repeat those 2 steps earlier; every steady forward step is a mark (the last stage's ``loss`` is then its
  backward's, done with), one micro-batch a period of the proof (the engine's window reaches back to the oldest
  block a period frees, a micro-batch in flight);
- the engine's and its optimizer's integer attributes and the micro-batches loaded are the adapter's running
  totals, proven to grow alike every period and advanced with the device;
- once proven, the device advances by a whole number of turns of the buffers (``n B`` micro-batches) that stays
  inside the steady steps and leaves the last steady micro-batch to run; the steps of those micro-batches are not
  executed: every slot still holds the mark's objects, which stand for the skipped work's last (their blocks
  remapped by the advance); the data iterator yields the skipped micro-batches' batches, in silence (a data
  iterator that works on the device there makes the skip raise; one that did so in the recorded periods is never
  skipped);
- the last stage appends each micro-batch's loss to ``fwd_outputs``, kept until the next batch: a growing
  container whose skipped entries own the blocks the allocator's replay left unowned (as Megatron's
  ``forward_data_store``), and its ``loss`` is the last of them, as the full run's.

Not fast-forwarded: evaluation (``eval_batch``), the ZeRO engines without a pipeline (their gradient accumulation
runs in the user's loop), anything the engine refuses (`prism_plugin.device.fast_forward.FastForward.unavailable`).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from prism_plugin.device.fast_forward import FastForward, held_storages

__all__ = ["PipeFastForward"]


def _shape(step: list[Any]) -> tuple[Any, ...]:
    return tuple(type(cmd).__name__ for cmd in step)


def _signature(step: list[Any]) -> tuple[Any, ...]:
    return tuple((type(cmd).__name__, tuple(sorted(cmd.kwargs.items()))) for cmd in step)


def _steady(steps: list[list[Any]], buffers: int) -> tuple[int, int]:
    """The longest run ``[a, b)`` of steps each repeating the step ``2 B`` before (buffer ids included) and the
    step 2 before (instruction kinds)."""
    best, start = (0, 0), None
    for i in range(len(steps) + 1):
        alike = i < len(steps) and i >= 2 * buffers and _signature(steps[i]) == _signature(steps[i - 2 * buffers]) \
            and _shape(steps[i]) == _shape(steps[i - 2])
        if alike and start is None:
            start = i
        elif not alike and start is not None:
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = None
    return best


def _counters(*objects: Any) -> dict[str, float]:
    """The integer attributes of `objects` (the engine, its optimizer): running totals."""
    return {f"attr.{i}.{name}": value for i, obj in enumerate(objects) if obj is not None
            for name, value in vars(obj).items() if type(value) is int}


class PipeFastForward:
    """The driven ``PipelineEngine._exec_schedule`` for virtual GPU `gpu` and its communication `session`."""

    def __init__(self, gpu: Any, session: Any) -> None:
        self.engine = FastForward(gpu, session)
        self.calls: Counter[str] = Counter()
        self.microbatches = 0
        self.microbatches_skipped = 0
        self._device_data = False
        """The data iterator worked on the device in a recorded period: its batches cannot be taken in silence."""

    def install(self, patches: Any) -> None:
        from deepspeed.runtime.pipe import engine as pipe_engine
        from deepspeed.runtime.pipe.schedule import TrainSchedule

        cls = pipe_engine.PipelineEngine
        original = cls._exec_schedule

        @functools.wraps(original)
        def _exec_schedule(ds: Any, pipe_schedule: Any) -> Any:
            reason = self.engine.unavailable()
            if reason is None and not isinstance(pipe_schedule, TrainSchedule):
                reason = "evaluation"
            if reason is not None:
                self.calls[reason] += 1
                return original(ds, pipe_schedule)
            return self._run(ds, pipe_schedule, pipe_engine)

        patches.setattr(cls, "_exec_schedule", _exec_schedule)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def _run(self, ds: Any, pipe_schedule: Any, pipe_engine: Any) -> None:
        from types import MethodType

        ds._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        ds.fwd_outputs = []
        steps = list(pipe_schedule)
        buffers = pipe_schedule.num_pipe_buffers()
        first, stop = _steady(steps, buffers)
        loads = [sum(1 for cmd in step if type(cmd).__name__ == "LoadMicroBatch") for step in steps]
        loaded = 0
        engine = self.engine
        advanced = False
        next_batch = ds._next_batch

        def watched_next_batch() -> Any:  # whether the data iterator works on the device
            before = engine.clock.kernels, engine.gpu.tracker.live_count()
            batch = next_batch()
            if (engine.clock.kernels, engine.gpu.tracker.live_count()) != before:
                self._device_data = True
            return batch

        ds._next_batch = watched_next_batch
        engine.mark(**self._totals(ds, loaded))
        try:
            i = 0
            while i < len(steps):
                if not advanced and first <= i and i + 2 <= stop and "ForwardPass" in _shape(steps[i]):
                    engine.mark(held=held_storages(ds.fwd_outputs), keep=buffers + 3, **self._totals(ds, loaded))
                    periods = (stop - 2 - i) // (2 * buffers) * buffers  # whole turns of the buffers
                    if self._device_data:
                        engine.not_proven["the data iterator works on the device"] += 1
                    elif periods >= 1 and engine.proven() and (periods := engine.allowed(periods, buffers)) >= 1:
                        self._skip(ds, periods, sum(loads[i:i + 2 * periods]))
                        loaded += sum(loads[i:i + 2 * periods])
                        i += 2 * periods
                        advanced = True
                        continue
                for cmd in steps[i]:
                    if type(cmd) not in ds._INSTRUCTION_MAP:
                        raise RuntimeError(f"{type(ds).__name__} does not understand instruction {cmd!r}")
                    ds._exec_instr = MethodType(ds._INSTRUCTION_MAP[type(cmd)], ds)
                    ds._exec_instr(**cmd.kwargs)
                loaded += loads[i]
                i += 1
        finally:
            del ds._next_batch
            engine.stop()
            micro = pipe_schedule.micro_batches
            self.microbatches += micro
            self.calls["fast-forwarded" if advanced else "not proven"] += 1

    def _totals(self, ds: Any, loaded: int) -> dict[str, float]:
        return {"data": loaded, "store": len(ds.fwd_outputs), **_counters(ds, getattr(ds, "optimizer", None))}

    def _skip(self, ds: Any, periods: int, batches: int) -> None:
        """Advance by `periods` proven micro-batches; the engine's counters grow, the data iterator yields the
        skipped batches (in silence), the last stage's losses are made."""
        grown = self.engine.advance(periods)
        entries = int(grown.pop("store", 0))
        grown.pop("data", None)
        objects = [ds, getattr(ds, "optimizer", None)]
        for key, amount in grown.items():
            _, index, name = key.split(".", 2)
            obj = objects[int(index)]
            setattr(obj, name, getattr(obj, name) + int(amount))
        if entries:
            self._adopt(ds, entries)
            ds.loss = ds.fwd_outputs[-1]  # the full run's last loss shares its storage with its entry
        self.microbatches_skipped += periods
        with self.engine.silent():
            for _ in range(batches):
                ds._next_batch()

    def _adopt(self, ds: Any, entries: int) -> None:
        """The skipped forwards' losses in ``fwd_outputs`` (`FastForward.adopted`)."""
        ds.fwd_outputs.extend(self.engine.adopted(ds.fwd_outputs[-1], entries, 'set "fast_forward": false in the '
                                                                              '"prism" section and report the job'))

    def summary(self) -> dict[str, Any]:
        return {"schedule_calls": dict(self.calls), "microbatches": self.microbatches,
                "microbatches_skipped": self.microbatches_skipped, **self.engine.summary()}

