"""The allocator model's memory history: torch's ``_record_memory_history`` trace and ``_snapshot()`` form.

Exact traces for short malloc / free / empty_cache sequences (addresses follow the model's made-up
address space: segments from 0x7F0000000000, each a multiple of 2 MiB apart), torch's ring and context
rules, and for a seeded workload of 400 calls: replaying the trace from an empty device gives the
snapshot's live blocks and reserved bytes, and its counts equal the model's counters.
"""

from __future__ import annotations

import random

import pytest

from prism_plugin.cost.allocator import CachingAllocatorModel, DeviceOutOfMemory
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.allocator_history import (
    AllocatorHistory,
    RecordContext,
    TraceAction,
    history_of,
    memory_snapshot,
)

MiB = 1 << 20
BASE = 0x7F0000000000


def recording(config: AllocatorConfig | None = None, *, device_bytes: int = 80 << 30, context: str | None = "all",
              enabled: str = "all", max_entries: int = 1 << 30) -> tuple[CachingAllocatorModel, AllocatorHistory]:
    model = CachingAllocatorModel(device_bytes, config)
    history = history_of(model)
    calls = iter(range(1 << 30))
    history.frames = lambda: [{"filename": "train.py", "line": next(calls), "name": "step"}]
    history.configure(enabled, context, max_entries=max_entries)
    return model, history


def actions(history: AllocatorHistory) -> list[tuple[str, int, int]]:
    return [(e.action.value, e.addr, e.size_bytes) for e in history.entries]


def test_malloc_free_empty_cache_trace_is_torchs_sequence() -> None:
    model, history = recording()
    a = model.malloc(1000)  # a 2 MiB small segment, then the block at its start
    b = model.malloc(3 * MiB)  # a 20 MiB large segment (1-10 MiB requests), after the small one
    model.free(b)
    model.empty_cache()  # the large segment is whole again: released; the small one holds `a`
    c = model.malloc(700)  # split from the small segment after `a` (1000 B took 1024)
    model.free(a)
    model.empty_cache()  # the small segment still holds `c`: kept
    large = BASE + 2 * MiB
    assert actions(history) == [
        ("segment_alloc", BASE, 2 * MiB), ("alloc", BASE, 1000),
        ("segment_alloc", large, 20 * MiB), ("alloc", large, 3 * MiB),
        ("free_requested", large, 3 * MiB), ("free_completed", large, 3 * MiB),
        ("segment_free", large, 20 * MiB),
        ("alloc", BASE + 1024, 700),
        ("free_requested", BASE, 1000), ("free_completed", BASE, 1000),
    ]
    assert c.ptr == BASE + 1024
    assert [e.time_us for e in history.entries] == list(range(10))  # the action sequence: deterministic
    assert all(e.stream == 0 for e in history.entries)


def test_expandable_segments_map_and_unmap_pages() -> None:
    model, history = recording(AllocatorConfig(expandable_segments=True))
    model.malloc(3 * MiB)
    b = model.malloc(30 * MiB)  # 17 MiB free in the first 20 MiB page: one more page is mapped
    model.free(b)
    model.empty_cache()  # the second page is wholly free: unmapped
    assert actions(history) == [
        ("segment_map", BASE, 20 * MiB), ("alloc", BASE, 3 * MiB),
        ("segment_map", BASE + 20 * MiB, 20 * MiB), ("alloc", BASE + 3 * MiB, 30 * MiB),
        ("free_requested", BASE + 3 * MiB, 30 * MiB), ("free_completed", BASE + 3 * MiB, 30 * MiB),
        ("segment_unmap", BASE + 20 * MiB, 20 * MiB),
    ]
    (segment,) = memory_snapshot([model])["segments"]
    assert (segment["address"], segment["total_size"], segment["is_expandable"]) == (BASE, 20 * MiB, True)


def test_oom_entry_carries_the_free_device_memory() -> None:
    model, history = recording(device_bytes=100 * MiB)
    model.malloc(50 * MiB)
    with pytest.raises(DeviceOutOfMemory):
        model.malloc(60 * MiB)
    assert actions(history)[-1] == ("oom", 50 * MiB, 60 * MiB)  # addr holds device_free, as in torch
    entry = history.entries[-1].as_dict()
    assert entry["device_free"] == 50 * MiB and "addr" not in entry and entry["size"] == 60 * MiB


def test_ring_keeps_the_last_max_entries_and_state_keeps_one() -> None:
    model, history = recording(max_entries=3)
    for _ in range(4):
        model.free(model.malloc(4096))
    # 1 segment_alloc + 4 x (alloc, free_requested, free_completed) = 13 entries made, the last 3 kept
    assert [e.action for e in history.entries] == [TraceAction.ALLOC, TraceAction.FREE_REQUESTED,
                                                   TraceAction.FREE_COMPLETED]
    assert [e.time_us for e in history.entries] == [10, 11, 12]
    model, history = recording(enabled="state")
    model.malloc(4096)
    model.malloc(4096)
    assert actions(history) == [("alloc", BASE + 4096, 4096)]
    history.configure(None)  # disabling clears the trace, as torch does
    model.malloc(4096)
    assert len(history.entries) == 0


