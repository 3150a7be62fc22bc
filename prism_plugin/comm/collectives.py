"""The emulation of every collective and transfer on a virtual group, in data and in time.

Each function takes the `VirtualGroup`, writes results in place into the caller's tensors, and
returns a `TimedWork`. Real members' data travels through the group's inner real group (async, so
nothing blocks at issue); virtual members' share is written by `fill` rules; the work completes
at ``max(arrivals) + cost``. Each op is reported as one `OpEvent` to the observers of the group's
`OpContext` (`prism_plugin.comm.context`), which may move its arrival, scale its cost, fail it or add
finishing steps: with the RECORDED policy the replayer overwrites the outputs with the payloads
recorded for (group, sequence number). Issue times come from the context's clock.

Fake tensors (virtual GPUs) hold no values: an op on them exchanges no data among the real members (each
writes what a lone real member would: shapes and memory are all there is); their emulated issue times travel
instead, exchanged by the emulated clock (`prism_plugin.device.clock`).

Temporaries: none when this rank is the group's only real member. With 2+ real members, a
reduce-scatter needs one chunk-sized temporary per other real member, and PRODUCT/BXOR one
tensor-sized temporary; each is freed when the op completes (nothing is retained).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from prism_plugin.comm.context import Finish, OpEvent, chain
from prism_plugin.comm.fill import (
    RedOp,
    apply_virtual_share,
    check_reduce_dtype,
    fill_from,
    premul_factor,
    red_op,
    same_memory,
    scale_result,
)
from prism_plugin.comm.group import VirtualGroup, carries_data
from prism_plugin.comm.work import TimedWork
from prism_plugin.config.kinds import DataPolicy, OpKind

Tensor = torch.Tensor

__all__ = [
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather",
    "scatter", "barrier", "send", "recv", "split_rows", "all_gather_into_tensors",
]


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _launch(
    vg: VirtualGroup,
    kind: OpKind,
    issue_s: float,
    size_bytes: int,
    received: Sequence[Tensor],
    inner: list[dist.Work],
    finish: Finish | None,
    result: object,
    peer: int | None = None,
    tag: int = 0,
) -> TimedWork:
    """Sequence-number and cost the op, report it to the context's observers (`prism_plugin.comm.context`:
    they may move its arrival, scale its cost, fail it, add finishing steps), then time it."""
    ctx = vg.ctx
    seq = vg.next_seq()
    cost_s = ctx.cost_s(kind, size_bytes, vg, peer)
    event = OpEvent(kind, vg, seq, size_bytes, peer, received, issue_s, issue_s, cost_s, cost_s, finish, tag=tag)
    observers = ctx.observers
    for observer in observers:
        observer.on_op(event)
    steps = event.steps  # (event.finishing(), inlined: the hot path adds no step)
    work = TimedWork(ctx.op_clock, result, event.arrival_s, event.cost_s, inner,
                     finish if steps is None else chain(finish, steps), observe_inner=not event.exchanged)
    if event.failure is not None:
        work.fail_at(event.failure)
    for observer in observers:
        observer.on_issued(event, work)
    return work


def _policy(vg: VirtualGroup) -> DataPolicy:
    # RECORDED runs the mirror path (real exchanges and timing) and then overwrites with payloads
    policy = vg.ctx.data_policy
    return DataPolicy.MIRROR if policy is DataPolicy.RECORDED else policy


def _allreduce_opts(op: RedOp) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(op)
    return opts


def _reduce_opts(op: RedOp, root: int) -> dist.ReduceOptions:
    opts = dist.ReduceOptions()
    opts.reduceOp = dist.ReduceOp(op)
    opts.rootRank = root
    return opts


def _real_reduce(vg: VirtualGroup, t: Tensor, op: RedOp, dst: int | None) -> tuple[list[dist.Work], Finish]:
    """Reduce `t` over the real members (all of them, or to real index `dst`), then add the
    virtual members' share on every member that receives the result."""
    check_reduce_dtype(op, t)
    n, k, policy = vg.size, vg.num_real, _policy(vg)
    receives = dst is None or dst == vg.my_real_index
    if k == 1:
        return [], (lambda: apply_virtual_share(t, op, n, 1, policy)) if receives else (lambda: None)
    pg = vg.inner(t.device)
    works: list[dist.Work] = []
    mirror_extra = policy is DataPolicy.MIRROR and n > k
    mean = first = None
    if mirror_extra and op == dist.ReduceOp.PRODUCT:
        mean = t.clone()
        works.append(pg.allreduce([mean], _allreduce_opts(dist.ReduceOp.SUM)) if dst is None
                     else pg.reduce([mean], _reduce_opts(dist.ReduceOp.SUM, dst)))
    if mirror_extra and op == dist.ReduceOp.BXOR and (n - k) % 2:
        first = t.clone()
        bopts = dist.BroadcastOptions()
        bopts.rootRank = 0
        works.append(pg.broadcast([first], bopts))
    real_op = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
    works.append(pg.allreduce([t], _allreduce_opts(real_op)) if dst is None
                 else pg.reduce([t], _reduce_opts(real_op, dst)))

    def finish() -> None:
        if not receives:
            return
        if op == dist.ReduceOp.AVG:
            t.div_(k) if t.is_floating_point() else t.floor_divide_(k)
        real_mean = None
        if mean is not None:
            real_mean = mean.div_(k) if mean.is_floating_point() else mean.floor_divide_(k)
        apply_virtual_share(t, op, n, k, policy, real_mean=real_mean, first_real=first)

    return works, finish


