"""Steady-state replay: consecutive iterations, per-rank step times, and virtual arrivals for live ranks.

A single-iteration replay starts every rank at time 0. A training job does not: in 1F1B the last stage
finishes its iteration one backward pass before the first stage and is already waiting in the next one.
`unroll` chains `iterations` copies of every class trace (sequence numbers continue, as on a live group),
so the last copy sees each rank start when it finished the previous copy, which is what a rank that marks
its iterations measures. From that replay:

- a rank's *step time* is the time between the ends of its last two copies (the job's period in steady
  state); `SteadyState.step_us` is the largest over ranks;
- `ArrivalTable.for_rank` gives, for every communication op of a live (real) rank, when its virtual
  partners arrive at it, as an offset from *that rank's* iteration start (the end of its previous copy):
  what `prism_plugin.runtime.arrivals` adds to the rank's own iteration anchor.

Limitation: steady state is assumed reached after ``iterations - 1`` copies (2 copies suffice for 1F1B
and for jobs whose iterations end with a collective over every rank; 3 is the default).

The *sampled* replay (`sampled_steps`): a graph built from traces keeps each compute span's duration in
every traced iteration (`Node.samples_us`). A replay of the means predicts the step of a job whose spans
never vary; when they do, the waits of a pipeline or a collective take the later of its members' spans, and
the mean of a max exceeds the max of the means. Replaying the traced iterations one after another, each
with its own spans (the k-th sample of every span, so spans that varied together in the traced run vary
together here), predicts the mean step of the varying job. Measured (Megatron pp=2 on this machine's CPU,
compute varying by ~20% per span): real 266.7 ms, replay of the means 254.3 ms (-4.6%), mean of
per-iteration replays 262.6 ms (-1.5%).

Pure: no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.config.errors import positive_int
from prism_plugin.config.faults import FaultSpec
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost.model import CostModel
from prism_plugin.graph.build import instantiate_rank
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.replay import ReplayResult, replay
from prism_plugin.graph.result import RankBreakdown
from prism_plugin.graph.schema import ClassTrace, ExecutionGraph, Node, NodeKind

__all__ = ["ArrivalTable", "SampledSteps", "SteadyState", "sampled_steps", "steady_state", "unroll"]

_P2P = (NodeKind.SEND, NodeKind.RECV)


def _channel(graph: ExecutionGraph, node: Node) -> tuple[Any, ...]:
    if node.kind is NodeKind.COLLECTIVE:
        return ("c", node.group)
    size = graph.layout.axis(node.peer_axis).size
    return (node.kind, node.peer_axis, node.peer_offset % size)


def _counts(graph: ExecutionGraph, trace: ClassTrace) -> dict[tuple[Any, ...], int]:
    counts: dict[tuple[Any, ...], int] = {}
    for node in trace.nodes:
        if node.kind.is_comm:
            key = _channel(graph, node)
            counts[key] = counts.get(key, 0) + 1
    return counts


def unroll(graph: ExecutionGraph, iterations: int, *, sampled: bool = False) -> ExecutionGraph:
    """`graph` with every class trace repeated `iterations` times (seq numbers and wait links shifted).

    `sampled`: copy c's compute spans take their ``(c - 1) mod K``-th sample (K samples per span; copy 0, the
    warm-in, the last), so copies 1..K replay the traced iterations in order. Spans without samples keep
    their duration.
    """
    positive_int("iterations", iterations, hint="an int >= 1 (chained copies of the iteration)", error=GraphError)
    if iterations == 1 and not sampled:
        return graph
    classes: dict[str, ClassTrace] = {}
    for name, trace in graph.classes.items():
        counts = _counts(graph, trace)
        n = len(trace.nodes)
        nodes: list[Node] = []
        for copy in range(iterations):
            for node in trace.nodes:
                fields = node.to_dict()
                samples = fields.pop("samples_us", None)
                if sampled and samples:
                    fields["duration_us"] = samples[(copy - 1) % len(samples)]
                if node.kind.is_comm:
                    fields["seq"] = node.seq + copy * counts[_channel(graph, node)]
                if node.waited_by >= 0:
                    fields["waited_by"] = node.waited_by + copy * n
                if node.waits_on >= 0:
                    fields["waits_on"] = node.waits_on + copy * n
                nodes.append(Node.from_dict(fields))
        classes[name] = ClassTrace(nodes=tuple(nodes))
    meta = {**graph.metadata, "unrolled_iterations": iterations, "sampled": sampled}
    return ExecutionGraph(layout=graph.layout, class_axes=graph.class_axes, classes=classes,
                          overrides=graph.overrides, metadata=meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class SteadyState:
    """A replay of `iterations` chained copies; queries are about the last copy."""

    graph: ExecutionGraph
    """The graph as given (one iteration)."""
    result: ReplayResult
    """The replay of the unrolled graph."""
    iterations: int

    def _bounds(self, rank: int) -> tuple[float, float, int]:
        n = len(self.graph.trace_of(rank).nodes)
        spans = self.result.op_spans(rank)
        last = spans[-1].end_us
        start = spans[(self.iterations - 1) * n - 1].end_us if self.iterations > 1 else 0.0
        return start, last, n

    def rank_step_us(self, rank: int) -> float:
        """`rank`'s step time: end of its last copy minus end of the one before (single copy: its finish)."""
        start, last, _ = self._bounds(rank)
        return last - start

    @property
    def step_us(self) -> float:
        """The job's step time: the largest step time of any rank (one rank per replayed actor)."""
        return max(self.rank_step_us(a.rep_rank) for a in self.result.space.actors)

    def iteration_start_us(self, rank: int) -> float:
        """When `rank` begins its last copy, on the replay's clock."""
        return self._bounds(rank)[0]

    def breakdown(self, rank: int) -> RankBreakdown:
        """Compute, exposed communication and bubble of `rank`'s last copy (they sum to its step time)."""
        start, last, n = self._bounds(rank)
        spans = self.result.op_spans(rank)[(self.iterations - 1) * n:]
        by_index = {s.index: s for s in spans}
        compute = exposed = bubble = 0.0
        for s in spans:
            node = s.node
            if node.kind is NodeKind.COMPUTE:
                compute += s.end_us - s.start_us
                continue
            if node.kind is NodeKind.WAIT:
                held_from, op = s.issue_us, by_index[node.waits_on]
            elif node.kind.is_comm and not node.is_async:
                held_from, op = s.issue_us, s
            else:
                continue
            held_to = s.end_us
            idle = max(0.0, min(op.ready_us, held_to) - held_from)
            bubble += idle
            exposed += max(0.0, held_to - held_from - idle)
        return RankBreakdown(iteration_us=last - start, compute_us=compute, exposed_comm_us=exposed,
                             bubble_us=bubble)


