"""Communicator buffer memory: what NCCL would allocate on a GPU at full scale, as a documented model.

The emulator allocates no NCCL communicator for a group whose other members are virtual, so the
device memory NCCL would hold there is absent from the measured allocator figure. This module
estimates it, and summaries report it *separately* (``communicator_memory``), never added to the
allocator's peak: the peak figure stays the exact, measured one.

Model (NCCL 2.2x defaults; every constant is a parameter, see `NcclBufferModel`):

- A communicator exists for each group on which this rank ran at least one op (NCCL creates them
  lazily, on the first op). Collectives use ``channels`` channels (NCCL picks 16-32 on NVLink
  systems; 16 by default here; ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` move it).
- Ring: per channel one receive connection from the previous rank, holding the buffers of the three
  protocols: SIMPLE ``NCCL_BUFFSIZE`` (4 MiB), LL128 4,915,200 B (120 elements x 640 threads x 8 steps
  x 8 B), LL 524,288 B (8 lines x 512 threads x 8 steps x 16 B). Groups spanning more than one node
  add a tree: up to 3 more connections per channel (parent and two children).
- Point-to-point: per peer ``p2p_channels_per_peer`` (2) channels, one send and one receive
  connection each, SIMPLE protocol only.
- A group of one rank, and a rank's own send to itself, allocate nothing.
- Not modelled: NCCL's fixed per-communicator state (device work FIFOs, proxy state: a few MiB),
  user-buffer registration, NVLS/CollNet buffers, ``NCCL_BUFFSIZE`` tuning by the launcher.

Pure: no torch. Example::

    >>> m = NcclBufferModel()
    >>> m.communicator_bytes(size=8, num_nodes=1, p2p_peers=0) == 16 * m.protocol_bytes
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["NcclBufferModel", "CommUse"]

_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CommUse:
    """How one rank used one group: its size, the nodes it spans, and the p2p peers it talked to."""

    size: int
    num_nodes: int
    collective: bool
    p2p_peers: int


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclBufferModel:
    """The buffer sizes and channel counts of the model (module docstring); defaults are NCCL's."""

    channels: int = 16
    simple_bytes: int = 4 * _MIB
    ll128_bytes: int = 4_915_200
    ll_bytes: int = 524_288
    tree_connections: int = 3
    p2p_channels_per_peer: int = 2

    @property
    def protocol_bytes(self) -> int:
        """One connection's buffers for all three protocols."""
        return self.simple_bytes + self.ll128_bytes + self.ll_bytes

    def communicator_bytes(self, *, size: int, num_nodes: int, p2p_peers: int, collective: bool = True) -> int:
        """Device bytes one rank's side of one communicator holds."""
        total = 0
        if collective and size > 1:
            connections = 1 + (self.tree_connections if num_nodes > 1 else 0)
            total += self.channels * connections * self.protocol_bytes
        total += p2p_peers * self.p2p_channels_per_peer * 2 * self.simple_bytes
        return total

    def report(self, uses: Iterable[CommUse]) -> dict[str, Any]:
        """The summary's ``communicator_memory`` section for a rank's groups."""
        uses = list(uses)
        per = [self.communicator_bytes(size=u.size, num_nodes=u.num_nodes, p2p_peers=u.p2p_peers,
                                       collective=u.collective) for u in uses]
        return {
            "model": "nccl-buffers (prism_plugin.cost.comm_memory): ring/tree/p2p connection buffers, "
                     f"{self.channels} channels, NCCL_BUFFSIZE {self.simple_bytes} B",
            "modelled_bytes": sum(per),
            "communicators": sum(1 for b in per if b > 0),
            "largest_bytes": max(per, default=0),
            "note": "what NCCL would allocate on a GPU at full scale; not allocated by prism and not part of "
                    "the measured peak (gloo on CPU keeps no persistent per-communicator device buffers)",
        }
