"""Configuration of one emulation: the virtual world, the data policy and the timing source.

Pure value objects (no torch.distributed): every check runs at construction, before any process
group exists, and each error names the field and says how to fix it (a `ConfigError`, a
`ValueError`).

Example: two real processes playing ranks 0 and 8191 of an 8192-rank job on DGX-H100 nodes::

    EmulationConfig(world=VirtualWorld(world_size=8192, real_ranks=(0, 8191), gpus_per_node=8),
                    profile="dgx-h100")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prism_plugin.config.errors import ConfigError, coerce_enum, parse_rank_list, positive_int
from prism_plugin.config.kinds import DataPolicy, DeviceMode, IterationMarker

if TYPE_CHECKING:
    from prism_plugin.config.faults import FaultSpec

__all__ = ["BASE_PROCESS_BYTES", "BYTES_PER_VIRTUAL_RANK", "ConfigError", "EmulationConfig", "VirtualWorld",
           "check_fault_nodes", "parse_rank_list"]

BYTES_PER_VIRTUAL_RANK = 176
"""Peak resident bytes one real process spends per rank of N (torch's c10d keeps a rank -> rank dict of the
world group; the summary's communicator model lists the world's ranks). Measured: max RSS of ``prism run
--world-size N --real-ranks 0 --no-timing`` of a script doing one all_reduce and a barrier (torch 2.13 CPU,
Python 3.11): N = 2^16 -> 235 MB, 2^20 -> 410 MB, 2^22 -> 841 MB, i.e. 176 B/rank from 2^16 to 2^20 and
140 B/rank from 2^20 to 2^22; the larger figure is kept. The program's own per-rank state (Megatron's rank
lists, say) is not in it."""
BASE_PROCESS_BYTES = 256 * 2**20
"""Resident bytes of one real process before any rank of N (Python + torch + prism: 229 MB measured at N = 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VirtualWorld:
    """N virtual ranks on nodes of `gpus_per_node`, of which `real_ranks` run for real.

    Physical process i (torchrun's RANK) plays virtual rank ``real_ranks[i]`` and uses physical
    device ``devices[i]`` (default: ``i % local process count``, or the CPU).
    """

    world_size: int
    """N, the number of ranks the training program believes exist."""
    real_ranks: tuple[int, ...]
    """Virtual ranks executed by real processes, in physical-process order; distinct, in [0, N)."""
    gpus_per_node: int = 8
    """Ranks per node in the target cluster (placement of groups on nodes for the cost model)."""
    devices: tuple[int, ...] | None = None
    """Physical device index of each real process (None: the process's local index)."""

    def __post_init__(self) -> None:
        positive_int("world_size", self.world_size, hint="give the job's total rank count, e.g. --world-size 8192")
        if isinstance(self.real_ranks, (str, int)) or not isinstance(self.real_ranks, Sequence):
            raise ConfigError(f"real_ranks={self.real_ranks!r} must be a list of ranks, e.g. [0, 5]")
        object.__setattr__(self, "real_ranks", tuple(int(r) for r in self.real_ranks))
        if not self.real_ranks:
            raise ConfigError("real_ranks is empty; name at least one rank to run for real, e.g. [0]")
        bad = [r for r in self.real_ranks if not 0 <= r < self.world_size]
        if bad:  # every bad rank at once (rank_in_range names one)
            raise ConfigError(
                f"real_ranks {bad} out of range for world_size={self.world_size}; "
                f"use ranks in 0..{self.world_size - 1}"
            )
        dups = sorted({r for i, r in enumerate(self.real_ranks) if r in self.real_ranks[:i]})
        if dups:
            raise ConfigError(f"real_ranks lists {dups} more than once; each real rank must appear once")
        positive_int("gpus_per_node", self.gpus_per_node, hint="ranks per node of the target cluster, 8 on DGX nodes")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            # a job smaller than one node runs on part of it (torchrun --nproc-per-node 2 on an 8-GPU node)
            raise ConfigError(
                f"gpus_per_node={self.gpus_per_node} does not divide world_size={self.world_size}: the job would "
                f"end on a partial node; use a world size that is a multiple of {self.gpus_per_node} (e.g. "
                f"{self.world_size - self.world_size % self.gpus_per_node} or "
                f"{self.world_size - self.world_size % self.gpus_per_node + self.gpus_per_node}), or the "
                "cluster's ranks per node (--gpus-per-node)"
            )
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
            if len(self.devices) != len(self.real_ranks):
                raise ConfigError(
                    f"devices has {len(self.devices)} entries but real_ranks has {len(self.real_ranks)}; "
                    "give one physical device per real rank, or omit devices"
                )
            if any(d < 0 for d in self.devices):
                raise ConfigError(f"devices={list(self.devices)} has a negative index; use 0, 1, ...")

    @property
    def num_nodes(self) -> int:
        """Nodes of the target cluster: N / gpus_per_node (one node when N < gpus_per_node).

        >>> VirtualWorld(world_size=16, real_ranks=(0,), gpus_per_node=8).num_nodes
        2
        >>> VirtualWorld(world_size=2, real_ranks=(0,)).num_nodes  # part of one 8-GPU node
        1
        """
        return -(-self.world_size // self.gpus_per_node)

    @property
    def estimated_bytes_per_process(self) -> int:
        """Resident bytes one real process of this world needs at least (`BASE_PROCESS_BYTES` +
        `BYTES_PER_VIRTUAL_RANK` x N); pure arithmetic, nothing allocated.

        >>> VirtualWorld(world_size=10**9, real_ranks=(0,)).estimated_bytes_per_process
        176268435456
        """
        return BASE_PROCESS_BYTES + BYTES_PER_VIRTUAL_RANK * self.world_size

    @property
    def num_real(self) -> int:
        return len(self.real_ranks)

    def is_real(self, rank: int) -> bool:
        return rank in self._real_set()

    def _real_set(self) -> frozenset[int]:
        return frozenset(self.real_ranks)

    def virtual_rank_of(self, process_index: int) -> int:
        """The virtual rank played by physical process `process_index`."""
        if not 0 <= process_index < self.num_real:  # a launch error: says how many processes to start
            raise ConfigError(
                f"process index {process_index} has no real rank: real_ranks has {self.num_real} entries; "
                f"launch exactly {self.num_real} processes (e.g. torchrun --nproc-per-node {self.num_real})"
            )
        return self.real_ranks[process_index]

    def device_of(self, process_index: int, local_world_size: int = 1) -> int:
        if self.devices is not None:
            return self.devices[process_index]
        return process_index % max(1, local_world_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulationConfig:
    """Everything one real process needs to join an emulation."""

    world: VirtualWorld
    profile: str = "local-cpu-gloo"
    """Hardware profile name (see `prism profiles`) or a path to a profile YAML."""
    data_policy: DataPolicy = DataPolicy.MIRROR
    """What virtual participants contribute; RECORDED needs `replay_dir`."""
    record_dir: Path | None = None
    """Write every payload this rank receives here (a recording run: usually all ranks real)."""
    replay_dir: Path | None = None
    """Recorded payloads to replay (data_policy=RECORDED)."""
    timing: bool = True
    """Hold each op until its emulated completion time; False completes ops as soon as data is ready."""
    timeout_s: float = 1800.0
    """Timeout of the inner real groups (the job's own collective timeout)."""
    output_dir: Path | None = None
    """Where metrics and traces go (None: nothing written)."""
    trace_dir: Path | None = None
    """Trace capture: write this rank's ops and compute spans per iteration to ``<trace_dir>/rank<R>.trace.json``."""
    trace_max_iterations: int = 64
    """Iterations traced (from the first mark); later ones are not recorded, so memory stays bounded."""
    graph: Path | None = None
    """Hybrid emulation: an execution graph (`prism graph build`) whose replay gives virtual arrivals."""
    iteration_marker: IterationMarker = IterationMarker.AUTO
    """What delimits iterations: explicit `mark_iteration()` calls, optimizer steps, or auto (both)."""
    faults: tuple[FaultSpec, ...] = ()
    """Faults and what-ifs (`prism_plugin.config.faults`): specs or strings like "straggler:ranks=4-7,factor=1.3"."""
    device: DeviceMode = DeviceMode.REAL
    """REAL: the program's tensors on the host's devices; VIRTUAL_GPU: fake cuda tensors on virtual GPUs (nothing
    sleeps: `timing` is off, and the session turns modelled time back on when the virtual GPU has virtual time,
    ``PRISM_VIRTUAL_TIME=on``, the default: `prism_plugin.device.clock`)."""
    gpu: str | None = None
    """GPU model of the virtual GPUs (`prism_plugin.cost.gpu.GPUS`); None: the profile's ``gpu``."""

    def __post_init__(self) -> None:
        if not isinstance(self.world, VirtualWorld):
            raise ConfigError("world must be a VirtualWorld(world_size=..., real_ranks=...)")
        object.__setattr__(self, "data_policy", coerce_enum(DataPolicy, self.data_policy, "data_policy"))
        object.__setattr__(self, "device", coerce_enum(DeviceMode, self.device, "device"))
        if self.device is DeviceMode.VIRTUAL_GPU:
            object.__setattr__(self, "timing", False)  # a virtual GPU never sleeps (virtual time: see the session)
        elif self.gpu is not None:
            raise ConfigError("gpu is the model of virtual GPUs; give it with device='virtual-gpu' (or drop it)")
        for name in ("record_dir", "replay_dir", "output_dir", "trace_dir", "graph"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if self.data_policy is DataPolicy.RECORDED:
            if self.replay_dir is None:
                raise ConfigError(
                    "data_policy='recorded' needs replay_dir: the directory a recording run wrote "
                    "(run it with record_dir=DIR / --record DIR first)"
                )
            if not self.replay_dir.is_dir():
                raise ConfigError(
                    f"replay_dir={str(self.replay_dir)!r} does not exist; point it at a recording run's "
                    "record_dir"
                )
        elif self.replay_dir is not None:
            raise ConfigError("replay_dir is only read with data_policy='recorded'; set both or neither")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds")
        object.__setattr__(self, "iteration_marker",
                           coerce_enum(IterationMarker, self.iteration_marker, "iteration_marker"))
        positive_int("trace_max_iterations", self.trace_max_iterations, hint="the number of iterations to trace")
        if self.graph is not None and not self.graph.is_file():
            raise ConfigError(
                f"graph={str(self.graph)!r} is not a file; build one with `prism graph build` (or drop --graph)"
            )
        if not isinstance(self.profile, str) or not self.profile:
            raise ConfigError("profile must be a profile name (e.g. dgx-h100) or a path to a profile YAML")
        self._check_faults()

    def _check_faults(self) -> None:
        from prism_plugin.config.faults import Crash, Hang, Kill, check_fault_ranks, parse_faults

        object.__setattr__(self, "faults", parse_faults(self.faults))
        check_fault_ranks(self.faults, self.world.world_size)
        check_fault_nodes(self.faults, self.world)
        for spec in self.faults:
            if isinstance(spec, Hang | Crash) and self.world.is_real(spec.rank):
                raise ConfigError(
                    f"fault {spec.to_text()!r}: rank {spec.rank} is a real rank; {spec.kind.value} applies to a "
                    "virtual rank (to stop a real rank, use kill:rank=R,step=S)"
                )
            if isinstance(spec, Kill) and not self.world.is_real(spec.rank):
                raise ConfigError(
                    f"fault {spec.to_text()!r}: rank {spec.rank} is virtual; kill stops a real rank's process "
                    f"(real ranks: {list(self.world.real_ranks)}); for a virtual rank use crash:rank=R,step=S"
                )


def check_fault_nodes(specs: Sequence[FaultSpec], world: VirtualWorld) -> None:
    """Raise a `ConfigError` naming the fault when a ``link:nodes=A/B`` side names a node the job lacks.

    Nodes are ``rank // gpus_per_node``, so the job has ``world.num_nodes`` of them, e.g. 8 ranks of 8 per node
    -> node 0 only: ``link:nodes=0/5`` is refused (it would never cross any group).
    """
    from prism_plugin.config.faults import SlowLink

    for spec in specs:
        if isinstance(spec, SlowLink) and spec.by_node:
            bad = sorted(n for n in set(spec.side_a + spec.side_b) if not 0 <= n < world.num_nodes)
            if bad:
                raise ConfigError(
                    f"fault {spec.to_text()!r}: nodes {bad} do not exist: the job has {world.num_nodes} node(s) "
                    f"(world_size={world.world_size} / gpus_per_node={world.gpus_per_node}), numbered "
                    f"0..{world.num_nodes - 1}; name existing nodes, or the ranks with link:ranks=A/B"
                )