def test_context_decides_which_entries_carry_frames() -> None:
    model, history = recording(context="state")  # frames of live blocks only
    a = model.malloc(4096)
    assert all(e.frames is None for e in history.entries)
    assert history.block_frames[a.ptr] == [{"filename": "train.py", "line": 1, "name": "step"}]
    assert "frames" not in history.entries[0].as_dict()
    model, history = recording(context="alloc")  # a free carries its allocation's frames
    model.free(model.malloc(4096))
    lines = [e.frames[0]["line"] if e.frames else None for e in history.entries]
    assert lines == [0, 1, 1, 1]  # segment_alloc, alloc, free_requested, free_completed
    model, history = recording(context="all")  # a free gathers its own
    model.free(model.malloc(4096))
    assert [e.frames[0]["line"] for e in history.entries if e.frames] == [0, 1, 2, 2]
    model, history = recording(context=None)
    model.malloc(4096)
    assert all(e.frames is None for e in history.entries) and history.block_frames == {}


def test_skip_actions_and_bad_options() -> None:
    model = CachingAllocatorModel(80 << 30)
    history = history_of(model)
    history.configure("all", "all", skip_actions=["free_requested", "segment_alloc"])
    model.free(model.malloc(4096))
    assert [e.action.value for e in history.entries] == ["alloc", "free_completed"]
    with pytest.raises(ValueError, match="expected state"):
        history.configure("yes")
    with pytest.raises(ValueError, match="expected context"):
        history.configure("all", "some")
    with pytest.raises(ValueError, match="valid actions"):
        history.configure("all", skip_actions=["malloc"])
    assert RecordContext.parse("alloc") > RecordContext.STATE


def test_snapshot_segments_and_totals() -> None:
    model, history = recording()
    a = model.malloc(1000)
    model.malloc(3 * MiB)
    model.malloc(18 * MiB + 1)  # more than the 17 MiB left of the 20 MiB one: its own, rounded up to 20 MiB
    model.free(a)
    snap = memory_snapshot([model])
    segments = snap["segments"]
    assert [(s["address"], s["total_size"], s["segment_type"]) for s in segments] == [
        (BASE, 2 * MiB, "small"), (BASE + 2 * MiB, 20 * MiB, "large"), (BASE + 22 * MiB, 20 * MiB, "large")]
    active = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in active) == model.stat("allocated_bytes") == 3 * MiB + 18 * MiB + 512
    assert sum(s["total_size"] for s in segments) == model.stat("reserved_bytes") == 42 * MiB
    assert sum(s["requested_size"] for s in segments) == model.stat("requested_bytes") == 21 * MiB + 1
    assert all(b["frames"] for b in active) and all(s["frames"] for s in segments)
    assert {s["segment_pool_id"] for s in segments} == {(0, 0)}
    for s in segments:  # torch's block addresses: contiguous from the segment's
        ends = [s["address"]] + [b["address"] + b["size"] for b in s["blocks"]]
        assert [b["address"] for b in s["blocks"]] == ends[:-1] and ends[-1] == s["address"] + s["total_size"]
    (trace,) = snap["device_traces"]
    assert trace[-1]["action"] == "snapshot" and trace[-1]["size"] == model.stat("active_bytes")
    assert "frames" not in trace[-1]
    assert snap["allocator_settings"]["max_split_size"] == -1
    assert snap["allocator_settings"]["expandable_segments"] is False


def _replay(trace: list[dict]) -> tuple[dict[int, int], int]:
    """Live blocks (address -> requested bytes) and reserved bytes after `trace`, from an empty device."""
    blocks: dict[int, int] = {}
    reserved = 0
    for e in trace:
        action = e["action"]
        if action == "alloc":
            assert e["addr"] not in blocks, f"two live blocks at {e['addr']:#x}"
            blocks[e["addr"]] = e["size"]
        elif action == "free_completed":
            assert blocks.pop(e["addr"]) == e["size"]
        elif action in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif action in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
    return blocks, reserved


@pytest.mark.parametrize("config", [AllocatorConfig(), AllocatorConfig(expandable_segments=True),
                                    AllocatorConfig(max_split_size_bytes=64 * MiB)], ids=["default", "expandable",
                                                                                          "max-split"])
def test_replaying_a_workload_trace_gives_the_snapshot(config: AllocatorConfig) -> None:
    model, history = recording(config, device_bytes=4 << 30)
    rng = random.Random(14)
    live, mallocs, frees = [], 0, 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.55 or not live:
            size = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 12 * MiB), rng.randint(12 * MiB, 90 * MiB)])
            live.append(model.malloc(size))
            mallocs += 1
        elif roll < 0.95:
            model.free(live.pop(rng.randrange(len(live))))
            frees += 1
        else:
            model.empty_cache()
    snap = memory_snapshot([model])
    blocks, reserved = _replay(snap["device_traces"][0])
    active = {b["address"]: b["requested_size"] for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert blocks == active == {b.ptr: b.requested for b in live}
    assert reserved == model.reserved == sum(s["total_size"] for s in snap["segments"])
    counts = {a: sum(e["action"] == a for e in snap["device_traces"][0]) for a in
              ("alloc", "free_completed", "segment_alloc", "segment_map", "segment_free", "segment_unmap")}
    assert (counts["alloc"], counts["free_completed"]) == (mallocs, frees)
    assert counts["segment_alloc"] + counts["segment_map"] == model.stat("num_device_alloc")
    assert counts["segment_free"] + counts["segment_unmap"] == model.stat("num_device_free")
