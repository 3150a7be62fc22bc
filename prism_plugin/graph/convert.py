"""From raw rank traces to class traces and an execution graph (trace capture -> slicing -> graph).

A raw `RankTrace` names groups by global ranks and peers by global rank; a `ClassTrace` names them relative
to the rank (a group role such as "dp", a peer offset along an axis) so one trace serves every rank of its
class. `class_trace` resolves both through the layout, rebuilds the rank's timeline from the op times and
averages the compute spans over the steady-state iterations.

Timeline rules (per iteration; times are the wall clock of the traced rank):

- a span of *compute* is the time between communication calls in which the rank was not held by an op:
  from the return of a blocking op (or the end of a wait, or the issue of an async op: its issue call is
  CPU work) to the next call;
- an op the program waits on right after issuing it, with no other op or wait in between, is *blocking*
  (torch's ``async_op=False`` path issues then waits); when the median time between the call's return and
  the wait exceeds `blocking_gap_us`, it is kept as async + that compute + WAIT instead;
- any other op is *async*, with a WAIT node where the program first waited on it; an op not waited on
  within its iteration gets a WAIT at the iteration's end (the rank does not go past an iteration holding
  an unfinished op in the replay).

Iterations: the first `warmup` are dropped, and of the rest only those with the most common op structure
are used (an iteration with an extra logging collective, say, is left out and counted). Each compute span
is the mean over those iterations.

Limitations: groups must be groups of the dense layout, Megatron's embedding group over the first and last
stages (`EMBEDDING_ROLE`) or groups of its expert grid (`EXPERT_PREFIX`); any other subgroup raises GraphError
naming it; two live groups over the same
ranks (e.g. "dp" and "dp-cp" with cp=1) share one role and one sequence.

Pure: no torch.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.build import TraceBuilder
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.layout import EMBEDDING_ROLE
from prism_plugin.graph.rank_trace import RankTrace, TracedIteration
from prism_plugin.graph.schema import ClassTrace, ExecutionGraph, WorldLayout, rule_class_name

__all__ = ["ConversionReport", "class_trace", "graph_from_rank_traces", "group_role", "peer_step"]

DEFAULT_BLOCKING_GAP_US = 100.0


def group_role(layout: WorldLayout, rank: int, ranks: Sequence[int] | None) -> str:
    """The group role (axis token) whose group holding `rank` is exactly `ranks` (None: every rank).

    The role names the axes along which the members' coordinates vary, in layout order.

    >>> from prism_plugin.topology import MegatronLayout
    >>> w = WorldLayout(MegatronLayout(world_size=16, tp=2, pp=2))
    >>> group_role(w, 5, [1, 3, 5, 7]), group_role(w, 5, None), group_role(w, 5, [5])
    ('dp', 'tp-dp-pp', 'cp')
    """
    members = tuple(range(layout.world_size)) if ranks is None else tuple(sorted(ranks))
    if rank not in members:
        raise GraphError(f"rank {rank} is not a member of group {list(members)[:16]}")
    if len(members) == 1:
        for axis in layout.axes:
            if axis.size == 1:
                return axis.name
        raise GraphError(f"rank {rank}'s one-member group has no role: every axis of the layout is > 1")
    own = layout.coords(rank)
    varying = [False] * len(layout.axes)
    for m in members:
        for i, c in enumerate(layout.coords(m)):
            if c != own[i]:
                varying[i] = True
    role = "-".join(a.name for a, v in zip(layout.axes, varying, strict=True) if v)
    pp_ends = (0, layout.axis("pp").size - 1)
    if role == "pp" and len(members) == 2 and pp_ends[1] > 1 \
            and tuple(layout.coords(m)[layout.axis_index("pp")] for m in members) == pp_ends:
        return EMBEDDING_ROLE
    if layout.group_of(rank, role) != members:
        for expert in layout.expert_roles():  # a group of the expert grid that is no dense group
            if layout.group_of(rank, expert) == members:
                return expert
        raise GraphError(
            f"group {list(members)[:16]}{' ...' if len(members) > 16 else ''} of rank {rank} is not a group of "
            f"the layout {_layout_text(layout)}: execution graphs only know groups along layout axes, "
            "Megatron's embedding group over the first and last stages and the expert grid's groups (check that "
            "--layout matches the program's own parallel sizes, --expert-tensor-parallel-size included)"
        )
    return role


def peer_step(layout: WorldLayout, rank: int, peer: int) -> tuple[str, int]:
    """(axis, offset): `peer` is `offset` steps from `rank` along `axis` (the only axis they differ on).

    >>> from prism_plugin.topology import MegatronLayout
    >>> peer_step(WorldLayout(MegatronLayout(world_size=16, tp=2, pp=2)), 5, 13)
    ('pp', 1)
    """
    own, other = layout.coords(rank), layout.coords(peer)
    diff = [i for i, (a, b) in enumerate(zip(own, other, strict=True)) if a != b]
    if len(diff) != 1:
        raise GraphError(
            f"rank {rank} exchanges with rank {peer}, which is not along one axis of the layout "
            f"{_layout_text(layout)} (they differ on {[layout.axes[i].name for i in diff]}): check --layout"
        )
    i = diff[0]
    return layout.axes[i].name, other[i] - own[i]


def _layout_text(layout: WorldLayout) -> str:
    return ",".join(f"{a.name}={a.size}" for a in layout.axes if a.size > 1) or "1 rank"


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionReport:
    """How a raw trace became a class trace."""

    rank: int
    iterations_used: tuple[int, ...]
    """Clock iteration numbers averaged into the class trace."""
    iterations_warmup: int
    iterations_other_structure: tuple[int, ...]
    """Steady iterations left out because their op structure differed from the most common one."""
    step_us_mean: float
    """Mean wall time of the used iterations (what the rank measured)."""
    step_us_stdev: float

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "iterations_used": list(self.iterations_used),
                "iterations_warmup": self.iterations_warmup,
                "iterations_other_structure": list(self.iterations_other_structure),
                "step_us_mean": round(self.step_us_mean, 3), "step_us_stdev": round(self.step_us_stdev, 3)}


# An iteration's timeline: ("c", slot) compute slots and ("i", op) / ("b", op) / ("w", op) events.
_Event = tuple[str, int]


def _timeline(it: TracedIteration) -> tuple[list[_Event], list[float], list[float]]:
    """(events, compute gap before each event and at the end, blocking-candidate inner gaps)."""
    end = it.duration_us
    events: list[tuple[float, int, int]] = []
    for j, op in enumerate(it.ops):
        events.append((op.issue_us, 0, j))
        if op.waited and op.end_us <= end:
            # the issue stamp is the op's arrival (on a virtual GPU its stream's time), the wait stamp the host's
            # call: a host may wait on an op its busy stream has not started (TransformerEngine's context-parallel
            # ring sends, 3.1 ms ahead); the event order needs the issue first, and the rank is held until the end
            events.append((max(op.wait_us, op.issue_us), 1, j))
    events.sort()
    out: list[_Event] = []
    gaps: list[float] = []
    inner: list[float] = []
    cursor = 0.0
    k = 0
    while k < len(events):
        t, what, j = events[k]
        op = it.ops[j]
        gaps.append(max(0.0, t - cursor))
        if what == 0:
            nxt = events[k + 1] if k + 1 < len(events) else None
            if nxt is not None and nxt[1] == 1 and nxt[2] == j:  # waited at once: blocking
                out.append(("b", j))
                inner.append(max(0.0, op.wait_us - op.return_us))
                cursor = max(cursor, op.end_us)
                k += 2
                continue
            out.append(("i", j))
            cursor = max(cursor, t)  # the issue call itself is CPU work: it counts as the next compute
        else:
            out.append(("w", j))
            cursor = max(cursor, op.end_us)
        k += 1
    gaps.append(max(0.0, end - cursor))
    return out, gaps, inner


def _signature(it: TracedIteration, events: list[_Event], resolve: Any) -> tuple[Any, ...]:
    sig: list[tuple[object, ...]] = []
    for what, j in events:
        op = it.ops[j]
        if what == "w":
            sig.append(("w", j))
        else:
            sig.append((what, op.op.value, resolve(op.group, op.peer), op.size_bytes))
    return tuple(sig)


def class_trace(trace: RankTrace, layout: WorldLayout, *, warmup: int = 2,
                blocking_gap_us: float = DEFAULT_BLOCKING_GAP_US) -> tuple[ClassTrace, ConversionReport]:
    """The class trace of `trace`'s rank (relative roles and peers, mean compute spans) and a report.

    Raises GraphError naming the fix when no steady iteration is left or a group is not a layout group.
    """
    if trace.world_size != layout.world_size:
        raise GraphError(
            f"rank {trace.rank}'s trace is of a {trace.world_size}-rank world but the layout has "
            f"{layout.world_size} ranks: pass the job's own --layout"
        )
    if warmup < 0:
        raise GraphError(f"warmup={warmup} must be >= 0 (iterations to drop)")
    steady = trace.iterations[warmup:]
    if not steady:
        raise GraphError(
            f"rank {trace.rank}'s trace has {len(trace.iterations)} iteration(s), none left after dropping "
            f"{warmup} warm-up iteration(s): run more iterations (Megatron's --train-iters, the script's own step "
            "count) or drop fewer (--warmup)"
        )
    roles: dict[int, str] = {}
    steps: dict[int, tuple[str, int]] = {}

    def resolve(group: int, peer: int) -> Any:
        if peer >= 0:
            if peer not in steps:
                steps[peer] = peer_step(layout, trace.rank, peer)
            return steps[peer]
        if group not in roles:
            roles[group] = group_role(layout, trace.rank, trace.groups[group])
        return roles[group]

    parsed = []
    for it in steady:
        events, gaps, inner = _timeline(it)
        parsed.append((it, events, gaps, inner, _signature(it, events, resolve)))
    counts = Counter(p[4] for p in parsed)
    modal = max(counts, key=lambda s: (counts[s], -next(i for i, p in enumerate(parsed) if p[4] == s)))
    used = [p for p in parsed if p[4] == modal]
    other = tuple(p[0].index for p in parsed if p[4] != modal)
    it0, events0 = used[0][0], used[0][1]
    mean_gaps = [statistics.fmean(p[2][k] for p in used) for k in range(len(used[0][2]))]
    median_inner = [statistics.median(p[3][k] for p in used) for k in range(len(used[0][3]))]
    mean_inner = [statistics.fmean(p[3][k] for p in used) for k in range(len(used[0][3]))]

    sizes = {a.name: a.size for a in layout.axes}
    builder = TraceBuilder(axis_sizes=sizes)
    handles: dict[int, int] = {}
    blocking_k = 0

    def add_op(j: int, is_async: bool) -> int:
        op = it0.ops[j]
        key = resolve(op.group, op.peer)
        if op.op is OpKind.SEND:
            return builder.send(key[0], key[1], op.size_bytes, is_async=is_async)
        if op.op is OpKind.RECV:
            return builder.recv(key[0], key[1], op.size_bytes, is_async=is_async)
        return builder.collective(op.op, key, op.size_bytes, is_async=is_async)

    def gap_samples(k: int) -> list[float]:
        return [round(p[2][k], 3) for p in used]  # to the nanosecond: the JSON stays ~9 characters a sample

    for k, (what, j) in enumerate(events0):
        if mean_gaps[k] > 0.0:
            builder.compute(mean_gaps[k], samples_us=gap_samples(k))
        if what == "b":
            if median_inner[blocking_k] > blocking_gap_us:
                h = add_op(j, True)
                builder.compute(mean_inner[blocking_k], samples_us=[round(p[3][blocking_k], 3) for p in used])
                builder.wait(h)
            else:
                add_op(j, False)
            blocking_k += 1
        elif what == "i":
            handles[j] = add_op(j, True)
        else:
            builder.wait(handles.pop(j))
    if mean_gaps[-1] > 0.0:
        builder.compute(mean_gaps[-1], samples_us=gap_samples(len(mean_gaps) - 1))
    for j in sorted(handles):  # not waited on within the iteration
        builder.wait(handles[j], name="implicit wait at iteration end")
    durations = [p[0].duration_us for p in used]
    report = ConversionReport(
        rank=trace.rank,
        iterations_used=tuple(p[0].index for p in used),
        iterations_warmup=min(warmup, len(trace.iterations)),
        iterations_other_structure=other,
        step_us_mean=statistics.fmean(durations),
        step_us_stdev=statistics.stdev(durations) if len(durations) > 1 else 0.0,
    )
    return builder.build(), report


def graph_from_rank_traces(
    traces: Iterable[RankTrace],
    layout: WorldLayout,
    class_axes: Sequence[str] = ("pp",),
    *,
    warmup: int = 2,
    blocking_gap_us: float = DEFAULT_BLOCKING_GAP_US,
    metadata: Mapping[str, Any] | None = None,
) -> ExecutionGraph:
    """The execution graph from the traces of profiling runs: one class trace per class.

    When several traces fall in one class (e.g. two data-parallel replicas were profiled), the lowest rank's
    is used and the others are listed in the metadata. Raises GraphError naming the ranks still to profile.
    """
    by_class: dict[str, list[RankTrace]] = {}
    for t in traces:
        by_class.setdefault(rule_class_name(layout, tuple(class_axes), t.rank), []).append(t)
    classes: dict[str, ClassTrace] = {}
    reports: dict[str, Any] = {}
    unused: list[int] = []
    for name, ts in sorted(by_class.items()):
        ts.sort(key=lambda t: t.rank)
        unused += [t.rank for t in ts[1:]]
        classes[name], report = class_trace(ts[0], layout, warmup=warmup, blocking_gap_us=blocking_gap_us)
        reports[name] = report.to_dict()
    from prism_plugin.graph.build import representatives

    missing = {n: r for n, r in representatives(layout, tuple(class_axes)).items() if n not in classes}
    if missing:
        raise GraphError(
            f"no trace for classes {sorted(missing)}: profile e.g. ranks {sorted(missing.values())} "
            "(`prism slice` lists the profiling runs)"
        )
    first = next(iter(by_class.values()))[0]
    meta = {
        "builder": "rank_traces",
        "warmup": warmup,
        "classes": reports,
        "unused_trace_ranks": unused,
        "capture": {k: first.metadata[k] for k in ("profile", "iteration_marker") if k in first.metadata},
        **(metadata or {}),
    }
    return ExecutionGraph(layout=layout, class_axes=tuple(class_axes), classes=classes, metadata=meta)
