"""The attention stand-in's pure parts: its mode, its up-front refusals, the CP chunk order, and the FLOPs the kernel
model counts for flash-attention's own ops on dense inputs (`prism_plugin.adapters.megatron.attention`)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from prism_plugin.adapters.megatron import attention
from prism_plugin.adapters.megatron.attention import AttentionMode, attention_mode, check_job
from prism_plugin.adapters.megatron.refusals import Refusal
from prism_plugin.config.errors import ConfigError
from prism_plugin.runtime.virtual_gpu.kernels import _dense_flash_flops


def test_mode_from_the_flag_else_the_environment_else_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attention.ENV, raising=False)
    assert attention_mode() is AttentionMode.LOCAL
    monkeypatch.setenv(attention.ENV, "flash")
    assert attention_mode() is AttentionMode.FLASH
    assert attention_mode("local") is AttentionMode.LOCAL
    with pytest.raises(ConfigError, match="--prism-attention / PRISM_ATTENTION 'fused'.*flash.*local"):
        attention_mode("fused")


def _ns(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"context_parallel_size": 1, "transformer_impl": "local", "cp_comm_type": ["p2p"],
                                 **kw})


def test_refusals_name_the_flag() -> None:
    with pytest.raises(Refusal, match="--prism-attention flash is a stand-in for virtual GPUs"):
        check_job(_ns(), AttentionMode.FLASH, virtual_gpu=False)
    with pytest.raises(Refusal, match="--context-parallel-size 2: .*pass --prism-attention flash"):
        check_job(_ns(context_parallel_size=2), AttentionMode.LOCAL, virtual_gpu=True)
    with pytest.raises(Refusal, match="--cp-comm-type a2a"):
        check_job(_ns(context_parallel_size=2, cp_comm_type=["a2a"]), AttentionMode.FLASH, virtual_gpu=True)
    check_job(_ns(), AttentionMode.LOCAL, virtual_gpu=False)  # the default: nothing to refuse
    for types in (["p2p"], ["all_gather"], ["allgather", "p2p"]):
        check_job(_ns(context_parallel_size=4, cp_comm_type=types), AttentionMode.FLASH, virtual_gpu=True)


def test_load_balanced_chunks_reorder_to_sequence_order_and_back() -> None:
    attention._CHUNK_IDS.clear()
    # CP 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; gathered rank after rank: [0, 3, 1, 2]
    assert attention._chunk_ids(2, torch.device("cpu"), False).tolist() == [0, 3, 1, 2]
    assert attention._chunk_ids(2, torch.device("cpu"), True).tolist() == [0, 2, 3, 1]
    gathered = torch.tensor([0, 0, 3, 3, 1, 1, 2, 2])  # chunk ids of an all-gathered 8-token sequence, chunk 2
    in_order = attention._reorder(gathered, 2, to_sequence=True)
    assert in_order.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert attention._reorder(in_order, 2, to_sequence=False).tolist() == gathered.tolist()
    attention._CHUNK_IDS.clear()


def test_dense_flash_ops_count_sdpa_flops_on_b_h_s_d() -> None:
    q = torch.empty(1, 2048, 16, 128, device="meta")  # (B, S, H, D): 16 query heads, 4 key/value groups
    k = v = torch.empty(1, 6144, 4, 128, device="meta")
    forward = _dense_flash_flops("_flash_attention_forward", (q, k, v, None, None, 2048, 6144))
    assert forward == sdpa_flop_count((1, 16, 2048, 128), (1, 4, 6144, 128), (1, 4, 6144, 128))
    assert forward == 4 * 16 * 2048 * 6144 * 128  # two GEMMs of 2 x s_q x s_k x d per head
    empty = torch.empty(0, dtype=torch.int32, device="meta")
    backward = _dense_flash_flops("_flash_attention_backward", (q, q, k, v, q, None, empty, empty, 2048, 6144))
    assert backward == sdpa_backward_flop_count((1, 16, 2048, 128), (1, 16, 2048, 128), (1, 4, 6144, 128),
                                                (1, 4, 6144, 128)) == 2.5 * forward
    seqlens = torch.zeros(3, dtype=torch.int32, device="meta")  # nested (varlen) call: torch's own formula
    assert _dense_flash_flops("_flash_attention_forward", (q, k, v, seqlens, seqlens, 2048, 6144)) is None
