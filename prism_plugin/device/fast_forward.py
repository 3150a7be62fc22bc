"""Exact fast-forward of repeated work on a virtual GPU (DESIGN.md section 14).

A training step repeats itself: in a pipeline schedule's steady state every period of micro-batches runs the
same ops on the same shapes. `FastForward` proves that a period repeats, then advances this process's virtual
GPU by whole periods without dispatching them again. A framework adapter marks the period boundaries (`mark`),
asks whether the last periods are proven (`proven`), advances (`advance`) and skips the program's calls for
those periods inside `silent`, keeping the program's objects as they were at the boundary.

**Recording.** From the first mark on (an adapter marks the start of the repeated work, so every block it frees
was numbered), every kernel and communication op (stream, name, start relative to the device at its period's
start: the host or the furthest stream, whichever is later; host work relative to the host; duration) and every
allocator request is recorded: a malloc by (device, size, stream), a free by its *distance*, how many mallocs ago
the freed block was allocated.

**The proof.** Marks ``b0, b1, b2`` and the two periods between them. The period is proven when both recorded the
same events (times within `TOLERANCE_S`); when the last one frees a block allocated before ``b0`` (a lifetime a
little longer than a period), the period before ``b0`` was recorded and its tail from that block on repeats the same
tail of the next period; the streams stand at the same places relative to the host at the marks (the host's frame),
or the GPU runs ahead of the host by a lead that grows by the same step every period, with no synchronisation or
query of the GPU by the host in either period (the GPU's frame; both in
`prism_plugin.device.period_proof.stream_frame`), no backward pass runs and no fusion region is open there, the live
storages and fake host bytes are the same, and the running totals (kernels, seconds, launches, kernel tallies, host
counts, value-policy answers, communication counts and bytes, group sequence numbers, and the adapter's own: data
consumed) grew by the same amounts in both. The allocator's block layout need not repeat (its small pool rarely
does): the allocator is replayed, not extrapolated.

**A growing container.** The adapter may name the storages that a container of the program holds and that grows
by the same objects every period (the last pipeline stage's losses, kept until the step ends): they are left out
of the live storages compared and never remapped; after the replay, the blocks no storage owns (`orphans`, in
malloc order) are what the skipped work left in the container, and the adapter makes its copies own them
(the virtual GPU's tracker's ``adopt``).

**The advance** by ``n`` periods:

- the allocator models run the second period's requests ``n`` more times (`_AllocatorLog.replay`: malloc by size
  and stream, free by distance), so blocks, fragmentation, segments, every statistic and peak are what the full
  execution gives, OOMs included; each live storage made in the recording then holds its counterpart of the last
  replayed period (the same malloc ``n`` periods later), as the program's objects stand for the skipped work's last;
- the host and every stream the period moved jump by ``n`` times their own step over the period (in the host's
  frame one duration for all; in the GPU's frame the host's step, and the device's for the streams); every other
  running total grows by ``n`` times its period delta.

While the adapter skips the program's calls the device is silent (`silent`): an op the schedule itself makes
between the skipped calls takes no time and no answer; anything that allocates or changes a figure makes it raise
`FastForwardBroken`: the fast-forward would no longer be exact.

**Observers that keep records.** The tracer (whose records `prism emulate` builds its execution graph from) and
the timeline offer period views (`prism_plugin.runtime.periods`): their records of the two periods are part of the
proof (the same records, times relative to the period's start, sequence numbers relative to the group's), and the
advance writes the last period's records ``n`` more times, shifted, through their own bounds. The timeline's kernel
recorder keeps receiving the kernels while the engine records them.

Without virtual time (memory only) the proof and the advance are the allocations and counts alone (`_NoClock`).

**Not fast-forwarded** (it runs for real; `unavailable` says why): with memory history, a
kernel table, a Kineto trace, or a recorded, replayed, profiled or fault-injected communication layer; with
several real ranks (their clocks couple at each exchange); with the allocator's garbage collection (block ages).

**Handles pending across marks** (Megatron's interleaved schedule waits on each exchange an iteration after issuing
it): compared at the marks and moved by the advance, their records stamped where the full run stamps them
(`prism_plugin.device.pending_works`).

Limitations: a CUDA event recorded in one period and waited on in a later one would not be shifted by the advance
(Megatron's schedules have none); float sums of the advanced clock differ from the executed ones by
rounding, far below a nanosecond.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prism_plugin.device.iteration_replay import RequestLog, is_request_hook
from prism_plugin.device.pending_works import PendingWorks, pending_at
from prism_plugin.device.period_proof import TOLERANCE_S, Capture, from_malloc, growth, same, same_map, stream_frame

__all__ = ["TOLERANCE_S", "FastForward", "FastForwardBroken", "held_storages"]

_CLOCK_TOTALS = ("kernels", "kernel_s", "launches", "native_launches", "comm_ops", "host_syncs", "exchanges",
                 "peer_wait_s", "host_work_s")
_LAYOUT_PARTS = ("the fake host bytes", "the live storages", "the cuBLAS workspaces", "the running backward passes",
                 "the futures waited on in backward", "the open fusion regions", "the iteration marks",
                 "the groups used")


def _has_periods(observer: Any) -> bool:
    """Whether `observer` keeps records a fast-forward can repeat (`prism_plugin.runtime.periods`)."""
    return callable(getattr(observer, "periods", None))


class _NoClock:
    """The clock of a virtual GPU without virtual time (memory only): nothing to record, prove or advance but its
    memory and counts; every time stays 0."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.ends: dict[Any, float] = {}
        self.record: Any = None
        self.backward_depth = 0
        self._future_wait_s = 0.0
        self.marks: tuple[Any, ...] = ()
        for name in _CLOCK_TOTALS:
            setattr(self, name, 0)


