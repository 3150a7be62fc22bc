"""TransformerEngine's own modules on a virtual H100: each TE kernel is one ``prism_te`` kernel, costed exactly.

Each case runs in a fresh process (the virtual CUDA device library and TE's fake extension load before torch) and
records every ``prism_te`` kernel the virtual GPU launches as (name, class, dtype, FLOPs, bytes, shape), the
`kernel_cost` the kernel model would time. Figures follow from the shapes: a GEMM's FLOPs are 2mnk, its bytes its
operands read plus its output written; FP8 operands are 1 byte an element and timed as ``float8_e4m3fn``.
"""

from __future__ import annotations

import pytest
from children import EPILOGUE, program, run_child

MiB = 1 << 20

PRELUDE = """
import json, sys
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
from prism_plugin.device.kernels import kernel_cost
costs = []
def model(func, args, kwargs, out):
    cost = kernel_cost(func, args, kwargs, out)
    if cost is None:
        return None
    if cost.op.startswith(("prism_te.", "flash_attn.")):
        costs.append([cost.op.split(".")[1], cost.kernel_class.value, cost.dtype, cost.flops, cost.bytes,
                      list(cost.shape)])
    return 2.0**-20
def take():
    taken = costs[:]
    costs.clear()
    return taken
out = {}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8).start()
    clock = vg.start_time(model, 2.0**-17)
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
"""

LINEAR = """
lin = te.Linear(1024, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.empty(2048, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
"""


def run(body: str) -> dict:
    return run_child(program(PRELUDE, body, EPILOGUE))


def test_te_linear_bf16_runs_its_three_gemms_as_te_kernels(library: None) -> None:
    out = run(LINEAR + """
y = lin(x)
y.sum().backward()
out["kernels"] = take()
out["fake_extension"] = type(sys.modules["transformer_engine_torch"]).__name__
""")
    assert out["fake_extension"] == "_FakeExtension"
    flops = 2 * 2048 * 4096 * 1024
    # forward y = x W^T: (2048, 4096, k 1024); dgrad dx = dy W: (2048, 1024, k 4096); wgrad dW = dy^T x
    # (TE's NT layout: D (4096, 1024), k 2048). Bytes: W 8 MiB + x 4 MiB + y 16 MiB, all bf16, in each.
    assert out["kernels"] == [
        ["gemm", "gemm", "bfloat16", flops, 28 * MiB, [2048, 4096, 1024]],
        ["gemm", "gemm", "bfloat16", flops, 28 * MiB, [2048, 1024, 4096]],
        ["gemm", "gemm", "bfloat16", flops, 28 * MiB, [4096, 1024, 2048]],
    ]


def test_te_linear_under_delayed_scaling_runs_fp8_gemms_and_te_casts(library: None) -> None:
    out = run(LINEAR + """
with te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)):
    y = lin(x)
y.sum().backward()
out["kernels"] = take()
""")
    flops = 2 * 2048 * 4096 * 1024
    cast = 4 + 4 + 4  # scale read, scale-inverse and amax written (fp32 each)
    assert out["kernels"] == [
        # the input's cast-transpose: 4 MiB bf16 read, 2 MiB E4M3 data + 2 MiB transpose written
        ["cast_transpose_fp8", "elementwise", "bfloat16", 0, 8 * MiB + cast, [2048, 1024]],
        # the weight's (cached for backward): 8 MiB read, 4 + 4 MiB written
        ["cast_transpose_fp8", "elementwise", "bfloat16", 0, 16 * MiB + cast, [4096, 1024]],
        # FP8 forward GEMM: W 4 MiB + x 2 MiB (E4M3) read, y 16 MiB bf16 written
        ["gemm", "gemm", "float8_e4m3fn", flops, 22 * MiB, [2048, 4096, 1024]],
        # the forward amax reduction's update: amax history (16 x 3 fp32) and 3 scales
        ["fused_amax_and_scale_update", "elementwise", "float32", 0, 420, [16, 3]],
        # dy's cast to E5M2 (hybrid): 16 MiB read, 8 + 8 MiB written
        ["cast_transpose_fp8", "elementwise", "bfloat16", 0, 32 * MiB + cast, [2048, 4096]],
        # dgrad from W's transpose (4 MiB) and dy (8 MiB), dx 4 MiB bf16; wgrad from x's transpose and dy's
        ["gemm", "gemm", "float8_e4m3fn", flops, 16 * MiB, [2048, 1024, 4096]],
        ["gemm", "gemm", "float8_e4m3fn", flops, 18 * MiB, [4096, 1024, 2048]],
        ["fused_amax_and_scale_update", "elementwise", "float32", 0, 280, [16, 2]],
    ]


