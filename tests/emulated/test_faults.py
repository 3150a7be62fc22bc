"""Faults and what-ifs (issue 7): spec parsing and validation (tier a), live faults on one real rank (tier b)."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.channel import config_from_env, config_to_env
from prism_plugin.config.emulation import ConfigError, EmulationConfig, VirtualWorld
from prism_plugin.config.faults import Crash, Hang, Jitter, Kill, SlowLink, Straggler, parse_fault, parse_faults
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.faults import FaultSet, jitter_factor
from prism_plugin.graph.steady import steady_state
from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph

GLOO = CostModel(load_profile("local-cpu-gloo"))


# -- specs (tier a) -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "spec"), [
    ("straggler:ranks=4-7,factor=1.3,from_step=2", Straggler(ranks=(4, 5, 6, 7), factor=1.3, from_step=2)),
    ("straggler:rank=3,factor=2", Straggler(ranks=(3,), factor=2.0)),
    ("straggler:ranks=0-2+5+8-9,factor=1.1", Straggler(ranks=(0, 1, 2, 5, 8, 9), factor=1.1)),
    ("link:nodes=0/1,bandwidth=0.25", SlowLink(side_a=(0,), side_b=(1,), bandwidth=0.25)),
    ("link:ranks=0-1/8,bandwidth=0.5", SlowLink(side_a=(0, 1), side_b=(8,), bandwidth=0.5, by_node=False)),
    ("jitter:sigma=0.05,seed=7", Jitter(sigma=0.05, seed=7)),
    ("hang:rank=1,group=tp,op=3", Hang(rank=1, group="tp", op=3)),
    ("crash:rank=5,step=2", Crash(rank=5, step=2)),
    ("kill:rank=0,step=3", Kill(rank=0, step=3)),
])
def test_fault_strings_parse_and_round_trip(text: str, spec) -> None:
    assert parse_fault(text) == spec
    assert parse_fault(spec.to_text()) == spec


@pytest.mark.parametrize(("text", "words"), [
    ("slow:rank=1", ["unknown kind 'slow'", "straggler"]),
    ("straggler:ranks=1", ["needs factor"]),
    ("straggler:ranks=1,factor=0", ["factor=0.0", "> 0"]),
    ("straggler:ranks=1,factor=1.5,speed=2", ["no field 'speed'", "from_step"]),
    ("link:nodes=0,bandwidth=0.5", ["two sides A/B"]),
    ("link:nodes=0/1,bandwidth=1.5", ["bandwidth=1.5", "(0, 1]"]),
    ("link:nodes=0/0,bandwidth=0.5", ["disjoint"]),
    ("hang:rank=1,op=0", ["op=0", ">= 1"]),
    ("crash:step=1", ["needs rank"]),
    ("jitter:sigma=x", ["sigma='x'", "float"]),
])
def test_bad_fault_strings_name_the_field_and_the_fix(text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fault(text)
    for word in words:
        assert word in str(info.value)


def test_config_checks_fault_ranks_against_the_world_and_round_trips_through_launch_env() -> None:
    world = VirtualWorld(world_size=16, real_ranks=(0, 9), gpus_per_node=8)
    faults = ("straggler:ranks=4-7,factor=1.3,from_step=2", "link:nodes=0/1,bandwidth=0.25",
              "jitter:sigma=0.05,seed=7", "hang:rank=1,group=tp,op=3", "crash:rank=5,step=2", "kill:rank=9,step=3")
    config = EmulationConfig(world=world, faults=faults)
    assert config.faults == parse_faults(faults)
    assert config_from_env(config_to_env(config)) == config
    for bad, words in [("straggler:ranks=16,factor=2", "outside the job's 0..15"),
                       ("hang:rank=9", "rank 9 is a real rank"), ("crash:rank=0", "real rank"),
                       ("kill:rank=3", "rank 3 is virtual")]:
        with pytest.raises(ConfigError, match=words):
            EmulationConfig(world=world, faults=(bad,))


def test_fault_set_questions_and_seeded_jitter() -> None:
    fs = FaultSet(parse_faults(["straggler:ranks=4-7,factor=1.5,from_step=2", "straggler:ranks=6,factor=2",
                                "link:nodes=0/1,bandwidth=0.25", "jitter:sigma=0.1,seed=7"]), 16, 8)
    assert fs.straggler_factor((0, 4), step=1) == (1.0, -1)  # before from_step=2
    assert fs.straggler_factor((0, 4), step=2) == (1.5, 4)
    assert fs.straggler_factor(range(16), step=5) == (2.0, 6)  # the slowest member is blamed
    assert fs.link_factor((0, 1, 2)) == 1.0 and fs.link_factor((0, 8)) == 4.0
    draws = [fs.jitter("dp", k) for k in range(200)]
    assert draws == [fs.jitter("dp", k) for k in range(200)]  # same seed, same draws
    assert draws != [FaultSet(parse_faults(["jitter:sigma=0.1,seed=8"]), 16, 8).jitter("dp", k) for k in range(200)]
    logs = [__import__("math").log(d) for d in draws]  # log-normal: log factor ~ N(0, 0.1)
    assert abs(statistics.mean(logs)) < 0.03 and 0.08 < statistics.stdev(logs) < 0.12
    assert jitter_factor(0.0, 1, "x", 1) == 1.0


# -- live faults on one real rank (tier b) ----------------------------------------------------------------
@pytest.fixture
def emulate():
    def start(world_size: int, rank: int, **kwargs) -> P.Session:
        return P.activate(EmulationConfig(world=VirtualWorld(world_size=world_size, real_ranks=(rank,),
                                                             gpus_per_node=2), **kwargs))

    yield start
    P.deactivate()


COMPUTE_S = 0.06
GRAD_BYTES = 1 << 20


def _dp_steps(steps: int) -> list[float]:
    """One real DP replica: mark, compute COMPUTE_S, all-reduce the gradients; each step's wall time."""
    grad = torch.zeros(GRAD_BYTES // 4)
    times = []
    for _ in range(steps):
        P.mark_iteration()
        t0 = time.perf_counter()
        time.sleep(COMPUTE_S)
        dist.all_reduce(grad)
        times.append(time.perf_counter() - t0)
    return times


def _replayed_step_us(stragglers: dict[int, float] | None) -> float:
    job = SyntheticJob(tp=1, pp=1, dp=4, num_microbatches=1, fwd_us=COMPUTE_S * 1e6 / 3,
                       bwd_us=COMPUTE_S * 2e6 / 3, activation_bytes=0, grad_bytes=GRAD_BYTES)
    return steady_state(build_1f1b_graph(job), GLOO, stragglers=stragglers).rank_step_us(0)


def test_straggler_dp_replica_slows_the_real_rank_by_what_the_replay_predicts(emulate) -> None:
    emulate(4, 0, faults=("straggler:ranks=2,factor=1.5,from_step=6",), iteration_marker="explicit")
    times = _dp_steps(10)
    summary = P.deactivate()
    # step 1 warms up (first-op overhead); CPU noise only adds time, so the fastest step of each kind is compared
    # (4 healthy steps, 5 slow ones: with 2 healthy ones, a loaded machine once slowed both by 8 ms)
    healthy, slow = min(times[1:5]), min(times[5:])
    predicted_s = (_replayed_step_us({2: 1.5}) - _replayed_step_us(None)) * 1e-6
    assert predicted_s == pytest.approx(0.5 * COMPUTE_S, rel=1e-6)  # the replay: 50% of 60 ms = 30 ms
    # live: the straggler arrives at t0 + 1.5 * (own arrival - t0); own arrival - t0 is the 60 ms sleep plus
    # its overshoot (< 1 ms), of which half is added again; a healthy step also pays the op's issue overhead
    # (~0.5 ms), which a slow step hides in its wait: 6 ms covers both with margin
    assert slow - healthy == pytest.approx(predicted_s, abs=0.006)
    faults = summary["faults"]
    assert [s["step"] for s in faults["steps"]] == [6, 7, 8, 9, 10]
    for s in faults["steps"]:
        assert s["blame_chain"] == [0, 2] and s["waited_on"][0]["rank"] == 2
        assert s["waited_s"] == pytest.approx(0.5 * COMPUTE_S, abs=0.006)
        assert s["longest_wait"]["op"] == "all_reduce"


def test_slow_link_and_jitter_scale_the_modelled_cost(emulate) -> None:
    emulate(4, 0, faults=("link:nodes=0/1,bandwidth=0.25",), iteration_marker="explicit")
    session = P.current_session()
    grad = torch.zeros(GRAD_BYTES // 4)
    intra = dist.new_group([0, 1])  # node 0 only (2 ranks per node)
    cross = dist.new_group([0, 2])  # node 0 - node 1: the degraded link
    w_intra = dist.all_reduce(grad, group=intra, async_op=True)
    w_cross = dist.all_reduce(grad, group=cross, async_op=True)
    base_cross = session.cost_model.collective_us_placed(
        "all_reduce", GRAD_BYTES, session.cost_model.placement((0, 2))) * 1e-6
    assert w_cross.cost_s == pytest.approx(4 * base_cross, rel=1e-9)
    assert w_intra.cost_s == pytest.approx(session.cost_model.collective_us_placed(
        "all_reduce", GRAD_BYTES, session.cost_model.placement((0, 1))) * 1e-6, rel=1e-9)
    w_intra.wait()
    w_cross.wait()


def test_jitter_is_deterministic_with_a_seed(emulate) -> None:
    emulate(4, 0, faults=("jitter:sigma=0.2,seed=11",), iteration_marker="explicit")
    grad = torch.zeros(1024)
    costs = [dist.all_reduce(grad, async_op=True).cost_s for _ in range(6)]
    P.deactivate()
    emulate(4, 0, faults=("jitter:sigma=0.2,seed=11",), iteration_marker="explicit")
    again = [dist.all_reduce(grad, async_op=True).cost_s for _ in range(6)]
    P.deactivate()
    emulate(4, 0, iteration_marker="explicit")
    plain = [dist.all_reduce(grad, async_op=True).cost_s for _ in range(6)]
    assert costs == again
    assert len(set(costs)) == 6 and costs != plain
    for c, p in zip(costs, plain, strict=True):
        assert 0.3 < c / p < 3.0  # exp(0.2 z), |z| < 5.5


def test_hung_virtual_tp_peer_raises_the_gloo_timeout_on_the_real_rank(emulate) -> None:
    timeout_s = 2.0
    emulate(4, 0, timeout_s=timeout_s, faults=("hang:rank=1,group=tp,op=3",), iteration_marker="explicit")
    tp = dist.new_group([0, 1], group_desc="tp")
    dp = dist.new_group([0, 2])
    t = torch.ones(8)
    dist.all_reduce(t, group=tp)
    dist.all_reduce(t, group=dp)  # not a tp group: not counted
    dist.all_reduce(t, group=tp)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"Timed out waiting 2000ms for recv operation to complete"):
        dist.all_reduce(t, group=tp)  # the 3rd tp op: rank 1 never arrives
    elapsed = time.perf_counter() - start
    assert timeout_s <= elapsed < timeout_s + 0.5  # the job's timeout, no more (margin: one loaded CI core)
    dist.all_reduce(t, group=dp)  # groups without the hung rank still work
    summary = P.deactivate()
    (event,) = summary["faults"]["events"]
    assert (event["event"], event["rank"], event["op"], event["blame_chain"]) == ("hang", 1, "all_reduce", [0, 1])


def test_crashed_virtual_rank_fails_the_next_op_with_the_peer_closed_error(emulate) -> None:
    emulate(4, 0, timeout_s=30.0, faults=("crash:rank=3,step=2",), iteration_marker="explicit")
    t = torch.ones(8)
    P.mark_iteration()
    dist.all_reduce(t)  # step 1: rank 3 alive
    P.mark_iteration()
    dist.all_reduce(t, group=dist.new_group([0, 2]))  # step 2, a group without rank 3
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"Read error \[virtual rank 3\]: Connection reset by peer"):
        dist.all_reduce(t)
    assert time.perf_counter() - start < 0.5  # at once, not after the 30 s timeout
    summary = P.deactivate()
    assert summary["faults"]["events"][0]["event"] == "crash"
    json.dumps(summary)


