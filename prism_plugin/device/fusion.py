"""Fusion regions: what a real GPU runs as one kernel is one kernel on the virtual GPU (DESIGN.md section 12).

A region is a stretch of the program whose ATen ops a GPU runs as one fused kernel: a function called through
`fused` (Megatron's ``@jit_fuser`` functions, the fake kernels of CUDA extensions), a ``torch.compile``d
function or module (`compile` stands in for ``torch.compile`` on virtual GPUs), or ``with regions.region(name)``.
While a region runs in the thread that opened it, on this process's virtual GPU (`FusionRegions`, owned by
`prism_plugin.device.device.VirtualGpu`):

- **time**: its ops launch no kernel; at its end ONE kernel is charged on the current stream of its device,
  named ``fused::<name>`` in the kernel tally: FLOPs the sum of its ops' (`kernels.kernel_cost`); bytes its
  inputs plus its outputs. Inputs: device storages that existed before the region and that one of its ops read,
  each distinct view once (its addressed elements: a broadcast dimension counts once), at most the storage's
  bytes. Outputs: storages created in the region and alive at its end, plus pre-existing storages its ops wrote
  in place (as the inputs). Class: the one given (`fused`'s ``kernel_class``), else the class with the most FLOPs
  when an op has FLOPs (a GEMM), else the class with the most bytes among its ops, a copy or fill counted as
  elementwise (a pointwise region is elementwise); dtype and shape are those of its op with the most FLOPs (else
  bytes);
- **memory**: a storage created and freed inside the region (an intermediate) is never allocated in the
  caching-allocator model; the survivors (outputs, and tensors autograd saved for backward) are allocated at its
  end, in creation order, on the current stream; a pre-existing storage freed inside the region is freed after
  them (a kernel holds its inputs until it ends). The peak is then the fused kernel's. A compiled region
  (``torch.compile``, Megatron's ``@jit_fuser``) that scatters in place into a tensor it was given (``index_put_``,
  ``scatter_``, ``index_add_``, ...) also holds, while it runs, a buffer of that tensor's storage size: inductor
  compiles the functionalized graph, which writes the scatter's result into a new buffer and copies it back into
  the input (Megatron's fused cross-entropy backward, ``grad_2d[arange, target] -= update`` into its saved
  softmax, holds one more fp32 [tokens, vocab/TP] buffer on a GPU: measured in the golden values, see
  recipes/RESULTS.md); a CUDA extension's kernel scatters in place;
- regions opened inside a region (nested ``@jit_fuser`` calls) fold into the outermost one.

Without a region cost model (`FusionRegions.region_time` None: a virtual GPU whose kernel model is a plain
function) the region's kernel lasts the sum of its ops' modelled durations; a ``table`` kernel model without
entries of the fused kernel (a table recorded where the region ran op by op, as on a CPU) sums its ops' entries
(`kernel_timer.KernelTimer.region_duration_s`).

Limitations: under autograd the region's ops are recorded as eager ops: the tensors autograd saves are eager
autograd's (a compiler's partitioner may save fewer and recompute), and the backward runs as those ops' kernels
(Megatron's fused functions run inside autograd Functions whose backward is a ``@jit_fuser`` function, a region
of its own); a region that reads a value on the host (``.item()``) is not one kernel on a GPU either (a graph
break) but is still charged as one; ops issued by another thread while a region is open run unfused.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from prism_plugin.cost.kernels import KernelClass, KernelCost
from prism_plugin.device.active import Slot, slot
from prism_plugin.device.kernels import kernel_cost, tensor_accesses

__all__ = ["FusedModule", "FusionRegions", "RegionEnd", "activate", "active", "compile", "deactivate", "fused"]

F = TypeVar("F", bound=Callable[..., Any])
_PREFIX = "fused::"
_REGIONS: Slot[FusionRegions] = slot("fusion_regions", stack=True)
"""The fusion regions of the running virtual GPUs (`prism_plugin.device.active`)."""


def active() -> FusionRegions | None:
    """The fusion regions of the virtual GPU running in this process (None: no virtual GPU: regions run eagerly)."""
    return _REGIONS.current()


@dataclass(frozen=True, slots=True)
class RegionEnd:
    """What the virtual GPU does when an outermost region ends: its memory, then its one kernel."""

    name: str
    """The kernel's name in the tally: ``fused::<region name>``."""
    device: int | None
    """The device its ops ran on (None: none of its ops ran on a virtual GPU)."""
    survivors: tuple[tuple[int, int, int], ...]
    """``(storage key, bytes, device)`` of the storages created in the region and alive at its end, in order."""
    released: tuple[Any, ...]
    """Allocator blocks of pre-existing storages freed inside the region, freed after the survivors' mallocs."""
    cost: KernelCost | None
    """The region's one kernel (None: no op of it launches a kernel)."""
    ops_s: float
    """The sum of its ops' modelled durations (the fallback without a region cost model)."""
    parts: tuple[KernelCost, ...] = ()
    """Its ops' kernel costs, in order (what a kernel table recorded unfused holds)."""
    transients: tuple[tuple[int, int], ...] = ()
    """``(bytes, device)`` of the buffers the compiled region holds while it runs (functional copies of the inputs it
    scatters into): allocated before the survivors, freed after them."""


