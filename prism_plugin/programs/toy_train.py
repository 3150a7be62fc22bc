"""A small tensor- and data-parallel MLP trained with plain torch.distributed.

It knows nothing of prism: run it for real (``torchrun --nproc-per-node 4 -m
prism_plugin.programs.toy_train --tp 2``) or emulated at any scale (``prism run --world-size 8192
--real-ranks 0,4100 -m prism_plugin.programs.toy_train``). Megatron-style layout: ranks
``[dp * tp, (dp + 1) * tp)`` form a tensor-parallel group; a column-parallel then a row-parallel
linear (``--layers`` such blocks in a row), the row output summed over TP; gradients averaged over DP. Prints what
this rank saw (``--json``: one ``TOY_STEP {...}`` JSON line per step, the form the recipe harness's logs keep).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient over TP backward (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over TP forward, identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1,
                    help="MLP blocks, each a column- then a row-parallel linear (default 1)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu",
                    help="where the weights and batches live: cpu (default), or cuda (a GPU, or prism's virtual GPUs)")
    ap.add_argument("--json", action="store_true",
                    help="print each step as one JSON line (TOY_STEP {...}) instead of text")
    args = ap.parse_args()
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: give at least 1 MLP block")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp
    if world % tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp}")
    dp = world // tp
    # every rank creates every group, as torch requires (Megatron does the same)
    tp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
        if d == rank // tp:
            tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if t == rank % tp:
            dp_group = g
    tp_rank, dp_rank = rank % tp, rank // tp
    h, shard = args.hidden, args.hidden * 4 // tp
    torch.manual_seed(1000 + tp_rank)  # same weights across DP replicas, different TP shards
    blocks = []
    for _ in range(args.layers):
        w1 = torch.nn.Parameter((torch.randn(h, shard) / h**0.5).to(args.device))
        w2 = torch.nn.Parameter((torch.randn(shard, h) / shard**0.5).to(args.device))
        blocks.append((w1, w2))
    params = [w for block in blocks for w in block]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(7 + dp_rank)  # different data per DP replica
    print(f"[rank {rank}/{world}] tp group {dist.get_process_group_ranks(tp_group)[:3]}..  "
          f"dp group size {dist.get_world_size(dp_group)} (dp rank {dp_rank})", flush=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = torch.randn(args.batch, h, generator=gen).to(args.device)  # the generator is a CPU one
        target = torch.tanh(x)
        y = x
        for w1, w2 in blocks:
            y = _ReduceFromTP.apply(torch.nn.functional.gelu(_CopyToTP.apply(y, tp_group) @ w1) @ w2, tp_group)
        loss = torch.nn.functional.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        for p in params:  # data-parallel gradient average
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp)
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=dp_group)
        step_time_s = time.perf_counter() - t0
        if args.json:  # machine-readable: this rank's own loss, the DP-averaged one, the step's wall time
            print("TOY_STEP " + json.dumps({"rank": rank, "world_size": world, "step": step,
                                            "loss": loss.item(), "dp_mean_loss": reported.item() / dp,
                                            "step_time_s": step_time_s}), flush=True)
        else:
            print(f"[rank {rank}] step {step} loss {reported.item() / dp:.6f} "
                  f"step_time_ms {1e3 * step_time_s:.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group() if os.environ.get("PRISM_CONFIG") is None else None


if __name__ == "__main__":
    main()