# -- reductions ------------------------------------------------------------------------------------
def _premul_steps(op: object, results: Sequence[Tensor]) -> list[Finish]:
    """A PREMUL_SUM's scaling of each result that carries data (none for SUM and the other ops)."""
    factor = premul_factor(op)
    if factor is None or not carries_data(list(results)):
        return []
    return [functools.partial(scale_result, t, factor) for t in results]


def all_reduce(vg: VirtualGroup, tensors: list[Tensor], op: object) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    rop = red_op(op)
    inner: list[dist.Work] = []
    steps: list[Finish] = []
    if vg.num_real == 1 or not carries_data(tensors):  # the hot path: no exchange, the virtual share at once
        policy = _policy(vg)
        for t in tensors:
            check_reduce_dtype(rop, t)
            apply_virtual_share(t, rop, vg.size, 1, policy)
        for step in _premul_steps(op, tensors):
            step()
        return _launch(vg, OpKind.ALL_REDUCE, arrival, _nbytes(tensors), tensors, inner, None, tensors)
    for t in tensors:
        works, finish = _real_reduce(vg, t, rop, None)
        inner += works
        steps.append(finish)
    steps += _premul_steps(op, tensors)
    return _launch(vg, OpKind.ALL_REDUCE, arrival, _nbytes(tensors), tensors, inner, chain(None, steps), tensors)


def reduce(vg: VirtualGroup, tensors: list[Tensor], root: int, op: object) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    rop = red_op(op)
    inner: list[dist.Work] = []
    steps: list[Finish] = []
    for t in tensors:
        check_reduce_dtype(rop, t)  # also when the root is virtual and nothing else runs
    if vg.is_real(root) and carries_data(tensors):
        for t in tensors:
            works, finish = _real_reduce(vg, t, rop, vg.real_index(root))
            inner += works
            steps.append(finish)
    received = tensors if root == vg.rank else []
    steps += _premul_steps(op, received)  # received only at a real root
    return _launch(vg, OpKind.REDUCE, arrival, _nbytes(tensors), received, inner, chain(None, steps), tensors)


def split_rows(t: Tensor, n: int) -> list[Tensor]:
    """n equal contiguous chunks of a flat view of `t` (the layout of *_into_tensor ops)."""
    if t.numel() % n:
        raise ValueError(f"prism: tensor of {t.numel()} elements does not split into {n} equal chunks")
    if not t.is_contiguous():
        raise NotImplementedError("prism: *_tensor collectives need a contiguous tensor (as NCCL does)")
    return list(t.view(n, -1).unbind(0))


