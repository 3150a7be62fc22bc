"""Device mode ``virtual-gpu``: the unmodified program on fake CUDA tensors, with exact per-rank memory.

`VirtualGpu.start()` installs, for this process and thread, until `stop()`:

1. the CUDA runtime shim (`shim.CudaShim`) for `num_devices` GPUs of the profile's model;
2. ``FakeTensorMode``: every tensor made from then on has shape, dtype, device and strides but no storage
   and no compute; ``cuda`` tensors work on the CPU-only torch wheel;
3. a dispatch mode above it that feeds each new ``cuda`` storage to the device's caching-allocator model
   (malloc on the current stream when made, free when its storage dies: allocated bytes are exactly the
   program's tensors) and answers data-dependent reads through the value policy (`values.ValuePolicy`); ops
   on real host tensors only run for real (data loaders), and fake host tensors (made from device ones, or
   inside `VirtualGpu.fake_host`) are counted as the host memory a real run holds (``host_memory``);
4. a function mode (`calls.DeviceCalls`) that resolves an integer device (``device=torch.cuda.current_device()``,
   ``t.to(0)``, ``t.cuda(1)``), which the CPU wheel would send to its accelerator API and refuse;
5. fusion regions (`fusion`): ``torch.compile`` makes a function or module one region, whose ops are one kernel
   and whose intermediates are never allocated.

Limitations: ``torch.device(<int>)`` itself still needs an accelerator (write ``"cuda:<i>"``); tensors made
before `start()` are real CPU tensors (allowed as inputs); storages resized in place are not followed; no
step time is modelled (virtual time is a separate layer) and nothing here sleeps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, disable_fake_tensor_cache
from torch.utils._python_dispatch import _disable_current_modes

from prism_plugin.cost.allocator import Block, CachingAllocatorModel, DeviceOutOfMemory
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.gpu import DeviceTotal, GpuSpec
from prism_plugin.cost.kernels import KernelCost
from prism_plugin.device import cuda_runtime, fusion, graphs, snapshot
from prism_plugin.device.active import Slot, slot
from prism_plugin.device.calls import DeviceCalls
from prism_plugin.device.clock import VirtualTime
from prism_plugin.device.host_counts import HostCounts
from prism_plugin.device.kernels import kernel_workspaces, uses_cublas
from prism_plugin.device.leaves import leaves
from prism_plugin.device.memory import StorageTracker
from prism_plugin.device.shim import CudaShim
from prism_plugin.device.values import ValuePolicy

__all__ = ["VirtualGpu", "current_gpu"]

aten = torch.ops.aten
CACHE_KEY_LEAVES = 8
"""An op with more argument leaves than this skips ``FakeTensorMode``'s dispatch cache. The cache keys an op by
every argument's metadata before it looks: an op over lists of tensors (TransformerEngine's amax-and-scale update
over every FP8 tensor of a layer, ``_foreach_*``, multi-tensor kernels) spends more host time building its key
than computing its fake outputs, and rarely meets the same key again. Host time only: the outputs are the same
either way (torch's own cross-check compares them)."""
KernelTime = Callable[[Any, tuple, dict, Any], "float | None"]
"""An op's modelled duration in seconds, from ``(func, args, kwargs, out)``; None: no kernel (views, metadata)."""


def _cuda_index(args: tuple, out: Any) -> int | None:
    """The cuda device an op runs on: its first cuda output's, else its first cuda input's (None: no cuda tensor)."""
    return _first_cuda(leaves(out), leaves(args))


def _first_cuda(*flats: list[Any]) -> int | None:
    """`_cuda_index` of leaves already flattened (the result's, then the positional arguments')."""
    for flat in flats:
        for x in flat:
            if isinstance(x, torch.Tensor) and x.device.type == "cuda":
                return x.device.index or 0
    return None


def _host_only(flat: list[Any]) -> bool:
    """Whether an op touches no fake tensor and no cuda device: its inputs (`flat`: the leaves of its arguments)
    are real host tensors (or none) and it creates nothing on a GPU."""
    for x in flat:
        if isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.device.type != "cpu"):
            return False
        if (isinstance(x, torch.device) and x.type != "cpu") or (isinstance(x, str) and x.startswith("cuda")):
            return False
    return True


