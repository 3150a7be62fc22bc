"""The caching allocator's sizes and options: rounding, segment sizes, ``PYTORCH_CUDA_ALLOC_CONF``.

The constants and rules of ``c10/cuda/CUDACachingAllocator.cpp`` and ``CUDAAllocatorConfig`` (torch 2.x) that
decide what size a request takes and what segment it reserves; `prism_plugin.cost.allocator` uses them.
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict

from prism_plugin.config.errors import ConfigError

__all__ = ["AllocatorConfig", "LARGE_BUFFER", "MIN_BLOCK", "NO_LIMIT", "ROUND_LARGE", "SMALL_BUFFER", "SMALL_SIZE",
           "allocation_size", "format_size", "round_size"]

MIN_BLOCK = 512
"""All sizes are rounded to at least 512 bytes (kMinBlockSize)."""
SMALL_SIZE = 1 << 20
"""The largest small-pool request, 1 MiB (kSmallSize)."""
SMALL_BUFFER = 2 << 20
"""Small requests are packed into 2 MiB segments (kSmallBuffer)."""
LARGE_BUFFER = 20 << 20
"""Requests of 1-10 MiB get a 20 MiB segment (kLargeBuffer); also the large pool's expandable page."""
MIN_LARGE_ALLOC = 10 << 20
"""Requests of at least 10 MiB get a segment of their own size (kMinLargeAlloc)..."""
ROUND_LARGE = 2 << 20
"""... rounded up to 2 MiB (kRoundLarge)."""
_POW2_INTERVALS = 16  # roundup_power2_divisions intervals: [1 MiB, 2 MiB), ..., [32 GiB, 64 GiB) and above
NO_LIMIT = (1 << 64) - 1  # SIZE_MAX: max_split_size when unset


def format_size(size: int) -> str:
    """torch's ``format_size``: ``"20.00 MiB"``, ``"512 bytes"``."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the model honours (`parse` reads the variable's text)."""

    max_split_size_bytes: int = NO_LIMIT
    """Blocks of this size or more are never split (``max_split_size_mb``; default: no limit)."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * _POW2_INTERVALS
    """Divisions per power-of-2 interval from 1 MiB up (0 or 1: plain 512 B rounding)."""
    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory above which cached blocks are reclaimed (needs a memory fraction)."""
    expandable_segments: bool = False
    memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction``: the share of the device the allocator may reserve."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes != NO_LIMIT and self.max_split_size_bytes <= LARGE_BUFFER:
            raise ConfigError(f"max_split_size_mb must be > {LARGE_BUFFER >> 20} (PYTORCH_CUDA_ALLOC_CONF)")
        if len(self.roundup_power2_divisions) != _POW2_INTERVALS or any(
                d < 0 or (d > 1 and d & (d - 1)) for d in self.roundup_power2_divisions):
            raise ConfigError("roundup_power2_divisions: each division count must be a power of 2, e.g. 4")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ConfigError("garbage_collection_threshold must be in (0.0, 1.0) (PYTORCH_CUDA_ALLOC_CONF)")
        if self.memory_fraction is not None and not 0.0 <= self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction={self.memory_fraction!r} must be within [0, 1]")

    @classmethod
    def parse(cls, text: str | None, *, memory_fraction: float | None = None) -> AllocatorConfig:
        """``"expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"``.

        Options the model does not change anything for (``backend``, ``release_lock_on_cudamalloc``,
        ``pinned_*``) are accepted; an unknown option is an error, as in torch.
        """
        kwargs: _Options = {"memory_fraction": memory_fraction}
        for key, value in _options(text or ""):
            if key == "max_split_size_mb":
                kwargs["max_split_size_bytes"] = int(value) << 20
            elif key == "roundup_power2_divisions":
                kwargs["roundup_power2_divisions"] = _divisions(value)
            elif key == "garbage_collection_threshold":
                kwargs["garbage_collection_threshold"] = float(value)
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ConfigError("expandable_segments must be True or False (PYTORCH_CUDA_ALLOC_CONF)")
                kwargs["expandable_segments"] = value == "True"
            elif key not in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                             "pinned_num_register_threads", "pinned_use_background_threads"):
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: unrecognized option {key!r}")
        return cls(**kwargs)

    def divisions(self, size: int) -> int:
        """The roundup_power2_divisions entry for `size` (intervals start at 1 MiB)."""
        index = max(0, size.bit_length() - 1 - 20)
        return self.roundup_power2_divisions[min(index, _POW2_INTERVALS - 1)]


def _options(text: str) -> Iterator[tuple[str, str]]:
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                key, sep, value = item.partition(":")
                if not sep:
                    raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {item!r} is not key:value")
                yield key.strip(), value.strip()


class _Options(TypedDict, total=False):
    """`AllocatorConfig`'s fields that `AllocatorConfig.parse` sets."""

    max_split_size_bytes: int
    roundup_power2_divisions: tuple[int, ...]
    garbage_collection_threshold: float
    expandable_segments: bool
    memory_fraction: float | None


def _divisions(value: str) -> tuple[int, ...]:
    """torch's ``parseRoundUpPower2Divisions``, quirks included: the first ``MB:count`` entry also fills every
    interval below it, ``>:count`` fills from the last named interval (itself included) to the end."""
    def count(text: str) -> int:
        n = int(text)
        if n < 1 or n & (n - 1):
            raise ConfigError(f"roundup_power2_divisions: {n} divisions is not a power of 2")
        return n

    if not value.startswith("["):
        return (count(value),) * _POW2_INTERVALS
    out = [0] * _POW2_INTERVALS
    last = 0
    for item in value.strip("[]").split(","):
        key, _, text = item.partition(":")
        n = count(text)
        if key.strip() == ">":
            out[last:] = [n] * (_POW2_INTERVALS - last)
            continue
        size_mb = int(key)
        if size_mb < 1 or size_mb & (size_mb - 1):
            raise ConfigError(f"roundup_power2_divisions: {size_mb} MB is not a power of 2")
        index = min(size_mb.bit_length() - 1, _POW2_INTERVALS - 1)
        if last == 0:
            out[:index] = [n] * index
        out[index] = n
        last = index
    return tuple(out)


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """The block size a request of `size` bytes takes (torch's ``round_size``).

    >>> round_size(1), round_size(513), round_size(1200 << 20, AllocatorConfig(roundup_power2_divisions=(4,) * 16))
    (512, 1024, 1342177280)
    """
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.divisions(size) if config is not None else 0
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment a new request of rounded `size` reserves (torch's ``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)
