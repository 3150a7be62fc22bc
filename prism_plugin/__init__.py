"""prism_plugin: run k real ranks of an N-rank Megatron-core / DeepSpeed job; emulate the rest.

The in-process API (the adapters build on it)::

    import prism_plugin
    session = prism_plugin.activate(prism_plugin.EmulationConfig(
        world=prism_plugin.VirtualWorld(world_size=8192, real_ranks=(5,))))
    ...  # the unmodified torch.distributed program: it is rank 5 of 8192
    prism_plugin.deactivate()

Attributes load lazily so the pure layers (config, topology, cost) import without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "activate": "prism_plugin.runtime.session",
    "deactivate": "prism_plugin.runtime.session",
    "current_session": "prism_plugin.runtime.session",
    "mark_iteration": "prism_plugin.runtime.session",
    "Session": "prism_plugin.runtime.session",
    "EmulationConfig": "prism_plugin.config.emulation",
    "VirtualWorld": "prism_plugin.config.emulation",
    "ConfigError": "prism_plugin.config.emulation",
    "DataPolicy": "prism_plugin.config.kinds",
    "OpKind": "prism_plugin.config.kinds",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prism_plugin' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
