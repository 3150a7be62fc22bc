"""Symmetry folding: the replay's actors, each one standing for a block of ranks with identical timelines.

Every axis of the rank grid is cut into *parts*. An **explicit** axis has one part per coordinate. A
**folded** axis has one part per *expanded* coordinate (the coordinates of ranks a what-if touches) plus one
part holding all the other coordinates. A block is a product of one part per axis; an actor replays one
block, on behalf of all its ranks.

Why this is exact. The replay computes the least solution of max-plus equations: an op starts when the
rank reached it and (for communication) when every partner reached its matching op, and ends a
duration or a cost later. Suppose every rank of a block B has (1) the same trace and compute scale,
(2) for each communication op, partners lying in the same set of blocks, each block's members being at the
same op, and (3) the same cost for each op. Then the timeline that gives every rank its block's timeline
satisfies every rank's equations (max over a set of equal values is that value), and the solution is
unique (each time is a function of earlier times: the replay's event order), so the folded replay gives
exactly the per-rank replay's times. The blocks built here meet the three conditions because:

1. traces: the class of a rank depends only on its coordinates on the class axes, which are explicit, and
   a rank a what-if touches (straggler, override) sits in a block of its own (its coordinate is expanded
   on every folded axis, and every other axis is explicit);
2. partners: a collective's group varies exactly the axes of its role over all coordinates, so its partner
   blocks are "every part of the role's axes x this block's part elsewhere", the same for every rank of B;
   a send/recv moves the coordinate of its peer axis by a fixed offset, which maps parts onto parts only
   when that axis is explicit, so every axis carrying sends/recvs is made explicit;
3. costs: a cost depends on the group's (or the peer pair's) placement over nodes of `gpus_per_node`
   ranks, which depends on the group base rank modulo `gpus_per_node`. `fold` computes, for every block,
   the set of those residues and checks that each op's placement (or node crossing) is the same for all
   of them. If one is not, every folded axis whose stride is not a multiple of `gpus_per_node` is made
   explicit, after which every rank of a block has the same residue, so the check holds trivially.

In a symmetric Megatron job (class = pipeline stage, tp=8 on 8-GPU nodes) this leaves one actor per
stage; one straggler adds its coordinate to each folded axis, e.g. tp: {t*, rest}, dp: {d*, rest}: 4 actors
per stage, whatever N.

Pure: no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

from prism_plugin.cost.model import GroupPlacement
from prism_plugin.graph.layout import EXPERT_PREFIX
from prism_plugin.graph.schema import ExecutionGraph, NodeKind, WorldLayout

__all__ = ["Actor", "ActorSpace", "ReplayMode", "fold"]


class ReplayMode(StrEnum):
    """How many actors the replay uses."""

    AUTO = "auto"  # fold symmetric ranks into one actor per block (exact; see the module docstring)
    FULL = "full"  # one actor per rank: the reference the folded replay is tested against


@dataclass(frozen=True, kw_only=True, slots=True)
class Actor:
    """One replayed timeline, standing for `num_ranks` ranks with identical timelines."""

    index: int
    """Position in `ActorSpace.actors`."""
    parts: tuple[int, ...]
    """Part index on each layout axis."""
    rep_rank: int
    """The block's lowest rank: its groups and peers price the block's ops."""
    num_ranks: int
    """How many ranks the actor stands for."""
    class_name: str
    """The class trace the actor runs."""
    compute_scale: float
    """Factor on compute durations (stragglers)."""


class ActorSpace:
    """The partition of the rank grid into blocks, and the arithmetic between ranks, parts and actors."""

    def __init__(
        self,
        graph: ExecutionGraph,
        explicit: frozenset[str],
        expanded: Mapping[str, frozenset[int]],
        compute_scale: Mapping[int, float],
    ) -> None:
        self.graph = graph
        self.layout: WorldLayout = graph.layout
        parts: list[tuple[tuple[int, ...], ...]] = []
        for axis in self.layout.axes:
            if axis.name in explicit or axis.size == 1:
                parts.append(tuple((c,) for c in range(axis.size)))
            else:
                keep = sorted(expanded.get(axis.name, ()))
                rest = tuple(c for c in range(axis.size) if c not in keep)
                parts.append(tuple((c,) for c in keep) + ((rest,) if rest else ()))
        self.parts = tuple(parts)
        """parts[axis][part] -> the coordinates in that part."""
        part_of = []
        for axis, axis_parts in zip(self.layout.axes, parts, strict=True):
            lookup = [0] * axis.size
            for p, coords in enumerate(axis_parts):
                for c in coords:
                    lookup[c] = p
            part_of.append(tuple(lookup))
        self.part_of = tuple(part_of)
        """part_of[axis][coordinate] -> part index."""
        self.folded_axes = tuple(
            a.name for a, ps in zip(self.layout.axes, parts, strict=True) if len(ps) < a.size
        )
        self._radix = [len(ps) for ps in parts]
        actors = []
        for index, combo in enumerate(itertools.product(*(range(n) for n in reversed(self._radix)))):
            part_idx = tuple(reversed(combo))  # first axis varies fastest, like ranks
            rep = self.layout.rank_at([self.parts[a][p][0] for a, p in enumerate(part_idx)])
            num = math.prod(len(self.parts[a][p]) for a, p in enumerate(part_idx))
            actors.append(
                Actor(
                    index=index,
                    parts=part_idx,
                    rep_rank=rep,
                    num_ranks=num,
                    class_name=graph.class_of(rep),
                    compute_scale=compute_scale.get(rep, 1.0) * graph.compute_scale_of(rep),
                )
            )
        self.actors: tuple[Actor, ...] = tuple(actors)

    def actor_index(self, parts: Iterable[int]) -> int:
        index, scale = 0, 1
        for p, n in zip(parts, self._radix, strict=True):
            index += p * scale
            scale *= n
        return index

    def actor_of(self, rank: int) -> Actor:
        """The actor whose block holds `rank`."""
        coords = self.layout.coords(rank)
        return self.actors[self.actor_index(self.part_of[a][c] for a, c in enumerate(coords))]

    def peer_actor(self, actor: Actor, axis: int, offset: int) -> Actor:
        """The actor of the peers `offset` along `axis` (an explicit axis: one coordinate per part)."""
        assert len(self.parts[axis]) == self.layout.axes[axis].size, "send/recv axes are explicit"
        parts = list(actor.parts)
        parts[axis] = (parts[axis] + offset) % self.layout.axes[axis].size
        return self.actors[self.actor_index(parts)]

    def ranks_of(self, actor: Actor) -> Iterable[int]:
        """Every rank the actor stands for (ascending within each axis; may be many)."""
        coord_sets = [self.parts[a][p] for a, p in enumerate(actor.parts)]
        for combo in itertools.product(*reversed(coord_sets)):
            yield self.layout.rank_at(tuple(reversed(combo)))

    def describe(self, actor: Actor) -> str:
        """E.g. "rank 24 (1 of 512 ranks: tp=*, cp=0, dp=*, pp=3)" or "rank 24" for a one-rank block."""
        if actor.num_ranks == 1:
            return f"rank {actor.rep_rank}"
        coords = []
        for a, p in enumerate(actor.parts):
            cs = self.parts[a][p]
            coords.append(f"{self.layout.axes[a].name}={cs[0] if len(cs) == 1 else '*'}")
        return f"rank {actor.rep_rank} (1 of {actor.num_ranks} ranks: {', '.join(coords)})"


def fold(
    graph: ExecutionGraph,
    gpus_per_node: int,
    *,
    compute_scale: Mapping[int, float],
    mode: ReplayMode = ReplayMode.AUTO,
) -> ActorSpace:
    """The actor space for replaying `graph` exactly (module docstring); `compute_scale`: stragglers."""
    layout = graph.layout
    all_axes = frozenset(a.name for a in layout.axes)
    if ReplayMode(mode) is ReplayMode.FULL:
        return ActorSpace(graph, all_axes, {}, compute_scale)
    touched = set(graph.overrides) | {r for r, s in compute_scale.items() if s != 1.0}
    expanded: dict[str, frozenset[int]] = {}
    for i, axis in enumerate(layout.axes):
        expanded[axis.name] = frozenset(layout.coords(r)[i] for r in touched)
    p2p_axes = {n.peer_axis for t in graph.classes.values() for n in t.nodes if n.kind in _P2P}
    explicit = frozenset(graph.class_axes) | p2p_axes
    if touched:  # an expert group may cover part of an axis: a touched coordinate's part would mix its groups
        explicit |= {a for t in graph.classes.values() for n in t.nodes if n.kind is NodeKind.COLLECTIVE
                     and n.group.startswith(EXPERT_PREFIX) for a in layout.role_axes(n.group)}
    space = ActorSpace(graph, explicit, expanded, compute_scale)
    if _costs_uniform(space, gpus_per_node):
        return space
    explicit |= {a.name for a in layout.axes if a.stride % gpus_per_node}
    space = ActorSpace(graph, explicit, expanded, compute_scale)
    assert _costs_uniform(space, gpus_per_node), "blocks with one residue mod gpus_per_node are uniform"
    return space


_P2P = (NodeKind.SEND, NodeKind.RECV)


def _costs_uniform(space: ActorSpace, gpus_per_node: int) -> bool:
    """Whether every op of every block has one placement (or node crossing) over all the block's ranks."""
    layout, g = space.layout, gpus_per_node
    if not space.folded_axes:
        return True

    @cache
    def part_residues(axis: int, part: int) -> frozenset[int]:
        stride = layout.axes[axis].stride
        return frozenset(c * stride % g for c in space.parts[axis][part])

    def residues(actor_parts: tuple[int, ...], skip: frozenset[int]) -> set[int]:
        out = {0}
        for axis, part in enumerate(actor_parts):
            if axis not in skip:
                out = {(s + r) % g for s in out for r in part_residues(axis, part)}
        return out

    @cache
    def placement(role: str, residue: int) -> GroupPlacement:
        return GroupPlacement.from_ranks([residue + m for m in layout.group_of(0, role)], g)

    @cache
    def signature(class_name: str) -> tuple[frozenset[str], frozenset[tuple[int, int]]]:
        roles, channels = set(), set()
        for node in space.graph.classes[class_name].nodes:
            if node.kind is NodeKind.COLLECTIVE:
                roles.add(node.group)
            elif node.kind in _P2P:
                channels.add((layout.axis_index(node.peer_axis), node.peer_offset))
        return frozenset(roles), frozenset(channels)

    for actor in space.actors:
        if actor.num_ranks == 1:
            continue
        roles, channels = signature(actor.class_name)
        for role in roles:
            skip = frozenset(layout.axis_index(a) for a in layout.role_axes(role))
            if len({placement(role, s) for s in residues(actor.parts, skip)}) > 1:
                return False
        every = residues(actor.parts, frozenset())
        for axis, offset in channels:
            spec = layout.axes[axis]
            own = space.parts[axis][actor.parts[axis]][0]
            delta = ((own + offset) % spec.size - own) * spec.stride
            if len({(s + delta) // g != 0 for s in every}) > 1:
                return False
    return True
