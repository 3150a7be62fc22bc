"""Node placement: which node holds a rank (ranks fill nodes in order). The one copy of `rank // gpus_per_node`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prism_plugin.config.errors import positive_int as _check_positive


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlacement:
    """Ranks fill nodes in order: rank r is on node `r // gpus_per_node`, local index `r % gpus_per_node`.

    Non-goal: irregular placements (hostfiles, heterogeneous nodes).

    >>> nodes = NodePlacement(gpus_per_node=8)
    >>> nodes.node_of(13), nodes.local_index(13)
    (1, 5)
    >>> nodes.nodes_of([13, 0, 9, 20]), nodes.ranks_per_node([13, 0, 9, 20])
    ((0, 1, 2), 2)
    >>> nodes.is_intra_node(range(8)), nodes.is_intra_node([7, 8])
    (True, False)
    """

    gpus_per_node: int
    """Ranks (GPUs) per node."""

    def __post_init__(self) -> None:
        _check_positive("gpus_per_node", self.gpus_per_node)

    def _rank(self, rank: object) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} is out of range: pass an int >= 0")
        return rank

    def node_of(self, rank: int) -> int:
        """Index of the node holding `rank`."""
        return self._rank(rank) // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        """Position of `rank` on its node (its local rank)."""
        return self._rank(rank) % self.gpus_per_node

    def nodes_of(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Distinct nodes holding `ranks`, sorted."""
        return tuple(sorted({self.node_of(r) for r in ranks}))

    def ranks_per_node(self, ranks: Iterable[int]) -> int:
        """Most distinct ranks of `ranks` on any one node (0 for no ranks)."""
        counts: dict[int, int] = {}
        for rank in set(ranks):
            node = self.node_of(rank)
            counts[node] = counts.get(node, 0) + 1
        return max(counts.values(), default=0)

    def is_intra_node(self, ranks: Iterable[int]) -> bool:
        """Whether all `ranks` share one node (True for no ranks)."""
        return len(self.nodes_of(ranks)) <= 1
