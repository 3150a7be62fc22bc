"""Hangs and crashes in the replay: which ranks block where, since when, and when each one's timeout fires.

`replay` honours the faults that only change times (stragglers, links, jitter). A hang or a crash stops a
rank: its partners block forever, and so, transitively, do theirs. `failure_replay` replays `iterations`
chained copies with the faulty rank's trace cut where it stops (a hang: before its ``op``-th op on the
selected group role, counted from copy ``step``; a crash: at the start of copy ``step``) and reports, for
every rank that can no longer go on, the op it blocks in, when it arrived there, when its error surfaces
(a hang: ``timeout_s`` later, the collective timeout; a crash: at once on gloo, where the dead peer's
connection closes) and the blame chain back to the faulty rank (through ranks that are themselves blocked).

The hang's group is a name of the fault vocabulary, matched against the graph's axis-token roles
(`prism_plugin.config.faults.graph_role_matches`: ``tp`` is "tp", ``dp_cp`` is "cp-dp").

Every rank is replayed (`ReplayMode.FULL`: the cut breaks the symmetry folding relies on), so the cost
grows with N. Steps are copies from 0 (the live `step` counts iteration marks; the first marked step is 1).

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prism_plugin.config.faults import Crash, FaultSpec, Hang, graph_role_matches
from prism_plugin.cost.faults import FaultSet
from prism_plugin.cost.model import CostModel
from prism_plugin.graph.engine import WAIT, Engine, ReplayDeadlock, compile_program
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.fold import ReplayMode, fold
from prism_plugin.graph.schema import ExecutionGraph, NodeKind
from prism_plugin.graph.steady import unroll

__all__ = ["FailureReport", "failure_replay"]



@dataclass(frozen=True, kw_only=True, slots=True)
class FailureReport:
    """Where a hang or crash leaves every rank (module docstring)."""

    fault: str
    faulty_rank: int
    stopped_at_us: float
    """When the faulty rank stopped (a hang: its arrival at the op it never issues)."""
    stopped_before: str
    """The op the faulty rank never issues ("" when its trace ran out first)."""
    blocked: dict[int, dict[str, Any]]
    """rank -> {"op", "since_us", "raises_at_us", "waiting_on", "blame_chain"}; ranks that still finished
    are absent."""

    def to_dict(self) -> dict[str, Any]:
        return {"fault": self.fault, "faulty_rank": self.faulty_rank, "stopped_at_us": round(self.stopped_at_us, 3),
                "stopped_before": self.stopped_before, "blocked_ranks": len(self.blocked),
                "blocked": {str(r): v for r, v in sorted(self.blocked.items())}}


def _cut_index(graph: ExecutionGraph, nodes: Sequence[Any], per_copy: int, spec: Hang | Crash) -> int:
    if isinstance(spec, Crash):
        return min(len(nodes), spec.step * per_copy)
    count = 0
    for i in range(spec.step * per_copy, len(nodes)):
        node = nodes[i]
        if not node.kind.is_comm:
            continue
        if spec.group and spec.group != "world":  # a vocabulary name against the graph's role (dp_cp: "cp-dp")
            if node.kind is not NodeKind.COLLECTIVE or not graph_role_matches(spec.group, node.group):
                continue
        count += 1
        if count == spec.op:
            return i
    return len(nodes)


def failure_replay(graph: ExecutionGraph, cost: CostModel, fault: Hang | Crash, *, timeout_s: float = 1800.0,
                   iterations: int = 3, others: Sequence[FaultSpec] = ()) -> FailureReport:
    """Replay `graph` with `fault` (plus the timing faults `others`) and report the blocked ranks.

    >>> from prism_plugin.cost import load_profile
    >>> from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph
    >>> g = build_1f1b_graph(SyntheticJob(tp=2, pp=1, dp=2, num_microbatches=1, fwd_us=10.0, bwd_us=20.0,
    ...                                   activation_bytes=64, grad_bytes=4096))
    >>> rep = failure_replay(g, CostModel(load_profile("dgx-h100")), Hang(rank=1, op=1, group="tp"), timeout_s=5)
    >>> sorted(rep.blocked), rep.blocked[0]["waiting_on"], rep.blocked[2]["blame_chain"]
    ([0, 2, 3], [1], [2, 0, 1])
    """
    world = graph.layout.world_size
    if not 0 <= fault.rank < world:
        raise GraphError(f"{fault.to_text()}: rank {fault.rank} is outside the graph's 0..{world - 1}")
    iterations = max(iterations, fault.step + 1)
    unrolled = unroll(graph, iterations)
    timing = FaultSet(tuple(others), world, cost.profile.gpus_per_node)
    scales = {r: s.factor for s in timing.stragglers for r in s.ranks}
    space = fold(unrolled, cost.profile.gpus_per_node, compute_scale=scales, mode=ReplayMode.FULL)
    cache: dict[Any, float] = {}
    programs = [compile_program(space, actor, cost, cache, timing or None) for actor in space.actors]
    a_fault = space.actor_of(fault.rank).index
    prog = programs[a_fault]
    per_copy = len(prog.kinds) // iterations
    cut = _cut_index(graph, prog.nodes, per_copy, fault)
    stopped_before = prog.nodes[cut].label() if cut < len(prog.nodes) else ""
    programs[a_fault] = replace(prog, kinds=prog.kinds[:cut], value=prog.value[:cut], key=prog.key[:cut],
                                expected=prog.expected[:cut], is_async=prog.is_async[:cut], link=prog.link[:cut],
                                nodes=prog.nodes[:cut])
    engine = Engine(space, programs, False)
    try:
        engine.run()
    except ReplayDeadlock:
        pass
    rank_of = [a.rep_rank for a in space.actors]
    blocked: dict[int, dict[str, Any]] = {}
    waiting: dict[int, list[int]] = {}
    for a, fin in enumerate(engine.finish):
        if fin >= 0.0 or a == a_fault:
            continue
        i = engine.blocked[a]
        p = programs[a]
        since = engine.issue[a][i]
        if p.kinds[i] == WAIT:
            i = p.link[i]
        node = p.nodes[i]
        pend = engine.pending.get(p.key[i])
        arrived = {rank_of[b] for b, _ in pend.members} if pend is not None else set()
        if node.kind is NodeKind.COLLECTIVE:
            members = graph.layout.group_of(rank_of[a], node.group)
        else:
            members = (rank_of[a], graph.layout.peer_of(rank_of[a], node.peer_axis, node.peer_offset))
        missing = sorted(set(members) - arrived - {rank_of[a]})
        waiting[rank_of[a]] = missing
        fails_at_once = isinstance(fault, Crash) and fault.rank in members
        blocked[rank_of[a]] = {"op": node.label(), "since_us": round(since, 3),
                               "raises_at_us": round(since + (0.0 if fails_at_once else timeout_s * 1e6), 3),
                               "waiting_on": missing}
    for r, entry in blocked.items():
        chain, seen = [r], {r}
        while chain[-1] != fault.rank:
            missing = waiting.get(chain[-1], [])
            nxt = fault.rank if fault.rank in missing else next((m for m in missing if m not in seen), None)
            if nxt is None:
                break
            chain.append(nxt)
            seen.add(nxt)
        entry["blame_chain"] = chain
    return FailureReport(fault=fault.to_text(), faulty_rank=fault.rank, stopped_at_us=engine.finish[a_fault],
                         stopped_before=stopped_before, blocked=blocked)
