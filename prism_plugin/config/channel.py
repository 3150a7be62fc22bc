"""The launcher-to-rank channel: an `EmulationConfig` as JSON (``PRISM_CONFIG``), derived from the dataclass.

The launcher resolves the settings (`prism_plugin.config.resolve`) and writes `config_to_env`; each rank process
reads `config_from_env`, whose constructors check the values again. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld

__all__ = ["config_from_env", "config_to_env"]


def _jsonable(value: object) -> object:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def config_to_env(config: EmulationConfig) -> str:
    """The launcher-to-rank channel: every field of `config` as JSON (derived from the dataclass, faults as their
    spec strings), read back by `config_from_env`."""
    data = _jsonable(config)
    assert isinstance(data, dict)
    data["faults"] = [f.to_text() for f in config.faults]
    return json.dumps(data)


def config_from_env(text: str) -> EmulationConfig:
    """The `EmulationConfig` `config_to_env` wrote (checked again by its constructors)."""
    data = json.loads(text)
    w = data.pop("world")
    world = VirtualWorld(world_size=w["world_size"], real_ranks=tuple(w["real_ranks"]),
                         gpus_per_node=w["gpus_per_node"],
                         devices=tuple(w["devices"]) if w["devices"] is not None else None)
    data["faults"] = tuple(data.get("faults") or ())
    return EmulationConfig(world=world, **data)
