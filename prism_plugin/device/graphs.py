"""CUDA graphs on a virtual GPU: a capture recorded once, replayed as one launch (issue 20, item 5).

``torch.cuda.CUDAGraph`` is torch's C++ graph over the CUDA runtime, which a virtual GPU does not run. `install`
puts `VirtualCudaGraph` in its place (``torch.cuda.CUDAGraph``, ``torch.cuda.graphs.CUDAGraph``), with the pool
handles and ``is_current_stream_capturing`` answered by `CudaGraphs`, so ``torch.cuda.graph``,
``torch.cuda.make_graphed_callables`` and the frameworks' own capture code (TransformerEngine's
``make_graphed_callables``, Megatron's ``--cuda-graph-impl``) run as written:

- **capture** (``capture_begin`` .. ``capture_end``): the program's ops run as fake ops, as always (their outputs
  are the graph's static tensors); each kernel is recorded into the graph instead of running on its stream: the
  device clock does not move, the host pays one launch overhead per kernel captured (the CPU records each
  launch). Every allocation meanwhile comes from the graph's **private memory pool**: torch's caching allocator
  serves a capture from a pool no other allocation shares (``beginAllocateToPool``); the allocator model keeps
  that pool as a stream of its own (`pool_stream`, negative ids: program streams count up from 0), so a block
  freed during capture is reused only by later captures into the same pool, as torch's is;
- **replay**: one launch on the current stream (one launch overhead on the host) whose duration is the sum of the
  captured kernels' (they run back to back; kernels captured on several streams are serialised here). Nothing is
  allocated: the graph writes into its pool's blocks, which the allocator counts as free unless a static tensor
  still holds them (torch's ``allocated_bytes`` likewise);
- ``reset`` drops the recording; the pool's cached blocks stay reserved until ``empty_cache``.

A collective issued during capture (TP communication inside a graphed layer) is captured as NCCL's kernels are:
its modelled cost joins the graph's kernels, in order, and every replay pays it; its ``wait()`` meanwhile is the
graph's own ordering. The op is seen once, at capture, as a program's ``torch.distributed`` call is (its trace,
counts and virtual peers' side).

Limitations: a captured collective replays at the cost it had when captured, serialised with the graph's kernels
(no overlap with them, as on the capture stream), and with real peers (several real ranks) its arrivals are not
exchanged again at replay; the kernel model's per-op tallies count captured kernels once (the clock's
``kernel_s`` holds each replay); the private pool's free segments are released by ``empty_cache`` while the graph
lives (torch keeps them), which moves reserved bytes, never allocated ones.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from prism_plugin.device.active import Slot, slot

__all__ = ["CudaGraphs", "VirtualCudaGraph", "install"]


@dataclass
class _Capture:
    graph: VirtualCudaGraph
    pool: tuple[int, int]
    kernels: list[tuple[str, float]] = field(default_factory=list)


class CudaGraphs:
    """The CUDA graphs of one virtual-GPU process: pool ids, the capture under way, replays on the clock."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.capture: _Capture | None = None
        self._pools = itertools.count(1)
        self.captured = 0
        self.replays = 0
        self.replayed_s = 0.0
        self._weak_refs_answered = False

    # -- pools --------------------------------------------------------------------------------------------------
    def pool_handle(self) -> tuple[int, int]:
        """A new private pool's id (``torch.cuda.graph_pool_handle``)."""
        return (next(self._pools), 0)

    @staticmethod
    def pool_stream(pool: tuple[int, int]) -> int:
        """The allocator model's stream id of a private pool."""
        return -pool[0]

    def allocation_stream(self, stream_id: int) -> int:
        """The allocator stream of an allocation made now on program stream `stream_id`: the capture's pool."""
        return stream_id if self.capture is None else self.pool_stream(self.capture.pool)

    # -- capture and replay -------------------------------------------------------------------------------------
    def capturing(self) -> bool:
        return self.capture is not None

    def begin(self, graph: VirtualCudaGraph, pool: tuple[int, int] | None) -> None:
        if self.capture is not None:
            raise RuntimeError("CUDA graph capture is already underway in this process (one at a time, as torch)")
        if not self._weak_refs_answered:
            self._answer_weak_refs()
        graph._pool = tuple(pool) if pool is not None else self.pool_handle()  # type: ignore[assignment]
        self.capture = _Capture(graph, graph._pool)
        clock = self.gpu.clock
        if clock is not None:  # collectives are captured too (the instance's methods shadow the class's meanwhile)
            clock.on_op = self._captured_op
            clock.sleep_until = self._captured_wait

    def end(self, graph: VirtualCudaGraph) -> None:
        capture = self.capture
        if capture is None or capture.graph is not graph:
            raise RuntimeError("capture_end() without this graph's capture_begin()")
        self.capture = None
        graph._kernels = capture.kernels
        self.captured += 1
        clock = self.gpu.clock
        if clock is not None:
            del clock.on_op, clock.sleep_until

    def _captured_op(self, event: Any) -> None:
        """A collective issued during capture (the clock's op observer meanwhile): recorded into the graph at its
        modelled cost, where the capture stream runs it at each replay; it occupies no stream now."""
        assert self.capture is not None
        self.record(event.cost_s, f"nccl:{event.kind.value}")
        assert self.gpu.clock is not None
        self.gpu.clock.comm_ops += 1  # issued once (the program's call), replayed with the graph

    def _captured_wait(self, deadline_s: float, record: bool = True) -> None:
        """``work.wait()`` during capture: a dependency inside the graph (its replay runs in order), no wait now."""

    def record(self, duration_s: float, name: str) -> bool:
        """A kernel launched now: recorded into the capture under way (True), or not capturing (False)."""
        capture = self.capture
        if capture is None:
            return False
        capture.kernels.append((name, duration_s))
        clock = self.gpu.clock
        if clock is not None:  # the CPU records the launch into the graph
            clock.captured_launch()
        return True

    def replay(self, graph: VirtualCudaGraph) -> None:
        if graph._kernels is None:
            raise RuntimeError("replay() of a CUDA graph that was never captured (or was reset)")
        self.replays += 1
        clock = self.gpu.clock
        if clock is None or not graph._kernels:
            return
        duration = sum(d for _, d in graph._kernels)
        self.replayed_s += duration
        shim = self.gpu.shim
        clock.kernel(shim.current_stream(shim.current).key, duration, f"cuda_graph({len(graph._kernels)} kernels)")

    def summary(self) -> dict[str, Any]:
        return {"captured": self.captured, "replays": self.replays, "replayed_s": round(self.replayed_s, 9)}

    # -- weak references to a graph's static tensors --------------------------------------------------------------
    def weak_ref(self, x: Any) -> Any:
        """TransformerEngine's ``make_weak_ref`` on a virtual GPU: a device tensor's alias that does not own its
        memory (TE builds one from the data pointer, so the graph's static outputs return to the pool, and stop
        counting as allocated, once the program drops them, while the replays keep writing there): a fake tensor of
        the same size, strides and dtype made with the allocator tracker paused (no block of its own). Containers
        and scalars as TE maps them."""
        if isinstance(x, torch.Tensor):
            if not x.is_cuda:
                return x
            with self.gpu.tracker.paused():
                return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        if isinstance(x, tuple | list):
            return type(x)(self.weak_ref(i) for i in x)
        if isinstance(x, dict):
            return {k: self.weak_ref(v) for k, v in x.items()}
        if x is None or isinstance(x, int | float | bool):
            return x
        raise TypeError(f"Invalid type {type(x).__name__} to make weak ref. Valid types are: torch.Tensor, tuple, "
                        "list, dict, int, float, bool, and None.")

    def _answer_weak_refs(self) -> None:
        """At the first capture (the capturing frameworks are imported by then): ``make_weak_ref`` wherever TE and
        Megatron bound it by name."""
        self._weak_refs_answered = True
        for name in ("transformer_engine.pytorch.utils", "transformer_engine.pytorch.graph",
                     "megatron.core.transformer.cuda_graphs"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "make_weak_ref"):
                self.gpu.shim._patches.setattr(module, "make_weak_ref", self.weak_ref)


