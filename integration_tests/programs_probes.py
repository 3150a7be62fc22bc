"""Worker-side probes of prism's timing and memory behaviour (test_timing.py, test_memory.py)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import Ctx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


# -- timing ----------------------------------------------------------------------------------------
def _compute_for(seconds: float) -> int:
    """Real CPU work (small matmuls) until `seconds` of wall time have passed; returns the count."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        count += 1
    return count


def timing_probe(ctx: Ctx, numel: int = 1 << 20, compute_s: float = 0.05) -> dict[str, Any]:
    """Async all_reduce over the world (all virtual but this rank) overlapped with compute."""
    from prism_plugin.config.kinds import OpKind

    session = ctx.session
    vg = dist.group.WORLD.vg
    x = torch.ones(numel)  # fp32: 4 MiB at the default numel
    model_s = session.cost_model.collective_us(OpKind.ALL_REDUCE, x.nbytes, range(ctx.world_size)) * 1e-6
    cost_s = session.cost_s(OpKind.ALL_REDUCE, x.nbytes, vg, None)
    dist.all_reduce(x)  # warm-up: caches (placement, cost) and the code path
    out: dict[str, Any] = {"model_s": model_s, "cost_s": cost_s}

    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    out["issue_s"] = time.perf_counter() - t0
    out["completed_at_issue"] = work.is_completed()
    _compute_for(compute_s)
    out["compute_done_s"] = time.perf_counter() - t0
    out["completed_before_wait"] = work.is_completed()
    work.wait()
    out["total_s"] = time.perf_counter() - t0
    out["completed_after_wait"] = work.is_completed()

    t0 = time.perf_counter()
    dist.all_reduce(x)
    out["sync_s"] = time.perf_counter() - t0
    return out


