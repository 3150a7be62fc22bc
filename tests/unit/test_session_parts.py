"""A session is built from the parts its config asks for (`prism_plugin.runtime.parts`), injected by `activate`."""

from __future__ import annotations

from pathlib import Path

from prism_plugin.comm.context import OpObserver
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.faults import parse_faults
from prism_plugin.device.op_clock import WallClock
from prism_plugin.runtime.parts import build_parts
from prism_plugin.runtime.session import Session
from prism_plugin.runtime.tracer import Tracer


def test_the_config_decides_the_parts_and_the_session_wires_them_in_comms_order(tmp_path: Path) -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(3,)), trace_dir=tmp_path / "trace",
                             faults=parse_faults(["straggler:ranks=4,factor=2"]))
    parts = build_parts(config, 3, "gloo")
    assert isinstance(parts.op_clock, WallClock) and parts.virtual_time is None and parts.timing
    assert isinstance(parts.tracer, Tracer) and parts.faults is not None
    assert parts.recorder is parts.replayer is parts.replayed is parts.timeline is parts.kineto is None

    session = Session(config, 0, None, parts, "gloo")
    assert session.rank == 3 and session.tracer is parts.tracer and session.faults is parts.faults
    assert session.observers == (parts.faults, parts.tracer, parts.profiler_ranges, session.counters)
    assert all(isinstance(o, OpObserver) for o in session.observers)


def test_a_plain_config_has_only_the_always_on_observers() -> None:
    parts = build_parts(EmulationConfig(world=VirtualWorld(world_size=2, real_ranks=(0,)), timing=False), 0, "nccl")
    assert parts.timing is False and parts.tracer is None and parts.faults is None
    counters = object.__new__(type("Counters", (OpObserver,), {}))
    assert parts.observers(counters) == (parts.profiler_ranges, counters)
