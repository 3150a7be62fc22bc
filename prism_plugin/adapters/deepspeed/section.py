"""The ``"prism"`` section of a DeepSpeed config, checked as `prism run`'s launcher checks its flags.

`prism_plugin.config.deepspeed` reads the section (its keys, one per setting of the table, and DeepSpeed's batch
arithmetic against the emulated world); `parse_section` adds the launcher's checks (`prism_plugin.launch.preflight`):
an ``output`` / ``record`` / ``trace`` that is (or lies under) a file, the environment, a graph of another world size,
a ``replay`` recorded at another world size or lacking a real rank's recording. Each real process makes them before
any process group exists (DeepSpeed has no launcher of ours).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prism_plugin.config.deepspeed import (
    ALLOWED_KEYS,
    KEY_NAMES,
    SECTION_KEY,
    PrismSection,
    TensorSpec,
    load_ds_config,
    read_section,
)
from prism_plugin.launch.preflight import check_directories, check_environment, check_graph, check_recording

__all__ = ["ALLOWED_KEYS", "KEY_NAMES", "SECTION_KEY", "PrismSection", "TensorSpec", "load_ds_config",
           "parse_section"]


def parse_section(ds_config: Mapping[str, Any] | str | Path, *, required: bool = True) -> PrismSection | None:
    """Validate the ``"prism"`` section of `ds_config` (dict or path). None when absent and not `required`."""
    section = read_section(ds_config, required=required)
    if section is None:
        return None
    emulation = section.emulation
    check_directories(emulation, KEY_NAMES)
    check_environment(emulation.world.real_ranks, {**os.environ, **section.environ})
    check_graph(emulation, KEY_NAMES)
    check_recording(emulation, KEY_NAMES)
    return section
