"""Pipeline schedules with virtual neighbours: one real rank as the first, a middle and the last stage.

1F1B (PP=4, ``_batched_p2p_ops``) and the interleaved schedule (PP=4 with 2 model chunks per
stage, ``_p2p_ops`` with handles; and PP=2 x 2 chunks, where one direction goes over WORLD) run
Megatron's real schedule for one rank while every other rank is virtual (mirror policy). Each
receive has the activation shape [seq, micro-batch, hidden]; values stay finite, the last stage
reports finite losses, parameters change (training proceeds), and the transfers are exactly the
ones the schedule implies.
"""

from __future__ import annotations

import math

import programs_megatron as pm
import pytest
import torch
from harness import Mode, Setup

pytestmark = pytest.mark.slow

STEPS, MICRO = 2, 4
ACT_BYTES = pm.SEQ * pm.MICRO * pm.HIDDEN * 4  # one fp32 activation / gradient [s, b, h]


def _run(mcluster, world: int, rank: int, pp: int, vpp: int | None) -> dict:
    setup = Setup(mode=Mode.PRISM, world_size=world, real_ranks=(rank,), label=f"pipe{pp}-{vpp}")
    layers = pp * (vpp or 1)
    return mcluster.run(setup, pm.train_case, pp=pp, vpp=vpp, layers=layers, steps=STEPS, microbatches=MICRO,
                        track_memory=False)[rank]


# world 8, pp 4: dp 2, stage = rank // 2 -> rank 0 first, rank 4 a middle stage, rank 7 last
@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("rank,stage", [(0, "first"), (4, "middle"), (7, "last")])
def test_stage_with_virtual_neighbours(mcluster, vpp: int | None, rank: int, stage: str) -> None:
    result = _run(mcluster, 8, rank, 4, vpp)
    assert result["finite"], f"{stage} stage: non-finite loss or gradient"
    assert not torch.equal(result["params"][0][0], result["params"][-1][0]), f"{stage} stage: parameters unchanged"
    chunks = vpp or 1
    # per step and micro-batch, each model chunk receives one activation (unless it is the very first
    # chunk) and one gradient (unless it is the very last chunk), and sends the same ones back
    first_chunks = 1 if stage == "first" else 0
    last_chunks = 1 if stage == "last" else 0
    recv_fwd = chunks - first_chunks
    recv_bwd = chunks - last_chunks
    expected = STEPS * MICRO * (recv_fwd + recv_bwd)
    assert result["ops"].get("recv", 0) == expected, f"{stage}: {result['ops']}"
    assert result["ops"].get("send", 0) == expected, f"{stage}: {result['ops']}"
    assert result["op_bytes"]["recv"] == expected * ACT_BYTES, "receives do not have the [s, b, h] shape"
    if stage == "last":
        assert all(len(step) == MICRO and all(math.isfinite(x) for x in step) for step in result["losses"])
    else:
        assert result["losses"] == [[]] * STEPS
    if stage != "first":
        # receives from a virtual stage with nothing to mirror were made non-degenerate
        assert result["adapter"]["p2p_virtual_receives_filled"] >= 1


@pytest.mark.parametrize("rank", [0, 3])
def test_two_stage_interleaved_uses_world_for_one_direction(mcluster, rank: int) -> None:
    # world 4, pp 2, dp 2: rank 0 first stage, rank 3 last; _p2p_ops sends one direction over WORLD
    result = _run(mcluster, 4, rank, 2, 2)
    assert result["finite"]
    assert result["ops"]["recv"] == STEPS * MICRO * 3 and result["ops"]["send"] == STEPS * MICRO * 3
    assert result["op_bytes"]["recv"] == STEPS * MICRO * 3 * ACT_BYTES
