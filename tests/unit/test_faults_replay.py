"""Faults in the replay (issue 7), tier (a): stragglers, degraded links, seeded jitter, blame chains, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_plugin.cli.main import build_config, make_parser
from prism_plugin.cli.main import main as prism_main
from prism_plugin.config.emulation import ConfigError
from prism_plugin.config.faults import parse_faults
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.faults import FaultSet
from prism_plugin.graph.blame import blame_chain, blame_report
from prism_plugin.graph.replay import ReplayMode, replay
from prism_plugin.graph.steady import steady_state
from prism_plugin.graph.synthetic import SyntheticJob, build_1f1b_graph

H100 = CostModel(load_profile("dgx-h100"))  # 8 GPUs per node
PIPE = build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=2, num_microbatches=4, fwd_us=100.0, bwd_us=200.0,
                                     activation_bytes=1 << 20, grad_bytes=1 << 24))
DP16 = build_1f1b_graph(SyntheticJob(tp=1, pp=1, dp=16, num_microbatches=1, fwd_us=100.0, bwd_us=200.0,
                                     activation_bytes=0, grad_bytes=1 << 24))


def test_straggler_fault_replays_like_the_straggler_what_if() -> None:
    by_fault = replay(PIPE, H100, faults=parse_faults(["straggler:ranks=3,factor=1.5"]))
    by_dict = replay(PIPE, H100, stragglers={3: 1.5})
    healthy = replay(PIPE, H100)
    assert by_fault.iteration_time_us(0) == by_dict.iteration_time_us(0)
    # rank 3 (stage 1 of replica 1): 4 micro-batches x (100 + 200) us x 0.5 more compute = 600 us later
    assert by_fault.iteration_time_us(0) - healthy.iteration_time_us(0) == pytest.approx(600.0, abs=1e-6)


def test_degraded_link_divides_the_bandwidth_of_ops_crossing_it() -> None:
    healthy = replay(DP16, H100)
    slow = replay(DP16, H100, faults=parse_faults(["link:nodes=0/1,bandwidth=0.25"]))
    cost_us = H100.collective_us_placed(OpKind.ALL_REDUCE, 1 << 24, H100.placement(range(16)))
    assert healthy.breakdown(0).exposed_comm_us == pytest.approx(cost_us, rel=1e-9)
    assert slow.breakdown(0).exposed_comm_us == pytest.approx(4 * cost_us, rel=1e-9)  # the DP group spans nodes 0-1
    assert slow.num_actors == 16  # links force the full replay
    inside = replay(DP16, H100, faults=parse_faults(["link:ranks=0/1,bandwidth=0.5"]))
    assert inside.breakdown(5).exposed_comm_us == pytest.approx(2 * cost_us, rel=1e-9)  # every rank's group holds 0, 1


def test_jitter_is_seeded_and_folding_stays_exact() -> None:
    def step(seed: int, mode: ReplayMode) -> float:
        return steady_state(PIPE, H100, faults=parse_faults([f"jitter:sigma=0.2,seed={seed}"])).step_us if \
            mode is ReplayMode.AUTO else replay(PIPE, H100, mode=mode,
                                                faults=parse_faults([f"jitter:sigma=0.2,seed={seed}"])).iteration_time_us()

    assert step(7, ReplayMode.AUTO) == step(7, ReplayMode.AUTO)
    assert step(7, ReplayMode.AUTO) != step(8, ReplayMode.AUTO) != steady_state(PIPE, H100).step_us
    folded = replay(PIPE, H100, faults=parse_faults(["jitter:sigma=0.2,seed=7"]))
    full = replay(PIPE, H100, mode=ReplayMode.FULL, faults=parse_faults(["jitter:sigma=0.2,seed=7"]))
    assert folded.num_actors < full.num_actors
    assert all(folded.iteration_time_us(r) == full.iteration_time_us(r) for r in range(4))


def test_blame_chain_runs_from_the_real_rank_back_to_the_straggler() -> None:
    result = replay(PIPE, H100, faults=parse_faults(["straggler:ranks=3,factor=1.5"]))
    chain = blame_chain(result, 0)
    # rank 0 waits in the DP all-reduce on rank 1 (its replica-1 peer), which waited on stage 1 of replica 1
    # (rank 3) in the pipeline; rank 3 was computing: the root
    assert [(h["rank"], h["on_rank"]) for h in chain] == [(0, 1), (1, 3), (3, None)]
    assert chain[0]["waited_us"] == pytest.approx(600.0, abs=1e-6) and chain[0]["op"].startswith("all_reduce dp")
    healthy = blame_chain(replay(PIPE, H100), 0)  # healthy: only 1F1B's own bubble, on the next stage (folded)
    assert [(h["rank"], h["on_rank"], h["waited_us"]) for h in healthy] == [(0, 2, 200.0), (2, None, 0.0)]
    state = steady_state(PIPE, H100, faults=parse_faults(["straggler:ranks=3,factor=1.5"]))
    report = blame_report(state.result, [0], steps=3)
    assert [(row["step"], row["root_rank"]) for row in report["0"]] == [(0, 3), (1, 3), (2, 3)]


def test_prism_replay_and_run_take_fault_flags(tmp_path: Path, capsys) -> None:
    graph = PIPE.save(tmp_path / "job.graph")
    png = tmp_path / "blame.png"
    rc = prism_main(["replay", str(graph), "--profile", "dgx-h100", "--fault", "straggler:ranks=3,factor=1.5",
                     "--fault", "jitter:sigma=0.0,seed=1", "--ranks", "0", "--json", "--blame-plot", str(png)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["faults"] == ["straggler:ranks=3,factor=1.5,from_step=0", "jitter:sigma=0.0,seed=1"]
    assert [row["root_rank"] for row in out["blame"]["0"]] == [3, 3, 3]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    trace_path = tmp_path / "blame.json"
    assert prism_main(["replay", str(graph), "--profile", "dgx-h100", "--fault", "straggler:ranks=3,factor=1.5",
                       "--ranks", "0-3", "--iterations", "1", "--chrome-trace", str(trace_path)]) == 0
    events = json.loads(trace_path.read_text())["traceEvents"]
    waits = [ev for ev in events if ev.get("cat") == "bubble" and ev["pid"] == 0 and ev["name"] == "wait for peers"]
    longest = max(waits, key=lambda ev: ev["dur"])
    assert longest["args"]["waited_on_rank"] == 1 and longest["dur"] == pytest.approx(600.0, abs=1e-6)
    flows = [ev for ev in events if ev.get("cat") == "blame"]
    assert flows and {ev["ph"] for ev in flows} == {"s", "f"} and len(flows) % 2 == 0
    assert prism_main(["replay", str(graph), "--fault", "straggler:ranks=3"]) == 2  # ConfigError: exit 2
    args = make_parser().parse_args(["run", "--world-size", "16", "--real-ranks", "0", "--fault", "crash:rank=5,step=2",
                                     "--fault", "hang:rank=1,group=tp,op=3", "--", "x.py"])
    faults = [f.to_text() for f in build_config(args).faults]
    assert faults == ["crash:rank=5,step=2", "hang:rank=1,op=3,group=tp,step=0"]


def test_megatron_and_deepspeed_forms_of_faults() -> None:
    from prism_plugin.adapters.deepspeed.section import parse_section
    from prism_plugin.adapters.megatron.wrapper import job_timeout_s, split_prism_flags

    rest, flags = split_prism_flags(["pretrain_gpt.py", "--tp", "2", "--prism-world-size", "16",
                                     "--prism-real-ranks", "0", "--prism-fault", "straggler:ranks=4-7,factor=1.3",
                                     "--prism-fault=hang:rank=1,group=tp,op=3", "--distributed-timeout-minutes", "2"])
    config = flags.to_config()
    assert rest == ["pretrain_gpt.py", "--tp", "2", "--distributed-timeout-minutes", "2"]
    assert [f.to_text() for f in config.faults] == ["straggler:ranks=4-7,factor=1.3,from_step=0",
                                                    "hang:rank=1,op=3,group=tp,step=0"]
    assert config.timeout_s == 600.0  # Megatron's default --distributed-timeout-minutes 10
    assert job_timeout_s(rest[1:]) == 120.0  # the job's own flag wins in run()
    _, flags = split_prism_flags(["--prism-world-size", "16", "--prism-real-ranks", "0", "--prism-timeout", "3"])
    assert flags.to_config().timeout_s == 3.0
    with pytest.raises(ConfigError, match="kill stops a real rank"):
        split_prism_flags(["--prism-world-size", "16", "--prism-real-ranks", "0",
                           "--prism-fault", "kill:rank=3"])[1].to_config()
    section = parse_section({"train_batch_size": 16, "prism": {
        "world_size": 16, "real_ranks": [0], "faults": ["crash:rank=5,step=2", "link:nodes=0/1,bandwidth=0.5"]}})
    assert [f.to_text() for f in section.emulation.faults] == ["crash:rank=5,step=2",
                                                               "link:nodes=0/1,bandwidth=0.5"]
    with pytest.raises(ConfigError, match='"prism" section: .*unknown kind'):
        parse_section({"train_batch_size": 16, "prism": {"world_size": 16, "real_ranks": [0], "faults": ["slow:x"]}})


TP2DP2 = build_1f1b_graph(SyntheticJob(tp=2, pp=2, dp=2, num_microbatches=2, fwd_us=100.0, bwd_us=200.0,
                                       activation_bytes=1 << 16, grad_bytes=1 << 20))


def test_hang_in_the_replay_blocks_ranks_transitively_and_times_them_out() -> None:
    from prism_plugin.config.faults import Hang
    from prism_plugin.graph.fault_replay import failure_replay

    # ranks: tp fastest, then dp, then pp; rank 1 = (tp 1, dp 0, pp 0): its TP peer is rank 0
    report = failure_replay(TP2DP2, H100, Hang(rank=1, op=2, group="tp", step=1), timeout_s=5.0)
    assert report.faulty_rank == 1 and report.stopped_before.startswith("all_reduce tp")
    assert sorted(report.blocked) == [0, 2, 3, 4, 5, 6, 7]  # everybody else ends up blocked
    zero = report.blocked[0]
    assert zero["waiting_on"] == [1] and zero["blame_chain"] == [0, 1] and zero["op"].startswith("all_reduce tp")
    assert zero["since_us"] == pytest.approx(report.stopped_at_us, abs=1e-3)  # TP peers arrive together
    assert zero["raises_at_us"] == pytest.approx(zero["since_us"] + 5e6, abs=1e-3)  # the job's timeout later
    for r, entry in report.blocked.items():
        assert entry["blame_chain"][0] == r and entry["blame_chain"][-1] == 1  # every chain ends at the hung rank
    healthy_step_us = steady_state(TP2DP2, H100).step_us
    assert healthy_step_us < report.stopped_at_us < 2 * healthy_step_us  # 2nd tp op of copy 1 (0-based)


def test_crash_in_the_replay_fails_its_partners_at_once(capsys, tmp_path: Path) -> None:
    from prism_plugin.config.faults import Crash
    from prism_plugin.graph.fault_replay import failure_replay

    report = failure_replay(TP2DP2, H100, Crash(rank=5, step=1), timeout_s=5.0)
    first_copy = replay(TP2DP2, H100)  # rank 5 dies when it ends step 0 (copy 0) and would start step 1
    assert report.stopped_at_us == pytest.approx(first_copy.iteration_time_us(5), rel=1e-9)
    four = report.blocked[4]  # rank 5's TP peer: its op with the dead rank fails when it arrives
    assert four["waiting_on"] == [5] and four["raises_at_us"] == four["since_us"]
    graph = TP2DP2.save(tmp_path / "job.graph")
    assert prism_main(["replay", str(graph), "--profile", "dgx-h100", "--fault", "hang:rank=1,op=2,group=tp,step=1",
                       "--fault", "straggler:ranks=6,factor=1.2", "--timeout", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (failure,) = out["failures"]
    assert failure["faulty_rank"] == 1 and failure["blocked"]["0"]["blame_chain"] == [0, 1]
    assert out["faults"][1].startswith("straggler:ranks=6")


def test_nccl_watchdog_message_on_cuda_ops() -> None:
    from types import SimpleNamespace

    import torch

    from prism_plugin.comm.context import OpEvent
    from prism_plugin.runtime.live_faults import LiveFaults

    clock = SimpleNamespace(iteration=0, iteration_start_s=0.0)
    live = LiveFaults(FaultSet(parse_faults(["hang:rank=1,op=1"]), 4, 2), 0, clock, 600.0)
    vg = SimpleNamespace(global_ranks=(0, 1), all_real=False, is_world=False, name="tp0", desc="",
                         group_rank_of=lambda r: r if r in (0, 1) else None)
    received = [SimpleNamespace(device=torch.device("cuda"), numel=lambda: 4096)]  # a CUDA tensor's fields
    event = OpEvent(OpKind.ALL_REDUCE, vg, 7, 4096 * 4, None, received, 10.0, 10.0, 0.001, 0.001)
    live.on_op(event)
    failure = event.failure
    assert event.device_type == "cuda" and event.numel == 4096
    assert failure is not None and failure.raise_at_s == 610.0
    assert str(failure.error) == ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                                  "OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600001 "
                                  "milliseconds before timing out.")


def test_hybrid_straggler_from_step_changes_the_replayed_arrivals_at_that_mark(tmp_path: Path) -> None:
    from prism_plugin.device.op_clock import EmulationClock
    from prism_plugin.graph.steady import ArrivalTable
    from prism_plugin.runtime.arrivals import fault_phases, load_arrivals

    faults = parse_faults(["straggler:ranks=2,factor=1.5,from_step=2", "link:ranks=0/2,bandwidth=0.5"])
    phases = fault_phases(faults)
    assert [(b, [f.kind for f in active]) for b, active in phases] == [(0, ["link"]), (2, ["straggler", "link"])]
    path = PIPE.save(tmp_path / "job.graph")
    arrivals = load_arrivals(path, H100, 0, (0,), PIPE.layout.world_size, EmulationClock(), faults)
    before = ArrivalTable.for_rank(steady_state(PIPE, H100, faults=phases[0][1]), 0, (0,))
    after = ArrivalTable.for_rank(steady_state(PIPE, H100, faults=faults), 0, (0,))
    assert after.step_us > before.step_us and after.p2p != before.p2p  # rank 2 is rank 0's next stage
    seen = []
    for step in (1, 2, 3):  # the iteration counter at each mark: step 1 starts at the first mark
        arrivals.on_iteration(step)
        seen.append(arrivals.table.p2p)
    assert seen == [before.p2p, after.p2p, after.p2p]
    phases_out = arrivals.summary()["phases"]
    assert [p["from_step"] for p in phases_out] == [0, 2]
    assert phases_out[1]["predicted_step_ms"] == pytest.approx(after.step_us / 1e3, abs=1e-6)
    # without a late straggler: one table, no phases in the summary
    plain = load_arrivals(path, H100, 0, (0,), PIPE.layout.world_size, EmulationClock(), faults[1:])
    assert len(plain.tables) == 1 and "phases" not in plain.summary()
