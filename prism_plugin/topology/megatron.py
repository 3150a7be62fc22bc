"""Megatron-core's rank grids as a pure value object (`MegatronLayout`).

`MegatronLayout` gives exactly the groups `megatron.core.parallel_state.RankGenerator.get_ranks(token)`
gives (checked against 0.19.2): the dense ("decoder") and expert grids are mixed-radix numbers whose axes
are listed fastest first: with order "tp-cp-ep-dp-pp", `rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP` (ep is
1 in the dense grid, cp is 1 in the expert grid). Every group list is sorted: groups by their first rank,
ranks inside a group ascending.

Non-goals: nothing here creates a process group, reads the environment or imports torch or Megatron.
Limitations: Megatron's `rank_offset`, hierarchical context parallelism and `gtp_remat_size > 1` are not
modelled (the `gtp_remat` token is accepted as the size-1 axis Megatron 0.19 injects into its orders).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prism_plugin.config.errors import positive_int as _check_positive
from prism_plugin.config.errors import rank_in_range as _check_rank
from prism_plugin.topology.grid import mixed_radix_offsets as _mixed_radix_offsets

MEGATRON_AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Axis names a Megatron `order` string may contain."""
GTP_REMAT_AXIS = "gtp_remat"
"""Axis Megatron 0.19 injects into its orders; always size 1 here, so it changes no group."""
_TOKEN_AXES: tuple[str, ...] = (*MEGATRON_AXES, GTP_REMAT_AXIS)


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
