"""Discrete-event replay of an execution graph: every rank's time at every op (DESIGN.md section 6).

Engine (after SimPy's kernel): a heap of ``(time_us, priority, seq, event)``; `seq` is a counter, so
ties resolve in the order events were scheduled and every run is identical. Time jumps from event to event;
nothing is time-stepped. When an op *completes* the actors blocked on it are released. Errors are never
swallowed: an op that can never start raises `ReplayDeadlock` naming the blocked ranks and ops, members
that disagree on an op raise `ReplayMismatch`.

Semantics, per rank (an *actor* replays one block of identical ranks, see `fold`):
- nodes run in trace order, all ranks starting at time 0;
- COMPUTE takes ``duration_us * compute_scale``;
- a COLLECTIVE of group instance I and sequence number k is *ready* when every member has arrived
  (issued it); it starts at ``max(ready, end of op k-1 on I)`` (one communicator runs its ops in order)
  and ends ``CostModel.collective_us_placed(op, size_bytes, placement of I's global ranks)`` later;
- SEND and RECV pair by (src, dst, channel, seq) and end ``CostModel.p2p_us`` after both arrived (and
  after the channel's previous transfer);
- a blocking communication op holds its rank until the op ends; an async one (``is_async``) lets the rank
  go on at once, and the WAIT node named by ``waited_by`` holds the rank until the op ends.

Per rank: iteration time (end of its last node) = compute + exposed communication + bubble, where time
blocked in an op splits into *bubble* (until the last partner arrived: idle, waiting on peers) and
*exposed communication* (the rest: the transfer itself, and queueing behind the communicator's previous op).

Symmetry: `ReplayMode.AUTO` replays one actor per block of ranks with provably identical timelines
(`prism_plugin.graph.fold` states the argument); a symmetric job costs one actor per class, whatever N.
What-ifs (`stragglers`, graph overrides) split only the blocks they touch. `ReplayMode.FULL` replays every
rank (the reference). Limitations: no contention between concurrent ops, compute is not slowed by
overlapping communication, and a straggler's slowdown applies to its compute only.

Pure: no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.config.faults import FaultSpec
from prism_plugin.cost.faults import FaultSet
from prism_plugin.cost.model import CostModel
from prism_plugin.graph.fold import Actor, ActorSpace, ReplayMode, fold
from prism_plugin.graph.result import OpSpan, RankBreakdown, ReplayResult
from prism_plugin.graph.schema import ExecutionGraph, Node, NodeKind

__all__ = [
    "OpSpan",
    "RankBreakdown",
    "ReplayDeadlock",
    "ReplayMismatch",
    "ReplayMode",
    "ReplayResult",
    "replay",
]

_COMPUTE, _COMM, _WAIT = 0, 1, 2
_PRIO_COMM, _PRIO_COMPUTE = 0, 1  # at equal times, communication completions are handled first


class ReplayDeadlock(RuntimeError):
    """Some rank's op can never start: the graph's ranks wait on each other (or on a missing op)."""


class ReplayMismatch(ValueError):
    """Members of one collective (or a send/recv pair) disagree on what the op is."""


@dataclass(slots=True)
class _Program:
    """One actor's trace compiled for the engine: parallel lists indexed by node."""

    kinds: list[int]
    value: list[float]  # compute: scaled duration; comm: cost
    key: list[Any]  # comm: rendezvous key
    expected: list[int]  # comm: number of actors that must arrive
    is_async: list[bool]
    link: list[int]  # async comm: waited_by; WAIT: waits_on
    nodes: Sequence[Node]


class _Pending:
    __slots__ = ("count", "ready", "members", "node", "last")

    def __init__(self, node: Node) -> None:
        self.count = 0
        self.ready = 0.0
        self.last = -1  # the actor that arrived last (whom the others waited on)
        self.members: list[tuple[int, int]] = []
        self.node = node


