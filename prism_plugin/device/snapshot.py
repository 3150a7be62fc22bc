"""Memory snapshots of virtual GPUs: torch's memory-history API answered by the allocator models.

`install(shim)` makes, until the shim's `uninstall()`, ``torch.cuda.memory._record_memory_history``,
``_snapshot``, ``_dump_snapshot`` and ``torch.cuda.memory_snapshot`` / ``torch.cuda.memory.memory_snapshot``
work on the virtual GPUs of a `CudaShim`: every device's `CachingAllocatorModel` records its history
(`prism_plugin.cost.allocator_history`) and the snapshot is the dictionary torch's ``_snapshot()`` returns,
so ``torch.cuda._memory_viz`` (``segments``, ``memory``, ``segsum``, ``trace``, ``trace_plot``,
``segment_plot``) and pytorch.org/memory_viz open the dumped pickle unchanged.

For a whole run, ``PRISM_MEMORY_SNAPSHOT=<path>`` records from the start (`from_env`, by the session when
the virtual GPU starts) and `write_snapshot` writes the file when it stops; ``{rank}`` in the path becomes
the process's rank; ``PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES`` bounds the trace (default 100,000 entries).

Frames are the program's Python stack (`python_frames`: prism's own frames and torch's fake-tensor and
dispatch internals left out, at most 64), innermost first, as torch lists them.

Limitations: no C++ frames (``stacks="all"`` is ``"python"``), so what autograd's device threads allocate
(the backward's gradients and temporaries) has no frames, as in torch with ``stacks="python"``; time is
the allocator's action sequence (no virtual time yet); one history setting for all devices, as in torch
(``device`` is ignored); ``_memory_viz.segments`` / ``memory`` / ``compare`` need Brendan Gregg's
flamegraph.pl as in torch (or a ``format_flamegraph`` argument).
Non-goals: ``augment_with_fx_traces``, ``torch._C._cuda_memorySnapshot``, memory metadata annotations.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import prism_plugin
from prism_plugin.cost.allocator import CachingAllocatorModel
from prism_plugin.cost.allocator_history import Frames, history_of, memory_snapshot, snapshot_segments

__all__ = ["DEFAULT_MAX_ENTRIES", "ENV", "ENV_MAX_ENTRIES", "dump_snapshot", "from_env", "install",
           "python_frames", "record_memory_history", "record_memory_history_legacy", "snapshot", "write_snapshot"]

ENV = "PRISM_MEMORY_SNAPSHOT"
ENV_MAX_ENTRIES = "PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES"
DEFAULT_MAX_ENTRIES = 100_000
"""Trace entries a run's snapshot keeps (torch's own default is unbounded; its docs suggest 100,000)."""

_PRISM_DIR = os.path.dirname(os.path.abspath(prism_plugin.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_INTERNALS = tuple(_TORCH_DIR + p for p in (
    "_subclasses", "utils/_python_dispatch.py", "utils/_pytree.py", "utils/_stats.py", "utils/_contextlib.py",
    "_ops.py", "overrides.py", "_prims", "_refs", "_decomp", "_meta_registrations.py", "_library",
    "fx/experimental", "_tensor.py", "_compile.py", "_dynamo", "_guards.py", "_higher_order_ops",
))
"""torch files that are the fake tensor's machinery, not the program: a real CUDA run would not show them."""


def python_frames(max_depth: int = 64) -> Frames:
    """The caller's Python stack, innermost first, without prism's frames and torch's fake-tensor internals."""
    out: Frames = []
    frame = sys._getframe(1)
    while frame is not None and len(out) < max_depth:
        filename = frame.f_code.co_filename
        if not filename.startswith(_PRISM_DIR) and not filename.startswith(_TORCH_INTERNALS):
            out.append({"filename": filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return out


def record_memory_history(allocators: Sequence[CachingAllocatorModel], enabled: str | bool | None = "all",
                          context: str | None = "all", stacks: str = "all", max_entries: int = sys.maxsize,
                          device: Any = None, clear_history: bool = False, compile_context: bool = False,
                          global_record_annotations: bool = False, skip_actions: Sequence[str] | None = None, *,
                          frames: Callable[[], Frames] = python_frames) -> None:
    """``torch.cuda.memory._record_memory_history`` for `allocators` (every device, as torch does)."""
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks={stacks!r}: expected stacks to be 'python', or 'all'")
    if isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled}: a bool is the legacy form (record_memory_history_legacy); torch's "
                        "_record_memory_history dispatches it there, as `install` does")
    for model in allocators:
        history = history_of(model)
        history.frames = frames
        history.configure(enabled, context, max_entries=max_entries, clear_history=clear_history,
                          skip_actions=skip_actions or ())


