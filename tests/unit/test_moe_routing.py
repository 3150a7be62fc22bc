"""The MoE routing policy of virtual GPUs (`adapters.megatron.moe`): its counts, without Megatron running."""

from __future__ import annotations

import pytest

from prism_plugin.adapters.megatron.moe import balanced_counts, parse_routing, skewed_counts
from prism_plugin.config.errors import ConfigError


def test_routing_specs_parse_and_bad_ones_name_the_flag() -> None:
    assert parse_routing(None).name == parse_routing("balanced").name == "balanced"
    skew = parse_routing("skew:7")
    assert (skew.kind, skew.seed, skew.alpha, skew.name) == ("skew", 7, 1.0, "skew:7,1")
    assert parse_routing("skew:3,0.5").name == "skew:3,0.5"
    assert parse_routing(parse_routing("skew:3,0.5").name) == parse_routing("skew:3,0.5")  # the env round trip
    for bad in ("skew", "skew:", "skew:x", "skew:-1", "skew:1,-2", "zipf:1", "skew:1,a", "skew:7,inf", "skew:7,nan"):
        with pytest.raises(ConfigError, match=r"--prism-moe-routing .*'balanced' or 'skew:SEED\[,ALPHA\]'"):
            parse_routing(bad)


def test_balanced_counts_are_exact_and_the_remainder_rotates_over_sources() -> None:
    assert balanced_counts(4096, 2, 8, source=5) == [1024] * 8  # Mixtral: 4096 tokens x top-2 over 8 experts
    # 4095 x 2 = 8190 = 8 x 1023 + 6: six experts get one more, starting at source x 6
    assert balanced_counts(4095, 2, 8, source=0) == [1024] * 6 + [1023] * 2
    assert balanced_counts(4095, 2, 8, source=1) == [1024] * 4 + [1023] * 2 + [1024] * 2  # experts 6, 7, 0..3
    # over 4 sources the 24 extras land 3 on each expert: the group's load is balanced too
    totals = [sum(col) for col in zip(*(balanced_counts(4095, 2, 8, source=s) for s in range(4)), strict=True)]
    assert totals == [4 * 1023 + 3] * 8


def test_skew_is_deterministic_differs_by_seed_and_layer_and_respects_one_expert_per_token() -> None:
    a = skewed_counts(4096, 2, 8, seed=7, alpha=1.0, layer=0)
    assert a == skewed_counts(4096, 2, 8, seed=7, alpha=1.0, layer=0)
    assert a != skewed_counts(4096, 2, 8, seed=8, alpha=1.0, layer=0)
    assert a != skewed_counts(4096, 2, 8, seed=7, alpha=1.0, layer=1)
    assert sum(a) == 8192 and a != [1024] * 8
    # Zipf shares 1/j over H_8 = 761/280: 8192 x 280/761/j = 3014.14, 1507.07, 1004.71, 753.54, 602.83, 502.36,
    # 430.59, 376.77; the floors sum to 8188, the 4 largest remainders (.83, .77, .71, .59) get one more
    assert sorted(a, reverse=True) == [3014, 1507, 1005, 753, 603, 502, 431, 377]
    assert skewed_counts(4096, 2, 8, seed=7, alpha=0.0, layer=0) == [1024] * 8  # alpha 0: balanced
    # a steep skew caps the hottest experts at one assignment per token (4096) and spreads the rest
    steep = skewed_counts(4096, 2, 8, seed=1, alpha=4.0, layer=0)
    assert max(steep) == 4096 and sum(steep) == 8192 and all(c >= 0 for c in steep)
    top1 = skewed_counts(100, 1, 4, seed=0, alpha=50.0, layer=0)
    assert sorted(top1) == [0, 0, 0, 100]
