"""Tier (a) tests of prism_plugin.topology: rank groups checked against Megatron-core and DeepSpeed.

The references are the libraries' own group builders (`megatron.core.parallel_state.RankGenerator`,
`deepspeed.runtime.pipe.topology.ProcessTopology`); every comparison is exact, including the order of
groups and of ranks inside each group.
"""

from __future__ import annotations

import doctest
import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_plugin import topology
from prism_plugin.topology import MEGATRON_AXES, DeepSpeedTopology, MegatronLayout, NodePlacement

parallel_state = pytest.importorskip("megatron.core.parallel_state")
ds_topology = pytest.importorskip("deepspeed.runtime.pipe.topology")


def _tokens(axes: tuple[str, ...]) -> list[str]:
    """Every non-empty combination of `axes`, joined with '-' (initialize_model_parallel uses a subset)."""
    return ["-".join(c) for n in range(1, len(axes) + 1) for c in itertools.combinations(axes, n)]


DENSE_TOKENS = _tokens(("tp", "cp", "dp", "pp"))
EXPERT_TOKENS = _tokens(("tp", "ep", "dp", "pp"))
# Tokens initialize_model_parallel (megatron-core 0.19.2) passes to get_ranks, gtp_remat included.
MEGATRON_DENSE_CALLS = (
    "dp-cp", "dp", "gtp_remat-dp", "gtp_remat-dp-cp", "cp", "tp-gtp_remat-pp", "tp", "pp",
    "tp-gtp_remat-dp-cp", "tp-gtp_remat-dp", "tp-cp",
)  # fmt: skip
MEGATRON_EXPERT_CALLS = ("ep", "tp", "tp-ep", "tp-ep-pp", "tp-ep-gtp_remat-pp", "dp", "gtp_remat-dp")

D = "tp-cp-ep-dp-pp"  # Megatron's default order
P = "tp-cp-ep-pp-dp"  # Megatron-LM's --use-tp-pp-dp-mapping
# (world_size, tp, pp, cp, ep, expert_tp, order); every one is accepted by initialize_model_parallel.
LAYOUTS = [
    (1, 1, 1, 1, 1, None, D),
    (8, 1, 1, 1, 1, None, D),
    (8, 2, 1, 1, 1, None, D),
    (8, 8, 1, 1, 1, None, D),
    (8, 1, 8, 1, 1, None, D),
    (8, 1, 1, 8, 1, None, D),
    (8, 1, 1, 1, 8, None, D),
    (16, 2, 2, 1, 1, None, D),
    (16, 2, 2, 2, 1, None, D),
    (16, 2, 2, 1, 2, None, D),
    (16, 2, 2, 1, 4, 1, D),
    (32, 2, 2, 2, 2, None, D),
    (32, 4, 2, 1, 4, 1, D),
    (32, 2, 4, 2, 4, 2, D),
    (48, 2, 3, 2, 1, None, D),
    (48, 3, 2, 1, 2, None, D),
    (64, 4, 4, 2, 1, None, D),
    (64, 2, 2, 2, 8, 1, D),
    (64, 8, 1, 1, 8, 1, D),
    (96, 4, 3, 2, 4, 2, D),
    (128, 4, 4, 2, 8, 1, D),
    (256, 8, 4, 2, 16, 1, D),
    (512, 8, 8, 1, 8, 2, D),
    (1024, 8, 4, 4, 8, None, D),
    (4096, 8, 8, 2, 64, 1, D),  # dp = 4096 // 128 = 32, expert_dp = 4096 // 512 = 8
    (4096, 4, 16, 4, 32, 2, D),  # dp = 4096 // 256 = 16, expert_dp = 4096 // 1024 = 4
    (16, 2, 2, 1, 1, None, P),
    (16, 2, 2, 2, 2, None, P),
    (32, 2, 4, 1, 2, 1, P),
    (64, 4, 2, 2, 8, 1, P),
    (48, 2, 3, 1, 1, None, P),
    (8, 2, 1, 1, 4, 1, P),
    (24, 2, 3, 1, 1, None, "tp-dp-pp"),
    (16, 2, 2, 2, 2, None, "tp-pp-ep-dp-cp"),
    (32, 1, 2, 4, 4, 1, "cp-ep-tp-dp-pp"),
    (64, 2, 2, 2, 2, None, "pp-tp-cp-ep-dp"),
    (32, 2, 1, 2, 2, None, "dp-tp-cp-ep-pp"),
]