def held_storages(store: list[Any] | None) -> frozenset[int]:
    """The storage keys (``_cdata``) of the tensors `store`'s entries hold: what `FastForward.mark` takes as
    `held` for a container of the program that grows by the same objects every period."""
    if not store:
        return frozenset()
    from torch.utils._pytree import tree_leaves

    return frozenset(x.untyped_storage()._cdata for entry in store for x in tree_leaves(entry)
                     if hasattr(x, "untyped_storage"))


class FastForwardBroken(RuntimeError):
    """Work the adapter skipped changed the device: the fast-forward would not be exact."""


class _AllocatorLog(RequestLog):
    """The allocator requests of the recording (malloc by size and stream, free by distance) and their replay."""

    def __init__(self, allocators: list[Any]) -> None:
        super().__init__()
        self.allocators = allocators
        self.events: list[tuple[Any, ...]] | None = None

    def tap(self) -> None:
        for model in self.allocators:
            if "malloc" not in vars(model):
                self._tap(model)

    def untap(self) -> None:
        for model in self.allocators:
            vars(model).pop("malloc", None)
            vars(model).pop("free", None)
        self.events = None

    def _tap(self, model: Any) -> None:
        malloc, free, device = model.malloc, model.free, model.device

        def tapped_malloc(size: int, stream: int = 0) -> Any:
            block = malloc(size, stream)
            self.number(block)
            if self.events is not None:
                self.events.append(("m", device, size, stream))
            return block

        def tapped_free(block: Any) -> None:
            made = self.forget(block)
            if self.events is not None:
                self.events.append(("f", device, None if made is None else self.mallocs - made))
            free(block)

        model.malloc, model.free = tapped_malloc, tapped_free

    def replay(self, period: list[tuple[Any, ...]], times: int) -> int:
        """Run the allocator requests of `period` (events as recorded; its kernels and communication are not
        requests) `times` more times on the models themselves (untapped); returns the mallocs one period makes."""
        by_device = {m.device: m for m in self.allocators}
        for _ in range(times):
            for event in period:
                if event[0] == "m":
                    self.malloc(by_device[event[1]], event[2], event[3])
                elif event[0] == "f":
                    self.free(by_device[event[1]], event[2])
        return sum(1 for e in period if e[0] == "m")

    def counterpart(self, block: Any, made: int | None, shift: int, *, since: int) -> Any:
        """What `block` (of malloc `made`, None: before the recording) stands for after a replay of `shift`
        mallocs: the block of malloc ``made + shift`` when `made` is `since` or later (in the proven periods), else
        `block` itself (older: it lives on, and must still be allocated)."""
        if made is None or made < since:
            if not block.allocated:
                raise FastForwardBroken("prism fast-forward: a block older than the proven periods was freed by "
                                        "their replay; the fast-forward would not be exact")
            return block
        other = self.blocks.get(made + shift)
        if other is None:
            raise FastForwardBroken(f"prism fast-forward: the block of malloc {made} has no live counterpart "
                                    f"{shift} mallocs later; the fast-forward would not be exact")
        return other


