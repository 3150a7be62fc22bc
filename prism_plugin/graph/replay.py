"""Discrete-event replay of an execution graph: every rank's time at every op (DESIGN.md section 6).

Engine (`prism_plugin.graph.engine`, after SimPy's kernel): a heap of ``(time_us, priority, seq, event)``;
`seq` is a counter, so ties resolve in the order events were scheduled and every run is identical. Time
jumps from event to event; nothing is time-stepped. When an op *completes* the actors blocked on it are
released. Errors are never swallowed: an op that can never start raises `ReplayDeadlock` naming the blocked
ranks and ops, members that disagree on an op raise `ReplayMismatch`.

Semantics, per rank (an *actor* replays one block of identical ranks, see `fold`):
- nodes run in trace order, all ranks starting at time 0;
- COMPUTE takes ``duration_us * compute_scale``;
- a COLLECTIVE of group instance I and sequence number k is *ready* when every member has arrived
  (issued it); it starts at ``max(ready, end of op k-1 on I)`` (one communicator runs its ops in order)
  and ends ``CostModel.collective_us_placed(op, size_bytes, placement of I's global ranks)`` later;
- SEND and RECV pair by (src, dst, channel, seq) and end ``CostModel.p2p_us`` after both arrived (and
  after the channel's previous transfer);
- a blocking communication op holds its rank until the op ends; an async one (``is_async``) lets the rank
  go on at once, and the WAIT node named by ``waited_by`` holds the rank until the op ends.

Per rank: iteration time (end of its last node) = compute + exposed communication + bubble, where time
blocked in an op splits into *bubble* (until the last partner arrived: idle, waiting on peers) and
*exposed communication* (the rest: the transfer itself, and queueing behind the communicator's previous op).

Symmetry: `ReplayMode.AUTO` replays one actor per block of ranks with provably identical timelines
(`prism_plugin.graph.fold` states the argument); a symmetric job costs one actor per class, whatever N.
What-ifs (`stragglers`, graph overrides) split only the blocks they touch. `ReplayMode.FULL` replays every
rank (the reference). Limitations: no contention between concurrent ops, compute is not slowed by
overlapping communication, and a straggler's slowdown applies to its compute only.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from prism_plugin.config.faults import FaultSpec
from prism_plugin.cost.faults import FaultSet
from prism_plugin.cost.model import CostModel
from prism_plugin.graph.engine import Engine, ReplayDeadlock, ReplayMismatch, compile_program
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.fold import ReplayMode, fold
from prism_plugin.graph.result import OpSpan, RankBreakdown, ReplayResult
from prism_plugin.graph.schema import ExecutionGraph

__all__ = [
    "OpSpan",
    "RankBreakdown",
    "ReplayDeadlock",
    "ReplayMismatch",
    "ReplayMode",
    "ReplayResult",
    "replay",
]

def replay(
    graph: ExecutionGraph,
    cost: CostModel,
    *,
    stragglers: Mapping[int, float] | None = None,
    mode: ReplayMode = ReplayMode.AUTO,
    record_events: bool = False,
    faults: Sequence[FaultSpec] | None = None,
) -> ReplayResult:
    """Replay one iteration of `graph` on `cost`'s cluster.

    `stragglers` maps a global rank to a slowdown factor of its compute (1.5 = 50% slower); it combines
    with the graph's own overrides. `record_events` keeps the completion order (for tests and debugging).
    `faults` (`prism_plugin.config.faults`): stragglers (their `from_step` is ignored: the replay predicts the
    faulty steady state), degraded links (an op crossing one costs ``cost / bandwidth``; forces
    `ReplayMode.FULL`, since folding assumes identical placements) and seeded jitter (``exp(sigma z)`` per
    (group role, seq), the same for every instance, so folding stays exact). Hangs, crashes and kills are
    live-only (a hang would only turn the replay into a `ReplayDeadlock`).

    >>> from prism_plugin.cost import CostModel, load_profile
    >>> from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph
    >>> g = build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=4, fwd_us=10.0, bwd_us=20.0,
    ...                                   activation_bytes=0, grad_bytes=0))
    >>> r = replay(g, CostModel(load_profile("dgx-h100")))
    >>> r.num_actors, r.iteration_time_us()  # (4 + 2 - 1) * (10 + 20) + 5 transfers of 6 us on the path
    (2, 180.0)
    """
    scales: dict[int, float] = {}
    for rank, factor in (stragglers or {}).items():
        graph.layout.coords(rank)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor):
            raise GraphError(f"stragglers[{rank}]={factor!r} must be a finite number > 0 (1.5 = 50% slower)")
        if factor <= 0:
            raise GraphError(f"stragglers[{rank}]={factor!r} must be > 0 (1.5 = 50% slower)")
        scales[rank] = float(factor)
    fault_set = None
    if faults:
        fault_set = FaultSet(tuple(faults), graph.layout.world_size, cost.profile.gpus_per_node)
        for spec in fault_set.stragglers:
            for rank in spec.ranks:
                scales[rank] = scales.get(rank, 1.0) * spec.factor
        if fault_set.links:
            mode = ReplayMode.FULL
    space = fold(graph, cost.profile.gpus_per_node, compute_scale=scales, mode=mode)
    cache: dict[Any, float] = {}
    programs = [compile_program(space, actor, cost, cache, fault_set) for actor in space.actors]
    engine = Engine(space, programs, record_events)
    engine.run()
    return ReplayResult(space, engine)