def _compile(space: ActorSpace, actor: Actor, cost: CostModel, cache: dict[Any, float],
             faults: FaultSet | None = None) -> _Program:
    layout = space.layout
    radix = [len(p) for p in space.parts]
    nodes = space.graph.classes[actor.class_name].nodes
    prog = _Program([], [], [], [], [], [], nodes)
    roles: dict[str, tuple[tuple[int, ...], int, Any]] = {}  # role -> (instance, expected, placement)
    channels: dict[tuple[NodeKind, str, int], tuple[tuple[int, ...], float, int]] = {}
    link_of: dict[str, float] = {}
    for node in nodes:
        kind, key, expected, value = node.kind, None, 0, 0.0
        if kind is NodeKind.COMPUTE:
            code, value = _COMPUTE, node.duration_us * actor.compute_scale
        elif kind is NodeKind.WAIT:
            code = _WAIT
        elif kind is NodeKind.COLLECTIVE:
            code = _COMM
            info = roles.get(node.group)
            if info is None:
                role_axes = {layout.axis_index(a) for a in layout.role_axes(node.group)}
                info = roles[node.group] = (
                    tuple(-1 if a in role_axes else p for a, p in enumerate(actor.parts)),
                    math.prod(radix[a] for a in role_axes),
                    cost.placement(layout.group_of(actor.rep_rank, node.group)),
                )
            instance, expected, placement = info
            key = (node.group, instance, node.seq)
            ckey = (node.op, node.size_bytes, placement)
            value = cache.get(ckey, -1.0)
            if value < 0:
                assert node.op is not None
                value = cache[ckey] = cost.collective_us_placed(node.op, node.size_bytes, placement)
            if faults:  # degraded links this instance crosses, seeded jitter per (role, seq)
                links = link_of.get(node.group)
                if links is None:
                    links = link_of[node.group] = faults.link_factor(layout.group_of(actor.rep_rank, node.group))
                value *= links * faults.jitter(node.group, node.seq)
        else:
            code, expected = _COMM, 2
            chan = channels.get((kind, node.peer_axis, node.peer_offset))
            if chan is None:
                axis = layout.axis_index(node.peer_axis)
                size = layout.axes[axis].size
                peer = space.peer_actor(actor, axis, node.peer_offset).index
                if kind is NodeKind.SEND:
                    prefix = (actor.index, peer, axis, node.peer_offset % size)
                else:
                    prefix = (peer, actor.index, axis, -node.peer_offset % size)
                peer_rank = layout.peer_of(actor.rep_rank, node.peer_axis, node.peer_offset)
                chan = channels[(kind, node.peer_axis, node.peer_offset)] = (prefix, -1.0, peer_rank)
            prefix, _, peer_rank = chan
            key = (*prefix, node.seq)
            ckey = ("p2p", node.size_bytes, actor.rep_rank, peer_rank)
            value = cache.get(ckey, -1.0)
            if value < 0:
                value = cache[ckey] = cost.p2p_us(node.size_bytes, actor.rep_rank, peer_rank)
            if faults:  # the send and its recv key the same draw: (axis, offset in the send direction, seq)
                size = layout.axes[layout.axis_index(node.peer_axis)].size
                off = node.peer_offset % size if kind is NodeKind.SEND else -node.peer_offset % size
                value *= faults.link_factor((actor.rep_rank, peer_rank)) * faults.jitter(
                    f"p2p:{node.peer_axis}:{off}", node.seq)
        prog.kinds.append(code)
        prog.value.append(value)
        prog.key.append(key)
        prog.expected.append(expected)
        prog.is_async.append(node.is_async)
        prog.link.append(node.waits_on if code == _WAIT else node.waited_by)
    return prog


