"""Allocation history of the caching-allocator model, and its snapshot in torch's ``_snapshot()`` form.

`AllocatorHistory` is what ``torch.cuda.memory._record_memory_history`` switches on in torch's
``DeviceCachingAllocator``: a bounded trace of the allocator's actions (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map`` / ``segment_unmap`` of expandable
segments, ``oom``, ``snapshot``), each with its address, size, stream, a time and, by the ``context``
option, the stack frames of the call; plus the frames each live block and segment was allocated from.
`CachingAllocatorModel` calls its hooks (``model.history``; nothing is recorded while it is None), and
`memory_snapshot` turns models and their histories into the dictionary torch's ``_snapshot()`` returns,
which ``torch.cuda._memory_viz`` and pytorch.org/memory_viz read.

Torch's rules kept: ``enabled="state"`` keeps one trace entry, ``"all"`` the last `max_entries` (a ring:
the oldest go first); context ``"state"`` keeps frames for live blocks only, ``"alloc"`` also on alloc
entries, ``"all"`` also on frees; a free's entries carry the allocation's frames unless context is
``"all"`` (and the free's own stack is not empty); disabling clears the trace; a snapshot records a
``snapshot`` entry (size: the active bytes).

Limitations: time is an integer sequence (one per recorded action) unless the runtime gives a clock in
microseconds (virtual time); segments released inside a malloc carry the segment's frames, not the
malloc's; frames are what the runtime's callable returns (opaque here; no C++ frames); no private pools
(``segment_pool_id`` is always ``(0, 0)``), no ``active_pending_free`` (a freed block is free at once),
no ``compile_context`` or user metadata (torch's defaults). Non-goals: the legacy per-block ``history``
format, FX trace augmentation. Pure: no torch.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

from prism_plugin.cost.allocator import Block, CachingAllocatorModel
from prism_plugin.cost.allocator_config import NO_LIMIT, AllocatorConfig

__all__ = ["AllocatorHistory", "Frames", "RecordContext", "TraceAction", "TraceEntry", "allocator_settings",
           "history_of", "memory_snapshot", "snapshot_segments"]

Frames = list[dict[str, Any]]
"""Stack frames, innermost first, each ``{"filename": str, "line": int, "name": str}`` (torch's ``Frame``)."""


class TraceAction(StrEnum):
    """torch's ``TraceEntry::Action``, by the names the snapshot carries."""

    ALLOC = "alloc"
    FREE_REQUESTED = "free_requested"
    FREE_COMPLETED = "free_completed"
    SEGMENT_ALLOC = "segment_alloc"
    SEGMENT_FREE = "segment_free"
    SEGMENT_MAP = "segment_map"
    SEGMENT_UNMAP = "segment_unmap"
    OOM = "oom"
    SNAPSHOT = "snapshot"


class RecordContext(IntEnum):
    """When frames are gathered (torch's ``RecordContext``; the ``context=`` option, ordered)."""

    NEVER = 0
    STATE = 1
    """Frames of live blocks and segments only (shown in the snapshot's ``segments``)."""
    ALLOC = 2
    """Also on the trace's alloc (and segment) entries."""
    ALL = 3
    """Also gathered at each free."""

    @classmethod
    def parse(cls, context: str | None) -> RecordContext:
        """``None`` / ``"state"`` / ``"alloc"`` / ``"all"``, as ``_record_memory_history(context=...)`` takes it."""
        if context is None:
            return cls.NEVER
        names = {"state": cls.STATE, "alloc": cls.ALLOC, "all": cls.ALL}
        if context not in names:
            raise ValueError(f"context={context!r}: expected context to be 'state', 'alloc', 'all', or None")
        return names[context]


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One recorded action; `addr` is the free device memory for ``oom`` (torch's ``device_free``)."""

    action: TraceAction
    addr: int
    size_bytes: int
    stream: int
    time_us: int
    frames: Frames | None
    """None: recorded without context (torch then leaves ``frames`` out of the entry)."""

    def as_dict(self) -> dict[str, Any]:
        """The entry as torch's snapshot lists it in ``device_traces``."""
        out: dict[str, Any] = {"action": self.action.value,
                               "device_free" if self.action is TraceAction.OOM else "addr": self.addr,
                               "size": self.size_bytes, "stream": self.stream, "time_us": self.time_us,
                               "compile_context": "N/A", "user_metadata": ""}
        if self.frames is not None:
            out["frames"] = self.frames
        return out


class AllocatorHistory:
    """The recorded history of one device's allocator model (disabled until `configure`).

    `frames` gathers the caller's stack (the runtime's; None records empty frames), `clock_us` the time of
    an action (None: a sequence number, 0, 1, 2, ... per recorded action).

    >>> h = AllocatorHistory(); h.configure("all", max_entries=2)
    >>> for ptr in (0, 512, 1024):
    ...     h.record(TraceAction.ALLOC, ptr, 512, 0)
    >>> [(e.addr, e.time_us) for e in h.entries]  # a ring of 2: the oldest entry is gone
    [(512, 1), (1024, 2)]
    """

    def __init__(self, *, frames: Callable[[], Frames] | None = None,
                 clock_us: Callable[[], int] | None = None) -> None:
        self.frames = frames
        self.clock_us = clock_us
        self.enabled = False
        self.context = RecordContext.NEVER
        self.skip_actions: frozenset[TraceAction] = frozenset()
        self.entries: deque[TraceEntry] = deque(maxlen=1)
        self.block_frames: dict[int, Frames] = {}  # address of a live block -> frames of its allocation
        self.segment_frames: dict[int, Frames] = {}  # address of a segment -> frames of its cudaMalloc / first map
        self._sequence = itertools.count()

    def configure(self, enabled: str | None = "all", context: str | None = "all", *, max_entries: int = sys.maxsize,
                  clear_history: bool = False, skip_actions: Iterable[str] = ()) -> None:
        """torch's ``_record_memory_history(enabled, context, max_entries=, clear_history=, skip_actions=)``."""
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled={enabled!r}: expected state to be 'state', 'all', or None")
        ctx = RecordContext.parse(context)
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: keep at least one entry (torch's default: sys.maxsize)")
        names = list(skip_actions)
        try:
            skip = frozenset(TraceAction(a) for a in names)
        except ValueError:
            raise ValueError(f"skip_actions={names!r}: valid actions are "
                             f"{[a.value for a in TraceAction]}") from None
        self.enabled = enabled is not None
        self.context = ctx if self.enabled else RecordContext.NEVER
        self.skip_actions = skip
        keep = max_entries if enabled == "all" else 1
        kept = [] if not self.enabled or clear_history else list(self.entries)
        self.entries = deque(kept, maxlen=keep)

    # -- recording ------------------------------------------------------------------------------------
    def gather(self, when: RecordContext) -> Frames | None:
        """The caller's frames if the context option asks for them at `when`, else None."""
        if self.context < when or when is RecordContext.NEVER:
            return None
        return self.frames() if self.frames is not None else []

    def record(self, action: TraceAction, addr: int, size: int, stream: int, frames: Frames | None = None) -> None:
        """Append one entry (torch's ``record_trace``): frames stay only with context alloc or all (None: none
        gathered, e.g. a block allocated before recording began)."""
        if not self.enabled or action in self.skip_actions:
            return
        time_us = self.clock_us() if self.clock_us is not None else next(self._sequence)
        kept = frames if self.context >= RecordContext.ALLOC else None
        self.entries.append(TraceEntry(action, addr, size, stream, time_us, kept))

    # -- the allocator model's hooks ------------------------------------------------------------------
    def on_alloc(self, block: Block, requested: int) -> None:
        frames = self.gather(RecordContext.STATE)
        if frames is not None:
            self.block_frames[block.ptr] = frames
        self.record(TraceAction.ALLOC, block.ptr, requested, block.stream, frames)

    def on_free(self, block: Block) -> None:
        """Requested and completed at once (no stream uses): both entries, the allocation's frames."""
        kept = self.block_frames.pop(block.ptr, None)
        frames = self.gather(RecordContext.ALL) or kept
        self.record(TraceAction.FREE_REQUESTED, block.ptr, block.requested, block.stream, frames)
        self.record(TraceAction.FREE_COMPLETED, block.ptr, block.requested, block.stream, frames)

    def on_segment_alloc(self, block: Block) -> None:
        frames = self.gather(RecordContext.STATE)
        if frames is not None:
            self.segment_frames[block.ptr] = frames
        self.record(TraceAction.SEGMENT_ALLOC, block.ptr, block.size, block.stream, frames)

    def on_segment_free(self, block: Block) -> None:
        kept = self.segment_frames.pop(block.ptr, None)
        self.record(TraceAction.SEGMENT_FREE, block.ptr, block.size, block.stream,
                    self.gather(RecordContext.ALL) or kept)

    def on_segment_map(self, block: Block, size: int) -> None:
        """`size` bytes mapped at `block` (an expandable segment's pages); the segment's first map names it."""
        frames = self.gather(RecordContext.STATE)
        if frames is not None and block.prev is None:
            self.segment_frames.setdefault(block.ptr, frames)
        self.record(TraceAction.SEGMENT_MAP, block.ptr, size, block.stream, frames)

    def on_segment_unmap(self, ptr: int, size: int, stream: int) -> None:
        self.record(TraceAction.SEGMENT_UNMAP, ptr, size, stream,
                    self.gather(RecordContext.ALL) or self.segment_frames.get(ptr))

    def on_oom(self, size: int, stream: int, device_free: int) -> None:
        """A request of `size` (rounded) bytes the device could not hold; `device_free` what it still has."""
        self.record(TraceAction.OOM, device_free, size, stream, self.gather(RecordContext.STATE))


def history_of(model: CachingAllocatorModel) -> AllocatorHistory:
    """`model`'s history, attached (disabled) on first use."""
    if model.history is None:
        model.history = AllocatorHistory()
    return model.history


def snapshot_segments(model: CachingAllocatorModel) -> list[dict[str, Any]]:
    """`model`'s segments as ``torch.cuda.memory._snapshot()["segments"]`` lists them (frames from its history).

    A segment's ``requested_size`` sums its live blocks' requests; ``active_size`` equals ``allocated_size``
    (no block waits on another stream).
    """
    history = model.history
    out = []
    for seg in model.segments():
        blocks = []
        for b in seg["blocks"]:
            frames = history.block_frames.get(b["address"], []) if history and b["state"] == "active_allocated" else []
            blocks.append({**b, "frames": frames})
        out.append({
            "device": seg["device"], "address": seg["address"], "total_size": seg["total_size"],
            "allocated_size": seg["allocated_size"], "active_size": seg["active_size"],
            "requested_size": sum(b["requested_size"] for b in blocks), "stream": seg["stream"],
            "segment_type": seg["segment_type"], "segment_pool_id": (0, 0), "is_expandable": seg["is_expandable"],
            "frames": history.segment_frames.get(seg["address"], []) if history else [],
            "blocks": blocks,
        })
    return out


def allocator_settings(config: AllocatorConfig, alloc_conf: str = "") -> dict[str, Any]:
    """The snapshot's ``allocator_settings`` for `config` (`alloc_conf`: the ``PYTORCH_CUDA_ALLOC_CONF`` text).

    >>> settings = allocator_settings(AllocatorConfig())
    >>> settings["max_split_size"], settings["roundup_power2_divisions"]["1"], len(settings["roundup_power2_divisions"])
    (-1, 0, 16)
    """
    return {
        "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
        "max_split_size": -1 if config.max_split_size_bytes == NO_LIMIT else config.max_split_size_bytes,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(config.roundup_power2_divisions)},
    }


def memory_snapshot(models: Sequence[CachingAllocatorModel], alloc_conf: str = "") -> dict[str, Any]:
    """torch's ``_snapshot()`` for devices `models` (index = device): segments of every device, then one trace per
    device (a ``snapshot`` entry recorded last, as torch does), and the first device's allocator settings."""
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for model in models:
        device_segments = snapshot_segments(model)
        segments.extend(device_segments)
        history = model.history
        if history is None:
            traces.append([])
            continue
        history.record(TraceAction.SNAPSHOT, 0, sum(s["active_size"] for s in device_segments), 0)
        traces.append([e.as_dict() for e in history.entries])
    config = models[0].config if models else AllocatorConfig()
    return {"segments": segments, "device_traces": traces, "allocator_settings": allocator_settings(config, alloc_conf),
            "external_annotations": []}