@dataclass(slots=True)
class _Region:
    name: str
    kernel_class: KernelClass | None
    thread: int
    compiled: bool = False
    device: int | None = None
    created: set[int] = field(default_factory=set)
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Storages created in the region and alive: key -> (bytes, device), in creation order."""
    released: list[Any] = field(default_factory=list)
    read: dict[int, dict[tuple, int]] = field(default_factory=dict)
    written: dict[int, dict[tuple, int]] = field(default_factory=dict)
    storage_bytes: dict[int, int] = field(default_factory=dict)
    flops: int = 0
    class_flops: dict[KernelClass, int] = field(default_factory=dict)
    class_bytes: dict[KernelClass, int] = field(default_factory=dict)
    lead: KernelCost | None = None
    ops_s: float = 0.0
    parts: list[KernelCost] = field(default_factory=list)
    transients: dict[int, tuple[int, int]] = field(default_factory=dict)


_SCATTERS = frozenset({"index_put_", "_index_put_impl_", "scatter_", "scatter_add_", "scatter_reduce_", "index_add_",
                       "index_copy_", "index_reduce_", "masked_scatter_"})
"""In-place scatters: in a compiled region, into a tensor the region was given, one functional copy of it."""


def _view_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a view addresses (a stride-0, broadcast dimension counts once)."""
    sizes = [int(n) for n, s in zip(t.shape, t.stride(), strict=True) if s != 0]
    return math.prod(sizes) * t.element_size() if all(sizes) else 0


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, int(storage.nbytes())


class FusionRegions:
    """The fusion regions of one virtual GPU (see the module docstring); `on_end` applies each region's end."""

    def __init__(self, on_end: Callable[[RegionEnd], None]) -> None:
        self.on_end = on_end
        self.region_time: Callable[[KernelCost, tuple[KernelCost, ...]], float] | None = None
        """A region's modelled seconds from its cost and its ops' (the kernel timer's `region_duration_s`, which
        tallies it)."""
        self.regions = 0
        """Outermost regions ended so far."""
        self._region: _Region | None = None
        self._depth = 0

    # -- opening and closing ---------------------------------------------------------------------------------
    def begin(self, name: str, kernel_class: KernelClass | None = None, *, compiled: bool = False) -> bool:
        """Open region `name` in this thread (nested: folds into the open one); False when another thread's
        region is open (this one then runs unfused; do not `end` it). `compiled`: a compiler's region (see the
        module docstring), not a CUDA extension's kernel."""
        me = threading.get_ident()
        if self._region is None:
            self._region = _Region(name, kernel_class, me, compiled)
            self._depth = 1
            return True
        if self._region.thread != me:
            return False
        self._depth += 1
        return True

    def end(self) -> None:
        """Close the innermost region; the outermost one's end is applied (`on_end`)."""
        region = self._region
        assert region is not None and self._depth > 0, "fusion region ended twice"
        self._depth -= 1
        if self._depth:
            return
        self._region = None
        self.regions += 1
        self.on_end(RegionEnd(name=_PREFIX + region.name, device=region.device,
                              survivors=tuple((k, n, d) for k, (n, d) in region.pending.items()),
                              released=tuple(region.released), cost=_region_cost(region), ops_s=region.ops_s,
                              parts=tuple(region.parts), transients=tuple(region.transients.values())))

    @contextmanager
    def region(self, name: str, kernel_class: KernelClass | None = None) -> Iterator[None]:
        """``with regions.region("bias_gelu"): ...``: the block's ops are one kernel (see the module docstring)."""
        began = self.begin(name, kernel_class)
        try:
            yield
        finally:
            if began:
                self.end()

    def folds(self) -> bool:
        """Whether an op issued now belongs to an open region (this thread's)."""
        region = self._region
        return region is not None and region.thread == threading.get_ident()

    # -- memory ------------------------------------------------------------------------------------------------
    def defer_allocation(self, key: int, nbytes: int, device: int) -> bool:
        """A new storage: True when it is the open region's (allocated at its end if it survives)."""
        region = self._region
        if region is None or region.thread != threading.get_ident():
            return False
        region.created.add(key)
        region.pending[key] = (nbytes, device)
        return True

    def drop(self, key: int) -> bool:
        """A storage died: True when it was one of the open region's (an intermediate: never allocated)."""
        region = self._region
        return region is not None and region.pending.pop(key, None) is not None

    def hold(self, block: Any) -> bool:
        """A pre-existing storage died inside the open region: True when its block is freed at the region's end."""
        if self._region is None:
            return False
        self._region.released.append(block)
        return True

    # -- time --------------------------------------------------------------------------------------------------
    def add_op(self, func: Any, args: tuple, kwargs: dict, out: Any, device: int | None,
               op_s: float | None = None) -> None:
        """Fold one op of the open region: its FLOPs and class, the pre-existing storages it reads and writes."""
        region = self._region
        assert region is not None
        if op_s is not None:
            region.ops_s += op_s
        cost = kernel_cost(func, args, kwargs, out)
        if cost is None:
            return
        if region.device is None:
            region.device = device
        region.parts.append(cost)
        region.flops += cost.flops
        kind = KernelClass.ELEMENTWISE if cost.kernel_class is KernelClass.MEMCPY else cost.kernel_class
        region.class_flops[kind] = region.class_flops.get(kind, 0) + cost.flops
        region.class_bytes[kind] = region.class_bytes.get(kind, 0) + cost.bytes
        if region.lead is None or (cost.flops, cost.bytes) > (region.lead.flops, region.lead.bytes):
            region.lead = cost
        reads, writes = tensor_accesses(func, args, kwargs)
        scatter = region.compiled and func._overloadpacket.__name__ in _SCATTERS
        for tensors, seen in ((reads, region.read), (writes, region.written)):
            for t in tensors:
                if t.device.type != "cuda":
                    continue
                storage = _storage(t)
                if storage is None or storage[0] in region.created:
                    continue
                key, nbytes = storage
                region.storage_bytes[key] = nbytes
                if scatter and seen is region.written:
                    region.transients.setdefault(key, (nbytes, t.device.index or 0))
                geometry = (int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.element_size())
                seen.setdefault(key, {})[geometry] = _view_bytes(t)


