"""A Llama-style decoder trained data-parallel with plain torch.distributed on CUDA (bf16, AdamW).

It knows nothing of prism: on GPUs run it with ``torchrun --nproc-per-node 8 -m prism_plugin.programs.llama_ddp``;
on a CPU-only host ``prism run --device virtual-gpu --profile dgx-h100 --world-size 8192 --real-ranks 5 -m
prism_plugin.programs.llama_ddp --hidden 4096 ...`` runs it at real size on a virtual H100 (fake tensors).

The model: token embedding, `layers` x (RMSNorm, grouped-query attention through
``torch.nn.functional.scaled_dot_product_attention`` (causal; no rotary embedding: positions change no
tensor size), RMSNorm, SwiGLU MLP), a final RMSNorm and an untied output head; no biases; parameters in bf16.
Training is Megatron-style mixed precision: bf16 parameters and gradients for compute and communication,
fp32 main parameters with fp32 AdamW moments for the update (16 bytes per parameter of persistent state:
2 bf16 parameter + 2 bf16 gradient + 4 fp32 main parameter + 4 + 4 moments). Each step: ``--accumulation`` K
micro-batches of forward and backward (gradient accumulation: the bf16 gradients sum over them, each loss
scaled by 1/K when K > 1; global batch = micro-batch x K x world size), then per parameter ``all_reduce`` of
its bf16 gradient over the world and divide by the world size (data parallelism), the gradient cast to fp32
as the main parameter's gradient (the bf16 one freed), AdamW on the main parameters, their values copied
back into the bf16 parameters, main gradients freed.

Prints after each step ``LLAMA_STEP {"step", "loss", "allocated_bytes", "max_allocated_bytes", "params"}``
(one JSON line: ``torch.cuda.memory_allocated()`` / ``max_memory_allocated()`` of the current device).

Non-goals: rotary embeddings, dropout, a tokenizer or real data (uniform random tokens), activation
checkpointing, torch DDP's gradient buckets (the all_reduce per parameter is what DDP does without them).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, **factory: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, **factory: object) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False, **factory)  # type: ignore[arg-type]
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **factory)  # type: ignore[arg-type]
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **factory)  # type: ignore[arg-type]
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False, **factory)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, **factory: object) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False, **factory)  # type: ignore[arg-type]
        self.w3 = nn.Linear(hidden, ffn, bias=False, **factory)  # type: ignore[arg-type]
        self.w2 = nn.Linear(ffn, hidden, bias=False, **factory)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, **factory: object) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(hidden, **factory)
        self.attention = Attention(hidden, heads, kv_heads, **factory)
        self.ffn_norm = RMSNorm(hidden, **factory)
        self.feed_forward = SwiGLU(hidden, ffn, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 **factory: object) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden, **factory)  # type: ignore[arg-type]
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn, **factory) for _ in range(layers))
        self.norm = RMSNorm(hidden, **factory)
        self.output = nn.Linear(hidden, vocab, bias=False, **factory)  # type: ignore[arg-type]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=1,
                    help="micro-batches per step (gradient accumulation) before the all-reduce")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must divide by --heads and --heads by --kv-heads")
    if args.accumulation < 1:
        ap.error("--accumulation must be >= 1 (micro-batches per step)")

    dist.init_process_group("nccl")
    world = dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(1234)
    model = Llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                  kv_heads=args.kv_heads, ffn=args.ffn, device="cuda", dtype=torch.bfloat16)
    params = list(model.parameters())
    main_params = [p.detach().float() for p in params]  # fp32 main parameters: what AdamW updates
    opt = torch.optim.AdamW(main_params, lr=args.lr)
    for step in range(args.steps):
        for _micro in range(args.accumulation):  # gradient accumulation: p.grad sums over the micro-batches
            tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device="cuda")
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), tokens[:, 1:].reshape(-1))
            del logits
            (loss / args.accumulation if args.accumulation > 1 else loss).backward()
        for p, main_p in zip(params, main_params, strict=True):
            assert p.grad is not None
            dist.all_reduce(p.grad)  # data-parallel gradient sum over the world
            p.grad.div_(world)
            main_p.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, main_p in zip(params, main_params, strict=True):
                p.copy_(main_p)
                main_p.grad = None
        print("LLAMA_STEP " + json.dumps({"step": step, "loss": float(loss.item()),
                                          "allocated_bytes": int(torch.cuda.memory_allocated()),
                                          "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                                          "params": sum(p.numel() for p in params)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
