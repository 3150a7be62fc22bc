"""Megatron's process groups under prism equal those Megatron's own RankGenerator computes.

One real rank of N runs megatron-core's ``initialize_model_parallel`` on the prism backend; every
group it holds (tp, pp, cp, dp, dp-cp, model-parallel, tp-cp, tp-dp, tp-dp-cp, the five expert
groups, the embedding group) must have exactly the members ``RankGenerator(...).get_ranks(token)``
gives for N real ranks, for many layouts, both rank orders, and N up to 8192. Gloo twins are
prism groups (no rendezvous with virtual ranks) that work, and cost only this rank's few groups.
"""

from __future__ import annotations

import programs_megatron as pm
import pytest
from harness import Mode, Setup

pytestmark = pytest.mark.slow

# (N, rank, tp, pp, cp, ep, etp, order)
LAYOUTS = [
    (8, 5, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
    (16, 13, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp"),
    (64, 13, 2, 4, 2, 2, None, "tp-cp-ep-dp-pp"),
    (64, 37, 4, 2, 1, 4, 1, "tp-cp-ep-dp-pp"),
    (64, 50, 2, 4, 1, 8, 1, "tp-cp-ep-dp-pp"),
    (96, 71, 4, 3, 2, 1, None, "tp-cp-ep-dp-pp"),
    (64, 22, 2, 4, 1, 1, None, "tp-cp-ep-pp-dp"),
    (8192, 4100, 8, 4, 2, 8, 1, "tp-cp-ep-dp-pp"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"N{x[0]}-r{x[1]}-tp{x[2]}pp{x[3]}cp{x[4]}ep{x[5]}-{x[7]}")
def test_memberships_equal_rank_generator(mcluster, layout) -> None:
    world, rank, tp, pp, cp, ep, etp, order = layout
    setup = Setup(mode=Mode.PRISM, world_size=world, real_ranks=(rank,), label="groups")
    result = mcluster.run(setup, pm.groups_case, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order,
                          case_timeout_s=120)[rank]
    seen, expected = result["seen"], result["expected"]
    for name, members in expected.items():
        assert seen[name] == members, f"{name}: prism built {seen[name][:8]}, RankGenerator says {members[:8]}"
    twins = result["twins"]
    assert twins["dp_gloo"] == seen["dp"] and twins["dp_gloo_backend"] == "PrismProcessGroup"
    assert twins["dp_gloo_all_reduce"] == [float(len(seen["dp"]))] * 3


def test_gloo_twins_cost_only_this_ranks_groups(mcluster) -> None:
    counts = {}
    for gloo in (True, False):
        setup = Setup(mode=Mode.PRISM, world_size=8192, real_ranks=(4100,), label=f"gloo{gloo}")
        counts[gloo] = mcluster.run(setup, pm.groups_case, tp=8, pp=4, gloo=gloo, case_timeout_s=120)[4100]
    extra = counts[True]["groups_created"] - counts[False]["groups_created"]
    # Megatron makes gloo twins of the dp, dp-cp and expert-dp groups: this rank belongs to one of each
    assert 0 < extra <= 4, f"gloo twins created {extra} prism groups on this rank"
