"""The CUDA runtime a virtual-GPU process sees: ``torch.cuda`` answered by the GPU model and the allocator model.

`CudaShim.install()` replaces, until `uninstall()`, what the unmodified program asks of ``torch.cuda`` on a
host without a GPU (DESIGN.md section 10): availability, device count and current device (`set_device`,
the ``torch.cuda.device`` context), properties, capability and name of the profile's GPU, streams and
events, CUDA RNG states and ``default_generators`` (Megatron's RNG tracker), NVTX ranges (no-ops), and the
memory API (``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``, ``memory_stats``,
``reset_peak_memory_stats``, ``mem_get_info``, ``empty_cache``, ``memory_snapshot``) answered by
`prism_plugin.cost.allocator.CachingAllocatorModel`.

Streams and events: with virtual time (`start_clock`, `prism_plugin.device.clock.VirtualTime`)
each stream has an emulated clock, events complete when their stream reaches them, ``wait_event`` /
``wait_stream`` hold a stream, and ``synchronize`` / ``Event.synchronize`` move the host clock; without it they
keep their order relations only (``synchronize`` returns at once, ``Event.elapsed_time`` is 0.0).
Non-goals: IPC, peer access, ``torch.cuda.jiterator`` (CUDA graphs: `prism_plugin.device.graphs`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from prism_plugin.cost.allocator import CachingAllocatorModel
from prism_plugin.cost.gpu import GpuSpec
from prism_plugin.device import active, cuda_runtime, snapshot
from prism_plugin.device.active import Slot
from prism_plugin.device.clock import CLOCKS, VirtualTime
from prism_plugin.device.undo import Patches

__all__ = ["CudaShim", "VirtualEvent", "VirtualStream", "device_index"]

_STREAM_IDS = itertools.count(1)


def device_index(device: Any, current: int) -> int:
    """The CUDA device index of `device` (None, an int, ``"cuda:1"``, a ``torch.device``)."""
    if device is None:
        return current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return current if device.index is None else device.index


class VirtualGenerator(torch.Generator):
    """A virtual GPU's RNG (``torch.cuda.default_generators[i]``): a host generator with the CUDA generator's
    graph-safe state API, which TransformerEngine's RNG tracker takes once CUDA graphs can register generator
    states (``--te-rng-tracker``): a state is a cloned generator, setting one copies its state in. Fake tensors
    draw no values, so only the calls matter."""

    def graphsafe_get_state(self) -> torch.Generator:
        return self.clone_state()

    def graphsafe_set_state(self, state: torch.Generator) -> None:
        self.set_state(state.get_state())


class VirtualStream:
    """A CUDA stream of a virtual GPU: an id and a device (stream 0 is the default stream)."""

    def __init__(self, device: Any = None, priority: int = 0, *, stream_id: int | None = None,
                 shim: CudaShim | None = None) -> None:
        self._shim = shim or CudaShim.active()
        self.device_index = device_index(device, self._shim.current)
        self.device = torch.device("cuda", self.device_index)
        self.priority = priority
        self.stream_id = next(_STREAM_IDS) if stream_id is None else stream_id
        self._context: list[VirtualStream] = []

    @property
    def key(self) -> tuple[int, int]:
        """This stream's clock in virtual time (`prism_plugin.device.clock.VirtualTime`)."""
        return (self.device_index, self.stream_id)

    def wait_stream(self, stream: VirtualStream) -> None:
        clock = self._shim.clock
        if clock is not None:
            clock.wait_until(self.key, clock.position(stream.key))

    def wait_event(self, event: VirtualEvent) -> None:
        event.wait(self)

    def record_event(self, event: VirtualEvent | None = None) -> VirtualEvent:
        event = event or VirtualEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        self._shim.queries += 1
        clock = self._shim.clock
        return clock is None or clock.ends.get(self.key, 0.0) <= clock.host_s

    def synchronize(self) -> None:
        clock = self._shim.clock
        if clock is not None:
            clock.sync_stream(self.key)

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def __enter__(self) -> VirtualStream:
        self._context.append(self._shim.current_stream())
        self._shim.set_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shim.set_stream(self._context.pop())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VirtualStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("virtual-stream", self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.stream_id:#x} (virtual)>"


class VirtualEvent:
    """A CUDA event of a virtual GPU: recorded on a stream, it completes when that stream reaches it (virtual time:
    `VirtualTime.position`); without virtual time every event is complete at once and ``elapsed_time`` is 0.0."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        self.enable_timing = enable_timing
        self.stream: VirtualStream | None = None
        self.time_s: float | None = None
        """The emulated time the event completes at (None: not recorded, or no virtual time)."""

    def record(self, stream: VirtualStream | None = None) -> None:
        shim = CudaShim.active()
        self.stream = stream or shim.current_stream()
        if shim.clock is not None:
            self.time_s = shim.clock.position(self.stream.key)

    def wait(self, stream: VirtualStream | None = None) -> None:
        shim = CudaShim.active()
        if shim.clock is not None and self.time_s is not None:
            shim.clock.wait_until((stream or shim.current_stream()).key, self.time_s)

    def query(self) -> bool:
        shim = CudaShim.active()
        shim.queries += 1
        clock = shim.clock
        return clock is None or self.time_s is None or self.time_s <= clock.host_s

    def synchronize(self) -> None:
        clock = CudaShim.active().clock
        if clock is not None and self.time_s is not None:
            clock.sync_host(self.time_s)

    def elapsed_time(self, end_event: VirtualEvent) -> float:
        """Milliseconds from this event to `end_event` (torch's unit); 0.0 without virtual time."""
        if self.time_s is None or end_event.time_s is None:
            return 0.0
        return 1e3 * (end_event.time_s - self.time_s)


class _Properties:
    """What ``torch.cuda.get_device_properties`` returns, for the profile's GPU."""

    def __init__(self, gpu: GpuSpec) -> None:
        self.name = gpu.name
        self.major, self.minor = gpu.capability
        self.total_memory = gpu.total_memory_bytes
        self.multi_processor_count = gpu.multi_processor_count
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.L2_cache_size = 50 * 2**20
        self.warp_size = 32
        self.gcnArchName = "NVIDIA"
        self.uuid = "00000000-0000-0000-0000-virtual-gpu"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count}, "
                "virtual=True)")


