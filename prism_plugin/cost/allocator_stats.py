"""The statistics of the caching allocator model (`allocator.CachingAllocatorModel`), kept as torch keeps them.

``torch.cuda.memory_stats()`` holds, for each statistic (`STATS`: ``allocation``, ``segment``, ``reserved_bytes``,
...) of each pool (`POOLS`: ``all``, ``small_pool``, ``large_pool``), the ``current`` and ``peak`` values and the
``allocated`` / ``freed`` totals (torch's ``Stat``), and event counters (`COUNTERS`: ``num_ooms``,
``num_device_alloc``, ...). `AllocatorStats` keeps the same numbers under the same names; the model updates them
where torch's ``DeviceCachingAllocator`` does. Pure: no torch.
"""

from __future__ import annotations

__all__ = ["COUNTERS", "POOLS", "STATS", "AllocatorStats", "Stat"]

POOLS = ("all", "small_pool", "large_pool")
STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
         "inactive_split_bytes", "requested_bytes")
COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "oversize_allocations",
            "oversize_segments")
_METRICS = ("current", "peak", "allocated", "freed")


class Stat:
    """One statistic of one pool: its current value, its peak, and the totals added and taken away."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, amount: int) -> None:
        if amount >= 0:
            self.current += amount
            self.peak = max(self.peak, self.current)
            self.allocated += amount
        else:
            self.current += amount
            assert self.current >= 0, "negative allocator statistic"
            self.freed -= amount


class AllocatorStats:
    """Every statistic of every pool (`by_pool`) and the counters (`counters`) of one device's allocator."""

    __slots__ = ("by_pool", "counters", "_pair")

    def __init__(self) -> None:
        self.by_pool = {(s, p): Stat() for s in STATS for p in POOLS}
        self._pair = {(s, small): (self.by_pool[(s, "all")], self.by_pool[(s, "small_pool" if small else "large_pool")])
                      for s in STATS for small in (True, False)}
        """(statistic, small pool?) -> its "all" and its pool's `Stat`: `add`'s two updates, looked up once."""
        self.counters = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, small: bool, amount: int) -> None:
        """Add `amount` (< 0: take away) to statistic `name` of pool "all" and of the small or the large pool."""
        both, pool = self._pair[(name, small)]
        both.add(amount)
        pool.add(amount)

    def get(self, name: str, pool: str = "all", metric: str = "current") -> int:
        """One statistic, e.g. ``get("reserved_bytes", "all", "peak")``, or a counter (``get("num_ooms")``)."""
        if name in self.counters:
            return self.counters[name]
        return getattr(self.by_pool[(name, pool)], metric)

    def memory_stats(self, max_split_size: int) -> dict[str, int]:
        """The flat dictionary ``torch.cuda.memory_stats()`` returns, sorted by key, with `max_split_size` (torch's
        -1: no limit)."""
        out = {f"{s}.{p}.{m}": getattr(st, m) for (s, p), st in self.by_pool.items() for m in _METRICS}
        out.update(self.counters)
        out["max_split_size"] = max_split_size
        return dict(sorted(out.items()))

    def totals(self) -> dict[str, int]:
        """The running totals (each statistic's ``allocated`` / ``freed``, and the counters), by `memory_stats`
        key: what work that leaves the blocks as it found them still changes."""
        out = {f"{s}.{p}.{m}": getattr(st, m) for (s, p), st in self.by_pool.items() for m in ("allocated", "freed")}
        out.update(self.counters)
        return out

    def levels(self) -> tuple[int, ...]:
        """Every statistic's ``current`` value: equal before and after repeated work that holds nothing new."""
        return tuple(st.current for st in self.by_pool.values())

    def reset_peaks(self) -> None:
        """Every peak becomes its current value (``torch.cuda.reset_peak_memory_stats``)."""
        for st in self.by_pool.values():
            st.peak = st.current
