"""DeepSpeed's pipeline grid gives its groups no description; the adapter names them so faults find them.

`prism_plugin.adapters.deepspeed.grid._describe_groups` labels a `PipelineParallelGrid`'s data / pipe / slice /
model groups as DeepSpeed's topology names its axes; the fault vocabulary then reads them in the user's words.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

import prism_plugin as P
from prism_plugin.adapters.deepspeed.grid import _describe_groups
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.faults import desc_role


def test_the_grid_groups_are_named_as_the_fault_vocabulary_reads_them() -> None:
    P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,)), timing=False))
    try:
        groups = {name: dist.new_group(ranks) for name, ranks in
                  (("dp", [0, 2, 4, 6]), ("pp", [0, 1]), ("slice", [0, 4]), ("mp", [0]))}
        named = dist.new_group([0, 3], group_desc="already_named")
        grid = SimpleNamespace(dp_proc_group=groups["dp"], pp_proc_group=groups["pp"],
                               slice_proc_group=groups["slice"], ds_model_proc_group=named)
        _describe_groups(grid)
        assert [g.group_desc for g in (groups["dp"], groups["pp"], groups["slice"])] == ["data", "pipe", "slice"]
        assert named.group_desc == "already_named"  # a description the program gave is kept
        assert [desc_role(g.group_desc) for g in (groups["dp"], groups["pp"])] == ["dp", "pp"]
        assert groups["dp"].vg.desc == "data"  # what live faults read
    finally:
        P.deactivate()
