"""Emulated time: async ops overlap with compute; sync ops last at least their modelled cost.

A profile slowed down to 0.1 GB/s makes a 4 MiB all_reduce over a world of 8 (one real rank,
seven virtual) cost ~75 ms (ring on one node of 8, see the arithmetic in `_PROFILE`). Then:
- `all_reduce(async_op=True)` returns in well under 10 ms with `is_completed()` False;
- 50 ms of real compute before `wait()` gives a total of max(cost, compute) = cost, not the sum;
- 110 ms of compute (more than the cost) gives ~the compute time: wait() returns at once;
- a sync all_reduce takes at least its modelled cost (`session.cost_model` and `session.cost_s`
  agree on the figure).

Tolerances (this 2-core VM is noisy; the other workers of the pool are idle but alive):
- lower bounds are hard: the handle may never complete before `issue + cost` (it sleeps until that
  deadline, measured on the same perf_counter clock), so `total >= cost` and `sync >= cost` exactly;
- upper bounds get 30% over the ideal max(cost, compute): a scheduler hiccup or the 1 ms scaling
  of 4 MiB at issue must not fail the test, while the serialised sum (cost + compute = 125 ms vs
  1.3 x 75 = 97.5 ms) still would;
- issue time < 10 ms: the one-real-rank path scales the 4 MiB tensor in place at issue (~1-2 ms).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Mode, Setup
from programs_probes import timing_probe

pytestmark = pytest.mark.slow

# 4 MiB all_reduce, ring over 8 ranks on one node (gpus_per_node 8):
#   traffic 2 * 7/8 * 4194304 B = 7340032 B at 0.1 GB/s x bus_efficiency 1.0 = 100 B/us -> 73400 us
#   + collective_overhead 500 us + 2 * 7 = 14 hops x 50 us = 700 us  -> 74.6 ms
_PROFILE = """\
name: slow-test-cluster
description: test profile, 0.1 GB/s links so a 4 MiB all_reduce over 8 ranks costs ~75 ms
gpus_per_node: 8
intra_node:
  bandwidth_gbytes_per_s: 0.1
  latency_us: 50.0
inter_node:
  bandwidth_gbytes_per_s: 0.1
  latency_us: 50.0
bus_efficiency: 1.0
p2p_efficiency: 1.0
collective_overhead_us: 500.0
p2p_overhead_us: 75.0
"""
EXPECTED_COST_S = 0.0746
SLACK = 1.3


@pytest.fixture(scope="module")
def slow_setup(tmp_path_factory) -> Setup:
    path = Path(tmp_path_factory.mktemp("profile")) / "slow.yaml"
    path.write_text(_PROFILE)
    return Setup(mode=Mode.PRISM, world_size=8, real_ranks=(0,), timing=True, profile=str(path),
                 gpus_per_node=8)


def test_cost_figure(cluster, slow_setup) -> None:
    r = cluster.run(slow_setup, timing_probe, compute_s=0.0)[0]
    assert r["cost_s"] == pytest.approx(r["model_s"], rel=1e-9)
    assert r["cost_s"] == pytest.approx(EXPECTED_COST_S, rel=0.01)
    assert 0.060 <= r["cost_s"] <= 0.100


def test_async_overlaps_compute_shorter_than_cost(cluster, slow_setup) -> None:
    r = cluster.run(slow_setup, timing_probe, compute_s=0.050)[0]
    cost = r["cost_s"]
    assert r["issue_s"] < 0.010, r
    assert r["completed_at_issue"] is False, r
    assert r["completed_before_wait"] is False, r  # 50 ms of compute < 75 ms of cost
    assert r["completed_after_wait"] is True, r
    assert r["total_s"] >= cost, r  # never before the emulated completion
    assert r["total_s"] <= SLACK * max(cost, 0.050), r  # max(cost, compute), not the sum
    assert r["total_s"] < cost + 0.050, r
    assert cost <= r["sync_s"] <= SLACK * cost, r


def test_async_overlaps_compute_longer_than_cost(cluster, slow_setup) -> None:
    r = cluster.run(slow_setup, timing_probe, compute_s=0.110)[0]
    cost = r["cost_s"]
    assert r["completed_at_issue"] is False, r
    assert r["completed_before_wait"] is True, r  # the op finished during the compute
    assert r["compute_done_s"] >= 0.110
    assert r["total_s"] <= SLACK * max(cost, 0.110), r
    assert r["total_s"] - r["compute_done_s"] < 0.010, r  # wait() had nothing left to do
