"""Pool-worker programs for the pipeline-grid tests: stock DeepSpeed vs the adapter's closed forms.

`grid_equivalence_job` builds DeepSpeed's `PipelineParallelGrid` twice in one prism world, once with
DeepSpeed's own topology methods and once with the adapter's, and returns both records: every
`new_group` call (ranks, in order), every grid attribute the engine reads, the names torch gave the
groups this rank holds, and the answers of every topology query for every rank.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

_PATCHED = ("get_coord", "get_axis_list", "filter_match", "get_axis_comm_lists")


def _prism_config(world_size: int, rank: int) -> dict[str, Any]:
    # nodes of gcd(N, 8) ranks: a node size that divides the job (a partial last node is refused); the groups
    # compared here do not depend on placement
    return {"train_micro_batch_size_per_gpu": 1, "prism": {"world_size": world_size, "real_ranks": [rank],
                                                           "timing": False, "gpus_per_node": math.gcd(world_size, 8)}}


def _record_grid(topo_args: tuple[int, int, int]) -> dict[str, Any]:
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    pp, mp, dp = topo_args
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)
    calls: list[list[int]] = []
    original = dist.new_group

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append(list(ranks))
        return original(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        grid = PipelineParallelGrid(topology=topo)
    finally:
        dist.new_group = original
    attrs = {name: getattr(grid, name, None) for name in (
        "stage_id", "data_parallel_id", "ds_model_rank", "ds_model_world_size", "dp_group", "dp_groups",
        "pp_group", "pipe_groups", "slice_group", "model_groups", "p2p_groups", "is_first_stage", "is_last_stage",
        "data_parallel_size", "pipe_parallel_size", "model_parallel_size")}
    attrs["stage_to_global"] = [grid.stage_to_global(stage_id=s) for s in range(pp)]
    names = {name: dist.distributed_c10d._get_process_group_name(getattr(grid, name))
             for name in ("ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group")}
    n = pp * mp * dp
    queries = {
        "coords": [tuple(topo.get_coord(r)) for r in range(n)],
        "axis_lists": {a: [topo.get_axis_list(a, i) for i in range(topo.get_dim(a) + 1)] for a in topo.axes},
        "comm_lists": {a: topo.get_axis_comm_lists(a) for a in (*topo.axes, "absent")},
        "filters": [topo.filter_match(pipe=p, data=d) for p in range(pp) for d in range(dp + 1)],
    }
    return {"calls": calls, "attrs": attrs, "group_names": names, "queries": queries}


def grid_equivalence_job(*, topo_args: tuple[int, int, int], rank: int) -> dict[str, Any]:
    """Stock and closed-form grid records for `rank` of a pipe x model x data topology."""
    from deepspeed.runtime.pipe import topology as ds_topology

    import prism_plugin.deepspeed as prism_ds

    pp, mp, dp = topo_args
    stock = {name: vars(ds_topology.ProcessTopology)[name] for name in _PATCHED}
    stock_p2p = vars(ds_topology.PipelineParallelGrid)["_build_p2p_groups"]
    prism_ds.init_distributed(_prism_config(pp * mp * dp, rank))
    try:
        fast = {name: vars(ds_topology.ProcessTopology)[name] for name in _PATCHED}
        fast_p2p = vars(ds_topology.PipelineParallelGrid)["_build_p2p_groups"]
        assert all(fast[name] is not stock[name] for name in _PATCHED), "the adapter did not install its topology"
        for name in _PATCHED:
            setattr(ds_topology.ProcessTopology, name, stock[name])
        ds_topology.PipelineParallelGrid._build_p2p_groups = stock_p2p
        try:
            stock_record = _record_grid(topo_args)
        finally:
            for name in _PATCHED:
                setattr(ds_topology.ProcessTopology, name, fast[name])
            ds_topology.PipelineParallelGrid._build_p2p_groups = fast_p2p
        # a second world, so torch numbers the groups from the same point
        prism_ds.shutdown()
        prism_ds.init_distributed(_prism_config(pp * mp * dp, rank))
        fast_record = _record_grid(topo_args)
    finally:
        prism_ds.shutdown()
    return {"stock": stock_record, "fast": fast_record}


def pipeline_setup_at_scale_job(*, world_size: int, rank: int, stages: int) -> dict[str, Any]:
    """Time ``PipelineModule`` (its grid and groups) + ``deepspeed.initialize`` as one rank of N."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    import prism_plugin.deepspeed as prism_ds

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": stages,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "steps_per_print": 10**9, "prism": {"world_size": world_size, "real_ranks": [rank], "timing": False}}
    t0, c0 = time.perf_counter(), time.process_time()
    prism_ds.init_distributed(config)
    try:
        net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 8, 8) for _ in range(stages)], num_stages=stages,
                             loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        module_s = time.perf_counter() - t0
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        setup_s, setup_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        grid = engine.grid
        out = {"module_s": module_s, "setup_s": setup_s, "setup_cpu_s": setup_cpu_s, "stage": engine.stage_id,
               "dp_group": list(grid.dp_group),
               "pp_group": list(grid.pp_group), "p2p_first": grid.p2p_groups[:3], "p2p_last": grid.p2p_groups[-1],
               "num_p2p": len(grid.p2p_groups), "groups_created": prism_ds.active().session.groups_created}
    finally:
        prism_ds.shutdown()
    return out


def pipeline_topology_error_job(*, world_size: int, pp: int, dp: int, topology: dict[str, int] | None) -> str:
    """A PipelineModule over an explicit pipe x data topology; the adapter's error message (or '')."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import prism_plugin.deepspeed as prism_ds
    from prism_plugin.config.emulation import ConfigError

    prism: dict[str, Any] = {"world_size": world_size, "real_ranks": [0], "timing": False}
    if topology is not None:
        prism["topology"] = topology
    prism_ds.init_distributed({"train_micro_batch_size_per_gpu": 1, "prism": prism})
    try:
        PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(pp)],
                       topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp))
    except ConfigError as exc:
        return str(exc)
    finally:
        prism_ds.shutdown()
    return ""
