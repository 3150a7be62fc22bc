"""Linear-time DeepSpeed pipeline topology: closed-form answers for `ProcessTopology` and the grid.

DeepSpeed 0.19.8's `PipelineParallelGrid` set-up is quadratic in N: `_build_p2p_groups` scans every
pipe group for every rank, `get_axis_list` scans the whole rank mapping once per data-parallel index,
and `get_coord` (called by every pipeline send/recv through `stage_to_global`) scans the mapping too.
As one real rank of 65536 that is ~59 s of set-up and milliseconds per transfer.

While an emulation is active, these methods answer from `prism_plugin.topology.DeepSpeedTopology`
(integer arithmetic on the same row-major layout) instead: `ProcessTopology.get_coord`,
`get_axis_list`, `filter_match`, `get_axis_comm_lists` and `PipelineParallelGrid._build_p2p_groups`.
They return exactly what the stock methods return (same lists, same order, same `ProcessCoord`
type); every `new_group` call of the grid still happens, in the same order, so torch's group names
(which key recorded payloads) do not change. Tested against the stock methods in
``integration_tests/deepspeed/test_ds_scale.py``.

The grid's constructor also checks its topology against the virtual world (`check_topology`).

Limitations: a topology whose `mapping` was edited after construction is not supported (DeepSpeed
never does); unknown filter axes raise `ValueError` here where DeepSpeed raises `AttributeError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prism_plugin.config.emulation import ConfigError
from prism_plugin.topology import DeepSpeedTopology

if TYPE_CHECKING:
    from prism_plugin.adapters.deepspeed.runtime import DeepSpeedEmulation

__all__ = ["install", "fast_topology", "p2p_pairs", "check_topology"]

_FAST = "_prism_fast_topology"


def fast_topology(topo: Any) -> DeepSpeedTopology:
    """The closed-form twin of a DeepSpeed `ProcessTopology` (cached on the instance)."""
    fast = topo.__dict__.get(_FAST)
    if fast is None or fast.axes != tuple(topo.axes) or fast.dims != tuple(topo.dims):
        fast = DeepSpeedTopology(axes=tuple(topo.axes), dims=tuple(topo.dims))
        topo.__dict__[_FAST] = fast
    return fast


def p2p_pairs(fast: DeepSpeedTopology) -> list[list[int]]:
    """``[rank, next rank along "pipe" (wrapping)]`` for every rank: `_build_p2p_groups` in O(N).

    >>> p2p_pairs(DeepSpeedTopology.pipe_data(2, 2))
    [[0, 2], [1, 3], [2, 0], [3, 1]]
    """
    a = fast.axes.index("pipe")
    stride, pp = fast._strides[a], fast.dims[a]
    last = (pp - 1) * stride
    return [[rank, rank + stride if (rank // stride) % pp < pp - 1 else rank - last]
            for rank in range(fast.world_size())]


def _get_coord(self: Any, rank: int) -> Any:
    fast = fast_topology(self)
    if not isinstance(rank, int) or not 0 <= rank < fast.world_size():
        raise ValueError(f"rank {rank} not found in topology.")
    return self.ProcessCoord(*fast.get_coord(rank))


def _get_axis_list(self: Any, axis: str, idx: int) -> list[int]:
    fast = fast_topology(self)
    axis_num = self.axes.index(axis)  # ValueError for an unknown axis, as DeepSpeed
    if not isinstance(idx, int) or not 0 <= idx < fast.dims[axis_num]:
        return []
    return fast.get_axis_list(axis, idx)


def _filter_match(self: Any, **filters: int) -> list[int]:
    fast = fast_topology(self)
    for axis, value in filters.items():
        if axis not in fast.axes:
            raise ValueError(f"filter_match({axis}=...): axis not in topology {list(fast.axes)}")
        if not isinstance(value, int) or not 0 <= value < fast.get_dim(axis):
            return []
    return fast.filter_match(**filters)


def _get_axis_comm_lists(self: Any, axis: str) -> list[list[int]]:
    return fast_topology(self).get_axis_comm_lists(axis)


def _build_p2p_groups(self: Any) -> list[list[int]]:
    fast = fast_topology(self._topo)
    if "pipe" not in fast.axes:
        return _STOCK_BUILD_P2P(self)  # fails as DeepSpeed fails
    return p2p_pairs(fast)


_STOCK_BUILD_P2P: Any = None


def check_topology(axes: tuple[str, ...], dims: tuple[int, ...], world_size: int,
                   declared: dict[str, int] | None) -> None:
    """Refuse a pipeline topology that does not span the virtual world or contradicts ``prism.topology``.

    DeepSpeed itself only asserts "Invalid Grid"; this names the sizes and the fix.

    >>> check_topology(("pipe", "data"), (3, 2), 8, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    prism_plugin.config.emulation.ConfigError: the pipeline topology {'pipe': 3, 'data': 2} spans 6 ranks but ...
    """
    sizes = dict(zip(axes, dims, strict=True))
    span = 1
    for d in dims:
        span *= d
    if span != world_size:
        raise ConfigError(
            f"the pipeline topology {sizes} spans {span} ranks but prism.world_size is {world_size}; make "
            "num_stages (and the model/data sizes) divide world_size, or fix prism.world_size"
        )
    if declared is not None:
        mine = {axis: sizes.get(axis, 1) for axis in declared}
        if mine != declared:
            raise ConfigError(f"the pipeline topology {sizes} contradicts prism.topology {declared}; make them agree")


_GRID_GROUPS = (("dp_proc_group", "data"), ("pp_proc_group", "pipe"), ("slice_proc_group", "slice"),
                ("ds_model_proc_group", "model"))
"""PipelineParallelGrid's process groups and the names fault specs give them (``group=dp`` matches "data")."""


def _describe_groups(grid: Any) -> None:
    """Name the grid's groups as DeepSpeed's topology does (DeepSpeed gives them no description), so faults
    select them in the user's words (`prism_plugin.config.faults`: ``group=dp`` / ``pp`` / ``mp``)."""
    for attr, desc in _GRID_GROUPS:
        group = getattr(grid, attr, None)
        if group is not None and hasattr(group, "_set_group_desc") and not getattr(group, "group_desc", ""):
            group._set_group_desc(desc)


def install(emulation: DeepSpeedEmulation) -> None:
    """Route the topology queries above to the closed forms until the emulation closes."""
    global _STOCK_BUILD_P2P
    from deepspeed.runtime.pipe import topology as ds_topology

    _STOCK_BUILD_P2P = vars(ds_topology.PipelineParallelGrid)["_build_p2p_groups"]
    stock_init = vars(ds_topology.PipelineParallelGrid)["__init__"]
    world_size = emulation.section.world_size
    declared = emulation.section.topology

    def grid_init(self: Any, topology: Any = None, process_group: Any = None) -> None:
        if topology is not None:
            check_topology(tuple(topology.axes), tuple(topology.dims), world_size, declared)
        stock_init(self, topology=topology, process_group=process_group)
        _describe_groups(self)

    emulation.patches.setattr(ds_topology.PipelineParallelGrid, "__init__", grid_init)
    cls = ds_topology.ProcessTopology
    emulation.patches.setattr(cls, "get_coord", _get_coord)
    emulation.patches.setattr(cls, "get_axis_list", _get_axis_list)
    emulation.patches.setattr(cls, "filter_match", _filter_match)
    emulation.patches.setattr(cls, "get_axis_comm_lists", _get_axis_comm_lists)
    emulation.patches.setattr(ds_topology.PipelineParallelGrid, "_build_p2p_groups", _build_p2p_groups)
