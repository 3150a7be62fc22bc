"""Tier (a) tests of the discrete-event replay: exact hand-computed times, symmetry folding == full replay,
stragglers, deadlocks, mismatches and deterministic ties."""

from __future__ import annotations

import doctest
import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile, override_profile
from prism_plugin.graph import (
    ClassTrace,
    ExecutionGraph,
    GradSync,
    Node,
    NodeKind,
    RankOverride,
    ReplayDeadlock,
    ReplayMismatch,
    ReplayMode,
    SyntheticJob,
    TraceBuilder,
    WorldLayout,
    build_1f1b_graph,
    fold,
    replay,
)
from prism_plugin.graph.convert import group_role as group_role_of
from prism_plugin.topology import MegatronLayout

H100_PROFILE = load_profile("dgx-h100")
H100 = CostModel(H100_PROFILE)
FREE = {"intra_node.latency_us": 0.0, "inter_node.latency_us": 0.0, "collective_overhead_us": 0.0,
        "p2p_overhead_us": 0.0}  # fmt: skip
ZERO = CostModel(override_profile(H100_PROFILE, FREE))  # with 0-byte messages every op costs 0


def _cost(gpus_per_node: int) -> CostModel:
    return CostModel(override_profile(H100_PROFILE, {"gpus_per_node": gpus_per_node}))


def _spans(result: object, rank: int) -> list[tuple[float, ...]]:
    spans = result.op_spans(rank)  # type: ignore[attr-defined]
    return [(s.issue_us, s.ready_us, s.start_us, s.end_us) for s in spans]


def _assert_same(a: object, b: object, world_size: int) -> None:
    for rank in range(world_size):
        assert _spans(a, rank) == _spans(b, rank), f"rank {rank}"
        assert a.breakdown(rank) == b.breakdown(rank), f"rank {rank}"  # type: ignore[attr-defined]


def _graph(world_size: int, class_axes: tuple[str, ...], traces: dict[str, TraceBuilder], **layout: int):
    return ExecutionGraph(
        layout=WorldLayout(MegatronLayout(world_size=world_size, **layout)),
        class_axes=class_axes,
        classes={name: b.build() for name, b in traces.items()},
    )


def test_doctests() -> None:
    # The package exports the function `replay`, which shadows the module of the same name.
    assert doctest.testmod(importlib.import_module("prism_plugin.graph.replay")).failed == 0


def test_two_ranks_one_all_reduce_exact_times() -> None:
    size = 2**30
    traces = {}
    for tp, compute_us in ((0, 100.0), (1, 250.0)):
        b = TraceBuilder()
        b.compute(compute_us)
        b.collective(OpKind.ALL_REDUCE, "tp", size)
        traces[f"tp={tp}"] = b
    g = _graph(2, ("tp",), traces, tp=2)
    cost_us = H100.collective_us(OpKind.ALL_REDUCE, size, [0, 1])
    assert cost_us == pytest.approx(5 + 2 * 1 + 2 * 1 / 2 * size / (450e3 * 0.8))  # ring over NVLink
    r = replay(g, H100)
    for rank in (0, 1):
        spans = r.op_spans(rank)
        assert spans[1].start_us == 250.0 and spans[1].end_us == 250.0 + cost_us
        assert r.iteration_time_us(rank) == 250.0 + cost_us
    assert r.arrival_offset_us(0, "tp", 0) == 100.0 and r.arrival_offset_us(1, [1, 0], 0) == 250.0
    b0, b1 = r.breakdown(0), r.breakdown(1)
    assert (b0.compute_us, b0.bubble_us, b0.exposed_comm_us) == (100.0, 150.0, cost_us)
    assert (b1.compute_us, b1.bubble_us, b1.exposed_comm_us) == (250.0, 0.0, cost_us)


