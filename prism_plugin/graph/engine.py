"""The discrete-event engine of the replay (after SimPy's kernel), public to the graph layer.

A heap of ``(time_us, priority, seq, event)``; `seq` is a counter, so ties resolve in the order events were
scheduled and every run is identical. Time jumps from event to event; nothing is time-stepped. When an op
*completes* the actors blocked on it are released. Errors are never swallowed: an op that can never start
raises `ReplayDeadlock` naming the blocked ranks and ops, members that disagree on an op raise
`ReplayMismatch`. `compile_program` turns one actor's class trace into the parallel lists the engine runs
(`Program`); `Engine(space, programs, record_events).run()` replays them. The semantics of each node kind
are stated in `prism_plugin.graph.replay`; `prism_plugin.graph.result` reads the engine's arrays.

Pure: no torch.
"""


from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.cost.faults import FaultSet
from prism_plugin.cost.model import CostModel
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.fold import Actor, ActorSpace
from prism_plugin.graph.layout import EXPERT_PREFIX
from prism_plugin.graph.schema import Node, NodeKind

__all__ = ["COMM", "COMPUTE", "WAIT", "Engine", "Program", "ReplayDeadlock", "ReplayMismatch", "compile_program"]

COMPUTE, COMM, WAIT = 0, 1, 2
"""Node codes of a compiled `Program`."""
_PRIO_COMM, _PRIO_COMPUTE = 0, 1  # at equal times, communication completions are handled first


class ReplayDeadlock(RuntimeError):
    """Some rank's op can never start: the graph's ranks wait on each other (or on a missing op)."""


class ReplayMismatch(GraphError):
    """Members of one collective (or a send/recv pair) disagree on what the op is: a graph that does not match."""


@dataclass(slots=True)
class Program:
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


def compile_program(space: ActorSpace, actor: Actor, cost: CostModel, cache: dict[Any, float],
             faults: FaultSet | None = None) -> Program:
    layout = space.layout
    nodes = space.graph.classes[actor.class_name].nodes
    prog = Program([], [], [], [], [], [], nodes)
    roles: dict[str, tuple[tuple[int, ...], int, Any]] = {}  # role -> (instance, expected, placement)
    channels: dict[tuple[NodeKind, str, int], tuple[tuple[int, ...], float, int]] = {}
    link_of: dict[str, float] = {}
    key: tuple[object, ...] | None  # comm: the rendezvous key
    ckey: tuple[object, ...]  # comm: the cost cache's key
    prefix: tuple[int, ...]  # p2p: the channel's (sender, receiver, axis, offset)
    for node in nodes:
        kind, key, expected, value = node.kind, None, 0, 0.0
        if kind is NodeKind.COMPUTE:
            code, value = COMPUTE, node.duration_us * actor.compute_scale
        elif kind is NodeKind.WAIT:
            code = WAIT
        elif kind is NodeKind.COLLECTIVE:
            code = COMM
            info = roles.get(node.group)
            if info is None:
                members = layout.group_of(actor.rep_rank, node.group)
                if node.group.startswith(EXPERT_PREFIX):  # its actors, whichever axes its members vary (in part)
                    actors = tuple(sorted({space.actor_of(m).index for m in members}))
                    instance, expected = actors, len(actors)
                else:
                    role_axes = [layout.axis_index(a) for a in layout.role_axes(node.group)]
                    instance = tuple(-1 if a in role_axes else p for a, p in enumerate(actor.parts))
                    expected = len({tuple(space.part_of[a][c] for a, c in zip(role_axes, coords, strict=True))
                                    for coords in layout.role_coords(node.group)})
                info = roles[node.group] = (instance, expected, cost.placement(members))
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
            code, expected = COMM, 2
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
        prog.link.append(node.waits_on if code == WAIT else node.waited_by)
    return prog


class Engine:
    def __init__(self, space: ActorSpace, programs: list[Program], record_events: bool) -> None:
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
            if code == COMPUTE:
                d = prog.value[i]
                start[i] = t
                self.compute[a] += d
                if d > 0.0:
                    self.blocked[a] = i
                    self._schedule(t + d, _PRIO_COMPUTE, (a, i))
                    return
                end[i] = t
            elif code == COMM:
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
            if prog.kinds[i] == WAIT:
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
