"""TE's userbuffers (``--tp-comm-overlap``) on virtual GPUs: TP communication in chunks, overlapped with GEMM chunks.

On a GPU, TE's ``CommOverlap`` / ``CommOverlapP2P`` objects own a buffer registered for peer access in the TP
domain, and its GEMMs run as chunks while the TP all-gather or reduce-scatter moves the other chunks on
communication streams (TE's split-pipelined and ring-exchange algorithms), or, for "bulk" overlap, one whole
collective runs beside an unrelated GEMM. Here the same objects are Python classes with the same methods, and:

- **memory**: each communicator's buffer (``shape`` rows x columns; a ring-exchange reduce-scatter holds
  ``2 tp - 1`` chunks, as TE's ``CommOverlapP2PBase``) is device memory outside torch's caching allocator, as
  TE's ``cudaMalloc`` / ``cuMem`` registration is: it is not in allocated or reserved bytes; `buffer_bytes` sums
  it for the device total;
- **ring exchange** (all-gather into a GEMM, and reduce-scatter out of one): ``tp - 1`` steps of
  ``batch_isend_irecv`` on the TP group (send to the next rank, receive from the previous) on a communication
  stream, and one GEMM chunk per TP rank on the compute stream: a chunk waits for the step that brought its rows
  (all-gather), a step waits for the chunk whose partial it sends (reduce-scatter, whose partials are then summed
  into the output by one kernel);
- **bulk**: one ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on the TP group on a communication
  stream, beside the GEMM; the compute stream waits for it at the end, as TE synchronises.

All transfers are real operations of the prism backend (timed by its cost model, with virtual peers' data by the
data policy). Limitations: atomic GEMMs and the external-GEMM overlap are refused; FP8 userbuffers carry the
FP8 data only (their scale travels as TE's Python sets it); SM sharing between communication and GEMM kernels is
not modelled (the GEMM chunks run at full speed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prism_plugin.device.active import Slot, slot
from prism_plugin.device.te import ops

__all__ = ["CommOverlap", "CommOverlapHelper", "CommOverlapP2P", "buffer_bytes", "overlapped_gemm"]

_BUFFERS: Slot[torch.Tensor] = slot("userbuffers", stack=True, permanent=True)
"""Every userbuffer of this process (TE keeps them to the end; `prism_plugin.device.active`)."""


def buffer_bytes() -> int:
    """Device bytes the userbuffers of this process hold (outside the caching allocator)."""
    return sum(b.numel() * b.element_size() for b in _BUFFERS.all())


class CommOverlapHelper:
    """The torch.distributed groups TE bootstraps userbuffers with: the world and the TP domain."""

    def __init__(self, world_group: Any = None, intra_domain_group: Any = None) -> None:
        self.world_group = world_group
        self.intra_domain_group = intra_domain_group


def _untracked_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A fake device tensor the caching-allocator model does not hold (registered userbuffer memory): made under
    the virtual GPU's ``FakeTensorMode`` alone, with the tracking modes off (its views are never new storages)."""
    from torch.utils._python_dispatch import _disable_current_modes

    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    assert fake_mode is not None, "userbuffers are created on a virtual GPU (under FakeTensorMode)"
    device = torch.device("cuda", torch.cuda.current_device())
    with _disable_current_modes(), fake_mode:
        return torch.empty(list(shape), dtype=dtype, device=device)


class _UserbufferCore:
    """What TE's ``CommOverlapCore`` answers, with the buffer and the TP group."""

    p2p = False

    def __init__(self, buffer_shape: Sequence[int], buffer_dtype: torch.dtype, helper: CommOverlapHelper,
                 tp_size: int, comm_type: Any = None, **options: Any) -> None:
        if options.get("atomic_gemm"):
            raise NotImplementedError("TE userbuffers on a virtual GPU: atomic GEMM overlap is not emulated; "
                                      "drop atomic_gemm from --tp-comm-overlap-cfg")
        import torch.distributed as dist

        self.group = helper.intra_domain_group if helper.intra_domain_group is not None else helper.world_group
        self.tp_size = int(tp_size)
        self.tp_id = dist.get_rank(self.group) if self.group is not None else 0
        self.comm_type = comm_type
        rows, cols = int(buffer_shape[0]), int(buffer_shape[1])
        self.chunk_rows = rows // self.tp_size
        reduce_scatter = self.p2p and comm_type is not None and getattr(comm_type, "name", "") == "RS"
        chunks = 2 * self.tp_size - 1 if reduce_scatter else self.tp_size
        self.buffer = _untracked_empty((self.chunk_rows * chunks, cols), buffer_dtype)
        _BUFFERS.enter(self.buffer)
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def is_fp8_ubuf(self) -> bool:
        return self.buffer.dtype == torch.uint8

    def is_atomic_gemm(self) -> bool:
        return False

    def is_p2p_overlap(self) -> bool:
        return self.p2p

    def get_communication_stream(self) -> tuple[Any, Any]:
        return self.streams

    def _rows(self, local_chunk: bool) -> torch.Tensor:
        full = self.buffer[: self.chunk_rows * self.tp_size]
        if not local_chunk:
            return full
        return full[self.tp_id * self.chunk_rows: (self.tp_id + 1) * self.chunk_rows]

    def get_buffer(self, local_chunk: bool = False, shape: Sequence[int] | None = None) -> torch.Tensor:
        rows = self._rows(local_chunk)
        return rows.view(*[int(d) for d in shape]) if shape is not None else rows

    def copy_into_buffer(self, input: torch.Tensor, local_chunk: bool = False) -> None:
        target = self._rows(local_chunk)
        ops.pointwise("userbuffers_copy")([input], outputs=[target])