def test_embedding_group_joins_the_first_and_last_stages_only() -> None:
    # Tied embeddings over pp 4: stages 0 and 3 all-reduce the embedding's gradient over Megatron's embedding group
    # (the role "embedding"); stages 1 and 2 are not in it and go on. Folded (tp, dp) replay == full replay.
    size = 2**26
    traces = {}
    for stage, compute_us in enumerate((100.0, 50.0, 60.0, 300.0)):
        b = TraceBuilder()
        b.compute(compute_us)
        if stage in (0, 3):
            b.collective(OpKind.ALL_REDUCE, "embedding", size)
        traces[f"pp={stage}"] = b
    g = _graph(16, ("pp",), traces, tp=2, pp=4)
    assert g.layout.group_of(1, "embedding") == (1, 13)  # tp 1, dp 0: stages 0 and 3
    cost_us = H100.collective_us(OpKind.ALL_REDUCE, size, [1, 13])
    r, full = replay(g, H100), replay(g, H100, mode=ReplayMode.FULL)
    _assert_same(r, full, 16)
    for rank in (1, 13):
        assert r.op_spans(rank)[1].start_us == 300.0 and r.iteration_time_us(rank) == 300.0 + cost_us
    assert (r.iteration_time_us(5), r.iteration_time_us(9)) == (50.0, 60.0)
    assert r.arrival_offset_us(1, [1, 13], 0) == 100.0


def test_expert_groups_inside_dp_replay_exactly_folded_and_with_a_straggler() -> None:
    # tp1 pp2 ep2 on 8 GPUs: dp 4, and each expert group ([0, 1], [2, 3], ...) is half a dp group, no dense group.
    # Each stage computes, all-to-alls over "expert:ep", then all-reduces over dp. Rank 2 is a straggler (x2): its
    # expert partner 3 waits for it, 0 and 1 do not until the dp all-reduce.
    size = 2**20
    traces = {}
    for stage in (0, 1):
        b = TraceBuilder()
        b.compute(100.0)
        b.collective(OpKind.ALL_TO_ALL, "expert:ep", size)
        b.compute(10.0)
        b.collective(OpKind.ALL_REDUCE, "dp", size)
        traces[f"pp={stage}"] = b
    g = _graph(8, ("pp",), traces, pp=2, ep=2)
    assert g.layout.group_of(2, "expert:ep") == (2, 3) and g.layout.role_axes("expert:ep") == ("dp",)
    assert group_role_of(g.layout, 5, [4, 5]) == "expert:ep"
    a2a = H100.collective_us(OpKind.ALL_TO_ALL, size, [0, 1])
    ar = H100.collective_us(OpKind.ALL_REDUCE, size, [0, 1, 2, 3])
    r, full = replay(g, H100), replay(g, H100, mode=ReplayMode.FULL)
    _assert_same(r, full, 8)
    assert r.num_actors == 2 and r.iteration_time_us(0) == pytest.approx(110.0 + a2a + ar)
    slow, slow_full = (replay(g, H100, stragglers={2: 2.0}, mode=m) for m in (ReplayMode.AUTO, ReplayMode.FULL))
    _assert_same(slow, slow_full, 8)
    assert slow.op_spans(3)[1].start_us == 200.0 and slow.op_spans(0)[1].start_us == 100.0
    assert slow.iteration_time_us(0) == pytest.approx(200.0 + a2a + 20.0 + ar)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (3, 1)])
def test_1f1b_closed_form_with_free_communication(pp: int, m: int) -> None:
    f, b = 7.0, 13.0
    job = SyntheticJob(tp=1, pp=pp, dp=2, num_microbatches=m, fwd_us=f, bwd_us=b, activation_bytes=0,
                       grad_bytes=0)  # fmt: skip
    r = replay(build_1f1b_graph(job), ZERO)
    assert r.iteration_time_us() == (m + pp - 1) * (f + b)
    assert r.breakdown(0).bubble_us == (pp - 1) * (f + b)  # the pipeline bubble, on the first stage


