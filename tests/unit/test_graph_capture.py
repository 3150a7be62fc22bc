"""Tier (a) tests of trace -> class trace conversion, slicing plans, steady-state replay and arrival tables.

The central check: capturing a replayed timeline (what a tracer on each rank would record) and converting it
back gives a graph whose replay is the same, op for op.
"""

from __future__ import annotations

import doctest
import json

import pytest

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.graph import (
    ExecutionGraph,
    GradSync,
    NodeKind,
    SyntheticJob,
    TraceBuilder,
    WorldLayout,
    build_1f1b_graph,
    instantiate_rank,
    replay,
)
from prism_plugin.graph import convert as convert_mod
from prism_plugin.graph import slicing as slicing_mod
from prism_plugin.graph.convert import class_trace, graph_from_rank_traces, group_role, peer_step
from prism_plugin.graph.rank_trace import RankTrace, TracedIteration, TracedOp, load_rank_traces
from prism_plugin.graph.slicing import Framework, SlicingPlan, make_plan, parse_layout
from prism_plugin.graph.steady import ArrivalTable, steady_state, unroll
from prism_plugin.topology import DeepSpeedTopology, MegatronLayout

H100 = CostModel(load_profile("dgx-h100"))


def _job(**kw: object) -> SyntheticJob:
    base = dict(tp=2, pp=4, dp=2, num_microbatches=6, fwd_us=[100.0, 120.0, 120.0, 150.0],
                bwd_us=[200.0, 240.0, 240.0, 300.0], activation_bytes=2**20, grad_bytes=2**24)
    base.update(kw)
    return SyntheticJob(**base)  # type: ignore[arg-type]


def captured(graph: ExecutionGraph, rank: int, iterations: int = 1) -> RankTrace:
    """What a tracer on `rank` records when the job runs as `graph`'s steady-state replay says."""
    state = steady_state(graph, H100, iterations=iterations)
    spans = state.result.op_spans(rank)
    n = len(graph.trace_of(rank).nodes)
    concrete = instantiate_rank(graph, rank)
    groups: list[tuple[int, ...]] = []
    its = []
    start = 0.0
    for copy in range(iterations):
        part = spans[copy * n:(copy + 1) * n]
        ops = []
        index_of: dict[int, int] = {}
        for s, c in zip(part, concrete, strict=True):
            node = s.node
            if node.kind.is_comm:
                ranks = c.group_ranks if node.kind is NodeKind.COLLECTIVE else tuple(sorted((rank, c.peer_rank)))
                if ranks not in groups:
                    groups.append(ranks)
                kind = node.op if node.kind is NodeKind.COLLECTIVE else OpKind(node.kind.value)
                blocking = not node.is_async
                index_of[c.index] = len(ops)
                ops.append(dict(op=kind, group=groups.index(ranks), seq=node.seq, size_bytes=node.size_bytes,
                                peer=c.peer_rank, issue_us=s.issue_us - start, return_us=s.issue_us - start,
                                wait_us=s.issue_us - start if blocking else -1.0,
                                end_us=s.end_us - start if blocking else -1.0))
            elif node.kind is NodeKind.WAIT:
                op = ops[index_of[node.waits_on % n]]
                op.update(wait_us=s.issue_us - start, end_us=s.end_us - start)
        end = part[-1].end_us
        its.append(TracedIteration(index=copy + 1, duration_us=end - start, ops=[TracedOp(**o) for o in ops]))
        start = end
    return RankTrace(rank=rank, world_size=graph.layout.world_size, groups=groups, iterations=its)


def _spans(result: object, rank: int) -> list[float]:
    """(issue, end) of every communication op of `rank`, flattened."""
    return [t for s in result.op_spans(rank) if s.node.kind.is_comm  # type: ignore[attr-defined]
            for t in (s.issue_us, s.end_us)]


