"""The config layer: pure value objects of one emulation, its vocabularies, fault specs and errors.

Modules: `settings` (the table of every user-facing setting: one name, one parser, every spelling), `resolve`
(the one validator: a launch's settings -> the nested, typed `Settings`), `reference` (the generated
configuration reference), `respell` (a message in the spelling of an entry point), `errors` (the error contract
and shared validators), `kinds` (closed vocabularies), `emulation` (`VirtualWorld`, `EmulationConfig`: what the
launcher hands each rank), `faults` (fault and what-if specs, parsed from strings), `virtual_time` and
`program_options` (settings as a rank reads them), `models` (model presets).
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
