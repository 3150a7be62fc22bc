"""The op seam (`prism_plugin.comm.context`): one `OpEvent` per op, handed to one ordered list of observers.

Tier b: a session's observers see every op once, in order, with its figures; and a fake `OpContext`
(with a manual clock that never sleeps) drives a `VirtualGroup` and the backend with no session at all,
which shows comm needs nothing from its owner beyond the context.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.comm import collectives as C
from prism_plugin.comm.backend import PrismProcessGroup
from prism_plugin.comm.context import OpEvent, OpObserver, OpWork
from prism_plugin.comm.group import VirtualGroup
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.kinds import DataPolicy, OpKind


class Spy:
    """An observer that logs both phases of every op."""

    def __init__(self, log: list[tuple[str, Any, Any]], name: str = "spy") -> None:
        self.log = log
        self.name = name

    def on_op(self, event: OpEvent) -> None:
        self.log.append((f"{self.name}.on_op", event, None))

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        self.log.append((f"{self.name}.on_issued", event, work))


@pytest.fixture
def session():
    s = P.activate(EmulationConfig(world=VirtualWorld(world_size=16, real_ranks=(3,), gpus_per_node=8),
                                   profile="dgx-h100"))
    yield s
    P.deactivate()


def test_an_observer_sees_one_event_per_op_in_order_with_its_figures(session, monkeypatch) -> None:
    log: list[tuple[str, Any, Any]] = []
    monkeypatch.setattr(session, "observers", (*session.observers, Spy(log)))
    g = dist.new_group(list(range(8)))
    t = torch.ones(256)
    before = session.op_clock.now_s()
    dist.all_reduce(t, group=g)
    out = torch.empty(8 * 256)
    work = dist.all_gather_into_tensor(out, t, group=g, async_op=True)
    dist.send(t, dst=11)
    work.wait()
    assert [name for name, _, _ in log] == ["spy.on_op", "spy.on_issued"] * 3
    events = [e for name, e, _ in log if name == "spy.on_op"]
    assert [e for name, e, _ in log if name == "spy.on_issued"] == events  # one event object per op, both phases
    ar, ag, send = events
    assert (ar.kind, ar.group_name, ar.seq, ar.size_bytes, ar.peer) == (OpKind.ALL_REDUCE, g.group_name, 1, 1024, None)
    assert (ag.kind, ag.group_name, ag.seq, ag.size_bytes) == (OpKind.ALL_GATHER, g.group_name, 2, 8 * 1024)
    assert (send.kind, send.seq, send.peer, send.size_bytes, send.received) == (OpKind.SEND, 1, 11, 1024, [])
    assert send.group.is_world and ar.group is ag.group
    assert ar.device_type == "cpu" and ar.numel == 256 and ag.numel == 8 * 256 and send.numel == 0
    assert list(ar.received) == [t] and list(ag.received) == [out]
    for e in events:  # symmetric arrivals, no faults: the model's cost, completion = arrival + cost
        assert before <= e.issue_s == e.arrival_s and e.failure is None
        assert e.cost_s == e.model_cost_s == session.cost_s(e.kind, e.size_bytes, e.group, e.peer) > 0.0
    issued = [w for name, _, w in log if name == "spy.on_issued"]
    assert issued[1] is work and work.deadline_s == pytest.approx(ag.completion_s, abs=0.0)
    # the session's counters are an observer too: they saw the same three ops
    summary = session.summary()
    assert summary["op_counts"] == {"all_reduce": 1, "all_gather": 1, "send": 1}
    assert summary["op_bytes"] == {"all_reduce": 1024, "all_gather": 8192, "send": 1024}
    assert summary["modelled_comm_s"] == pytest.approx(sum(e.model_cost_s for e in events), abs=1e-9)


def test_the_session_orders_its_observers_as_the_seam_documents(tmp_path) -> None:
    from prism_plugin.comm.recording import Recorder
    from prism_plugin.device.op_clock import WallClock
    from prism_plugin.runtime.live_faults import LiveFaults
    from prism_plugin.runtime.profiler import ProfilerRanges
    from prism_plugin.runtime.session import OpCounters
    from prism_plugin.runtime.tracer import Tracer

    session = P.activate(EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0,)), trace_dir=tmp_path,
                                         record_dir=tmp_path / "rec", faults=("jitter:sigma=0.1,seed=1",)))
    try:
        # the profiler ranges observer is always there: it opens ranges only while a torch.profiler runs
        assert [type(o) for o in session.observers] == [LiveFaults, Recorder, Tracer, ProfilerRanges, OpCounters]
        assert all(isinstance(o, OpObserver) for o in session.observers)
        assert isinstance(session.op_clock, WallClock) and not isinstance(session.op_clock, OpObserver)
        assert dist.group.WORLD.vg.ctx is session
    finally:
        P.deactivate()


# -- a fake owner: comm with no session ----------------------------------------------------------------
class ManualClock:
    """An emulated clock: time moves only when a wait sleeps until a deadline (it jumps there)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[tuple[float, bool]] = []

    def now_s(self) -> float:
        return self.t

    def sleep_until(self, deadline_s: float, record: bool = True) -> None:
        self.slept.append((deadline_s, record))
        self.t = max(self.t, deadline_s)