def test_an_fp8_modules_checkpoint_state_pickles_its_scaling_state_as_zeros(library: None) -> None:
    """A checkpoint of an FP8 job: TE pickles each module's scaling state (copied to the host); fake tensors hold
    no values, so they are written as zero tensors of their shapes (the checkpoint itself is not written)."""
    out = run(LINEAR + """
with te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)):
    y = lin(x)
import pickle
from torch.utils._python_dispatch import _disable_current_modes
extra = lin.get_extra_state()
with _disable_current_modes():  # read back as the host would, outside the virtual GPU
    state = pickle.loads(extra.numpy().tobytes())
out["extra"] = [str(extra.dtype), list(state["scale_fwd"].shape), list(state["amax_history_fwd"].shape),
                float(state["amax_history_fwd"].abs().sum()), type(state["scale_fwd"]).__name__]
""")
    # TE's forward scaling state of a Linear: 3 scales (input, weight, output), a 16 x 3 amax history
    assert out["extra"] == ["torch.uint8", [3], [16, 3], 0.0, "Tensor"]


def test_current_scaling_computes_the_amax_then_casts(library: None) -> None:
    out = run(LINEAR + """
with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_format=Format.HYBRID)):
    y = lin(x)
out["kernels"] = [k[:2] + k[5:] for k in take()]
""")
    assert out["kernels"] == [
        ["compute_amax", "reduction", [2048, 1024]], ["compute_scale_from_amax", "elementwise", [1]],
        ["cast_transpose_fp8", "elementwise", [2048, 1024]],
        ["compute_amax", "reduction", [4096, 1024]], ["compute_scale_from_amax", "elementwise", [1]],
        ["cast_transpose_fp8", "elementwise", [4096, 1024]],
        ["gemm", "gemm", [2048, 4096, 1024]],
    ]


