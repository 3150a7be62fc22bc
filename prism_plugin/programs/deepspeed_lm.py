"""A small decoder-only language model trained with DeepSpeed (ZeRO 0-3), written for GPUs.

    python -m prism_plugin.programs.deepspeed_lm --deepspeed_config ds_config.json --seq-length 1024 \
        [--hidden 1024] [--layers 2] [--heads 16] [--vocab 32000] [--steps 3]

A plain DeepSpeed script with the one documented change for emulation,
``prism_plugin.deepspeed.init_distributed(config)`` instead of ``deepspeed.init_distributed()``: with a
``"prism"`` section in the config it runs as rank r of N (``"device": "virtual-gpu"``: on a virtual GPU), without
one it is an ordinary DeepSpeed job. The model (embedding, pre-norm blocks of causal self-attention through
``scaled_dot_product_attention`` and a GELU MLP of 4 x hidden, final norm, untied output layer) is built on the
accelerator's device (under ``deepspeed.zero.Init`` for ZeRO-3); its batches are random token ids made on the
device, ``train_micro_batch_size_per_gpu`` x ``--seq-length`` each. One step is gradient_accumulation_steps
forward/backward passes plus ``engine.step()`` each (DeepSpeed steps the optimizer at the boundary).

Non-goals: the pipeline engine (``deepspeed.pipe``; see `prism_plugin.programs.deepspeed_mlp`), real data.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

import prism_plugin.deepspeed as prism_ds


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def model_flops_per_iteration(*, global_batch: int, seq: int, hidden: int, layers: int, vocab: int) -> int:
    """Model FLOPs of one step of this model (forward + backward = 3 x forward; matmuls only, causal attention
    counted in full as Megatron counts it): per token and layer 24 h^2 (qkv 6, proj 2, MLP 16) + 4 s h
    (scores and context), plus 2 h V for the output layer.

    >>> model_flops_per_iteration(global_batch=1, seq=2, hidden=4, layers=1, vocab=8)
    2880
    """
    per_token = layers * (24 * hidden * hidden + 4 * seq * hidden) + 2 * hidden * vocab
    return 3 * global_batch * seq * per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--deepspeed_config", "--config", dest="config", required=True)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    torch.manual_seed(0)
    device = torch.device(get_accelerator().current_device_name())
    if (config.get("zero_optimization") or {}).get("stage", 0) == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LM(args.vocab, args.hidden, args.layers, args.heads)
    else:
        with device:
            model = LM(args.vocab, args.hidden, args.layers, args.heads)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(args.steps):
        for _ in range(gas):
            tokens = torch.randint(args.vocab, (micro, args.seq_length + 1), device=engine.device)
            logits = engine(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        print(f"DS_STEP {step}", flush=True)


if __name__ == "__main__":
    main()
