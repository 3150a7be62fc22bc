"""Alpha-beta time of one collective or send/recv on a hardware profile (DESIGN.md section 5).

Conventions:
- Rank r sits on node ``r // profile.gpus_per_node``; each GPU owns one NIC of ``inter_node`` bandwidth.
- ``size_bytes`` is the full buffer for all_reduce / broadcast / reduce; the OUTPUT total for
  all_gather / gather; the INPUT total for reduce_scatter / scatter; the total input of one rank for
  all_to_all (it sends size_bytes / n to each peer); the message for send / recv. Barrier ignores it.
- A group of one rank costs 0 (and so does a send to oneself). Every other op pays a fixed overhead
  (``collective_overhead_us`` or ``p2p_overhead_us``) plus latency and transfer terms.
- Transfer terms use link rate x ``bus_efficiency`` (collectives) or x ``p2p_efficiency`` (send/recv),
  times the profile's optional per-op ``op_transfer_factors`` (1 for an op not listed).
- A phase that crosses nodes runs over the NICs of the group's ranks in parallel (one NIC per rank, as
  NCCL's rings/channels use them); the node with the fewest group ranks is the bottleneck. Latency:
  ``intra_node.latency_us`` per hop inside a node, ``inter_node.latency_us`` per hop between nodes.

Limitations (what this model will NOT do): no contention between concurrent ops, no congestion or
oversubscription, no protocol switch (LL/LL128/Simple), no NVLS/SHARP/CollNet in-network reduction,
no PXN, no per-peer cost in all_to_all (one step however many peers), and an unbalanced group (ranks
unevenly spread over nodes) is approximated by its fullest and emptiest node. Monotonic in group size
only for balanced placements. Expect tens of percent error until a profile is calibrated.

Pure: stdlib only; no torch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from prism_plugin.config.errors import ConfigError, int_at_least
from prism_plugin.config.kinds import Algorithm, OpKind
from prism_plugin.config.nccl import NcclAlgorithms
from prism_plugin.cost.profiles import HardwareProfile
from prism_plugin.topology.placement import NodePlacement

__all__ = ["NCCL_STAND_INS", "CostBreakdown", "CostModel", "GroupPlacement", "allowed_algorithms",
           "supported_algorithms"]

_AR, _BC, _RD = OpKind.ALL_REDUCE, OpKind.BROADCAST, OpKind.REDUCE
_AG, _RS, _BAR = OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.BARRIER
_SUPPORTED: dict[Algorithm, frozenset[OpKind]] = {
    Algorithm.RING: frozenset({_AR, _AG, _RS, _BC, _RD, _BAR}),
    Algorithm.TREE: frozenset({_AR, _BC, _RD, _BAR}),
    Algorithm.HIERARCHICAL: frozenset({_AR, _AG, _RS, _BC, _RD, _BAR}),
    Algorithm.DIRECT: frozenset({OpKind.ALL_TO_ALL, OpKind.GATHER, OpKind.SCATTER, OpKind.SEND, OpKind.RECV}),
}
_KINDS: dict[object, OpKind] = {kind: kind for kind in OpKind}  # also maps the plain strings
_ALGORITHMS: dict[object, Algorithm] = {alg: alg for alg in Algorithm}


def supported_algorithms(kind: OpKind) -> tuple[Algorithm, ...]:
    """The algorithms the model knows for `kind`, e.g. ALL_TO_ALL -> (DIRECT,)."""
    return tuple(alg for alg, kinds in _SUPPORTED.items() if kind in kinds)


NCCL_STAND_INS: dict[Algorithm, frozenset[str]] = {
    Algorithm.RING: frozenset({"ring"}), Algorithm.TREE: frozenset({"tree"}),
    Algorithm.HIERARCHICAL: frozenset({"collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"}),
}
"""The NCCL algorithms each model algorithm stands for: HIERARCHICAL (an intra-node phase, then one between nodes)
is the model's one formula for NCCL's multi-level algorithms (CollNet, NVLS, NVLSTree, PAT), allowed when
``NCCL_ALGO`` allows one of them."""


def allowed_algorithms(kind: OpKind, nccl: NcclAlgorithms | None) -> tuple[Algorithm, ...]:
    """The model algorithms `kind` may use under `nccl` (``NCCL_ALGO``; None: every one), RING, TREE, HIERARCHICAL
    order (a tie goes to the earlier); a barrier follows all_reduce's (NCCL runs it as one). A `ConfigError` when
    none is left, naming the variables and the fix.

    >>> from prism_plugin.config.nccl import parse_nccl_algo
    >>> allowed_algorithms(OpKind.ALL_REDUCE, parse_nccl_algo("^ring"))
    (<Algorithm.TREE: 'tree'>, <Algorithm.HIERARCHICAL: 'hierarchical'>)
    """
    candidates = tuple(a for a in (Algorithm.RING, Algorithm.TREE, Algorithm.HIERARCHICAL) if kind in _SUPPORTED[a])
    if nccl is None or _is_direct_only(kind):
        return candidates
    names = nccl.allowed((OpKind.ALL_REDUCE if kind is OpKind.BARRIER else kind).value)
    allowed = tuple(a for a in candidates if NCCL_STAND_INS[a] & names)
    if not allowed:
        known = sorted(set().union(*(NCCL_STAND_INS[a] for a in candidates)))
        raise ConfigError(f"{nccl.text}: leaves {kind.value} no algorithm NCCL runs it with ({', '.join(known)}); "
                          f"allow one of them for {kind.value}")
    return allowed


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlacement:
    """How a group's ranks spread over nodes: all the cost model needs to know about the group.

    Example (8 GPUs/node): ranks [0, 1, 8, 9, 10] -> size=5, num_nodes=2, max_ranks_per_node=3,
    min_ranks_per_node=2.
    """

    size: int
    """Number of ranks in the group."""
    num_nodes: int
    """Number of distinct nodes the group touches."""
    max_ranks_per_node: int
    """Group ranks on the fullest node (sets the intra-node phase)."""
    min_ranks_per_node: int
    """Group ranks on the emptiest node touched (sets how many NICs work in parallel)."""

    def __post_init__(self) -> None:
        n, m, hi, lo = self.size, self.num_nodes, self.max_ranks_per_node, self.min_ranks_per_node
        if not (1 <= m <= n and 1 <= lo <= hi and lo * m <= n <= hi * m) or (m == 1 and lo != n):
            raise ConfigError(
                f"inconsistent GroupPlacement(size={n}, num_nodes={m}, max_ranks_per_node={hi}, "
                f"min_ranks_per_node={lo}); build it with GroupPlacement.from_ranks(ranks, gpus_per_node)"
            )

    @classmethod
    def from_ranks(cls, group_ranks: Sequence[int], gpus_per_node: int) -> GroupPlacement:
        """Placement of global ranks on nodes of `gpus_per_node` (node = rank // gpus_per_node).

        Example: from_ranks(range(16), 8) -> size=16, num_nodes=2, max=min=8 ranks per node.
        """
        if not group_ranks:
            raise ConfigError("group_ranks is empty; a group needs at least one rank")
        nodes = NodePlacement(gpus_per_node=gpus_per_node)
        per_node: dict[int, int] = {}
        for rank in group_ranks:
            int_at_least("group rank", rank, 0, hint="a global rank")
            node = nodes.node_of(rank)
            per_node[node] = per_node.get(node, 0) + 1
        size = len(group_ranks)
        if len(set(group_ranks)) != size:
            raise ConfigError(f"group_ranks lists a rank more than once: {list(group_ranks)[:16]}")
        counts = per_node.values()
        return cls(
            size=size, num_nodes=len(per_node), max_ranks_per_node=max(counts), min_ranks_per_node=min(counts)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CostBreakdown:
    """One op's modelled time split into its alpha (latency + overhead) and beta (transfer) parts."""

    algorithm: Algorithm
    """The algorithm the time is for (chosen by the model unless the caller forced one)."""
    latency_us: float
    """Fixed overhead plus per-hop latencies, in microseconds."""
    transfer_us: float
    """Size-dependent part, in microseconds."""

    @property
    def total_us(self) -> float:
        return self.latency_us + self.transfer_us


class CostModel:
    """Times collectives and send/recv on one `HardwareProfile`; immutable and cheap to call.

    Example (dgx-h100): 1 GiB all_reduce on ranks 0..7 (one node, ring):
    2*7/8 * 2**30 B / (450e9 B/s * 0.8) = 5219.6 us, + 14 hops * 1 us + 5 us overhead = 5238.6 us.
    Hot path for replay engines: ``pl = model.placement(ranks)`` once, then
    ``model.collective_us_placed(kind, size_bytes, pl)`` per op.
    """

    __slots__ = (
        "_profile",
        "_allowed",
        "_bi",
        "_be",
        "_bp_intra",
        "_bp_inter",
        "_ai",
        "_ae",
        "_oc",
        "_op",
        "_placement_cached",
        "_tf",
    )

    def __init__(self, profile: HardwareProfile, nccl: NcclAlgorithms | None = None) -> None:
        if not isinstance(profile, HardwareProfile):
            raise TypeError(f"CostModel needs a HardwareProfile (see load_profile), got {type(profile)!r}")
        self._profile = profile
        # the algorithms NCCL_ALGO / NCCL_NVLS_ENABLE leave each collective (None: NCCL's free choice)
        self._allowed = {kind: allowed_algorithms(kind, nccl) for kind in OpKind if not _is_direct_only(kind)}
        # GB/s = 1e9 bytes/s = 1e3 bytes/us.
        self._bi = profile.intra_node.bandwidth_gbytes_per_s * 1e3 * profile.bus_efficiency
        self._be = profile.inter_node.bandwidth_gbytes_per_s * 1e3 * profile.bus_efficiency
        self._bp_intra = profile.intra_node.bandwidth_gbytes_per_s * 1e3 * profile.p2p_efficiency
        self._bp_inter = profile.inter_node.bandwidth_gbytes_per_s * 1e3 * profile.p2p_efficiency
        self._ai = profile.intra_node.latency_us
        self._ae = profile.inter_node.latency_us
        self._oc = profile.collective_overhead_us
        self._op = profile.p2p_overhead_us
        # optional per-op transfer multipliers (a backend whose ops differ in more than hops and traffic)
        self._tf = {OpKind(op): factor for op, factor in profile.op_transfer_factors}
        if OpKind.SEND in self._tf and OpKind.RECV not in self._tf:
            self._tf[OpKind.RECV] = self._tf[OpKind.SEND]
        gpus_per_node = profile.gpus_per_node
        self._placement_cached = lru_cache(maxsize=65536)(
            lambda ranks: GroupPlacement.from_ranks(ranks, gpus_per_node)
        )

    @property
    def profile(self) -> HardwareProfile:
        return self._profile

    def placement(self, group_ranks: Sequence[int]) -> GroupPlacement:
        """The (cached) placement of `group_ranks` on this profile's nodes."""
        return self._placement_cached(tuple(group_ranks))

    def choose_algorithm(self, kind: OpKind, size_bytes: int, group_ranks: Sequence[int]) -> Algorithm:
        """Roughly what NCCL picks; deterministic.

        all_to_all, gather, scatter, send, recv -> DIRECT. A group inside one node -> RING (on NVLink).
        A group spanning nodes -> the candidate with the least modelled time among RING, TREE (all_reduce,
        broadcast, reduce, barrier only) and HIERARCHICAL, ties to the earlier one; like NCCL's tuner this
        lands on TREE for small all_reduce at scale, HIERARCHICAL for large all_gather / reduce_scatter
        over many nodes (fewer latency terms), and RING for very large messages over few nodes.
        """
        return self._choose(_kind(kind), _size(size_bytes), self.placement(group_ranks))

    def collective_us(
        self,
        kind: OpKind,
        size_bytes: int,
        group_ranks: Sequence[int],
        algorithm: Algorithm | None = None,
    ) -> float:
        """Modelled time of one `kind` op over global `group_ranks`, in microseconds (see module doc)."""
        return self.collective_us_placed(kind, size_bytes, self.placement(group_ranks), algorithm)

    def collective_us_placed(
        self,
        kind: OpKind,
        size_bytes: int,
        placement: GroupPlacement,
        algorithm: Algorithm | None = None,
    ) -> float:
        """`collective_us` for a precomputed placement (the hot path: no per-call work on the group)."""
        if type(kind) is not OpKind:
            kind = _kind(kind)
        if type(size_bytes) is not int or size_bytes < 0:
            size_bytes = _size(size_bytes)
        latency_us, transfer_us, _ = self._terms(kind, size_bytes, placement, algorithm)
        return latency_us + transfer_us

    def breakdown(
        self,
        kind: OpKind,
        size_bytes: int,
        placement: GroupPlacement,
        algorithm: Algorithm | None = None,
    ) -> CostBreakdown:
        """The same time as `collective_us_placed`, split into latency and transfer, with the algorithm."""
        latency_us, transfer_us, alg = self._terms(_kind(kind), _size(size_bytes), placement, algorithm)
        return CostBreakdown(algorithm=alg, latency_us=latency_us, transfer_us=transfer_us)

    def p2p_us(self, size_bytes: int, src: int, dst: int) -> float:
        """Time of one send/recv of `size_bytes` from global rank `src` to `dst` (0 when src == dst).

        Example (dgx-h100): 1 MB from rank 0 to 8 (another node) = 5 us overhead + 10 us
        + 1e6 B / (50e9 B/s * 0.8) = 40 us.
        """
        size = _size(size_bytes)
        if src < 0 or dst < 0:
            raise ConfigError(f"p2p ranks must be non-negative, got src={src!r}, dst={dst!r}")
        if src == dst:
            return 0.0
        nodes = NodePlacement(gpus_per_node=self._profile.gpus_per_node)
        latency_us, transfer_us = self._p2p(size, nodes.node_of(src) != nodes.node_of(dst))
        return latency_us + transfer_us * self._tf.get(OpKind.SEND, 1.0)

    # -- internals -------------------------------------------------------------------------------

    def _p2p(self, size: int, crosses_nodes: bool) -> tuple[float, float]:
        if crosses_nodes:
            return self._op + self._ae, size / self._bp_inter
        return self._op + self._ai, size / self._bp_intra

    def _choose(self, kind: OpKind, size: int, pl: GroupPlacement) -> Algorithm:
        if _is_direct_only(kind):
            return Algorithm.DIRECT
        if pl.num_nodes == 1:
            return self._inside_node(kind)
        return self._best_spanning(kind, size, pl)[2]

    def _inside_node(self, kind: OpKind) -> Algorithm:
        """A group inside one node: RING on NVLink, unless NCCL_ALGO excludes it (then the first allowed)."""
        allowed = self._allowed[kind]
        return Algorithm.RING if Algorithm.RING in allowed else allowed[0]

    def _best_spanning(self, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float, Algorithm]:
        """The least-time allowed candidate for a group spanning nodes; ties go to RING, then TREE."""
        best: tuple[float, float, Algorithm] | None = None
        for alg in self._allowed[kind]:
            lat, xfer = self._spanning_terms(alg, kind, size, pl)
            if best is None or lat + xfer < best[0] + best[1]:
                best = (lat, xfer, alg)
        assert best is not None  # allowed_algorithms never leaves a kind without one
        return best

    def _spanning_terms(self, alg: Algorithm, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float]:
        if alg is Algorithm.RING:
            return self._ring(kind, size, pl)
        if alg is Algorithm.TREE:
            return self._tree(kind, size, pl)
        return self._hierarchical(kind, size, pl)

    def _terms(
        self, kind: OpKind, size: int, pl: GroupPlacement, algorithm: Algorithm | None
    ) -> tuple[float, float, Algorithm]:
        """(latency_us including overhead, transfer_us, algorithm) of one op; validates the algorithm.
        The profile's per-op transfer factor scales the chosen algorithm's transfer term (the choice is made
        without it)."""
        latency_us, transfer_us, alg = self._unscaled_terms(kind, size, pl, algorithm)
        factor = self._tf.get(kind) if self._tf else None
        return (latency_us, transfer_us * factor, alg) if factor is not None else (latency_us, transfer_us, alg)

    def _unscaled_terms(
        self, kind: OpKind, size: int, pl: GroupPlacement, algorithm: Algorithm | None
    ) -> tuple[float, float, Algorithm]:
        if pl.size == 1:
            if kind is OpKind.SEND or kind is OpKind.RECV:
                raise ConfigError(f"{kind.name} needs a group of exactly 2 ranks (src, dst), got 1")
            return (
                0.0,
                0.0,
                self._choose(kind, size, pl) if algorithm is None else _algorithm(algorithm, kind),
            )
        if algorithm is None:
            if _is_direct_only(kind):
                return (*self._direct(kind, size, pl), Algorithm.DIRECT)
            if pl.num_nodes == 1:
                alg = self._inside_node(kind)
                terms = self._tree(kind, size, pl) if alg is Algorithm.TREE else self._ring(kind, size, pl)
                return (*terms, alg)  # HIERARCHICAL inside one node is the intra-node ring
            return self._best_spanning(kind, size, pl)
        algorithm = _algorithm(algorithm, kind)
        # Inside one node there is no inter-node phase: HIERARCHICAL is the intra-node ring.
        if algorithm is Algorithm.RING or (algorithm is Algorithm.HIERARCHICAL and pl.num_nodes == 1):
            return (*self._ring(kind, size, pl), algorithm)
        if algorithm is Algorithm.TREE:
            return (*self._tree(kind, size, pl), algorithm)
        if algorithm is Algorithm.HIERARCHICAL:
            return (*self._hierarchical(kind, size, pl), algorithm)
        return (*self._direct(kind, size, pl), algorithm)

    def _ring(self, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float]:
        """Ring: all_reduce = reduce-scatter + all-gather, 2(n-1) hops moving 2(n-1)/n * S per rank;
        all_gather / reduce_scatter: n-1 hops, (n-1)/n * S; broadcast / reduce: a pipelined chain,
        n-1 hops, S per rank; barrier: the hops of an all_reduce, no bytes."""
        n = pl.size
        if kind is _AR:
            traffic, hops = 2.0 * (n - 1) / n * size, 2 * (n - 1)
        elif kind is _AG or kind is _RS:
            traffic, hops = (n - 1) / n * size, n - 1
        elif kind is _BAR:
            traffic, hops = 0.0, 2 * (n - 1)
        else:  # broadcast, reduce
            traffic, hops = float(size), n - 1
        m = pl.num_nodes
        if m == 1:
            return self._oc + hops * self._ai, traffic / self._bi
        # Of the n-1 hops a chunk makes around the ring, m-1 cross a node boundary.
        hop_us = ((m - 1) * self._ae + (n - m) * self._ai) / (n - 1)
        # Never faster than NVLink; across nodes each rank's NIC carries 1/min_ranks_per_node of it.
        transfer = max(traffic / self._bi, traffic / (pl.min_ranks_per_node * self._be))
        return self._oc + hops * hop_us, transfer

    def _tree(self, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float]:
        """Double binary tree: ceil(log2 n) levels, ceil(log2 nodes) of them between nodes. all_reduce =
        reduce up + broadcast down, each rank sending ~S per direction (two trees, S/2 each); broadcast /
        reduce: one direction, ~S."""
        levels = (pl.size - 1).bit_length()  # ceil(log2 n)
        inter_levels = (pl.num_nodes - 1).bit_length()  # ceil(log2 nodes)
        one_way_us = inter_levels * self._ae + (levels - inter_levels) * self._ai
        if kind is _AR or kind is _BAR:
            passes = 2
        else:  # broadcast, reduce
            passes = 1
        traffic = 0.0 if kind is _BAR else passes * float(size)
        transfer = traffic / self._bi
        if pl.num_nodes > 1:
            transfer = max(transfer, traffic / (pl.min_ranks_per_node * self._be))
        return self._oc + passes * one_way_us, transfer

    def _hierarchical(self, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float]:
        """Intra-node ring phase, inter-node ring phase on 1/p of the data per NIC (p NICs per node in
        parallel), then intra-node again. all_reduce: RS, AR, AG; all_gather: inter AG then intra AG
        (reduce_scatter mirrored); broadcast: intra scatter, inter chain, intra AG (reduce mirrored)."""
        p, m = pl.max_ranks_per_node, pl.num_nodes
        nic = pl.min_ranks_per_node * self._be
        intra = (p - 1) / p * size / self._bi  # one intra-node ring pass over the whole buffer
        if kind is _AR or kind is _BAR:
            lat = 2 * (p - 1) * self._ai + 2 * (m - 1) * self._ae
            transfer = 0.0 if kind is _BAR else 2 * intra + 2.0 * (m - 1) / m * size / nic
        elif kind is _AG or kind is _RS:
            lat = (p - 1) * self._ai + (m - 1) * self._ae
            transfer = intra + (m - 1) / m * size / nic
        else:  # broadcast, reduce
            lat = 2 * (p - 1) * self._ai + (m - 1) * self._ae
            transfer = 2 * intra + size / nic
        return self._oc + lat, transfer

    def _direct(self, kind: OpKind, size: int, pl: GroupPlacement) -> tuple[float, float]:
        """Send/recv: one message. all_to_all: every pair at once, one hop; each rank moves
        (p-1)/n * S over NVLink and (n-p)/n * S over its NIC. gather / scatter: the root moves the same
        (n-1)/n * S, so the same formula (root assumed on the emptiest node)."""
        if kind is OpKind.SEND or kind is OpKind.RECV:
            if pl.size != 2:
                raise ConfigError(f"{kind.name} needs a group of exactly 2 ranks (src, dst), got {pl.size}")
            return self._p2p(size, pl.num_nodes > 1)
        n, m = pl.size, pl.num_nodes
        transfer = (pl.max_ranks_per_node - 1) / n * size / self._bi
        if m == 1:
            return self._oc + self._ai, transfer
        transfer = max(transfer, (n - pl.min_ranks_per_node) / n * size / self._be)
        return self._oc + self._ae, transfer


def _is_direct_only(kind: OpKind) -> bool:
    return (
        kind is OpKind.ALL_TO_ALL
        or kind is OpKind.GATHER
        or kind is OpKind.SCATTER
        or kind is OpKind.SEND
        or kind is OpKind.RECV
    )


def _algorithm(algorithm: Algorithm, kind: OpKind) -> Algorithm:
    """`algorithm` as an Algorithm, checked to have a formula for `kind`."""
    alg = _ALGORITHMS.get(algorithm)
    if alg is None or kind not in _SUPPORTED[alg]:
        names = ", ".join(a.name for a in supported_algorithms(kind))
        raise ConfigError(f"algorithm {algorithm!r} has no formula for {kind.name}; supported: {names}")
    return alg


def _kind(kind: OpKind) -> OpKind:
    try:
        return _KINDS[kind]
    except (KeyError, TypeError):
        raise NotImplementedError(
            f"the cost model has no formula for op {kind!r}; known ops: {', '.join(k.value for k in OpKind)}"
        ) from None


def _size(size_bytes: int) -> int:
    """`size_bytes` as a non-negative int (numpy integers accepted; bools and floats rejected)."""
    try:
        size = operator.index(size_bytes) if not isinstance(size_bytes, bool) else -1
    except TypeError:
        size = -1
    if size < 0:
        raise ConfigError(f"size_bytes must be a non-negative integer, got {size_bytes!r}")
    return size
