"""Replay and hybrid emulation against real Megatron-core and DeepSpeed pipeline runs (pp=2, 1F1B, real compute).

One module fixture per framework runs `validation.framework.validate_framework`
(24 steps; the first 3 traced iterations dropped, 20 compared): a real run with both ranks real through
the prism backend (traced), the execution graph built from that run's traces, its replay, and the two
hybrid runs (rank 0 real with rank 1 virtual and replayed, and vice versa, started together so the
2 cores are loaded as in the real run). Megatron: the tiny GPT of recipes/megatron-pp2.yaml through the
drop-in wrapper; DeepSpeed: recipes/deepspeed-pipe2.yaml's PipelineModule (hidden 1024) with a "prism"
ds_config section. Before them a transfer probe fits the profile's p2p overhead to this machine. About
1 minute in all (Megatron ~35 s: its start-up is ~15 s per run; DeepSpeed ~20 s).

The graph comes from the real run's traces rather than from profiling runs (one real rank each, as
`prism slice --devices 1` plans them), which work too (``graph_from="profiling"``, exercised by
``benchmarks/graph_validation.py --framework ... --graph-from profiling``) but cost one more launch per
framework, beyond this test's time budget.

Tolerances. Compute is real on this shared 2-core machine: while other work holds the cores the steps of
the real run itself scatter by tens of percent (coefficient of variation, measured here, and isolated
steps several times the median), so each bound is a floor plus a multiple of that noise, as in
test_pipeline_validation.py: errors of the mean within FLOOR + 2 x noise, the worst single step within
MAX_FLOOR + 4 x noise; noise = the real run's coefficient of variation (for a hybrid rank, the larger of
that and its own run's, as the load moves between the runs). The structural checks (classes, op counts,
replayed arrivals) have fixed bounds. Measured on this machine under a load of ~2.5 (other jobs): Megatron
replay -5%, hybrids -3% / -2% (noise 13%); DeepSpeed replay -10%, hybrids -10% (noise 12%). A hybrid
rank's step against the replay is bounded by how far its own compute moved from the real run's (compute
coupling, see validation.framework); its ops' completions against the replay's
arrivals are checked to the microsecond scale.

Caps (graph_checks.Bound): each bound is capped at its value for a noise of NOISE_CAP_PCT = 15%, the 12-13%
measured under a load of ~2.5 above plus 2 points; the hybrid-follows-the-replay bound also at the largest
compute coupling seen (18% of the step). Noisier runs skip their timing checks with the figures instead of
passing.
"""

from __future__ import annotations

import json

import pytest
from graph_checks import (
    Bound,
    Tolerances,
    check_arrivals,
    check_graph_classes,
    check_hybrid_errors,
    check_replay,
    noise_checks,
)

from validation.framework import FrameworkJob, validate_framework

pytestmark = pytest.mark.slow

FLOOR_PCT = 10.0  # real compute on 2 shared cores: wider than the slept pipeline example's 5%
MAX_FLOOR_PCT = 25.0  # the worst of 20 steps
WAIT_FLOOR_PCT = 5.0  # mean per-op wait error, as a share of the step time
NOISE_CAP_PCT = 15.0  # the 12-13% noise measured under a load of ~2.5 (module docstring) + 2 points
TOL = Tolerances(
    mean=Bound(floor_pct=FLOOR_PCT, k=2.0, cap_pct=40.0),  # 10 + 2 x 15 = 40
    worst_step=Bound(floor_pct=MAX_FLOOR_PCT, k=4.0, cap_pct=85.0),  # 25 + 4 x 15 = 85
    wait=Bound(floor_pct=WAIT_FLOOR_PCT, k=2.0, cap_pct=35.0),  # 5 + 2 x 15 = 35
)
# a hybrid rank's step against the replay: 5% + 2 x its run's noise + |its compute coupling|;
# cap 5 + 2 x 15 + 18 (the largest coupling seen: DeepSpeed hybrid ranks 18% of the step faster) = 53
FOLLOW = Bound(floor_pct=5.0, k=2.0, cap_pct=53.0)
# p2p ops per stage and step: 4 micro-batches, each stage sends 4 and receives 4 (activations or gradients)
P2P_PER_STEP = 4
ARRIVAL_EARLY_US = 10.0  # an op completing before the replay says would be a bug: only clock rounding
ARRIVAL_MEDIAN_US = 200.0