@pytest.mark.parametrize("grad_sync", list(GradSync))
def test_capture_then_convert_replays_identically(grad_sync: GradSync) -> None:
    graph = build_1f1b_graph(_job(grad_sync=grad_sync))
    reps = [0, 4, 8, 12]  # one rank per stage (tp=2, dp=2: pp stride 4)
    rebuilt = graph_from_rank_traces([captured(graph, r) for r in reps], graph.layout, ("pp",), warmup=0)
    a, b = replay(graph, H100), replay(rebuilt, H100)
    assert b.iteration_time_us() == pytest.approx(a.iteration_time_us(), rel=1e-9)
    for r in range(graph.layout.world_size):
        assert _spans(b, r) == pytest.approx(_spans(a, r), rel=1e-9, abs=1e-6)
        assert b.breakdown(r).bubble_us == pytest.approx(a.breakdown(r).bubble_us, abs=1e-6)
    for name, trace in graph.classes.items():
        comm = [(n.kind, n.op, n.group, n.peer_axis, n.peer_offset % 4, n.seq, n.size_bytes, n.is_async)
                for n in trace.nodes if n.kind.is_comm]
        got = [(n.kind, n.op, n.group, n.peer_axis, n.peer_offset % 4, n.seq, n.size_bytes, n.is_async)
               for n in rebuilt.classes[name].nodes if n.kind.is_comm]
        assert got == comm, name
        assert rebuilt.classes[name].total_compute_us() == pytest.approx(trace.total_compute_us())


def test_conversion_averages_steady_iterations_and_drops_warmup_and_odd_ones() -> None:
    layout = WorldLayout(MegatronLayout(world_size=4, pp=2))
    world = (None,)

    def it(index: int, compute_us: float, extra: bool = False) -> TracedIteration:
        ops = [TracedOp(op=OpKind.ALL_REDUCE, group=0, seq=1, size_bytes=8, issue_us=compute_us,
                        return_us=compute_us + 1, wait_us=compute_us + 2, end_us=compute_us + 50)]
        if extra:
            ops.append(TracedOp(op=OpKind.BARRIER, group=0, seq=2, size_bytes=0, issue_us=compute_us + 60,
                                return_us=compute_us + 61, wait_us=compute_us + 61, end_us=compute_us + 70))
        return TracedIteration(index=index, duration_us=compute_us + 100, ops=ops)

    trace = RankTrace(rank=1, world_size=4, groups=world,
                      iterations=[it(1, 5000.0), it(2, 100.0), it(3, 200.0, extra=True), it(4, 300.0)])
    ct, report = class_trace(trace, layout, warmup=1)
    assert report.iterations_used == (2, 4) and report.iterations_other_structure == (3,)
    assert report.step_us_mean == pytest.approx(300.0)
    kinds = [(n.kind.value, n.duration_us) for n in ct.nodes]
    # compute 200 mean, the blocking all-reduce on the world ("dp-pp" role), 50 us of compute after it
    assert kinds == [("compute", 200.0), ("collective", 0.0), ("compute", 50.0)]
    assert ct.nodes[1].group == "dp-pp" and not ct.nodes[1].is_async


def test_async_ops_late_waits_and_unwaited_ops() -> None:
    layout = WorldLayout(MegatronLayout(world_size=2, pp=2))
    ops = [
        TracedOp(op=OpKind.SEND, group=0, seq=1, size_bytes=64, peer=1, issue_us=10, return_us=12,
                 wait_us=40, end_us=45),  # async: compute in between
        TracedOp(op=OpKind.RECV, group=0, seq=2, size_bytes=64, peer=1, issue_us=20, return_us=22),  # never waited
        TracedOp(op=OpKind.SEND, group=0, seq=3, size_bytes=64, peer=1, issue_us=50, return_us=51,
                 wait_us=300, end_us=310),  # waited at once but 249 us later: async + compute + wait
    ]
    trace = RankTrace(rank=0, world_size=2, groups=[None], iterations=[TracedIteration(index=1, duration_us=400,
                                                                                      ops=ops)])
    ct, _ = class_trace(trace, layout, warmup=0)
    labels = [n.label() for n in ct.nodes]
    assert labels == ["compute", "send pp+1#0", "compute", "recv pp+1#0", "compute", "wait node 1", "compute",
                      "send pp+1#1", "compute", "wait node 7", "compute",
                      "wait node 3 (implicit wait at iteration end)"]
    durations = [n.duration_us for n in ct.nodes if n.kind is NodeKind.COMPUTE]
    assert durations == [10, 10, 20, 5, 249, 90]  # 10 | 10..20 | 20..40 | 45..50 | 51..300 | 310..400


