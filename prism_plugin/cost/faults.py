"""Faults and what-ifs as cost questions: the per-op factors the live emulation and the replay both ask.

`FaultSet` indexes one job's fault specs (`prism_plugin.config.faults` parses them and states their
semantics) for the questions asked per op: a straggler's factor among an op's members, the cost factor of
degraded links an op crosses (nodes through `NodePlacement`) and seeded jitter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Container, Iterable, Sequence

from prism_plugin.config.faults import (
    Crash,
    FaultSpec,
    Hang,
    Jitter,
    Kill,
    SlowLink,
    Straggler,
    check_fault_ranks,
)
from prism_plugin.topology.placement import NodePlacement

__all__ = ["FaultSet", "jitter_factor"]


def jitter_factor(sigma: float, seed: int, group: str, seq: int) -> float:
    """The seeded cost factor ``exp(sigma * z)`` of op `seq` of `group` (identical on every run and rank).

    ``z`` is a standard normal from Box-Muller on two uniforms taken from ``blake2b(f"{seed}/{group}/{seq}")``
    (about 2 us, against 40 us for seeding a `random.Random` per op).
    """
    if sigma == 0.0:
        return 1.0
    digest = hashlib.blake2b(f"{seed}/{group}/{seq}".encode(), digest_size=16).digest()
    u1 = (int.from_bytes(digest[:8], "little") + 1) / 2.0**64  # (0, 1]
    u2 = int.from_bytes(digest[8:], "little") / 2.0**64
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return math.exp(sigma * z)


class FaultSet:
    """The faults of one job, indexed for the per-op questions the emulation and the replay ask.

    >>> fs = FaultSet(parse_faults(["straggler:ranks=4-7,factor=1.5", "link:nodes=0/1,bandwidth=0.5"]), 8, 4)
    >>> fs.straggler_factor([0, 4], step=0), fs.cost_factor([0, 4], "dp", 1)
    ((1.5, 4), 2.0)
    """

    def __init__(self, specs: Sequence[FaultSpec], world_size: int, gpus_per_node: int) -> None:
        self.specs = tuple(specs)
        self.world_size = world_size
        self.gpus_per_node = gpus_per_node
        self.placement = NodePlacement(gpus_per_node=gpus_per_node)
        check_fault_ranks(self.specs, world_size)
        self.stragglers = [s for s in self.specs if isinstance(s, Straggler)]
        self.links = [s for s in self.specs if isinstance(s, SlowLink)]
        self.jitters = [s for s in self.specs if isinstance(s, Jitter)]
        self.hangs = [s for s in self.specs if isinstance(s, Hang)]
        self.crashes = [s for s in self.specs if isinstance(s, Crash)]
        self.kills = [s for s in self.specs if isinstance(s, Kill)]

    def __bool__(self) -> bool:
        return bool(self.specs)

    def straggler_factor(self, members: Container[int], step: int | None) -> tuple[float, int]:
        """(largest factor > 1 among `members` at `step`, that rank); (1.0, -1) when none. step None: any step."""
        best, who = 1.0, -1
        for s in self.stragglers:
            if step is not None and step < s.from_step:
                continue
            for r in s.ranks:
                if r in members and s.factor > best:
                    best, who = s.factor, r
        return best, who

    def link_factor(self, ranks: Iterable[int]) -> float:
        """Cost multiplier of the degraded links an op over global `ranks` crosses (1 / bandwidth each)."""
        factor = 1.0
        if self.links:
            members = list(ranks)
            for link in self.links:
                if link.crosses(members, self.placement.node_of):
                    factor /= link.bandwidth
        return factor

    def jitter(self, group: str, seq: int) -> float:
        """Seeded jitter multiplier of op `seq` of `group` (1.0 without jitter)."""
        factor = 1.0
        for j in self.jitters:
            factor *= jitter_factor(j.sigma, j.seed, group, seq)
        return factor

    def cost_factor(self, ranks: Iterable[int], group: str, seq: int) -> float:
        """Multiplier of an op's communication cost: degraded links it crosses and seeded jitter."""
        return self.link_factor(ranks) * self.jitter(group, seq)
