"""Validation of trace capture, slicing, replay and hybrid emulation against a real 2-stage pipeline run.

One module fixture runs `validation.pipeline.validate` on the 1F1B example (pp=2,
8 micro-batches, compute slept: 3/4 ms forward and 6/8 ms backward per micro-batch on stages 0/1, 24 steps,
the first 3 traced iterations dropped): two real runs (A, B: every rank real, gloo underneath), a probe of
this machine's transfer time (the profile's p2p overhead is fitted to it), two profiling runs (one real
rank each, from `prism slice --devices 1`), the graph and its replay, and one hybrid run per stage (that
rank real, the other virtual and replayed). Then the CLI path: `prism slice`, `prism profile`,
`prism graph build`, `prism replay --json`.

Tolerances. On a quiet run of this 2-core machine (benchmarks/graph_validation.py; figures in the closing
note of the execution-graph issue) the real run repeats within ~1% and the errors below are within ~3%.
The machine is shared, and while other work holds its cores every wake-up of a sleeping process (each
slept compute span, each transfer) comes late: the real run's steps then scatter by 5-10% (coefficient of
variation) and runs differ by up to ~15%. The real run cannot be predicted better than it repeats, so
each bound is a floor plus a multiple of the noise measured here, noise = max(run-to-run difference of
real runs A and B, coefficient of variation of A's steps, and for a hybrid rank that of its own run's
steps, as the load moves between runs: one stalled step of a hybrid run, 24% over the real mean in a CI
run whose real runs scattered by 1%, is the machine's, not the emulator's). Mean errors are within
FLOOR + 2 x noise (the prediction and the real run each off by up to one noise), the worst single step
within MAX_FLOOR + 4 x noise. The mechanism check (hybrid rank 0 follows the replay, the bubble is
emulated) does not depend on the real run: 3% plus the hybrid run's own coefficient of variation.

Caps (graph_checks.Bound): each bound is capped at its value for a noise of NOISE_CAP_PCT = 10%, the top of
the 5-10% step scatter of a loaded machine above. That keeps the mean bound (5 + 2 x 10 = 25%) and the
mechanism check's (3 + 10 = 13%) under the ~35% a lost replay would show (stage 0 alone at its own compute
time, see test_hybrid_rank_follows_the_replayed_virtual_stage). Noisier runs (runs ~15% apart, as under
heavy load) skip their timing checks with the figures instead of passing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from graph_checks import (
    Bound,
    Tolerances,
    check_arrivals,
    check_graph_classes,
    check_hybrid_errors,
    check_replay,
    noise_checks,
    run_noise_pct,
)

from prism_plugin.graph.rank_trace import load_rank_traces
from prism_plugin.graph.schema import ExecutionGraph
from validation.pipeline import PipelineJob, run_pipeline, validate

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # minutes of CI each; `scripts/test.sh --heavy` runs them

JOB = PipelineJob(pp=2, microbatches=8, fwd_ms="3,4", bwd_ms="6,8", steps=24, warmup=3, profile_steps=12)
FLOOR_PCT = 5.0  # quiet-machine errors of the mean are within ~3%; 2 points of margin
MAX_FLOOR_PCT = 10.0  # the worst of 20 steps
WAIT_FLOOR_PCT = 3.0  # per-op wait errors, as a share of the step time (quiet: within ~1.5%)
NOISE_CAP_PCT = 10.0  # the top of the 5-10% step scatter of a loaded machine (module docstring)
TOL = Tolerances(
    mean=Bound(floor_pct=FLOOR_PCT, k=2.0, cap_pct=25.0),  # 5 + 2 x 10 = 25 (a lost replay: ~35%)
    worst_step=Bound(floor_pct=MAX_FLOOR_PCT, k=4.0, cap_pct=50.0),  # 10 + 4 x 10 = 50
    wait=Bound(floor_pct=WAIT_FLOOR_PCT, k=2.0, cap_pct=23.0),  # 3 + 2 x 10 = 23
)
FOLLOW = Bound(floor_pct=3.0, k=1.0, cap_pct=13.0)  # 3 + 1 x 10 = 13 (without the replay: ~35% off)
P2P_PER_STEP = 8  # 8 micro-batches: each stage sends 8 and receives 8 (activations or gradients)


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = validate(JOB, tmp_path_factory.mktemp("pipeline"))
    print("\nPIPELINE_VALIDATION " + json.dumps({k: v for k, v in out.items() if k != "hybrid"}))
    for r, h in out["hybrid"].items():
        print(f"PIPELINE_VALIDATION hybrid {r} " + json.dumps({k: v for k, v in h.items() if k != "summary"}))
    return out


def test_structure_of_traces_graph_and_hybrid_runs(figures: dict) -> None:
    assert figures["job"]["steps_compared"] == 20  # 24 steps: 23 traced iterations, 3 dropped
    graph = check_graph_classes(figures, P2P_PER_STEP)
    for trace in graph.classes.values():
        assert [n.kind.value for n in trace.nodes].count("collective") == 0
        assert sum(n.is_async for n in trace.nodes) == 14  # 7 steady-state exchanges of isend + irecv
    for r, h in figures["hybrid"].items():
        s = h["summary"]
        assert s["arrivals"] == "replayed" and h["ops_per_step"] == 16
        g = s["graph"]
        # 23 marked iterations x 16 ops replayed; the first step (before the first mark) and the final
        # barrier (beyond the graph's iteration) keep the symmetric assumption; no op differs in kind
        assert (g["ops_replayed"], g["ops_before_first_mark"], g["ops_not_in_graph"], g["ops_kind_mismatch"]) \
            == (23 * 16, 16, 1, 0), r


def test_replay_predicts_the_real_step_time(figures: dict) -> None:
    check_replay(figures, TOL)


def test_hybrid_ranks_reproduce_real_step_time_and_waits(figures: dict) -> None:
    check_hybrid_errors(figures, TOL)


def test_hybrid_rank_follows_the_replayed_virtual_stage(figures: dict) -> None:
    """Stage 0 is paced by stage 1 (the slower one): alone, with stage 1 virtual, its step is the replay's.

    Without replayed arrivals (the symmetric assumption) it would run at its own compute time, ~35% faster.
    """
    h0 = figures["hybrid"]["0"]
    predicted = figures["predicted_rank_step_ms"]["0"]
    assert h0["wait_total_ms_hybrid"] > 0.2 * h0["step_ms"]  # the bubble is there: stage 0 waits for stage 1
    with noise_checks() as nc:
        nc.approx("hybrid 0 step vs replay", h0["step_ms"], predicted, FOLLOW, h0["step_cv_pct"], detail=h0)


def test_hybrid_ops_complete_when_the_replay_says(figures: dict) -> None:
    """Each replayed op completes at max(own arrival, replayed virtual arrival) + modelled cost, never
    before, late only by a thread's wake-up (measured: median 2-7 us, 90th percentile <= 21 us; the 90th
    percentile follows the machine's load, see test_framework_validation.py, so the median is bounded)."""
    check_arrivals(figures, min_ops=20 * 2 * P2P_PER_STEP, min_waiting=10, early_us=10.0, median_us=200.0)


