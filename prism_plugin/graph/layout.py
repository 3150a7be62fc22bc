"""The virtual world's rank grid as the graph layer sees it: axes, coordinates, groups and peers.

`WorldLayout` wraps Megatron-core's dense grid (`prism_plugin.topology.MegatronLayout`: tp, cp, dp, pp) and
adds what the execution graph needs: each axis's size and stride, a rank's coordinates, the group of a
role (an axis token such as "tp-dp") and the peer at an offset along an axis.

Roles: a token of dense axes ("tp-dp"), Megatron's embedding group (`EMBEDDING_ROLE`), or a token of the expert
grid (`EXPERT_PREFIX`: its groups need not lie along whole dense axes). Non-goals: DeepSpeed layouts are not
represented (they raise GraphError).

Pure: stdlib and prism_plugin.topology only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from prism_plugin.config.errors import rank_in_range
from prism_plugin.graph.errors import GraphError
from prism_plugin.topology import MegatronLayout

__all__ = ["EMBEDDING_ROLE", "EXPERT_PREFIX", "AxisSpec", "WorldLayout"]

EXPERT_PREFIX = "expert:"
"""Roles of Megatron's expert grid: ``expert:`` and its token (``expert:ep``, ``expert:tp-ep``, ``expert:dp``: the
expert layers' tensor, expert and data parallel axes, `MegatronLayout.group_of` with ``expert=True``). A group of
the expert grid that is also a dense group keeps the dense role."""
EMBEDDING_ROLE = "embedding"
"""The group role of Megatron's embedding group: a rank of the first pipeline stage and the rank of the last stage
at its other coordinates (the tied input and output embeddings' gradients are all-reduced over it). With pp <= 2 it
is the whole ``pp`` group and has that role; with pp > 2 it is this one, the only role not along whole axes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisSpec:
    """One axis of the dense rank grid: coordinate = (rank // stride) % size."""

    name: str
    size: int
    stride: int


@dataclass(frozen=True, slots=True)
class WorldLayout:
    """The virtual world: N ranks on Megatron-core's dense grid (tp, cp, dp, pp), as a pure value.

    Group roles are tokens of the dense grid ("tp", "dp", "tp-dp", ...), resolved by `MegatronLayout`.

    >>> w = WorldLayout(MegatronLayout(world_size=16, tp=2, pp=2))
    >>> [(a.name, a.size, a.stride) for a in w.axes]
    [('tp', 2, 1), ('cp', 1, 1), ('dp', 4, 2), ('pp', 2, 8)]
    >>> w.group_of(5, "dp"), w.peer_of(5, "pp", +1)
    ((1, 3, 5, 7), 13)
    """

    megatron: MegatronLayout
    axes: tuple[AxisSpec, ...] = field(init=False, compare=False)
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.megatron, MegatronLayout):
            raise GraphError(f"WorldLayout needs a MegatronLayout, got {type(self.megatron).__name__}")
        m = self.megatron
        sizes = {"tp": m.tp, "cp": m.cp, "dp": m.dp, "pp": m.pp}
        names = list(m.coords(0))  # the dense grid's axes, fastest first
        zero = {n: 0 for n in names if sizes[n] > 1}
        axes = []
        for name in names:
            size = sizes[name]
            stride = m.rank_at(expert=False, **{**zero, name: 1}) if size > 1 else 1
            axes.append(AxisSpec(name=name, size=size, stride=stride))
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "_index", MappingProxyType({a.name: i for i, a in enumerate(axes)}))

    @property
    def world_size(self) -> int:
        return self.megatron.world_size

    def axis(self, name: str) -> AxisSpec:
        try:
            return self.axes[self._index[name]]
        except KeyError:
            raise GraphError(
                f"axis {name!r} is not an axis of the dense grid: use one of {list(self._index)} "
                "(expert-parallel axes are not modelled in execution graphs)"
            ) from None

    def axis_index(self, name: str) -> int:
        self.axis(name)
        return self._index[name]

    def role_axes(self, role: str) -> tuple[str, ...]:
        """The axes a group role spans: "tp-dp" -> ("tp", "dp"); each checked to be a dense axis
        (`EMBEDDING_ROLE` spans ``pp``, at its two ends)."""
        if role == EMBEDDING_ROLE:
            if self.axis("pp").size < 3:
                raise GraphError(f"group role {role!r} needs pp > 2 (with pp <= 2 the embedding group is 'pp')")
            return ("pp",)
        if role.startswith(EXPERT_PREFIX):  # the dense axes its members vary along (some perhaps in part)
            members = self.group_of(0, role)
            own = self.coords(members[0])
            return tuple(a.name for i, a in enumerate(self.axes) if any(self.coords(m)[i] != own[i] for m in members))
        names = tuple(role.split("-"))
        for name in names:
            self.axis(name)
        if len(set(names)) != len(names):
            raise GraphError(f"group role {role!r} repeats an axis: name each axis once, e.g. 'tp-dp'")
        return names

    def role_coords(self, role: str) -> list[tuple[int, ...]]:
        """Coordinates, on the role's axes, of every member of a `role` group, in rank order.

        >>> w = WorldLayout(MegatronLayout(world_size=16, tp=2, pp=4))
        >>> w.role_coords("tp-dp"), w.role_coords("embedding")
        ([(0, 0), (1, 0), (0, 1), (1, 1)], [(0,), (3,)])
        """
        names = self.role_axes(role)
        if role == EMBEDDING_ROLE:
            return [(0,), (self.axis("pp").size - 1,)]
        if role.startswith(EXPERT_PREFIX):
            index = [self.axis_index(n) for n in names]
            return [tuple(self.coords(m)[i] for i in index) for m in self.group_of(0, role)]
        return [tuple(reversed(c)) for c in itertools.product(*(range(self.axis(n).size) for n in reversed(names)))]

    def expert_roles(self) -> list[str]:
        """Every role of the expert grid (`EXPERT_PREFIX` and a token of its axes of size > 1, in grid order)."""
        m = self.megatron
        sizes = {"tp": m.expert_tp or m.tp, "ep": m.ep, "dp": m.expert_dp, "pp": m.pp}
        names = [n for n in m.coords(0, expert=True) if sizes[n] > 1]
        return [EXPERT_PREFIX + "-".join(c) for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of `rank` on `axes`, in order."""
        rank_in_range(rank, self.world_size, error=GraphError)
        return tuple((rank // a.stride) % a.size for a in self.axes)

    def rank_at(self, coords: Sequence[int]) -> int:
        return sum(c * a.stride for c, a in zip(coords, self.axes, strict=True))

    def group_of(self, rank: int, role: str) -> tuple[int, ...]:
        """Global ranks of the `role` group holding `rank`, ascending (Megatron's own order)."""
        if role.startswith(EXPERT_PREFIX):
            token = role[len(EXPERT_PREFIX):]
            try:
                return self.megatron.group_of(rank, token, expert=True)
            except ValueError as exc:
                raise GraphError(f"group role {role!r}: {exc}") from None
        self.role_axes(role)
        if role != EMBEDDING_ROLE:
            return self.megatron.group_of(rank, role)
        coords, pp = list(self.coords(rank)), self.axis_index("pp")
        last = self.axes[pp].size - 1
        if coords[pp] not in (0, last):
            raise GraphError(f"rank {rank} is on pipeline stage {coords[pp]}, not in an embedding group (stages 0 "
                             f"and {last})")
        return tuple(self.rank_at([*coords[:pp], c, *coords[pp + 1:]]) for c in (0, last))

    def peer_of(self, rank: int, axis: str, offset: int) -> int:
        """The rank whose coordinate on `axis` is this rank's plus `offset` (modulo the axis size)."""
        spec = self.axis(axis)
        own = (rank // spec.stride) % spec.size
        return rank + ((own + offset) % spec.size - own) * spec.stride

    def to_dict(self) -> dict[str, Any]:
        m = self.megatron
        return {
            "kind": "megatron",
            "world_size": m.world_size,
            "tp": m.tp,
            "pp": m.pp,
            "cp": m.cp,
            "ep": m.ep,
            "expert_tp": m.expert_tp,
            "order": m.order,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorldLayout:
        data = dict(data)
        kind = data.pop("kind", None)
        if kind != "megatron":
            raise GraphError(f"layout kind {kind!r} is not supported: only 'megatron' layouts are")
        return cls(MegatronLayout(**data))
