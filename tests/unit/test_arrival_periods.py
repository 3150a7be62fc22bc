"""A hybrid run's replayed arrivals in a fast-forward (`prism_plugin.runtime.periods.ArrivalPeriods`).

The lookup (`prism_plugin.runtime.arrivals.ReplayedArrivals`) is stood in for by its state: the table of virtual
arrivals (offsets in us from the iteration start), the k-th op counted per role and per peer channel, the counters.
A period of two receives from rank 0 and one all-reduce on the dp role; the table repeats it every 100 us.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prism_plugin.config.kinds import OpKind
from prism_plugin.graph.steady import ArrivalTable
from prism_plugin.runtime.periods import ArrivalPeriods

STEP_US = 100.0


def _table(repeats: int, then: float = 0.0) -> ArrivalTable:
    """`repeats` periods, then (if `then`) two more whose second receive comes `then` us later than the pattern."""
    p2p, coll = {}, {}
    for n in range(repeats + (2 if then else 0)):
        late = then if n >= repeats else 0.0
        p2p[(OpKind.RECV, 0, 2 * n)] = 10.0 + n * STEP_US
        p2p[(OpKind.RECV, 0, 2 * n + 1)] = 40.0 + n * STEP_US + late
        coll[("dp", n)] = (OpKind.ALL_REDUCE, 70.0 + n * STEP_US)
    return ArrivalTable(rank=1, collectives=coll, p2p=p2p, step_us=1e4, rank_step_us=1e4)


def _arrivals(table: ArrivalTable, start_s: float = 5.0) -> Any:
    return SimpleNamespace(table=table, clock=SimpleNamespace(iteration_start_s=start_s), active=True, _coll={},
                           _p2p={}, replayed=0, outside_iterations=0, unmatched=0, mismatched=0)


def _period(arrivals: Any) -> None:
    """One period's lookups, as `ReplayedArrivals.arrival` counts them."""
    arrivals._p2p[(OpKind.RECV, 0)] = arrivals._p2p.get((OpKind.RECV, 0), 0) + 2
    arrivals._coll["dp"] = arrivals._coll.get("dp", 0) + 1
    arrivals.replayed += 3


def test_two_periods_sign_the_same_arrivals_relative_to_their_starts() -> None:
    arrivals = _arrivals(_table(10))
    view = ArrivalPeriods(arrivals)
    marks = [view.position()]
    for _ in range(2):
        _period(arrivals)
        marks.append(view.position())
    base = 5.0 + 3e-6  # the device at the first mark, 3 us into the iteration
    first = view.signature(marks[0], marks[1], base, base, lambda vg: 0)
    second = view.signature(marks[1], marks[2], base + 1e-4, base + 1e-4, lambda vg: 0)
    assert isinstance(first, list) and isinstance(second, list)
    assert first[:2] == second[:2] == [True, [3, 0, 0, 0]]
    # per channel: the op's place in the period, its kind and its virtual arrival relative to the period's start
    recv = (OpKind.RECV, 0)
    assert [(key, j, e[0]) for key, j, e in first[2]] == [("dp", 0, OpKind.ALL_REDUCE), (recv, 0, OpKind.RECV),
                                                         (recv, 1, OpKind.RECV)]
    assert [round(e[1] * 1e6, 6) for _, _, e in first[2]] == [67.0, 7.0, 37.0]
    assert [e[:2] for e in first[2]] == [e[:2] for e in second[2]]
    assert all(abs(a[2][1] - b[2][1]) < 1e-15 for a, b in zip(first[2], second[2], strict=True))


def _horizon(table: ArrivalTable, step_us: float, periods: int) -> int:
    """The horizon after the table's first period (periods 1, 2, ... must repeat it)."""
    arrivals = _arrivals(table)
    view = ArrivalPeriods(arrivals)
    a = view.position()
    _period(arrivals)
    return view.horizon(a, view.position(), step_us * 1e-6, periods)


def test_the_horizon_ends_where_the_table_stops_repeating_the_period() -> None:
    # periods 1..9 of a 10-period table repeat period 0; periods 10 and 11, half a microsecond late, do not
    assert _horizon(_table(10), STEP_US, 20) == 9
    assert _horizon(_table(10, then=0.5), STEP_US, 20) == 9
    assert _horizon(_table(10), STEP_US, 3) == 3
    # a device step other than the table's: the very next period differs
    assert _horizon(_table(10), 1.01 * STEP_US, 20) == 0


def test_an_offset_within_the_proof_tolerance_still_repeats_and_a_nanosecond_off_does_not() -> None:
    for late_us, expected in ((0.5e-4, 11), (1e-3, 10)):  # 5e-11 s (under 1e-10 s), 1e-9 s
        table = _table(12)
        p2p = dict(table.p2p)
        p2p[(OpKind.RECV, 0, 23)] += late_us  # the second receive of the last period, 11
        late = ArrivalTable(rank=1, collectives=table.collectives, p2p=p2p, step_us=1e4, rank_step_us=1e4)
        assert _horizon(late, STEP_US, 20) == expected, late_us


def test_the_repeat_advances_the_counts_as_the_skipped_periods_would() -> None:
    arrivals = _arrivals(_table(10))
    view = ArrivalPeriods(arrivals)
    _period(arrivals)
    a = view.position()
    _period(arrivals)
    b = view.position()
    assert view.repeat(a, b, 5, 1e-4, 1e-4, lambda vg: 0) == {}
    assert arrivals._p2p == {(OpKind.RECV, 0): 14} and arrivals._coll == {"dp": 7} and arrivals.replayed == 21


def test_a_period_across_an_iteration_mark_is_not_described() -> None:
    arrivals = _arrivals(_table(10))
    view = ArrivalPeriods(arrivals)
    a = view.position()
    arrivals.clock.iteration_start_s = 6.0
    arrivals._p2p, arrivals._coll = {}, {}
    _period(arrivals)
    assert isinstance(view.signature(a, view.position(), 6.0, 6.0, lambda vg: 0), str)


def test_before_the_first_mark_nothing_is_looked_up_and_every_period_repeats() -> None:
    arrivals = _arrivals(_table(1))
    arrivals.active = False
    view = ArrivalPeriods(arrivals)
    a = view.position()
    arrivals.outside_iterations += 4
    b = view.position()
    assert view.signature(a, b, 0.0, 0.0, lambda vg: 0) == [False, [0, 4, 0, 0], []]
    assert view.horizon(a, b, 1e-4, 50) == 50
    view.repeat(a, b, 3, 0.0, 0.0, lambda vg: 0)
    assert arrivals.outside_iterations == 16
