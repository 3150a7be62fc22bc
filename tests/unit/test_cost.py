"""Pure unit tests of the timing layer: hardware profiles and the alpha-beta cost model (tier a)."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_plugin.config.kinds import Algorithm, OpKind
from prism_plugin.cost import (
    CostModel,
    GroupPlacement,
    HardwareProfile,
    LinkSpec,
    ProfileError,
    available_profiles,
    load_profile,
    override_profile,
    profile_from_yaml,
    profile_to_yaml,
    supported_algorithms,
)

GIB = 2**30
COLLECTIVES = [k for k in OpKind if not k.is_p2p]
H100 = CostModel(load_profile("dgx-h100"))
# dgx-h100 in bytes/us: NVLink 450 GB/s * 0.8 = 360e3 B/us; NIC 50 GB/s * 0.8 = 40e3 B/us.
NVLINK_B_PER_US, NIC_B_PER_US = 450e9 * 0.8 / 1e6, 50e9 * 0.8 / 1e6


# -- worked examples (hand arithmetic) ----------------------------------------------------------


def test_ring_all_reduce_one_node_h100_worked_example():
    # 1 GiB all_reduce on 8 H100 of one node, ring on NVLink:
    #   transfer = 2*(8-1)/8 * 2**30 B / (450e9 B/s * 0.8) = 1.75 * 1073741824 / 360e9 s = 5219.58 us
    #   latency  = 5 us overhead + 2*(8-1) = 14 hops * 1 us = 19 us
    expected_us = 2 * 7 / 8 * GIB / (450e9 * 0.8) * 1e6 + 5 + 14 * 1.0
    assert expected_us == pytest.approx(5238.58, abs=0.01)
    assert H100.collective_us(OpKind.ALL_REDUCE, GIB, range(8)) == pytest.approx(expected_us, rel=1e-12)
    parts = H100.breakdown(OpKind.ALL_REDUCE, GIB, H100.placement(range(8)))
    assert parts.algorithm is Algorithm.RING
    assert parts.latency_us == pytest.approx(19.0)
    # nccl-tests bus bandwidth = algbw * 2(n-1)/n must come back as link rate * efficiency.
    bus_gbytes_per_s = GIB / (parts.transfer_us * 1e-6) * 2 * 7 / 8 / 1e9
    assert bus_gbytes_per_s == pytest.approx(450 * 0.8)


def test_ring_all_gather_two_nodes_worked_example():
    # 16 ranks on 2 nodes, 1 GiB output, ring forced. Per rank 15/16 * S; 8 NICs per node in parallel:
    #   transfer = max(15/16 S / 360e3, 15/16 S / (8 * 40e3)) = 15/16 * S / 320e3 us = 3145.73 us
    #   latency  = 5 + 15 hops * (1 inter hop * 10 us + 14 intra hops * 1 us) / 15 = 5 + 24 = 29 us
    got = H100.collective_us(OpKind.ALL_GATHER, GIB, range(16), Algorithm.RING)
    assert got == pytest.approx(15 / 16 * GIB / (8 * NIC_B_PER_US) + 29.0)


def test_hierarchical_all_reduce_two_nodes_worked_example():
    # intra reduce-scatter + intra all-gather: 2 * 7/8 * S / 360e3 us; inter all_reduce of S/8 per NIC
    # over 2 nodes: 2 * 1/2 * S / (8 * 40e3) us; latency 5 + 2*7 * 1 + 2*1 * 10 = 39 us.
    expected = 2 * 7 / 8 * GIB / NVLINK_B_PER_US + GIB / (8 * NIC_B_PER_US) + 39.0
    got = H100.collective_us(OpKind.ALL_REDUCE, GIB, range(16), Algorithm.HIERARCHICAL)
    assert got == pytest.approx(expected)


def test_tree_all_reduce_1024_ranks_worked_example():
    # 1024 ranks = 128 nodes: ceil(log2 1024) = 10 levels, ceil(log2 128) = 7 between nodes.
    # latency = 5 + 2 * (7 * 10 + 3 * 1) = 151 us; transfer = max(2S / 360e3, 2S / (8 * 40e3)).
    size = 8
    expected = 151.0 + 2 * size / (8 * NIC_B_PER_US)
    assert H100.collective_us(OpKind.ALL_REDUCE, size, range(1024), Algorithm.TREE) == pytest.approx(expected)
    assert H100.choose_algorithm(OpKind.ALL_REDUCE, size, range(1024)) is Algorithm.TREE


def test_p2p_worked_examples():
    # inter-node: 5 us overhead + 10 us + 1e6 B / 40e3 B/us = 40 us; intra: 5 + 1 + 1e6 / 360e3.
    assert H100.p2p_us(10**6, 0, 8) == pytest.approx(40.0)
    assert H100.p2p_us(10**6, 0, 1) == pytest.approx(6 + 1e6 / NVLINK_B_PER_US)
    assert H100.collective_us(OpKind.SEND, 10**6, [0, 8]) == pytest.approx(40.0)
    assert H100.p2p_us(10**6, 3, 3) == 0.0


def test_all_to_all_and_barrier_worked_examples():
    # 16 ranks, per-rank input S: 7/16 S over NVLink, 8/16 S over the rank's NIC; one inter hop.
    expected = 5 + 10 + max(7 / 16 * GIB / NVLINK_B_PER_US, 8 / 16 * GIB / NIC_B_PER_US)
    assert H100.collective_us(OpKind.ALL_TO_ALL, GIB, range(16)) == pytest.approx(expected)
    # barrier: latency only, whatever size is passed; one node: ring, 5 + 14 hops * 1 us.
    assert H100.collective_us(OpKind.BARRIER, 0, range(8)) == pytest.approx(19.0)
    assert H100.collective_us(OpKind.BARRIER, GIB, range(8)) == pytest.approx(19.0)


# -- structure of the model ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_group_of_one_costs_zero(kind):
    assert H100.collective_us(kind, GIB, [5]) == 0.0


def test_p2p_needs_two_ranks():
    for ranks in ([0], [0, 1, 2]):
        with pytest.raises(ValueError, match="exactly 2 ranks"):
            H100.collective_us(OpKind.RECV, 8, ranks)


@pytest.mark.parametrize("kind", list(OpKind))
@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_forced_algorithm_supported_or_refused(kind, algorithm):
    ranks = [0, 8] if kind.is_p2p else range(32)
    if algorithm in supported_algorithms(kind):
        assert H100.collective_us(kind, 1 << 20, ranks, algorithm) > 0
    else:
        with pytest.raises(ValueError, match="supported"):
            H100.collective_us(kind, 1 << 20, ranks, algorithm)


@pytest.mark.parametrize(
    ("kind", "size", "ranks", "expected"),
    [
        (OpKind.ALL_REDUCE, GIB, range(8), Algorithm.RING),  # one node: ring on NVLink
        (OpKind.ALL_GATHER, 8, range(8), Algorithm.RING),
        (OpKind.ALL_TO_ALL, GIB, range(64), Algorithm.DIRECT),
        (OpKind.SCATTER, 8, range(64), Algorithm.DIRECT),
        (OpKind.ALL_REDUCE, 1 << 20, range(64), Algorithm.TREE),  # small all_reduce over nodes
        (OpKind.ALL_GATHER, 1 << 20, range(8192), Algorithm.HIERARCHICAL),  # many nodes
        (OpKind.REDUCE_SCATTER, GIB, range(8192), Algorithm.HIERARCHICAL),
        (OpKind.ALL_REDUCE, GIB, range(16), Algorithm.RING),  # huge, few nodes
    ],
)
def test_choose_algorithm(kind, size, ranks, expected):
    assert H100.choose_algorithm(kind, size, ranks) is expected
    assert H100.breakdown(kind, size, H100.placement(ranks)).algorithm is expected


@given(
    kind=st.sampled_from(COLLECTIVES),
    size=st.integers(0, 1 << 34),
    nodes=st.integers(1, 64),
)
@settings(max_examples=150, deadline=None)
def test_chosen_algorithm_is_fastest_supported(kind, size, nodes):
    ranks = range(8 * nodes)
    chosen = H100.collective_us(kind, size, ranks)
    forced = [H100.collective_us(kind, size, ranks, alg) for alg in supported_algorithms(kind)]
    if nodes > 1:
        assert chosen == min(forced)
    assert chosen == H100.collective_us(kind, size, ranks, H100.choose_algorithm(kind, size, ranks))


def test_intra_node_faster_than_inter_node():
    for name in ("dgx-h100", "dgx-a100"):
        model = CostModel(load_profile(name))
        for size in (0, 8, 1 << 20, GIB):
            assert model.p2p_us(size, 0, 1) < model.p2p_us(size, 0, 8)
            for kind in COLLECTIVES:
                # 8 ranks in one node vs 8 ranks on 8 nodes (a stride of 8), same size.
                assert model.collective_us(kind, size, range(8)) < model.collective_us(
                    kind, size, range(0, 64, 8)
                ), (name, kind, size)


def test_placement():
    pl = GroupPlacement.from_ranks([0, 1, 8, 9, 10], 8)
    assert pl == GroupPlacement(size=5, num_nodes=2, max_ranks_per_node=3, min_ranks_per_node=2)
    assert H100.placement((0, 1, 8, 9, 10)) is H100.placement([0, 1, 8, 9, 10])  # cached
    for bad in ([], [0, 0], [-1], [1.5]):
        with pytest.raises(ValueError):
            GroupPlacement.from_ranks(bad, 8)
    with pytest.raises(ValueError, match="from_ranks"):
        GroupPlacement(size=4, num_nodes=3, max_ranks_per_node=1, min_ranks_per_node=1)


def test_bad_call_arguments():
    with pytest.raises(NotImplementedError, match="no formula for op"):
        H100.collective_us("all_shuffle", 8, range(8))
    for size in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="size_bytes"):
            H100.collective_us(OpKind.ALL_REDUCE, size, range(8))
    with pytest.raises(TypeError):
        CostModel("dgx-h100")
    # plain strings are accepted for kind and algorithm
    assert H100.collective_us("all_reduce", 8, range(8), "ring") == H100.collective_us(
        OpKind.ALL_REDUCE, 8, range(8), Algorithm.RING
    )


# -- properties ---------------------------------------------------------------------------------

BUILTIN_MODELS = [CostModel(load_profile(name)) for name in available_profiles()]


def _balanced_sizes(gpus_per_node: int) -> list[int]:
    """Group sizes whose contiguous placement is balanced: within one node, or whole nodes."""
    return list(range(1, gpus_per_node + 1)) + [gpus_per_node * k for k in (2, 3, 4, 16, 128, 1024)]


@given(
    model=st.sampled_from(BUILTIN_MODELS),
    kind=st.sampled_from(COLLECTIVES),
    sizes=st.lists(st.integers(0, 1 << 36), min_size=2, max_size=2).map(sorted),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_monotonic_in_size(model, kind, sizes, data):
    n = data.draw(st.sampled_from(_balanced_sizes(model.profile.gpus_per_node)))
    algorithm = data.draw(st.sampled_from([None, *supported_algorithms(kind)]))
    small, large = (model.collective_us(kind, s, range(n), algorithm) for s in sizes)
    assert small <= large


@given(
    model=st.sampled_from(BUILTIN_MODELS),
    kind=st.sampled_from(COLLECTIVES),
    size=st.integers(0, 1 << 36),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_monotonic_in_group_size(model, kind, size, data):
    group_sizes = st.sampled_from(_balanced_sizes(model.profile.gpus_per_node))
    smaller, larger = sorted(data.draw(st.lists(group_sizes, min_size=2, max_size=2)))
    algorithm = data.draw(st.sampled_from([None, *supported_algorithms(kind)]))
    small = model.collective_us(kind, size, range(smaller), algorithm)
    assert small <= model.collective_us(kind, size, range(larger), algorithm)


_positive = st.floats(1e-3, 1e4, allow_nan=False)
_links = st.builds(LinkSpec, bandwidth_gbytes_per_s=_positive, latency_us=st.floats(0, 100))
_profiles = st.builds(
    HardwareProfile,
    name=st.just("random"),
    description=st.just(""),
    gpus_per_node=st.integers(1, 16),
    intra_node=_links,
    inter_node=_links,
    bus_efficiency=st.floats(0.01, 1.0),
    p2p_efficiency=st.floats(0.01, 1.0),
    collective_overhead_us=st.floats(0, 1e3),
    p2p_overhead_us=st.floats(0, 1e3),
)


@given(
    profile=_profiles,
    kind=st.sampled_from(list(OpKind)),
    size=st.integers(0, 1 << 40),
    ranks=st.lists(st.integers(0, 4096), min_size=1, max_size=64, unique=True),
)
@settings(max_examples=300, deadline=None)
def test_non_negative_finite_deterministic(profile, kind, size, ranks):
    if kind.is_p2p:
        ranks = (ranks + [4097])[:2]
    model = CostModel(profile)
    got = model.collective_us(kind, size, ranks)
    assert got >= 0 and math.isfinite(got)
    assert (
        got == model.collective_us(kind, size, ranks) == CostModel(profile).collective_us(kind, size, ranks)
    )
    parts = model.breakdown(kind, size, model.placement(ranks))
    assert parts.total_us == pytest.approx(got)
    assert parts.latency_us >= 0 and parts.transfer_us >= 0
    for algorithm in supported_algorithms(kind):
        forced = model.collective_us(kind, size, ranks, algorithm)
        assert forced >= 0 and math.isfinite(forced)


# -- profiles -----------------------------------------------------------------------------------


def test_builtin_profiles_load_and_round_trip(tmp_path):
    names = available_profiles()
    assert names == ["dgx-a100", "dgx-b200", "dgx-h100", "dgx-h200", "host-cpu", "local-cpu-gloo",
                     "local-cpu-gloo-train"]
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        assert profile_from_yaml(profile_to_yaml(profile)) == profile
        path = tmp_path / f"{name}-copy.yaml"
        path.write_text(profile_to_yaml(profile))
        assert load_profile(str(path)) == profile


def test_aliases_and_figures():
    for alias in ("H100", "h100", "DGX-H100"):
        assert load_profile(alias).name == "dgx-h100"
    assert load_profile("a100").name == "dgx-a100"
    h100, a100 = load_profile("H100"), load_profile("A100")
    assert (h100.intra_node.bandwidth_gbytes_per_s, h100.inter_node.bandwidth_gbytes_per_s) == (450.0, 50.0)
    assert (a100.intra_node.bandwidth_gbytes_per_s, a100.inter_node.bandwidth_gbytes_per_s) == (300.0, 25.0)
    assert h100.gpus_per_node == a100.gpus_per_node == 8
    assert "calibrate to trust" in load_profile("local-cpu-gloo").description


def test_override_profile():
    slower = override_profile(
        load_profile("H100"), {"inter_node.bandwidth_gbytes_per_s": 25, "bus_efficiency": 0.5}
    )
    assert slower.inter_node.bandwidth_gbytes_per_s == 25.0 and slower.bus_efficiency == 0.5
    assert CostModel(slower).collective_us(OpKind.ALL_REDUCE, GIB, range(16)) > H100.collective_us(
        OpKind.ALL_REDUCE, GIB, range(16)
    )
    with pytest.raises(ProfileError, match="inter_node.bandwidth"):
        override_profile(slower, {"inter_node.bandwith": 1})
    with pytest.raises(ProfileError, match="`intra_node.latency_us`"):
        override_profile(slower, {"intra_node.latency_us": -1})


_DROP = object()  # BAD_CASES value meaning: delete the field
BAD_CASES = [
    *[(field, _DROP, f"missing field `{field}`") for field in ("name", "gpus_per_node", "intra_node")],
    ("inter_node.latency_us", _DROP, "missing field `inter_node.latency_us`"),
    ("bus_eficiency", 0.8, "unknown field `bus_eficiency`; did you mean `bus_efficiency`"),
    ("intra_node.bandwidth", 1.0, "unknown field `intra_node.bandwidth`"),
    ("intra_node.bandwidth_gbytes_per_s", 0, "`intra_node.bandwidth_gbytes_per_s` must be finite and > 0"),
    ("inter_node.bandwidth_gbytes_per_s", -5.0, "`inter_node.bandwidth_gbytes_per_s` must be finite"),
    ("inter_node.latency_us", -1.0, "`inter_node.latency_us` must be finite and >= 0"),
    ("intra_node.latency_us", float("nan"), "`intra_node.latency_us` must be finite"),
    ("intra_node.bandwidth_gbytes_per_s", "450 GB/s", "`intra_node.bandwidth_gbytes_per_s` must be a number"),
    ("bus_efficiency", 0.0, "`bus_efficiency` must be finite and > 0"),
    ("bus_efficiency", 80, "`bus_efficiency` must be a fraction in (0, 1]"),
    ("p2p_efficiency", True, "`p2p_efficiency` must be a number"),
    ("collective_overhead_us", -0.5, "`collective_overhead_us` must be finite and >= 0"),
    ("gpus_per_node", 0, "`gpus_per_node` must be >= 1"),
    ("gpus_per_node", 2.5, "`gpus_per_node` must be a positive integer"),
    ("name", "", "`name` must be a non-empty string"),
    ("inter_node", 50.0, "`inter_node` must be a mapping"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_CASES)
def test_bad_profile_files_name_field_and_file(tmp_path, field, value, message):
    data = yaml.safe_load(profile_to_yaml(load_profile("dgx-h100")))
    head, _, tail = field.partition(".")
    parent, key = (data[head], tail) if tail else (data, head)
    if value is _DROP:
        del parent[key]
    else:
        parent[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_malformed_yaml_reports_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ngpus_per_node: 8\nintra_node: [1, 2\nbus_efficiency: 0.8\n")
    with pytest.raises(ProfileError, match="malformed YAML") as info:
        load_profile(str(path))
    assert f"{path}:4:" in str(info.value)


@pytest.mark.parametrize(("text", "message"), [("", "empty"), ("- 1\n- 2\n", "mapping")])
def test_empty_or_non_mapping_profile(text, message):
    with pytest.raises(ProfileError, match=message):
        profile_from_yaml(text, source="x.yaml")


def test_unknown_name_and_missing_file():
    with pytest.raises(ProfileError) as info:
        load_profile("dgx-b300")
    text = str(info.value)
    assert "dgx-b300" in text and all(name in text for name in available_profiles()) and "path" in text
    with pytest.raises(ProfileError, match="cannot read profile file"):
        load_profile("/nonexistent/cluster.yaml")


def test_profile_error_is_value_error_and_direct_construction_validates():
    assert issubclass(ProfileError, ValueError)
    with pytest.raises(ProfileError, match="bandwidth_gbytes_per_s"):
        LinkSpec(bandwidth_gbytes_per_s=0.0, latency_us=1.0)


def test_cost_layer_imports_only_stdlib_yaml_and_the_layers_below():
    allowed = set(sys.stdlib_module_names) | {"yaml"}
    below = ("prism_plugin.config.", "prism_plugin.topology.", "prism_plugin.cost.")
    for source in (Path(__file__).resolve().parents[2] / "prism_plugin" / "cost").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules = {node.module or ""}
            else:
                continue
            for module in modules:
                ours = module.startswith(below)
                assert ours or module.split(".")[0] in allowed, (source.name, module)