def test_roles_and_peers_resolve_through_the_layout() -> None:
    w = WorldLayout(MegatronLayout(world_size=32, tp=2, pp=4))
    assert group_role(w, 9, w.group_of(9, "tp-dp")) == "tp-dp"
    assert group_role(w, 9, list(reversed(w.group_of(9, "dp")))) == "dp"
    assert peer_step(w, 9, w.peer_of(9, "pp", -1)) == ("pp", -1)
    assert group_role(w, 24, [0, 24]) == "embedding"  # Megatron's embedding group with pp=4
    assert w.group_of(2, "embedding") == (2, 26) and w.role_coords("embedding") == [(0,), (3,)]
    with pytest.raises(ValueError, match="not a group of the layout"):
        group_role(w, 8, [8, 24])  # stages 1 and 3
    with pytest.raises(ValueError, match="not in an embedding group"):
        w.group_of(8, "embedding")
    with pytest.raises(ValueError, match="not along one axis"):
        peer_step(w, 0, 9)
    with pytest.raises(ValueError, match="not a member"):
        group_role(w, 0, [2, 3])


def test_graph_from_rank_traces_names_missing_classes_and_mismatched_worlds() -> None:
    graph = build_1f1b_graph(_job())
    traces = [captured(graph, r) for r in (0, 4, 12)]
    with pytest.raises(ValueError, match=r"no trace for classes \['pp=2'\]: profile e.g. ranks \[8\]"):
        graph_from_rank_traces(traces, graph.layout, warmup=0)
    other = WorldLayout(MegatronLayout(world_size=32, tp=2, pp=4))
    with pytest.raises(ValueError, match="16-rank world but the layout has 32"):
        graph_from_rank_traces(traces, other, warmup=0)
    with pytest.raises(ValueError, match="none left after dropping 2 warm-up"):
        graph_from_rank_traces(traces, graph.layout, warmup=2)
    extra = traces + [captured(graph, 8), captured(graph, 9)]
    g = graph_from_rank_traces(extra, graph.layout, warmup=0)
    assert g.metadata["unused_trace_ranks"] == [9]


def test_rank_trace_json_round_trip(tmp_path) -> None:
    graph = build_1f1b_graph(_job())
    trace = captured(graph, 4, iterations=2)
    path = trace.save(tmp_path / "run0" / "rank4.trace.json")
    (tmp_path / "rank8.trace.json").write_text(json.dumps(captured(graph, 8).to_dict()))
    loaded = load_rank_traces([tmp_path])
    assert [t.rank for t in loaded] == [4, 8]
    again = RankTrace.load(path)
    assert [len(i.ops) for i in again.iterations] == [len(i.ops) for i in trace.iterations]
    assert again.iterations[1].ops[3].end_us == pytest.approx(trace.iterations[1].ops[3].end_us, abs=1e-3)
    with pytest.raises(ValueError, match="two traces of rank 4"):
        load_rank_traces([tmp_path, path])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.trace.json"):
        load_rank_traces([tmp_path / "empty"])
    with pytest.raises(ValueError, match="does not exist"):
        load_rank_traces([tmp_path / "x"])


