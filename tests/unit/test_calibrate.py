"""`prism calibrate`: the fit (pure, tier a), nccl-tests logs, the CLI, and one real 2-process gloo run (tier c).

The fitting tests use synthetic measurements from a known profile: noise-free they must give it back
to rounding; with noise, within tolerances set from a 200-seed Monte Carlo (figures in the test).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
import statistics
from pathlib import Path

import pytest

from prism_plugin.cli.main import main
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, GroupPlacement, HardwareProfile, load_profile, profile_from_yaml
from prism_plugin.cost.calibrate import Measurement, fit_profile, one_node_placement
from prism_plugin.cost.nccl_tests import fit_from_nccl_tests, load_nccl_tests_dir, nccl_tests_fit, parse_nccl_tests

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"
_spec = importlib.util.spec_from_file_location("nccl_tests_generate", DATA / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)
TRUTH = load_profile(str(DATA / "truth.yaml"))
SIZES = [2**k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB
ONE8 = one_node_placement(8)
TWO16 = GroupPlacement.from_ranks(range(16), 8)
PAIR = one_node_placement(2)
CASES = [(OpKind.ALL_REDUCE, ONE8), (OpKind.ALL_GATHER, ONE8), (OpKind.SEND, PAIR), (OpKind.ALL_REDUCE, TWO16),
         (OpKind.REDUCE_SCATTER, TWO16)]


def _fields(p: HardwareProfile) -> dict[str, float]:
    return {
        "intra_bw": p.intra_node.bandwidth_gbytes_per_s, "intra_lat": p.intra_node.latency_us,
        "inter_bw": p.inter_node.bandwidth_gbytes_per_s, "inter_lat": p.inter_node.latency_us,
        "bus": p.bus_efficiency, "p2p": p.p2p_efficiency, "oc": p.collective_overhead_us, "op": p.p2p_overhead_us,
    }


def _synthetic(profile: HardwareProfile, cases=CASES, noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    model, rng = CostModel(profile), random.Random(seed)
    return [
        Measurement(kind=k, size_bytes=s, placement=pl,
                    time_us=model.collective_us_placed(k, s, pl) * math.exp(rng.gauss(0, noise)))
        for s in SIZES for k, pl in cases
    ]


# -- the fit ------------------------------------------------------------------------------------------


def test_fit_recovers_known_profile_exactly_from_noise_free_data():
    fit = fit_profile(_synthetic(TRUTH), name="t", description="synthetic", gpus_per_node=8, link_rates=TRUTH)
    got, want = _fields(fit.profile), _fields(TRUTH)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-7), key
    assert fit.not_fitted == ()
    assert all(r.max_rel_error < 1e-9 for r in fit.residuals)
    assert {r.label for r in fit.residuals} >= {"all_reduce 8 ranks/1 node", "all_reduce 16 ranks/2 nodes"}


def test_fit_without_link_rates_makes_the_faster_rate_the_link_and_ties_the_unmeasured_inter_tier():
    # A local-backend-like truth: send/recv is the faster path (p2p_efficiency 1), one node only.
    local = dataclasses.replace(TRUTH, p2p_efficiency=1.0, bus_efficiency=0.4, gpus_per_node=2,
                                inter_node=TRUTH.intra_node)
    cases = [(OpKind.ALL_REDUCE, PAIR), (OpKind.ALL_GATHER, PAIR), (OpKind.BROADCAST, PAIR), (OpKind.SEND, PAIR)]
    fit = fit_profile(_synthetic(local, cases), name="loc", description="d", gpus_per_node=2)
    got, want = _fields(fit.profile), _fields(local)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-7), key
    assert set(fit.not_fitted) == {"inter_node.latency_us", "inter_node.bandwidth_gbytes_per_s"}
    assert "Not fitted" in fit.profile.description and "residuals" in fit.profile.description


def test_fit_with_5_percent_noise_stays_within_monte_carlo_tolerances():
    # 400 seeds of 5% log-normal noise on these 55 points gave, as max relative deviations from truth.yaml:
    # bus_efficiency 6.3%, p2p 7.9%, inter bandwidth 9.3%, intra latency 23%, inter latency 12%, overheads
    # 32% (collective, a small intercept) / 9.2% (p2p), and max |prediction / truth - 1| over all points 8.5%.
    # Tolerances are about 1.4x those maxima (this seed is one draw of the same distribution).
    tol = {"intra_bw": 1e-12, "bus": 0.09, "p2p": 0.11, "inter_bw": 0.13, "intra_lat": 0.33, "inter_lat": 0.17,
           "oc": 0.45, "op": 0.13}
    fit = fit_profile(_synthetic(TRUTH, noise=0.05, seed=7), name="t", description="", gpus_per_node=8,
                      link_rates=TRUTH)
    got, want = _fields(fit.profile), _fields(TRUTH)
    for key, rel in tol.items():
        assert got[key] == pytest.approx(want[key], rel=rel), key
    fitted, truth = CostModel(fit.profile), CostModel(TRUTH)
    worst = max(abs(fitted.collective_us_placed(k, s, pl) / truth.collective_us_placed(k, s, pl) - 1)
                for s in SIZES for k, pl in CASES)
    assert worst < 0.12
    # The residuals against the noisy points are of the order of the noise (5% sigma over 11 sizes: < 4 sigma).
    assert all(r.max_rel_error < 0.20 for r in fit.residuals)


def test_fit_fixes_an_inseparable_latency_and_says_so():
    # 2 ranks, all_reduce only: overhead + 2 hops are one intercept; the latency is fixed (0), not fitted.
    fit = fit_profile(_synthetic(TRUTH, [(OpKind.ALL_REDUCE, PAIR)]), name="t", description="", gpus_per_node=2)
    assert "intra_node.latency_us" in fit.not_fitted and "p2p_overhead_us" in fit.not_fitted
    assert fit.profile.intra_node.latency_us == 0.0
    assert fit.profile.p2p_overhead_us == fit.profile.collective_overhead_us  # the tie
    assert "not separable" in fit.profile.description
    assert fit.max_rel_error(OpKind.ALL_REDUCE) < 1e-9  # one op: still reproduced exactly


def test_fit_refuses_unusable_measurements():
    flat = [Measurement(kind=OpKind.ALL_REDUCE, size_bytes=s, placement=PAIR, time_us=100.0) for s in SIZES]
    with pytest.raises(ValueError, match="grows with message size"):
        fit_profile(flat, name="t", description="", gpus_per_node=2)
    with pytest.raises(ValueError, match="single-node runs"):
        fit_profile(_synthetic(TRUTH, [(OpKind.ALL_REDUCE, TWO16)]), name="t", description="", gpus_per_node=8)
    with pytest.raises(ValueError, match="gpus_per_node=4"):
        fit_profile(_synthetic(TRUTH), name="t", description="", gpus_per_node=4)
    with pytest.raises(ValueError, match="no measurements"):
        fit_profile([], name="t", description="", gpus_per_node=2)
    with pytest.raises(ValueError, match="time_us"):
        Measurement(kind=OpKind.ALL_REDUCE, size_bytes=8, placement=PAIR, time_us=0.0)
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        Measurement(kind=OpKind.SEND, size_bytes=8, placement=ONE8, time_us=1.0)


def test_fit_yaml_round_trips_and_lists_every_measurement(tmp_path):
    fit = fit_profile(_synthetic(TRUTH), name="rt", description="d", gpus_per_node=8, link_rates=TRUTH)
    text = fit.to_yaml()
    assert profile_from_yaml(text) == fit.profile
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_profile(str(path)) == fit.profile
    comments = [line for line in text.splitlines() if line.startswith("# all_reduce ")]
    assert len(comments) == 2 * len(SIZES)  # one per measurement (two all_reduce placements)


# -- nccl-tests logs ----------------------------------------------------------------------------------


def test_committed_logs_are_what_generate_py_writes(tmp_path):
    generate.main(tmp_path)
    for path in tmp_path.iterdir():
        assert path.read_text() == (DATA / path.name).read_text(), f"regenerate {path.name}: generate.py"


def test_parse_nccl_tests_logs_in_both_formats():
    runs, empty = load_nccl_tests_dir(DATA)
    assert empty == []
    summary = sorted((r.test, r.num_ranks, r.num_nodes, len(r.rows)) for r in runs)
    assert summary == [("all_gather_perf", 8, 1, 11), ("all_reduce_perf", 8, 1, 11), ("all_reduce_perf", 16, 2, 11),
                       ("sendrecv_perf", 8, 1, 11)]
    two = next(r for r in runs if r.num_nodes == 2)  # the mpirun --tag-output file, NCCL INFO noise around it
    assert two.ranks_per_host == (("synth-node-01", 8), ("synth-node-02", 8))
    assert two.device == "NVIDIA H100 80GB HBM3"
    assert two.rows[0] == (1024, (34.81, 34.81))
    sr = next(r for r in runs if r.test == "sendrecv_perf")  # old format: named by its file name
    assert sr.kind is OpKind.SEND and sr.measurements()[0].placement.size == 2


def test_parse_nccl_tests_refuses_what_it_cannot_attribute():
    header = ("# nThread 1 nGpus 1 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20\n"
              "#  Rank  0 Group  0 Pid 1 on h device  0 [0x01] G\n#  Rank  1 Group  0 Pid 2 on h device  1 [0x02] G\n"
              "#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong\n"
              "  1024  256  float  sum  -1  10.0  0.1  0.2  0  10.0  0.1  0.2  0\n")
    assert parse_nccl_tests(header, source="x/all_reduce_perf.log")[0].rows == ((1024, (10.0, 10.0)),)
    with pytest.raises(ValueError, match="names no test"):
        parse_nccl_tests(header, source="x/run1.log")
    with pytest.raises(ValueError, match="no cost-model formula"):
        parse_nccl_tests("# Collective test starting: hypercube_perf\n" + header, source="x.log")
    with pytest.raises(ValueError, match="more than once"):
        parse_nccl_tests(header.replace("Rank  1", "Rank  0"), source="all_reduce_perf.log")
    no_ranks = "\n".join(line for line in header.splitlines() if "Rank" not in line)
    with pytest.raises(ValueError, match="cannot tell ranks"):
        parse_nccl_tests(no_ranks, source="all_reduce_perf.log")
    assert parse_nccl_tests("no table here", source="all_reduce_perf.log") == []


def test_fit_from_nccl_tests_recovers_the_generating_profile():
    # Times are printed with 3-4 significant digits (%7.2f of 5-17 us: +-0.005 us = 3e-4 relative): 1e-3 tolerance.
    fit = nccl_tests_fit(DATA)
    got, want = _fields(fit.profile), _fields(TRUTH)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    assert fit.profile.gpus_per_node == 8 and fit.not_fitted == ()
    assert "dgx-h100" in fit.profile.description  # the base picked from the GPU name
    assert all(r.max_rel_error < 2e-3 for r in fit.residuals)
    assert fit_from_nccl_tests(DATA) == fit.profile


def test_fit_from_single_node_logs_takes_the_inter_tier_from_the_base(tmp_path):
    for name in ("node1_8gpu_collectives.log", "sendrecv_perf.node1_8gpu.log"):
        (tmp_path / name).write_text((DATA / name).read_text())
    fit = nccl_tests_fit(tmp_path, base="dgx-a100")
    a100 = load_profile("dgx-a100")
    assert set(fit.not_fitted) == {"inter_node.latency_us", "inter_node.bandwidth_gbytes_per_s"}
    assert fit.profile.inter_node == a100.inter_node
    # A100's 300 GB/s NVLink is below the fitted 324 GB/s collective rate: the link rate is raised, and said.
    assert fit.profile.intra_node.bandwidth_gbytes_per_s == pytest.approx(450 * 0.72, rel=1e-3)
    assert "link rate raised" in fit.profile.description


# -- command line -------------------------------------------------------------------------------------


def test_cli_calibrate_from_nccl_tests_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "cluster.yaml"
    assert main(["calibrate", "--from-nccl-tests", str(DATA), "--name", "synth", "--out", str(out)]) == 0
    profile = load_profile(str(out))
    assert profile.name == "synth"
    assert profile.inter_node.latency_us == pytest.approx(12.0, rel=1e-3)
    assert out.read_text().startswith("# prism calibrate: profile 'synth'")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "1001,4K"], "multiple of 8 bytes"),
        (["--ops", "all_reduce,alltoall"], "unknown op 'alltoall'"),
        (["--processes", "1"], "num_processes"),
        (["--repeats", "1"], "repeats"),
        (["--base", "dgx-h100"], "--base only applies"),
        (["--sizes", "4X"], "size '4X'"),
        (["--from-nccl-tests", "/nonexistent"], "not a directory"),
    ],
)
def test_cli_calibrate_rejects_bad_input_before_any_process(tmp_path, capsys, argv, message):
    assert main(["calibrate", "--out", str(tmp_path / "p.yaml"), *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "p.yaml").exists()


def test_the_calibrate_verb_lives_in_the_cli_and_the_measuring_in_the_runtime() -> None:
    import prism_plugin.runtime.calibrate as measuring
    from prism_plugin.cli.calibrate import _parse_size, add_calibrate_parser
    from prism_plugin.config.errors import ConfigError

    assert callable(add_calibrate_parser) and not hasattr(measuring, "add_calibrate_parser")
    assert (_parse_size("4K"), _parse_size("64MiB"), _parse_size("1000")) == (4096, 2**26, 1000)
    with pytest.raises(ConfigError, match="size '4X'"):
        _parse_size("4X")
    with pytest.raises(ConfigError, match="num_processes must be an integer >= 2, got 1"):
        measuring.CalibrationPlan(num_processes=1)


# -- a real calibration (2 gloo processes) ------------------------------------------------------------


@pytest.mark.slow
def test_real_gloo_calibration_predicts_a_size_it_was_not_fitted_on():
    """Two local gloo processes; 4 fitted sizes, 8 MiB held out and predicted.

    Tolerance, from measurements on this 2-core VM (interleaved rounds, median of 7): the run-to-run spread
    of the medians at 1-16 MiB was 6-20% with the machine to ourselves and up to 45% while other jobs ran;
    an affine fit of gloo's all_reduce / send over 256 KiB..16 MiB misses the 8 MiB point by 2-15% (cache
    effects make gloo slightly super-linear). Hence 35%, plus twice this run's own IQR/median at the
    held-out size (the machine's noise right now: 20-95% under load average 8), capped at 100% (a factor 2).
    Ten runs of this test under load average 8 missed by 0-38% against tolerances of 74-100%.
    """
    from prism_plugin.runtime.calibrate import CalibrationPlan, measure_collectives

    held_out = 2**23
    plan = CalibrationPlan(backend="gloo", num_processes=2, sizes_bytes=(2**18, 2**20, 2**22, held_out, 2**24),
                           repeats=7, warmup=1)
    ms = measure_collectives(plan)
    assert len(ms) == 5 * 5 and all(len(m.samples_us) == 7 for m in ms)
    # Fit all_reduce and send, the two ops whose gloo cost the model's shape captures (own rate, own overhead).
    fitted = [m for m in ms if m.size_bytes != held_out and m.kind in (OpKind.ALL_REDUCE, OpKind.SEND)]
    fit = fit_profile(fitted, name="t", description="", gpus_per_node=2)
    model = CostModel(fit.profile)
    for m in ms:
        if m.size_bytes != held_out or m.kind not in (OpKind.ALL_REDUCE, OpKind.SEND):
            continue
        q1, _, q3 = statistics.quantiles(m.samples_us, n=4)
        tolerance = min(0.35 + 2 * (q3 - q1) / m.time_us, 1.0)
        predicted = model.collective_us_placed(m.kind, m.size_bytes, m.placement)
        assert abs(predicted - m.time_us) <= tolerance * m.time_us, (m.kind, predicted, m.time_us, tolerance)
    # Every op fitted together: a loadable profile that says the two tiers are one loopback.
    every = fit_profile([m for m in ms if m.size_bytes != held_out], name="local", gpus_per_node=2,
                        description="2 gloo processes; intra- and inter-node links are the same loopback")
    assert profile_from_yaml(every.to_yaml()) == every.profile
    assert every.profile.inter_node == every.profile.intra_node
    assert {r.kind for r in every.residuals} == set(plan.ops)


def test_compute_gap_and_mean_statistic_are_validated_and_applied() -> None:
    """`--compute-gap-us` / `--statistic` (training-like timing): checked up front; mean keeps the tail."""
    from prism_plugin.runtime.calibrate import CalibrationPlan, _medians

    with pytest.raises(ValueError, match="compute-gap-us"):
        CalibrationPlan(compute_gap_us=-1.0)
    with pytest.raises(ValueError, match="--statistic"):
        CalibrationPlan(statistic="p99")
    plan = CalibrationPlan(sizes_bytes=(64, 128), ops=(OpKind.ALL_REDUCE,), repeats=3, statistic="mean")
    # ns stamps: every rank starts at 0; the op ends after 1, 1 and 7 ms (a tail, as a woken process pays)
    stamps = {f"all_reduce/{s}": ([0, 0, 0], [1_000_000, 1_000_000, 7_000_000]) for s in (64, 128)}
    (m, _) = _medians(plan, {0: stamps, 1: stamps})
    assert m.time_us == pytest.approx(3000.0)  # mean; the median would say 1000
