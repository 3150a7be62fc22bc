"""Megatron's fusions on a virtual H100: each fused kernel is one region, and the fp32 softmax memory disappears.

A small GPT (2 layers, hidden 512, 8 heads, seq 2048, vocab 1024, bf16, the local spec, Megatron's DDP with fp32
main grads) runs one forward and backward through the drop-in (``python -m prism_plugin.megatron``, device
virtual-gpu, rank 0 of 8), once with ``bias_activation_fusion``, ``bias_dropout_fusion``,
``gradient_accumulation_fusion``, ``masked_softmax_fusion`` and ``persist_layer_norm`` on and once with all of them
off (the two runs start together: `integration_tests.at_once`). The memory figures are the caching-allocator
model's (exact to the byte), the times modelled (virtual time).

What disappears with the fusions, exactly: the unfused masked softmax (Megatron's ``forward_torch_softmax``) casts
the bf16 scores to fp32, masks them in place with a fresh causal mask and takes the softmax in fp32, so autograd
saves, per layer, the fp32 probabilities (4 B x batch x heads x seq^2) and the bool mask (seq^2 B); the fused
kernel saves only its bf16 output, which the unfused path makes too. Bias-GeLU and bias-dropout-add save the same
tensors fused or not (the fc1 output or its biased copy, both one activation; the dropout mask).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, FFN, SEQ, VOCAB, BATCH = 2, 512, 8, 2048, 2048, 1024, 1
SCRIPT = textwrap.dedent(f"""
    import json, sys, torch, torch.distributed as dist
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    fused = "--unfused" not in sys.argv
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers={LAYERS}, hidden_size={HIDDEN}, num_attention_heads={HEADS},
        ffn_hidden_size={FFN}, params_dtype=torch.bfloat16, bf16=True, attention_dropout=0.0,
        bias_activation_fusion=fused, bias_dropout_fusion=fused, gradient_accumulation_fusion=fused,
        masked_softmax_fusion=fused, persist_layer_norm=fused)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size={VOCAB},
                     max_sequence_length={SEQ}).cuda()
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    Float16Module(cfg, model))
    tokens = torch.zeros({BATCH}, {SEQ}, dtype=torch.long, device="cuda")
    position_ids = torch.arange({SEQ}, device="cuda").unsqueeze(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    after_forward = torch.cuda.memory_allocated() - base
    loss.backward()
    model.finish_grad_sync()
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({{"after_forward": after_forward, "peak": torch.cuda.max_memory_allocated() - base}}),
          flush=True)
""")


def _run(tmp: Path, *extra: str) -> tuple[dict[str, Any], dict[str, Any]]:
    script = tmp / "fused_gpt.py"
    script.write_text(SCRIPT)
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(script), *extra,
                           "--prism-world-size", "8", "--prism-real-ranks", "0", "--prism-profile", "dgx-h100",
                           "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return result, json.loads((out / "rank0.summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    fused, unfused = tmp_path_factory.mktemp("fused"), tmp_path_factory.mktemp("unfused")
    runs = at_once(lambda: _run(fused), lambda: _run(unfused, "--unfused"))
    return dict(zip(("fused", "unfused"), runs, strict=True))


def test_each_fused_kernel_is_one_region_in_the_kernel_tally(runs: dict) -> None:
    _, fused = runs["fused"]
    _, unfused = runs["unfused"]
    assert fused["megatron"]["switched_off"] == []  # no fusion default is switched off on a virtual GPU
    tally = {t["op"]: (t["class"], t["count"]) for t in fused["virtual_gpu"]["kernels"]["fused"]}
    linears = 4 * LAYERS + 1  # QKV, attention projection, fc1, fc2 per layer, and the (tied) output layer
    assert tally == {
        "fused::bias_gelu": ("elementwise", LAYERS),  # forward, inside Megatron's GeLUFunction
        "fused::bias_gelu_back": ("elementwise", LAYERS),  # its backward, a @jit_fuser function of its own
        "fused::bias_dropout_add_fused_train": ("elementwise", 2 * LAYERS),  # after attention and after the MLP
        "fused::scaled_upper_triang_masked_softmax_cuda.forward": ("norm", LAYERS),
        "fused::scaled_upper_triang_masked_softmax_cuda.backward": ("norm", LAYERS),
        "fused::wgrad_gemm_accum_fp32": ("gemm", linears),  # each weight gradient accumulated into main_grad
    }
    assert unfused["virtual_gpu"]["kernels"]["fused"] == []
    clocks = {name: run[1]["virtual_gpu"]["virtual_time"] for name, run in runs.items()}
    assert clocks["fused"]["kernels"] < clocks["unfused"]["kernels"]
    assert clocks["fused"]["device_s"] < clocks["unfused"]["device_s"]  # modelled


def test_the_fused_softmax_saves_no_fp32_probabilities_and_the_peak_drops(runs: dict) -> None:
    fused, _ = runs["fused"]
    unfused, _ = runs["unfused"]
    probabilities = 4 * BATCH * HEADS * SEQ * SEQ  # fp32 softmax output autograd saves per layer: 128 MiB
    causal_mask = SEQ * SEQ  # the bool mask masked_fill_ saves per layer (Megatron makes one per call): 4 MiB
    saved = LAYERS * (probabilities + causal_mask)
    assert unfused["after_forward"] - fused["after_forward"] == saved == 276_824_064
    # both peaks fall in the backward of the last layer's attention, where every layer's saved tensors are still
    # alive: the unfused peak holds at least those, and the unfused softmax backward's fp32 gradients besides
    assert unfused["peak"] - fused["peak"] >= saved
    assert fused["peak"] < unfused["peak"]
