"""One real rank of a 1,024- and an 8,192-rank Megatron job: the memory the layout implies.

Layout TP=2 x PP=2, so DP = N/4 (256, then 2,048) with Megatron's distributed optimizer, mirror
policy. The real rank is N/2 + 1: last pipeline stage (it reports the loss), TP rank 1 (its TP
rank 0 is virtual, so its batch is the adapter's synthetic one), DP rank 0 (its optimizer shard
holds parameters, not padding). It trains 2 steps: the loss stays finite and the parameters
change. Its Adam state is exactly 8 bytes (fp32 exp_avg + exp_avg_sq) per parameter element of
its optimizer shard, the shard Megatron computes from its own grad-buffer layout for this DP size,
so the state shrinks with DP.

The peak tensor memory is not asserted to shrink: Megatron's ``_get_param_groups`` gathers an
object from every rank over WORLD (``all_gather_object``), whose per-rank buffers grow with N
(measured: 115,664 B at N=1,024 and 491,520 B at N=8,192 for this tiny model); the real job
allocates them too.
"""

from __future__ import annotations

import math

import programs_megatron as pm
import pytest
from harness import Mode, Setup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(mcluster) -> dict[int, dict]:
    out = {}
    for world in (1024, 8192):
        rank = world // 2 + 1  # last stage, TP rank 1, DP rank 0
        setup = Setup(mode=Mode.PRISM, world_size=world, real_ranks=(rank,), label="scale")
        out[world] = mcluster.run(setup, pm.train_case, tp=2, pp=2, steps=2, microbatches=2, layers=2,
                                  case_timeout_s=240)[rank]
    return out


@pytest.mark.parametrize("world", [1024, 8192])
def test_mirror_training_proceeds(runs, world: int) -> None:
    result = runs[world]
    assert result["dp_size"] == world // 4
    assert result["finite"]
    assert all(math.isfinite(x) for step in result["losses"] for x in step) and result["losses"][0]
    assert result["params"][0][0].ne(result["params"][-1][0]).any()


@pytest.mark.parametrize("world", [1024, 8192])
def test_optimizer_state_is_the_layout_shard(runs, world: int) -> None:
    result = runs[world]
    assert result["optimizer_state_bytes"] == result["expected_state_bytes"] > 0


def test_state_shrinks_with_dp(runs) -> None:
    small, large = runs[1024], runs[8192]
    assert large["optimizer_state_bytes"] < small["optimizer_state_bytes"]
    # the shard is ~1/DP of the stage's grad buffer: DP grew 8x
    for result in (small, large):
        per_rank = result["grad_buffer_numel"] / result["dp_size"]
        assert result["optimizer_state_bytes"] / 8 <= per_rank


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_rank_of_64_with_virtual_experts(mcluster, dispatcher: str) -> None:
    # TP=2 with sequence parallelism (Megatron requires it for MoE + TP), EP=8: rank 5's expert
    # peers, TP peer and pipeline neighbours are virtual
    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.0, add_bias_linear=False,
               moe_token_dispatcher_type=dispatcher)
    setup = Setup(mode=Mode.PRISM, world_size=64, real_ranks=(5,), label=f"moe-{dispatcher}")
    result = mcluster.run(setup, pm.train_case, tp=2, ep=8, sp=True, moe=moe, steps=2)[5]
    assert result["finite"] and result["losses"][0]
    assert result["params"][0][0].ne(result["params"][-1][0]).any()
    if dispatcher == "alltoall":
        assert result["ops"]["all_to_all"] > 0
    else:
        assert "all_to_all" not in result["ops"]