class FakeContext:
    """Everything `OpContext` declares, and nothing else."""

    def __init__(self, rank: int, world_size: int, observers: Sequence[OpObserver] = ()) -> None:
        self.rank = rank
        self.world_size = world_size
        self.real_ranks = (rank,)
        self.data_policy = DataPolicy.MIRROR
        self.timeout_s = 5.0
        self.op_clock = ManualClock()
        self.observers = tuple(observers)
        self.costs: list[tuple[OpKind, int, int | None]] = []

    def cost_s(self, kind: OpKind, size_bytes: int, group: Any, peer: int | None) -> float:
        self.costs.append((kind, size_bytes, peer))
        return 0.25

    def make_inner_group(self, prefix: str, rank: int, size: int, device_type: str,
                         timeout: timedelta) -> dist.ProcessGroup:
        raise AssertionError("one real member: no inner group")

    def create_group(self, ranks: Sequence[int], group_name: str | None,
                     group_desc: str | None = None) -> PrismProcessGroup | None:
        if self.rank not in ranks:
            return None
        return PrismProcessGroup(VirtualGroup(self, group_name or "", ranks, group_desc or ""))


class Late:
    """Moves every arrival 1 s later, doubles the cost, and adds a finishing step that sees the op's data."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_op(self, event: OpEvent) -> None:
        event.arrival_s += 1.0
        event.cost_s *= 2.0
        if event.received:
            out = event.received[0]
            event.add_finish(lambda: self.seen.append(float(out[0])))

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass


def test_a_fake_context_drives_a_virtual_group_with_no_session() -> None:
    late, log = Late(), []
    ctx = FakeContext(rank=2, world_size=8, observers=[late, Spy(log)])
    pg = ctx.create_group(range(8), "g8", "fake")
    assert pg is not None and pg.vg.ctx is ctx and pg.vg.desc == "fake"
    assert ctx.create_group([0, 1], "other") is None
    t = torch.full((4,), 3.0)
    work = pg.allreduce([t])  # the backend's own entry point, no init_process_group
    assert torch.equal(t, torch.full((4,), 24.0))  # mirror: 8 members each contribute this rank's 3
    assert late.seen == [24.0]  # the observer's finishing step ran after the op's own
    assert work.deadline_s == 100.0 + 1.0 + 0.5  # issue on the context's clock, moved 1 s, cost 0.25 doubled
    assert not work.is_completed()  # the clock is at 100 s
    work.wait()
    assert ctx.op_clock.slept == [(101.5, True)] and ctx.op_clock.t == 101.5 and work.is_completed()
    sub = pg.new_group([2, 3], group_name="pair")  # subgroups come from the context too
    assert sub is not None and sub.vg.global_ranks == (2, 3)
    dist_recv = C.recv(sub.vg, [torch.empty(4)], 1, 0)
    assert ctx.costs == [(OpKind.ALL_REDUCE, 16, None), (OpKind.RECV, 16, 3)]
    assert [e.seq for name, e, _ in log if name == "spy.on_op"] == [1, 1]
    assert dist_recv.deadline_s == 101.5 + 1.0 + 0.5


class Failing:
    """Fails every op: it raises at 7 s past issue, and says so first."""

    def __init__(self) -> None:
        self.raised = 0

    def on_op(self, event: OpEvent) -> None:
        outer = self

        class Failure:
            raise_at_s = event.issue_s + 7.0
            error = RuntimeError("peer gone")

            def raised(self) -> None:
                outer.raised += 1

        event.failure = Failure()

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass


def test_a_failure_set_by_an_observer_raises_at_its_time_on_the_context_clock() -> None:
    failing = Failing()
    ctx = FakeContext(rank=0, world_size=4, observers=[failing])
    vg = VirtualGroup(ctx, "w", None)
    work = C.barrier(vg)
    assert not work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="peer gone"):
        work.wait(timedelta(seconds=2))  # a shorter wait timeout raises first
    assert ctx.op_clock.slept == [(102.0, False)] and failing.raised == 1  # a raise time is not a completion
    with pytest.raises(RuntimeError, match="peer gone"):
        work.wait()
    assert ctx.op_clock.slept[-1] == (107.0, False) and failing.raised == 2 and not work.is_completed()


def test_comm_loads_nothing_from_the_runtime() -> None:
    code = ("import sys\nimport prism_plugin.comm.backend, prism_plugin.comm.collectives, prism_plugin.comm.recording\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('prism_plugin.runtime', 'prism_plugin.adapters')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_wall_clock_records_how_late_completions_woke_and_nothing_else() -> None:
    from prism_plugin.device.op_clock import EmulationClock, WallClock

    clock = WallClock()
    clock.sleep_until(clock.now_s() - 1.0)  # already passed: not a wait
    clock.sleep_until(clock.now_s() + 0.002, record=False)  # a fault's raise time: not a completion
    assert clock.wakeups.count == 0
    deadline = clock.now_s() + 0.002
    clock.sleep_until(deadline)
    assert clock.now_s() >= deadline and clock.wakeups.count == 1 and clock.wakeups.max_s >= 0.0
    manual = ManualClock()
    anchor = EmulationClock(manual.now_s)  # the iteration anchor reads the op clock's time
    manual.t = 250.0
    anchor.anchor()
    assert (anchor.iteration, anchor.iteration_start_s, anchor.offset_s(251.0)) == (1, 250.0, 1.0)
