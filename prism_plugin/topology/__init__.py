"""Parallel layouts as pure value objects: which global ranks form which process group.

- `MegatronLayout` (`megatron`): Megatron-core's dense and expert rank grids, equal to `RankGenerator`.
- `DeepSpeedTopology` (`deepspeed`): DeepSpeed's `ProcessTopology` in closed form.
- `NodePlacement` (`placement`): which node holds a rank.

Non-goals: nothing here creates a process group, reads the environment or imports torch, Megatron or
DeepSpeed (STYLE.md practice 1); the adapters turn these rank lists into groups.
"""

from prism_plugin.topology.deepspeed import DeepSpeedTopology
from prism_plugin.topology.megatron import GTP_REMAT_AXIS, MEGATRON_AXES, MegatronLayout
from prism_plugin.topology.placement import NodePlacement

__all__ = ["GTP_REMAT_AXIS", "MEGATRON_AXES", "DeepSpeedTopology", "MegatronLayout", "NodePlacement"]