# -- memory ----------------------------------------------------------------------------------------
class AllocationLog(TorchDispatchMode):
    """Records every ATen op whose output owns a storage that none of its inputs owns.

    That is exactly "the op allocated a tensor": views and in-place ops return storage of an
    input, factory functions and out-of-place ops return a fresh one. Weak references to those
    tensors tell whether any scratch tensor survives the op. (Scalars wrapped into 0-dim CPU tensors
    by the Python argument parser, e.g. for ``t.mul_(4)``, are made before dispatch and never reach
    a mode: a few bytes of CPU memory, freed on return, never device memory.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[tuple[str, tuple[int, ...], int]] = []
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = func(*args, **(kwargs or {}))
        owned = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in owned:
                self.allocated.append((str(func), tuple(t.shape), t.untyped_storage().nbytes()))
                self.refs.append(weakref.ref(t))
        return result


def _ops(ctx: Ctx, g: Any, peer: int, real_src: int, virtual_src: int,
         root: int) -> dict[str, Callable[[], tuple[list[torch.Tensor], Callable[[], Any]]]]:
    """name -> builder returning (every user tensor, the op to run) for one group."""
    n = dist.get_world_size(g)
    me = dist.get_rank(g)
    G = dist.get_global_rank

    def mk(*shapes: int) -> list[torch.Tensor]:
        return [torch.ones(s) for s in shapes]

    def all_reduce(op: Any, async_op: bool):
        def build():
            (x,) = mk(64)

            def run():
                w = dist.all_reduce(x, op=op, group=g, async_op=async_op)
                if w is not None:
                    w.wait()
            return [x], run
        return build

    def build_all_gather():
        outs, (x,) = mk(*[64] * n), mk(64)
        return [*outs, x], lambda: dist.all_gather(outs, x, group=g)

    def build_all_gather_uneven():
        outs, (x,) = mk(*[3 * (j + 1) for j in range(n)]), mk(3 * (me + 1))
        return [*outs, x], lambda: dist.all_gather(outs, x, group=g)

    def build_all_gather_tensor():
        out, x = mk(64 * n, 64)
        return [out, x], lambda: dist.all_gather_into_tensor(out, x, group=g)

    def build_reduce_scatter_tensor():
        out, x = mk(64, 64 * n)
        return [out, x], lambda: dist.reduce_scatter_tensor(out, x, group=g)

    def build_reduce_scatter_list():
        ins, (out,) = mk(*[64] * n), mk(64)
        return [*ins, out], lambda: dist.reduce_scatter(out, ins, group=g)

    def build_reduce_scatter_product():
        out, x = mk(64, 64 * n)
        return [out, x], lambda: dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.PRODUCT, group=g)

    def build_all_to_all_single():
        out, x = mk(64 * n, 64 * n)
        return [out, x], lambda: dist.all_to_all_single(out, x, group=g)

    def build_all_to_all_list():
        outs, ins = mk(*[16] * n), mk(*[16] * n)
        return [*outs, *ins], lambda: dist.all_to_all(outs, ins, group=g)

    def build_broadcast(src: int):
        def build():
            (x,) = mk(64)
            return [x], lambda: dist.broadcast(x, src=src, group=g)
        return build

    def build_reduce():
        (x,) = mk(64)
        return [x], lambda: dist.reduce(x, dst=G(g, root), group=g)

    def build_gather():
        outs, (x,) = mk(*[64] * n), mk(64)
        return [*outs, x], lambda: dist.gather(x, outs if me == root else None, dst=G(g, root), group=g)

    def build_scatter():
        ins, (out,) = mk(*[64] * n), mk(64)
        return [*ins, out], lambda: dist.scatter(out, ins if me == root else None, src=G(g, root), group=g)

    def build_p2p():
        x, r = mk(64, 64)

        def run():
            works = [dist.isend(x, peer, group=g), dist.irecv(r, peer, group=g)]
            for w in works:
                w.wait()
        return [x, r], run

    def build_send_recv():
        x, r = mk(64, 64)

        def run():
            dist.send(x, peer, group=g)
            dist.recv(r, peer, group=g)
        return [x, r], run

    def build_barrier():
        return [], lambda: dist.barrier(group=g)

    def build_coalesced():
        a, b = mk(64, 32)

        def run():
            with dist._coalescing_manager(group=g, async_ops=True) as cm:
                dist.all_reduce(a, group=g)
                dist.all_reduce(b, group=g)
            cm.wait()
        return [a, b], run

    R = dist.ReduceOp
    return {
        "all_reduce.SUM": all_reduce(R.SUM, False),
        "all_reduce.SUM.async": all_reduce(R.SUM, True),
        "all_reduce.AVG": all_reduce(R.AVG, False),
        "all_reduce.PRODUCT": all_reduce(R.PRODUCT, False),
        "all_reduce.MAX.async": all_reduce(R.MAX, True),
        "all_gather.list": build_all_gather,
        "all_gather.uneven": build_all_gather_uneven,
        "all_gather.tensor": build_all_gather_tensor,
        "reduce_scatter.tensor": build_reduce_scatter_tensor,
        "reduce_scatter.list": build_reduce_scatter_list,
        "reduce_scatter.PRODUCT": build_reduce_scatter_product,
        "all_to_all_single": build_all_to_all_single,
        "all_to_all.list": build_all_to_all_list,
        "broadcast.from_real": build_broadcast(real_src),
        "broadcast.from_virtual": build_broadcast(virtual_src),
        "reduce": build_reduce,
        "gather": build_gather,
        "scatter": build_scatter,
        "isend_irecv.virtual_peer": build_p2p,
        "send_recv.virtual_peer": build_send_recv,
        "barrier": build_barrier,
        "coalesced.all_reduce": build_coalesced,
    }


def memory_probe(ctx: Ctx, peers: dict[int, int], real_src: int, virtual_src: int, root: int,
                 group: str = "world", grace_s: float = 1.0) -> dict[str, Any]:
    """Per op: what it allocated (ATen level), which of those survive, which user tensors survive.

    `peers[rank]` (global) is each real rank's p2p partner, `real_src` / `virtual_src` (global) a
    real and a virtual broadcast source, `root` (group rank) the root of reduce / gather / scatter.
    Each op runs once to warm up (first calls of torch under a dispatch mode keep a few frames in
    a reference cycle), then once measured with garbage collection disabled, so "dead" means freed
    by reference counting the moment the last reference went, as a C++ backend frees tensors.
    """
    g = ctx.groups[group]
    report: dict[str, Any] = {}
    for name, build in _ops(ctx, g, peers[ctx.rank], real_src, virtual_src, root).items():
        tensors, run = build()
        with AllocationLog():
            run()  # warm-up
        del tensors, run
        gc.collect()
        gc.disable()
        try:
            tensors, run = build()
            user_refs = [weakref.ref(t) for t in tensors]
            log = AllocationLog()
            with log:
                run()
            del tensors, run
            refs = user_refs + log.refs
            entry = {
                "allocated": log.allocated,
                "scratch_alive": [a for a, r in zip(log.allocated, log.refs, strict=True) if r() is not None],
                "user_alive": sum(r() is not None for r in user_refs),
            }
            # gloo's worker thread drops its reference to a finished work's tensors a moment
            # after wait() returns: with real peers, allow it up to grace_s to do so
            deadline = time.perf_counter() + grace_s
            while any(r() is not None for r in refs) and time.perf_counter() < deadline:
                time.sleep(0.005)
            entry["alive_after_grace"] = sum(r() is not None for r in refs)
            report[name] = entry
            del log, refs
        finally:
            gc.enable()
    vg = g.vg
    report["_group_state"] = {"pending_root_payloads": len(vg.pending_root_payloads),
                              "sent_alive": sum(r() is not None for r in vg._sent.values())}
    return report
