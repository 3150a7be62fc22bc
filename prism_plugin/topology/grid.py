"""Rank arithmetic shared by the layouts: mixed-radix offsets."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["mixed_radix_offsets"]


def mixed_radix_offsets(sizes_strides: Iterable[tuple[int, int]]) -> list[int]:
    """All sums `sum(i_k * stride_k)` with `0 <= i_k < size_k`, the first pair varying fastest.

    >>> mixed_radix_offsets([(2, 1), (3, 4)])
    [0, 1, 4, 5, 8, 9]
    """
    offsets = [0]
    for size, stride in sizes_strides:
        offsets = [offset + i * stride for i in range(size) for offset in offsets]
    return offsets
