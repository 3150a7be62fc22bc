"""Tier (a) tests of the execution-graph schema, builders and Chrome trace export (no processes, no torch)."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys

import pytest

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.graph import (
    ClassTrace,
    ExecutionGraph,
    GradSync,
    Node,
    NodeKind,
    RankOverride,
    SyntheticJob,
    TraceBuilder,
    WorldLayout,
    build,
    build_1f1b_graph,
    chrome_trace,
    graph_from_traces,
    instantiate_rank,
    layout,
    replay,
    representatives,
    schema,
    synthetic,
    write_chrome_trace,
)
from prism_plugin.topology import MegatronLayout

H100 = CostModel(load_profile("dgx-h100"))


def _job(**kw: object) -> SyntheticJob:
    args: dict[str, object] = dict(
        tp=2,
        pp=4,
        dp=2,
        num_microbatches=4,
        fwd_us=10.0,
        bwd_us=20.0,
        activation_bytes=2**20,
        grad_bytes=2**24,
    )
    args.update(kw)
    return SyntheticJob(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("module", [schema, layout, build, synthetic])
def test_doctests(module: object) -> None:
    assert doctest.testmod(module).failed == 0  # type: ignore[arg-type]


def test_world_layout_matches_megatron_groups() -> None:
    mega = MegatronLayout(world_size=32, tp=2, pp=4, order="tp-cp-ep-pp-dp")
    world = WorldLayout(mega)
    for rank in range(32):
        coords = world.coords(rank)
        assert dict(zip([a.name for a in world.axes], coords, strict=True)) == mega.coords(rank)
        assert world.rank_at(coords) == rank
        for role in ("tp", "dp", "pp", "tp-dp"):
            assert world.group_of(rank, role) == tuple(mega.group_of(rank, role))
        nxt = world.peer_of(rank, "pp", +1)
        assert mega.coords(nxt)["pp"] == (mega.coords(rank)["pp"] + 1) % 4
        assert world.peer_of(nxt, "pp", -1) == rank
    with pytest.raises(ValueError, match="not an axis"):
        world.group_of(0, "ep-tp")


def test_node_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match="duration_us"):
        Node(kind=NodeKind.COMPUTE, duration_us=-1.0)
    with pytest.raises(ValueError, match="collective OpKind"):
        Node(kind=NodeKind.COLLECTIVE, op=OpKind.SEND, group="dp", seq=0)
    with pytest.raises(ValueError, match="waited_by"):
        Node(kind=NodeKind.SEND, peer_axis="pp", peer_offset=1, seq=0, is_async=True)
    with pytest.raises(ValueError, match="unknown"):
        Node(kind="flop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown field"):
        Node.from_dict({"kind": "compute", "duration_ms": 3})


def test_class_trace_checks_waits_and_sequence_numbers() -> None:
    send = Node(kind=NodeKind.SEND, peer_axis="pp", peer_offset=1, seq=0, is_async=True, waited_by=1)
    ClassTrace(nodes=(send, Node(kind=NodeKind.WAIT, waits_on=0)))
    with pytest.raises(ValueError, match="must be waited on"):
        ClassTrace(nodes=(send, Node(kind=NodeKind.COMPUTE, duration_us=1.0)))
    ar = Node(kind=NodeKind.COLLECTIVE, op=OpKind.ALL_REDUCE, group="dp", seq=1)
    with pytest.raises(ValueError, match="expected 0"):
        ClassTrace(nodes=(ar,))


def test_trace_builder_shares_a_channel_for_equivalent_offsets() -> None:
    b = TraceBuilder(axis_sizes={"pp": 2})
    b.send("pp", +1, 8)
    b.send("pp", -1, 8)  # the same peer when pp = 2
    assert [n.seq for n in b.build()] == [0, 1]


def test_graph_requires_every_class_and_checks_p2p_channels() -> None:
    world = WorldLayout(MegatronLayout(world_size=4, pp=2))
    trace = ClassTrace(nodes=(Node(kind=NodeKind.COMPUTE, duration_us=1.0),))
    with pytest.raises(ValueError, match="no trace"):
        ExecutionGraph(layout=world, class_axes=("pp",), classes={"pp=0": trace})
    bad = ClassTrace(nodes=(Node(kind=NodeKind.SEND, peer_axis="pp", peer_offset=2, seq=0),))
    with pytest.raises(ValueError, match="sends to itself"):
        ExecutionGraph(layout=world, class_axes=(), classes={"all": bad})


def test_slicing_representatives_and_graph_from_traces() -> None:
    g = build_1f1b_graph(_job())
    reps = representatives(g.layout, ("pp",))
    assert reps == {"pp=0": 0, "pp=1": 4, "pp=2": 8, "pp=3": 12}
    traces = {rank: g.classes[name] for name, rank in reps.items()}
    assert graph_from_traces(g.layout, ("pp",), traces).classes == g.classes
    with pytest.raises(ValueError, match="profile e.g. ranks \\[12\\]"):
        graph_from_traces(g.layout, ("pp",), {r: t for r, t in traces.items() if r != 12})


def test_synthetic_1f1b_structure() -> None:
    job = _job(pp=4, num_microbatches=6, grad_sync=GradSync.REDUCE_SCATTER_ALL_GATHER, optimizer_us=5.0)
    g = build_1f1b_graph(job)
    assert g.class_axes == ("pp",) and sorted(g.classes) == ["pp=0", "pp=1", "pp=2", "pp=3"]
    for stage in range(4):
        nodes = g.classes[f"pp={stage}"].nodes
        fwd = [n for n in nodes if n.kind is NodeKind.COMPUTE and n.name.startswith("fwd")]
        bwd = [n for n in nodes if n.kind is NodeKind.COMPUTE and n.name.startswith("bwd")]
        assert len(fwd) == len(bwd) == 6 * job.tp_collectives_per_pass
        sends = [n for n in nodes if n.kind is NodeKind.SEND]
        assert len(sends) == 6 * ((stage < 3) + (stage > 0))
        tp = [n for n in nodes if n.kind is NodeKind.COLLECTIVE and n.group == "tp"]
        assert len(tp) == 2 * 6 * 2 and {n.size_bytes for n in tp} == {job.activation_bytes}
        tail = [(n.op, n.group) for n in nodes if n.kind is NodeKind.COLLECTIVE and n.group == "dp"]
        assert tail == [(OpKind.REDUCE_SCATTER, "dp"), (OpKind.ALL_GATHER, "dp")]
        # 1F1B: stage s runs pp - s - 1 forward passes before its first backward.
        names = [n.name.split(".")[0] for n in nodes if n.kind is NodeKind.COMPUTE]
        first_bwd = names.index("bwd mb0")
        assert len({n for n in names[:first_bwd] if n.startswith("fwd")}) == 4 - stage
    last = g.classes["pp=3"].nodes
    assert not any(n.kind is NodeKind.SEND and n.peer_offset == 1 for n in last)


def test_instantiate_rank_relabels_groups_and_peers() -> None:
    g = build_1f1b_graph(_job())
    ops = instantiate_rank(g, 5)  # tp=1, dp=0, pp=1 (tp2 dp2 pp4, order tp-cp-ep-dp-pp)
    tp = {op.group_ranks for op in ops if op.node.group == "tp"}
    dp = {op.group_ranks for op in ops if op.node.group == "dp"}
    peers = {(op.node.kind, op.peer_rank) for op in ops if op.peer_rank >= 0}
    assert tp == {(4, 5)} and dp == {(5, 7)}
    assert peers == {(NodeKind.RECV, 1), (NodeKind.SEND, 1), (NodeKind.RECV, 9), (NodeKind.SEND, 9)}


def test_save_load_round_trip(tmp_path: object) -> None:
    g = build_1f1b_graph(_job(fwd_us=[1.0, 2.5, 3.0, 4.0])).with_overrides(
        {3: RankOverride(compute_scale=1.5), 6: RankOverride(class_name="pp=0")}
    )
    path = g.save(tmp_path / "job.graph.json")  # type: ignore[operator]
    loaded = ExecutionGraph.load(path)
    assert loaded == g
    assert loaded.class_of(6) == "pp=0" and loaded.compute_scale_of(3) == 1.5
    data = json.loads(path.read_text())
    assert data["format"] == "prism-execution-graph" and data["version"] == 1
    assert data["layout"]["kind"] == "megatron" and data["layout"]["world_size"] == 16
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        ExecutionGraph.from_dict(data)


def test_an_8192_rank_graph_round_trips(tmp_path: object) -> None:
    """Its load time is a benchmark figure (benchmarks/replay_scale.py), not checked here."""
    g = build_1f1b_graph(
        SyntheticJob(tp=8, pp=16, dp=64, num_microbatches=64, fwd_us=1000.0, bwd_us=2000.0,
                     activation_bytes=2**26, grad_bytes=2**30)
    )  # fmt: skip
    path = g.save(tmp_path / "big.json")  # type: ignore[operator]
    loaded = ExecutionGraph.load(path)
    assert loaded.layout.world_size == 8192 and len(loaded.classes) == 16


def test_chrome_trace_export(tmp_path: object) -> None:
    g = build_1f1b_graph(_job())
    result = replay(g, H100, stragglers={5: 2.0})
    path = write_chrome_trace(result, tmp_path / "trace.json", ranks=[0, 5, 12])  # type: ignore[operator]
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 5, 12}
    assert all(e["dur"] >= 0 and isinstance(e["tid"], int) for e in spans)
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(5, "compute"), (5, "comm tp"), (5, "comm dp"), (5, "p2p pp")} <= threads
    rank5 = [e for e in spans if e["pid"] == 5]
    compute = [e for e in rank5 if e["cat"] == "compute"]
    assert sum(e["dur"] for e in compute) == pytest.approx(result.breakdown(5).compute_us)
    assert max(e["ts"] + e["dur"] for e in rank5) == pytest.approx(result.iteration_time_us(5))
    assert any(e["cat"] == "bubble" for e in spans if e["pid"] == 0)  # rank 0 waits for the straggler
    assert chrome_trace(result, [0])["traceEvents"]


def test_graph_layer_is_pure() -> None:
    code = "import sys, prism_plugin.graph; sys.exit(int(any(m.split('.')[0] in "
    code += "('torch', 'megatron', 'deepspeed') for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_wait_stamped_before_its_issue_counts_after_it() -> None:
    from prism_plugin.graph.convert import _timeline
    from prism_plugin.graph.rank_trace import TracedIteration, TracedOp

    send = TracedOp(op=OpKind.SEND, group=0, seq=0, size_bytes=64, peer=1, issue_us=7399.8, return_us=7399.8,
                    wait_us=4299.4, end_us=7452.4)
    events, _gaps, _inner = _timeline(TracedIteration(index=2, duration_us=9000.0, ops=(send,)))
    assert events == [("b", 0)]  # issued, then waited at once: a blocking send