def test_hybrid_straggler_slows_the_virtual_stage_from_its_from_step(figures: dict, tmp_path: Path) -> None:
    """Rank 0 real, stage 1 virtual and a straggler (x1.5) from step 8: the replayed arrivals switch from the
    clean replay's to the faulty one's at the mark that starts step 8, and rank 0's step follows each."""
    graph = Path(figures["graph"])
    traces = run_pipeline(JOB, tmp_path, [0], 14, str(graph.parent / "calibrated.yaml"), graph=graph,
                  faults=("straggler:ranks=1,factor=1.5,from_step=8",))
    summary = json.loads((tmp_path / "rank0.summary.json").read_text())
    clean, slow = (p["predicted_rank_step_ms"] for p in summary["graph"]["phases"])
    assert slow > 1.2 * clean  # stage 1 is the slower stage: it sets the pace
    by_step = {it.index: it.duration_us / 1e3 for it in traces[0].iterations}
    before = statistics.median(t for i, t in by_step.items() if 2 <= i < 8)
    after = statistics.median(t for i, t in by_step.items() if i >= 8)
    noise = run_noise_pct(figures)  # 5% + 2 x this machine's measured noise, as the other step checks
    with noise_checks() as nc:
        nc.approx("steps before the straggler", before, clean, TOL.mean, noise, detail=(by_step, clean, slow))
        nc.approx("steps from the straggler on", after, slow, TOL.mean, noise, detail=(by_step, clean, slow))


def test_cli_slice_profile_build_replay(figures: dict, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "prism_plugin.cli.graph"]
    plan = tmp_path / "plan.json"
    subprocess.run([*cli, "slice", "--layout", "pp=2,dp=1", "--devices", "2", "--out", str(plan)], check=True,
                   capture_output=True)
    run = subprocess.run([*cli, "profile", "--plan", str(plan), "--out", str(tmp_path / "prof"), "--gpus-per-node",
                          "2", "-m", "prism_plugin.programs.pipeline_train", "--steps", "5", "--microbatches", "2"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(t.rank for t in load_rank_traces([tmp_path / "prof"])) == [0, 1]
    built = tmp_path / "built.graph"
    profiled = Path(figures["graph"]).parent
    subprocess.run([*cli, "graph", "build", str(profiled / "profile0"), str(profiled / "profile1"), "--layout",
                    "pp=2,dp=1", "-o", str(built)], check=True, capture_output=True)
    out = subprocess.run([*cli, "replay", str(built), "--profile", str(profiled / "calibrated.yaml"), "--json",
                          "--sampled", "--chrome-trace", str(tmp_path / "t.json"), "--ranks", "0,1"],
                         check=True, capture_output=True, text=True)
    pred = json.loads(out.stdout)
    assert pred["step_us"] / 1e3 == pytest.approx(figures["replay"]["predicted_step_ms"], rel=1e-3)
    assert set(pred["ranks"]) == {"0", "1"} and pred["num_actors"] == 2
    # 12 profiled steps: 11 marked iterations, 2 dropped as warm-up by `prism graph build`; stage 1 is the
    # critical path throughout (no max of varying spans), so the sampled mean is the replay of the means
    assert pred["sampled"]["iterations"] == 9
    assert pred["sampled"]["step_us_mean"] / 1e3 == pytest.approx(figures["replay"]["sampled_step_ms"], rel=1e-3)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for profile_graph in (tmp_path / "prof" / "job.graph",):
        assert sorted(ExecutionGraph.load(profile_graph).classes) == ["pp=0", "pp=1"]
    bad = subprocess.run([*cli, "replay", str(built), "--straggler", "7"], capture_output=True, text=True)
    assert bad.returncode == 2 and "RANK:FACTOR" in bad.stdout + bad.stderr