_HOST_FACTORIES = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default, aten.ones.default, aten.full.default,
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
})
"""Host tensors made without data: fake inside `VirtualGpu.fake_host` (a framework's host buffers for the GPU)."""


class _AllocatorTracker(StorageTracker):
    """Each new cuda storage is a malloc of the device's allocator model, its death a free; and torch's cuBLAS
    workspaces (`cublas_workspace`)."""

    def __init__(self, gpu: VirtualGpu) -> None:
        super().__init__(devices=("cuda", "cpu"))
        self.gpu = gpu
        self._blocks: dict[int, Block] = {}
        self._host: dict[int, int] = {}
        self.host_bytes = 0
        """Bytes of fake host storage alive now: host tensors made from device ones (``.cpu()``, ZeRO-Offload's
        partitions), which a real run holds in host memory and a virtual GPU does not allocate."""
        self.host_peak_bytes = 0
        self.workspaces: dict[tuple[int, int, bool], Block] = {}
        """torch's cuBLAS workspaces by (device, stream, backward): held for the life of the process."""
        self._workspace_bytes = gpu.gpu.cublas_workspace_bytes

    def cublas_workspace(self, index: int) -> None:
        """A cuBLAS GEMM just ran on device `index`: its handle's workspace on the current stream, if it has none.

        torch keeps one workspace per (cuBLAS handle, stream) (``setWorkspaceForHandle`` in CublasHandlePool.cpp;
        cuBLASLt shares it), allocated through the caching allocator after the GEMM's output and never freed.
        Handles are per thread: the program's thread, and in backward the autograd engine's worker thread of the
        device (here: a GEMM inside ``backward`` runs on the backward handle, recomputed forwards included)."""
        key = (index, self.gpu.shim.current_stream(index).stream_id, torch._C._current_graph_task_id() != -1)
        if key not in self.workspaces:
            self.workspaces[key] = self.transient(self._workspace_bytes, index)

    def _allocated(self, key: int, nbytes: int, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":  # a fake host tensor: host memory, no device block
            self._host[key] = nbytes
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        index = tensor.device.index or 0
        if not self.gpu.fusion.defer_allocation(key, nbytes, index):  # a fusion region's: at its end, if it survives
            self.malloc(key, nbytes, index)

    def malloc(self, key: int, nbytes: int, index: int) -> None:
        """Storage `key` of `nbytes` is allocated on device `index`, on its current stream."""
        try:
            self._blocks[key] = self.transient(nbytes, index)
        except torch.OutOfMemoryError:
            self._live.pop(key, None)
            raise

    def transient(self, nbytes: int, index: int) -> Block:
        """`nbytes` allocated on device `index`, on its current stream, for no storage (the caller frees it)."""
        shim = self.gpu.shim
        stream = self.gpu.graphs.allocation_stream(shim.current_stream(index).stream_id)  # a capture's: its pool
        try:
            return shim.allocators[index].malloc(nbytes, stream)
        except DeviceOutOfMemory as exc:
            raise torch.OutOfMemoryError(str(exc)) from None

    def _released(self, key: int) -> None:
        host = self._host.pop(key, None)
        if host is not None:
            self.host_bytes -= host
            return
        if self.gpu.fusion.drop(key):  # a fusion region's intermediate: never allocated
            return
        block = self._blocks.pop(key, None)
        if block is not None and not self.gpu.fusion.hold(block):  # held: freed when the region ends
            self.free(block)

    def adopt(self, tensor: torch.Tensor, block: Block) -> None:
        """`tensor` (made while this tracker was paused: no block of its own) owns `block`, allocated already (a
        fast-forward's replay: `prism_plugin.device.fast_forward.FastForward.orphans`); its death frees it."""
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        assert key not in self._live and tensor.device.type == "cuda"
        self._live[key] = (weakref.ref(storage, lambda _ref, k=key: self._free(k)), nbytes)
        self._blocks[key] = block
        self.allocations += 1
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def disown(self) -> None:
        """The run ended on a replayed iteration (``--prism-stop-at-iteration``): the allocator models hold the
        replay's blocks, which the program's storages no longer stand for, so a storage that dies from here on (the
        process's exit) frees nothing: its block may be one the replay freed already."""
        self._blocks.clear()

    def live_count(self) -> tuple[int, int]:
        """How many device and fake host storages are alive."""
        return len(self._blocks), len(self._host)

    def free(self, block: Block) -> None:
        self.gpu.shim.allocators[self._device_of(block)].free(block)

    def _device_of(self, block: Block) -> int:
        for i, allocator in enumerate(self.gpu.shim.allocators):
            if allocator.active.get(block.ptr) is block:
                return i
        raise AssertionError("a tracked block belongs to no virtual device")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # each op's arguments and result are flattened once here (the tracker, host test and timing share them)
        flat_args, flat_kwargs = leaves(args), leaves(kwargs)
        if _host_only(flat_args) and _host_only(flat_kwargs) and not (
                self.gpu.fake_host_depth and func in _HOST_FACTORIES):
            # host work (data loaders, samplers, CPU counters and timers) runs for real: only the GPU is virtual
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        if func is aten._local_scalar_dense.default:
            if self.gpu.clock is not None and args[0].device.type == "cuda":  # .item(): the host waits for the value
                self.gpu.clock.sync_stream(self.gpu.shim.current_stream(args[0].device.index).key)
            return self.gpu.values.read(args[0])
        to_host = False
        seen_func, seen_args, seen_kwargs = func, args, kwargs or {}  # the value policy sees the copy, not its rewrite
        if func is aten._to_copy.default:
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != args[0].device.type:
                to_host = torch.device(device).type == "cpu" and not kwargs.get("non_blocking", False)
                # a cross-device copy: FakeTensorMode on the CPU wheel refuses cpu <-> cuda; no values move anyway
                func, args, kwargs = aten.empty_like.default, (args[0],), {
                    "dtype": kwargs.get("dtype") or args[0].dtype, "device": device,
                    "memory_format": kwargs.get("memory_format") or torch.preserve_format}
                flat_args, flat_kwargs = leaves(args), leaves(kwargs)
        elif func is aten.copy_.default and len(args) > 1 and args[0].device.type == "cpu" \
                and args[1].device.type == "cuda":  # a blocking copy to the host: the host waits for it
            to_host = not (args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False))
        kwargs = kwargs or {}
        if len(flat_args) + len(flat_kwargs) > CACHE_KEY_LEAVES:
            with disable_fake_tensor_cache(self.gpu.fake):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)  # StorageTracker.__torch_dispatch__, with the leaves flattened once
        flat_out = leaves(out)
        self._track_outputs(flat_out, flat_args + flat_kwargs)
        if self.gpu.silent:  # work a fast-forward skipped (`fast_forward.FastForward.silent`): no time, no answer
            return out
        self.gpu.host_counts.op()
        self.gpu.values.observe(seen_func, seen_args, seen_kwargs, out)
        cublas = uses_cublas(func)
        workspaces = kernel_workspaces(func, args, kwargs)
        index = _first_cuda(flat_out, flat_args) if cublas or workspaces or self.gpu.clock is not None else None
        if cublas and index is not None:
            self.cublas_workspace(index)
        held = [self.transient(nbytes, index) for nbytes in workspaces] if index is not None else []
        if self.gpu.clock is not None:
            if index is None and self.gpu.host_time is not None:  # an op on host tensors only: the host's CPU
                duration = self.gpu.host_time(func, args, kwargs, out)
                if duration:
                    self.gpu.clock.host_work(duration, str(func))
            else:
                self.gpu.time_kernel(func, args, kwargs, out, to_host, index=index)
        for block in held:  # an extension's workspaces, freed when its kernel returns
            self.free(block)
        return out


