"""Execution-graph schema: class traces, the world layout and the rank -> class rule (DESIGN.md section 6).

An `ExecutionGraph` describes one training iteration of all N ranks without storing N traces: the ranks
fall into a few *classes* (by default one per pipeline stage), each class has one `ClassTrace` (the ordered
ops of one representative rank), and the rank -> class rule is "the rank's coordinates on `class_axes`".
Symmetric replicas are implicit; `overrides` lists the few ranks that differ (asymmetric what-ifs).

Node kinds form a small closed enum (Chakra-like): COMPUTE, COLLECTIVE, SEND, RECV, WAIT. A trace refers
to groups and peers *relative to its rank*: a collective names a group role (a Megatron axis token such as
"dp", "tp" or "tp-dp"), a send/recv names an axis and an offset along it (pp +1 = the next stage, wrapping
as Megatron's pipeline ring does), so one trace serves every rank of its class.

JSON file (``save`` / ``load``), version 1; units are in the field names::

    {
      "format": "prism-execution-graph", "version": 1,
      "layout": {"kind": "megatron", "world_size": 8192, "tp": 8, "pp": 16, "cp": 1, "ep": 1,
                 "expert_tp": 8, "order": "tp-cp-ep-dp-pp"},
      "class_axes": ["pp"],
      "classes": {"pp=0": {"nodes": [NODE, ...]}, "pp=1": {...}, ...},
      "overrides": {"17": {"class_name": "pp=0", "compute_scale": 1.5}},
      "metadata": {"builder": "synthetic_1f1b", ...}
    }

A NODE is an object holding "kind" and only its non-default fields:

    kind          "compute" | "collective" | "send" | "recv" | "wait"
    name          free label ("fwd mb3")                                    default ""
    duration_us   compute time in microseconds                (compute)     default 0.0
    op            OpKind value, e.g. "all_reduce"             (collective)
    size_bytes    bytes as the cost model counts them         (comm)        default 0
    group         group role, an axis token, e.g. "dp"        (collective)
    seq           0, 1, 2, ... within the group role (collective) or within the channel
                  (send/recv: kind, peer_axis, peer_offset mod axis size)   (comm)
    peer_axis     axis of the peer, e.g. "pp"                 (send/recv)
    peer_offset   peer = own coordinate + offset, mod axis size (send/recv)
    is_async      the rank goes on after issuing it; a WAIT blocks on it     default false
    waited_by     index of the WAIT node for this async op                   default -1
    waits_on      index of the async node this WAIT blocks on   (wait)       default -1
    samples_us    the span's duration in each traced iteration (compute)     default [] (optional)

Non-goals: expert-parallel groups (roles over the expert grid), DeepSpeed layouts, and iterations whose
ops differ (a class trace is one iteration's ops; ``samples_us`` only says how long each compute span took
in each traced iteration) are not represented yet; unknown kinds and fields are rejected, never skipped.

Pure: stdlib and prism_plugin.topology / kinds only.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from prism_plugin.config.errors import coerce_enum
from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.layout import AxisSpec, WorldLayout

__all__ = [
    "FORMAT_NAME",
    "SCHEMA_VERSION",
    "AxisSpec",
    "ClassTrace",
    "ExecutionGraph",
    "Node",
    "NodeKind",
    "RankOverride",
    "WorldLayout",
    "rule_class_name",
]

FORMAT_NAME = "prism-execution-graph"
SCHEMA_VERSION = 1


class NodeKind(StrEnum):
    """The closed set of node kinds of a class trace."""

    COMPUTE = "compute"
    COLLECTIVE = "collective"
    SEND = "send"
    RECV = "recv"
    WAIT = "wait"

    @property
    def is_comm(self) -> bool:
        return self in (NodeKind.COLLECTIVE, NodeKind.SEND, NodeKind.RECV)


_P2P = (NodeKind.SEND, NodeKind.RECV)


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One op of a class trace; which fields matter depends on `kind` (see the module docstring).

    Example: ``Node(kind=NodeKind.COLLECTIVE, op=OpKind.ALL_REDUCE, group="dp", seq=0, size_bytes=2**30)``.
    """

    kind: NodeKind
    """What the node is."""
    name: str = ""
    """Free label shown in timelines, e.g. "fwd mb3"."""
    duration_us: float = 0.0
    """COMPUTE: time on the rank, in microseconds."""
    op: OpKind | None = None
    """COLLECTIVE: which collective (not SEND/RECV: those are node kinds)."""
    size_bytes: int = 0
    """Communication nodes: bytes as `CostModel` counts them for `op` (the message for send/recv)."""
    group: str = ""
    """COLLECTIVE: group role relative to the rank, an axis token such as "dp", "tp" or "tp-dp"."""
    seq: int = -1
    """Communication nodes: index of this op within its group role (or p2p channel), from 0."""
    peer_axis: str = ""
    """SEND/RECV: the axis along which the peer lies, e.g. "pp"."""
    peer_offset: int = 0
    """SEND/RECV: the peer's coordinate minus this rank's, wrapping modulo the axis size (pp: +1 / -1)."""
    is_async: bool = False
    """Communication nodes: the rank goes on after issuing; the WAIT at `waited_by` blocks on it."""
    waited_by: int = -1
    """Async communication nodes: index of the WAIT node that blocks on this one."""
    waits_on: int = -1
    """WAIT: index of the async node it blocks on (an earlier node of the same trace)."""
    samples_us: tuple[float, ...] = ()
    """COMPUTE, optional: the span's duration in each traced iteration it was averaged from (in order);
    `duration_us` is their mean. The sampled replay (`prism_plugin.graph.steady.sampled_steps`) replays
    iteration k with the k-th sample of every span."""

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not NodeKind:
            try:
                kind = NodeKind(kind)
            except ValueError:
                raise GraphError(
                    f"node kind {kind!r} is unknown: use one of {[k.value for k in NodeKind]}"
                ) from None
            object.__setattr__(self, "kind", kind)
        where = f"{kind.value} node {self.name!r}"
        if self.op is not None and type(self.op) is not OpKind:
            object.__setattr__(self, "op", coerce_enum(OpKind, self.op, f"{where}: op", error=GraphError))
        if kind is NodeKind.COMPUTE:
            d = self.duration_us
            if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or d < 0:
                raise GraphError(f"{where}: duration_us={d!r} must be a finite number >= 0")
            object.__setattr__(self, "duration_us", float(d))
        elif self.duration_us != 0.0:
            raise GraphError(f"{where}: only compute nodes have duration_us; drop it")
        if self.samples_us:
            if kind is not NodeKind.COMPUTE:
                raise GraphError(f"{where}: only compute nodes have samples_us; drop it")
            samples = tuple(self.samples_us)
            if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                       for x in samples):
                raise GraphError(f"{where}: samples_us must be finite numbers >= 0")
            object.__setattr__(self, "samples_us", tuple(float(x) for x in samples))
        if kind.is_comm:
            if (
                isinstance(self.size_bytes, bool)
                or not isinstance(self.size_bytes, int)
                or self.size_bytes < 0
            ):
                raise GraphError(f"{where}: size_bytes={self.size_bytes!r} must be an int >= 0")
            if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
                raise GraphError(f"{where}: seq={self.seq!r} must be an int >= 0 (index within its group)")
            if self.is_async != (self.waited_by >= 0):
                raise GraphError(
                    f"{where}: an async node needs waited_by (the index of its WAIT), a blocking one none; "
                    f"got is_async={self.is_async}, waited_by={self.waited_by}"
                )
        elif self.is_async or self.waited_by >= 0 or self.seq != -1 or self.size_bytes:
            raise GraphError(
                f"{where}: is_async, waited_by, seq and size_bytes belong to communication nodes"
            )
        if kind is NodeKind.COLLECTIVE:
            if self.op is None or self.op.is_p2p:
                raise GraphError(f"{where}: op={self.op!r} must be a collective OpKind such as 'all_reduce'")
            if not self.group:
                raise GraphError(f"{where}: group must name a group role, e.g. 'dp'")
        elif self.op is not None or self.group:
            raise GraphError(f"{where}: op and group belong to collective nodes (send/recv are node kinds)")
        if kind in _P2P:
            if (
                not self.peer_axis
                or isinstance(self.peer_offset, bool)
                or not isinstance(self.peer_offset, int)
            ):
                raise GraphError(f"{where}: needs peer_axis (e.g. 'pp') and an int peer_offset (e.g. +1)")
        elif self.peer_axis or self.peer_offset:
            raise GraphError(f"{where}: peer_axis and peer_offset belong to send/recv nodes")
        if (kind is NodeKind.WAIT) != (self.waits_on >= 0):
            raise GraphError(f"{where}: waits_on (an earlier node index) is required on WAIT nodes only")

    @property
    def stream(self) -> str:
        """The timeline row the node runs on: "compute" (compute, waits), "comm <role>", "p2p <axis>"."""
        if self.kind is NodeKind.COLLECTIVE:
            return f"comm {self.group}"
        if self.kind in _P2P:
            return f"p2p {self.peer_axis}"
        return "compute"

    def label(self) -> str:
        """Short description for timelines and error messages, e.g. "all_reduce dp#0"."""
        if self.kind is NodeKind.COLLECTIVE:
            assert self.op is not None
            text = f"{self.op.value} {self.group}#{self.seq}"
        elif self.kind in _P2P:
            text = f"{self.kind.value} {self.peer_axis}{self.peer_offset:+d}#{self.seq}"
        elif self.kind is NodeKind.WAIT:
            text = f"wait node {self.waits_on}"
        else:
            text = "compute"
        return f"{text} ({self.name})" if self.name else text

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        for f in fields(Node)[1:]:
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) \
                    else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Node:
        unknown = set(data) - _NODE_FIELDS
        if unknown:
            raise GraphError(f"node has unknown field(s) {sorted(unknown)}; known: {sorted(_NODE_FIELDS)}")
        if "kind" not in data:
            raise GraphError(f"node {dict(data)!r} has no 'kind'")
        return cls(**data)


