"""The caching-allocator model against cases computed by hand from ``c10/cuda/CUDACachingAllocator.cpp``.

Each test states the allocator's steps it exercises (the function names are torch's).
"""

from __future__ import annotations

import pytest

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.allocator import CachingAllocatorModel, DeviceOutOfMemory
from prism_plugin.cost.allocator_config import AllocatorConfig, allocation_size, format_size, round_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_round_size_and_allocation_size() -> None:
    assert [round_size(s) for s in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    four = AllocatorConfig(roundup_power2_divisions=(4,) * 16)
    # torch's own example: 1200 lies in [1024, 2048); 4 divisions are 1024, 1280, 1536, 1792 -> 1280
    assert round_size(1200 * MiB, four) == 1280 * MiB
    assert round_size(1024 * MiB, four) == 1024 * MiB  # a power of 2 stays
    assert round_size(1500, four) == 1536  # 1500 > 512 * 4: divisions of [1024, 2048) are 256 B apart
    assert round_size(1900, four) == 2048
    assert round_size(1500, AllocatorConfig(roundup_power2_divisions=(8,) * 16)) == 1536  # 1500 < 4096: 512 B
    # get_allocation_size: small -> 2 MiB; (1, 10) MiB -> 20 MiB; >= 10 MiB -> rounded up to 2 MiB
    assert [allocation_size(s) for s in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 512)] == [
        2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


def test_format_size_is_torchs() -> None:
    assert [format_size(s) for s in (512, 1024, 1025, 20 * MiB, 80 * GiB)] == [
        "512 bytes", "1024 bytes", "1.00 KiB", "20.00 MiB", "80.00 GiB"]


def test_small_requests_pack_into_2mib_segments() -> None:
    m = CachingAllocatorModel(80 * GiB)
    blocks = [m.malloc(512 * KiB) for _ in range(4)]  # split 2 MiB: 1.5, 1.0, 0.5 MiB remain; the 4th is exact
    assert m.stat("reserved_bytes") == 2 * MiB and m.stat("segment") == 1
    assert m.stat("allocated_bytes") == 2 * MiB and m.stat("inactive_split_bytes") == 0
    m.malloc(100)  # rounds to 512 B: a second small segment
    assert m.stat("reserved_bytes") == 4 * MiB and m.stat("allocated_bytes") == 2 * MiB + 512
    assert m.stat("requested_bytes") == 2 * MiB + 100
    assert m.stat("inactive_split_bytes") == 2 * MiB - 512  # the rest of the second segment, split off
    for b in blocks:
        m.free(b)
    assert m.stat("reserved_bytes") == 4 * MiB  # cached, not released
    m.empty_cache()
    assert m.stat("reserved_bytes") == 2 * MiB  # only the segment with no block in use goes back


def test_large_split_rule_and_whole_block_allocation() -> None:
    m = CachingAllocatorModel(80 * GiB)
    a = m.malloc(3 * MiB)  # 20 MiB segment; 17 MiB remain (> 1 MiB): split
    assert (m.stat("allocated_bytes"), m.stat("reserved_bytes")) == (3 * MiB, 20 * MiB)
    m.free(a)  # merges back into one 20 MiB block
    b = m.malloc(19 * MiB + 600 * KiB)  # the cached 20 MiB block fits; 424 KiB would remain (<= 1 MiB): no split
    assert m.stat("num_device_alloc") == 1 and b.size == 20 * MiB
    assert m.stat("allocated_bytes") == 20 * MiB  # torch counts the whole block as allocated
    assert m.stat("requested_bytes") == 19 * MiB + 600 * KiB
    c = m.malloc(12 * MiB)  # >= 10 MiB: its own 12 MiB segment
    assert m.stat("reserved_bytes") == 32 * MiB and c.size == 12 * MiB


def test_best_fit_reuse_and_a_fragmentation_case() -> None:
    m = CachingAllocatorModel(80 * GiB)
    blocks = [m.malloc(8 * MiB) for _ in range(6)]  # two 8 MiB per 20 MiB segment, a 4 MiB sliver each
    assert m.stat("segment") == 3 and m.stat("reserved_bytes") == 60 * MiB
    assert m.stat("inactive_split_bytes") == 12 * MiB
    assert m.peak_fragmentation == pytest.approx(1 - 48 / 60)
    m.malloc(5 * MiB)  # no 4 MiB sliver fits: a fourth segment although 12 MiB are free
    assert m.stat("segment") == 4
    m.free(blocks[0])
    again = m.malloc(8 * MiB)  # best fit among the free 4, 4, 4, 8 (freed) and 15 MiB blocks: the 8
    assert again.ptr == blocks[0].ptr and m.stat("num_device_alloc") == 4


def test_out_of_memory_message_and_retry_after_releasing_cached_blocks() -> None:
    m = CachingAllocatorModel(40 * MiB)
    m.malloc(15 * MiB)
    second = m.malloc(15 * MiB)  # 16 MiB segments each: 32 MiB reserved
    with pytest.raises(DeviceOutOfMemory) as err:
        m.malloc(15 * MiB)
    assert str(err.value).startswith(
        "CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 40.00 MiB of which "
        "8.00 MiB is free. Of the allocated memory 32.00 MiB is allocated by PyTorch, and 0 bytes is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert m.stat("num_ooms") == 1 and m.stat("num_alloc_retries") == 1
    m.free(second)  # a cached 16 MiB segment
    m.malloc(17 * MiB)  # 18 MiB: 32 + 18 > 40, so the unsplit cached segment is released and the retry fits
    assert m.stat("reserved_bytes") == 34 * MiB and m.stat("num_alloc_retries") == 2
    assert m.stat("num_device_free") == 1


def test_out_of_memory_can_be_reported_instead() -> None:
    m = CachingAllocatorModel(40 * MiB, raise_oom=False)
    for _ in range(3):
        m.malloc(15 * MiB)
    assert m.stat("reserved_bytes") == 48 * MiB
    assert m.ooms == [{"alloc_size": 16 * MiB, "allocated_bytes": 32 * MiB, "reserved_bytes": 32 * MiB}]


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    cfg = AllocatorConfig.parse("max_split_size_mb:32")
    assert cfg.max_split_size_bytes == 32 * MiB
    m = CachingAllocatorModel(80 * GiB, cfg)
    m.free(m.malloc(40 * MiB))  # a cached 40 MiB oversize segment
    m.malloc(10 * MiB)  # below max_split_size: may not take an oversize block -> new 10 MiB segment
    assert m.stat("segment") == 2
    b = m.malloc(38 * MiB)  # >= max_split_size and 40 < 38 + 20: the oversize block, whole
    assert b.size == 40 * MiB and m.stat("segment") == 2 and m.memory_stats()["oversize_allocations"] == 1
    m.free(b)
    m.malloc(15 * MiB)  # 40 >= 32: not for a smaller request below the limit
    assert m.stat("segment") == 3
    with pytest.raises(ConfigError, match="max_split_size_mb must be > 20"):
        AllocatorConfig.parse("max_split_size_mb:20")


def test_release_available_cached_blocks_frees_oversize_blocks_first() -> None:
    m = CachingAllocatorModel(100 * MiB, AllocatorConfig.parse("max_split_size_mb:32"))
    m.free(m.malloc(40 * MiB))
    m.malloc(70 * MiB)  # 40 + 70 > 100: the oversize block is released, then (all cached gone) the retry fits
    assert m.stat("reserved_bytes") == 70 * MiB and m.stat("num_device_free") == 1
    assert m.stat("num_alloc_retries") == 1  # release_available freed 40 < 70 MiB and said no: the full release ran


def test_roundup_power2_divisions_parsing_follows_torch() -> None:
    assert AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    # the first entry fills the intervals below it; ">" fills from the last named one (itself included)
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert cfg.divisions(600 * MiB) == 2 and cfg.divisions(3 * GiB) == 8 and cfg.divisions(100) == 1
    with pytest.raises(ConfigError, match="power of 2"):
        AllocatorConfig.parse("roundup_power2_divisions:3")
    with pytest.raises(ConfigError, match="unrecognized option 'max_split'"):
        AllocatorConfig.parse("max_split:4")


def test_expandable_segments_grow_one_segment_by_pages() -> None:
    m = CachingAllocatorModel(80 * GiB, AllocatorConfig.parse("expandable_segments:True"))
    a = m.malloc(3 * MiB)  # maps one 20 MiB page of the large pool's segment
    assert m.stat("reserved_bytes") == 20 * MiB and m.stat("allocated_bytes") == 3 * MiB
    b = m.malloc(30 * MiB)  # the free 17 MiB plus one more page: 37 MiB, split: 30 used, 7 free
    assert m.stat("reserved_bytes") == 40 * MiB and b.ptr == a.ptr + 3 * MiB
    plain = CachingAllocatorModel(80 * GiB)
    plain.malloc(3 * MiB)
    plain.malloc(30 * MiB)
    assert plain.stat("reserved_bytes") == 50 * MiB  # without: a 20 MiB and a 30 MiB segment
    small = m.malloc(4 * KiB)  # the small pool has its own segment, of 2 MiB pages
    assert m.stat("reserved_bytes") == 42 * MiB and small.size == 4 * KiB
    m.free(a)
    m.free(b)
    m.empty_cache()  # unmaps every free whole page
    assert m.stat("reserved_bytes") == 2 * MiB and m.stat("num_device_free") == 1
    m.free(small)
    m.empty_cache()
    assert m.stat("reserved_bytes") == 0 and m.segments() == []


def test_garbage_collection_releases_old_cached_blocks_before_reserving() -> None:
    cfg = AllocatorConfig.parse("garbage_collection_threshold:0.5", memory_fraction=1.0)
    m = CachingAllocatorModel(100 * MiB, cfg)
    blocks = [m.malloc(20 * MiB) for _ in range(3)]  # three whole 20 MiB segments
    for b in blocks:
        m.free(b)
    m.malloc(30 * MiB)  # 60 MiB reserved > 50 MiB threshold: every block of average age or older goes
    assert m.stat("num_device_free") == 3 and m.stat("reserved_bytes") == 30 * MiB


def test_memory_stats_and_segments_use_torchs_names() -> None:
    m = CachingAllocatorModel(80 * GiB)
    a = m.malloc(1000)
    m.malloc(3 * MiB)
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.current"] == 1024 + 3 * MiB
    assert stats["allocated_bytes.small_pool.current"] == 1024
    assert stats["reserved_bytes.large_pool.peak"] == 20 * MiB and stats["max_split_size"] == -1
    m.free(a)
    assert m.stat("allocated_bytes", "all", "peak") == 1024 + 3 * MiB
    m.reset_peak_stats()
    assert m.stat("allocated_bytes", "all", "peak") == 3 * MiB
    segments = m.segments()
    assert [(s["segment_type"], s["total_size"], s["allocated_size"]) for s in segments] == [
        ("small", 2 * MiB, 0), ("large", 20 * MiB, 3 * MiB)]
    assert [b["state"] for b in segments[1]["blocks"]] == ["active_allocated", "inactive"]
