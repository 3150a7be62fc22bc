"""The fake CUDA extensions Megatron's fusions call on virtual GPUs compute what the extensions compute.

Outside a virtual GPU each fake runs as plain torch on real CPU tensors, so its math is checked here against
torch: the masked softmaxes against ``torch.softmax`` and their backward against autograd, the wgrad GEMM's
in-place accumulation against ``main_grad + grad_output^T @ input``. Their cost as one kernel on a virtual GPU is
in tests/emulated/test_fusion_regions.py.
"""

from __future__ import annotations

import pytest
import torch

from prism_plugin.adapters.megatron.fused_kernels import EXTENSIONS, extensions

FAKES = extensions()


def test_every_extension_megatron_imports_has_a_fake() -> None:
    assert set(FAKES) == set(EXTENSIONS)


def test_wgrad_gemm_accum_adds_the_weight_gradient_into_main_grad_in_place() -> None:
    torch.manual_seed(0)
    total_input = torch.randn(2, 8, 16, dtype=torch.bfloat16)  # (s, b, k): the kernel flattens the leading dims
    grad_output = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    main_grad = torch.randn(4, 16)
    expected = main_grad + grad_output.reshape(16, 4).t().float() @ total_input.reshape(16, 16).float()
    storage = main_grad.untyped_storage().data_ptr()
    FAKES["fused_weight_gradient_mlp_cuda"].wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.untyped_storage().data_ptr() == storage
    torch.testing.assert_close(main_grad, expected, rtol=1e-2, atol=1e-2)  # the product is rounded to bf16
    with pytest.raises(TypeError, match="accumulates into torch.float32"):
        FAKES["fused_weight_gradient_mlp_cuda"].wgrad_gemm_accum_fp32(total_input, grad_output, main_grad.half())


def test_the_wgrad_kernel_records_nothing_for_autograd_even_in_grad_mode() -> None:
    """Megatron's drain_embedding_wgrad_compute calls the kernel in grad mode with an activation that requires grad.
    The CUDA kernel records no graph; the fake's eager math did, on main_grad (a view of the grad buffer), and that
    graph kept each deferred grad_output alive (+45% peak in the defer-embedding-wgrad functional test)."""
    import gc
    import weakref

    total_input = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)  # the layer's saved activation
    grad_output = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    buffer = torch.zeros(2 * 4 * 16)
    main_grad = buffer[64:].view(4, 16)  # Megatron's main_grad: a view into the bucket's grad buffer
    assert torch.is_grad_enabled()
    FAKES["fused_weight_gradient_mlp_cuda"].wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert not main_grad.requires_grad and main_grad.grad_fn is None and buffer.grad_fn is None
    alive = weakref.ref(grad_output)
    del grad_output
    gc.collect()
    assert alive() is None  # nothing holds the consumed gradient


@pytest.mark.parametrize("module", ["scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                                    "scaled_softmax_cuda"])
def test_masked_softmax_forward_and_in_place_backward_match_torch(module: str) -> None:
    torch.manual_seed(0)
    scale = torch.tensor([0.125])[0]  # Megatron passes the scale as a 0-d CPU tensor
    scores = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 8, 8) > 0.7
    reference = scores.float() * 0.125
    if module == "scaled_upper_triang_masked_softmax_cuda":
        scores, reference = scores.view(8, 8, 8), reference.view(8, 8, 8)
        reference = reference.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        args: tuple = (scores, scale)
    elif module == "scaled_masked_softmax_cuda":
        reference = reference.masked_fill(mask, -10000.0)
        args = (scores, mask, scale)
    else:
        args = (scores, scale)
    reference = reference.requires_grad_()
    expected = torch.softmax(reference, dim=-1)
    probs = FAKES[module].forward(*args)
    assert probs.dtype == torch.bfloat16 and probs.shape == scores.shape
    torch.testing.assert_close(probs.float(), expected, rtol=1e-2, atol=1e-2)
    grads = torch.randn_like(probs)
    (expected_input_grad,) = torch.autograd.grad(expected, reference, grads.float())
    returned = FAKES[module].backward(grads, probs, scale)
    assert returned is grads  # in place into the output gradients, as apex's kernels write them
    torch.testing.assert_close(returned.float(), expected_input_grad * 0.125, rtol=2e-2, atol=2e-2)


def test_forward_refuses_what_the_extension_refuses() -> None:
    with pytest.raises(TypeError, match="float16/bfloat16"):
        FAKES["scaled_softmax_cuda"].forward(torch.randn(1, 1, 4, 4), 1.0)


@pytest.mark.parametrize("key_seq_len,expected", [(4096, 4), (2048, 4), (128, 8), (64, 8), (16, 16)])
def test_batch_per_block_is_apex_s_formula(key_seq_len: int, expected: int) -> None:
    # 128 threads: (128 / warp size) warps, a warp of min(next power of two, 32) lanes per row, 2 rows a warp <= 128
    assert FAKES["scaled_masked_softmax_cuda"].get_batch_per_block(key_seq_len, key_seq_len, 1, 16) == expected
