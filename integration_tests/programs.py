"""The torch.distributed programs the conformance suite runs inside the workers (see harness.py).

Every function here takes the worker's `Ctx` first and returns picklable results. They are plain
torch.distributed code: the same function runs under plain gloo (every rank a process) and under
prism (a few real ranks, the rest virtual), and the tests compare what each real rank got.

Data of the *symmetric* programs does not depend on the rank: small integers (1..3 for sums and
products, -3..3 for min/max, 0..7 for bitwise ops) cast to the dtype, so every summation order is
exact in fp16/bf16 too (at most 4 * 3 = 12, 3 ** 4 = 81). Receive buffers start as a rank-dependent
sentinel (100 + rank) so a value that was never delivered is visible.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import Ctx, all_subsets

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "i64": torch.int64,
}

# A family is a set of disjoint groups; every rank runs the op on the family's group it belongs to.
FAMILIES: dict[str, tuple[tuple[int, ...], ...] | None] = {
    "world": None,  # the default group
    "all4": ((0, 1, 2, 3),),  # a new_group over every rank (not the default group object)
    "strided": ((0, 2), (1, 3)),
    "pairs": ((0, 1), (2, 3)),
    "mid": ((0, 3), (1, 2)),
    "single": ((0,), (1,), (2,), (3,)),
    "tri": ((0, 1, 2),),  # rank 3 is no member
}


def gname(ranks: tuple[int, ...]) -> str:
    return "g" + "".join(str(r) for r in ranks)


GroupSpec = tuple[str, tuple[int, ...], str | None]


def standard_groups(world_size: int = 4, backend: str | None = None) -> tuple[GroupSpec, ...]:
    """Every non-empty subset of the ranks as a group (15 for N=4), created once per setup."""
    return tuple((gname(s), s, backend) for s in all_subsets(world_size))


def group_of(ctx: Ctx, family: str | None = None,
             ranks: tuple[int, ...] | None = None) -> tuple[Any, tuple[int, ...]] | None:
    """(process group, its global ranks) of this rank in `family` (or the group over `ranks`)."""
    if ranks is not None:
        ranks = tuple(sorted(ranks))
        if ctx.rank not in ranks:
            return None
        if ranks == tuple(range(ctx.world_size)) and family == "world":
            return ctx.groups["world"], ranks
        return ctx.groups[gname(ranks)], ranks
    groups = FAMILIES[family or "world"]
    if groups is None:
        return ctx.groups["world"], tuple(range(ctx.world_size))
    for g in groups:
        if ctx.rank in g:
            return ctx.groups[gname(g)], g
    return None


# -- data ------------------------------------------------------------------------------------------
def sym(shape: tuple[int, ...] | int, dtype: torch.dtype, salt: int = 0, lo: int = 1, hi: int = 3) -> torch.Tensor:
    """Rank-independent small integers in [lo, hi] (period hi - lo + 1 along the flat index)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape)
    span = hi - lo + 1
    return ((torch.arange(numel) * 5 + salt) % span + lo).reshape(shape).to(dtype)


