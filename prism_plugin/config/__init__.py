"""The config layer: pure value objects of one emulation, its vocabularies, fault specs and errors.

Modules: `errors` (the error contract and shared validators), `kinds` (closed vocabularies),
`emulation` (`VirtualWorld`, `EmulationConfig`), `faults` (fault and what-if specs, parsed from strings).
Pure: imports nothing from torch.
"""

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.errors import (
    ConfigError,
    coerce_enum,
    int_at_least,
    parse_rank_list,
    positive_int,
    rank_in_range,
)
from prism_plugin.config.kinds import DataPolicy, Framework, IterationMarker, OpKind

__all__ = ["ConfigError", "DataPolicy", "EmulationConfig", "Framework", "IterationMarker", "OpKind", "VirtualWorld",
           "coerce_enum", "int_at_least", "parse_rank_list", "positive_int", "rank_in_range"]