def test_1f1b_two_stages_with_known_transfer_cost() -> None:
    # Each stage boundary crossing costs c; with 2 stages and 4 micro-batches five transfers lie on the
    # critical path (act0, the three batched exchanges, grad3): (m + p - 1) * (f + b) + 5c.
    job = SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=4, fwd_us=10.0, bwd_us=20.0, activation_bytes=10**6,
                       grad_bytes=0)  # fmt: skip
    c = H100.p2p_us(10**6, 0, 1)
    assert c == pytest.approx(5 + 1 + 10**6 / (450e3 * 0.8))
    assert replay(build_1f1b_graph(job), H100).iteration_time_us() == pytest.approx(5 * 30.0 + 5 * c)


def test_symmetric_replay_equals_full_replay_tp2_pp4_dp2() -> None:
    job = SyntheticJob(tp=2, pp=4, dp=2, num_microbatches=5, fwd_us=[10, 11, 12, 13], bwd_us=20.0,
                       activation_bytes=2**20, grad_bytes=2**24)  # fmt: skip
    g = build_1f1b_graph(job)
    auto, full = replay(g, H100), replay(g, H100, mode=ReplayMode.FULL)
    assert (auto.num_actors, full.num_actors) == (4, 16)
    _assert_same(auto, full, 16)
    assert auto.events < full.events


def test_large_symmetric_job_folds_to_one_actor_per_stage() -> None:
    job = SyntheticJob(tp=8, pp=16, dp=64, num_microbatches=4, fwd_us=1.0, bwd_us=2.0, activation_bytes=8,
                       grad_bytes=8)  # fmt: skip
    g = build_1f1b_graph(job)
    assert len(fold(g, 8, compute_scale={}).actors) == 16
    space = fold(g, 8, compute_scale={4100: 1.5})
    assert len(space.actors) == 16 * 2 * 2  # pp x {tp*, other tp} x {dp*, other dp}
    # 4100 = tp 4, dp 0, pp 8; 4101: its TP peers; 4108: its DP peers; 4109: neither.
    assert [space.actor_of(r).num_ranks for r in (4100, 4101, 4108, 4109)] == [1, 7, 63, 7 * 63]


def test_uneven_node_placement_unfolds_what_it_must() -> None:
    # tp=3 on 8-GPU nodes: some TP groups straddle two nodes, so TP peers are not interchangeable.
    job = SyntheticJob(tp=3, pp=2, dp=4, num_microbatches=3, fwd_us=5.0, bwd_us=9.0, activation_bytes=2**22,
                       grad_bytes=2**22)  # fmt: skip
    g = build_1f1b_graph(job)
    auto, full = replay(g, H100), replay(g, H100, mode=ReplayMode.FULL)
    assert auto.num_actors > 2
    _assert_same(auto, full, 24)
    times = {full.iteration_time_us(r) for r in range(24)}
    assert len(times) > 2  # the asymmetry is real


def test_straggler_slows_everyone_by_its_slowdown_when_nothing_else_matters() -> None:
    # One stage, free communication: every rank's iteration is the straggler's compute, m * (f + b) * s.
    f, b, m, s = 10.0, 30.0, 4, 1.75
    job = SyntheticJob(tp=2, pp=1, dp=4, num_microbatches=m, fwd_us=f, bwd_us=b, activation_bytes=0,
                       grad_bytes=0)  # fmt: skip
    r = replay(build_1f1b_graph(job), ZERO, stragglers={5: s})
    for rank in range(8):
        assert r.iteration_time_us(rank) == m * (f + b) * s
        bd = r.breakdown(rank)
        expected_compute = m * (f + b) * (s if rank == 5 else 1.0)
        assert bd.compute_us == expected_compute and bd.bubble_us == m * (f + b) * s - expected_compute


