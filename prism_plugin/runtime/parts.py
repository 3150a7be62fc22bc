"""What a session is built from: its clock, cost model and op observers, made from the config before the session.

`build_parts` reads the config (and the rank's settings plumbing, ``PRISM_KINETO``) and makes each part the
config asks for; `prism_plugin.runtime.session.Session` receives them (`activate` builds them, a test may hand
in its own) and only wires them to comm's op context. So what a session observes and how it keeps time is
decided here, in one place, and the session holds no constructor logic of its own.

    clock     the wall clock (`WallClock`: ops sleep to their modelled end), or the virtual GPU's emulated
              clock (`VirtualTime`: nothing sleeps) when one runs with virtual time
    observers replayed arrivals (``graph``), live faults, the replayer (``replay``), the recorder (``record``),
              the tracer (``trace``), the timeline (``output``), torch.profiler ranges, the Kineto trace
              (``PRISM_KINETO`` on virtual time); in the order of `prism_plugin.comm.context`
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.comm.context import OpObserver
from prism_plugin.comm.recording import Recorder, Replayer
from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.kinds import DataPolicy, DeviceMode
from prism_plugin.config.nccl import nccl_from_environ
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.profiles import HardwareProfile
from prism_plugin.device.op_clock import EmulationClock, WallClock

__all__ = ["SessionParts", "build_parts"]


@dataclass(kw_only=True, slots=True)
class SessionParts:
    """A session's clock, cost model and op observers (None: the config does not ask for that observer)."""

    profile: HardwareProfile
    cost_model: CostModel
    op_clock: Any
    """`WallClock`, or the virtual GPU's `VirtualTime` (an op observer that advances with each op)."""
    virtual_time: Any | None
    """The virtual GPU's emulated clock when it keeps the time, else None."""
    timing: bool
    """Whether ops take their modelled time (sleeping on the wall clock, advancing a virtual one)."""
    clock: EmulationClock
    replayed: Any | None = None
    faults: Any | None = None
    replayer: Replayer | None = None
    recorder: Recorder | None = None
    tracer: Any | None = None
    timeline: Any | None = None
    profiler_ranges: Any | None = None
    kineto: Any | None = None

    def observers(self, counters: OpObserver) -> tuple[OpObserver, ...]:
        """The op observers in comm's order (`prism_plugin.comm.context`), `counters` and an emulated clock last."""
        found: list[OpObserver] = [o for o in (self.replayed, self.faults, self.replayer, self.recorder, self.tracer,
                                               self.timeline, self.profiler_ranges, self.kineto) if o is not None]
        found.append(counters)
        if isinstance(self.op_clock, OpObserver):  # an emulated clock advances with each op; the wall clock does not
            found.append(self.op_clock)
        return tuple(found)


def _virtual_time(config: EmulationConfig) -> Any:
    """The active virtual GPU's emulated clock (`prism_plugin.device.clock.VirtualTime`), if any."""
    if config.device is not DeviceMode.VIRTUAL_GPU:
        return None
    from prism_plugin.device.shim import SHIM

    shim = SHIM.current()
    return None if shim is None else shim.clock


def build_parts(config: EmulationConfig, rank: int, backend: str) -> SessionParts:
    """The parts of virtual rank `rank`'s session under `config` (the program's `backend` names the trace events)."""
    world = config.world
    profile = load_profile(config.profile)
    cost_model = CostModel(profile, nccl_from_environ())  # the job's NCCL_ALGO / NCCL_NVLS_ENABLE, as NCCL reads them
    virtual_time = _virtual_time(config)
    op_clock: Any = WallClock() if virtual_time is None else virtual_time
    timing = config.timing or virtual_time is not None  # virtual time: every op takes its modelled time
    parts = SessionParts(profile=profile, cost_model=cost_model, op_clock=op_clock, virtual_time=virtual_time,
                         timing=timing, clock=EmulationClock(op_clock.now_s))
    if config.record_dir:
        parts.recorder = Recorder(config.record_dir, rank, world.world_size)
    if config.data_policy is DataPolicy.RECORDED and config.replay_dir is not None:
        parts.replayer = Replayer(config.replay_dir, rank, world.world_size)
    if config.trace_dir is not None:
        from prism_plugin.runtime.tracer import Tracer

        parts.tracer = Tracer(rank, world.world_size, config.trace_dir, config.trace_max_iterations, {
            "profile": config.profile, "real_ranks": list(world.real_ranks),
            "data_policy": config.data_policy.value, "iteration_marker": config.iteration_marker.value,
            "graph": str(config.graph) if config.graph else None,
        }, now_s=op_clock.now_s)
    if config.graph is not None:
        from prism_plugin.runtime.arrivals import load_arrivals

        parts.replayed = load_arrivals(config.graph, cost_model, rank, world.real_ranks, world.world_size,
                                       parts.clock, config.faults)  # GraphError on bad input
        parts.replayed.timing = timing
    if config.faults:
        from prism_plugin.cost.faults import FaultSet
        from prism_plugin.runtime.live_faults import LiveFaults

        parts.faults = LiveFaults(FaultSet(config.faults, world.world_size, world.gpus_per_node), rank,
                                  parts.clock, config.timeout_s)
        parts.faults.timing = timing
        if parts.replayed is not None:  # the graph's replay already delays virtual stragglers' arrivals
            parts.faults.role_of = parts.replayed._role
            parts.faults.live_stragglers = False
    from prism_plugin.runtime.timeline import Timeline, timeline_dir

    folder = timeline_dir(config.output_dir)
    if folder is not None:  # the per-rank Chrome/Perfetto timeline
        parts.timeline = Timeline(rank, world.world_size, folder, now_s=op_clock.now_s,
                                  time_name="wall" if virtual_time is None else "emulated")
        parts.timeline.faults = parts.faults  # a delayed op names the straggler blamed for it
        if virtual_time is not None:  # each kernel and op on its emulated stream's row
            virtual_time.record = parts.timeline.add_span
    from prism_plugin.runtime.profiler import ProfilerRanges

    # torch.profiler: the real backend's ranges of each op while a profile runs
    parts.profiler_ranges = ProfilerRanges(rank, backend, wall_now_s=op_clock.now_s if virtual_time is None else None)
    kineto = os.environ.get("PRISM_KINETO")
    if kineto and virtual_time is None:
        warnings.warn("PRISM_KINETO is set but this run has no virtual time (virtual-GPU mode with "
                      "PRISM_VIRTUAL_TIME=on): no Kineto trace is written", stacklevel=2)
    elif kineto:
        from prism_plugin.runtime.kineto import KinetoTrace

        parts.kineto = KinetoTrace(rank, world.world_size, Path(kineto), virtual_time, backend=backend)
        parts.kineto.attach()  # chained after the timeline's span recorder
    return parts
