"""The new_group path of older torch: the delegation to the default group hidden.

torch 2.13 hands every `new_group` (any `backend=`) to the default group's `new_group`; torch
2.11/2.12 call the backend creator instead, and prism redirects explicitly requested real side
backends (`backend="gloo"`) to itself (a real gloo group would wait for absent ranks). Workers run
with PRISM_NEW_GROUP_DELEGATION=0 to take that path here. Every group of the setup is created with
`backend="gloo"`; world, strided, singleton (and pairs, 3-rank) all_reduce / all_gather / broadcast /
reduce_scatter cases must conform to the real gloo run exactly as on the delegated path.
"""

from __future__ import annotations

from typing import Any

import programs as prog
import pytest
from checks import check_case
from harness import Mode, Setup

pytestmark = pytest.mark.slow

GROUPS = prog.standard_groups(backend="gloo")
REAL_SETS = {"k1-rank0": (0,), "k1-rank3": (3,), "k2-ranks12": (1, 2)}
OPS = ["all_reduce.SUM", "all_reduce.MAX", "all_reduce.PRODUCT", "all_gather.list", "all_gather.tensor",
       "broadcast.rootlast", "reduce_scatter.tensor.SUM"]
FAMILIES = ["world", "all4", "strided", "single", "pairs", "tri"]
CASES = [
    (f"{op}-{dtype}-{family}-{'async' if a else 'sync'}",
     {"op": op, "dtype": dtype, "family": family, "async_op": a})
    for op in OPS for dtype in ("fp32", "i64") for family in FAMILIES for a in (False, True)
]


def _setup(real: tuple[int, ...]) -> Setup:
    return Setup(mode=Mode.PRISM, real_ranks=real, delegation=False, groups=GROUPS)


@pytest.fixture(scope="module")
def results(cluster) -> dict[str, list[dict[int, Any]]]:
    calls = [(prog.collective, kw) for _, kw in CASES]
    out = {"gloo": cluster.run_batch(Setup(mode=Mode.GLOO, groups=GROUPS), calls)}
    for name, real in REAL_SETS.items():
        both = cluster.run_batch(_setup(real), calls + calls)
        out[name], out[name + "#repeat"] = both[: len(calls)], both[len(calls):]
    return out


@pytest.mark.parametrize("index", range(len(CASES)), ids=[cid for cid, _ in CASES])
def test_conforms_without_delegation(index: int, results) -> None:
    case_id, kw = CASES[index]
    for name, real in REAL_SETS.items():
        per_rank = results[name][index]
        for rank in real:
            check_case(kw, rank, real, results["gloo"][index][rank], per_rank[rank],
                       results[name + "#repeat"][index][rank], per_rank,
                       f"{case_id} without delegation, {name}, rank {rank}")


@pytest.mark.parametrize("delegation", [False, True], ids=["creator-path", "delegated"])
def test_gloo_groups_become_prism_groups(cluster, delegation: bool) -> None:
    per_rank = cluster.run(Setup(mode=Mode.PRISM, real_ranks=(1, 2), delegation=delegation, groups=GROUPS),
                           prog.group_probe)
    for rank, info in per_rank.items():
        assert info["delegation_env"] == ("1" if delegation else "0")
        assert info["world_has_new_group"] is delegation
        assert info["world_class"] == ("PrismProcessGroup" if delegation else "_NoDelegationGroup")
        for name, ranks, _backend in GROUPS:
            got = info["groups"][name]
            if rank not in ranks:
                assert got is None, f"rank {rank} got a group {name} it is no member of"
                continue
            # a real gloo group here would have waited for the absent ranks: it must be prism's
            assert got["class"] in ("PrismProcessGroup", "_NoDelegationGroup"), (name, got)
            assert got["ranks"] == list(ranks) and got["size"] == len(ranks)
            assert got["rank"] == list(ranks).index(rank)
        # the creator is called for member groups only: world + the 8 subsets holding this rank
        assert info["groups_created"] == 1 + sum(rank in r for _, r, _ in GROUPS)
