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

A graph that does not describe the program is refused at exit (`check_graph_match`): when more than
`DEFAULT_MAX_OUTSIDE_FRACTION` (10%) of the ops after the first mark were outside the graph (not in it, or of
another kind), or no op came after a first mark at all, the run fails with `GraphMismatchError` naming the
counts; ``PRISM_GRAPH_MAX_OUTSIDE=<fraction>`` (``1`` accepts any mismatch) relaxes it. The counts are in the
summary's ``graph`` block either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpEvent, OpWork
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.faults import Straggler
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel
from prism_plugin.device.op_clock import EmulationClock
from prism_plugin.graph.convert import group_role
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.replay import ReplayDeadlock
from prism_plugin.graph.schema import ExecutionGraph
from prism_plugin.graph.steady import ArrivalTable, steady_state

__all__ = ["DEFAULT_MAX_OUTSIDE_FRACTION", "MAX_OUTSIDE_ENV", "GraphMismatchError", "ReplayedArrivals",
           "check_graph_match", "fault_phases", "load_arrivals", "load_job_graph", "max_outside_fraction"]

DEFAULT_MAX_OUTSIDE_FRACTION = 0.10
"""Ops after the first iteration mark that may be outside the graph before the run is refused: a few ops after
the last optimizer step (a final barrier, end-of-training collectives) are expected, a different program is not."""
MAX_OUTSIDE_ENV = "PRISM_GRAPH_MAX_OUTSIDE"
"""Environment variable overriding `DEFAULT_MAX_OUTSIDE_FRACTION` (a fraction in [0, 1]; 1 never refuses)."""


class GraphMismatchError(RuntimeError):
    """The run's ops did not follow its execution graph: its virtual arrivals were not the replay's."""


def max_outside_fraction(environ: Mapping[str, str]) -> float:
    """The refusal threshold: ``environ[MAX_OUTSIDE_ENV]`` or the default (a `ConfigError` when malformed).

    >>> max_outside_fraction({})
    0.1
    >>> max_outside_fraction({"PRISM_GRAPH_MAX_OUTSIDE": "1"})
    1.0
    """
    text = environ.get(MAX_OUTSIDE_ENV)
    if text is None or not text.strip():
        return DEFAULT_MAX_OUTSIDE_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{MAX_OUTSIDE_ENV}={text!r} must be a fraction in [0, 1] of the ops after the first "
                          f"iteration mark that may be outside the graph (default {DEFAULT_MAX_OUTSIDE_FRACTION}; "
                          "1 accepts any mismatch)")
    return value


def check_graph_match(graph: Mapping[str, Any], limit: float) -> dict[str, Any]:
    """The verdict on a run's ``graph`` summary block: counts, fraction outside the graph, ``ok`` or ``refused``.

    Example: 2 replayed, 6 not in the graph, 2 of another kind -> 8 of 10 outside (0.8 > 0.1): refused, and
    ``reason`` says so. No op after a first mark while ops ran before one -> refused (nothing was replayed).
    """
    outside = int(graph["ops_not_in_graph"]) + int(graph["ops_kind_mismatch"])
    after_mark = int(graph["ops_replayed"]) + outside
    before = int(graph["ops_before_first_mark"])
    verdict: dict[str, Any] = {"ops_after_first_mark": after_mark, "ops_outside_graph": outside,
                               "outside_fraction": round(outside / after_mark, 6) if after_mark else None,
                               "max_outside_fraction": limit, "verdict": "ok"}
    if after_mark == 0 and before > 0:
        verdict["verdict"] = "refused"
        verdict["reason"] = (f"none of the {before} ops on groups with virtual members came after an iteration "
                             "mark, so none followed the graph's replay; mark iterations "
                             "(prism_plugin.mark_iteration() or an optimizer step) or drop the graph")
    elif after_mark and outside / after_mark > limit:
        verdict["verdict"] = "refused"
        verdict["reason"] = (f"{outside} of the {after_mark} ops after the first iteration mark were outside the "
                             f"graph ({graph['ops_not_in_graph']} not in it, {graph['ops_kind_mismatch']} of another "
                             f"kind), more than {limit:.0%}; build the graph from this program (`prism graph build`) "
                             f"or set {MAX_OUTSIDE_ENV}=1 to accept it")
    return verdict


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

    def periods(self) -> Any:
        """This lookup's side of a fast-forward (`prism_plugin.runtime.periods`)."""
        from prism_plugin.runtime.periods import ArrivalPeriods

        return ArrivalPeriods(self)

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
            "ops_outside_graph": self.unmatched + self.mismatched,
        }
        if len(self.tables) > 1:
            out["phases"] = [{"from_step": start, "predicted_step_ms": round(t.step_us / 1e3, 6),
                              "predicted_rank_step_ms": round(t.rank_step_us / 1e3, 6)} for start, t in self.tables]
        return out
