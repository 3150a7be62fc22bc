"""Building execution graphs: class traces op by op, slicing, and per-rank instantiation (DESIGN.md 6).

- `TraceBuilder` appends ops to one class trace, numbering collectives per group role and sends/recvs per
  channel, and linking each async op to the WAIT that blocks on it.
- `representatives` is the slicing step: one rank per class, the ranks a profiling run executes for real.
- `graph_from_traces` assembles the `ExecutionGraph` from the representatives' traces.
- `instantiate_rank` relabels a class trace for one concrete rank: group roles become global rank lists,
  relative peers become global ranks (what the comm layer and the full replay see).

Pure: no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.schema import (
    ClassTrace,
    ExecutionGraph,
    Node,
    NodeKind,
    WorldLayout,
    rule_class_name,
)

__all__ = ["ConcreteOp", "TraceBuilder", "graph_from_traces", "instantiate_rank", "representatives"]


class TraceBuilder:
    """Appends the ops of one class trace in issue order; `build()` returns the checked `ClassTrace`.

    `axis_sizes` (e.g. {"pp": 2}) lets send/recv sequence numbers follow the channel a peer offset really
    names: with pp=2, offsets +1 and -1 reach the same rank, so they share one channel.

    >>> b = TraceBuilder(axis_sizes={"pp": 4})
    >>> h = b.send("pp", +1, 1024, is_async=True)
    >>> _ = b.compute(10.0, name="fwd")
    >>> _ = b.wait(h)
    >>> [n.label() for n in b.build()]
    ['send pp+1#0', 'compute (fwd)', 'wait node 0']
    """

    def __init__(self, axis_sizes: Mapping[str, int] | None = None) -> None:
        self._axis_sizes = dict(axis_sizes or {})
        self._nodes: list[dict[str, Any]] = []
        self._seq: dict[object, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def _append(self, **fields: Any) -> int:
        self._nodes.append(fields)
        return len(self._nodes) - 1

    def _next_seq(self, channel: object) -> int:
        seq = self._seq.get(channel, 0)
        self._seq[channel] = seq + 1
        return seq

    def compute(self, duration_us: float, *, name: str = "", samples_us: Sequence[float] = ()) -> int:
        """Append a compute span of `duration_us` (`samples_us`: per traced iteration); returns its index."""
        return self._append(kind=NodeKind.COMPUTE, duration_us=duration_us, name=name, samples_us=tuple(samples_us))

    def collective(
        self, op: OpKind, group: str, size_bytes: int, *, is_async: bool = False, name: str = ""
    ) -> int:
        """Append collective `op` on group role `group` (e.g. "dp"); its seq is the next in that role."""
        return self._append(
            kind=NodeKind.COLLECTIVE,
            op=OpKind(op),
            group=group,
            size_bytes=size_bytes,
            seq=self._next_seq(("collective", group)),
            is_async=is_async,
            name=name,
        )

    def _p2p(self, kind: NodeKind, axis: str, offset: int, size_bytes: int, is_async: bool, name: str) -> int:
        size = self._axis_sizes.get(axis)
        channel = (kind, axis, offset % size if size else offset)
        return self._append(
            kind=kind,
            peer_axis=axis,
            peer_offset=offset,
            size_bytes=size_bytes,
            seq=self._next_seq(channel),
            is_async=is_async,
            name=name,
        )

    def send(self, axis: str, offset: int, size_bytes: int, *, is_async: bool = False, name: str = "") -> int:
        """Append a send to the peer `offset` steps along `axis` (pp +1: the next stage)."""
        return self._p2p(NodeKind.SEND, axis, offset, size_bytes, is_async, name)

    def recv(self, axis: str, offset: int, size_bytes: int, *, is_async: bool = False, name: str = "") -> int:
        """Append a receive from the peer `offset` steps along `axis` (pp -1: the previous stage)."""
        return self._p2p(NodeKind.RECV, axis, offset, size_bytes, is_async, name)

    def wait(self, index: int, *, name: str = "") -> int:
        """Append a WAIT on the async node `index` and link the two."""
        target = self._nodes[index]
        if not target.get("is_async") or "waited_by" in target:
            raise GraphError(f"node {index} is not an async op awaiting its WAIT")
        target["waited_by"] = len(self._nodes)
        return self._append(kind=NodeKind.WAIT, waits_on=index, name=name)

    def build(self) -> ClassTrace:
        return ClassTrace(nodes=tuple(Node(**fields) for fields in self._nodes))


def representatives(layout: WorldLayout, class_axes: tuple[str, ...]) -> dict[str, int]:
    """Slicing: class name -> the lowest rank of that class, the rank a profiling run executes for real.

    >>> from prism_plugin.topology import MegatronLayout
    >>> representatives(WorldLayout(MegatronLayout(world_size=16, tp=2, pp=2)), ("pp",))
    {'pp=0': 0, 'pp=1': 8}
    """
    graph_axes = [layout.axis(a) for a in class_axes]
    out: dict[str, int] = {}
    for coords in itertools.product(*(range(a.size) for a in graph_axes)):
        name = ",".join(f"{a.name}={c}" for a, c in zip(graph_axes, coords, strict=True)) or "all"
        out[name] = sum(c * a.stride for a, c in zip(graph_axes, coords, strict=True))
    return out


def graph_from_traces(
    layout: WorldLayout,
    class_axes: tuple[str, ...],
    traces: Mapping[int, ClassTrace],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> ExecutionGraph:
    """The execution graph from one captured trace per class, keyed by the rank that produced it.

    Every class needs exactly one trace; the error names the ranks still to profile.
    """
    reps = representatives(layout, class_axes)
    classes: dict[str, ClassTrace] = {}
    for rank, trace in traces.items():
        name = rule_class_name(layout, class_axes, rank)
        if name in classes:
            raise GraphError(f"two traces for class {name!r} (rank {rank} and another): pass one per class")
        classes[name] = trace
    missing = {name: rank for name, rank in reps.items() if name not in classes}
    if missing:
        raise GraphError(
            f"no trace for classes {sorted(missing)}: profile e.g. ranks {sorted(missing.values())}"
        )
    return ExecutionGraph(
        layout=layout, class_axes=tuple(class_axes), classes=classes, metadata=metadata or {}
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ConcreteOp:
    """One node of a class trace relabelled for a concrete rank."""

    index: int
    """Node index in the class trace."""
    node: Node
    group_ranks: tuple[int, ...] = ()
    """COLLECTIVE: the global ranks of the group instance (ascending)."""
    peer_rank: int = -1
    """SEND/RECV: the global rank of the peer."""


def instantiate_rank(graph: ExecutionGraph, rank: int) -> list[ConcreteOp]:
    """The ops `rank` runs, with group roles and relative peers resolved through the layout.

    >>> from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph
    >>> g = build_1f1b_graph(SyntheticJob(tp=2, pp=2, dp=2, num_microbatches=2, fwd_us=1.0, bwd_us=2.0,
    ...                                   activation_bytes=8, grad_bytes=8))
    >>> [op.group_ranks for op in instantiate_rank(g, 5) if op.node.group == "dp"]
    [(5, 7)]
    """
    layout = graph.layout
    out: list[ConcreteOp] = []
    for i, node in enumerate(graph.trace_of(rank).nodes):
        if node.kind is NodeKind.COLLECTIVE:
            out.append(ConcreteOp(index=i, node=node, group_ranks=layout.group_of(rank, node.group)))
        elif node.kind in (NodeKind.SEND, NodeKind.RECV):
            peer = layout.peer_of(rank, node.peer_axis, node.peer_offset)
            out.append(ConcreteOp(index=i, node=node, peer_rank=peer))
        else:
            out.append(ConcreteOp(index=i, node=node))
    return out