class _Engine:
    def __init__(self, space: ActorSpace, programs: list[_Program], record_events: bool) -> None:
        self.space, self.programs = space, programs
        n = len(programs)
        self.issue = [[0.0] * len(p.kinds) for p in programs]
        self.ready = [[0.0] * len(p.kinds) for p in programs]
        self.start = [[0.0] * len(p.kinds) for p in programs]
        self.end = [[-1.0] * len(p.kinds) for p in programs]
        self.last = [[-1] * len(p.kinds) for p in programs]  # comm: actor that arrived last (blame)
        self.blocked = [-1] * n  # node index an actor is blocked on, -1 when running or finished
        self.finish = [-1.0] * n
        self.compute = [0.0] * n
        self.exposed = [0.0] * n
        self.bubble = [0.0] * n
        self.pending: dict[Any, _Pending] = {}
        self.last_end: dict[Any, float] = {}  # communicator (group instance or p2p channel) -> end of last op
        self.heap: list[tuple[float, int, int, Any]] = []
        self.counter = 0
        self.events = 0
        self.log: list[tuple[float, int, int]] | None = [] if record_events else None

    def _schedule(self, time_us: float, priority: int, event: Any) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (time_us, priority, self.counter, event))

    def run(self) -> None:
        for a in range(len(self.programs)):
            self._advance(a, 0, 0.0)
        heap, pop = self.heap, heapq.heappop
        while heap:
            time_us, priority, _, event = pop(heap)
            self.events += 1
            if priority == _PRIO_COMPUTE:
                a, i = event
                self.end[a][i] = time_us
                if self.log is not None:
                    self.log.append((time_us, a, i))
                self._advance(a, i + 1, time_us)
            else:
                self._complete(event, time_us)
        stuck = [a for a, f in enumerate(self.finish) if f < 0]
        if stuck:
            raise ReplayDeadlock(self._deadlock_message(stuck))

    def _advance(self, a: int, i: int, t: float) -> None:
        """Run actor `a` from node `i` at time `t` until it blocks or finishes."""
        prog = self.programs[a]
        kinds, issue, start, end = prog.kinds, self.issue[a], self.start[a], self.end[a]
        n = len(kinds)
        while i < n:
            code = kinds[i]
            issue[i] = t
            if code == _COMPUTE:
                d = prog.value[i]
                start[i] = t
                self.compute[a] += d
                if d > 0.0:
                    self.blocked[a] = i
                    self._schedule(t + d, _PRIO_COMPUTE, (a, i))
                    return
                end[i] = t
            elif code == _COMM:
                self._arrive(a, i, t)
                if not prog.is_async[i]:
                    self.blocked[a] = i
                    return
            else:
                j = prog.link[i]
                start[i] = t
                if end[j] < 0.0:
                    self.blocked[a] = i
                    return
                end[i] = t
            i += 1
        self.blocked[a] = -1
        self.finish[a] = t

    def _arrive(self, a: int, i: int, t: float) -> None:
        prog = self.programs[a]
        key = prog.key[i]
        pend = self.pending.get(key)
        node = prog.nodes[i]
        if pend is None:
            pend = self.pending[key] = _Pending(node)
        elif not _same_op(pend.node, node):
            first = self.space.describe(self.space.actors[pend.members[0][0]])
            raise ReplayMismatch(
                f"{self.space.describe(self.space.actors[a])} node {i} ({node.label()}, {node.size_bytes} B) "
                f"meets {first}'s {pend.node.label()} ({pend.node.size_bytes} B) at the same op: the class "
                "traces disagree on this op"
            )
        pend.count += 1
        pend.members.append((a, i))
        if t > pend.ready or pend.last < 0:
            pend.ready = t
            pend.last = a
        if pend.count == prog.expected[i]:
            del self.pending[key]
            channel = key[:-1]
            begin = max(pend.ready, self.last_end.get(channel, 0.0))
            finish = begin + prog.value[i]
            self.last_end[channel] = finish
            for b, k in pend.members:
                self.ready[b][k] = pend.ready
                self.start[b][k] = begin
                self.last[b][k] = pend.last
            self._schedule(finish, _PRIO_COMM, pend)

    def _complete(self, pend: _Pending, t: float) -> None:
        for a, i in pend.members:
            self.end[a][i] = t
            if self.log is not None:
                self.log.append((t, a, i))
            prog = self.programs[a]
            issue = self.issue[a]
            if self.blocked[a] == i:  # a blocking op
                self._account(a, issue[i], pend.ready, t)
                self._advance(a, i + 1, t)
            elif prog.is_async[i] and self.blocked[a] == prog.link[i]:  # its WAIT is holding the rank
                w = prog.link[i]
                self._account(a, issue[w], pend.ready, t)
                self.end[a][w] = t
                self._advance(a, w + 1, t)

    def _account(self, a: int, blocked_from: float, ready: float, t: float) -> None:
        """Split the time actor `a` was held, [blocked_from, t], into bubble and exposed communication."""
        waited_for_peers = max(0.0, min(ready, t) - blocked_from)
        self.bubble[a] += waited_for_peers
        self.exposed[a] += t - blocked_from - waited_for_peers

    def _deadlock_message(self, stuck: list[int]) -> str:
        space, lines = self.space, []
        for a in stuck[:8]:
            i = self.blocked[a]
            prog = self.programs[a]
            who = space.describe(space.actors[a])
            if i < 0:
                lines.append(f"  {who}: never started")
                continue
            if prog.kinds[i] == _WAIT:
                who += f" node {i} (wait) waits on"
                i = prog.link[i]
            node = prog.nodes[i]
            pend = self.pending.get(prog.key[i])
            arrived = 0 if pend is None else pend.count
            others = (
                [] if pend is None else [space.describe(space.actors[b]) for b, _ in pend.members if b != a]
            )
            lines.append(
                f"  {who} node {i} ({node.label()}): {arrived} of {prog.expected[i]} members arrived"
                + (f" (with {', '.join(others[:3])})" if others else "")
            )
        more = f"\n  ... and {len(stuck) - 8} more blocked actors" if len(stuck) > 8 else ""
        return (
            f"replay deadlock: {len(stuck)} actor(s) can never go on; the op each is blocked on never gets "
            "all its members (a missing or misordered op in a class trace):\n" + "\n".join(lines) + more
        )