def reduce_scatter(vg: VirtualGroup, outputs: list[Tensor], input_lists: list[list[Tensor]],
                   op: object, flat_inputs: list[Tensor] | None = None) -> TimedWork:
    """outputs[i] = reduction over members of their input_lists[i][my group rank].

    `flat_inputs`: the tensors `input_lists` are rows of (reduce_scatter_tensor forms).
    """
    arrival = vg.ctx.op_clock.now_s()
    rop = red_op(op)
    inner: list[dist.Work] = []
    steps: list[Finish] = []
    data = carries_data(outputs)
    if vg.all_real and vg.num_real > 1 and data:
        # Every member is real (a recording run): the inner group's own reduce_scatter, so the
        # result is bit for bit what the real backend computes. The per-member reduces below sum
        # in another order and differed from gloo in the last bits of float results.
        for t, chunks in zip(outputs, input_lists, strict=True):
            check_reduce_dtype(rop, t)
            if len(chunks) != vg.size:
                raise ValueError(f"prism: reduce_scatter needs {vg.size} input chunks, got {len(chunks)}")
        pg = vg.inner(outputs[0].device)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp(rop)
        if flat_inputs is not None:
            for out, flat in zip(outputs, flat_inputs, strict=True):
                inner.append(pg._reduce_scatter_base(out, flat, opts))
        else:
            inner.append(pg.reduce_scatter(list(outputs), [list(c) for c in input_lists], opts))
        size = sum(_nbytes(c) for c in input_lists)
        return _launch(vg, OpKind.REDUCE_SCATTER, arrival, size, outputs, inner,
                       chain(None, _premul_steps(op, outputs)), outputs)
    for out, chunks in zip(outputs, input_lists, strict=True):
        if len(chunks) != vg.size:
            raise ValueError(f"prism: reduce_scatter needs {vg.size} input chunks, got {len(chunks)}")
        fill_from(out, chunks[vg.rank])
        if not data:  # fake tensors: nothing to reduce (shapes and memory only)
            continue
        if vg.num_real == 1:
            _, finish = _real_reduce(vg, out, rop, None)
            steps.append(finish)
            continue
        for idx, member in enumerate(vg.real_group_ranks):
            target = out if member == vg.rank else chunks[member].clone()
            works, finish = _real_reduce(vg, target, rop, idx)
            inner += works
            if member == vg.rank:
                steps.append(finish)
    size = sum(_nbytes(c) for c in input_lists)
    steps += _premul_steps(op, outputs)
    return _launch(vg, OpKind.REDUCE_SCATTER, arrival, size, outputs, inner, chain(None, steps), outputs)


# -- gathers and broadcasts ----------------------------------------------------------------------
def _fill_virtual_slots(vg: VirtualGroup, slots: list[Tensor]) -> Finish:
    zeros = _policy(vg) is DataPolicy.ZEROS

    def finish() -> None:
        for j, slot in enumerate(slots):
            if not vg.is_real(j):
                slot.zero_() if zeros else fill_from(slot, slots[vg.mirror_source(j)])

    return finish


def all_gather_into_tensors(vg: VirtualGroup, outputs: list[Tensor], inputs: list[Tensor]) -> TimedWork:
    """outputs[i] = concatenation over members of their inputs[i] (all_gather_into_tensor)."""
    if vg.num_real > 1 or _policy(vg) is DataPolicy.ZEROS:
        return all_gather(vg, [split_rows(o, vg.size) for o in outputs], inputs, flat_outputs=outputs)
    # one real member, mirror: every slot is this rank's input; two copies, no per-slot loop
    arrival = vg.ctx.op_clock.now_s()
    me = vg.rank
    for out, inp in zip(outputs, inputs, strict=True):
        rows = out.view(vg.size, -1)
        src = inp.reshape(1, -1)
        if same_memory(src, rows[me]):  # in-place gather: the input is my slot
            rows[:me].copy_(src.expand(me, -1))
            rows[me + 1:].copy_(src.expand(vg.size - me - 1, -1))
        else:
            rows.copy_(src.expand(vg.size, -1))
    return _launch(vg, OpKind.ALL_GATHER, arrival, _nbytes(outputs), outputs, [], None, outputs)


