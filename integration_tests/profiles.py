"""Hardware profiles the integration tests write: a built-in one with a field changed.

`launch_light_profile`: the host time per launch of the DGX profiles is fitted on Megatron-LM's functional tests
(85 us, `prism_plugin/cost/profiles/dgx-h100.yaml`), so a toy job's step is its host's. A test of a GPU-side
mechanism (communication hidden behind compute), or of the execution graph's replay reproducing a live step (the
replay's compute spans are GPU-frame spans: docs/graph.md), runs on a launch-light host, where the GPU bounds the
step as it does a real-size job's.
"""

from __future__ import annotations

from pathlib import Path

from prism_plugin.cost import load_profile, override_profile
from prism_plugin.cost.profiles import profile_to_yaml

__all__ = ["LIGHT_LAUNCH_US", "launch_light_profile"]

LIGHT_LAUNCH_US = 5.0
"""The host time per launch of a launch-light profile: the DGX profiles' estimate before the fit."""


def launch_light_profile(folder: Path, base: str = "dgx-h100") -> Path:
    """`base` with ``kernels.launch_overhead_us`` = `LIGHT_LAUNCH_US`, written to `folder`; its path (what
    ``--profile`` / ``--prism-profile`` take)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{base}-launch-light.yaml"
    profile = override_profile(load_profile(base), {"kernels.launch_overhead_us": LIGHT_LAUNCH_US})
    path.write_text(profile_to_yaml(profile))
    return path
