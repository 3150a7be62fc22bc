"""Megatron-core at real width on a virtual H100: GPT layers of Llama-3-8B (TP8) as rank 0 of 64, no GPU, no shim.

`prism run --device virtual-gpu` runs a plain Megatron-core script (``initialize_model_parallel``, the CUDA RNG
tracker, ``GPTModel`` with the local spec, forward and backward on ``cuda``) unmodified: Megatron takes its GPU
code paths; the adapters' CPU shim is not involved. Parameter counts and bytes are exact (computed below from
the architecture); host-side work (the RNG tracker's state check) runs for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema
from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(8, 1, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        ffn_hidden_size=14336, params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=8,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
        gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128256,
                     max_sequence_length=4096, position_embedding_type="rope").cuda()
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="cuda")
    loss = model(tokens, torch.arange(4096, device="cuda").unsqueeze(0), None, labels=tokens).float().mean()
    loss.backward()
    params = list(model.parameters())
    print("RESULT " + json.dumps({
        "numel": sum(p.numel() for p in params), "devices": sorted({str(p.device) for p in params}),
        "param_bytes": [p.numel() * p.element_size() for p in params],
        "grad_bytes": [p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None],
        "dtypes": [str(p.dtype) for p in params],
        "grad_dtypes": [str(p.grad.dtype) for p in params if p.grad is not None],
        "peak": torch.cuda.max_memory_allocated()}), flush=True)
""")


@pytest.mark.heavy  # about 55 s; the Llama-3-8B-width TP8 training test runs in CI
def test_llama3_8b_width_gpt_layers_run_forward_and_backward_on_a_virtual_h100(tmp_path: Path) -> None:
    script = tmp_path / "gpt.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "64", "--real-ranks",
                           "0", "--profile", "dgx-h100", "--device", "virtual-gpu", "--output", str(out), "--",
                           str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    h, tp, ffn, vocab = 4096, 8, 14336, 128256
    embedding = vocab // tp * h  # 16032 x 4096, the vocab-parallel embedding shard; the output layer is the same
    layer = ((h + 2 * 8 * 128) // tp * h  # fused QKV: 32 query heads + 2 x 8 key/value groups of 128, per TP rank
             + h // tp * h  # attention output projection
             + 2 * ffn // tp * h + ffn // tp * h  # SwiGLU fc1 (gate and up) and fc2
             + 2 * h)  # the two RMSNorms
    assert result["numel"] == 2 * embedding + 2 * layer + h == 185_880_576
    assert result["devices"] == ["cuda:0"]
    # every parameter has its gradient, of its own dtype and size (bf16 weights; the local spec's torch
    # RMSNorm keeps fp32 weights: 4 of them, 2 per layer; the final norm is TransformerEngine's (TENorm, bf16):
    # Megatron's TransformerBlock takes TENorm for it whenever TE is importable, as on a GPU host with TE)
    assert result["grad_bytes"] == result["param_bytes"] and result["grad_dtypes"] == result["dtypes"]
    assert result["dtypes"].count("torch.float32") == 4
    summary = json.loads((out / "rank0.summary.json").read_text())
    assert_published_schema(summary)  # the drop-in's summary: its megatron section, the virtual GPU's
    device0 = summary["virtual_gpu"]["devices"][0]
    params = sum(round_size(b) for b in result["param_bytes"])
    logits = 4096 * (vocab // tp) * 2  # one sequence's bf16 logits shard, alive between forward and backward
    assert device0["peak_allocated_bytes"] == result["peak"] >= 2 * params + logits
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    # no value had to be invented: Megatron's RNG-tracker check (torch.all(a == b).item()) compares CPU RNG
    # states, which the host computes for real (only the GPU is virtual)
    assert summary["virtual_gpu"]["values"]["reads"] == 0