CUDA_VERSION = "12.9"
"""What ``torch.version.cuda`` answers on virtual GPUs (a policy answer: the CUDA 12.9 toolkit)."""


SHIM: Slot[CudaShim] = active.slot("cuda_shim")
"""The virtual GPU that answers ``torch.cuda`` in this process (`prism_plugin.device.active`)."""


class CudaShim:
    """``torch.cuda`` of `num_devices` virtual GPUs of model `gpu`; `allocators[i]` models device i's memory."""

    def __init__(self, gpu: GpuSpec, allocators: list[CachingAllocatorModel], *, current: int = 0) -> None:
        self.gpu = gpu
        self.allocators = allocators
        self.current = current
        self.properties = _Properties(gpu)
        self.generators = tuple(VirtualGenerator() for _ in allocators)
        self._default = [VirtualStream(i, stream_id=0, shim=self) for i in range(len(allocators))]
        self._streams = list(self._default)
        self._patches = Patches()
        self.clock: VirtualTime | None = None
        """Virtual time (`start_clock`); None: streams keep their order only and nothing takes time."""
        self.queries = 0
        """``Stream.query()`` / ``Event.query()`` calls: the host asking how far the GPU got without waiting (an
        exact fast-forward in the GPU's frame needs none: `prism_plugin.device.fast_forward`)."""

    @classmethod
    def active(cls) -> CudaShim:
        shim = SHIM.current()
        if shim is None:
            raise RuntimeError("prism: torch.cuda.Stream/Event need an active virtual GPU (device mode virtual-gpu)")
        return shim

    # -- devices and streams ------------------------------------------------------------------------
    def _index(self, device: Any = None) -> int:
        index = device_index(device, self.current)
        if not 0 <= index < len(self.allocators):
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of {len(self.allocators)})")
        return index

    def set_device(self, device: Any) -> None:
        self.current = self._index(device)
        cuda_runtime.set_device(self.current)  # the device guard: autograd and torch.device(int) agree

    def current_stream(self, device: Any = None) -> VirtualStream:
        return self._streams[self._index(device)]

    def default_stream(self, device: Any = None) -> VirtualStream:
        return self._default[self._index(device)]

    def set_stream(self, stream: VirtualStream) -> None:
        self._streams[stream.device_index] = stream

    def stream(self, stream: VirtualStream | None) -> contextlib.AbstractContextManager[VirtualStream | None]:
        """``torch.cuda.stream(s)``: a context that makes `s` current, re-enterable as torch's ``StreamContext``
        (Megatron enters one twice: the grad buffers' communication-stream context with several optimizer
        instances)."""
        return contextlib.nullcontext() if stream is None else stream

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        previous = self.current
        if device is not None and not (isinstance(device, int) and device < 0):
            self.set_device(device)
        try:
            yield
        finally:
            self.current = previous

    def start_clock(self, launch_overhead_s: float, native_launch_s: float | None = None) -> VirtualTime:
        """Give this GPU virtual time: streams, events and synchronize follow `VirtualTime`'s clocks."""
        self.clock = VirtualTime(launch_overhead_s=launch_overhead_s, native_launch_s=native_launch_s,
                                 current_stream=lambda: self._streams[self.current].key)
        CLOCKS.enter(self.clock)
        self._patches.callback(CLOCKS.leave, self.clock)
        return self.clock

    def synchronize(self, device: Any = None) -> None:
        if self.clock is not None:
            self.clock.sync_device(self._index(device))

    def allocator(self, device: Any = None) -> CachingAllocatorModel:
        return self.allocators[self._index(device)]

    # -- RNG ----------------------------------------------------------------------------------------------
    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generators[self._index(device)].get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.generators[self._index(device)].set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.generators[self.current].manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        for g in self.generators:
            g.manual_seed(int(seed))

    # -- memory ---------------------------------------------------------------------------------------------
    def _memory_api(self) -> dict[str, Any]:
        a = self.allocator

        def stats(device: Any = None) -> dict[str, int]:
            return a(device).memory_stats()

        def nested(device: Any = None) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in stats(device).items():
                node = out
                *path, last = key.split(".")
                for part in path:
                    node = node.setdefault(part, {})
                node[last] = value
            return out

        def mem_get_info(device: Any = None) -> tuple[int, int]:
            model = a(device)
            return max(0, model.capacity - model.reserved), model.device_total

        def reset_peak(device: Any = None) -> None:
            a(device).reset_peak_stats()

        return {
            "memory_allocated": lambda device=None: a(device).stat("allocated_bytes"),
            "max_memory_allocated": lambda device=None: a(device).stat("allocated_bytes", "all", "peak"),
            "memory_reserved": lambda device=None: a(device).stat("reserved_bytes"),
            "max_memory_reserved": lambda device=None: a(device).stat("reserved_bytes", "all", "peak"),
            "memory_cached": lambda device=None: a(device).stat("reserved_bytes"),
            "max_memory_cached": lambda device=None: a(device).stat("reserved_bytes", "all", "peak"),
            "memory_stats": stats, "memory_stats_as_nested_dict": nested, "mem_get_info": mem_get_info,
            "reset_peak_memory_stats": reset_peak, "reset_max_memory_allocated": reset_peak,
            "reset_max_memory_cached": reset_peak, "reset_accumulated_memory_stats": lambda device=None: None,
            "empty_cache": lambda: a().empty_cache(), "memory_snapshot": lambda *_, **__: a().segments(),
            "is_initialized": lambda: True,
        }

    # -- install ------------------------------------------------------------------------------------------
    def install(self) -> CudaShim:
        """Patch ``torch.cuda`` (and its submodules' copies) for this process; `uninstall` restores it."""
        if SHIM.current() is not None:
            raise RuntimeError("prism: a virtual GPU is already installed in this process")
        if len(self.allocators) > cuda_runtime.MAX_DEVICES:
            raise RuntimeError(f"prism: a virtual-GPU process has at most {cuda_runtime.MAX_DEVICES} devices")
        cuda, p = torch.cuda, self._patches
        api: dict[str, Any] = {
            "is_available": lambda: True, "device_count": lambda: len(self.allocators),
            "current_device": lambda: self.current, "set_device": self.set_device,
            "get_device_properties": lambda device=None: self.properties,
            "get_device_capability": lambda device=None: self.gpu.capability,
            "get_device_name": lambda device=None: self.gpu.name,
            "is_initialized": lambda: True, "init": lambda: None, "_lazy_init": lambda: None,
            "_lazy_call": lambda callable, **kwargs: callable(),
            "synchronize": self.synchronize, "is_bf16_supported": lambda including_emulation=True: True,
            "current_stream": self.current_stream, "default_stream": self.default_stream,
            "set_stream": self.set_stream, "stream": self.stream, "device": self.device,
            "Stream": VirtualStream, "Event": VirtualEvent, "default_generators": self.generators,
            "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state,
            "get_rng_state_all": lambda: [g.get_state() for g in self.generators],
            "set_rng_state_all": lambda states: [g.set_state(s) for g, s in zip(self.generators, states, strict=True)],
            "manual_seed": self.manual_seed, "manual_seed_all": self.manual_seed_all,
            "seed": lambda: self.generators[self.current].seed(),
            "initial_seed": lambda: self.generators[self.current].initial_seed(),
            "is_current_stream_capturing": lambda: False,  # (the virtual GPU answers it: device/graphs.py)
            **self._memory_api(),
        }
        for name, value in api.items():
            p.setattr(cuda, name, value)
        for name in ("range_push", "range_pop", "mark"):
            p.setattr(cuda.nvtx, name, lambda *_, **__: None)
        p.setattr(cuda.nvtx, "range", contextlib.nullcontext)
        for name, value in self._memory_api().items():  # torch.cuda.memory's own functions call these names
            p.setattr(cuda.memory, name, value)
        p.setattr(cuda.graphs, "is_current_stream_capturing", api["is_current_stream_capturing"])
        p.setattr(cuda.random, "default_generators", self.generators)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed",
                     "manual_seed_all", "seed", "initial_seed"):  # torch.cuda.random's own (Megatron calls them)
            p.setattr(cuda.random, name, api[name])
        # pinned host memory is a host property (page-locked for faster copies): the tensor itself, unpinned; a
        # DataLoader with pin_memory=True (Megatron's) then runs as on a GPU host
        p.setattr(torch.Tensor, "pin_memory", lambda t, device=None: t)
        # Tensor.record_stream takes torch's C++ stream type; a virtual stream is recorded as torch's fake tensors
        # record any stream: no effect on the caching-allocator model, which reuses a freed block in program order
        # (Megatron's MoE all-to-all overlap records its inputs on the communication stream before freeing them)
        record_stream = torch.Tensor.record_stream
        p.setattr(torch.Tensor, "record_stream",
                  lambda t, stream: None if isinstance(stream, VirtualStream) else record_stream(t, stream))
        # the CUDA runtime a GPU host's torch reports (the CPU wheel says None; TE checks it for FP8 block scaling):
        # CUDA 12.9, the toolkit whose cuBLASLt and cuDNN the TE fakes report (a policy answer)
        p.setattr(torch.version, "cuda", CUDA_VERSION)
        # NCCL is there, as on a GPU host: the prism backend serves a program's "nccl" groups (and TE's userbuffers
        # bootstrap asks before it creates one); the CPU wheel has no NCCL of its own to answer
        import torch.distributed as dist

        backend_available = dist.is_backend_available
        p.setattr(dist, "is_nccl_available", lambda: True)
        p.setattr(dist, "is_backend_available",
                  lambda backend: backend.lower() == "nccl" or backend_available(backend))
        self._count_backward_passes()
        snapshot.install(self)  # torch.cuda.memory's history and snapshot API (memory_viz's input)
        SHIM.enter(self)
        p.callback(SHIM.leave, self)
        return self

    def _count_backward_passes(self) -> None:
        """Tell the clock where an autograd backward pass runs (`VirtualTime.on_future`): torch.autograd's
        ``backward`` and ``grad`` run the engine through ``torch.autograd.graph._engine_run_backward``."""
        import torch.autograd.graph as graph

        run = graph._engine_run_backward

        def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
            clock = self.clock
            if clock is None:
                return run(*args, **kwargs)
            clock.backward_depth += 1
            try:
                return run(*args, **kwargs)
            finally:
                clock.backward_depth -= 1
                if clock.backward_depth == 0:
                    clock.end_backward()

        self._patches.setattr(graph, "_engine_run_backward", engine_run_backward)
        self._patches.setattr(torch.autograd, "_engine_run_backward", engine_run_backward)

    def uninstall(self) -> None:
        self._patches.close()
