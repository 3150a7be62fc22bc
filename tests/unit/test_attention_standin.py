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
from prism_plugin.device.kernels import _dense_flash_flops


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


def _bottom_right_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q [sq, h, d] over k, v [sk, h, d] with flash-attention's causal mask (query i sees keys
    j <= i + sk - sq), on the CPU in float64."""
    sq, sk = q.size(0), k.size(0)
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed).transpose(0, 1)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_cp_plan_computes_causal_attention_of_the_whole_sequence(cp: int) -> None:
    """The stand-in's CP decomposition, every rank simulated in one process with real CPU tensors: each rank's
    load-balanced chunks (r, 2cp-1-r), the all-gathered K/V reordered into sequence order, one bottom-right-causal
    attention per query chunk over ``k_seq[:keys]``, and dK/dV accumulated in sequence order, reordered and
    reduce-scattered (summed over ranks, rank r's slice) give causal attention over the whole sequence and its
    gradients."""
    torch.manual_seed(0)
    chunk, heads, dim = 3, 2, 4
    s = 2 * cp * chunk
    q, k, v = (torch.randn(s, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(s, heads, dim, dtype=torch.float64)
    reference = _bottom_right_causal(q, k, v)  # square: the ordinary causal mask
    reference.backward(grad_out)

    def local(t: torch.Tensor, rank: int) -> torch.Tensor:  # Megatron's get_batch_on_this_cp_rank layout
        return torch.cat([t[c * chunk:(c + 1) * chunk] for c in (rank, 2 * cp - 1 - rank)])

    gathered_k = torch.cat([local(k.detach(), r) for r in range(cp)])  # all_gather_into_tensor, rank after rank
    gathered_v = torch.cat([local(v.detach(), r) for r in range(cp)])
    k_seq = attention._reorder(gathered_k, cp, to_sequence=True).requires_grad_()
    v_seq = attention._reorder(gathered_v, cp, to_sequence=True).requires_grad_()
    assert torch.equal(k_seq, k.detach()) and torch.equal(v_seq, v.detach())
    dk_seq_sum, dv_seq_sum = torch.zeros_like(k_seq), torch.zeros_like(v_seq)
    for rank in range(cp):
        q_local = local(q.detach(), rank).requires_grad_()
        rows_out = []
        for rows, keys in attention._query_chunks(rank, cp, chunk, causal=True):
            rows_out.append(_bottom_right_causal(q_local[rows], k_seq[:keys], v_seq[:keys]))
        out = torch.cat(rows_out)
        torch.testing.assert_close(out, local(reference.detach(), rank))
        dq, dk_seq, dv_seq = torch.autograd.grad(out, (q_local, k_seq, v_seq), local(grad_out, rank))
        torch.testing.assert_close(dq, local(q.grad, rank))
        dk_seq_sum += dk_seq  # the reduce-scatter's sum over the CP group
        dv_seq_sum += dv_seq
    dk_gathered = attention._reorder(dk_seq_sum, cp, to_sequence=False)
    dv_gathered = attention._reorder(dv_seq_sum, cp, to_sequence=False)
    for rank in range(cp):  # rank r keeps slice r of the reduce-scattered tensor: its own chunks' gradients
        part = slice(rank * 2 * chunk, (rank + 1) * 2 * chunk)
        torch.testing.assert_close(dk_gathered[part], local(k.grad, rank))
        torch.testing.assert_close(dv_gathered[part], local(v.grad, rank))
    attention._CHUNK_IDS.clear()


def test_features_the_standin_does_not_compute_are_refused_by_name() -> None:
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from prism_plugin.adapters.megatron.attention import AttentionNotSupported, _forward, _refuse_config

    plain = {"window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla"}
    _refuse_config(SimpleNamespace(**plain), 1)
    with pytest.raises(AttentionNotSupported, match="window attention"):
        _refuse_config(SimpleNamespace(**{**plain, "window_size": (128, 0)}), 1)
    with pytest.raises(AttentionNotSupported, match="off-by-one / learnable softmax"):
        _refuse_config(SimpleNamespace(**{**plain, "softmax_type": "learnable"}), 1)
    module = SimpleNamespace(attn_mask_type=AttnMaskType.causal)
    q = torch.empty(8, 1, 4, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(AttentionNotSupported, match="packed sequences"):
        _forward(module, q, q, q, None, None, object())
    with pytest.raises(AttentionNotSupported, match="attention bias"):
        _forward(module, q, q, q, None, q, None)
    with pytest.raises(AttentionNotSupported, match="mask type padding"):
        _forward(module, q, q, q, AttnMaskType.padding, None, None)
    with pytest.raises(AttentionNotSupported, match="torch.float32 query/key with head dim 16"):
        _forward(module, q.float(), q.float(), q.float(), None, None, None)
