"""Hybrid emulation: virtual participants arrive at each op when the execution graph's replay says.

With ``EmulationConfig.graph`` set, the session replays the graph once at activation (`steady_state`,
chained iterations) and keeps, for this real rank, an `ArrivalTable`: for the k-th op of each group role
(and the k-th send/recv to each peer) in an iteration, the latest arrival of a virtual member as an offset
from this rank's iteration start. At run time `ReplayedArrivals`, the first op observer
(`prism_plugin.comm.context`), maps each live op to its table entry (group -> role through the layout;
k counted per role since the last iteration mark) and moves its arrival to ``max(real arrival, iteration
anchor + offset)``, so the op completes at ``max(real and virtual arrivals) + cost``. Ops on groups
without a virtual member, and every op with ``timing=False``, are left alone. Every mark re-anchors the
offsets on the clock, so a real rank whose compute drifts from the graph does not accumulate error.

What is not replayed (said in the session summary with counts): ops before the first iteration mark (the
table's offsets count from a mark), ops beyond what the graph's iteration holds, and ops whose kind
differs from the graph's at that position. Those keep the symmetric assumption (virtual members arrive
with this rank). Groups that are not groups of the graph's layout raise ValueError at their first op.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpEvent, OpWork
from prism_plugin.config.faults import Straggler
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel
from prism_plugin.graph.convert import group_role
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.replay import ReplayDeadlock
from prism_plugin.graph.schema import ExecutionGraph
from prism_plugin.graph.steady import ArrivalTable, steady_state
from prism_plugin.runtime.clock import EmulationClock

__all__ = ["ReplayedArrivals", "fault_phases", "load_arrivals", "load_job_graph"]


def load_job_graph(path: Path, world_size: int) -> ExecutionGraph:
    """The execution graph at `path`, checked to describe `world_size` ranks (a `GraphError` naming the fix).

    Adapters call it while validating their flags, before any process group exists.
    """
    try:
        graph = ExecutionGraph.load(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GraphError(f"graph={str(path)!r} cannot be read: {exc}; build one with `prism graph build`") from None
    if graph.layout.world_size != world_size:
        raise GraphError(
            f"graph={str(path)!r} describes {graph.layout.world_size} ranks but --world-size is {world_size}: "
            "load the graph of this job"
        )
    return graph


def fault_phases(faults: Sequence[Any]) -> list[tuple[int, tuple[Any, ...]]]:
    """The steps at which the set of active faults changes, with the faults active from each on.

    Stragglers act from their ``from_step``; every other fault the replay honours acts throughout.
    ``[(0, faults)]`` when no straggler starts late.
    """
    starts = sorted({0} | {f.from_step for f in faults if isinstance(f, Straggler)})
    return [(b, tuple(f for f in faults if not isinstance(f, Straggler) or f.from_step <= b)) for b in starts]


def load_arrivals(path: Path, cost: CostModel, rank: int, real_ranks: tuple[int, ...],
                  world_size: int, clock: EmulationClock, faults: Sequence[Any] = ()) -> ReplayedArrivals:
    """Load the graph at `path`, replay it and build this rank's table (ValueError on a mismatch).

    `faults` (`prism_plugin.config.faults`): the replay honours stragglers, links and jitter, so virtual members
    arrive when the faulty job's replay says (the live straggler model is then not applied on top). A
    straggler with ``from_step`` s: one table replayed without it for the steps before s, one with it from
    s on (`fault_phases`), switched at the iteration mark that starts step s.
    """
    graph = load_job_graph(path, world_size)
    tables: list[tuple[int, ArrivalTable]] = []
    for start, active in fault_phases(faults):
        try:
            state = steady_state(graph, cost, faults=active)
        except ReplayDeadlock as exc:
            raise ValueError(f"graph={str(path)!r} cannot be replayed: {exc}") from None
        tables.append((start, ArrivalTable.for_rank(state, rank, real_ranks)))
    arrivals = ReplayedArrivals(graph, tables, rank, clock, str(path))
    if faults:  # the replay's chain of waits from this rank back to the faulty rank, in the steady step
        from prism_plugin.graph.blame import blame_report

        arrivals.blame = blame_report(state.result, [rank], steps=state.iterations)[str(rank)][-1]
    return arrivals


class ReplayedArrivals:
    """This rank's live lookup of virtual arrivals (see the module docstring)."""

    def __init__(self, graph: ExecutionGraph, tables: Sequence[tuple[int, ArrivalTable]], rank: int,
                 clock: EmulationClock, source: str) -> None:
        self.graph = graph
        self.tables = sorted(tables, key=lambda t: t[0])
        """(first step, table) per fault phase (`fault_phases`), from step 0."""
        if not self.tables or self.tables[0][0] != 0:
            raise ValueError("the arrival tables must start at step 0")
        self.table = self.tables[0][1]
        """The table of the current step's phase (`fault_phases`)."""
        self.rank = rank
        self.clock = clock
        self.source = source
        self._roles: dict[int, tuple[Any, str]] = {}
        self._coll: dict[str, int] = {}
        self._p2p: dict[tuple[OpKind, int], int] = {}
        self.active = False
        self.replayed = 0
        self.outside_iterations = 0
        self.unmatched = 0
        self.mismatched = 0
        self.blame: dict[str, Any] | None = None
        self.timing = True
        """False with ``EmulationConfig.timing=False``: ops complete when their data is ready, nothing is replayed."""

    def on_op(self, event: OpEvent) -> None:
        """Move the op's arrival to its virtual members' replayed arrival (when later than this rank's)."""
        vg = event.group
        if vg.all_real or not self.timing:
            return
        event.arrival_s = self.arrival(vg, event.kind, event.arrival_s, event.peer)

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass

    def on_iteration(self, step: int = 0) -> None:
        """An iteration mark: `step` (the session's iteration counter) starts; counts restart."""
        self.active = True
        for start, table in self.tables:
            if start <= step:
                self.table = table
        self._coll.clear()
        self._p2p.clear()

    def _role(self, vg: Any) -> str:
        entry = self._roles.get(id(vg))
        if entry is None:
            ranks = None if vg.is_world else vg.global_ranks
            entry = self._roles[id(vg)] = (vg, group_role(self.graph.layout, self.rank, ranks))
        return entry[1]

    def arrival(self, vg: Any, kind: OpKind, arrival_s: float, peer: int | None) -> float:
        """The op's effective arrival: max(this rank's, its virtual members' per the replay)."""
        if not self.active:
            self.outside_iterations += 1
            return arrival_s
        if peer is not None:
            key = (kind, peer)
            k = self._p2p.get(key, 0)
            self._p2p[key] = k + 1
            offset = self.table.p2p.get((kind, peer, k))
        else:
            role = self._role(vg)
            k = self._coll.get(role, 0)
            self._coll[role] = k + 1
            entry = self.table.collectives.get((role, k))
            offset = None
            if entry is not None:
                if entry[0] is not kind:
                    self.mismatched += 1
                    return arrival_s
                offset = entry[1]
        if offset is None:
            self.unmatched += 1
            return arrival_s
        self.replayed += 1
        virtual_s = self.clock.iteration_start_s + offset * 1e-6
        return virtual_s if virtual_s > arrival_s else arrival_s

    def summary(self) -> dict[str, Any]:
        out = {
            "path": self.source,
            "predicted_step_ms": round(self.table.step_us / 1e3, 6),
            "predicted_rank_step_ms": round(self.table.rank_step_us / 1e3, 6),
            "ops_replayed": self.replayed,
            "ops_before_first_mark": self.outside_iterations,
            "ops_not_in_graph": self.unmatched,
            "ops_kind_mismatch": self.mismatched,
        }
        if len(self.tables) > 1:
            out["phases"] = [{"from_step": start, "predicted_step_ms": round(t.step_us / 1e3, 6),
                              "predicted_rank_step_ms": round(t.rank_step_us / 1e3, 6)} for start, t in self.tables]
        return out