def sentinel(ctx: Ctx, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.full(shape, 100 + ctx.rank, dtype=dtype)


REDUCE_RANGES = {
    "SUM": (1, 3), "AVG": (1, 3), "PRODUCT": (1, 3), "MIN": (-3, 3), "MAX": (-3, 3),
    "BAND": (0, 7), "BOR": (0, 7), "BXOR": (0, 7),
}


def _redop(name: str) -> Any:
    return getattr(dist.ReduceOp, name)


def _finish(work: Any, async_op: bool) -> None:
    if async_op:
        assert work is not None, "async_op=True returned no work handle"
        work.wait()
        # prism's handles must report completion after wait(); gloo's reduce_scatter (list form)
        # handle does not (torch 2.13), so the check is on prism handles only
        if type(work).__module__.startswith("prism_plugin"):
            assert work.is_completed(), "work not completed after wait()"
    else:
        assert work is None, f"sync op returned {work!r}"


# -- the symmetric op catalogue ----------------------------------------------------------------------
class Op:
    """One op of the catalogue: `run(c)` issues it and returns {output name: value}."""

    def __init__(self, name: str, run: Callable[[OpCtx], dict[str, Any]], *, dtypes: bool = True,
                 has_async: bool = True, min_size: int = 1, source: str | None = None,
                 refused_dtypes: tuple[str, ...] = ()) -> None:
        self.name = name
        self.run = run
        self.dtypes = dtypes
        """False: the op does not depend on a tensor dtype (run once, as fp32)."""
        self.has_async = has_async
        self.min_size = min_size
        """Smallest group it makes sense on (p2p needs 2)."""
        self.source = source
        """Where received data comes from: 'root0'/'rootlast' (group rank 0 / last), 'prev' (the
        previous rank of a ring), or None (every member contributes)."""
        self.refused_dtypes = refused_dtypes
        """dtypes every real backend refuses for this op (prism must refuse them as well)."""


class OpCtx:
    def __init__(self, ctx: Ctx, pg: Any, granks: tuple[int, ...], dtype: torch.dtype, async_op: bool,
                 shape: tuple[int, ...]) -> None:
        self.ctx, self.pg, self.granks, self.dtype, self.async_op = ctx, pg, granks, dtype, async_op
        self.shape = shape
        self.n = len(granks)
        self.me = granks.index(ctx.rank)

    def sym(self, shape: tuple[int, ...] | int | None = None, salt: int = 0, lo: int = 1, hi: int = 3) -> torch.Tensor:
        return sym(self.shape if shape is None else shape, self.dtype, salt, lo, hi)

    def sentinel(self, shape: tuple[int, ...] | int | None = None) -> torch.Tensor:
        return sentinel(self.ctx, self.shape if shape is None else shape, self.dtype)

    def rows(self, k: int) -> tuple[int, ...]:
        """self.shape with dim 0 multiplied by k (the *_tensor layouts)."""
        return (self.shape[0] * k, *self.shape[1:])


def _all_reduce(opname: str) -> Callable[[OpCtx], dict[str, Any]]:
    lo, hi = REDUCE_RANGES[opname]

    def run(c: OpCtx) -> dict[str, Any]:
        x = c.sym(lo=lo, hi=hi)
        _finish(dist.all_reduce(x, op=_redop(opname), group=c.pg, async_op=c.async_op), c.async_op)
        return {"out": x}

    return run


def _broadcast(which: str) -> Callable[[OpCtx], dict[str, Any]]:
    def run(c: OpCtx) -> dict[str, Any]:
        root = c.granks[0 if which == "root0" else -1]
        x = c.sym() if c.ctx.rank == root else c.sentinel()
        _finish(dist.broadcast(x, src=root, group=c.pg, async_op=c.async_op), c.async_op)
        return {"out": x}

    return run


def _reduce(opname: str, which: str) -> Callable[[OpCtx], dict[str, Any]]:
    lo, hi = REDUCE_RANGES[opname]

    def run(c: OpCtx) -> dict[str, Any]:
        root = c.granks[0 if which == "root0" else -1]
        x = c.sym(lo=lo, hi=hi)
        _finish(dist.reduce(x, dst=root, op=_redop(opname), group=c.pg, async_op=c.async_op), c.async_op)
        # only the root's result is defined (gloo may use a non-root's buffer as scratch)
        return {"out": x if c.ctx.rank == root else None}

    return run


def _all_gather_list(c: OpCtx) -> dict[str, Any]:
    outs = [c.sentinel() for _ in range(c.n)]
    _finish(dist.all_gather(outs, c.sym(), group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": outs}


def _all_gather_tensor(c: OpCtx) -> dict[str, Any]:
    out = c.sentinel(c.rows(c.n))
    _finish(dist.all_gather_into_tensor(out, c.sym(), group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": out}


def uneven_sizes(n: int) -> list[int]:
    # multiples of the data's period (3), so a virtual slot filled by repeating a real member's
    # block holds the same values as that member's own (longer or shorter) block would
    return [3 * (j + 1) for j in range(n)]


def _all_gather_uneven(c: OpCtx) -> dict[str, Any]:
    sizes = uneven_sizes(c.n)
    outs = [c.sentinel(s) for s in sizes]
    _finish(dist.all_gather(outs, c.sym(sizes[c.me]), group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": outs}


def _reduce_scatter_list(opname: str) -> Callable[[OpCtx], dict[str, Any]]:
    lo, hi = REDUCE_RANGES[opname]

    def run(c: OpCtx) -> dict[str, Any]:
        inputs = [c.sym(salt=j, lo=lo, hi=hi) for j in range(c.n)]
        out = c.sentinel()
        _finish(dist.reduce_scatter(out, inputs, op=_redop(opname), group=c.pg, async_op=c.async_op),
                c.async_op)
        return {"out": out}

    return run


def _reduce_scatter_tensor(opname: str) -> Callable[[OpCtx], dict[str, Any]]:
    lo, hi = REDUCE_RANGES[opname]

    def run(c: OpCtx) -> dict[str, Any]:
        out = c.sentinel()
        inp = c.sym(c.rows(c.n), lo=lo, hi=hi)
        _finish(dist.reduce_scatter_tensor(out, inp, op=_redop(opname), group=c.pg, async_op=c.async_op),
                c.async_op)
        return {"out": out}

    return run


def _all_to_all_list(c: OpCtx) -> dict[str, Any]:
    inputs = [c.sym(salt=j) for j in range(c.n)]
    outs = [c.sentinel() for _ in range(c.n)]
    _finish(dist.all_to_all(outs, inputs, group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": outs}


def _all_to_all_single(c: OpCtx) -> dict[str, Any]:
    inp = c.sym(c.rows(c.n))
    out = c.sentinel(c.rows(c.n))
    _finish(dist.all_to_all_single(out, inp, group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": out}


def _all_to_all_splits(c: OpCtx) -> dict[str, Any]:
    # member j sends (i + 1) rows to member i (the same split list on every rank), so member i
    # receives (i + 1) rows from each peer
    in_splits = [i + 1 for i in range(c.n)]
    out_splits = [c.me + 1] * c.n
    tail = tuple(c.shape[1:])
    inp = c.sym((sum(in_splits), *tail))
    out = c.sentinel((sum(out_splits), *tail))
    _finish(dist.all_to_all_single(out, inp, out_splits, in_splits, group=c.pg, async_op=c.async_op),
            c.async_op)
    return {"out": out}


def _gather(which: str) -> Callable[[OpCtx], dict[str, Any]]:
    def run(c: OpCtx) -> dict[str, Any]:
        root = c.granks[0 if which == "root0" else -1]
        x = c.sym()
        outs = [c.sentinel() for _ in range(c.n)] if c.ctx.rank == root else None
        _finish(dist.gather(x, outs, dst=root, group=c.pg, async_op=c.async_op), c.async_op)
        return {"out": outs, "input": x}

    return run


def _scatter(which: str) -> Callable[[OpCtx], dict[str, Any]]:
    def run(c: OpCtx) -> dict[str, Any]:
        root = c.granks[0 if which == "root0" else -1]
        chunks = [c.sym(salt=j) for j in range(c.n)] if c.ctx.rank == root else None
        out = c.sentinel()
        _finish(dist.scatter(out, chunks, src=root, group=c.pg, async_op=c.async_op), c.async_op)
        return {"out": out}

    return run


def _barrier(c: OpCtx) -> dict[str, Any]:
    _finish(dist.barrier(group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": None}


def _ring(c: OpCtx) -> tuple[int, int]:
    return c.granks[(c.me + 1) % c.n], c.granks[(c.me - 1) % c.n]


def _p2p_sync(c: OpCtx) -> dict[str, Any]:
    nxt, prv = _ring(c)
    x, r = c.sym(), c.sentinel()
    if c.me % 2 == 0:  # even members send first, odd ones receive first: no cycle of blocked sends
        dist.send(x, nxt, group=c.pg)
        dist.recv(r, prv, group=c.pg)
    else:
        dist.recv(r, prv, group=c.pg)
        dist.send(x, nxt, group=c.pg)
    return {"out": r}


def _p2p_async(c: OpCtx) -> dict[str, Any]:
    nxt, prv = _ring(c)
    x, r = c.sym(), c.sentinel()
    works = [dist.isend(x, nxt, group=c.pg), dist.irecv(r, prv, group=c.pg)]
    for w in works:
        w.wait()
    return {"out": r}


def _p2p_batch(c: OpCtx) -> dict[str, Any]:
    nxt, prv = _ring(c)
    x, r = c.sym(), c.sentinel()
    ops = [dist.P2POp(dist.isend, x, nxt, c.pg), dist.P2POp(dist.irecv, r, prv, c.pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return {"out": r}


def _all_reduce_coalesced(c: OpCtx) -> dict[str, Any]:
    ts = [c.sym(), c.sym((3, 2), salt=1)]
    _finish(dist.all_reduce_coalesced(ts, group=c.pg, async_op=c.async_op), c.async_op)
    return {"out": ts}


def _cm_all_reduce(c: OpCtx) -> dict[str, Any]:
    ts = [c.sym(), c.sym((3, 2), salt=1)]
    with dist._coalescing_manager(group=c.pg, async_ops=c.async_op) as cm:
        for t in ts:
            dist.all_reduce(t, group=c.pg)
    if c.async_op:
        cm.wait()
    return {"out": ts}


def _cm_all_gather(c: OpCtx) -> dict[str, Any]:
    ins = [c.sym(), c.sym((3, 2), salt=1)]
    outs = [c.sentinel(c.rows(c.n)), c.sentinel((3 * c.n, 2))]
    with dist._coalescing_manager(group=c.pg, async_ops=c.async_op) as cm:
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i, group=c.pg)
    if c.async_op:
        cm.wait()
    return {"out": outs}


def _cm_reduce_scatter(c: OpCtx) -> dict[str, Any]:
    ins = [c.sym(c.rows(c.n)), c.sym((3 * c.n, 2), salt=1)]
    outs = [c.sentinel(), c.sentinel((3, 2))]
    with dist._coalescing_manager(group=c.pg, async_ops=c.async_op) as cm:
        for o, i in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(o, i, group=c.pg)
    if c.async_op:
        cm.wait()
    return {"out": outs}


OBJ = {"ids": [1, 2, 3], "name": "prism", "nested": {"x": (4, 5)}}


def _all_gather_object(c: OpCtx) -> dict[str, Any]:
    objs: list[Any] = [None] * c.n
    dist.all_gather_object(objs, OBJ, group=c.pg)
    return {"out": objs}


def _broadcast_object_list(which: str, non_root: str) -> Callable[[OpCtx], dict[str, Any]]:
    def run(c: OpCtx) -> dict[str, Any]:
        root = c.granks[0 if which == "root0" else -1]
        if c.ctx.rank == root or non_root == "same":
            objs: list[Any] = [OBJ, "tail", 7]
        else:
            objs = [None, None, None]
        dist.broadcast_object_list(objs, src=root, group=c.pg)
        return {"out": objs}

    return run


def _catalogue() -> dict[str, Op]:
    ops: list[Op] = []
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        refused = ("fp32", "bf16", "fp16") if name in ("BAND", "BOR", "BXOR") else ()
        ops.append(Op(f"all_reduce.{name}", _all_reduce(name), refused_dtypes=refused))
    for which in ("root0", "rootlast"):
        ops.append(Op(f"broadcast.{which}", _broadcast(which), source=which))
    ops += [
    ]
    for name in ("SUM", "MAX", "PRODUCT", "BXOR"):
        refused = ("fp32", "bf16", "fp16") if name == "BXOR" else ()
        for which in ("root0", "rootlast"):
            ops.append(Op(f"reduce.{name}.{which}", _reduce(name, which), refused_dtypes=refused))
    ops += [
        Op("all_gather.list", _all_gather_list),
        Op("all_gather.tensor", _all_gather_tensor),
        Op("all_gather.uneven", _all_gather_uneven),
        Op("reduce_scatter.list.SUM", _reduce_scatter_list("SUM")),
        Op("reduce_scatter.list.PRODUCT", _reduce_scatter_list("PRODUCT")),
        Op("reduce_scatter.tensor.SUM", _reduce_scatter_tensor("SUM")),
        Op("reduce_scatter.tensor.MAX", _reduce_scatter_tensor("MAX")),
        Op("all_to_all.list", _all_to_all_list),
        Op("all_to_all_single.even", _all_to_all_single),
        Op("all_to_all_single.splits", _all_to_all_splits),
        Op("gather.root0", _gather("root0")),
        Op("gather.rootlast", _gather("rootlast")),
        Op("scatter.root0", _scatter("root0"), source="root0"),
        Op("scatter.rootlast", _scatter("rootlast"), source="rootlast"),
        Op("barrier", _barrier, dtypes=False),
        Op("p2p.send_recv", _p2p_sync, has_async=False, min_size=2, source="prev"),
        # isend/irecv and the batch send before they receive: a virtual previous rank is mirrored
        # from what this rank sent, which is exactly what it would have sent (symmetric data)
        Op("p2p.isend_irecv", _p2p_async, has_async=False, min_size=2),
        Op("p2p.batch_isend_irecv", _p2p_batch, has_async=False, min_size=2),
        Op("coalesced.all_reduce_coalesced", _all_reduce_coalesced),
        Op("coalesced.cm_all_reduce", _cm_all_reduce),
        Op("coalesced.cm_all_gather", _cm_all_gather),
        Op("coalesced.cm_reduce_scatter", _cm_reduce_scatter),
        Op("object.all_gather_object", _all_gather_object, dtypes=False, has_async=False),
        Op("object.broadcast_object_list.root0", _broadcast_object_list("root0", "same"), dtypes=False,
           has_async=False),
        Op("object.broadcast_object_list.rootlast", _broadcast_object_list("rootlast", "same"),
           dtypes=False, has_async=False),
        # non-roots hold None: from a virtual root they keep their own objects (not comparable)
        Op("object.broadcast_object_list.none", _broadcast_object_list("rootlast", "none"),
           dtypes=False, has_async=False, source="rootlast"),
    ]
    return {op.name: op for op in ops}


OPS = _catalogue()


def collective(ctx: Ctx, op: str, dtype: str = "fp32", family: str | None = "world",
               ranks: tuple[int, ...] | None = None, async_op: bool = False,
               shape: tuple[int, ...] = (6,)) -> dict[str, Any]:
    """Run catalogue op `op` on this rank's group of `family` (or the group over `ranks`).

    Returns {"member": False} on a rank outside the group, {"raised": "Type: message"} when the op
    was refused at issue, else {"member": True, **outputs}.
    """
    found = group_of(ctx, family, ranks)
    if found is None:
        return {"member": False}
    pg, granks = found
    c = OpCtx(ctx, pg, granks, DTYPES[dtype], async_op, tuple(shape))
    spec = OPS[op]
    if c.n < spec.min_size:
        return {"member": True, "skipped": f"needs a group of {spec.min_size}"}
    try:
        out = spec.run(c)
    except (RuntimeError, TypeError, ValueError) as exc:
        if "timeout" in str(exc).lower() or "closed" in str(exc).lower():
            raise
        return {"member": True, "raised": f"{type(exc).__name__}: {exc}"}
    return {"member": True, **out}


def batch(ctx: Ctx, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run several `collective` cases in one message (the rank-symmetric suite's bulk path)."""
    return [collective(ctx, **kw) for kw in cases]


# -- helpers for the other tests --------------------------------------------------------------------
def session_info(ctx: Ctx) -> dict[str, Any]:
    """What the worker believes: rank, world size, group ranks and backend names."""
    info: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                            "backend": dist.get_backend()}
    for name, pg in ctx.groups.items():
        if pg is not None and name != "world":
            info[name] = (dist.get_rank(pg), dist.get_world_size(pg), dist.get_process_group_ranks(pg))
    return info


def fail_on_rank(ctx: Ctx, rank: int) -> str:
    """Raise on `rank`; the others enter a collective that rank never joins (a would-be hang)."""
    if ctx.rank == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return "unreachable"


def sleep_then(ctx: Ctx, seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def group_probe(ctx: Ctx) -> dict[str, Any]:
    """How this rank's groups were made: class, rank/size/ranks, and the new_group path in use."""
    import os

    world = ctx.groups["world"]
    info: dict[str, Any] = {
        "world_class": type(world).__name__,
        "delegation_env": os.environ.get("PRISM_NEW_GROUP_DELEGATION"),
        "world_has_new_group": callable(getattr(world, "new_group", None)),
        "groups": {},
    }
    for name, pg in ctx.groups.items():
        if name == "world":
            continue
        if pg is None:
            info["groups"][name] = None
            continue
        info["groups"][name] = {
            "class": type(pg).__name__,
            "rank": dist.get_rank(pg),
            "size": dist.get_world_size(pg),
            "ranks": dist.get_process_group_ranks(pg),
        }
    if ctx.session is not None:
        info["groups_created"] = ctx.session.groups_created
    return info
