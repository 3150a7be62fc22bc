"""What a replay returns: every rank's iteration time, time breakdown and per-op times.

Queries take global ranks; a rank's answers are those of the actor (`prism_plugin.graph.fold`) standing
for it, so they cost the same whatever N.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prism_plugin.graph.fold import ActorSpace
from prism_plugin.graph.schema import Node, NodeKind

if TYPE_CHECKING:
    from prism_plugin.graph.engine import Engine

__all__ = ["OpSpan", "RankBreakdown", "ReplayResult"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankBreakdown:
    """Where one rank's iteration time went; the three parts sum to `iteration_us`."""

    iteration_us: float
    compute_us: float
    exposed_comm_us: float
    bubble_us: float


@dataclass(frozen=True, kw_only=True, slots=True)
class OpSpan:
    """Times of one node on one rank, in microseconds from the iteration start."""

    index: int
    node: Node
    issue_us: float
    """When the rank reached the node (its arrival at a communication op)."""
    ready_us: float
    """Communication: when the last member arrived (the rank's idle wait on peers ends); else issue_us."""
    start_us: float
    """When the op began: compute at issue; communication when all partners arrived (and the
    communicator was free); WAIT at issue."""
    end_us: float
    """When the op completed (WAIT: when the awaited op completed, or at issue if it already had)."""


class ReplayResult:
    """Every rank's timeline: iteration time, breakdown, and (start, end) of every op.

    Queries take global ranks; a rank's answers are those of the actor standing for it.
    """

    def __init__(self, space: ActorSpace, engine: Engine) -> None:
        self.space = space
        self.graph = space.graph
        self._e = engine
        self._index_cache: dict[str, tuple[dict[tuple[str, int], int], dict[tuple[Any, ...], int]]] = {}

    @property
    def num_actors(self) -> int:
        """How many timelines were replayed (classes x what-if blocks; N in FULL mode)."""
        return len(self.space.actors)

    @property
    def events(self) -> int:
        """Events the engine processed."""
        return self._e.events

    @property
    def event_log(self) -> list[tuple[float, int, int]]:
        """(time_us, representative rank, node index) of every completion in processing order.

        Empty unless the replay ran with ``record_events=True``.
        """
        actors = self.space.actors
        return [(t, actors[a].rep_rank, i) for t, a, i in (self._e.log or [])]

    def iteration_time_us(self, rank: int | None = None) -> float:
        """When `rank` finished its iteration; with no rank, the job's (the last rank's) time."""
        if rank is None:
            return max(self._e.finish)
        return self._e.finish[self.space.actor_of(rank).index]

    def breakdown(self, rank: int) -> RankBreakdown:
        a = self.space.actor_of(rank).index
        e = self._e
        return RankBreakdown(
            iteration_us=e.finish[a],
            compute_us=e.compute[a],
            exposed_comm_us=e.exposed[a],
            bubble_us=e.bubble[a],
        )

    def op_spans(self, rank: int) -> list[OpSpan]:
        """Every node of `rank`'s trace with its issue, start and end times."""
        a = self.space.actor_of(rank).index
        e = self._e
        nodes = self._e.programs[a].nodes
        issue, ready = e.issue[a], e.ready[a]
        return [
            OpSpan(
                index=i,
                node=n,
                issue_us=issue[i],
                ready_us=ready[i] if n.kind.is_comm else issue[i],
                start_us=e.start[a][i],
                end_us=e.end[a][i],
            )
            for i, n in enumerate(nodes)
        ]

    def _index(self, class_name: str) -> tuple[dict[tuple[str, int], int], dict[tuple[Any, ...], int]]:
        """(collectives by (role, seq), sends/recvs by (kind, axis, offset, seq)) -> node index."""
        index = self._index_cache.get(class_name)
        if index is None:
            coll: dict[tuple[str, int], int] = {}
            p2p: dict[tuple[Any, ...], int] = {}
            for i, node in enumerate(self.graph.classes[class_name].nodes):
                if node.kind is NodeKind.COLLECTIVE:
                    coll[(node.group, node.seq)] = i
                elif node.kind in (NodeKind.SEND, NodeKind.RECV):
                    p2p[(node.kind, node.peer_axis, node.peer_offset, node.seq)] = i
            index = self._index_cache[class_name] = (coll, p2p)
        return index

    def arrival_offset_us(self, rank: int, group: str | Sequence[int], seq: int) -> float:
        """When `rank` arrives at its `seq`-th collective on `group`, in us from the iteration start.

        `group` is a group role ("dp") or the group's global ranks (any order).
        """
        actor = self.space.actor_of(rank)
        index = self._index(actor.class_name)[0]
        role = group if isinstance(group, str) else self._role_of(rank, actor.class_name, group)
        i = index.get((role, seq))
        if i is None:
            raise KeyError(
                f"rank {rank} ({actor.class_name}) has no collective #{seq} on group role {role!r}"
            )
        return self._e.issue[actor.index][i]

    def _role_of(self, rank: int, class_name: str, group: Sequence[int]) -> str:
        wanted = tuple(sorted(group))
        layout = self.graph.layout
        for role in sorted({role for role, _ in self._index(class_name)[0]}):
            if layout.group_of(rank, role) == wanted:
                return role
        raise KeyError(f"rank {rank} ({class_name}) has no collective on group {list(wanted)[:16]}")

    def p2p_arrival_offset_us(self, rank: int, kind: NodeKind, peer: int, seq: int) -> float:
        """When `rank` issues its `seq`-th SEND to (or RECV from) global rank `peer`."""
        actor = self.space.actor_of(rank)
        layout = self.graph.layout
        for (k, axis, offset, s), i in self._index(actor.class_name)[1].items():
            if k is NodeKind(kind) and s == seq:
                if layout.peer_of(rank, axis, offset) == peer:
                    return self._e.issue[actor.index][i]
        raise KeyError(f"rank {rank} has no {NodeKind(kind).value} #{seq} with peer {peer}")

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: job iteration time, actors, events, and the slowest rank's breakdown."""
        a = max(range(self.num_actors), key=lambda k: self._e.finish[k])
        b = self.breakdown(self.space.actors[a].rep_rank)
        return {
            "iteration_us": b.iteration_us,
            "num_actors": self.num_actors,
            "events": self.events,
            "folded_axes": list(self.space.folded_axes),
            "slowest_rank": self.space.actors[a].rep_rank,
            "compute_us": b.compute_us,
            "exposed_comm_us": b.exposed_comm_us,
            "bubble_us": b.bubble_us,
        }