def test_unroll_numbers_ops_on_and_steady_state_of_1f1b() -> None:
    graph = build_1f1b_graph(_job(tp=1, dp=1, fwd_us=100.0, bwd_us=200.0, activation_bytes=0, grad_bytes=0))
    three = unroll(graph, 3)
    t = three.classes["pp=1"]
    n = len(graph.classes["pp=1"])
    assert len(t) == 3 * n
    assert [x.seq for x in t.nodes[n:2 * n] if x.kind is NodeKind.SEND] == [
        x.seq + 6 for x in graph.classes["pp=1"].nodes if x.kind is NodeKind.SEND]
    state = steady_state(graph, H100)
    cold = replay(graph, H100).iteration_time_us()
    # uniform 1F1B: (m + pp - 1) * (fwd + bwd) plus transfers on the critical path, first stage critical
    assert state.step_us == pytest.approx(cold, rel=1e-9)
    for r in range(4):
        b = state.breakdown(r)
        assert b.compute_us + b.exposed_comm_us + b.bubble_us == pytest.approx(b.iteration_us)
        assert state.rank_step_us(r) == pytest.approx(state.step_us, rel=1e-9)
    # a last stage that loads its labels (compute) before waiting on activations: hidden in steady state
    b = TraceBuilder(axis_sizes={"pp": 2})
    b.compute(500.0)
    b.recv("pp", -1, 0)
    b.compute(100.0)
    a = TraceBuilder(axis_sizes={"pp": 2})
    a.compute(1000.0)
    a.send("pp", 1, 0)
    g2 = ExecutionGraph(layout=WorldLayout(MegatronLayout(world_size=2, pp=2)), class_axes=("pp",),
                        classes={"pp=0": a.build(), "pp=1": b.build()})
    cold2 = replay(g2, H100)
    hot = steady_state(g2, H100)
    assert hot.step_us == pytest.approx(cold2.iteration_time_us(0), rel=1e-9)
    assert hot.rank_step_us(1) == pytest.approx(hot.step_us)  # every rank has the job's period
    # the cold replay counts stage 1's 100 us tail after the transfer; steady state overlaps it
    assert cold2.iteration_time_us() - hot.step_us == pytest.approx(100.0)


def test_arrival_table_gives_virtual_partners_times_from_the_rank_start() -> None:
    graph = build_1f1b_graph(_job())
    state = steady_state(graph, H100)
    spans = {r: state.result.op_spans(r) for r in (0, 1, 4)}
    table = ArrivalTable.for_rank(state, 0, real_ranks=(0,))
    base0 = state.iteration_start_us(0)
    n4 = len(graph.trace_of(4).nodes)
    # rank 0's k-th recv from rank 4 meets rank 4's k-th send of the last copy
    sends4 = [s for s in spans[4][2 * n4:] if s.node.kind is NodeKind.SEND and s.node.peer_offset == -1]
    for k, s in enumerate(sends4):
        assert table.p2p[(OpKind.RECV, 4, k)] == pytest.approx(s.issue_us - base0)
    # tp all-reduce k: the virtual member is rank 1 (same stage, so the same class)
    n0 = len(graph.trace_of(1).nodes)
    ar1 = [s for s in spans[1][2 * n0:] if s.node.kind is NodeKind.COLLECTIVE and s.node.group == "tp"]
    for k, s in enumerate(ar1):
        assert table.collectives[("tp", k)] == (OpKind.ALL_REDUCE, pytest.approx(s.issue_us - base0))
    assert table.step_us == pytest.approx(state.step_us)
    both = ArrivalTable.for_rank(state, 0, real_ranks=(0, 1))
    assert not any(role == "tp" for role, _ in both.collectives)  # every tp member real: observed live