def test_hybrid_rank_sees_the_straggler_through_the_graph_replay(emulate, tmp_path) -> None:
    job = SyntheticJob(tp=1, pp=1, dp=4, num_microbatches=1, fwd_us=COMPUTE_S * 1e6 / 3,
                       bwd_us=COMPUTE_S * 2e6 / 3, activation_bytes=0, grad_bytes=GRAD_BYTES)
    graph = build_1f1b_graph(job).save(tmp_path / "dp4.graph")
    emulate(4, 0, graph=graph, faults=("straggler:ranks=2,factor=1.5",), iteration_marker="explicit")
    times = _dp_steps(5)
    summary = P.deactivate()
    predicted_s = _replayed_step_us({2: 1.5}) * 1e-6  # 1.5 * 60 ms + the all-reduce's cost
    # the virtual members arrive when the faulty replay says (90 ms after the mark); this rank's own 60 ms
    # of compute hides under it, so the step is the prediction plus issue overhead (< 4 ms on a loaded core)
    assert min(times[1:]) == pytest.approx(predicted_s, abs=0.004)
    assert summary["graph"]["ops_replayed"] == 5
    blame = summary["faults"]["replay_blame"]
    assert blame["root_rank"] == 2 and blame["waited_us"] == pytest.approx(0.5 * COMPUTE_S * 1e6, rel=1e-6)
    assert [s["waited_on"][0]["rank"] for s in summary["faults"]["steps"]] == [2] * 5