def steady_state(graph: ExecutionGraph, cost: CostModel, *, iterations: int = 3,
                 stragglers: Mapping[int, float] | None = None,
                 faults: Sequence[FaultSpec] | None = None) -> SteadyState:
    """Replay `iterations` chained copies of `graph` (see the module docstring); `faults`: see `replay`."""
    result = replay(unroll(graph, iterations), cost, stragglers=stragglers, faults=faults)
    return SteadyState(graph=graph, result=result, iterations=iterations)


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledSteps:
    """The replay of a graph's traced iterations one after another (module docstring: sampled replay)."""

    iterations: int
    """Traced iterations replayed (the samples per span)."""
    rank_steps_us: Mapping[int, tuple[float, ...]]
    """Each replayed actor's representative rank -> its step time in each replayed iteration, in order."""

    def mean_step_us(self, rank: int | None = None) -> float:
        """`rank`'s mean step time; None: the largest over ranks (the job's)."""
        if rank is not None:
            return math.fsum(self.rank_steps_us[rank]) / self.iterations
        return max(self.mean_step_us(r) for r in self.rank_steps_us)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: iterations, the job's mean step and the median / 90th percentile of its ranks' steps."""
        slowest = max(self.rank_steps_us, key=self.mean_step_us)
        steps = sorted(self.rank_steps_us[slowest])
        return {"iterations": self.iterations, "rank": slowest, "step_us_mean": round(self.mean_step_us(), 3),
                "step_us_median": round(statistics.median(steps), 3),
                "step_us_p90": round(steps[min(len(steps) - 1, math.ceil(0.9 * len(steps)) - 1)], 3),
                "step_us_min": round(steps[0], 3), "step_us_max": round(steps[-1], 3)}


def sampled_steps(graph: ExecutionGraph, cost: CostModel, *, stragglers: Mapping[int, float] | None = None,
                  faults: Sequence[FaultSpec] | None = None) -> SampledSteps:
    """Replay the K traced iterations of `graph` in order, after a warm-in copy (module docstring).

    Raises GraphError when the graph carries no samples (built without traces: synthetic, or an old file).
    """
    k = max((t.sample_count for t in graph.classes.values()), default=0)
    if k < 2:
        raise GraphError("the graph carries no per-iteration compute samples (samples_us): build it from "
                         "traces of at least 2 steady iterations with `prism graph build`")
    result = replay(unroll(graph, k + 1, sampled=True), cost, stragglers=stragglers, faults=faults)
    steps: dict[int, tuple[float, ...]] = {}
    for actor in result.space.actors:
        r = actor.rep_rank
        n = len(graph.trace_of(r).nodes)
        spans = result.op_spans(r)
        ends = [spans[(c + 1) * n - 1].end_us for c in range(k + 1)]
        steps[r] = tuple(ends[c] - ends[c - 1] for c in range(1, k + 1))
    return SampledSteps(iterations=k, rank_steps_us=steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrivalTable:
    """When a live rank's virtual partners arrive at each of its ops, in us from the rank's iteration start.

    `collectives[(role, k)] = (op, offset)`: the k-th collective (from 0) on group role `role` in an iteration;
    `p2p[(kind, peer, k)] = offset`: the k-th SEND to / RECV from global rank `peer`. The offset is the latest
    arrival of a virtual member (real members' arrivals are observed live); an op whose members are all real
    is absent.
    """

    rank: int
    collectives: Mapping[tuple[str, int], tuple[OpKind, float]]
    p2p: Mapping[tuple[OpKind, int, int], float]
    step_us: float
    """The job's predicted steady-state step time."""
    rank_step_us: float
    """This rank's predicted step time."""

    @classmethod
    def for_rank(cls, state: SteadyState, rank: int, real_ranks: Collection[int]) -> ArrivalTable:
        graph, result = state.graph, state.result
        real = set(real_ranks)
        space = result.space
        base = state.iteration_start_us(rank)
        last = state.iterations - 1
        trace = graph.trace_of(rank)
        counts = _counts(graph, trace)
        role_actors: dict[str, list[int]] = {}
        collectives: dict[tuple[str, int], tuple[OpKind, float]] = {}
        p2p: dict[tuple[OpKind, int, int], float] = {}
        for op in instantiate_rank(graph, rank):
            node = op.node
            if not node.kind.is_comm:
                continue
            seq = node.seq + last * counts[_channel(graph, node)]
            if node.kind is NodeKind.COLLECTIVE:
                reps = role_actors.get(node.group)
                if reps is None:
                    seen: dict[int, int] = {}
                    for m in op.group_ranks:
                        if m not in real:
                            seen.setdefault(space.actor_of(m).index, m)
                    reps = role_actors[node.group] = list(seen.values())
                if reps:
                    t = max(result.arrival_offset_us(m, node.group, seq) for m in reps)
                    assert node.op is not None
                    collectives[(node.group, node.seq)] = (node.op, t - base)
            elif op.peer_rank not in real:
                other = NodeKind.RECV if node.kind is NodeKind.SEND else NodeKind.SEND
                t = result.p2p_arrival_offset_us(op.peer_rank, other, rank, seq)
                kind = OpKind.SEND if node.kind is NodeKind.SEND else OpKind.RECV
                p2p[(kind, op.peer_rank, node.seq)] = t - base
        step = state.step_us
        rank_step = state.rank_step_us(rank)
        for v in (step, rank_step):
            assert math.isfinite(v)
        return cls(rank=rank, collectives=collectives, p2p=p2p, step_us=step, rank_step_us=rank_step)