def test_parse_layout_and_plans() -> None:
    j = parse_layout("tp=8,pp=16,dp=64")
    plan = make_plan(j, 2)
    assert [c.rank for c in plan.classes] == [512 * s for s in range(16)]
    assert len(plan.runs) == 8 and all(len(r) == 2 for r in plan.runs)
    assert sorted(r for run in plan.runs for r in run) == [c.rank for c in plan.classes]
    assert make_plan(j, 5).runs[-1] == (7680,) and len(make_plan(j, 5).runs) == 4
    assert "first stage" in plan.classes[0].role and "last stage" in plan.classes[-1].role
    vpp = make_plan(parse_layout("tp=2,pp=4,vpp=2", world_size=64), 4)
    assert "chunks 1, 5" in vpp.classes[1].role and vpp.runs == ((0, 16, 32, 48),)
    for bad, msg in (("tp=8,pp=x", "not an integer"), ("tq=2", "NAME=SIZE"), ("pp=2,pp=2", "twice"),
                     ("pp=4", "needs dp"), ("tp=0,dp=1", ">= 1"), ("vpp=2,dp=2", "needs pp >= 2")):
        with pytest.raises(ValueError, match=msg):
            parse_layout(bad)
    with pytest.raises(ValueError, match="world size is 100"):
        parse_layout("pp=2,dp=2", world_size=100)
    with pytest.raises(ValueError, match="positive integer"):
        make_plan(j, 0)
    with pytest.raises(ValueError, match="pipe, data and model axes only"):
        parse_layout("pipe=2,data=2,vpp=2", Framework.DEEPSPEED)


def test_plan_save_load(tmp_path) -> None:
    plan = make_plan(parse_layout("pipe=4,data=2,model=2", "deepspeed"), 3)
    again = SlicingPlan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="slicing plan"):
        SlicingPlan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("dims", [(4, 2, 2), (2, 4, 1), (8, 2, 4)])
def test_deepspeed_layout_is_deepspeeds_process_topology(dims: tuple[int, int, int]) -> None:
    pp, dp, mp = dims
    topo = DeepSpeedTopology.pipe_model_data(pp, mp, dp)
    w = parse_layout(f"pipe={pp},data={dp},model={mp}", "deepspeed").world
    for axis, role in (("pipe", "pp"), ("data", "dp"), ("model", "tp")):
        if topo.get_dim(axis) > 1:
            assert sorted(map(sorted, topo.get_axis_comm_lists(axis))) == sorted(
                sorted(w.group_of(r, role)) for r in range(w.world_size) if w.group_of(r, role)[0] == r)


def test_doctests() -> None:
    for mod in (convert_mod, slicing_mod):
        assert doctest.testmod(mod).failed == 0