def test_rmsnorm_and_fused_attention_are_one_kernel_each(library: None) -> None:
    out = run("""
x = torch.empty(2048, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
norm = te.RMSNorm(1024, params_dtype=torch.bfloat16, device="cuda")
norm(x).sum().backward()
out["norm"] = take()
dpa = te.DotProductAttention(num_attention_heads=8, kv_channels=64, num_gqa_groups=2, attn_mask_type="causal",
                             qkv_format="sbhd")
q = torch.empty(2048, 1, 8, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
k = torch.empty(2048, 1, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
v = torch.empty(2048, 1, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
o = dpa(q, k, v)
o.sum().backward()
out["attention"] = take()
out["attention_out"] = list(o.shape)
""")
    # forward: x 4 MiB + gamma 2 KiB read, y 4 MiB + rsigma (2048 fp32) written; backward: dy, x, rsigma, gamma
    # read, dx and dgamma written
    assert out["norm"] == [
        ["rmsnorm_fwd", "norm", "bfloat16", 0, 8 * MiB + 2048 + 8192, [2048, 1024]],
        ["rmsnorm_bwd", "norm", "bfloat16", 0, 12 * MiB + 8192 + 2048 + 2048, [2048, 1024]],
    ]
    # TE chose cuDNN's fused attention (one kernel each way, no s x s tensor): 4 b h s^2 d FLOPs forward, causal:
    # the 2048 * 2049 / 2 unmasked pairs of 2048^2; backward torch's flash-backward count (2.5x) with the same mask
    causal = 2048 * 2049 // 2
    forward = 4 * 8 * 2048 * 2048 * 64 * causal // (2048 * 2048)
    assert [k[:4] + k[5:] for k in out["attention"]] == [
        ["fused_attn_fwd", "attention", "bfloat16", forward, [1, 8, 2048, 2048, 64, 1]],
        ["fused_attn_bwd", "attention", "bfloat16", forward * 5 // 2, [1, 8, 2048, 2048, 64, 1]],
    ]
    assert out["attention_out"] == [2048, 1, 512]


def test_flash_backend_runs_flash_attn_with_its_workspaces(library: None) -> None:
    """``--attention-backend flash`` (Megatron sets TE's switches so): TE calls flash-attn 2.8.3's own Python layer,
    whose operators' fake implementations give the outputs; the C++'s workspaces are held during the backward."""
    out = run_child(program(PRELUDE, """
dpa = te.DotProductAttention(num_attention_heads=8, kv_channels=64, num_gqa_groups=2, attn_mask_type="causal",
                             qkv_format="bshd")
q = torch.empty(1, 2048, 8, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
k = torch.empty(1, 2048, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
v = torch.empty(1, 2048, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
take()
o = dpa(q, k, v)
out["after_forward"] = torch.cuda.memory_allocated()
o.sum().backward()
out["attention"] = take()
out["peak"] = torch.cuda.max_memory_allocated()
out["extension"] = type(sys.modules["flash_attn_2_cuda"]).__name__
""", EPILOGUE), env={"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"})
    assert out["extension"] == "_Extension"
    causal = 2048 * 2049 // 2
    forward = 4 * 8 * 2048 * 2048 * 64 * causal // (2048 * 2048)
    assert [k[:4] + k[5:] for k in out["attention"] if k[0].startswith("_flash")] == [
        ["_flash_attn_forward", "attention", "bfloat16", forward, [1, 8, 2048, 2048, 64, 1]],
        ["_flash_attn_backward", "attention", "bfloat16", forward * 5 // 2, [1, 8, 2048, 2048, 64, 1]],
    ]
    # forward: q 2 MiB, k and v 0.5 MiB each, out 2 MiB, softmax_lse (1, 8, 2048) fp32 64 KiB, rng_state 512 B
    # (one block), cu_seqlens 512 B. Backward peak adds: o.sum() and its ones 512 B each; dq, dk, dv (3 MiB);
    # softmax_d (1, 8, 2048) fp32 64 KiB; and the C++'s workspaces: dq_accum fp32 (1, 2048, 8, 64) 4 MiB and,
    # GQA 8 heads over 2, dk_expanded and dv_expanded (1, 2048, 8, 64) bf16 2 MiB each
    assert out["after_forward"] == 5 * MiB + 64 * 1024 + 1024
    assert out["peak"] == out["after_forward"] + 1024 + 3 * MiB + 64 * 1024 + 8 * MiB


def test_the_fused_moe_router_is_one_kernel_per_step_with_tes_buffers(library: None) -> None:
    """``--moe-router-fusion``: TE's fused top-k, aux-loss scores and aux loss, forward and backward."""
    out = run("""
from transformer_engine.pytorch.router import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                                               fused_topk_with_score_function)
logits = torch.empty(4096, 8, dtype=torch.bfloat16, device="cuda", requires_grad=True)
take()
before = torch.cuda.memory_allocated()
probs, routing_map = fused_topk_with_score_function(logits, 2, False, None, None, None, "softmax", None)
out["topk_bytes"] = torch.cuda.memory_allocated() - before
_, scores = fused_compute_score_for_moe_aux_loss(logits, 2, "softmax")
tokens = torch.empty(8, dtype=torch.int64, device="cuda")
loss = fused_moe_aux_loss(scores, tokens, 4096, 8, 2, 0.01)
(probs.sum() + loss).backward()
out["router"] = [k[:5] for k in take() if k[0].startswith("router_")]
""")
    tokens_experts = 4096 * 8
    # top-k: probs bf16, routing map bool, fp32 intermediate (as TE's C++ allocates them), each [4096, 8]
    assert out["topk_bytes"] == tokens_experts * (2 + 1 + 4)
    assert out["router"] == [
        ["router_topk_fwd", "elementwise", "bfloat16", 0, tokens_experts * (2 + 2 + 1 + 4)],
        ["router_aux_scores_fwd", "elementwise", "bfloat16", 0, tokens_experts * (2 + 4 + 1 + 4)],
        ["router_aux_loss_fwd", "reduction", "float32", 0, tokens_experts * 4 + 8 * 8 + 4 + 8],
        ["router_aux_loss_bwd", "elementwise", "float32", 0, 8 + 8 * 8 + 4 + tokens_experts * 4],
        ["router_aux_scores_bwd", "elementwise", "float32", 0, tokens_experts * (4 + 4 + 2)],
        ["router_topk_bwd", "elementwise", "float32", 0, tokens_experts * (1 + 4 + 2 + 2)],
    ]


@pytest.mark.parametrize("name", ["nvshmem_finalize", "an_unknown_kernel"])
def test_kernels_without_a_fake_refuse_when_called(library: None, name: str) -> None:
    out = run_child(program(PRELUDE, f"""
import transformer_engine_torch as tex
tex.{name}()
""", EPILOGUE), allow_error=True)
    assert out["error"].startswith(f"NotImplementedError: transformer_engine_torch.{name} on a virtual GPU")


def test_fp8_weights_scales_are_one_multi_tensor_kernel_in_place(library: None) -> None:
    # what TE's tensor/utils.py launches for FP8 primary weights under current scaling (--fp8-param-gather):
    # scale and scale_inv from each amax, written in place into the given fp32 tensors
    out = run("""
import transformer_engine_torch as tex
amaxes, scales, inverses = ([torch.empty(1, device="cuda") for _ in range(4)] for _ in range(3))
noop = torch.zeros(1, dtype=torch.int32, device="cuda")
before = torch.cuda.memory_allocated()
out["result"] = tex.multi_tensor_compute_scale_and_scale_inv(2048 * 32, noop, [amaxes, scales, inverses], 448.0,
                                                             False, 0.0)
out["allocated"] = torch.cuda.memory_allocated() - before
out["kernels"] = take()
""")
    assert out["result"] is None and out["allocated"] == 0  # in place: nothing allocated, nothing returned
    # one kernel: reads the 12 tensors, writes the 8 scales and inverses (4 B each)
    assert out["kernels"] == [["multi_tensor_compute_scale_and_scale_inv", "elementwise", "float32", 0, 20 * 4, [1]]]


def test_grouped_linear_runs_one_gemm_per_group_with_rows(library: None) -> None:
    out = run("""
grouped = te.GroupedLinear(3, 1024, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.empty(2048, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
y = grouped(x, [1024, 0, 1024])
y.sum().backward()
out["kernels"] = [k[:2] + k[3:4] + k[5:] for k in take()]
out["y"] = list(y.shape)
""")
    flops = 2 * 1024 * 4096 * 1024
    # forward, dgrad, wgrad for the two groups with rows (TE's grouped GEMM); the empty group launches none
    assert out["kernels"] == [["gemm", "gemm", flops, [1024, 4096, 1024]]] * 2 + \
        [["gemm", "gemm", flops, [1024, 1024, 4096]]] * 2 + [["gemm", "gemm", flops, [4096, 1024, 1024]]] * 2
    assert out["y"] == [2048, 4096]


def test_block_scaling_runs_fp8_gemms_on_the_transposed_column_wise_data(library: None) -> None:
    """FP8 block scaling (``--fp8-recipe blockwise``): 1 x 128 blocks for activations and gradients, 128 x 128 for
    weights, each with its fp32 scale. The column-wise data is stored transposed (TE's ``get_columnwise_shape``:
    what Hopper's TN GEMM reads), so the wgrad GEMM reads x and dy that way: shapes and FLOPs are the bf16 GEMMs'."""
    out = run(LINEAR + """
from transformer_engine.common.recipe import Float8BlockScaling
with te.autocast(enabled=True, recipe=Float8BlockScaling()):
    y = lin(x)
y.sum().backward()
out["kernels"] = take()
""")
    assert "error" not in out, out["error"]
    flops = 2 * 2048 * 4096 * 1024

    def scales(rows: int, cols: int, block_rows: int) -> int:
        """fp32 scale-inverses of the row-wise and the column-wise data (TE's ``get_scale_shape``: a 1 x 128 block
        per 128 elements of a row, or a 128 x 128 block; the inner dimension padded to a multiple of 4)."""
        def pad(n: int) -> int:
            return -(-n // 4) * 4
        if block_rows == 1:
            return 4 * (cols // 128 * pad(rows) + rows // 128 * pad(cols))
        return 4 * 2 * (rows // 128 * pad(cols // 128))

    assert out["kernels"] == [
        # the input's cast: 4 MiB bf16 read; 2 MiB row-wise + 2 MiB column-wise E4M3 and their 1 x 128 scales
        ["quantize_float8block", "elementwise", "bfloat16", 0, 8 * MiB + scales(2048, 1024, 1), [2048, 1024]],
        # the weight's: 8 MiB read, 4 + 4 MiB written, 128 x 128 scales
        ["quantize_float8block", "elementwise", "bfloat16", 0, 16 * MiB + scales(4096, 1024, 128), [4096, 1024]],
        ["gemm", "gemm", "float8_e4m3fn", flops, 22 * MiB, [2048, 4096, 1024]],  # W 4 + x 2 MiB, y 16 MiB bf16
        # dy's cast: 16 MiB read, 8 + 8 MiB written
        ["quantize_float8block", "elementwise", "bfloat16", 0, 32 * MiB + scales(2048, 4096, 1), [2048, 4096]],
        # dgrad from W's column-wise data (4 MiB) and dy (8 MiB), dx 4 MiB; wgrad from x's and dy's column-wise
        # (transposed) data, dW 8 MiB bf16
        ["gemm", "gemm", "float8_e4m3fn", flops, 16 * MiB, [2048, 1024, 4096]],
        ["gemm", "gemm", "float8_e4m3fn", flops, 18 * MiB, [4096, 1024, 2048]],
    ]
    assert scales(2048, 1024, 1) == 131072 and scales(4096, 1024, 128) == 2048  # as TE 2.14 allocates them