class CommOverlap(_UserbufferCore):
    """TE's ``CommOverlap`` (bulk and split-pipelined overlap)."""


class CommOverlapP2P(_UserbufferCore):
    """TE's ``CommOverlapP2P`` (ring exchange)."""

    p2p = True


def _ring_step(ub: _UserbufferCore, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
    import torch.distributed as dist

    group_ranks = dist.get_process_group_ranks(ub.group)
    after = group_ranks[(ub.tp_id + 1) % ub.tp_size]
    before = group_ranks[(ub.tp_id - 1) % ub.tp_size]
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, after, ub.group),
                                   dist.P2POp(dist.irecv, recv, before, ub.group)])


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def overlapped_gemm(ub: _UserbufferCore, comm_type: Any, bulk: bool, run_gemm: Any, a: torch.Tensor,
                    b: torch.Tensor, out: torch.Tensor, extra_output: torch.Tensor | None) -> None:
    """Run ``run_gemm(a, b, out)`` (one GEMM kernel) with its TP communication overlapped, as TE does for `ub`."""
    import torch.distributed as dist

    compute = torch.cuda.current_stream()
    name = getattr(comm_type, "name", str(comm_type))
    if bulk:
        with torch.cuda.stream(ub.streams[0]):
            ub.streams[0].wait_stream(compute)
            if name == "AG":
                work = dist.all_gather_into_tensor(ub.get_buffer(), ub.get_buffer(local_chunk=True),
                                                   group=ub.group, async_op=True)
            else:
                target = extra_output if extra_output is not None else ub.get_buffer(local_chunk=True)
                work = dist.reduce_scatter_tensor(target, ub.get_buffer(), group=ub.group, async_op=True)
        run_gemm(a, b, out)
        work.wait()
        return
    chunks = ub.tp_size
    b, out = b.reshape(-1, b.shape[-1]), out.reshape(-1, out.shape[-1])  # TE's 2-D view: rows x columns
    if name == "AG":  # B is the gathered buffer: its chunks arrive one ring step at a time
        rows = [b.narrow(0, i * ub.chunk_rows, ub.chunk_rows) for i in range(chunks)]
        outs = [out.narrow(0, i * ub.chunk_rows, ub.chunk_rows) for i in range(chunks)]
        order = [(ub.tp_id - step) % chunks for step in range(chunks)]
        arrived: list[list[Any]] = []
        with torch.cuda.stream(ub.streams[0]):
            ub.streams[0].wait_stream(compute)
            for step in range(chunks - 1):
                arrived.append(_ring_step(ub, rows[order[step]], rows[order[step + 1]]))
        for step, index in enumerate(order):
            if step:
                _wait(arrived[step - 1])
            run_gemm(a, rows[index], outs[index])
        if extra_output is not None:
            ops.pointwise("userbuffers_copy")([b], outputs=[extra_output])
        return
    # reduce-scatter: each chunk's partial (rows owned by one TP rank) is sent on as soon as it is computed
    step = b.shape[0] // chunks  # D has B's rows: chunk i of both is the partial owned by TP rank i
    rows = [b.narrow(0, i * step, step) for i in range(chunks)]
    partials = [out.narrow(0, i * step, step) for i in range(chunks)]
    sent: list[list[Any]] = []
    for step in range(chunks):
        index = (ub.tp_id + step + 1) % chunks
        run_gemm(a, rows[index], partials[index])
        if step < chunks - 1:
            done = torch.cuda.Event()
            done.record(compute)
            with torch.cuda.stream(ub.streams[0]):
                ub.streams[0].wait_event(done)
                sent.append(_ring_step(ub, partials[index], partials[(index + 1) % chunks]))
    for works in sent:
        _wait(works)
    target = extra_output if extra_output is not None else partials[ub.tp_id]
    ops.pointwise("userbuffers_reduce")(partials, outputs=[target])