class FastForward:
    """Proves and advances repeated work on virtual GPU `gpu` (`prism_plugin.device.device.VirtualGpu`), whose
    communication goes through `session` (`prism_plugin.runtime.session.Session`, None: no communication)."""

    def __init__(self, gpu: Any, session: Any = None) -> None:
        self.gpu = gpu
        self.session = session
        self.clock = gpu.clock if gpu.clock is not None else _NoClock()
        """The virtual GPU's clock, or a stand-in without virtual time (memory only: the proof and the advance are
        its allocations and counts)."""
        self._log = _AllocatorLog(gpu.allocators)
        self._captures: list[Capture] = []
        self._periods: list[list[tuple[Any, ...]]] = []
        self._events: list[tuple[Any, ...]] | None = None
        self._extra_totals: dict[str, float] = {}
        self._held: frozenset[int] = frozenset()
        """The storages a growing container of the program holds (the adapter's, at the last mark)."""
        self.orphans: list[Any] = []
        """After `advance`: the replayed blocks no storage owns, in malloc order: what the skipped work left in
        the growing container (the adapter makes its objects own them: `adopt`)."""
        self._outer_record: Any = None
        """The clock's kernel recorder before the recording (a timeline's), fed while recording, restored after."""
        self.views: list[Any] = []
        """The period views (`prism_plugin.runtime.periods`) of the observers that keep records: the tracer and
        the timeline; proven and repeated with the device."""
        self._pending = PendingWorks(self, same)
        self.advanced_periods = 0
        self.advanced_s = 0.0
        self.not_proven: Counter[str] = Counter()
        """Why marks did not prove a period, by reason (the first failed condition of the proof)."""

    # -- when it applies ----------------------------------------------------------------------------------------
    def unavailable(self) -> str | None:
        """Why this virtual GPU's work cannot be fast-forwarded (None: it can)."""
        gpu, clock = self.gpu, self.clock
        if clock.record is not None and self._events is None and not _has_periods(getattr(clock.record, "__self__",
                                                                                         None)):
            return "a kernel recorder without a period view records every kernel"
        for model in gpu.allocators:
            if model.history is not None and not is_request_hook(model.history):
                return "the allocator's memory history is recorded"
            if model.config.garbage_collection_threshold > 0:
                return "the allocator's garbage collection (block ages)"
        timer = gpu.kernel_timer
        if timer is None and gpu.clock is not None:
            return "no kernel tallies"
        if timer is not None and type(timer.model).__name__ == "TableModel":
            return "the kernel table model counts its lookups"
        session = self.session
        if gpu.clock is None and session is not None and any(_has_periods(o) for o in session.observers):
            return "memory only, and the trace or timeline records wall-clock times"
        if session is not None:
            if len(session.real_ranks) > 1:
                return "several real ranks (their clocks couple at every exchange)"
            others = [type(o).__name__ for o in session.observers if o is not session.counters and o is not clock
                      and not (callable(getattr(o, "idle", None)) and o.idle()) and not _has_periods(o)]
            if others:
                return f"the communication layer is observed ({', '.join(others)})"
        return None

    # -- marks and the proof --------------------------------------------------------------------------------------
    def mark(self, held: frozenset[int] = frozenset(), keep: int = 3, **extra_totals: float) -> None:
        """A boundary between two periods of the repeated work; `extra_totals`: the adapter's own running totals
        (data consumed), proven and advanced with the device's; `held`: the storage keys (``_cdata``) of what a
        container of the program that grows by the same objects every period holds (the last pipeline stage's
        losses): left out of the live storages the proof compares, never remapped by the advance; `keep`: how many
        periods are kept (at least 3): a proof's window reaches as far back as the oldest block its last period
        frees (`_compared`)."""
        self._extra_totals = dict(extra_totals)
        self._held = held
        keep = max(keep, 3)
        if self._events is not None:
            self._periods = [*self._periods[-(keep - 1):], self._events]
        else:  # the recording starts
            self._outer_record = self.clock.record
            keepers = [*(self.session.observers if self.session is not None else ()),
                       getattr(self._outer_record, "__self__", None)]
            keepers = [o for i, o in enumerate(keepers) if _has_periods(o) and all(o is not k for k in keepers[:i])]
            self.views = [o.periods() for o in keepers]
        if self.session is not None and self.session.counters.issued is None:
            self.session.counters.issued = []
        self._captures = [*self._captures[-keep:], self._capture()]
        if self.session is not None:  # what the next mark must find waited on (or still pending: then compared)
            self.session.counters.issued = [ref for ref, _, _ in self._captures[-1].pending]
        if len(self._captures) > 1:
            self._captures[-1].kept = self._pending.kept(self._captures[-2], self._captures[-1])
        events: list[tuple[Any, ...]] = []
        self._events = self._log.events = events
        host, device = self._captures[-1].host_s, self._captures[-1].device_s
        outer = self._outer_record

        def record(row: str, name: str, start_s: float, end_s: float) -> None:
            events.append(("k", row, name, start_s - (host if row == "host" else device), end_s - start_s))
            if outer is not None:
                outer(row, name, start_s, end_s)

        self.clock.record = record
        self._log.tap()

    @property
    def pending(self) -> tuple[Any, ...]:
        """The communication handles pending at the last mark (`prism_plugin.device.pending_works`)."""
        works = (ref() for ref, _, _ in self._captures[-1].pending) if self._captures else ()
        return tuple(w for w in works if w is not None)

    def proven(self) -> bool:
        """Whether the last two periods prove the next repeats them (module docstring); counts why not."""
        reason = self._unproven()
        if reason is not None:
            self.not_proven[reason] += 1
        return reason is None

    def _unproven(self) -> str | None:
        compared = self._compared()
        if isinstance(compared, str):
            return compared
        periods = 2
        captures = self._captures[-periods - 1:]
        for name, *parts in zip(_LAYOUT_PARTS, *(c.layout for c in captures), strict=False):
            if any(part != parts[0] for part in parts):
                return f"{name} differ at the period boundaries"
        frame = stream_frame(captures)
        if frame is not None:
            return frame
        recorded = self._periods[-periods:]
        if not all(same(a, b) for a, b in zip(recorded, recorded[1:], strict=False)):
            return "the periods ran different kernels, ops or allocations"
        reason = self._pending.unproven(captures)
        if reason is not None:
            return reason
        deltas = [growth(a.totals, b.totals) for a, b in zip(captures, captures[1:], strict=False)]
        if not all(same_map(a, b) for a, b in zip(deltas, deltas[1:], strict=False)):
            return "the running totals grew differently"
        return None

    def _compared(self) -> int | str:
        """The first malloc of the proof's window: the last two periods, and the periods before them back to the
        oldest block the last period frees (a lifetime longer than a period: a pipeline stage's micro-batch, freed
        by its backward ``W`` iterations after its forward, and its output one iteration later), whose allocations
        (from that block on) must be the last period's: every block the next periods free was then made by the
        request the last period's freed block was made by; or why no window proves anything."""
        if len(self._periods) < 2:
            return "fewer than two periods recorded"
        last, mallocs = self._periods[-1], self._captures[-2].mallocs
        earliest = mallocs
        for event in last:
            if event[0] == "m":
                mallocs += 1
            elif event[0] == "f":
                if event[2] is None:
                    return "a block allocated before the recording was freed"
                earliest = min(earliest, mallocs - event[2])
        start = self._captures[-3].mallocs
        if earliest >= start:
            return start
        pattern = [event for event in last if event[0] == "m"]
        for back in range(3, len(self._periods) + 1):
            begin = self._captures[-back - 1].mallocs
            made = [event for event in from_malloc(self._periods[-back], begin, max(earliest, begin))
                    if event[0] == "m"]
            if made != pattern[len(pattern) - len(made):] or (earliest < begin and len(made) != len(pattern)):
                return "the periods ran different kernels, ops or allocations"
            if earliest >= begin:
                return earliest
        return "a block older than the recorded periods was freed"

    # -- the advance ------------------------------------------------------------------------------------------------
    def allowed(self, periods: int, unit: int = 1) -> int:
        """`periods` (after a `proven` mark) cut, in whole `unit`s, to what every recording observer lets repeat: a
        hybrid run's table of replayed arrivals, data from outside the program, repeats the proven period only so
        far (`prism_plugin.runtime.periods.ArrivalPeriods.horizon`). Counts it when that leaves none."""
        c1, c2 = self._captures[-2], self._captures[-1]
        for i, view in enumerate(self.views):
            horizon = getattr(view, "horizon", None)
            if horizon is not None and periods > 0:
                periods = min(periods, horizon(c1.views[i], c2.views[i], c2.device_s - c1.device_s, periods))
        periods -= periods % unit
        if periods < 1:
            self.not_proven["the replayed arrivals do not repeat the period"] += 1
        return periods

    def advance(self, periods: int) -> dict[str, float]:
        """Advance this virtual GPU by `periods` repeats of the proven period (call right after a `proven` mark);
        returns the adapter's extra totals to advance (each grown by `periods` x its delta). Ends the recording."""
        assert periods > 0 and self._unproven() is None
        since = self._compared()
        assert isinstance(since, int)
        c1, c2 = self._captures[-2], self._captures[-1]
        period = self._periods[-1]
        gpu, clock, log = self.gpu, self.clock, self._log
        clock.record, log.events, self._events = self._outer_record, None, None
        tracker = gpu.tracker
        held = self._held
        made = {key: log.born.get(id(block)) for key, block in tracker._blocks.items()}  # blocks are reused
        shift = periods * log.replay(period, periods)
        for key, block in list(tracker._blocks.items()):
            if key not in held:
                tracker._blocks[key] = log.counterpart(block, made[key], shift, since=since)
        owned = {id(b) for b in (*tracker._blocks.values(), *tracker.workspaces.values())}
        self.orphans = [b for m, b in sorted(log.blocks.items()) if m >= since and id(b) not in owned]
        log.untap()
        deltas = growth(c1.totals, c2.totals)
        period_s, device_step = c2.host_s - c1.host_s, c2.device_s - c1.device_s
        moved = {k: t - c1.ends.get(k, t - period_s) for k, t in clock.ends.items() if c1.ends.get(k) != t}
        clock.host_s += periods * period_s
        for key, step in moved.items():  # the host's period, or the device's where the GPU runs ahead (`_frame`)
            clock.ends[key] += periods * step
        by_part: dict[str, dict[Any, float]] = {}
        for (part, key), delta in deltas.items():
            if delta:
                by_part.setdefault(part, {})[key] = delta
        seq_step = self._seq_of(by_part.get("seq", {}), key=lambda i: i)
        self._pending.repeat(c1, c2, periods, period_s, device_step, seq_step)
        for name, delta in by_part.get("clock", {}).items():
            setattr(clock, name, getattr(clock, name) + periods * delta)
        if gpu.kernel_timer is not None:
            gpu.kernel_timer.advance(by_part.get("kernels", {}), periods)
        gpu.host_counts.advance(by_part.get("host_counts", {}), periods)
        gpu.shim.queries += periods * int(by_part.get("shim", {}).get("queries", 0))
        values = gpu.values
        for key, delta in by_part.get("values", {}).items():
            if key == "constants_read":
                values.constants_read += periods * int(delta)
            else:
                values.answers[key] += periods * int(delta)
        session = self.session
        if session is not None:
            counters = session.counters
            for (kind, figure), delta in by_part.get("comm", {}).items():
                if figure == "modelled_s":
                    counters.modelled_comm_s += periods * delta
                else:
                    getattr(counters, figure)[kind] += periods * int(delta)
            for index, delta in by_part.get("seq", {}).items():
                session.virtual_groups[index].seq += periods * int(delta)
        self.advanced_periods += periods
        self.advanced_s += periods * max(period_s, device_step)
        self._reset()
        return {key: periods * delta for key, delta in by_part.get("extra", {}).items()}

    def adopted(self, last: Any, entries: int, fix: str) -> list[Any]:
        """The `entries` objects the skipped periods would have appended to a container of the program that grows
        by one per period (`held`): copies of `last` (a tensor or a tree of them) whose tensors own the blocks the
        allocator's replay left unowned (`orphans`), in malloc order, so the container holds what the full run's
        holds and its death frees those blocks. `fix`: what the refusal tells the user to do
        (`FastForwardBroken` when the orphans are not exactly the copies' tensors)."""
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten(last)
        leaves = [x for x in flat if isinstance(x, torch.Tensor)]
        whole = all(t.device.type == "cuda" and t.is_contiguous() and t.storage_offset() == 0
                    and t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in leaves)
        if not whole or len(self.orphans) != entries * len(leaves):
            raise FastForwardBroken(
                f"prism fast-forward: the skipped work appends {entries} entries of {len(leaves)} tensors to the "
                f"program's container but the replay left {len(self.orphans)} blocks (or the entries are not whole "
                f"device tensors), so the fast-forward would not be exact; {fix}")
        tracker, blocks = self.gpu.tracker, iter(self.orphans)
        out = []
        with tracker.paused():
            for _ in range(entries):
                made = []
                for x in flat:
                    if isinstance(x, torch.Tensor):
                        x = torch.empty_like(x)
                        tracker.adopt(x, next(blocks))
                    made.append(x)
                out.append(tree_unflatten(made, spec))
        return out

    @contextmanager
    def silent(self) -> Iterator[None]:
        """The adapter skips the program's calls: ops made meanwhile take no time and no answer; anything that
        changes the device's figures raises `FastForwardBroken` at the end."""
        before = self._capture(allocators=True)
        self.gpu.silent = True
        try:
            yield
        finally:
            self.gpu.silent = False
        after = self._capture(allocators=True)
        changed = [f"{key}: {before.totals.get(key, 0)} -> {after.totals.get(key, 0)}"
                   for key in sorted(set(before.totals) | set(after.totals), key=str)
                   if not same(before.totals.get(key, 0), after.totals.get(key, 0))]
        parts = (*_LAYOUT_PARTS[:-1], "the allocators' blocks", _LAYOUT_PARTS[-1])  # as `_capture` lays them out
        changed += [f"{name} differ" for name, a, b in zip(parts, before.layout, after.layout, strict=False) if a != b]
        if before.host_s != after.host_s or before.ends != after.ends:
            changed.append("the host or a stream moved")
        if changed:
            raise FastForwardBroken(
                "prism fast-forward: the program changed the virtual GPU between the calls it skipped (it allocated, "
                "launched or read a value there: " + "; ".join(changed[:6]) + "), so the fast-forward would not be "
                "exact; run with --prism-fast-forward off and report the job")

    def stop(self) -> None:
        """The repeated work ended (the schedule returned): drop the marks and the recording."""
        if self._events is not None:
            self.clock.record = self._outer_record
        self._log.untap()
        self._reset()

    def _reset(self) -> None:
        self._events = None
        self._outer_record, self.views = None, []
        if self.session is not None:
            self.session.counters.issued = None
        self._captures, self._periods = [], []
        self._log = _AllocatorLog(self.gpu.allocators)

    def summary(self) -> dict[str, Any]:
        return {"periods_advanced": self.advanced_periods, "emulated_s_advanced": round(self.advanced_s, 9),
                "not_proven": dict(self.not_proven)}

    def _seq_of(self, figures: dict[Any, float], key: Any = lambda i: ("seq", i)) -> Any:
        """A group -> its figure in `figures` (a capture's totals: its sequence number; a period's growth)."""
        groups = {id(vg): i for i, vg in enumerate(self.session.virtual_groups)} if self.session is not None else {}
        return lambda vg: int(figures.get(key(groups[id(vg)]), 0))

    # -- captures -----------------------------------------------------------------------------------------------------
    def _capture(self, *, allocators: bool = False) -> Capture:
        gpu, clock = self.gpu, self.clock
        host = clock.host_s
        positions = {k: max(t - host, 0.0) for k, t in clock.ends.items()}
        tracker = gpu.tracker
        held = self._held
        devices, hosts = tracker.live_count()
        held_host = [tracker._host[k] for k in held if k in tracker._host]
        live = (devices - sum(1 for k in held if k in tracker._blocks), hosts - len(held_host))
        layout: tuple[Any, ...] = (tracker.host_bytes - sum(held_host), live, len(tracker.workspaces),
                                   clock.backward_depth, clock._future_wait_s > 0.0, gpu.fusion.folds(),
                                   len(clock.marks))
        totals: dict[Any, float] = {("clock", n): getattr(clock, n) for n in _CLOCK_TOTALS}
        if allocators:
            layout = (*layout, tuple(m.layout() for m in gpu.allocators))
            for model in gpu.allocators:
                totals.update({("allocator", (model.device, k)): v for k, v in model.totals().items()})
        if gpu.kernel_timer is not None:
            totals.update({("kernels", k): v for k, v in gpu.kernel_timer.totals().items()})
        totals.update({("host_counts", k): v for k, v in gpu.host_counts.totals().items()})
        totals.update({("values", k): v for k, v in gpu.values.answers.items()})
        totals[("values", "constants_read")] = gpu.values.constants_read
        session = self.session
        if session is not None:
            counters = session.counters
            totals.update({("comm", (k, "op_counts")): v for k, v in counters.op_counts.items()})
            totals.update({("comm", (k, "op_bytes")): v for k, v in counters.op_bytes.items()})
            totals[("comm", (None, "modelled_s"))] = counters.modelled_comm_s
            totals.update({("seq", i): vg.seq for i, vg in enumerate(session.virtual_groups)})
            layout = (*layout, tuple((name, use[1], frozenset(use[2])) for name, use in counters.comm_use.items()))
        totals.update({("extra", k): v for k, v in self._extra_totals.items()})
        totals[("shim", "queries")] = gpu.shim.queries
        issued = self.session.counters.issued if session is not None else None
        device = max(host, max(clock.ends.values(), default=host)) if gpu.clock is not None else None
        pending = () if issued is None else pending_at(issued, device)
        return Capture(host, dict(clock.ends), positions, layout, totals, self._log.mallocs,
                        tuple(view.position() for view in self.views), pending)
