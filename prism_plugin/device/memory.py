"""Deterministic peak tensor memory on CPU: a tensor-storage tracker (DESIGN.md section 7).

On GPU the allocator's own statistics (``torch.cuda.max_memory_allocated``) are the peak. A
CPU-only torch keeps no such statistics, so `StorageTracker` counts them itself: a
`TorchDispatchMode` that sees the output of every ATen op (forward and backward, in the thread
that entered it), registers each storage an op *creates* once (an output sharing an input's
storage, as views, in-place and ``out=`` results do, is not an allocation) and subtracts its bytes
when the storage is freed (a weak reference on the storage, whose Python object torch preserves
for the storage's whole life). The figure is bytes of live tensor storage: deterministic run to
run, with no allocator rounding, caching or fragmentation, so two runs that allocate the same
tensors report the same peak to the byte.

Pure-ish: imports torch, never torch.distributed, Megatron or DeepSpeed.

Limitations (say them next to any figure):
- only storages created by ATen ops while the tracker is active count; tensors that existed before
  `start()` are the baseline (not counted, nor are views of them), and storages made outside the dispatcher
  (``torch.from_numpy``, unpickled data-loader batches, memory-mapped loads) are not seen;
- ``storage.resize_()`` after creation is not followed (Megatron's FSDP path does this);
- one thread: ops issued by other threads (a data-loader thread) are not seen;
- it slows every op by a Python call (fine for the tiny models of CPU tests).

Example::

    from prism_plugin.device.memory import StorageTracker
    with StorageTracker() as mem:
        train_step()
    print(mem.peak_bytes)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prism_plugin.device.active import Slot, slot
from prism_plugin.device.leaves import leaves

__all__ = ["StorageTracker", "current_tracker"]

TRACKERS: Slot[StorageTracker] = slot("storage_tracker", stack=True)
"""The running trackers of this process, innermost last (`prism_plugin.device.active`)."""


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_FULL_STORAGE_LOSSES = {torch.ops.aten.mse_loss.default: 2, torch.ops.aten.smooth_l1_loss.default: 2,
                        torch.ops.aten.binary_cross_entropy.default: 3}
"""Losses whose real kernel returns a reduced (0-dim) result in a storage of the unreduced size: the structured
meta function (one for every device) allocates the output as the elementwise loss, the mean or sum then resizes it
to 0-dim in place, and a shrinking resize keeps the storage (measured on CPU: ``F.mse_loss`` of two 64 x 512 fp32
tensors holds 131,072 B). FakeTensorMode's meta makes a 4 B storage instead, so a fake output of these ops is
counted at the real kernel's size. Value: the position of the ``reduction`` argument (0 = none: elementwise)."""