_GRAPHS: Slot[CudaGraphs] = slot("cuda_graphs", stack=True)
"""The started virtual GPU's graphs (`install`), which `VirtualCudaGraph` reports to."""


def _graphs() -> CudaGraphs:
    graphs = _GRAPHS.current()
    if graphs is None:
        raise RuntimeError("a CUDA graph on a virtual GPU needs the virtual GPU started")
    return graphs


class VirtualCudaGraph:
    """``torch.cuda.CUDAGraph`` on a virtual GPU (`CudaGraphs` keeps the capture and times the replays)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._kernels: list[tuple[str, float]] | None = None
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global",
                      **options: Any) -> None:
        """Begin capturing on the current stream into `pool` (None: a new private pool). `options` (torch's
        ``check_input_liveness``, a debugging aid) change nothing here."""
        _graphs().begin(self, pool)

    def capture_end(self) -> None:
        _graphs().end(self)

    def instantiate(self) -> None:
        pass

    def replay(self) -> None:
        _graphs().replay(self)

    def reset(self) -> None:
        self._kernels = None

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("pool() of a CUDA graph that was never captured")
        return self._pool

    def register_generator_state(self, *_: Any, **__: Any) -> None:
        """RNG states are the virtual GPU's (no kernel reads them): nothing to register."""

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        raise RuntimeError("debug_dump: a virtual GPU's CUDA graph holds no CUDA graph to dump")

    def raw_cuda_graph(self) -> int:
        raise RuntimeError("raw_cuda_graph: a virtual GPU's CUDA graph holds no cudaGraph_t")

    def raw_cuda_graph_exec(self) -> int:
        raise RuntimeError("raw_cuda_graph_exec: a virtual GPU's CUDA graph holds no cudaGraphExec_t")

    @property
    def kernels(self) -> int:
        """How many kernels the capture recorded (0 before capture)."""
        return len(self._kernels or ())