def test_graph_cli_slice_build_show_replay(tmp_path, capsys) -> None:
    from prism_plugin.cli import graph as graph_cli

    assert graph_cli.main(["slice", "--layout", "tp=2,pp=4,dp=2", "--devices", "3", "--out",
                           str(tmp_path / "plan.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["runs"] == [[0, 4, 8], [12]]
    graph = build_1f1b_graph(_job())
    for r in (0, 4, 8, 12):
        captured(graph, r, iterations=3).save(tmp_path / "traces" / f"rank{r}.trace.json")
    out = tmp_path / "job.graph"
    assert graph_cli.main(["graph", "build", str(tmp_path / "traces"), "--plan", str(tmp_path / "plan.json"),
                           "-o", str(out), "--warmup", "1"]) == 0
    assert graph_cli.main(["graph", "show", str(out)]) == 0
    capsys.readouterr()
    assert graph_cli.main(["replay", str(out), "--profile", "dgx-h100", "--json", "--straggler", "5:2"]) == 0
    pred = json.loads(capsys.readouterr().out)
    plain = steady_state(graph, H100)
    slow = steady_state(graph, H100, stragglers={5: 2.0})
    assert pred["step_us"] == pytest.approx(slow.step_us, rel=1e-6) and slow.step_us > plain.step_us
    assert pred["ranks"]["5"]["compute_us"] == pytest.approx(2 * graph.trace_of(5).total_compute_us(), rel=1e-6)
    for argv, msg in ((["slice", "--layout", "pp=4", "--devices", "1"], "needs dp"),
                      (["graph", "build", str(tmp_path / "traces"), "-o", str(out)], "exactly one of --plan"),
                      (["replay", str(out), "--straggler", "5"], "RANK:FACTOR"),
                      (["replay", str(out), "--set", "bogus.field=1"], "unknown field")):
        assert graph_cli.main(argv) == 2, argv
        assert msg in capsys.readouterr().err.replace("\n", " "), argv


def test_conversion_keeps_each_spans_samples_in_iteration_order() -> None:
    layout = WorldLayout(MegatronLayout(world_size=4, pp=2))

    def it(index: int, compute_us: float) -> TracedIteration:
        ops = [TracedOp(op=OpKind.ALL_REDUCE, group=0, seq=1, size_bytes=8, issue_us=compute_us,
                        return_us=compute_us + 1, wait_us=compute_us + 2, end_us=compute_us + 50)]
        return TracedIteration(index=index, duration_us=compute_us + 100, ops=ops)

    trace = RankTrace(rank=1, world_size=4, groups=(None,), iterations=[it(1, 5000.0), it(2, 100.0), it(3, 300.0)])
    ct, _ = class_trace(trace, layout, warmup=1)
    assert ct.sample_count == 2
    assert [n.samples_us for n in ct.nodes] == [(100.0, 300.0), (), (50.0, 50.0)]
    graph = ExecutionGraph(layout=layout, class_axes=("pp",), classes={"pp=0": ct, "pp=1": ct})
    assert ExecutionGraph.from_dict(json.loads(json.dumps(graph.to_dict()))) == graph  # samples survive JSON
    copies = unroll(graph, 3, sampled=True).classes["pp=0"].nodes
    # copy 0 (the warm-in) takes the last sample, copies 1.. the samples in order
    assert [n.duration_us for n in copies if n.kind is NodeKind.COMPUTE][::2] == [300.0, 100.0, 300.0]
    mixed = TraceBuilder()
    mixed.compute(1.0, samples_us=[1.0])
    mixed.compute(2.0, samples_us=[1.0, 3.0])
    with pytest.raises(ValueError, match="samples_us of different lengths"):
        mixed.build()


def test_sampled_replay_takes_the_later_member_of_each_traced_iteration() -> None:
    """Two stages meet at a collective each iteration; their spans alternate 100/300 and 300/100 us. The replay
    of the means says 200 us + the collective; every traced iteration took 300 us + the collective."""
    from prism_plugin.graph.steady import sampled_steps

    layout = WorldLayout(MegatronLayout(world_size=2, pp=2))
    classes = {}
    for name, samples in (("pp=0", [100.0, 300.0, 100.0, 300.0]), ("pp=1", [300.0, 100.0, 300.0, 100.0])):
        b = TraceBuilder(axis_sizes={"pp": 2})
        b.compute(200.0, samples_us=samples)
        b.collective(OpKind.ALL_REDUCE, "pp", 1 << 20)
        classes[name] = b.build()
    graph = ExecutionGraph(layout=layout, class_axes=("pp",), classes=classes)
    mean_field = steady_state(graph, H100).step_us
    sampled = sampled_steps(graph, H100)
    assert sampled.iterations == 4 and set(sampled.rank_steps_us) == {0, 1}
    for steps in sampled.rank_steps_us.values():
        assert steps == pytest.approx([mean_field + 100.0] * 4)
    summary = sampled.summary()
    assert summary["step_us_mean"] == pytest.approx(mean_field + 100.0, abs=1e-3)
    with pytest.raises(ValueError, match="no per-iteration compute samples"):
        sampled_steps(build_1f1b_graph(_job()), H100)