def _full_storage_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """The storage a real kernel gives `func`'s reduced output (`_FULL_STORAGE_LOSSES`); None: its own size."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(out, FakeTensor) or out.dim() != 0:
        return None
    at = _FULL_STORAGE_LOSSES[func]
    if (args[at] if len(args) > at else kwargs.get("reduction", 1)) == 0:
        return None
    return torch.broadcast_shapes(args[0].shape, args[1].shape).numel() * out.element_size()


def current_tracker() -> StorageTracker | None:
    """The innermost running tracker of this process, if any."""
    return TRACKERS.current()


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storage created while active (see the module docstring).

    `devices`: device types counted (default: cpu only, the case this tracker exists for).
    """

    def __init__(self, devices: tuple[str, ...] = ("cpu",)) -> None:
        super().__init__()
        self.devices = frozenset(devices)
        self.current_bytes = 0
        """Bytes of tracked storage alive now."""
        self.peak_bytes = 0
        """Highest `current_bytes` since start (or the last `reset_peak`)."""
        self.allocations = 0
        """Storages registered so far."""
        self.late_frees = 0
        self.late_free_bytes = 0
        """Storages (and their bytes) freed by a thread other than the one that started the tracker: a
        communication library's worker (gloo's) dropping the last reference to a tensor after the program's thread
        was told the operation completed. Until that thread ran, the program's thread may have allocated more, so
        a peak measured with late frees is an upper bound, above the race-free one by at most these bytes."""
        self._owner: int | None = None
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.history: list[tuple[str, int, int, int]] | None = None
        """With `record_history`: (action ``alloc`` / ``free_completed``, storage key, bytes, sequence), bounded."""
        self._history_max = 0
        self._nbytes_override: int | None = None
        self._sequence = 0

    # -- accounting ----------------------------------------------------------------------------
    def _register(self, t: torch.Tensor) -> None:
        if t.device.type not in self.devices or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested / wrapper tensors
            return
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes() if self._nbytes_override is None else self._nbytes_override
        if nbytes == 0:
            return
        self._live[key] = (weakref.ref(storage, lambda _ref, k=key: self._free(k)), nbytes)
        self._allocated(key, nbytes, t)
        if self.history is not None:
            self._record("alloc", key, nbytes)
        self.allocations += 1
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current_bytes -= entry[1]
            if self._owner is not None and threading.get_ident() != self._owner:
                self.late_frees += 1
                self.late_free_bytes += entry[1]
            self._released(key)
            if self.history is not None:
                self._record("free_completed", key, entry[1])

    def _record(self, action: str, key: int, nbytes: int) -> None:
        assert self.history is not None
        self._sequence += 1
        self.history.append((action, key, nbytes, self._sequence))
        if len(self.history) > self._history_max:  # a ring, like torch's max_entries
            del self.history[0]

    def record_history(self, max_entries: int = 100_000) -> None:
        """Keep the last `max_entries` allocations and frees, for `snapshot` (torch's memory_viz format)."""
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r} must be >= 1")
        self.history, self._history_max = [], max_entries

    def snapshot(self) -> dict[str, Any]:
        """This tracker's storages in the format of ``torch.cuda.memory._snapshot()`` where it fits: no segments
        (a CPU tensor's storage is its own ``malloc``; no caching allocator), one trace of ``alloc`` /
        ``free_completed`` entries (storage key as the address, bytes, the sequence as ``time_us``) from
        `record_history`; ``torch.cuda._memory_viz.trace_plot`` draws it."""
        trace = [{"action": action, "addr": key, "size": nbytes, "stream": 0, "time_us": seq, "frames": []}
                 for action, key, nbytes, seq in (self.history or ())]
        return {"segments": [], "device_traces": [trace], "allocator_settings": {"device": "cpu"}}

    def _allocated(self, key: int, nbytes: int, tensor: torch.Tensor) -> None:
        """Called once per new storage (a subclass's hook: the virtual GPU feeds its allocator model)."""

    def _released(self, key: int) -> None:
        """Called when a tracked storage is freed."""

    def reset_peak(self) -> None:
        """Restart the peak from the bytes alive now (like ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_bytes = self.current_bytes

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside the dispatcher (e.g. a data-loader batch) from now on."""
        for t in tensors:
            self._register(t)

    # -- dispatch ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._track_outputs(leaves(out), leaves((args, kwargs)), func, args, kwargs)
        return out

    def _track_outputs(self, out_leaves: list[Any], in_leaves: list[Any], func: Any = None, args: tuple = (),
                       kwargs: dict | None = None) -> None:
        """Register each output tensor among an op's result leaves whose storage none of its input leaves has
        (with `func` and its arguments: a fake output of `_FULL_STORAGE_LOSSES` at the real kernel's size)."""
        outputs = [t for t in out_leaves if isinstance(t, torch.Tensor)]
        if not outputs or func is _LIFT_FRESH:
            # lift_fresh wraps a tensor made from data outside the dispatcher (torch.tensor, as_tensor, from_numpy):
            # real runs return that tensor itself (its storage unseen, the documented limitation); under
            # FakeTensorMode it is a new fake storage, left out too so fake and real runs count the same
            return
        # a view, an in-place or an out= result shares an input's storage: not a new allocation
        # (and a view of a storage allocated while untracked must not count as one either)
        inputs = {_storage_key(t) for t in in_leaves if isinstance(t, torch.Tensor)}
        full = _full_storage_bytes(func, args, kwargs or {}, outputs[0]) if func in _FULL_STORAGE_LOSSES else None
        self._nbytes_override = full
        try:
            for t in outputs:
                if _storage_key(t) not in inputs:
                    self._register(t)
        finally:
            self._nbytes_override = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> StorageTracker:
        """Enter the mode (in this thread) and make it the process's current tracker."""
        self.__enter__()
        return self

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def __enter__(self) -> StorageTracker:
        if self._owner is None:
            self._owner = threading.get_ident()
        TRACKERS.enter(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        TRACKERS.leave(self)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Allocations inside are not counted (e.g. a test's copies of results); frees still are."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def summary(self) -> dict[str, int]:
        return {"current_bytes": self.current_bytes, "peak_bytes": self.peak_bytes,
                "allocations": self.allocations, "late_free_bytes": self.late_free_bytes}
