"""The session's per-op hooks: replayed virtual arrivals (hybrid emulation) and trace capture.

`prism_plugin.comm.collectives._launch` calls them for every op when either is enabled (and touches
nothing otherwise): `arrival` may move the op's arrival later (a virtual member arrives after this rank,
per the execution graph's replay), then `issued` records the op and links its record to the work handle,
whose wait() stamps the wait point.
"""

from __future__ import annotations

from typing import Any

from prism_plugin.config.kinds import OpKind
from prism_plugin.runtime.arrivals import ReplayedArrivals
from prism_plugin.runtime.tracer import Tracer

__all__ = ["OpHooks"]


class OpHooks:
    """Replayed arrivals and/or a tracer, called by the backend for each op."""

    __slots__ = ("arrivals", "tracer", "timing")

    def __init__(self, arrivals: ReplayedArrivals | None, tracer: Tracer | None, timing: bool) -> None:
        self.arrivals = arrivals
        self.tracer = tracer
        self.timing = timing

    def arrival(self, vg: Any, kind: OpKind, arrival_s: float, peer: int | None) -> float:
        arrivals = self.arrivals
        if arrivals is None or vg.all_real or not self.timing:
            return arrival_s
        return arrivals.arrival(vg, kind, arrival_s, peer)

    def issued(self, work: Any, vg: Any, kind: OpKind, seq: int, arrival_s: float, size_bytes: int,
               peer: int | None) -> None:
        if self.tracer is not None:
            self.tracer.issued(work, vg, kind, seq, arrival_s, size_bytes, peer)
