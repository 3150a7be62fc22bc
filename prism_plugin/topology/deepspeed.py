"""DeepSpeed's `ProcessTopology` in closed form, as a pure value object (`DeepSpeedTopology`).

Row-major named axes, the last axis fastest (checked against DeepSpeed 0.19.8). Non-goals: nothing here
creates a process group or imports torch or DeepSpeed.
"""

from __future__ import annotations

import keyword
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from prism_plugin.config.errors import positive_int as _check_positive
from prism_plugin.config.errors import rank_in_range as _check_rank
from prism_plugin.topology.grid import mixed_radix_offsets as _mixed_radix_offsets


@cache
def _coord_type(axes: tuple[str, ...]) -> Callable[..., tuple[int, ...]]:
    """DeepSpeed's `ProcessCoord` namedtuple for these axes (supports `._replace` and `._asdict`)."""
    return namedtuple("ProcessCoord", axes)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedTopology:
    """DeepSpeed's `ProcessTopology`: named axes laid out row-major, the LAST axis varying fastest.

    Same methods and results as `deepspeed.runtime.pipe.topology.ProcessTopology`, computed in closed form
    instead of by enumerating every coordinate (DeepSpeed's `get_coord` is O(N) per call). Differences:
    bad axis names, coordinates and ranks raise `ValueError` (DeepSpeed asserts, raises AttributeError or
    returns []); only `get_axis_comm_lists` and `get_dim` keep DeepSpeed's lenient answer ([] and 0) for
    an axis the topology lacks, since DeepSpeed's `PipelineParallelGrid` relies on it.

    Example: axes=("pipe", "data", "model"), dims=(2, 2, 2) puts rank = pipe*4 + data*2 + model.

    >>> topo = DeepSpeedTopology.pipe_model_data(2, 2, 2)
    >>> topo.world_size(), topo.get_rank(pipe=1, data=0, model=1)
    (8, 5)
    >>> topo.get_coord(5)
    ProcessCoord(pipe=1, data=0, model=1)
    >>> topo.get_axis_comm_lists("pipe")
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> topo.get_axis_comm_lists("data")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """

    axes: tuple[str, ...]
    """Axis names, slowest-varying first."""
    dims: tuple[int, ...]
    """Size of each axis."""
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "dims", tuple(self.dims))
        if not self.axes or len(self.axes) != len(self.dims):
            raise ValueError(
                f"axes={self.axes} and dims={self.dims} must be non-empty and of equal length: "
                f"give one dim per axis"
            )
        for axis in self.axes:
            if not (isinstance(axis, str) and axis.isidentifier() and axis[0] != "_") or keyword.iskeyword(
                axis
            ):
                raise ValueError(
                    f"axes has invalid name {axis!r}: use identifiers not starting with '_', e.g. 'pipe'"
                )
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"axes={self.axes} repeats a name: name each axis once")
        for axis, dim in zip(self.axes, self.dims, strict=True):
            _check_positive(f"dims[{axis!r}]", dim)
        strides, stride = [], 1
        for dim in reversed(self.dims):
            strides.append(stride)
            stride *= dim
        object.__setattr__(self, "_strides", tuple(reversed(strides)))

    @classmethod
    def pipe_data(cls, pp: int, dp: int) -> DeepSpeedTopology:
        """DeepSpeed's `PipeDataParallelTopology(num_pp, num_dp)`: axes ("pipe", "data")."""
        return cls(axes=("pipe", "data"), dims=(pp, dp))

    @classmethod
    def pipe_model_data(cls, pp: int, tp: int, dp: int) -> DeepSpeedTopology:
        """DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`.

        Despite the name, the axes are ("pipe", "data", "model"): model (tensor) parallel is fastest.
        """
        return cls(axes=("pipe", "data", "model"), dims=(pp, dp, tp))

    def world_size(self) -> int:
        """Number of ranks: the product of `dims` (a method, as in DeepSpeed)."""
        return self._strides[0] * self.dims[0]

    def get_axis_names(self) -> list[str]:
        """The axis names, slowest first."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of `axis`; 0 when the topology has no such axis (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def _axis_index(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"axis={axis!r} is not in this topology: use one of {list(self.axes)}")
        return self.axes.index(axis)

    def _check_coord(self, axis: str, value: object) -> int:
        dim = self.dims[self._axis_index(axis)]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < dim:
            raise ValueError(f"{axis}={value!r} is out of range: pass 0 <= {axis} < {dim}")
        return value

    def get_rank(self, **coords: int) -> int:
        """The rank at a full coordinate, e.g. `get_rank(pipe=1, data=0)`; use `filter_match` for slices."""
        if set(coords) != set(self.axes):
            raise ValueError(
                f"get_rank() got axes {sorted(coords)}: pass every axis of {list(self.axes)} "
                f"(use filter_match() for slices)"
            )
        return sum(self._check_coord(a, coords[a]) * s for a, s in zip(self.axes, self._strides, strict=True))

    def get_coord(self, rank: int) -> tuple[int, ...]:
        """The coordinate of `rank` as DeepSpeed's `ProcessCoord` namedtuple.

        >>> DeepSpeedTopology.pipe_data(2, 3).get_coord(4)
        ProcessCoord(pipe=1, data=1)
        """
        _check_rank(rank, self.world_size())
        values = ((rank // s) % d for s, d in zip(self._strides, self.dims, strict=True))
        return _coord_type(self.axes)(*values)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: tuple[str, ...] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """DeepSpeed's checkpoint-name form of a rank's coordinate, e.g. 'model_01'."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{value:02d}"
            for axis, value in zip(self.axes, coord, strict=True)
            if axis not in omit_axes
        )

    def _offsets(self, keep: Callable[[int], bool]) -> list[int]:
        """Ascending offsets over the axes for which `keep(index)` holds."""
        n = len(self.axes)
        return _mixed_radix_offsets((self.dims[i], self._strides[i]) for i in reversed(range(n)) if keep(i))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Groups of ranks that differ only along `axis`; [] when the topology has no such axis.

        >>> DeepSpeedTopology.pipe_data(2, 3).get_axis_comm_lists("data")
        [[0, 1, 2], [3, 4, 5]]
        """
        if axis not in self.axes:
            return []
        a = self.axes.index(axis)
        members = self._offsets(lambda i: i == a)
        return [[base + m for m in members] for base in self._offsets(lambda i: i != a)]

    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        """The group of `get_axis_comm_lists(axis)` that holds `rank`, in O(group size).

        >>> DeepSpeedTopology.pipe_data(2, 3).group_of(4, "pipe")
        (1, 4)
        """
        _check_rank(rank, self.world_size())
        a = self._axis_index(axis)
        stride = self._strides[a]
        base = rank - (rank // stride) % self.dims[a] * stride
        return tuple(range(base, base + self.dims[a] * stride, stride))

    def filter_match(self, **filters: int) -> list[int]:
        """Ranks (ascending) whose coordinate matches every `axis=value` filter.

        >>> DeepSpeedTopology(axes=("pipe", "data", "model"), dims=(2, 2, 2)).filter_match(pipe=0, data=1)
        [2, 3]
        """
        fixed = {self._axis_index(axis): self._check_coord(axis, value) for axis, value in filters.items()}
        base = sum(value * self._strides[i] for i, value in fixed.items())
        return [base + offset for offset in self._offsets(lambda i: i not in fixed)]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks (ascending) whose coordinate on `axis` is `idx`.

        >>> DeepSpeedTopology(axes=("x", "y"), dims=(2, 3)).get_axis_list("y", 0)
        [0, 3]
        """
        return self.filter_match(**{axis: idx})
