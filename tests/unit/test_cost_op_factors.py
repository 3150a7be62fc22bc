"""Per-op transfer factors of a hardware profile: optional, backwards compatible, and fitted by calibrate.

Added for the recipes (like-for-like CPU step times): gloo's all_gather / reduce_scatter run several times
slower per byte than its all_reduce, which one shared bus efficiency cannot express.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, GroupPlacement, ProfileError, load_profile, override_profile
from prism_plugin.cost.calibrate import Measurement, fit_op_factors, fit_profile, one_node_placement
from prism_plugin.cost.profiles import available_profiles, profile_from_yaml, profile_to_yaml

H100 = load_profile("dgx-h100")
ONE8 = one_node_placement(8)
TWO16 = GroupPlacement.from_ranks(range(16), 8)


def test_builtin_profiles_have_no_factors_and_yaml_is_unchanged() -> None:
    for name in available_profiles():
        p = load_profile(name)
        text = profile_to_yaml(p)
        assert profile_from_yaml(text) == p
        if name in ("local-cpu-gloo-train", "host-cpu"):  # fitted with --per-op (host-cpu: the same comm figures)
            assert dict(p.op_transfer_factors) == {"all_reduce": 1.6422, "broadcast": 0.6271, "send": 0.9722}
            continue
        assert p.op_transfer_factors == ()
        assert "op_transfer_factors" not in text  # files written before the field existed look the same


def test_factor_scales_the_transfer_term_of_its_op_only() -> None:
    p = dataclasses.replace(H100, op_transfer_factors={"all_gather": 3.0, "send": 2.0})
    assert p.op_transfer_factors == (("all_gather", 3.0), ("send", 2.0))
    base, scaled = CostModel(H100), CostModel(p)
    for pl in (ONE8, TWO16):
        b = base.breakdown(OpKind.ALL_GATHER, 2**28, pl)
        s = scaled.breakdown(OpKind.ALL_GATHER, 2**28, pl)
        assert s.algorithm is b.algorithm and s.latency_us == b.latency_us
        assert s.transfer_us == pytest.approx(3.0 * b.transfer_us)
        assert scaled.collective_us_placed(OpKind.ALL_REDUCE, 2**28, pl) == base.collective_us_placed(
            OpKind.ALL_REDUCE, 2**28, pl)
    lat = 5.0 + 10.0  # p2p overhead + inter-node latency (dgx-h100), 1 MB from rank 0 to 8
    assert scaled.p2p_us(10**6, 0, 8) - lat == pytest.approx(2.0 * (base.p2p_us(10**6, 0, 8) - lat))
    pair = GroupPlacement.from_ranks((0, 8), 8)
    assert scaled.collective_us_placed(OpKind.RECV, 10**6, pair) == pytest.approx(scaled.p2p_us(10**6, 0, 8))


def test_yaml_round_trip_and_override() -> None:
    p = dataclasses.replace(H100, op_transfer_factors={"reduce_scatter": 4.25})
    text = profile_to_yaml(p)
    assert yaml.safe_load(text)["op_transfer_factors"] == {"reduce_scatter": 4.25}
    assert profile_from_yaml(text) == p
    q = override_profile(p, {"op_transfer_factors.all_gather": 2.0, "bus_efficiency": 0.7})
    assert dict(q.op_transfer_factors) == {"all_gather": 2.0, "reduce_scatter": 4.25} and q.bus_efficiency == 0.7


@pytest.mark.parametrize(("factors", "message"), [
    ({"all_gathr": 2.0}, "`op_transfer_factors.all_gathr`: unknown op; did you mean `all_gather`?"),
    ({"all_gather": 0.0}, "`op_transfer_factors.all_gather` must be finite and > 0"),
    ({"all_gather": "fast"}, "`op_transfer_factors.all_gather` must be a number"),
    (5, "`op_transfer_factors` must map op names to factors"),
])
def test_bad_factors_are_named(factors: object, message: str) -> None:
    data = yaml.safe_load(profile_to_yaml(H100))
    data["op_transfer_factors"] = factors
    with pytest.raises(ProfileError) as exc:
        profile_from_yaml(yaml.safe_dump(data), source="mine.yaml")
    assert message in str(exc.value)


def _measure(truth: CostModel) -> list[Measurement]:
    sizes = [2**k for k in range(10, 27, 2)]
    out = []
    for kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.BROADCAST, OpKind.SEND):
        pl = one_node_placement(2)
        out += [Measurement(kind=kind, size_bytes=s, placement=pl,
                            time_us=truth.collective_us_placed(kind, s, pl)) for s in sizes]
    return out


def test_calibrate_fits_per_op_factors() -> None:
    truth_profile = dataclasses.replace(load_profile("local-cpu-gloo"), name="truth",
                                        op_transfer_factors={"all_gather": 3.0, "reduce_scatter": 4.0})
    ms = _measure(CostModel(truth_profile))
    shared = fit_profile(ms, name="shared", description="", gpus_per_node=2)
    per_op = fit_profile(ms, name="per-op", description="", gpus_per_node=2, per_op_factors=True)
    # one shared efficiency cannot fit ops whose per-byte cost differs 4x; per-op factors can
    assert shared.max_rel_error(OpKind.REDUCE_SCATTER) > 0.3
    for kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.SEND):
        assert per_op.max_rel_error(kind) < 0.12, kind
    f = dict(per_op.profile.op_transfer_factors)
    ar = f.get("all_reduce", 1.0)
    assert f["reduce_scatter"] / ar == pytest.approx(4.0, rel=0.1)
    assert f["all_gather"] / ar == pytest.approx(3.0, rel=0.1)
    # the written YAML carries them and loads back
    assert profile_from_yaml(per_op.to_yaml()).op_transfer_factors == per_op.profile.op_transfer_factors
    assert fit_op_factors(truth_profile, ms) == (("all_gather", 3.0), ("reduce_scatter", 4.0))