def all_gather(vg: VirtualGroup, output_lists: list[list[Tensor]], inputs: list[Tensor],
               flat_outputs: list[Tensor] | None = None) -> TimedWork:
    """output_lists[i][j] = member j's inputs[i]; uneven slot sizes are allowed.

    `flat_outputs`: the tensors `output_lists` are rows of (into_tensor forms); they are what
    recording and replay see, so both paths key the same payloads.
    """
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    steps: list[Finish] = []
    for slots, inp in zip(output_lists, inputs, strict=True):
        if len(slots) != vg.size:
            raise ValueError(f"prism: all_gather needs {vg.size} output tensors, got {len(slots)}")
        fill_from(slots[vg.rank], inp)
        if vg.num_real > 1 and carries_data(slots):
            pg = vg.inner(inp.device)
            for idx, member in enumerate(vg.real_group_ranks):
                opts = dist.BroadcastOptions()
                opts.rootRank = idx
                inner.append(pg.broadcast([slots[member]], opts))
        steps.append(_fill_virtual_slots(vg, slots))
    received = flat_outputs if flat_outputs is not None else [t for slots in output_lists for t in slots]
    size = _nbytes(received)
    result = flat_outputs if flat_outputs is not None else output_lists
    return _launch(vg, OpKind.ALL_GATHER, arrival, size, received, inner, chain(None, steps), result)


def _fill_from_virtual_source(vg: VirtualGroup, t: Tensor, peer: bool) -> None:
    """Values for a tensor whose source is a virtual member (before any replay overwrites them).

    MIRROR: a payload queued for this op (object collectives), else for a receive the last tensor
    this rank sent with the same shape and dtype (what the peer in its position would send), else
    the buffer keeps this rank's own values (a broadcast root in the same position holds the same
    parameters); a receive with nothing to mirror gets zeros. ZEROS: zeros.
    """
    if vg.pending_root_payloads:
        fill_from(t, vg.pending_root_payloads.popleft())
        return
    if _policy(vg) is DataPolicy.ZEROS:
        t.zero_()
        return
    if peer:
        sent = vg.sent_like(t)
        fill_from(t, sent) if sent is not None else t.zero_()


def broadcast(vg: VirtualGroup, tensors: list[Tensor], root: int) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    if vg.is_real(root):
        source = vg.real_index(root)
    else:
        for t in tensors:
            _fill_from_virtual_source(vg, t, peer=False)
        source = 0  # the first real member's values, so every real member agrees
    if vg.num_real > 1 and carries_data(tensors):
        pg = vg.inner(tensors[0].device)
        opts = dist.BroadcastOptions()
        opts.rootRank = source
        inner.append(pg.broadcast(tensors, opts))
    received = [] if root == vg.rank else tensors
    return _launch(vg, OpKind.BROADCAST, arrival, _nbytes(tensors), received, inner, None, tensors)


def gather(vg: VirtualGroup, output_lists: list[list[Tensor]], inputs: list[Tensor], root: int) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    steps: list[Finish] = []
    received: list[Tensor] = []
    data = carries_data(inputs)
    if root == vg.rank:
        for slots, inp in zip(output_lists, inputs, strict=True):
            fill_from(slots[vg.rank], inp)
            for member in vg.real_group_ranks:
                if member != vg.rank and data:
                    inner.append(vg.inner(inp.device).recv([slots[member]], vg.real_index(member), 0))
            steps.append(_fill_virtual_slots(vg, slots))
            received += slots
    elif vg.is_real(root) and data:
        for inp in inputs:
            inner.append(vg.inner(inp.device).send([inp], vg.real_index(root), 0))
    size = _nbytes(inputs) * vg.size
    return _launch(vg, OpKind.GATHER, arrival, size, received, inner, chain(None, steps), output_lists)


