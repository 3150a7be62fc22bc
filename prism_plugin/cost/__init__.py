"""The pure timing layer: hardware profiles and the alpha-beta cost model (DESIGN.md section 5).

Example::

    from prism_plugin.cost import CostModel, load_profile
    from prism_plugin.config.kinds import OpKind

    model = CostModel(load_profile("H100"))
    model.collective_us(OpKind.ALL_REDUCE, 2**30, range(8))  # ~5239 us

Pure: stdlib + pyyaml; imports nothing from torch.
"""

from prism_plugin.cost.model import CostBreakdown, CostModel, GroupPlacement, supported_algorithms
from prism_plugin.cost.profiles import (
    HardwareProfile,
    LinkSpec,
    ProfileError,
    available_profiles,
    load_profile,
    override_profile,
    profile_from_yaml,
    profile_to_yaml,
)

__all__ = [
    "CostBreakdown",
    "CostModel",
    "GroupPlacement",
    "HardwareProfile",
    "LinkSpec",
    "ProfileError",
    "available_profiles",
    "load_profile",
    "override_profile",
    "profile_from_yaml",
    "profile_to_yaml",
    "supported_algorithms",
]
