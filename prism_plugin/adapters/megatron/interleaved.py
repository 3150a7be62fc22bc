"""Megatron's interleaved (virtual-pipeline) schedule, fast-forwarded on virtual GPUs (DESIGN.md section 14).

``forward_backward_pipelining_with_interleaving`` runs, on a stage with ``W`` warm-up forwards, steady iterations
of one forward and one backward of (generally different) model chunks. The schedule table repeats every
``P = g x vp`` virtual micro-batches (``g``: ``microbatch_group_size_per_vp_stage``, the pipeline size by default;
``vp``: the model chunks), so the steady state repeats every ``P`` iterations, except near its ends: the first
micro-batch group (parameter syncs, TransformerEngine's first-micro-batch work), the last one (gradient syncs) and
the last steady iteration (no receive). Its state lives in the schedule's closures: per-chunk lists of inputs,
outputs and output gradients read by index, receive buffers, and (with ``overlap_p2p_comm``, as Megatron-LM runs
it) handles waited on an iteration after they are issued. So the driver works through the seams the schedule
calls (``forward_step``, ``backward_step``, ``deallocate_output_tensor`` and the ``P2PCommunicator``'s steady
exchanges) and never reaches into the closures:

- a mark at the forward of every ``P``-th steady iteration; the engine keeps the periods back to the oldest block
  the last one frees, and the handles pending at the marks (`prism_plugin.device.pending_works`);
- each steady iteration's seam results are remembered *weakly* (the program's objects die when the program lets go
  of them);
- once proven at iteration ``k``, the device advances by ``n`` periods (the most that stay clear of the ends, and
  never fewer than the window of held objects: each object held at the mark stands for the one made ``n`` periods
  later, which must not be one the program already holds) and
  the next ``n x P`` iterations' seams return at once: each returns what the same seam returned ``n`` periods
  earlier (iteration ``j - nP``, still alive when the program still holds it), so when the schedule reaches the
  forward of iteration ``k + nP`` its lists, buffers and handles hold the objects they held at the mark, which
  stand for the skipped work's last (their blocks remapped by the advance); the handles pending at the mark are
  the ones pending then, completing ``n`` periods later (their waits during the skip do nothing);
- results the program let go of before the mark (an iteration more than the longest lifetime back) are replaced
  by ``None`` and a handle that has completed: the schedule only files and drops them during the skip.

Not fast-forwarded: the combined 1F1B schedule (``--overlap-moe-expert-parallel-comm``), partial activation
checkpointing (its pattern follows the warm-up count, not the table), forward-only passes.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

__all__ = ["InterleavedRun", "unsupported"]


def unsupported(config: Any) -> str | None:
    """Why the interleaved schedule under `config` is not fast-forwarded (None: it is)."""
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "the combined 1F1B schedule (--overlap-moe-expert-parallel-comm)"
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        return "partial activation checkpointing"
    return None


class _Completed:
    """A handle whose op completed before the mark: the schedule waits on it during the skip."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True