def _same_op(a: Node, b: Node) -> bool:
    if a.kind is NodeKind.COLLECTIVE:
        return b.kind is NodeKind.COLLECTIVE and a.op is b.op and a.size_bytes == b.size_bytes
    return {a.kind, b.kind} == {NodeKind.SEND, NodeKind.RECV} and a.size_bytes == b.size_bytes


def replay(
    graph: ExecutionGraph,
    cost: CostModel,
    *,
    stragglers: Mapping[int, float] | None = None,
    mode: ReplayMode = ReplayMode.AUTO,
    record_events: bool = False,
    faults: Sequence[FaultSpec] | None = None,
) -> ReplayResult:
    """Replay one iteration of `graph` on `cost`'s cluster.

    `stragglers` maps a global rank to a slowdown factor of its compute (1.5 = 50% slower); it combines
    with the graph's own overrides. `record_events` keeps the completion order (for tests and debugging).
    `faults` (`prism_plugin.config.faults`): stragglers (their `from_step` is ignored: the replay predicts the
    faulty steady state), degraded links (an op crossing one costs ``cost / bandwidth``; forces
    `ReplayMode.FULL`, since folding assumes identical placements) and seeded jitter (``exp(sigma z)`` per
    (group role, seq), the same for every instance, so folding stays exact). Hangs, crashes and kills are
    live-only (a hang would only turn the replay into a `ReplayDeadlock`).

    >>> from prism_plugin.cost import CostModel, load_profile
    >>> from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph
    >>> g = build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=4, fwd_us=10.0, bwd_us=20.0,
    ...                                   activation_bytes=0, grad_bytes=0))
    >>> r = replay(g, CostModel(load_profile("dgx-h100")))
    >>> r.num_actors, r.iteration_time_us()  # (4 + 2 - 1) * (10 + 20) + 5 transfers of 6 us on the path
    (2, 180.0)
    """
    scales: dict[int, float] = {}
    for rank, factor in (stragglers or {}).items():
        graph.layout.coords(rank)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor):
            raise ValueError(f"stragglers[{rank}]={factor!r} must be a finite number > 0 (1.5 = 50% slower)")
        if factor <= 0:
            raise ValueError(f"stragglers[{rank}]={factor!r} must be > 0 (1.5 = 50% slower)")
        scales[rank] = float(factor)
    fault_set = None
    if faults:
        fault_set = FaultSet(tuple(faults), graph.layout.world_size, cost.profile.gpus_per_node)
        for spec in fault_set.stragglers:
            for rank in spec.ranks:
                scales[rank] = scales.get(rank, 1.0) * spec.factor
        if fault_set.links:
            mode = ReplayMode.FULL
    space = fold(graph, cost.profile.gpus_per_node, compute_scale=scales, mode=mode)
    cache: dict[Any, float] = {}
    programs = [_compile(space, actor, cost, cache, fault_set) for actor in space.actors]
    engine = _Engine(space, programs, record_events)
    engine.run()
    return ReplayResult(space, engine)