def record_memory_history_legacy(allocators: Sequence[CachingAllocatorModel], enabled: bool,
                                 record_context: bool = True, trace_alloc_max_entries: int = 1,
                                 trace_alloc_record_context: bool = False, device: Any = None,
                                 record_context_cpp: bool = False, clear_history: bool = False,
                                 compile_context: bool = False, global_record_annotations: bool = False,
                                 skip_actions: Sequence[str] | None = None) -> None:
    """torch's legacy form, ``_record_memory_history(True, trace_alloc_max_entries=100000,
    trace_alloc_record_context=True)`` (Megatron's ``--record-memory-history``), mapped as torch maps it."""
    state = None if not enabled else "all" if trace_alloc_max_entries > 1 else "state"
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    record_memory_history(allocators, state, context, max_entries=max(1, trace_alloc_max_entries),
                          clear_history=clear_history, skip_actions=skip_actions)


def snapshot(allocators: Sequence[CachingAllocatorModel], alloc_conf: str | None = None) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` of `allocators` (`alloc_conf`: default ``PYTORCH_CUDA_ALLOC_CONF``)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
    return memory_snapshot(allocators, conf)


def dump_snapshot(allocators: Sequence[CachingAllocatorModel], filename: str | os.PathLike = "dump_snapshot.pickle",
                  augment_with_fx_traces: bool = False) -> None:
    """``torch.cuda.memory._dump_snapshot``: the snapshot, pickled."""
    if augment_with_fx_traces:
        raise NotImplementedError("prism virtual GPU: _dump_snapshot(augment_with_fx_traces=True) is not modelled")
    with open(filename, "wb") as f:
        pickle.dump(snapshot(allocators), f)


def write_snapshot(allocators: Sequence[CachingAllocatorModel], path: str | os.PathLike) -> Path:
    """Dump the snapshot to `path` (its folder made if missing); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    dump_snapshot(allocators, out)
    return out


def from_env(allocators: Sequence[CachingAllocatorModel], *, rank: int | None = None,
             environ: Mapping[str, str] | None = None) -> Path | None:
    """With ``PRISM_MEMORY_SNAPSHOT`` set: start recording on `allocators` and return where to `write_snapshot`."""
    env = os.environ if environ is None else environ
    template = env.get(ENV)
    if not template:
        return None
    if "{rank}" in template and rank is None:
        raise ValueError(f"{ENV}={template!r} names {{rank}} but this process has no rank")
    from prism_plugin.config.settings import from_environ

    max_entries = int(str(from_environ("memory_snapshot_max_entries", env)))  # the table's parser and default
    record_memory_history(allocators, "all", "all", max_entries=max_entries)
    return Path(template.replace("{rank}", str(rank)))


def install(shim: Any) -> None:
    """Patch torch's memory-history API for `shim`'s virtual GPUs (`shim.allocators`), undone by its uninstall."""
    allocators: list[CachingAllocatorModel] = shim.allocators
    memory, p = torch.cuda.memory, shim._patches

    def _record(enabled: str | bool | None = "all", *args: Any, **kwargs: Any) -> None:
        if isinstance(enabled, bool):
            record_memory_history_legacy(allocators, enabled, *args, **kwargs)
        else:
            record_memory_history(allocators, enabled, *args, **kwargs)

    def _snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
        if augment_with_fx_traces:
            raise NotImplementedError("prism virtual GPU: _snapshot(augment_with_fx_traces=True) is not modelled")
        return snapshot(allocators)

    def _dump(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
        dump_snapshot(allocators, filename, augment_with_fx_traces)

    def _segments(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
        return [seg for model in allocators for seg in snapshot_segments(model)]

    p.setattr(memory, "_record_memory_history", _record)
    p.setattr(memory, "_record_memory_history_impl", lambda *a, **k: record_memory_history(allocators, *a, **k))
    p.setattr(memory, "_record_memory_history_legacy",
              lambda *a, **k: record_memory_history_legacy(allocators, *a, **k))
    p.setattr(memory, "_snapshot", _snapshot)
    p.setattr(memory, "_dump_snapshot", _dump)
    p.setattr(memory, "memory_snapshot", _segments)
    p.setattr(torch.cuda, "memory_snapshot", _segments)
