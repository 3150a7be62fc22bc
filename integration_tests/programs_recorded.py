"""A NON-symmetric training-like program for the recorded policy (test_recorded.py).

Its data depends on the rank (float values from a per-rank generator, so summation order shows in
the last bits), it uses several groups, point-to-point between virtual and real peers, a broadcast
from rank 3 and broadcast_object_list from rank 3, and each step computes on what the previous one
received. Under the RECORDED policy every real rank must reproduce its recording-run values bit for
bit, whichever ranks are real.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import Ctx
from programs import gname


def _g(ctx: Ctx, ranks: tuple[int, ...]) -> Any:
    return ctx.groups[gname(ranks)]


def recorded_program(ctx: Ctx, steps: int = 2) -> dict[str, Any]:
    rank, n = ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(1234 + 17 * rank)
    out: dict[str, Any] = {}
    w = torch.randn(5, 5, generator=gen)
    for step in range(steps):
        p = f"s{step}."
        x = torch.randn(8, 5, generator=gen) * (rank + 1) + 0.1 * step
        # world all_reduce of rounding-sensitive floats
        dist.all_reduce(x)
        out[p + "all_reduce"] = x.clone()
        h = torch.tanh(x @ w)
        # AVG over the strided group (even / odd ranks), async with compute in between
        strided = _g(ctx, (0, 2) if rank % 2 == 0 else (1, 3))
        work = dist.all_reduce(h, op=dist.ReduceOp.AVG, group=strided, async_op=True)
        extra = (w * 0.5).sin()
        work.wait()
        out[p + "avg_strided"] = h.clone()
        # bf16 all_reduce: rounding inside the reduction
        hb = (h * (rank + 1)).to(torch.bfloat16)
        dist.all_reduce(hb, group=_g(ctx, (0, 1, 2, 3)))
        out[p + "bf16"] = hb.clone()
        # all_gather_into_tensor over pairs (0,1) / (2,3)
        pair = (0, 1) if rank < 2 else (2, 3)
        gathered = torch.empty(16, 5)
        dist.all_gather_into_tensor(gathered, h + extra[0], group=_g(ctx, pair))
        out[p + "all_gather_pairs"] = gathered.clone()
        # reduce_scatter over the world
        rs_in = torch.randn(4 * 6, generator=gen) + gathered.sum()
        rs_out = torch.empty(6)
        dist.reduce_scatter_tensor(rs_out, rs_in)
        out[p + "reduce_scatter"] = rs_out.clone()
        # uneven all_to_all_single: member j sends (i + 1 + rank % 2) rows to member i
        in_splits = [i + 1 + rank % 2 for i in range(n)]
        out_splits = [rank + 1 + j % 2 for j in range(n)]
        a2a_in = torch.randn(sum(in_splits), 3, generator=gen) + rs_out[:3]
        a2a_out = torch.empty(sum(out_splits), 3)
        dist.all_to_all_single(a2a_out, a2a_in, out_splits, in_splits)
        out[p + "all_to_all"] = a2a_out.clone()
        # ring p2p over the world: with a few real ranks, peers are virtual or real
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        send_t = a2a_out[:2].contiguous() * 2 + step
        recv_t = torch.empty(2, 3)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send_t, nxt), dist.P2POp(dist.irecv, recv_t, prv)])
        for req in reqs:
            req.wait()
        out[p + "ring"] = recv_t.clone()
        # blocking p2p inside the 3-rank group: 0 -> 1 -> 2 (rank 3 is no member)
        if rank in (0, 1, 2):
            tri = _g(ctx, (0, 1, 2))
            chain = torch.empty(4)
            if rank == 0:
                dist.send(recv_t.flatten()[:4] + 1, 1, group=tri)
            elif rank == 1:
                dist.recv(chain, 0, group=tri)
                dist.send(chain * 3, 2, group=tri)
            else:
                dist.recv(chain, 1, group=tri)
            out[p + "chain"] = chain.clone() if rank else None
            # reduce (MAX) to rank 2 inside the 3-rank group
            red = recv_t.flatten() * (rank - 1.5)
            dist.reduce(red, dst=2, op=dist.ReduceOp.MAX, group=tri)
            out[p + "reduce_max"] = red.clone() if rank == 2 else None
        # broadcast from rank 3 (virtual in most replays)
        b = torch.randn(7, generator=gen) if rank == 3 else torch.zeros(7)
        dist.broadcast(b, src=3)
        out[p + "bcast3"] = b.clone()
        # broadcast_object_list from rank 3
        objs: list[Any] = [{"step": step, "norm": float(b.norm()), "ids": [rank, 3 * step]}, "rank3"] \
            if rank == 3 else [None, None]
        dist.broadcast_object_list(objs, src=3)
        out[p + "objects3"] = objs
        # gather to rank 0, scatter from rank 2
        gather_list = [torch.empty(3) for _ in range(n)] if rank == 0 else None
        dist.gather(b[:3] + rank, gather_list, dst=0)
        out[p + "gather0"] = [t.clone() for t in gather_list] if gather_list else None
        scatter_out = torch.empty(2)
        chunks = [torch.randn(2, generator=gen) + i for i in range(n)] if rank == 2 else None
        dist.scatter(scatter_out, chunks, src=2)
        out[p + "scatter2"] = scatter_out.clone()
        # all_gather_object of something that depends on what arrived
        names: list[Any] = [None] * n
        dist.all_gather_object(names, (rank, round(float(scatter_out.sum()), 3)))
        out[p + "objects_all"] = names
        dist.barrier()
        # the "update": everything received feeds the next step
        w = w + 0.01 * torch.outer(x.mean(1)[:5], recv_t.flatten()[:5]) + 0.001 * b[:5].sum()
        out[p + "w"] = w.clone()
    loss = (w * w).sum().reshape(1)
    dist.all_reduce(loss)
    out["loss"] = loss
    return out