_NODE_FIELDS = frozenset(f.name for f in fields(Node))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassTrace:
    """The ordered ops of one representative rank of a class, for one iteration.

    Checked at construction: every async node is waited on by exactly the WAIT it names, WAITs come after
    their op, and collective sequence numbers count 0, 1, 2, ... within each group role.
    """

    nodes: tuple[Node, ...]
    """The ops, in the order the rank issues them."""

    @property
    def sample_count(self) -> int:
        """How many traced iterations its compute spans carry (`Node.samples_us`); 0: means only."""
        return next((len(n.samples_us) for n in self.nodes if n.samples_us), 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        counts = {len(n.samples_us) for n in self.nodes if n.samples_us}
        if len(counts) > 1:
            raise GraphError(f"compute nodes carry samples_us of different lengths {sorted(counts)}: one sample "
                             "per traced iteration, the same iterations for every span")
        next_seq: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if not isinstance(node, Node):
                raise GraphError(f"node {i} is {type(node).__name__}, not a Node")
            if node.kind is NodeKind.WAIT:
                j = node.waits_on
                if j >= i or not self.nodes[j].is_async or self.nodes[j].waited_by != i:
                    raise GraphError(
                        f"node {i} ({node.label()}) waits on node {j}, which must be an earlier async node "
                        f"with waited_by={i}"
                    )
            elif node.is_async and not (
                i < node.waited_by < len(self.nodes) and self.nodes[node.waited_by].waits_on == i
            ):
                raise GraphError(
                    f"node {i} ({node.label()}) is async with waited_by={node.waited_by}, which is not a "
                    f"later WAIT node with waits_on={i}: every async op must be waited on"
                )
            if node.kind is NodeKind.COLLECTIVE:
                expected = next_seq.get(node.group, 0)
                if node.seq != expected:
                    raise GraphError(
                        f"node {i} ({node.label()}) has seq={node.seq}, expected {expected}: sequence "
                        f"numbers count 0, 1, 2, ... within each group role"
                    )
                next_seq[node.group] = expected + 1

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def total_compute_us(self) -> float:
        return sum(n.duration_us for n in self.nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankOverride:
    """An asymmetric what-if for one rank: another class trace and/or slower compute.

    Example: ``RankOverride(compute_scale=1.5)`` makes that rank's compute 50% slower (a straggler).
    """

    class_name: str = ""
    """The class trace this rank runs instead of its own; "" keeps the class the rule gives."""
    compute_scale: float = 1.0
    """Factor on every compute duration of this rank (> 0); 1.0 changes nothing."""

    def __post_init__(self) -> None:
        s = self.compute_scale
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
            raise GraphError(f"compute_scale={s!r} must be a finite number > 0 (1.5 = 50% slower)")
        object.__setattr__(self, "compute_scale", float(s))


def _class_name(names: Sequence[str], coords: Sequence[int]) -> str:
    return ",".join(f"{n}={c}" for n, c in zip(names, coords, strict=True)) or "all"


def rule_class_name(layout: WorldLayout, class_axes: Sequence[str], rank: int) -> str:
    """The class the rule "coordinates on `class_axes`" gives `rank`, e.g. "pp=3" (or "all" for no axes).

    >>> from prism_plugin.topology import MegatronLayout
    >>> rule_class_name(WorldLayout(MegatronLayout(world_size=16, tp=2, pp=2)), ("pp",), 13)
    'pp=1'
    """
    coords = layout.coords(rank)
    return _class_name(class_axes, [coords[layout.axis_index(a)] for a in class_axes])


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionGraph:
    """All N ranks' ops for one iteration: class traces + the rank -> class rule + per-rank overrides.

    The class of a rank is named by its coordinates on `class_axes`: with class_axes=("pp",) rank r is in
    class "pp=<its stage>" (class_axes=() puts every rank in class "all"), unless `overrides` says otherwise.
    """

    layout: WorldLayout
    """The virtual world's rank grid."""
    class_axes: tuple[str, ...]
    """Axes whose coordinates name a rank's class, e.g. ("pp",): one class per pipeline stage."""
    classes: Mapping[str, ClassTrace]
    """Class name -> its trace; every name the rule can produce must be present."""
    overrides: Mapping[int, RankOverride] = field(default_factory=dict)
    """Global rank -> what-if for that rank (asymmetric jobs); every other rank follows the rule."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free JSON-compatible provenance (builder, parameters, profile used to capture)."""
    version: int = SCHEMA_VERSION
    """Schema version of the file this graph was read from or will be written as."""

    def __post_init__(self) -> None:
        if self.version != SCHEMA_VERSION:
            raise GraphError(
                f"execution graph version {self.version} is not supported (this is {SCHEMA_VERSION})"
            )
        object.__setattr__(self, "class_axes", tuple(self.class_axes))
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        layout = self.layout
        for name in self.class_axes:
            layout.axis(name)
        if len(set(self.class_axes)) != len(self.class_axes):
            raise GraphError(f"class_axes={self.class_axes} repeats an axis")
        missing = [n for n in self.rule_class_names() if n not in self.classes]
        if missing:
            raise GraphError(
                f"classes {missing[:8]} have no trace: profile one representative rank of each "
                "(see build.representatives) or change class_axes"
            )
        for rank, override in self.overrides.items():
            layout.coords(rank)
            if not isinstance(override, RankOverride):
                raise GraphError(f"override of rank {rank} must be a RankOverride")
            if override.class_name and override.class_name not in self.classes:
                raise GraphError(f"override of rank {rank} names unknown class {override.class_name!r}")
        for name, trace in self.classes.items():
            self._check_trace(name, trace)

    def _check_trace(self, name: str, trace: ClassTrace) -> None:
        if not isinstance(trace, ClassTrace):
            raise GraphError(f"class {name!r} maps to {type(trace).__name__}, not a ClassTrace")
        next_seq: dict[tuple[NodeKind, str, int], int] = {}
        for i, node in enumerate(trace.nodes):
            if node.kind is NodeKind.COLLECTIVE:
                self.layout.role_axes(node.group)
            elif node.kind in _P2P:
                size = self.layout.axis(node.peer_axis).size
                channel = (node.kind, node.peer_axis, node.peer_offset % size)
                if channel[2] == 0:
                    raise GraphError(
                        f"class {name!r} node {i} ({node.label()}) sends to itself: peer_offset "
                        f"{node.peer_offset} is 0 modulo the {node.peer_axis} size {size}"
                    )
                expected = next_seq.get(channel, 0)
                if node.seq != expected:
                    raise GraphError(
                        f"class {name!r} node {i} ({node.label()}) has seq={node.seq}, expected {expected}: "
                        f"send/recv seq counts 0, 1, 2, ... per (kind, axis, offset mod axis size)"
                    )
                next_seq[channel] = expected + 1

    def rule_class_names(self) -> list[str]:
        """Every class name the rule produces (one per combination of class-axis coordinates)."""
        sizes = [range(self.layout.axis(a).size) for a in self.class_axes]
        return [_class_name(self.class_axes, c) for c in itertools.product(*sizes)]

    def rule_class_of(self, rank: int) -> str:
        """The class the rule gives `rank` (ignoring overrides)."""
        return rule_class_name(self.layout, self.class_axes, rank)

    def class_of(self, rank: int) -> str:
        """The class `rank` runs: its override's class if it has one, else the rule's."""
        override = self.overrides.get(rank)
        if override is not None and override.class_name:
            return override.class_name
        return self.rule_class_of(rank)

    def trace_of(self, rank: int) -> ClassTrace:
        return self.classes[self.class_of(rank)]

    def compute_scale_of(self, rank: int) -> float:
        override = self.overrides.get(rank)
        return 1.0 if override is None else override.compute_scale

    def with_overrides(self, overrides: Mapping[int, RankOverride]) -> ExecutionGraph:
        """A copy with `overrides` added (replacing any earlier override of the same rank)."""
        return ExecutionGraph(
            layout=self.layout,
            class_axes=self.class_axes,
            classes=self.classes,
            overrides={**self.overrides, **overrides},
            metadata=self.metadata,
        )

    # -- JSON ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "layout": self.layout.to_dict(),
            "class_axes": list(self.class_axes),
            "classes": {name: {"nodes": [n.to_dict() for n in t.nodes]} for name, t in self.classes.items()},
            "overrides": {
                str(rank): {"class_name": o.class_name, "compute_scale": o.compute_scale}
                for rank, o in sorted(self.overrides.items())
            },
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutionGraph:
        if data.get("format") != FORMAT_NAME:
            raise GraphError(
                f"not an execution graph: 'format' is {data.get('format')!r}, not {FORMAT_NAME!r}"
            )
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise GraphError(
                f"execution graph version {version!r} is not supported (this is {SCHEMA_VERSION})"
            )
        try:
            classes = {
                name: ClassTrace(nodes=tuple(Node.from_dict(n) for n in body["nodes"]))
                for name, body in data["classes"].items()
            }
            return cls(
                layout=WorldLayout.from_dict(data["layout"]),
                class_axes=tuple(data["class_axes"]),
                classes=classes,
                overrides={int(r): RankOverride(**o) for r, o in data.get("overrides", {}).items()},
                metadata=data.get("metadata", {}),
                version=version,
            )
        except KeyError as exc:
            raise GraphError(f"execution graph is missing field {exc}") from None
        except (TypeError, AttributeError) as exc:  # a field of the wrong JSON type
            raise GraphError(f"execution graph has a malformed field ({exc})") from None
        except ValueError as exc:  # the layout's own checks (prism_plugin.topology)
            if isinstance(exc, GraphError):
                raise
            raise GraphError(f"execution graph layout: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write the graph as compact JSON (see the module docstring); returns the path."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ExecutionGraph:
        """Read a graph file; every refusal is a `GraphError` naming the file ("graph file job.graph: ...")."""
        where = f"graph file {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise GraphError(f"{where}: cannot be read ({exc.strerror or exc}); build one with `prism graph "
                             "build`") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise GraphError(f"{where}: not JSON ({exc}); write it with `prism graph build`") from None
        if not isinstance(data, Mapping):
            raise GraphError(f"{where}: not an execution graph: a JSON object is expected, got "
                             f"{type(data).__name__}")
        try:
            return cls.from_dict(data)
        except GraphError as exc:
            raise GraphError(f"{where}: {exc}") from None