def test_straggler_delays_overlapped_gradient_buckets_from_the_step_start(emulate) -> None:
    """Two async buckets (DDP style): the second is issued while the first still runs, so the straggler's
    lateness on it counts from the iteration start, not from the first bucket's end."""
    emulate(4, 0, faults=("straggler:ranks=3,factor=1.5",), iteration_marker="explicit")
    t = torch.zeros(1024)
    P.mark_iteration()
    start = P.current_session().clock.iteration_start_s
    # Times are read before and after each call, not taken from the sleeps: the op reads this rank's time somewhere
    # inside the call, and a loaded host can stall for tens of milliseconds anywhere (measured once: 35 ms between
    # the read before a call and the op's own); the 1.5 ms margins cover the reads themselves.
    time.sleep(0.04)
    own1 = time.perf_counter() - start
    w1 = dist.all_reduce(t, async_op=True)
    own1_after = time.perf_counter() - start
    time.sleep(0.03)
    own2 = time.perf_counter() - start
    w2 = dist.all_reduce(t.clone(), async_op=True)
    own2_after = time.perf_counter() - start
    late1, late2 = w1.arrival_s - start, w2.arrival_s - start  # the straggler's arrivals, 1.5 x this rank's
    assert 1.5 * own1 - 0.0015 <= late1 <= 1.5 * own1_after + 0.0015
    assert 1.5 * own2 - 0.0015 <= late2 <= 1.5 * own2_after + 0.0015  # from the step's start, not w1's end
    w1.wait()
    w2.wait()
    done = time.perf_counter() - start
    assert late2 + w2.cost_s <= done <= late2 + w2.cost_s + 0.004 + 0.2 * (done - own2)
    # a blocking op (waited for) is a synchronisation point: the next op's lateness counts from its end
    sync = w2.arrival_s + w2.cost_s
    time.sleep(0.02)
    own3 = time.perf_counter() - sync
    w3 = dist.all_reduce(t, async_op=True)
    own3_after = time.perf_counter() - sync
    assert 1.5 * own3 - 0.0015 <= w3.arrival_s - sync <= 1.5 * own3_after + 0.0015
    w3.wait()


def test_failed_op_future_carries_the_error(emulate) -> None:
    emulate(4, 0, timeout_s=0.3, faults=("hang:rank=2,op=1",), iteration_marker="explicit")
    future = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    with pytest.raises(RuntimeError, match="Timed out waiting 300ms"):
        future.wait()