_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                       "send_object_list", "recv_object_list")


def _object_collectives_on_cpu(patches: Any) -> None:
    """Object collectives move real pickled bytes: run them outside the fake modes, on the CPU.

    torch pickles each object into a byte tensor on `_get_object_coll_device` ("cuda" for an NCCL job) and
    reads sizes back with ``.item()``; under fake tensors neither the bytes nor the sizes would exist. The
    payloads are CPU tensors here, so the objects arrive as the prism backend delivers them (mirrored from
    this rank for virtual members, exchanged for real ones) and no fake value is read.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def on_cpu(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": torch.device("cpu")}
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                saved = c10d._get_object_coll_device
                c10d._get_object_coll_device = lambda group=None: "cpu"
                try:
                    return original(*args, **kwargs)
                finally:
                    c10d._get_object_coll_device = saved

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    for name in _OBJECT_COLLECTIVES:
        wrapped = on_cpu(getattr(c10d, name))
        patches.setattr(c10d, name, wrapped)
        patches.setattr(dist, name, wrapped)


_GPUS: Slot[VirtualGpu] = slot("virtual_gpu", stack=True)


def current_gpu() -> VirtualGpu | None:
    """This process's started virtual GPUs, if any."""
    return _GPUS.current()


class VirtualGpu:
    """`num_devices` virtual GPUs of model `gpu` in this process; this process uses device `device`."""

    def __init__(self, gpu: GpuSpec, *, num_devices: int = 1, device: int = 0,
                 allocator: AllocatorConfig | None = None, values: ValuePolicy | None = None,
                 raise_oom: bool = True) -> None:
        self.gpu = gpu
        config = allocator or AllocatorConfig()
        self.allocators = [CachingAllocatorModel(gpu.total_memory_bytes, config, other_bytes=gpu.context_bytes,
                                                 device=i, raise_oom=raise_oom) for i in range(num_devices)]
        self.shim = CudaShim(gpu, self.allocators, current=device)
        self.values = values or ValuePolicy()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.host_counts = HostCounts()
        self.tracker = _AllocatorTracker(self)
        self._int_devices = DeviceCalls(self.values)
        self._started = False
        self.snapshot_path: Path | None = None
        """Where `stop` writes the allocators' snapshot (`snapshot.from_env`: ``PRISM_MEMORY_SNAPSHOT``)."""
        self.clock: VirtualTime | None = None
        """Virtual time (`start_time`): each GPU op a kernel of modelled duration on its stream; None: no time."""
        self.kernel_time: KernelTime | None = None
        self.kernel_timer: Any = None
        """The kernel model's tallies (`prism_plugin.device.kernel_timer.KernelTimer`), with virtual time."""
        self.kernel_summary: Callable[[], Any] | None = None
        """The kernel model's report (`prism_plugin.device.kernel_timer.KernelTimer.summary`), if any."""
        self.fusion = fusion.FusionRegions(self._region_ended)
        self.graphs = graphs.CudaGraphs(self)
        """CUDA graphs (`graphs`): a capture's kernels recorded, each replay one launch."""
        self.fake_host_depth = 0
        self.silent = False
        """Inside `fast_forward.FastForward.silent`: ops keep their memory but take no time and no answer."""
        """> 0 inside `fake_host`: host tensors made without data are fake (no host memory), not real."""
        self.host_time: KernelTime | None = None
        """The modelled host seconds of an op on host tensors only (None: host ops take no modelled time): set
        where a framework's host work is part of its step (ZeRO-Offload's CPU-side partition ops)."""
        """The fusion regions of these GPUs (`fusion`): one kernel each, intermediates never allocated."""

    def start_time(self, kernel_time: KernelTime, launch_overhead_s: float, *, program_time: bool = False,
                   native_launch_s: float | None = None,
                   region_time: Callable[[KernelCost, tuple[KernelCost, ...]], float] | None = None) -> VirtualTime:
        """Give these GPUs virtual time: `kernel_time(func, args, kwargs, out)` is an op's modelled seconds (None:
        not a kernel, e.g. a view), each launch costs the host `launch_overhead_s`; `region_time(cost, parts)` a fusion
        region's one kernel from its cost and its ops' (None: the sum of its ops' `kernel_time`).

        `program_time`: ``time.time``, ``time.perf_counter`` and ``time.monotonic`` (and their ``_ns`` forms)
        return the emulated host time from then on (``time.time`` from the wall time at this call), so the
        program's own iteration-time and throughput logs print the emulated job's figures; code that imported
        them by name before (``from time import perf_counter``) keeps the wall clock."""
        self.kernel_time = kernel_time
        self.fusion.region_time = region_time
        clock = self.clock = self.shim.start_clock(launch_overhead_s, native_launch_s)
        for model in self.allocators:  # memory history in emulated microseconds
            if model.history is not None:
                model.history.clock_us = lambda: int(round(1e6 * clock.host_s))
        if program_time:
            import time

            epoch = time.time()
            patches = self.shim._patches
            for name, base in (("time", epoch), ("perf_counter", 0.0), ("monotonic", 0.0)):
                patches.setattr(time, name, lambda base=base: base + clock.host_s)
                patches.setattr(time, f"{name}_ns", lambda base=base: int(round(1e9 * (base + clock.host_s))))
        return clock

    def time_kernel(self, func: Any, args: tuple, kwargs: dict, out: Any, to_host: bool = False, *,
                    index: int | None = -1) -> None:
        """Place the op just run on the current stream of its device, as a kernel of its modelled duration.
        `index`: its device if the caller found it already (`_cuda_index`; None: no cuda tensor; -1: find it)."""
        assert self.clock is not None and self.kernel_time is not None
        if self.clock.untimed_depth:  # comm writing the virtual members' share: the collective's kernel did
            return
        if self.fusion.folds():  # inside a fusion region: part of its one kernel
            device = _cuda_index(args, out) if index == -1 else index
            op_s = self.kernel_time(func, args, kwargs, out) if self.fusion.region_time is None else None
            self.fusion.add_op(func, args, kwargs, out, device, op_s)
            return
        duration = self.kernel_time(func, args, kwargs, out)
        if duration is None:
            return
        device = _cuda_index(args, out) if index == -1 else index
        if device is None:
            return
        if self.graphs.record(duration, str(func)):  # captured into a CUDA graph: runs at each replay
            return
        stream = self.shim.current_stream(device).key
        self.clock.kernel(stream, duration, str(func))
        if to_host:  # a blocking copy to the host: the host has the data when the copy ends
            self.clock.sync_stream(stream)

    def fake_host(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` with host tensors made without data (zeros, empty, full and their ``_like`` / ``new_``
        forms) fake while it runs: a framework's host-side buffers for the GPU (ZeRO-Offload's partitions and
        staging buffers) then hold no host memory here, and count in the summary's ``host_memory``, as the bytes a
        real run holds. Their values are unknown (a read goes to the value policy)."""
        import functools

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.fake_host_depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.fake_host_depth -= 1

        return call

    def _region_ended(self, end: fusion.RegionEnd) -> None:
        """A fusion region's end: its transient buffers allocated, then its survivors in creation order, then the
        transients and the inputs it outlived freed, then its one kernel on the current stream of its device."""
        transients = [self.tracker.transient(nbytes, index) for nbytes, index in end.transients]
        for key, nbytes, index in end.survivors:
            self.tracker.malloc(key, nbytes, index)
        for block in transients:
            self.tracker.free(block)
        for block in end.released:
            self.tracker.free(block)
        if self.clock is None or end.device is None or (end.cost is None and not end.ops_s):
            return
        if end.cost is not None and self.fusion.region_time is not None:
            duration = self.fusion.region_time(end.cost, end.parts)
        else:
            duration = end.ops_s
        if not self.graphs.record(duration, end.name):
            self.clock.kernel(self.shim.current_stream(end.device).key, duration, end.name)

    def _swap_tensors(self, t1: torch.Tensor, t2: torch.Tensor) -> None:
        """``torch.utils.swap_tensors`` (Module.to/cuda swaps fake parameters) once the fake mode's converter memo
        forgets both tensors: its weak references would make the swap refuse them.

        ``t1`` keeps its Python attributes: on a GPU, ``Module._apply`` assigns ``param.data`` and the parameter
        object keeps what the framework set on it (Megatron's ``sequence_parallel``, ``tensor_model_parallel``,
        ``partition_dim``, ``shared``, ``allreduce``); the swap would hand them to the discarded tensor."""
        memo = self.fake.fake_tensor_converter.meta_converter.tensor_memo
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            del memo[key]
        kept = dict(getattr(t1, "__dict__", {}))
        self._original_swap(t1, t2)
        for name, value in kept.items():
            t1.__dict__.setdefault(name, value)

    def start(self) -> VirtualGpu:
        assert not self._started, "virtual GPU already started"
        if not cuda_runtime.preloaded():
            raise RuntimeError("prism virtual GPU: this process's torch has no virtual CUDA device; start it with "
                               "`prism run --device virtual-gpu` (the device library loads before torch)")
        self.shim.install()
        graphs.install(self.shim._patches, self.graphs)
        self.shim.set_device(self.shim.current)
        self._original_swap = torch.utils.swap_tensors
        self.shim._patches.setattr(torch.utils, "swap_tensors", self._swap_tensors)
        _object_collectives_on_cpu(self.shim._patches)
        self.shim._patches.setattr(torch, "compile", fusion.compile)  # a compiled function or module: one region
        fusion.activate(self.fusion)
        self.shim._patches.callback(fusion.deactivate, self.fusion)
        self.fake.__enter__()
        self.tracker.start()
        self._int_devices.__enter__()
        self.host_counts.start()
        self._started = True
        _GPUS.enter(self)
        return self

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self.host_counts.stop()
        _GPUS.leave(self)
        if self.snapshot_path is not None:  # PRISM_MEMORY_SNAPSHOT: the allocator's state and history, for memory_viz
            snapshot.write_snapshot(self.allocators, self.snapshot_path)
        self._int_devices.__exit__(None, None, None)
        self.tracker.stop()
        self.fake.__exit__(None, None, None)
        self.shim.uninstall()

    def __enter__(self) -> VirtualGpu:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def summary(self, session: Any = None) -> dict[str, Any]:
        """Per device this process touched (its own, and any other it allocated on): allocated / reserved
        (current, peak), fragmentation at the peak, the device total the job needs (`device_total`), whether it
        fits, OOMs; the others' indices (``untouched_devices``); and the value policy's answers.

        `session`: the emulation session whose groups this rank used (its ``communicator_memory()``, the modelled
        NCCL buffers); None: no communicator, 0 B."""
        devices, untouched = [], []
        own = self.shim.current
        nccl = _nccl_buffer_bytes(session)
        for model in self.allocators:
            peak_reserved = model.stat("reserved_bytes", "all", "peak")
            if model.device != own and not peak_reserved and not model.ooms:
                untouched.append(model.device)  # never allocated on: no context a job would count there
                continue
            total = self.device_total(peak_reserved, nccl if model.device == own else 0,
                                      own=model.device == own)
            workspaces = [b for (index, _, _), b in self.tracker.workspaces.items() if index == model.device]
            devices.append({
                "device": model.device, "allocated_bytes": model.stat("allocated_bytes"),
                "cublas_workspaces": len(workspaces), "cublas_workspace_bytes": sum(b.size for b in workspaces),
                "peak_allocated_bytes": model.stat("allocated_bytes", "all", "peak"),
                "peak_requested_bytes": model.stat("requested_bytes", "all", "peak"),
                "reserved_bytes": model.stat("reserved_bytes"), "peak_reserved_bytes": peak_reserved,
                "fragmentation_at_peak": round(model.peak_fragmentation, 6),
                "device_total_bytes": total.total_bytes, "device_total": total.as_dict(),
                "fits": total.total_bytes <= self.gpu.total_memory_bytes and not model.ooms,
                "ooms": list(model.ooms),
            })
        return {"device_mode": "virtual-gpu", "gpu": self.gpu.name,
                "gpu_memory_bytes": self.gpu.total_memory_bytes, "context_bytes": self.gpu.context_bytes,
                "device_total_note": "device_total_bytes = peak reserved (the program's tensors and torch's cuBLAS "
                f"workspaces, {self.gpu.cublas_workspace_bytes} B per handle and stream that ran a GEMM, through the "
                "caching-allocator model) + NCCL communicator buffers (cost/comm_memory.py, modelled, on the device "
                "this process uses) + TransformerEngine's userbuffers (TP-communication overlap, registered outside "
                "the allocator) + the CUDA context; policy default: context_bytes",
                "step_time": "not modelled (virtual GPU without virtual time: compute takes no time)"
                if self.clock is None else "modelled (virtual time: kernel model and emulated CUDA streams)",
                **({"virtual_time": self.clock.summary()} if self.clock is not None else {}),
                **({"kernels": _plain(self.kernel_summary())} if self.kernel_summary is not None else {}),
                **({"host_memory": {"current_bytes": self.tracker.host_bytes,
                                    "peak_bytes": self.tracker.host_peak_bytes,
                                    "note": "fake host tensors (made on the host from device ones, e.g. "
                                            "ZeRO-Offload's partitions): what a real run holds in host memory, "
                                            "modelled; nothing allocated here"}}
                   if self.tracker.host_peak_bytes else {}),
                **({"cuda_graphs": self.graphs.summary()} if self.graphs.captured else {}),
                "host_counts": self.host_counts.summary(),
                "devices": devices, "untouched_devices": untouched, "values": self.values.summary()}

    def device_total(self, peak_reserved_bytes: int, nccl_buffer_bytes: int = 0, *, own: bool = True) -> DeviceTotal:
        """The device total of one of these GPUs (`prism_plugin.cost.gpu.DeviceTotal`): the NCCL buffers and
        userbuffers only on the device this process uses (`own`), the context on each."""
        from prism_plugin.device.te.userbuffers import buffer_bytes

        return DeviceTotal(peak_reserved_bytes=peak_reserved_bytes,
                           nccl_buffer_bytes=nccl_buffer_bytes, context_bytes=self.gpu.context_bytes,
                           userbuffer_bytes=buffer_bytes() if own else 0)


def _nccl_buffer_bytes(session: Any) -> int:
    """The modelled NCCL buffer bytes of `session`'s groups (its ``communicator_memory()``; 0 without a session:
    the rank process passes its own, the device does not look one up)."""
    report = getattr(session, "communicator_memory", None)
    return int(report()["modelled_bytes"]) if callable(report) else 0


def _plain(report: Any) -> Any:
    """A report as JSON data (its ``as_dict``, a dataclass's fields, else as is)."""
    to_dict = getattr(report, "as_dict", None)
    if callable(to_dict):
        return to_dict()
    import dataclasses

    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report