def test_straggler_with_real_costs_matches_full_replay_and_syncs_dp_groups() -> None:
    job = SyntheticJob(tp=2, pp=4, dp=4, num_microbatches=6, fwd_us=50.0, bwd_us=100.0,
                       activation_bytes=2**22, grad_bytes=2**26)  # fmt: skip
    g = build_1f1b_graph(job)
    base = replay(g, H100)
    auto = replay(g, H100, stragglers={13: 1.5})
    full = replay(g, H100, stragglers={13: 1.5}, mode=ReplayMode.FULL)
    _assert_same(auto, full, 32)
    assert auto.num_actors < 32
    for rank in range(32):
        assert auto.iteration_time_us(rank) > base.iteration_time_us(rank)
        dp_group = g.layout.group_of(rank, "dp")
        assert {auto.iteration_time_us(m) for m in dp_group} == {auto.iteration_time_us(rank)}
    assert auto.breakdown(13).compute_us == 1.5 * base.breakdown(13).compute_us


def test_class_override_is_expanded_and_exact() -> None:
    job = SyntheticJob(tp=2, pp=2, dp=2, num_microbatches=3, fwd_us=10.0, bwd_us=20.0, activation_bytes=2**20,
                       grad_bytes=2**20)  # fmt: skip
    g = build_1f1b_graph(job)
    nodes = list(g.classes["pp=0"].nodes)
    nodes[0] = Node(kind=NodeKind.COMPUTE, duration_us=nodes[0].duration_us + 40.0, name="slow first chunk")
    classes = {**g.classes, "pp=0 slow": ClassTrace(nodes=tuple(nodes))}
    g2 = ExecutionGraph(layout=g.layout, class_axes=g.class_axes, classes=classes,
                        overrides={2: RankOverride(class_name="pp=0 slow")})  # fmt: skip
    auto, full = replay(g2, H100), replay(g2, H100, mode=ReplayMode.FULL)
    _assert_same(auto, full, 8)
    assert auto.iteration_time_us(0) > replay(g, H100).iteration_time_us(0)


def test_deadlock_names_blocked_ranks_and_ops() -> None:
    a, b = TraceBuilder(axis_sizes={"pp": 2}), TraceBuilder(axis_sizes={"pp": 2})
    a.recv("pp", +1, 8, name="first")  # both stages receive before either sends
    a.send("pp", +1, 8)
    b.recv("pp", -1, 8, name="first")
    b.send("pp", -1, 8)
    g = _graph(2, ("pp",), {"pp=0": a, "pp=1": b}, pp=2)
    with pytest.raises(ReplayDeadlock, match=r"rank 0 node 0 \(recv pp\+1#0 \(first\)\): 1 of 2") as info:
        replay(g, H100)
    assert "rank 1 node 0" in str(info.value)


def test_missing_collective_member_deadlocks_in_folded_replay() -> None:
    a, b = TraceBuilder(), TraceBuilder()
    a.compute(1.0)
    a.collective(OpKind.ALL_REDUCE, "tp-pp", 64)  # spans both stages...
    b.compute(1.0)
    b.collective(OpKind.ALL_REDUCE, "tp", 64)  # ...but stage 1 never joins it
    g = _graph(16, ("pp",), {"pp=0": a, "pp=1": b}, tp=2, pp=2)
    with pytest.raises(ReplayDeadlock) as info:
        replay(g, H100)
    text = str(info.value)
    assert "1 actor(s)" in text and "rank 0 (1 of 8 ranks: tp=*, cp=0, dp=*, pp=0)" in text
    assert "all_reduce tp-pp#0): 1 of 2 members arrived" in text


def test_mismatched_sizes_raise() -> None:
    a, b = TraceBuilder(), TraceBuilder()
    a.collective(OpKind.ALL_REDUCE, "tp", 64)
    b.collective(OpKind.ALL_REDUCE, "tp", 128)
    g = _graph(2, ("tp",), {"tp=0": a, "tp=1": b}, tp=2)
    with pytest.raises(ReplayMismatch, match="disagree"):
        replay(g, H100)