def install(patches: Any, graphs: CudaGraphs) -> None:
    """``torch.cuda``'s graph API answered by `graphs` (held by `patches`)."""
    _GRAPHS.enter(graphs)
    patches.callback(_GRAPHS.leave, graphs)
    cuda = torch.cuda

    def pool_handle() -> Any:
        return cuda._POOL_HANDLE(graphs.pool_handle()) if hasattr(cuda, "_POOL_HANDLE") else graphs.pool_handle()

    for module in (cuda, cuda.graphs):
        patches.setattr(module, "CUDAGraph", VirtualCudaGraph)
        patches.setattr(module, "graph_pool_handle", pool_handle)
        patches.setattr(module, "is_current_stream_capturing", graphs.capturing)
    patches.setattr(torch._C, "_graph_pool_handle", graphs.pool_handle)
    patches.setattr(torch._C, "_cuda_isCurrentStreamCapturing", graphs.capturing)
    te_graph = sys.modules.get("transformer_engine.pytorch.graph")  # bound torch._C's by name when imported first
    if te_graph is not None and hasattr(te_graph, "_graph_pool_handle"):
        patches.setattr(te_graph, "_graph_pool_handle", graphs.pool_handle)
    # torch.cuda.graph's entry empties the pinned-host cache, which the CPU wheel lacks: a virtual GPU's pinned
    # memory is plain host memory, nothing is cached there
    if not hasattr(torch._C, "_host_emptyCache"):
        patches.setattr(torch._C, "_host_emptyCache", lambda: None)