@pytest.fixture(scope="module", params=["megatron", pytest.param("deepspeed", marks=pytest.mark.heavy)])
def figures(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    job = FrameworkJob(framework=request.param, steps=24, warmup=3)
    out = validate_framework(job, tmp_path_factory.mktemp(request.param))
    print(f"\nFRAMEWORK_VALIDATION {request.param} " + json.dumps({k: v for k, v in out.items() if k != "hybrid"}))
    for r, h in out["hybrid"].items():
        print(f"FRAMEWORK_VALIDATION {request.param} hybrid {r} " + json.dumps(h))
    return out


def test_structure_of_graph_and_hybrid_runs(figures: dict) -> None:
    assert figures["job"]["steps_compared"] == 20  # 24 steps: 23 traced iterations, 3 dropped
    check_graph_classes(figures, P2P_PER_STEP)
    for r, h in figures["hybrid"].items():
        assert h["arrivals"] == "replayed", r
        g = h["graph_ops"]
        # every marked iteration's pipeline ops follow the replay; a few ops after Megatron's last optimizer
        # step (its end-of-training collectives) lie beyond the graph's iteration
        assert g["ops_replayed"] >= 20 * 2 * P2P_PER_STEP, (r, g)
        assert g["ops_not_in_graph"] + g["ops_kind_mismatch"] <= 3, (r, g)


def test_hybrid_ops_complete_when_the_replay_says(figures: dict) -> None:
    """The mechanism, independent of how fast this machine ran the rank's compute: each replayed op of a
    hybrid rank completes at max(own arrival, replayed virtual arrival) + modelled cost, never before;
    late only by the wake-up of a sleeping thread (measured on an idle machine: median 2-6 us, 90th
    percentile <= 110 us; with a third busy process on the 2 cores the 90th percentile reached 3.5 ms, the
    scheduler's time slice, while the median stayed at 6 us: the median is what is bounded). How many ops wait
    on the virtual peer depends on how fast this rank computed against the recorded run (a loaded machine
    computes slower, so its own arrival comes later and fewer ops wait: 11 of 200 in a CI run with four
    other busy processes on the 2 cores, 2026-12-01): at least 5 must, so the rule is exercised."""
    check_arrivals(figures, min_ops=20 * 2 * P2P_PER_STEP, min_waiting=5, early_us=ARRIVAL_EARLY_US,
                   median_us=ARRIVAL_MEDIAN_US)


def test_hybrid_ranks_follow_the_replay(figures: dict) -> None:
    """Alone with its peer stage virtual, a rank runs at the replay's step time, give or take how much
    faster or slower its own compute ran than the real run's that the graph carries (module docstring of
    validation.framework: compute coupling; DeepSpeed hybrid ranks ran up to 18% of
    the step faster) and its run's own noise."""
    with noise_checks() as nc:
        for r, h in figures["hybrid"].items():
            nc.approx(f"hybrid {r} step vs replay", h["step_ms"], figures["predicted_rank_step_ms"][r], FOLLOW,
                      h["step_cv_pct"], extra_pct=abs(h["compute_delta_pct_of_step"]), detail=h)


def test_replay_predicts_the_real_step_time(figures: dict) -> None:
    check_replay(figures, TOL)


def test_hybrid_ranks_reproduce_real_step_time_and_waits(figures: dict) -> None:
    check_hybrid_errors(figures, TOL)
