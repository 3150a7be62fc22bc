"""Single-process tests (tier b) of trace capture, iteration markers and replayed arrivals (hybrid emulation)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import ConfigError, EmulationConfig, VirtualWorld
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.graph import ExecutionGraph, TraceBuilder, WorldLayout
from prism_plugin.graph.rank_trace import RankTrace
from prism_plugin.topology import MegatronLayout

GLOO = CostModel(load_profile("local-cpu-gloo"))


@pytest.fixture
def emulate():
    def start(world_size: int, rank: int, **kwargs) -> P.Session:
        return P.activate(EmulationConfig(world=VirtualWorld(world_size=world_size, real_ranks=(rank,),
                                                             gpus_per_node=2), **kwargs))

    yield start
    P.deactivate()


def test_trace_records_ops_groups_peers_and_wait_points(emulate, tmp_path) -> None:
    emulate(8, 2, trace_dir=tmp_path, timing=False, iteration_marker="explicit")
    dp = dist.new_group([0, 2, 4, 6])
    t = torch.ones(16)
    dist.all_reduce(t, group=dp)  # before the first mark: not traced
    for _ in range(3):
        P.mark_iteration()
        dist.all_reduce(t, group=dp)
        work = dist.isend(t, dst=3)
        time.sleep(0.002)
        work.wait()
        dist.barrier()
    P.mark_iteration()
    session = P.current_session()
    summary = P.deactivate()
    assert summary["trace"]["path"] == str(tmp_path / "rank2.trace.json")
    assert (summary["trace"]["iterations"], summary["trace"]["ops"]) == (3, 9)
    trace = RankTrace.load(tmp_path / "rank2.trace.json")
    assert trace.rank == 2 and trace.world_size == 8 and len(trace.iterations) == 3
    assert trace.metadata["untraced_ops"] == 1 and session is not None
    for it in trace.iterations:
        ar, send, bar = it.ops
        assert (ar.op, trace.group_ranks(ar.group), ar.size_bytes) == (OpKind.ALL_REDUCE, (0, 2, 4, 6), 64)
        assert (send.op, send.peer, bar.op) == (OpKind.SEND, 3, OpKind.BARRIER)
        assert trace.groups[bar.group] is None  # the world group
        assert ar.issue_us <= ar.return_us <= ar.wait_us <= ar.end_us <= send.issue_us
        assert send.wait_us - send.return_us >= 1900  # the 2 ms of compute before wait()
        assert bar.end_us <= it.duration_us


def test_iteration_markers(emulate, tmp_path) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.1)
    for marker, expected in (("auto", 3), ("optimizer-step", 4), ("explicit", 1)):
        emulate(2, 0, iteration_marker=marker)
        opt.step()
        opt.step()
        P.mark_iteration()  # explicit: from now on AUTO ignores optimizer steps
        opt.step()
        assert P.current_session().clock.iteration == expected, marker  # type: ignore[union-attr]
        P.deactivate()
    opt.step()  # the hook is gone with the session


def _two_stage_graph(path, recv_after_us: float) -> ExecutionGraph:
    """Stage 0 sends at once; stage 1 computes `recv_after_us` then receives (and all-reduces over pp)."""
    a = TraceBuilder(axis_sizes={"pp": 2})
    a.send("pp", 1, 64)
    a.collective(OpKind.ALL_REDUCE, "pp", 64)
    b = TraceBuilder(axis_sizes={"pp": 2})
    b.compute(recv_after_us)
    b.recv("pp", -1, 64)
    b.compute(recv_after_us)
    b.collective(OpKind.ALL_REDUCE, "pp", 64)
    g = ExecutionGraph(layout=WorldLayout(MegatronLayout(world_size=2, pp=2)), class_axes=("pp",),
                       classes={"pp=0": a.build(), "pp=1": b.build()})
    g.save(path)
    return g


def test_hybrid_real_rank_waits_for_virtual_arrivals(emulate, tmp_path) -> None:
    path = tmp_path / "job.graph"
    _two_stage_graph(path, 30_000.0)
    session = emulate(2, 0, graph=path, iteration_marker="explicit")
    assert session.arrivals.value == "replayed"
    t = torch.ones(16)
    cost_p2p = GLOO.p2p_us(64, 0, 1) * 1e-6
    cost_ar = GLOO.collective_us(OpKind.ALL_REDUCE, 64, (0, 1)) * 1e-6
    dist.send(t, 1)  # before the first mark: symmetric, done after its cost only
    sent, reduced = [], []
    for _ in range(5):
        P.mark_iteration()
        t0 = session.clock.iteration_start_s
        dist.send(t, 1)  # virtual stage 1 reaches its recv 30 ms into its iteration
        sent.append(time.perf_counter() - t0)
        dist.all_reduce(t)  # and the all-reduce 30 ms later
        reduced.append(time.perf_counter() - t0)
    # never before the virtual arrival + cost; the median within 5 ms (a shared machine wakes late at times)
    assert min(sent) >= 0.030 + cost_p2p and min(reduced) >= 0.060 + cost_p2p + cost_ar
    assert statistics.median(sent) < 0.030 + cost_p2p + 0.005
    assert statistics.median(reduced) < 0.060 + cost_p2p + cost_ar + 0.005
    summary = P.deactivate()
    graph = summary["graph"]
    assert (graph["ops_replayed"], graph["ops_before_first_mark"], graph["ops_not_in_graph"]) == (10, 1, 0)
    assert graph["predicted_step_ms"] == pytest.approx(60 + 1e3 * (cost_p2p + cost_ar), abs=1e-3)
    assert "replay of execution graph" in summary["arrivals_note"]
    emulate(2, 0, graph=path, iteration_marker="explicit")
    P.mark_iteration()
    dist.broadcast(t, 0)  # the graph's first collective on the world ("pp" role) is an all-reduce
    dist.send(t, 1)
    dist.send(t, 1)  # beyond the graph's iteration
    graph = P.deactivate()["graph"]
    assert (graph["ops_kind_mismatch"], graph["ops_replayed"], graph["ops_not_in_graph"]) == (1, 1, 1)


def test_bad_graph_input_is_refused_before_any_process_group(tmp_path) -> None:
    world = VirtualWorld(world_size=4, real_ranks=(0,))
    with pytest.raises(ConfigError, match="is not a file"):
        EmulationConfig(world=world, graph=tmp_path / "missing.graph")
    path = tmp_path / "job.graph"
    _two_stage_graph(path, 10.0)
    with pytest.raises(ConfigError, match="describes 2 ranks but --world-size is 4"):
        P.activate(EmulationConfig(world=world, graph=path))
    assert not dist.is_initialized()
    (tmp_path / "junk.graph").write_text("{}")
    with pytest.raises(ConfigError, match="cannot be read"):
        P.activate(EmulationConfig(world=world, graph=tmp_path / "junk.graph"))
    for bad in ({"iteration_marker": "sometimes"}, {"trace_max_iterations": 0}):
        with pytest.raises(ConfigError):
            EmulationConfig(world=world, **bad)


def test_trace_and_graph_options_travel_to_launched_processes(tmp_path) -> None:
    from prism_plugin.config.channel import config_from_env, config_to_env

    path = tmp_path / "job.graph"
    _two_stage_graph(path, 10.0)
    config = EmulationConfig(world=VirtualWorld(world_size=2, real_ranks=(1,)), trace_dir=tmp_path / "t",
                             trace_max_iterations=7, graph=path, iteration_marker="optimizer-step")
    assert config_from_env(config_to_env(config)) == config
