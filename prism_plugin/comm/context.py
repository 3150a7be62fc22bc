"""The op seam: what comm needs from its owner, and the one event each op reports to its observers.

comm (the backend, virtual groups, collectives, work handles) imports nothing from the runtime. Its owner
(`prism_plugin.runtime.session.Session`, or a test's fake) hands every `VirtualGroup` an `OpContext`:
this rank, the world's real ranks, the data policy, the timeout of inner real groups, the `OpClock`, the
factory of inner real groups and of subgroups, the cost of an op, and one ordered list of `OpObserver`.

Every op builds one `OpEvent` and goes through two phases, each over the observers in list order:

1. ``on_op(event)``, before the work handle exists: an observer may move ``arrival_s`` later, scale
   ``cost_s``, set a ``failure``, add finishing steps (`OpEvent.add_finish`) that run after the op's own
   data rules; the handle then completes at ``arrival_s + cost_s``;
2. ``on_issued(event, work)``, once the handle exists: an observer may link a record to it (``work.trace``)
   or remember it.

The session's order, and why:

- replayed arrivals (`prism_plugin.runtime.arrivals`): moves ``arrival_s`` to the virtual members' replayed
  arrival; first, so every later observer sees the arrival the graph's replay says;
- live faults (`prism_plugin.runtime.live_faults`): a live straggler moves ``arrival_s``, a slow link or jitter
  scales ``cost_s``, a hung or crashed member sets ``failure``; after the replay, whose delay it blames on
  the straggler it comes from;
- replayer, recorder (`prism_plugin.comm.recording`): finishing steps that overwrite the received tensors
  with recorded payloads / copy them for the recording; replay first, so a recording of a replayed run
  records what was delivered;
- tracer (`prism_plugin.runtime.tracer`): records the op with its final figures and links the record to
  the handle (wait() stamps the wait point); after everything that changes the op;
- timeline (`prism_plugin.runtime.timeline`, ``PRISM_TIMELINE``), torch.profiler ranges
  (`prism_plugin.runtime.profiler`: the ranges a real backend opens inside a user's profiler) and the Kineto
  trace (`prism_plugin.runtime.kineto`, ``PRISM_KINETO``, virtual GPUs): record the op as the tracer does
  (their ``on_issued`` sees every ``on_op`` done, the clock's included); read-only;
- counters (the session's op counts, bytes, modelled communication, communicator use): read-only;
- the clock, when it observes (an emulated clock places the op on its stream); last, with the op final.
  The wall clock (`prism_plugin.device.op_clock.WallClock`) observes nothing and is not in the list.

Cost on the hot path (one real member, no graph, tracer or faults): the one `OpEvent`, two calls per
observer; ``device_type`` and ``numel`` are computed only when an observer reads them.

Non-goals: the protocols state what comm reads, not how the owner computes it; observers run on the
issuing thread and must not block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from prism_plugin.config.kinds import DataPolicy, OpKind

__all__ = ["Finish", "OpClock", "OpContext", "OpEvent", "OpFailure", "OpGroup", "OpObserver", "OpWork",
           "WaitTrace", "chain"]

Finish = Callable[[], None]
"""A step run when an op's data is complete (real exchanges done): writes or copies its outputs."""


def chain(first: Finish | None, steps: Sequence[Finish] | None) -> Finish | None:
    """One step running `first` (if any) then `steps` in order; None when there is nothing to run."""
    if not steps:
        return first
    todo = [first, *steps] if first is not None else list(steps)
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


class OpClock(Protocol):
    """The time comm reads and waits on: when an op is issued, when an inner exchange finished, and until
    when a wait() blocks. The wall clock sleeps; an emulated clock would advance instead."""

    def now_s(self) -> float:
        """The current time in seconds (the origin is the clock's own)."""
        ...

    def sleep_until(self, deadline_s: float, record: bool = True) -> None:
        """Block until ``now_s() >= deadline_s``; `record`: the deadline is an op's emulated completion,
        so the clock may note how late it delivered it (False: a fault's raise time)."""
        ...


def data_steps(clock: OpClock) -> AbstractContextManager[None]:
    """The block comm's own data steps run in (the virtual members' share written into a result, a recorded
    payload copied in): what a real backend's collective kernel writes as part of the op, so a clock that times
    the program's device ops times none of theirs (`prism_plugin.device.clock.VirtualTime.untimed`); a clock that
    times none (the wall clock) gives an empty block."""
    untimed: Callable[[], AbstractContextManager[None]] | None = getattr(clock, "untimed", None)
    return nullcontext() if untimed is None else untimed()


class OpFailure(Protocol):
    """How a faulty op ends: wait() raises a copy of `error` once the clock reaches `raise_at_s`."""

    raise_at_s: float
    error: BaseException

    def raised(self) -> None:
        """Called by wait() just before it raises (e.g. to tell the user which fault it was)."""
        ...


class WaitTrace(Protocol):
    """A record a tracer links to a work handle: wait() stamps when it was entered and when it returned."""

    def on_wait(self, clock: OpClock) -> None: ...

    def on_done(self, clock: OpClock) -> None: ...


class OpWork(Protocol):
    """What an observer sees of an op's handle (`prism_plugin.comm.work.TimedWork`)."""

    trace: WaitTrace | None
    deadline_s: float

    def is_completed_flag(self) -> bool:
        """Whether a wait() finished this work (never blocks, never polls)."""
        ...