def _region_cost(region: _Region) -> KernelCost | None:
    lead = region.lead
    if lead is None:
        return None

    def moved(seen: dict[int, dict[tuple, int]]) -> int:
        return sum(min(sum(views.values()), region.storage_bytes[key]) for key, views in seen.items())

    nbytes = moved(region.read) + moved(region.written) + sum(n for n, _ in region.pending.values())
    kind = region.kernel_class
    if kind is None:
        weights = region.class_flops if region.flops else region.class_bytes
        kind = max(weights, key=lambda c: (weights[c], -list(KernelClass).index(c)))
    return KernelCost(op=_PREFIX + region.name, kernel_class=kind, flops=region.flops, bytes=nbytes,
                      dtype=lead.dtype, shape=lead.shape)


# -- entry points: fused functions and torch.compile -------------------------------------------------------------


def _label(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in ("_call_impl", "__call__", "forward"):
        return type(owner).__name__  # Module.compile(): the module's call
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def fused(fn: F, name: str | None = None, *, kernel_class: KernelClass | None = None, compiled: bool = False) -> F:
    """`fn` as a fusion region named `name` (default: its ``__name__``) whenever a virtual GPU runs in this process;
    elsewhere `fn` itself runs. `kernel_class`: the region kernel's class (default: the dominant one); `compiled`:
    ``torch.compile``'s region (its scatters into inputs hold a functional copy), not a CUDA extension's kernel."""
    label = name or _label(fn)

    @functools.wraps(fn)
    def region(*args: Any, **kwargs: Any) -> Any:
        regions = active()
        if regions is None or not regions.begin(label, kernel_class, compiled=compiled):
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            regions.end()

    region.__prism_fused__ = label  # type: ignore[attr-defined]
    return region  # type: ignore[return-value]


class FusedModule(torch.nn.Module):
    """What `compile` makes of a module: each call one region named after the module's class. The module sits under
    ``_orig_mod`` (parameter names ``_orig_mod.*``, as torch's ``OptimizedModule``); other attributes are its."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = module
        self._region = fused(module.__call__, type(module).__name__, compiled=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._region(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def compile(model: Any = None, *, disable: bool = False, **options: Any) -> Any:  # noqa: A001 - torch.compile's name
    """``torch.compile`` on virtual GPUs: a function (or bound method) becomes a fusion region (`fused`), a module a
    `FusedModule`; nothing is traced or compiled (fake tensors on a CPU host: inductor cannot run, and the region's
    one kernel is what a compiled graph without breaks launches per call). ``torch.compile(disable=True)`` returns
    the model itself; every other option (backend, mode, fullgraph, dynamic, ...) is accepted and has no effect.
    Called without a model, returns the decorator, as torch's does."""
    if model is None:
        return lambda fn: compile(fn, disable=disable, **options)
    if disable:
        return model
    if isinstance(model, torch.nn.Module):
        return FusedModule(model)
    return fused(model, compiled=True)


# -- the active regions ------------------------------------------------------------------------------------------


def activate(regions: FusionRegions) -> None:
    """Make `regions` this process's (the virtual GPU starts)."""
    _REGIONS.enter(regions)


def deactivate(regions: FusionRegions) -> None:
    """The virtual GPU of `regions` stops: fused functions run eagerly again."""
    _REGIONS.leave(regions)
