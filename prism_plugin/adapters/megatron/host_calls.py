"""Megatron calls that act on the host's real GPU hardware and have no meaning on a virtual GPU: skipped, counted.

- ``megatron.core.pipeline_parallel.utils.set_ideal_affinity_for_current_gpu`` (``--fine-grained-activation-
  offloading``, from ``megatron.training.pretrain``): pins this process's CPUs to the NUMA node of its GPU through
  the CUDA driver (``cuda-python``) and NVML. On a virtual GPU there is no driver, device or NUMA node; the pinning
  changes no device memory and no modelled time, only how a real host schedules its copies.

Each skipped call is counted by name (`HostCalls.skipped`, the summary's ``megatron.host_calls_skipped``), so a run
says what it did not do. Undone by the `Patches` given.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prism_plugin.device.undo import Patches

__all__ = ["HostCalls", "install"]

SKIPPED = {
    "megatron.core.pipeline_parallel.utils": ("set_ideal_affinity_for_current_gpu",),
}
"""Module -> functions replaced by a counted no-op on virtual GPUs."""


class HostCalls:
    """The host-hardware calls skipped in this process, by name."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()

    def summary(self) -> dict[str, int]:
        return dict(self.skipped)


def install(patches: Patches) -> HostCalls:
    """Replace every function of `SKIPPED` (in its module, imported here: megatron.core is) by a counted no-op."""
    import importlib

    calls = HostCalls()
    for module_name, names in SKIPPED.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                patches.setattr(module, name, _skip(calls, name))
    return calls


def _skip(calls: HostCalls, name: str) -> Any:
    def skipped(*args: Any, **kwargs: Any) -> None:
        calls.skipped[name] += 1

    skipped.__name__ = skipped.__qualname__ = name
    return skipped
