"""The host a GPU hangs off: what its CPU streams through memory per GPU, for work that runs on the CPU.

A hardware profile's optional ``host:`` section::

    host:
      cpu_memory_bandwidth_gbytes_per_s: 76.8   # one GPU's share of its node's host memory bandwidth, 1e9 B/s

Used by DeepSpeed's CPU optimizer under ZeRO-Offload (`prism_plugin.adapters.deepspeed.cpu_adam`): its Adam step
streams the fp32 partition, its gradient and the two moments through host memory (AVX kernels on every core),
so its time is those bytes over this figure. The 8 ranks of a node step at the same time and share the
node's memory bandwidth, hence a per-GPU share.

Policy default (listed by `HostSpec.defaults_used` when no profile sets it): the DGX H100's own figure. Its
two Intel Xeon Platinum 8480C (DGX H100 user guide) have 8 DDR5-4800 channels each (Intel's product sheet):
2 x 8 x 4800e6 transfers/s x 8 B = 614.4e9 B/s per node, 76.8e9 B/s per GPU. A datasheet peak: a STREAM run
on the node gives the achieved figure to set instead.

Limitations: one figure per GPU; no NUMA placement, no contention with the data loader's host work, no overlap
of the optimizer step with the GPU (DeepSpeed steps after the backward pass, as modelled).

Pure: stdlib only (and the config layer's error contract).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from prism_plugin.cost.storage import GbytesSection

__all__ = ["HOST_DEFAULTS_GBYTES_PER_S", "HostSpec"]

HOST_DEFAULTS_GBYTES_PER_S: Mapping[str, float] = {
    "cpu_memory_bandwidth_gbytes_per_s": 2 * 8 * 4800e6 * 8 / 8 / 1e9,  # DGX H100: 614.4 GB/s over 8 GPUs
}
"""The policy defaults of the ``host:`` figures (module docstring: where they come from)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec(GbytesSection):
    """A profile's ``host:`` section; None: the policy default.

    Example: ``HostSpec().stream_s(76_800_000_000) == 1.0`` (one second to stream 76.8 GB at the default).
    """

    SECTION: ClassVar[str] = "host"
    DEFAULTS: ClassVar[Mapping[str, float]] = HOST_DEFAULTS_GBYTES_PER_S

    cpu_memory_bandwidth_gbytes_per_s: float | None = None
    """One GPU's share of its node's host memory bandwidth, 1e9 bytes/s (None: the DGX H100 default)."""

    def stream_s(self, size_bytes: int) -> float:
        """Seconds the host's CPU takes to stream `size_bytes` through memory (read or written) for one GPU."""
        return size_bytes / self.bandwidth_bytes_per_s("cpu_memory_bandwidth_gbytes_per_s")
