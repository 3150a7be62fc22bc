"""A model of PyTorch's CUDA caching allocator: reserved bytes, fragmentation and OOM of a virtual GPU.

Follows ``c10/cuda/CUDACachingAllocator.cpp`` (DeviceCachingAllocator, torch 2.x) decision for decision,
on integer sizes and made-up device addresses (nothing is allocated):

- sizes round up to 512 B (`round_size`), or to the next power-of-2 division with
  ``roundup_power2_divisions``; requests <= 1 MiB use the small pool, larger ones the large pool;
- a request is served by the smallest cached free block of its pool and stream that fits (best fit,
  ties by address); blocks >= ``max_split_size`` serve only requests within 20 MiB of their size;
- otherwise a new segment is reserved (``cudaMalloc``): 2 MiB for small requests, 20 MiB for requests
  below 10 MiB, else the size rounded up to 2 MiB; when the device is full the allocator frees cached
  oversize blocks (only with ``max_split_size``), then every unsplit cached block, retries once, and
  raises `DeviceOutOfMemory` with torch's message;
- a block is split when the rest is >= 512 B (small pool, or expandable segments) or > 1 MiB (large
  pool, request below ``max_split_size``); a freed block merges with free neighbours of its segment and
  stays cached until `empty_cache` releases every segment with no block in use;
- ``garbage_collection_threshold`` (with a memory fraction) releases the oldest unsplit cached large
  blocks before reserving more; ``expandable_segments`` grows one segment per (stream, pool) by 2 MiB
  (small) or 20 MiB (large) pages and unmaps free pages at `empty_cache`.

Statistics carry torch's names (``allocated_bytes.all.current``, ``reserved_bytes.all.peak``, ...; kept by
`allocator_stats.AllocatorStats`).
Non-goals: CUDA graph private pools, ``recordStream`` events (a freed block is reusable at once), IPC,
``release_lock_on_cudamalloc``, and memory outside the allocator (context, cuBLAS workspaces, NCCL
buffers: the device total adds those separately). Pure: no torch. With `history` set
(`allocator_history.AllocatorHistory`) each action is also recorded as torch's ``_record_memory_history`` does.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

from prism_plugin.cost.allocator_config import (
    LARGE_BUFFER,
    MIN_BLOCK,
    NO_LIMIT,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
    allocation_size,
    format_size,
    round_size,
)
from prism_plugin.cost.allocator_stats import AllocatorStats

__all__ = ["AllocatorConfig", "Block", "CachingAllocatorModel", "DeviceOutOfMemory"]


class DeviceOutOfMemory(MemoryError):
    """A request the modelled device cannot hold; the message is torch's ``OutOfMemoryError`` text."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


