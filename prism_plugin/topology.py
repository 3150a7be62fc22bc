"""Parallel layouts as pure value objects: which global ranks form which process group.

Three frozen value objects, each computing groups by integer index arithmetic:

- `MegatronLayout`: Megatron-core's dense ("decoder") and expert rank grids, giving exactly the groups
  `megatron.core.parallel_state.RankGenerator.get_ranks(token)` gives (checked against 0.19.2).
- `DeepSpeedTopology`: DeepSpeed's `ProcessTopology` (row-major named axes, checked against 0.19.8).
- `NodePlacement`: which node holds a rank when ranks fill nodes in order.

Non-goals: nothing here creates a process group, reads the environment or imports torch, Megatron or
DeepSpeed (STYLE.md practice 1); the adapters turn these rank lists into groups. Limitations: Megatron's
`rank_offset`, hierarchical context parallelism and `gtp_remat_size > 1` are not modelled (the
`gtp_remat` token is accepted as the size-1 axis Megatron 0.19 injects into its orders).

Both grids are mixed-radix numbers. A Megatron grid lists its axes fastest first: with order
"tp-cp-ep-dp-pp", `rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP` (ep is 1 in the dense grid, cp is 1 in
the expert grid). A DeepSpeed grid is row-major, its last axis fastest. Every group list both libraries
build is sorted: groups by their first rank, ranks inside a group ascending.
"""

from __future__ import annotations

import keyword
from collections import namedtuple
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache

