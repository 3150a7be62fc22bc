"""The `prism` torch.distributed backend: a Python ProcessGroup over a virtual group.

Registered with ``torch.distributed.Backend.register_backend("prism", ..., extended_api=True)``,
so every Python-level collective reaches it, including module-level aliases taken at import time
(``dist_all_gather_func = torch.distributed.all_gather_into_tensor``) and functional collectives.
Each method only unpacks torch's options and hands over to `collectives`.

Backend identity: the group reports the backend the program asked for (the session records it as torch's
``get_backend`` reads it; `getBackendName` / ``name()`` answer the same) and refuses what that backend
refuses, with its own error: emulating gloo, AVG of an integer or bool tensor ("result type Float can't be
cast to the desired output type Long", torch 2.13's gloo divides the sum in place) and an all_gather whose
output tensors differ in size from the input ("ProcessGroupGloo::allgather: invalid tensor size at index 1
(expected (2), got (3))"). torch 2.13's gloo runs AVG of floating tensors (older releases refused it), so
that is accepted; NCCL's PREMUL_SUM is refused ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Emulating nccl,
nothing is refused of these (uneven all_gather, integer AVG and PREMUL_SUM run on NCCL).
Under the name "prism" nothing is refused.

What it will NOT do: `recv` from any source (ANY_SOURCE cannot be emulated deterministically),
custom reduce ops, NCCL-style coalescing groups (`_start_coalescing` with a device),
CUDA-stream placement of emulated delays. Each raises `NotImplementedError` naming the op.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from prism_plugin.comm import collectives as C
from prism_plugin.comm.context import data_steps
from prism_plugin.comm.fill import premul_factor
from prism_plugin.comm.group import VirtualGroup
from prism_plugin.comm.work import TimedWork

__all__ = ["PrismProcessGroup", "BACKEND_NAME"]


def _no_grad(fn: Any) -> Any:
    """In-place writes into autograd leaves, as a C++ backend does through raw storage; the op's data steps
    untimed (`prism_plugin.comm.context.data_steps`).

    (`torch.no_grad()` as a decorator costs several microseconds per call; this costs one.)
    """
    set_grad = torch._C._set_grad_enabled
    is_enabled = torch.is_grad_enabled

    def run(*args: Any, **kwargs: Any) -> Any:
        prev = is_enabled()
        set_grad(False)
        try:
            with data_steps(args[0].vg.ctx.op_clock):  # the op's data rules: the collective's kernel writes them
                work = fn(*args, **kwargs)
        finally:
            set_grad(prev)
        coalescing = args[0]._coalescing  # the group: ops inside an NCCL-style coalescing block are remembered
        if coalescing is not None:
            coalescing.append(work)
        return work

    functools.update_wrapper(run, fn, assigned=("__name__", "__doc__"), updated=())  # and run.__wrapped__ = fn
    return run

BACKEND_NAME = "prism"
Tensor = torch.Tensor
_AVG = dist.ReduceOp.AVG


def _dims(t: Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def _refuse_like_gloo_avg(tensors: list[Tensor]) -> None:
    """gloo's AVG divides the sum in place: an integer (or bool) tensor fails with torch's own cast error."""
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            torch.empty(0, dtype=t.dtype).div_(2)  # raises exactly what gloo's division raises


def _refuse_like_gloo_uneven(output_lists: list[list[Tensor]], inputs: list[Tensor]) -> None:
    for slots, inp in zip(output_lists, inputs, strict=False):
        for index, out in enumerate(slots):
            if out.shape != inp.shape:
                raise RuntimeError(f"ProcessGroupGloo::allgather: invalid tensor size at index {index} "
                                   f"(expected {_dims(inp)}, got {_dims(out)})")


def _op(opts: Any) -> Any:
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _root(opts: Any) -> int:
    return opts.rootRank if opts is not None else 0


def _split(t: Tensor, sizes: list[int], n: int) -> list[Tensor]:
    """Chunks of `t` along dim 0 by `sizes` (empty: n equal chunks), as all_to_all_single splits."""
    if not sizes:
        if t.shape[0] % n:
            raise ValueError(f"prism: all_to_all_single dim 0 ({t.shape[0]}) does not split into {n} chunks")
        rows = t.shape[0] // n
        return [t.narrow(0, i * rows, rows) for i in range(n)]
    if len(sizes) != n:
        raise ValueError(f"prism: all_to_all_single split sizes list has {len(sizes)} entries, group has {n}")
    return list(torch.split(t, sizes, dim=0))


class PrismProcessGroup(dist.ProcessGroup):
    """One real process's view of a virtual group: rank `group.rank` of `group.size`."""

    def __init__(self, group: VirtualGroup) -> None:
        # torch's stub lists only the (store, rank, size) overload; the bindings also take (rank, size)
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]
        self.vg = group
        self._group_name: str | None = None
        self._group_desc: str | None = None
        self.backend_name = BACKEND_NAME
        """The emulated backend's name until torch has recorded this group's own (`getBackendName`)."""
        self._recorded: str | None = None
        self._coalescing: list[TimedWork] | None = None
        """The works issued since `_start_coalescing`, or None outside a coalescing block."""

    # -- identity (a Python PG has no C++ backend that would hold these) -----------------------
    def getBackendName(self) -> str:
        """The name torch recorded for this group (what ``dist.get_backend(group)`` answers)."""
        if self._recorded is None:
            entry = c10d._world.pg_map.get(self)
            if entry is None:
                return self.backend_name
            self._recorded = str(entry[0])
        return self._recorded

    def name(self) -> str:
        return self.getBackendName()

    def _emulates_gloo(self, t: Tensor | None) -> bool:
        name = self.getBackendName()
        if ":" in name:  # a device map, "cpu:gloo,cuda:nccl"
            device = t.device.type if t is not None else "cpu"
            name = dict(p.split(":", 1) for p in name.split(",") if ":" in p).get(device, "")
        return name == "gloo"

    def _check_avg(self, op: Any, tensors: list[Tensor]) -> None:
        """Refuse what gloo refuses when it is the backend emulated: AVG of integers, and NCCL's PREMUL_SUM (with
        gloo's own text, measured with torch 2.13)."""
        if tensors and self._emulates_gloo(tensors[0]):
            if op == _AVG:
                _refuse_like_gloo_avg(tensors)
            if premul_factor(op) is not None:
                raise RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo")

    def setGroupName(self, name: str) -> None:
        self._group_name = name
        self.vg.name = name

    def getGroupName(self) -> str:
        return self._group_name or ""

    def setGroupDesc(self, desc: str) -> None:
        """Also the virtual group's description (fault group matching reads it)."""
        self._group_desc = desc
        self.vg.desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc or ""

    def __repr__(self) -> str:
        return f"PrismProcessGroup(name={self._group_name!r}, rank={self.vg.rank}, size={self.vg.size})"

    # -- subgroups: torch >= 2.13 hands every new_group() (any backend=) to the default group ----
    def new_group(self, ranks: list[int], timeout: Any = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None) -> dist.ProcessGroup | None:
        return self.vg.ctx.create_group(ranks, group_name, group_desc)

    # -- reductions ----------------------------------------------------------------------------
    @_no_grad
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, tensors)
        return C.all_reduce(self.vg, tensors, op)

    @_no_grad
    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, tensors)
        return C.all_reduce(self.vg, tensors, op)

    @_no_grad
    def reduce(self, tensors: list[Tensor], opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, tensors)
        return C.reduce(self.vg, tensors, _root(opts), op)

    @_no_grad
    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, outputs)
        return C.reduce_scatter(self.vg, outputs, input_lists, op)

    @_no_grad
    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, [output])
        return C.reduce_scatter(self.vg, [output], [C.split_rows(input, self.vg.size)], op,
                                flat_inputs=[input])

    _reduce_scatter_base = reduce_scatter_single

    @_no_grad
    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> TimedWork:
        op = _op(opts)
        self._check_avg(op, outputs)
        lists = [C.split_rows(t, self.vg.size) for t in inputs]
        return C.reduce_scatter(self.vg, outputs, lists, op, flat_inputs=list(inputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- gathers, broadcasts ---------------------------------------------------------------------
    @_no_grad
    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> TimedWork:
        return C.broadcast(self.vg, tensors, _root(opts))

    @_no_grad
    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> TimedWork:
        if inputs and self._emulates_gloo(inputs[0]):
            _refuse_like_gloo_uneven(output_lists, inputs)
        return C.all_gather(self.vg, output_lists, inputs)

    @_no_grad
    def allgather_coalesced(self, output_lists: list[list[Tensor]], inputs: list[Tensor],
                            opts: Any = None) -> TimedWork:
        # output_lists[rank][i] receives member rank's inputs[i]: transpose to one list per tensor
        per_tensor = [[output_lists[r][i] for r in range(self.vg.size)] for i in range(len(inputs))]
        work = C.all_gather(self.vg, per_tensor, inputs)
        work._result = output_lists
        return work

    @_no_grad
    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> TimedWork:
        return C.all_gather_into_tensors(self.vg, [output], [input])

    _allgather_base = all_gather_single

    @_no_grad
    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                    opts: Any = None) -> TimedWork:
        return C.all_gather_into_tensors(self.vg, outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_no_grad
    def gather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> TimedWork:
        return C.gather(self.vg, output_lists, inputs, _root(opts))

    @_no_grad
    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> TimedWork:
        return C.scatter(self.vg, outputs, input_lists, _root(opts))

    @_no_grad
    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> TimedWork:
        return C.all_to_all(self.vg, outputs, inputs)

    @_no_grad
    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> TimedWork:
        n = self.vg.size
        outs = _split(output, list(output_split_sizes), n)
        ins = _split(input, list(input_split_sizes), n)
        work = C.all_to_all(self.vg, outs, ins)
        work._result = [output]
        return work

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> TimedWork:
        return C.barrier(self.vg)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        C.barrier(self.vg).wait()

    # -- point to point (peers are group ranks) ---------------------------------------------------
    @_no_grad
    def send(self, tensors: list[Tensor], dstRank: int, tag: int = 0) -> TimedWork:  # noqa: N803
        return C.send(self.vg, tensors, dstRank, tag)

    @_no_grad
    def recv(self, tensors: list[Tensor], srcRank: int, tag: int = 0) -> TimedWork:  # noqa: N803
        return C.recv(self.vg, tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> TimedWork:
        raise NotImplementedError(
            "prism: recv from ANY_SOURCE is not emulated (a virtual sender cannot be chosen "
            "deterministically); pass src= explicitly"
        )

    def _start_coalescing(self, device: Any) -> None:
        """NCCL-style coalescing (``_coalescing_manager(group, device)``): the ops inside run as they are issued
        (one after another on this group, as NCCL's grouped calls complete together at the last one's end)."""
        if self._coalescing is not None:
            raise RuntimeError("prism: coalescing blocks on one group do not nest (NCCL refuses them too)")
        self._coalescing = []

    # torch's stub says Work; its _coalescing_manager takes None too (an empty block, "work is not None")
    def _end_coalescing(self, device: Any) -> TimedWork | None:  # type: ignore[override]
        """The block's work: the last op issued in it (ops on a group complete in issue order), None if empty."""
        works, self._coalescing = self._coalescing or [], None
        return works[-1] if works else None