@dataclass(eq=False, slots=True)
class Block:
    """One block of a segment: in use (`allocated`) or cached; `prev`/`next` link its segment's blocks."""

    stream: int
    size: int
    ptr: int
    small: bool
    allocated: bool = False
    requested: int = 0
    mapped: bool = True
    expandable: bool = False
    base: int = 0
    """Address of the segment this block belongs to (expandable pages count from it)."""
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    gc_base: int = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Cached free blocks of one pool, sorted by (stream, size, address); unmapped ranges by address."""

    __slots__ = ("small", "blocks", "keys", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks: list[Block] = []
        self.keys: list[tuple[int, int, int]] = []
        self.unmapped: dict[int, Block] = {}  # ptr -> unmapped block of an expandable segment
        self.gc_calls = 0

    def insert(self, block: Block) -> None:
        block.gc_base = self.gc_calls
        key = (block.stream, block.size, block.ptr)
        i = bisect.bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self.keys, (block.stream, block.size, block.ptr))
        assert self.blocks[i] is block, "cached block missing from its pool"
        del self.keys[i], self.blocks[i]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect.bisect_left(self.keys, (stream, size, -1))


class CachingAllocatorModel:
    """One device's caching allocator, driven by `malloc` / `free` / `empty_cache` calls.

    `device_total_bytes` is the GPU's memory; `other_bytes` what the allocator cannot have (CUDA context,
    cuBLAS workspaces, NCCL buffers). A request that does not fit raises `DeviceOutOfMemory`, or with
    ``raise_oom=False`` is counted (`ooms`) and served beyond the device, so a run reports every OOM.

    >>> m = CachingAllocatorModel(80 << 30)
    >>> a = m.malloc(1000); b = m.malloc(3 << 20)  # 1 KiB block of a 2 MiB segment; 3 MiB of a 20 MiB one
    >>> m.stat("allocated_bytes"), m.stat("reserved_bytes")
    (3146752, 23068672)
    >>> m.free(b); m.empty_cache(); m.stat("reserved_bytes")  # the large segment is whole again: released
    2097152
    """

    def __init__(self, device_total_bytes: int, config: AllocatorConfig | None = None, *, other_bytes: int = 0,
                 device: int = 0, raise_oom: bool = True) -> None:
        self.config = config or AllocatorConfig()
        self.device = device
        self.device_total = device_total_bytes
        self.capacity = device_total_bytes - other_bytes
        self.allowed = None if self.config.memory_fraction is None else int(
            self.config.memory_fraction * device_total_bytes)
        self.raise_oom = raise_oom
        self.small, self.large = _Pool(True), _Pool(False)
        self.reserved = 0  # total_allocated_memory: bytes of all segments (mapped pages)
        self.active: dict[int, Block] = {}
        self.ooms: list[dict[str, int]] = []
        self.peak_fragmentation = 0.0  # 1 - allocated / reserved when allocated bytes last reached their peak
        self._stats = AllocatorStats()
        self._next_ptr = 0x7F0000000000
        self._gc = self.allowed is not None and self.config.garbage_collection_threshold > 0
        self.history: Any = None  # an allocator_history.AllocatorHistory (which imports this module) when recording

    # -- statistics -----------------------------------------------------------------------------------
    def stat(self, name: str, pool: str = "all", metric: str = "current") -> int:
        """One statistic, e.g. ``stat("reserved_bytes", "all", "peak")``, or a counter (``stat("num_ooms")``)."""
        return self._stats.get(name, pool, metric)

    def memory_stats(self) -> dict[str, int]:
        """The flat dictionary `torch.cuda.memory_stats()` returns (the keys this model keeps)."""
        limit = self.config.max_split_size_bytes
        return self._stats.memory_stats(-1 if limit == NO_LIMIT else limit)

    def reset_peak_stats(self) -> None:
        self._stats.reset_peaks()

    # -- repeated work (`prism_plugin.device.fast_forward`) ---------------------------------------------
    def layout(self) -> tuple[Any, ...]:
        """Everything the model's next decisions depend on: each block (address, size, stream, in use,
        requested, segment), the statistics' current values, the OOMs so far and the next segment's address.
        Two points with equal layouts and equal requests after them get equal answers."""
        blocks = sorted((b.ptr, b.size, b.stream, b.allocated, b.requested, b.mapped, b.small, b.expandable, b.base)
                        for b in itertools.chain(self.active.values(), self.small.blocks, self.large.blocks,
                                                 self.small.unmapped.values(), self.large.unmapped.values()))
        return (tuple(blocks), self._stats.levels(), self.reserved, len(self.ooms), self._next_ptr)

    def totals(self) -> dict[str, int]:
        """The running totals of the statistics (`allocator_stats.AllocatorStats.totals`)."""
        return self._stats.totals()

    # -- the public calls -----------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> Block:
        """The block a request of `size` bytes (> 0) on `stream` gets (torch's ``DeviceCachingAllocator::malloc``)."""
        assert size > 0, "a zero-byte request allocates nothing in torch; do not call malloc"
        cfg = self.config
        rounded = round_size(size, cfg)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        alloc = allocation_size(rounded)
        block = self._get_free_block(pool, stream, rounded)
        if block is None:
            if self._gc:
                self._garbage_collect()
            block = (self._alloc_block(pool, stream, rounded, alloc, retry=False)
                     or (self._release_available(pool, stream, rounded)
                         and self._alloc_block(pool, stream, rounded, alloc, retry=False))
                     or (self._release_cached()
                         and self._alloc_block(pool, stream, rounded, alloc, retry=True))
                     or self._out_of_memory(pool, stream, alloc, rounded))
        block = self._alloc_found(block, pool, stream, rounded, size, self._should_split(block, rounded))
        if self.history is not None:
            self.history.on_alloc(block, size)
        return block

    def free(self, block: Block) -> None:
        """Return `block` to its pool (torch's ``free``: no stream uses, so at once)."""
        assert block.allocated and self.active.get(block.ptr) is block, "free of a block not in use"
        block.allocated = False
        self._stats.add("allocation", block.small, -1)
        self._stats.add("allocated_bytes", block.small, -block.size)
        if block.size >= self.config.max_split_size_bytes:
            self._stats.counters["oversize_allocations"] -= 1
        if self.history is not None:
            self.history.on_free(block)
        self._free_block(block)

    def empty_cache(self) -> None:
        """Release every cached segment with no block in use (``torch.cuda.empty_cache``)."""
        self._release_cached()

    # -- torch's private steps ------------------------------------------------------------------------
    def _pool_of(self, block: Block) -> _Pool:
        return self.small if block.small else self.large

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        if self._gc:
            pool.gc_calls += 1
        blocks = pool.blocks
        i = pool.lower_bound(stream, size)
        if i == len(blocks) or blocks[i].stream != stream:
            return None
        if blocks[i].expandable:
            if self.config.expandable_segments:
                def grow(b: Block) -> int:
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
                j = i + 1
                while blocks[i].expandable and j < len(blocks) and blocks[j].stream == stream \
                        and grow(blocks[j]) < grow(blocks[i]):
                    i, j = j, j + 1
            else:
                i += 1
                while i < len(blocks) and blocks[i].expandable and blocks[i].stream == stream:
                    i += 1
                if i == len(blocks) or blocks[i].stream != stream:
                    return None
        block, limit = blocks[i], self.config.max_split_size_bytes
        if size < limit <= block.size:
            return None  # an oversize block is not split for a smaller request
        if size >= limit and block.size >= size + LARGE_BUFFER:
            return None  # an oversize block serves requests within 20 MiB of its size
        del pool.keys[i], blocks[i]
        return block

    def _new_segment(
        self, size: int, stream: int, small: bool, *, mapped: bool = True, expandable: bool = False
    ) -> Block:
        ptr = self._next_ptr
        self._next_ptr += ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)
        return Block(stream, size, ptr, small, mapped=mapped, expandable=expandable, base=ptr)

    def _alloc_block(self, pool: _Pool, stream: int, rounded: int, alloc: int, *, retry: bool) -> Block | None:
        if retry:
            self._stats.counters["num_alloc_retries"] += 1
        if self.allowed is not None and self.reserved + alloc > self.allowed:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable(pool, stream, rounded)
        if self.reserved + alloc > self.capacity:
            return None  # cudaMalloc fails
        return self._reserve(self._new_segment(alloc, stream, pool.small))

    def _reserve(self, block: Block) -> Block:
        self.reserved += block.size
        self._stats.add("segment", block.small, 1)
        self._stats.add("reserved_bytes", block.small, block.size)
        if block.size >= self.config.max_split_size_bytes:
            self._stats.counters["oversize_segments"] += 1
        self._stats.counters["num_device_alloc"] += 1
        if self.history is not None:
            self.history.on_segment_alloc(block)
        return block

    def _out_of_memory(self, pool: _Pool, stream: int, alloc: int, rounded: int = 0) -> Block:
        self._stats.counters["num_ooms"] += 1
        if self.history is not None:
            self.history.on_oom(rounded or alloc, stream, max(0, self.capacity - self.reserved))
        allocated, reserved = self.stat("allocated_bytes"), self.stat("reserved_bytes")
        self.ooms.append({"alloc_size": alloc, "allocated_bytes": allocated, "reserved_bytes": reserved})
        if self.raise_oom:
            free = max(0, self.capacity - self.reserved)
            allowed = f"{format_size(self.allowed)} allowed; " if self.allowed is not None else ""
            raise DeviceOutOfMemory(
                f"CUDA out of memory. Tried to allocate {format_size(alloc)}. GPU {self.device} has a total capacity "
                f"of {format_size(self.device_total)} of which {format_size(free)} is free. {allowed}Of the allocated "
                f"memory {format_size(allocated)} is allocated by PyTorch, and {format_size(reserved - allocated)} is "
                "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
                "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)", alloc)
        if self.config.expandable_segments:  # served past the device: map the pages regardless
            capacity, self.capacity = self.capacity, 1 << 62
            try:
                block = self._try_allocate_expandable(pool, stream, alloc)
            finally:
                self.capacity = capacity
            assert block is not None
            return block
        return self._reserve(self._new_segment(alloc, stream, pool.small))

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.max_split_size_bytes and remaining > SMALL_SIZE

    def _alloc_found(self, block: Block, pool: _Pool, stream: int, size: int, orig: int, split: bool) -> Block:
        already_split = block.is_split()
        if split:
            remaining = block
            block = Block(stream, size, remaining.ptr, pool.small, expandable=remaining.expandable, base=remaining.base)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.insert(remaining)
            if not block.expandable:
                if already_split:
                    self._stats.add("inactive_split_bytes", pool.small, -block.size)
                else:
                    self._stats.add("inactive_split_bytes", pool.small, remaining.size)
                    self._stats.add("inactive_split", pool.small, 1)
        elif already_split and not block.expandable:
            self._stats.add("inactive_split_bytes", pool.small, -block.size)
            self._stats.add("inactive_split", pool.small, -1)
        block.allocated = True
        block.requested = orig
        self.active[block.ptr] = block
        for name, amount in (("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                             ("active_bytes", block.size), ("requested_bytes", orig)):
            self._stats.add(name, pool.small, amount)
        if block.size >= self.config.max_split_size_bytes:
            self._stats.counters["oversize_allocations"] += 1
        stat = self._stats.by_pool[("allocated_bytes", "all")]
        if stat.current == stat.peak:
            self.peak_fragmentation = 1.0 - stat.current / self.reserved if self.reserved else 0.0
        return block

    def _free_block(self, block: Block) -> None:
        pool = self._pool_of(block)
        del self.active[block.ptr]
        size, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        if not block.expandable:
            if net_blocks:
                self._stats.add("inactive_split", pool.small, net_blocks)
            if net_bytes:
                self._stats.add("inactive_split_bytes", pool.small, net_bytes)
        self._stats.add("active", pool.small, -1)
        self._stats.add("active_bytes", pool.small, -size)
        self._stats.add("requested_bytes", pool.small, -requested)

    def _try_merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.ptr]
        return src.size

    def _release_block(self, block: Block) -> None:
        assert not block.expandable
        pool = self._pool_of(block)
        self._stats.counters["num_device_free"] += 1
        self.reserved -= block.size
        self._stats.add("segment", block.small, -1)
        self._stats.add("reserved_bytes", block.small, -block.size)
        if block.size >= self.config.max_split_size_bytes:
            self._stats.counters["oversize_segments"] -= 1
        if self.history is not None:
            self.history.on_segment_free(block)
        pool.remove(block)

    def _release_available(self, pool: _Pool, stream: int, size: int) -> bool:
        limit = self.config.max_split_size_bytes
        if limit == NO_LIMIT:
            return False
        key = max(size, limit)
        blocks = pool.blocks
        i = pool.lower_bound(stream, key)
        if i < len(blocks) and blocks[i].stream == stream:
            self._release_block(blocks[i])
            return True
        if i == 0:
            return False
        released, i = 0, i - 1
        while released < key and blocks[i].size >= limit and blocks[i].stream == stream:
            current = blocks[i]
            released += current.size
            self._release_block(current)
            if i == 0:
                break
            i -= 1
        return released >= key

    def _release_cached(self) -> bool:
        for pool in (self.large, self.small):
            to_unmap = []
            for block in list(pool.blocks):
                if block.expandable:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if not block.is_split():
                    del pool.unmapped[block.ptr]  # release_expandable_segment
        return True

    def _garbage_collect(self) -> None:
        assert self.allowed is not None
        threshold = int(self.config.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed, pool = self.reserved - threshold, 0, self.large
        freeable = [b for b in pool.blocks if not b.is_split() and not b.expandable]
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in list(pool.blocks):
                age = pool.gc_calls - block.gc_base
                if not block.is_split() and not block.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments ----------------------------------------------------------------------------
    def _page(self, pool: _Pool) -> int:
        return SMALL_BUFFER if pool.small else LARGE_BUFFER

    def _find_expandable(self, pool: _Pool, stream: int, size: int) -> Block:
        def free(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def room(b: Block | None) -> bool:
            total = 0
            while total < size and free(b):
                assert b is not None
                total += b.size
                b = b.next
            return total >= size

        for ptr in sorted(p for p, b in pool.unmapped.items() if b.stream == stream):
            candidate = pool.unmapped[ptr]
            if candidate.prev is not None and free(candidate.prev):
                candidate = candidate.prev
            if room(candidate):
                return candidate
        page = self._page(pool)
        space = self.device_total + self.device_total // 8  # 1 1/8 of the GPU's memory of address space
        block = self._new_segment(page * ((space + page - 1) // page), stream, pool.small, mapped=False,
                                  expandable=True)
        pool.unmapped[block.ptr] = block
        return block

    def _map_block(self, block: Block, size: int, pool: _Pool) -> bool:
        page = self._page(pool)
        mapped = page * ((block.ptr + size - block.base + page - 1) // page) - (block.ptr - block.base)
        if self.reserved + mapped > self.capacity:
            return False  # the physical pages cannot be created
        del pool.unmapped[block.ptr]
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.stream, block.size - mapped, block.ptr + mapped, block.small, mapped=False,
                         expandable=True, base=block.base, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.unmapped[rest.ptr] = rest
            block.size = mapped
        if self.history is not None:
            self.history.on_segment_map(block, mapped)
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self.reserved += mapped
        self._stats.add("reserved_bytes", pool.small, mapped)
        self._stats.counters["num_device_alloc"] += 1
        return True

    def _try_allocate_expandable(self, pool: _Pool, stream: int, size: int) -> Block | None:
        candidate = self._find_expandable(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following  # it absorbed the free block before it
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: Block, pool: _Pool) -> None:
        page = self._page(pool)
        begin = block.base + page * ((block.ptr - block.base + page - 1) // page)
        end = block.base + page * ((block.ptr + block.size - block.base) // page)
        if end <= begin:
            return
        pool.remove(block)
        before = begin - block.ptr
        if before > 0:
            head = Block(block.stream, before, block.ptr, block.small, expandable=True, base=block.base,
                         prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pool.insert(head)
        after = block.size - before - (end - begin)
        if after > 0:
            tail = Block(block.stream, after, end, block.small, expandable=True, base=block.base, prev=block,
                         next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.ptr, block.size, block.mapped = begin, end - begin, False
        if self.history is not None:
            self.history.on_segment_unmap(begin, end - begin, block.stream)
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.unmapped[block.ptr] = block
        self.reserved -= end - begin
        self._stats.add("reserved_bytes", pool.small, -(end - begin))
        self._stats.counters["num_device_free"] += 1

    # -- snapshots --------------------------------------------------------------------------------------
    def segments(self) -> list[dict[str, Any]]:
        """The allocator's segments as `torch.cuda.memory_snapshot()` lists them (mapped blocks only)."""
        heads: dict[int, Block] = {}
        for block in itertools.chain(self.active.values(), self.small.blocks, self.large.blocks):
            first = block
            while first.prev is not None and first.prev.mapped:
                first = first.prev
            heads[first.ptr] = first
        out: list[dict[str, Any]] = []
        for ptr in sorted(heads):
            blocks: list[dict[str, Any]] = []
            total = used = 0
            b: Block | None = heads[ptr]
            while b is not None and b.mapped:
                blocks.append({"address": b.ptr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
                               "state": "active_allocated" if b.allocated else "inactive"})
                total += b.size
                if b.allocated:  # "state" == "active_allocated"
                    used += b.size
                b = b.next
            out.append({"device": self.device, "address": ptr, "total_size": total, "allocated_size": used,
                        "active_size": used, "stream": heads[ptr].stream,
                        "segment_type": "small" if heads[ptr].small else "large",
                        "is_expandable": heads[ptr].expandable, "blocks": blocks})
        return out