def scatter(vg: VirtualGroup, outputs: list[Tensor], input_lists: list[list[Tensor]], root: int) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    data = carries_data(outputs)
    if root == vg.rank:
        for out, chunks in zip(outputs, input_lists, strict=True):
            fill_from(out, chunks[vg.rank])
            for member in vg.real_group_ranks:
                if member != vg.rank and data:
                    inner.append(vg.inner(out.device).send([chunks[member]], vg.real_index(member), 0))
    elif vg.is_real(root):
        for out in outputs if data else ():
            inner.append(vg.inner(out.device).recv([out], vg.real_index(root), 0))
    else:
        for out in outputs:
            _fill_from_virtual_source(vg, out, peer=False)
    received = [] if root == vg.rank else outputs
    size = _nbytes(outputs) * vg.size
    return _launch(vg, OpKind.SCATTER, arrival, size, received, inner, None, outputs)


def all_to_all(vg: VirtualGroup, outputs: list[Tensor], inputs: list[Tensor]) -> TimedWork:
    """outputs[j] = member j's inputs[my group rank]; a virtual j mirrors this rank's own block."""
    arrival = vg.ctx.op_clock.now_s()
    if len(outputs) != vg.size or len(inputs) != vg.size:
        raise ValueError(f"prism: all_to_all needs {vg.size} input and output chunks")
    me = vg.rank
    inner: list[dist.Work] = []
    fill_from(outputs[me], inputs[me])
    zeros = _policy(vg) is DataPolicy.ZEROS
    data = carries_data(inputs)
    for j in range(vg.size):
        if j == me:
            continue
        if vg.is_real(j) and data:
            pg = vg.inner(inputs[j].device)
            inner.append(pg.send([inputs[j].contiguous()], vg.real_index(j), 0))
            inner.append(pg.recv([outputs[j]], vg.real_index(j), 0))
        else:
            outputs[j].zero_() if zeros else fill_from(outputs[j], inputs[me])
    return _launch(vg, OpKind.ALL_TO_ALL, arrival, _nbytes(inputs), outputs, inner, None, outputs)


def barrier(vg: VirtualGroup) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner = [vg.inner(torch.device("cpu")).barrier(dist.BarrierOptions())] if vg.num_real > 1 else []
    return _launch(vg, OpKind.BARRIER, arrival, 0, [], inner, None, None)


# -- point to point --------------------------------------------------------------------------------
def send(vg: VirtualGroup, tensors: list[Tensor], dst: int, tag: int) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    if vg.is_real(dst) and carries_data(tensors):
        inner.append(vg.inner(tensors[0].device).send(tensors, vg.real_index(dst), tag))
    # Remember every send, to a real peer too: a later recv from a virtual peer mirrors "the last
    # tensor this rank sent with that shape". Remembering only sends to virtual peers made a rank
    # whose next peer is real (a ring/pipeline with 2+ real ranks) receive zeros instead.
    for t in tensors:
        vg.remember_sent(t)
    return _launch(vg, OpKind.SEND, arrival, _nbytes(tensors), [], inner, None, tensors,
                   peer=vg.global_ranks[dst], tag=tag)


def recv(vg: VirtualGroup, tensors: list[Tensor], src: int, tag: int) -> TimedWork:
    arrival = vg.ctx.op_clock.now_s()
    inner: list[dist.Work] = []
    if vg.is_real(src):
        if carries_data(tensors):
            inner.append(vg.inner(tensors[0].device).recv(tensors, vg.real_index(src), tag))
    else:
        for t in tensors:
            _fill_from_virtual_source(vg, t, peer=True)
    return _launch(vg, OpKind.RECV, arrival, _nbytes(tensors), tensors, inner, None, tensors,
                   peer=vg.global_ranks[src], tag=tag)