class OpGroup(Protocol):
    """What an observer reads of an op's group (`prism_plugin.comm.group.VirtualGroup`)."""

    name: str
    desc: str
    is_world: bool
    global_ranks: Sequence[int]
    all_real: bool
    num_real: int
    """Real members (2+: their emulated times travel with each op, `exchange_max` / `send_word` / `recv_word`)."""

    def group_rank_of(self, global_rank: int) -> int | None: ...

    def is_real(self, group_rank: int) -> bool: ...

    def exchange_max(self, values: Sequence[float]) -> list[float]:
        """The element-wise max of `values` over the real members (each gives its own; blocks until all did)."""
        ...

    def send_word(self, dst: int, tag: int, value: float) -> None:
        """Send `value` to real member `dst` (group rank) with `tag`; never blocks."""
        ...

    def recv_word(self, src: int, tag: int) -> float:
        """The value real member `src` (group rank) sent with `tag`; blocks until it was sent."""
        ...


@dataclass(slots=True, eq=False)
class OpEvent:
    """One op as its observers see it; observers may change the fields marked mutable."""

    kind: OpKind
    group: OpGroup
    seq: int
    """The op's sequence number in its group (1, 2, ...): with the group's name, its identity across ranks."""
    size_bytes: int
    peer: int | None
    """The other rank (global) of a send/recv; None for a collective."""
    received: Sequence[torch.Tensor]
    """The tensors this rank receives into (empty when it receives nothing: a send, a broadcast root)."""
    issue_s: float
    """When this rank issued the op (its own arrival), on the op clock."""
    arrival_s: float
    """Mutable: the latest arrival of every member; starts at `issue_s` (virtual members arrive with this rank)."""
    model_cost_s: float
    """The cost model's duration of the op (0 when the group has no virtual member or timing is off)."""
    cost_s: float
    """Mutable: the op's duration, `model_cost_s` until a fault scales it; completion = arrival_s + cost_s."""
    finish: Finish | None = None
    """The op's own data step (virtual members' share); observers add theirs with `add_finish`."""
    failure: OpFailure | None = None
    """Mutable: set when the op fails (a hung or crashed member); wait() raises instead of completing."""
    steps: list[Finish] | None = None
    """Observers' finishing steps, run after `finish` in the order added."""
    tag: int = 0
    """A send/recv's tag (0 for a collective)."""
    exchanged: bool = False
    """Mutable: an emulated clock set `arrival_s` from the real members' exchanged times, so the handle does not
    observe the inner real exchange's completion on the clock (`prism_plugin.comm.work.TimedWork`)."""

    @property
    def group_name(self) -> str:
        return self.group.name

    @property
    def device_type(self) -> str:
        """The device type of the received tensors ("cpu" when none); computed on each read."""
        received = self.received
        return received[0].device.type if received else "cpu"

    @property
    def numel(self) -> int:
        """Elements received, summed over the tensors; computed on each read."""
        return sum(t.numel() for t in self.received)

    @property
    def completion_s(self) -> float:
        """The emulated completion before the real exchange is observed: ``arrival_s + cost_s``."""
        return self.arrival_s + self.cost_s

    def add_finish(self, step: Finish) -> None:
        """Run `step` when the op's data is complete, after its own step and the steps added before."""
        if self.steps is None:
            self.steps = [step]
        else:
            self.steps.append(step)

    def finishing(self) -> Finish | None:
        """The op's own step followed by the observers' (what the work handle runs)."""
        return chain(self.finish, self.steps)


@runtime_checkable
class OpObserver(Protocol):
    """Sees every op, twice: before its handle exists (`on_op`) and after (`on_issued`)."""

    def on_op(self, event: OpEvent) -> None:
        """Before the handle exists: may move ``arrival_s`` later, scale ``cost_s``, set ``failure``,
        add finishing steps."""
        ...

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        """Once the handle exists (completing at ``event.completion_s``): may link a trace or remember it."""
        ...


class OpContext(Protocol):
    """Everything comm needs from its owner (see the module docstring); the session implements it."""

    @property
    def rank(self) -> int:
        """The virtual rank this process plays."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def real_ranks(self) -> Sequence[int]:
        """The virtual ranks played by real processes, in process order."""
        ...

    @property
    def data_policy(self) -> DataPolicy: ...

    @property
    def timeout_s(self) -> float:
        """Timeout of the inner real groups (and of a hung op)."""
        ...

    @property
    def op_clock(self) -> OpClock: ...

    @property
    def observers(self) -> Sequence[OpObserver]:
        """The op observers, in the order they are called."""
        ...

    def cost_s(self, kind: OpKind, size_bytes: int, group: Any, peer: int | None) -> float:
        """The modelled duration of an op of `size_bytes` on `group` (`peer`: a send/recv's global rank)."""
        ...

    def make_inner_group(self, prefix: str, rank: int, size: int, device_type: str,
                         timeout: timedelta) -> dist.ProcessGroup:
        """A real group among the real members (store keys under `prefix`)."""
        ...

    def create_group(self, ranks: Sequence[int], group_name: str | None,
                     group_desc: str | None = None) -> dist.ProcessGroup | None:
        """The prism group over global `ranks` (None when this rank is not a member): `new_group`."""
        ...