def _weak(value: Any) -> Any:
    """`value` (a tensor, handle, or tuple, list or dict of them) holding its objects weakly."""
    if isinstance(value, tuple | list):
        return type(value)(_weak(v) for v in value)
    if isinstance(value, dict):
        return {k: _weak(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return weakref.ref(value)


def _strong(value: Any) -> Any:
    """`_weak`'s inverse: a tensor let go of is None, a handle a completed one."""
    if isinstance(value, tuple | list):
        return type(value)(_strong(v) for v in value)
    if isinstance(value, dict):
        return {k: _Completed() if (work := _strong(v)) is None else work for k, v in value.items()}
    if isinstance(value, weakref.ref):
        return value()
    return value


def _fresh(value: Any) -> Any:
    """`value` in new containers (the schedule pops a handles' dictionary it is given)."""
    if isinstance(value, tuple | list):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


class InterleavedRun:
    """One call of the interleaved schedule, driven by `driver` (`fast_forward.ScheduleFastForward`)."""

    def __init__(self, driver: Any, num_microbatches: int, chunks: int, datas: list[Any]) -> None:
        self.driver = driver
        self.num_microbatches = num_microbatches
        self.chunks = chunks
        self.total = num_microbatches * chunks
        self.datas = datas
        """Each chunk's counting data iterator (`fast_forward._Counting`), None where the chunk reads none."""
        self.data = None
        self.store: list[Any] | None = None
        self.forwards = 0
        self.warmup: int | None = None
        """Forwards before the first backward, less one (None: still warming up)."""
        self.group = 0
        self.returns: dict[int, dict[str, Any]] = {}
        """Steady iteration -> what its seams returned (weakly), the last `window` of them."""
        self.entries: dict[int, int] = {}
        """Steady iteration -> the entries its forward appended to the schedule's ``forward_data_store``."""
        self.skipping = 0
        self.skip: tuple[int, int] = (0, 0)
        """The skipped iterations: from (the mark's), to (the first run again)."""
        self.silence: Any = None
        self.advanced = False
        self.pending: deque[Any] = deque()
        self.waits: list[Any] = []
        """The handles pending at the mark, whose waits during the skip do nothing."""
        self.held: dict[int, dict[str, Any]] = {}
        """During the skip: the seam results of the window before the mark, held (the schedule lets go of the
        objects it holds at the mark during the skip, and gets them back at its end)."""

    # -- the schedule's shape -----------------------------------------------------------------------------------
    @property
    def period(self) -> int:
        return self.group * self.chunks

    @property
    def window(self) -> int:
        """Iterations back to the oldest object the schedule may still hold: a micro-batch's first chunk is
        freed ``W + (vp - 1) g`` iterations after its forward; whole periods."""
        period = self.period
        reach = (self.warmup or 0) + (self.chunks - 1) * self.group + 2
        return -(-reach // period) * period

    def _iteration(self) -> int | None:
        """The steady iteration under way (its forward called), None in the warm-up."""
        return None if self.warmup is None else self.forwards - 1 - self.warmup

    def _last(self) -> int:
        """The last steady iteration a skip may cover: the table repeats (whole micro-batch groups, the next
        forward's chunk included), no gradient sync (the last group's backwards), not the last steady iteration."""
        assert self.warmup is not None
        full = self.num_microbatches // self.group * self.period
        return min(self.total - self.warmup - 2, self.total - self.period - 1, full - self.warmup - 2)

    # -- the seams --------------------------------------------------------------------------------------------------
    def forward(self, call: Any, config: Any, store: list[Any]) -> Any:
        self.store = store
        if not self.group:
            self.group = config.microbatch_group_size_per_vp_stage or 1
        j = None if self.warmup is None else self.forwards - self.warmup
        if self.skipping:
            if j == self.skip[1]:
                self._resume()
            else:
                return self._skipped_forward(j, store)
        elif j is not None and not self.advanced and j >= 1 and (j - 1) % self.period == 0 and self._boundary(j):
            return self._skipped_forward(j, store)
        before = len(store)
        output, tokens = call()
        self.forwards += 1
        if j is not None:
            self.returns[j] = {"forward": _weak(output)}
            self.returns.pop(j - self.window - 1, None)
            self.entries[j] = len(store) - before
            self.entries.pop(j - self.window - 1, None)
        return output, tokens

    def backward(self, call: Any) -> Any:
        if self.warmup is None:
            self.warmup = self.forwards - 1
        j = self._iteration()
        if self.skipping:
            return _fresh(self.held[self._source(j)].get("backward"))
        grad = call()
        self._remember(j, "backward", grad)
        return grad

    def exchange(self, name: str, call: Any) -> Any:
        j = self._iteration()
        if self.skipping:
            return _fresh(self.held[self._source(j)].get(name))
        value = call()
        self._remember(j, name, value)
        return value

    def _remember(self, j: int | None, name: str, value: Any) -> None:
        seams = self.returns.get(j) if j is not None else None
        if seams is not None and name not in seams:
            seams[name] = _weak(value)  # new containers: the schedule pops the handles' dictionary

    # -- the skip -----------------------------------------------------------------------------------------------------
    def _source(self, j: int | None) -> int:
        """The steady iteration whose seam results skipped iteration `j` returns: ``n`` periods earlier for the
        last `window` skipped iterations (the objects the program holds after the skip), the same place in the
        window otherwise."""
        assert j is not None
        start, stop = self.skip
        window = self.window
        if j >= stop - window:
            return j - (stop - start)
        return start - window + (j - start) % window

    def _skipped_forward(self, j: int | None, store: list[Any]) -> Any:
        self.forwards += 1
        source = self._source(j)
        for _ in range(self.entries.get(source, 0)):
            store.append(self.pending.popleft())
        return _fresh(self.held[source]["forward"]), 0

    def _boundary(self, k: int) -> bool:
        """A mark before the forward of steady iteration `k`; when proven, advance and start skipping."""
        driver = self.driver
        engine = driver.engine
        engine.mark(held=driver.held(self.store), keep=self.window // self.period + 3, **driver._totals(self))
        if k - self.window < 1 or any(j not in self.returns for j in range(k - self.window, k)):
            return False
        if not engine.proven():
            return False
        periods = (self._last() + 1 - k) // self.period
        periods = engine.allowed(periods) if periods >= 1 else 0
        if periods < 1:
            return False
        if periods * self.period < self.window:
            # the objects the program holds at the mark stand, after the advance, for the ones made n periods later:
            # with a skip shorter than their window, some of those were made before the mark (the program holds
            # both), and the ones never handed back die when the skip ends (measured: a 70B candidate of `prism
            # plan`, TP4 PP4 VP20 CP2, stage 1, one 80-iteration period against a 160-iteration window)
            engine.not_proven["fewer periods to advance than the window of objects the schedule holds"] += 1
            return False
        self.skip = (k, k + periods * self.period)
        self.held = {j: _strong(self.returns[j]) for j in range(k - self.window, k)}
        self.waits = list(engine.pending)
        driver._start_skipping(self, periods, periods * self.group, adopt_per_forward=False)
        for work in self.waits:  # waited on by the skipped iterations in the full run; pending at the resume here
            work.wait = _Completed.wait.__get__(work)
        return True

    def _resume(self) -> None:
        """The forward of the first iteration after the skip: the device speaks again."""
        self.skipping = 0
        for work in self.waits:
            del work.wait
        self.waits, self.held = [], {}
        self.driver._speak(self)