def _layout(world, tp, pp, cp, ep, etp, order) -> MegatronLayout:
    return MegatronLayout(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)


def _megatron_generators(world, tp, pp, cp, ep, etp, order):
    """The two RankGenerators initialize_model_parallel builds, or None where it would reject the layout."""
    etp = tp if etp is None else etp
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        return None
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    try:
        dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = parallel_state.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    except RuntimeError:
        return None
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return None
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        return None
    return dense, expert


def _check_against_megatron(layout: MegatronLayout, dense, expert, ranks) -> None:
    for token in DENSE_TOKENS:
        groups = layout.groups(token)
        assert groups == dense.get_ranks(token), token
        for rank in ranks:
            (containing,) = [g for g in groups if rank in g]
            assert layout.group_of(rank, token) == tuple(containing), (token, rank)
    for token in EXPERT_TOKENS:
        groups = layout.expert_groups(token)
        assert groups == expert.get_ranks(token), token
        for rank in ranks:
            (containing,) = [g for g in groups if rank in g]
            assert layout.group_of(rank, token, expert=True) == tuple(containing), (token, rank)


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: "-".join(map(str, s)))
def test_megatron_layout_matches_rank_generator(spec):
    world, tp, pp, cp, ep, etp, order = spec
    generators = _megatron_generators(*spec)
    assert generators is not None, "LAYOUTS must hold layouts Megatron accepts"
    layout = _layout(*spec)
    assert layout.dp == world // (tp * pp * cp)
    assert layout.expert_dp == world // (layout.expert_tp * ep * pp)
    ranks = range(world) if world <= 64 else sorted({0, 1, world // 3, world // 2 + 1, world - 1})
    _check_against_megatron(layout, *generators, ranks)


@pytest.mark.parametrize("spec", LAYOUTS[::4], ids=lambda s: "-".join(map(str, s)))
def test_megatron_calls_with_injected_gtp_remat_axis(spec):
    """The exact tokens initialize_model_parallel passes, on the gtp_remat-injected orders it builds."""
    world, tp, pp, cp, ep, etp, order = spec
    etp = tp if etp is None else etp
    inject = parallel_state._inject_gtp_remat_axis
    dense = parallel_state.RankGenerator(
        tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=inject(order, after="tp")
    )
    expert = parallel_state.RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=inject(order, after="ep")
    )
    layout = _layout(*spec)
    for token in MEGATRON_DENSE_CALLS:
        assert layout.groups(token) == dense.get_ranks(token), token
    for token in MEGATRON_EXPERT_CALLS:
        assert layout.expert_groups(token) == expert.get_ranks(token), token


@st.composite
def _megatron_specs(draw):
    tp, pp, cp = (
        draw(st.sampled_from([1, 2, 3, 4])),
        draw(st.sampled_from([1, 2, 3, 4])),
        draw(st.sampled_from([1, 2])),
    )
    world = tp * pp * cp * draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    etp = draw(st.sampled_from([d for d in range(1, world // pp + 1) if (world // pp) % d == 0]))
    ep = draw(
        st.sampled_from([d for d in range(1, world // (pp * etp) + 1) if (world // (pp * etp)) % d == 0])
    )
    names = list(
        draw(st.one_of(st.just(D.split("-")), st.just(P.split("-")), st.permutations(MEGATRON_AXES)))
    )
    if draw(st.booleans()):  # leave out some axes; Megatron appends them and accepts it when they are size 1
        names = [n for n in names if draw(st.booleans())] or ["tp"]
    return world, tp, pp, cp, ep, etp, "-".join(names)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_megatron_specs(), data=st.data())
def test_megatron_layout_hypothesis(spec, data):
    """Random layouts and orders: accepted exactly when Megatron accepts them, then identical groups."""
    generators = _megatron_generators(*spec)
    if generators is None:
        with pytest.raises(ValueError):
            _layout(*spec)
        return
    layout = _layout(*spec)
    ranks = data.draw(st.lists(st.integers(0, spec[0] - 1), min_size=1, max_size=4))
    _check_against_megatron(layout, *generators, ranks)


@pytest.mark.parametrize("spec", LAYOUTS[:20], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("expert", [False, True])
def test_megatron_coords_round_trip_and_match_group_positions(spec, expert):
    layout = _layout(*spec)
    keys = ("tp", "ep", "dp", "pp") if expert else ("tp", "cp", "dp", "pp")
    for rank in range(layout.world_size):
        coords = layout.coords(rank, expert=expert)
        assert sorted(coords) == sorted(keys)
        assert layout.rank_at(expert=expert, **coords) == rank
        for axis, value in coords.items():  # a coordinate is the index inside the group along that axis
            assert layout.group_of(rank, axis, expert=expert).index(rank) == value


def test_megatron_token_order_and_default_expert_tp():
    layout = MegatronLayout(world_size=64, tp=2, pp=2, cp=2, ep=4)
    assert layout.groups("pp-dp-tp") == layout.groups("tp-dp-pp")
    assert layout.expert_tp == 2
    assert layout == MegatronLayout(world_size=64, tp=2, pp=2, cp=2, ep=4, expert_tp=2)
    assert hash(layout) == hash(MegatronLayout(world_size=64, tp=2, pp=2, cp=2, ep=4, expert_tp=2))
    assert layout.rank_at(tp=1, cp=1, dp=3, pp=1) == 1 + 1 * 2 + 3 * 4 + 1 * 32
    assert MegatronLayout(world_size=8, tp=2).rank_at(tp=1, dp=3) == 7  # size-1 axes may be left out


def test_megatron_group_of_is_fast_at_131072_ranks():
    layout = MegatronLayout(world_size=131072, tp=8, pp=16, cp=2, ep=64, expert_tp=1)  # dp = 131072 // 256
    start = time.perf_counter()
    for rank in range(0, 131072, 131):
        layout.group_of(rank, "tp")
        layout.group_of(rank, "pp")
        layout.group_of(rank, "ep", expert=True)
    assert len(layout.group_of(131071, "dp-cp")) == 1024  # dp*cp = 512 * 2
    assert time.perf_counter() - start < 1.0  # ~3000 calls of O(group size); measured ~0.05 s


def _ds_pairs(pp_dp_tp):
    if len(pp_dp_tp) == 2:
        pp, dp = pp_dp_tp
        return DeepSpeedTopology.pipe_data(pp, dp), ds_topology.PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    pp, tp, dp = pp_dp_tp
    return (
        DeepSpeedTopology.pipe_model_data(pp, tp, dp),
        ds_topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp),
    )


def _check_against_deepspeed(ours: DeepSpeedTopology, theirs) -> None:
    assert ours.get_axis_names() == theirs.get_axis_names()
    assert ours.world_size() == theirs.world_size()
    for axis in (*theirs.get_axis_names(), "model", "nope"):
        assert ours.get_dim(axis) == theirs.get_dim(axis), axis
        assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis), axis
    for coord, rank in theirs.mapping.items():
        assert ours.get_rank(**coord._asdict()) == rank
        assert ours.get_coord(rank) == coord
        assert ours.get_coord(rank)._asdict() == coord._asdict()
        assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)
        assert ours.get_rank_repr(rank, omit_axes=()) == theirs.get_rank_repr(rank, omit_axes=[])
    for axis in theirs.get_axis_names():
        groups = theirs.get_axis_comm_lists(axis)
        for idx in range(theirs.get_dim(axis)):
            assert ours.get_axis_list(axis, idx) == theirs.get_axis_list(axis, idx)
        for group in groups[:3] + groups[-3:]:
            for rank in group:
                assert ours.group_of(rank, axis) == tuple(group)
    axes = theirs.get_axis_names()
    for n in range(len(axes) + 1):
        for chosen in itertools.combinations(axes, n):
            for values in itertools.product(*(range(min(theirs.get_dim(a), 3)) for a in chosen)):
                filters = dict(zip(chosen, values, strict=True))
                assert ours.filter_match(**filters) == theirs.filter_match(**filters), filters


DS_DIMS = [
    (1, 1), (1, 8), (8, 1), (2, 4), (4, 2), (3, 5), (7, 3), (16, 64), (64, 16),
    (1, 1, 1), (2, 2, 2), (2, 4, 8), (4, 8, 2), (3, 2, 5), (8, 8, 16), (1, 8, 4), (4, 1, 4), (5, 3, 1),
]  # fmt: skip


@pytest.mark.parametrize("dims", DS_DIMS, ids=lambda d: "x".join(map(str, d)))
def test_deepspeed_topology_matches_process_topology(dims):
    _check_against_deepspeed(*_ds_pairs(dims))


@settings(max_examples=40, deadline=None)
@given(
    named_dims=st.lists(
        st.tuples(st.sampled_from(["pipe", "data", "model", "seq", "expert", "x"]), st.integers(1, 5)),
        min_size=1,
        max_size=4,
        unique_by=lambda t: t[0],
    )
)
def test_deepspeed_topology_hypothesis(named_dims):
    axes, dims = zip(*named_dims, strict=True)
    ours = DeepSpeedTopology(axes=axes, dims=dims)
    _check_against_deepspeed(ours, ds_topology.ProcessTopology(axes=list(axes), dims=list(dims)))


def test_deepspeed_coord_supports_namedtuple_methods_used_by_pipeline_grid():
    topo = DeepSpeedTopology.pipe_model_data(4, 2, 8)  # axes pipe, data, model; dims (4, 8, 2)
    me = topo.get_coord(37)  # 37 = pipe 2 * 16 + data 2 * 2 + model 1
    assert (me.pipe, me.data, me.model) == (2, 2, 1)
    assert topo.get_rank(**me._replace(pipe=3)._asdict()) == 37 + 16


def test_deepspeed_is_fast_at_65536_ranks():
    topo = DeepSpeedTopology.pipe_model_data(16, 8, 512)  # 16 * 8 * 512 = 65536
    start = time.perf_counter()
    lists = {axis: topo.get_axis_comm_lists(axis) for axis in topo.axes}
    elapsed = time.perf_counter() - start
    assert [len(lists[a]) for a in ("pipe", "data", "model")] == [65536 // 16, 65536 // 512, 65536 // 8]
    assert lists["data"][0][:3] == [0, 8, 16]
    assert topo.group_of(65535, "data") == tuple(lists["data"][-1])
    assert elapsed < 1.0  # three passes over 65536 ranks; measured ~0.03 s


def test_node_placement():
    nodes = NodePlacement(gpus_per_node=4)
    assert [nodes.node_of(r) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [nodes.local_index(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert nodes.nodes_of([9, 0, 5, 4]) == (0, 1, 2)
    assert nodes.ranks_per_node([9, 0, 5, 4, 4]) == 2  # node 1 holds 4 and 5
    assert nodes.ranks_per_node([]) == 0
    assert nodes.is_intra_node([4, 7]) and not nodes.is_intra_node([3, 4])
    layout = MegatronLayout(world_size=32, tp=4, pp=2)
    assert all(nodes.is_intra_node(g) for g in layout.groups("tp"))
    assert all(nodes.ranks_per_node(g) == 1 for g in layout.groups("pp"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size=0 must be a positive int"),
        ({"world_size": 8, "tp": 0}, "tp=0"),
        ({"world_size": 8, "pp": -1}, "pp=-1"),
        ({"world_size": 8, "cp": 1.5}, "cp=1.5"),
        ({"world_size": 8, "ep": True}, "ep=True"),
        ({"world_size": 8, "expert_tp": 0}, "expert_tp=0"),
        ({"world_size": 8, "order": "tp-cp-xp-dp-pp"}, "order=.*unknown axis 'xp'"),
        ({"world_size": 8, "order": "tp-dp-tp"}, "order=.*repeats"),  # Megatron ignores the repeat
    ],
)  # fmt: skip
def test_megatron_layout_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronLayout(**kwargs)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ((10, 2, 2, 1, 1, None, D), r"world_size=10 is not divisible by tp\*pp\*cp=4: choose"),
        ((8, 1, 1, 1, 16, None, D), r"world_size=8 is not divisible by expert_tp\*ep\*pp=16"),
        ((8, 1, 1, 2, 1, None, "tp-dp-pp"), "order=.*leaves out 'cp'"),
        ((8, 1, 1, 1, 2, None, "tp-cp-dp-pp"), "order=.*leaves out 'ep'"),
        ((16, 2, 2, 2, 1, None, P), "order=.*expert_dp"),
        ((16, 2, 2, 2, 4, 1, "tp-pp-cp-ep-dp"), "order=.*strides"),
    ],
)
def test_megatron_layout_rejects_what_megatron_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        _layout(*spec)
    assert _megatron_generators(*spec) is None


def test_megatron_methods_reject_bad_input():
    layout = MegatronLayout(world_size=16, tp=2, pp=2)
    with pytest.raises(ValueError, match="axis='xp' has unknown dense token 'xp'.*'tp'"):
        layout.groups("xp")
    with pytest.raises(ValueError, match="axis='tp-tp' repeats"):
        layout.groups("tp-tp")
    with pytest.raises(ValueError, match="axis=3"):
        layout.expert_groups(3)
    with pytest.raises(ValueError, match="rank=16 is out of range for world_size=16"):
        layout.group_of(16, "tp")
    with pytest.raises(ValueError, match="rank=-1"):
        layout.coords(-1)
    with pytest.raises(ValueError, match="tp=2 is out of range"):
        layout.rank_at(tp=2, dp=0, pp=0)
    with pytest.raises(ValueError, match=r"\['cp'\] are not axes"):
        layout.rank_at(expert=True, cp=0)
    with pytest.raises(ValueError, match="coordinate pp is missing"):
        layout.rank_at(tp=0, dp=0)


def test_deepspeed_and_nodes_reject_bad_input():
    with pytest.raises(ValueError, match="axes=.*equal length"):
        DeepSpeedTopology(axes=("a", "b"), dims=(2,))
    with pytest.raises(ValueError, match=r"dims\['a'\]=0"):
        DeepSpeedTopology(axes=("a",), dims=(0,))
    with pytest.raises(ValueError, match="axes=.*repeats"):
        DeepSpeedTopology(axes=("a", "a"), dims=(1, 1))
    with pytest.raises(ValueError, match="axes has invalid name '1a'"):
        DeepSpeedTopology(axes=("1a",), dims=(1,))
    topo = DeepSpeedTopology.pipe_data(2, 4)
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="pipe=5 is out of range"):
        topo.get_rank(pipe=5, data=0)
    with pytest.raises(ValueError, match="rank=8 is out of range for world_size=8"):
        topo.get_coord(8)
    with pytest.raises(ValueError, match="axis='model' is not in this topology"):
        topo.filter_match(model=0)
    with pytest.raises(ValueError, match="axis='model'"):
        topo.group_of(0, "model")
    with pytest.raises(ValueError, match="data=-1"):
        topo.get_axis_list("data", -1)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        NodePlacement(gpus_per_node=0)
    with pytest.raises(ValueError, match="rank=-3"):
        NodePlacement(gpus_per_node=8).nodes_of([0, -3])


def test_docstring_examples():
    assert doctest.testmod(topology).failed == 0