def test_async_collective_overlaps_compute() -> None:
    b = TraceBuilder()
    h = b.collective(OpKind.ALL_REDUCE, "dp", 2**28, is_async=True)
    b.compute(100.0)
    b.wait(h)
    g = _graph(16, (), {"all": b})  # 16 ranks of one node pair, pure dp
    r = replay(g, H100)
    cost_us = H100.collective_us(OpKind.ALL_REDUCE, 2**28, range(16))
    assert r.iteration_time_us(3) == max(100.0, cost_us)
    assert r.breakdown(3).exposed_comm_us == pytest.approx(max(0.0, cost_us - 100.0))


def test_deterministic_ties() -> None:
    job = SyntheticJob(tp=2, pp=3, dp=2, num_microbatches=4, fwd_us=1.0, bwd_us=1.0, activation_bytes=0,
                       grad_bytes=0)  # fmt: skip
    g = build_1f1b_graph(job)
    logs = [replay(g, ZERO, mode=ReplayMode.FULL, record_events=True).event_log for _ in range(2)]
    assert logs[0] == logs[1]
    times = [t for t, _, _ in logs[0]]
    assert times == sorted(times) and len(set(times)) < len(times)  # many ties, resolved identically


def test_arrival_queries() -> None:
    g = build_1f1b_graph(SyntheticJob(tp=2, pp=2, dp=2, num_microbatches=2, fwd_us=10.0, bwd_us=20.0,
                                      activation_bytes=2**20, grad_bytes=2**20))  # fmt: skip
    r = replay(g, H100)
    last_dp = r.arrival_offset_us(0, "dp", 0)
    assert last_dp == r.arrival_offset_us(0, (0, 2), 0) == r.arrival_offset_us(2, [2, 0], 0)
    assert r.p2p_arrival_offset_us(4, NodeKind.RECV, 0, 0) == 0.0  # stage 1 posts its first recv at once
    assert r.p2p_arrival_offset_us(0, NodeKind.SEND, 4, 0) > 0.0
    with pytest.raises(KeyError):
        r.arrival_offset_us(0, "dp", 5)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2, 3, 4]),
    pp=st.integers(1, 3),
    dp=st.integers(1, 3),
    m=st.integers(1, 4),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
    grad_sync=st.sampled_from(list(GradSync)),
    data=st.data(),
)
def test_property_folded_replay_equals_full_replay(
    tp: int,
    pp: int,
    dp: int,
    m: int,
    gpus_per_node: int,
    order: str,
    grad_sync: GradSync,
    data: st.DataObject,
) -> None:
    fwd = data.draw(st.lists(st.integers(1, 50), min_size=pp, max_size=pp))
    job = SyntheticJob(tp=tp, pp=pp, dp=dp, num_microbatches=m, fwd_us=[float(f) for f in fwd],
                       bwd_us=30.0, activation_bytes=2**20, grad_bytes=2**22, grad_sync=grad_sync,
                       order=order)  # fmt: skip
    n = job.world_size
    stragglers = {}
    if data.draw(st.booleans()):
        stragglers[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from([0.5, 1.25, 3.0]))
    g = build_1f1b_graph(job)
    cost = _cost(gpus_per_node)
    auto = replay(g, cost, stragglers=stragglers)
    full = replay(g, cost, stragglers=stragglers, mode=ReplayMode.FULL)
    _assert_same(auto, full, n)
    assert auto.num_actors <= full.num_actors == n


def test_straggler_input_is_checked() -> None:
    g = build_1f1b_graph(SyntheticJob(tp=1, pp=1, dp=2, num_microbatches=1, fwd_us=1.0, bwd_us=1.0,
                                      activation_bytes=0, grad_bytes=0))  # fmt: skip
    with pytest.raises(ValueError, match="> 0"):
        replay(g, H100, stragglers={0: 0.0})
    with pytest.raises(ValueError, match="out of range"):
        replay(g, H100, stragglers={7: 2.0})