MEGATRON_AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Axis names a Megatron `order` string may contain."""
GTP_REMAT_AXIS = "gtp_remat"
"""Axis Megatron 0.19 injects into its orders; always size 1 here, so it changes no group."""
_TOKEN_AXES: tuple[str, ...] = (*MEGATRON_AXES, GTP_REMAT_AXIS)


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int: pass an integer >= 1")
    return value


def _check_rank(rank: object, world_size: int, name: str = "rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"{name}={rank!r} is out of range for world_size={world_size}: "
            f"pass an int with 0 <= {name} < {world_size}"
        )
    return rank


def _mixed_radix_offsets(sizes_strides: Iterable[tuple[int, int]]) -> list[int]:
    """All sums `sum(i_k * stride_k)` with `0 <= i_k < size_k`, the first pair varying fastest.

    >>> _mixed_radix_offsets([(2, 1), (3, 4)])
    [0, 1, 4, 5, 8, 9]
    """
    offsets = [0]
    for size, stride in sizes_strides:
        offsets = [offset + i * stride for i in range(size) for offset in offsets]
    return offsets


@dataclass(frozen=True, slots=True)
class _MegatronGrid:
    """One Megatron `RankGenerator`: named axes listed fastest first, with their sizes."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        strides = [1]
        for size in self.sizes[:-1]:
            strides.append(strides[-1] * size)
        object.__setattr__(self, "strides", tuple(strides))

    def _mask(self, token: str, what: str) -> tuple[bool, ...]:
        parts = token.split("-") if isinstance(token, str) else [token]
        valid = [a for a in _TOKEN_AXES if a in self.names]
        for part in parts:
            if part not in valid:
                raise ValueError(
                    f"axis={token!r} has unknown {what} token {part!r}: join valid tokens "
                    f"{valid} with '-', e.g. 'tp-dp'"
                )
        if len(set(parts)) != len(parts):
            raise ValueError(f"axis={token!r} repeats a token: name each axis at most once")
        return tuple(name in parts for name in self.names)

    def _offsets(self, mask: tuple[bool, ...], masked: bool) -> list[int]:
        return _mixed_radix_offsets(
            (size, stride)
            for size, stride, m in zip(self.sizes, self.strides, mask, strict=True)
            if m == masked
        )

    def groups(self, token: str, what: str) -> list[list[int]]:
        mask = self._mask(token, what)
        members = self._offsets(mask, True)
        return [[base + m for m in members] for base in self._offsets(mask, False)]

    def group_of(self, rank: int, token: str, what: str) -> tuple[int, ...]:
        mask = self._mask(token, what)
        base = rank
        for size, stride, m in zip(self.sizes, self.strides, mask, strict=True):
            if m:
                base -= (rank // stride) % size * stride
        return tuple(base + m for m in self._offsets(mask, True))

    def coords(self, rank: int, skip: str) -> dict[str, int]:
        return {
            name: (rank // stride) % size
            for name, size, stride in zip(self.names, self.sizes, self.strides, strict=True)
            if name not in (skip, GTP_REMAT_AXIS)
        }

    def rank_at(self, coords: dict[str, int], skip: str) -> int:
        axes = [n for n in self.names if n not in (skip, GTP_REMAT_AXIS)]
        unknown = sorted(set(coords) - set(axes))
        if unknown:
            raise ValueError(f"coordinate(s) {unknown} are not axes of this grid: pass only {axes}")
        rank = 0
        for name, size, stride in zip(self.names, self.sizes, self.strides, strict=True):
            if name not in axes:
                continue
            if name not in coords and size > 1:
                raise ValueError(f"coordinate {name} is missing: pass {name}=0..{size - 1}")
            value = coords.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{name}={value!r} is out of range: pass 0 <= {name} < {size}")
            rank += value * stride
        return rank


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronLayout:
    """Megatron-core's parallel layout: the dense grid (tp, cp, dp, pp) and the expert grid (tp, ep, dp, pp).

    `groups(token)` equals `RankGenerator(tp, 1, dp, pp, cp, order).get_ranks(token)` and
    `expert_groups(token)` equals `RankGenerator(expert_tp, ep, expert_dp, pp, 1, order).get_ranks(token)`,
    the two generators `initialize_model_parallel` builds, groups and members in the same order.
    A token joins axis names with '-'; only the set of names matters ("pp-tp" is "tp-pp").

    Example: world_size=16, tp=2, pp=2, ep=2 gives dp=16//(2*2*1)=4 and expert_dp=16//(2*2*2)=2.

    >>> layout = MegatronLayout(world_size=16, tp=2, pp=2, ep=2)
    >>> layout.dp, layout.expert_tp, layout.expert_dp
    (4, 2, 2)
    >>> layout.groups("tp")[:3]
    [[0, 1], [2, 3], [4, 5]]
    >>> layout.groups("dp")
    [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    >>> layout.groups("pp")[:3]
    [[0, 8], [1, 9], [2, 10]]
    >>> layout.expert_groups("ep")[:3]
    [[0, 2], [1, 3], [4, 6]]
    >>> layout.expert_groups("tp-ep")
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    """

    world_size: int
    """Total number of ranks N of the job being emulated."""
    tp: int = 1
    """Tensor-parallel size of the dense layers."""
    pp: int = 1
    """Pipeline-parallel size (shared by dense and expert layers)."""
    cp: int = 1
    """Context-parallel size (dense layers only)."""
    ep: int = 1
    """Expert-parallel size (expert layers only)."""
    expert_tp: int | None = None
    """Tensor-parallel size of the expert layers; None means `tp` (resolved at construction)."""
    order: str = "tp-cp-ep-dp-pp"
    """Megatron's `order`: axis names fastest-varying first. Axes of size 1 may be left out."""
    _dense: _MegatronGrid = field(init=False, repr=False, compare=False)
    _expert: _MegatronGrid = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            _check_positive(name, getattr(self, name))
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)
        etp = _check_positive("expert_tp", self.expert_tp)
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp*pp*cp={model}: choose world_size "
                f"as a multiple of {model} or change tp/pp/cp"
            )
        expert_model = etp * self.ep * self.pp
        if self.world_size % expert_model:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by expert_tp*ep*pp={expert_model}: choose "
                f"world_size as a multiple of {expert_model} or change expert_tp/ep/pp"
            )
        dense_sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert_sizes = {"tp": etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        names = self._order_names(dense_sizes, expert_sizes)
        dense = _MegatronGrid(names, tuple(dense_sizes.get(n, 1) for n in names))
        expert = _MegatronGrid(names, tuple(expert_sizes.get(n, 1) for n in names))
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "_expert", expert)
        # The two checks initialize_model_parallel asserts after building both generators.
        if self.pp > 1 and not self.order.endswith("pp") and self.expert_dp != self.dp:
            raise ValueError(
                f"order={self.order!r} does not end with 'pp', so Megatron needs expert_dp == dp, but "
                f"expert_dp={self.expert_dp} and dp={self.dp}: put 'pp' last in order or choose "
                f"expert_tp*ep == tp*cp"
            )
        pp_axis = names.index("pp")
        if self.pp > 1 and dense.strides[pp_axis] != expert.strides[pp_axis]:
            raise ValueError(
                f"order={self.order!r} gives dense and expert pipeline groups with different strides "
                f"({dense.strides[pp_axis]} vs {expert.strides[pp_axis]}), which Megatron rejects: put 'pp' "
                f"last in order or make the axes before 'pp' the same size in both grids"
            )

    def _order_names(self, dense: dict[str, int], expert: dict[str, int]) -> tuple[str, ...]:
        if not isinstance(self.order, str):
            raise ValueError(f"order={self.order!r} must be a str such as 'tp-cp-ep-dp-pp'")
        names = self.order.split("-")
        for name in names:
            if name not in MEGATRON_AXES:
                raise ValueError(
                    f"order={self.order!r} has unknown axis {name!r}: join axes from {list(MEGATRON_AXES)} "
                    f"with '-', e.g. 'tp-cp-ep-dp-pp'"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"order={self.order!r} repeats an axis: name each axis at most once")
        for name in MEGATRON_AXES:
            if name not in names and max(dense[name], expert[name]) > 1:
                raise ValueError(
                    f"order={self.order!r} leaves out {name!r}, whose size is "
                    f"{max(dense[name], expert[name])}: add {name!r} to order"
                )
        # Megatron appends the missing (size-1) axes; where they go changes no group.
        return (*names, *(n for n in MEGATRON_AXES if n not in names), GTP_REMAT_AXIS)

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers: `world_size // (tp*pp*cp)`."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers: `world_size // (expert_tp*ep*pp)`."""
        assert self.expert_tp is not None  # resolved in __post_init__
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def _grid(self, expert: bool) -> tuple[_MegatronGrid, str, str]:
        """The grid, the axis it lacks, and its name for error messages."""
        return (self._expert, "cp", "expert") if expert else (self._dense, "ep", "dense")

    def groups(self, axis: str) -> list[list[int]]:
        """All dense-layer groups along `axis` (e.g. "tp", "dp-cp", "tp-dp-cp"), as Megatron lists them.

        >>> MegatronLayout(world_size=8, tp=2, cp=2).groups("dp-cp")
        [[0, 2, 4, 6], [1, 3, 5, 7]]
        """
        return self._dense.groups(axis, "dense")

    def expert_groups(self, axis: str) -> list[list[int]]:
        """All expert-layer groups along `axis` ("ep", "tp" = expert tp, "dp" = expert dp, "tp-ep-pp", ...).

        >>> MegatronLayout(world_size=8, ep=4).expert_groups("dp")
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        return self._expert.groups(axis, "expert")

    def group_of(self, rank: int, axis: str, expert: bool = False) -> tuple[int, ...]:
        """The one group along `axis` that holds `rank`, in O(group size) (no enumeration of groups).

        >>> MegatronLayout(world_size=16, tp=2, pp=2).group_of(5, "dp")
        (1, 3, 5, 7)
        >>> MegatronLayout(world_size=16, tp=2, pp=2, ep=2).group_of(5, "ep", expert=True)
        (5, 7)
        """
        _check_rank(rank, self.world_size)
        grid, _, what = self._grid(expert)
        return grid.group_of(rank, axis, what)

    def coords(self, rank: int, expert: bool = False) -> dict[str, int]:
        """Position of `rank` on each axis: tp, cp, dp, pp (dense) or tp, ep, dp, pp (expert), in order.

        A coordinate equals the rank's index inside its group along that axis.

        >>> MegatronLayout(world_size=16, tp=2, pp=2).coords(13)
        {'tp': 1, 'cp': 0, 'dp': 2, 'pp': 1}
        >>> MegatronLayout(world_size=16, tp=2, pp=2, ep=2).coords(13, expert=True)
        {'tp': 1, 'ep': 0, 'dp': 1, 'pp': 1}
        """
        _check_rank(rank, self.world_size)
        grid, skip, _ = self._grid(expert)
        return grid.coords(rank, skip)

    def rank_at(self, *, expert: bool = False, **coords: int) -> int:
        """Inverse of `coords`: the rank at the given position. Axes of size 1 may be left out.

        >>> MegatronLayout(world_size=16, tp=2, pp=2).rank_at(tp=1, dp=2, pp=1)
        13
        """
        grid, skip, _ = self._grid(expert)
        return grid.rank_at(coords, skip)


@cache
def _coord_type(axes: tuple[str, ...]) -> type[tuple[int, ...]]:
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


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlacement:
    """Ranks fill nodes in order: rank r is on node `r // gpus_per_node`, local index `r % gpus_per_node`.

    Non-goal: irregular placements (hostfiles, heterogeneous nodes).

    >>> nodes = NodePlacement(gpus_per_node=8)
    >>> nodes.node_of(13), nodes.local_index(13)
    (1, 5)
    >>> nodes.nodes_of([13, 0, 9, 20]), nodes.ranks_per_node([13, 0, 9, 20])
    ((0, 1, 2), 2)
    >>> nodes.is_intra_node(range(8)), nodes.is_intra_node([7, 8])
    (True, False)
    """

    gpus_per_node: int
    """Ranks (GPUs) per node."""

    def __post_init__(self) -> None:
        _check_positive("gpus_per_node", self.gpus_per_node)

    def _rank(self, rank: object) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} is out of range: pass an int >= 0")
        return rank

    def node_of(self, rank: int) -> int:
        """Index of the node holding `rank`."""
        return self._rank(rank) // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        """Position of `rank` on its node (its local rank)."""
        return self._rank(rank) % self.gpus_per_node

    def nodes_of(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Distinct nodes holding `ranks`, sorted."""
        return tuple(sorted({self.node_of(r) for r in ranks}))

    def ranks_per_node(self, ranks: Iterable[int]) -> int:
        """Most distinct ranks of `ranks` on any one node (0 for no ranks)."""
        counts: dict[int, int] = {}
        for rank in set(ranks):
            node = self.node_of(rank)
            counts[node] = counts.get(node, 0) + 1
        return max(counts.values(), default=0)

    def is_intra_node(self, ranks: Iterable[int]) -> bool:
        """Whether all `ranks` share one node (True for no ranks)."""
        return len(self.nodes_of(ranks)) <= 1
