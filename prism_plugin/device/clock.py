"""Virtual time: the emulated clock of one virtual-GPU process (DESIGN.md section 11).

`VirtualTime` keeps an emulated **host** clock and one clock per CUDA stream (the program's streams, keyed by
``(device, stream id)``, and one communication stream per process group, as NCCL keeps one per communicator).
Nothing sleeps and the wall clock is never read, so the same job gives the same times to the nanosecond on any
host:

- a kernel (an ATen op on a device tensor, `kernel`) starts at max(its launch on the host, the end of its
  stream's previous kernel) and lasts its modelled duration (`prism_plugin.device.kernels`); each
  launch advances the host by the profile's host time per launch (``kernels.launch_overhead_us``: everything
  the host spends per launch in the framework's Python, PyTorch's dispatcher and the driver);
- one call into a compiled extension (`native_call`: a TransformerEngine function) is one step of the program's
  Python however many kernels its C++ launches: its first launch pays the host time per launch, each further
  one only the driver's (``kernels.native_launch_us``), as TE's userbuffers loop of chunk GEMMs and transfers
  does;
- comm's own data steps (`untimed`: the virtual members' contributions written into a result, which a real
  backend's collective kernel writes as part of the op) launch nothing;
- a stream's position is max(host, the end of its last kernel): an event recorded there completes then;
  ``wait_event`` / ``wait_stream`` hold the stream until that time; ``query`` compares with the host;
- host work (`host_work`: DeepSpeed's CPU Adam step under ZeRO-Offload) advances the host by its modelled time;
- host-blocking calls (``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize``, ``.item()``,
  a blocking copy to the host) move the host to the device time they wait for (`sync_*`);
- as comm's `OpClock` (`prism_plugin.comm.context`): ``now_s`` is where the current stream stands (a
  collective enqueued now starts after everything before it on that stream); ``sleep_until(t)`` is ``work.wait()``:
  the current stream waits for the op's completion, the host does not block (CUDA semantics); a fault's raise
  (``record=False``: a timeout the host sees) moves the host;
- as the last `OpObserver`: each op runs on its group's communication stream, after that stream's previous op
  (``arrival_s`` moves to the stream's end) and occupies it until ``arrival_s + cost_s``; the launch costs the
  host one launch overhead;
- several real ranks: each op's arrival travels with it through the group's inner gloo group, so real ranks
  couple in emulated time only. A collective (every kind but send/recv) exchanges ``(arrival, cost)`` among the
  group's real members (`OpGroup.exchange_max`: a float64 MAX all-reduce, exact and order-free) and completes
  on every member at max(arrivals) + max(costs): each real member's arrival already holds its virtual peers'
  (with it, or from the replay); a send to a real peer sends its arrival (never blocks: an eager send completes
  at its own arrival + cost), the matching recv completes at max(the send's arrival, its own) + cost. Each
  exchange is one more op on the inner group in the program's own op order, so it adds no ordering of its own
  beyond one: the host blocks at a collective's issue until every real member issued it (and at a recv until
  its send was issued), where a GPU's host would run on. ``peer_wait_s`` sums how much later than this rank
  the ops it exchanged started (waiting for a real peer).

A future of an op (``work.get_future()``, as DDP's reducer takes each bucket's all-reduce) is complete on the host
at once (`on_future`); as a CUDA-aware future's ``wait()`` does, the current stream then waits for the op: at the
end of the backward pass it was taken in (DDP's reducer waits for every bucket there, at finalize_backward; the
shim tells the clock where a backward pass runs, `backward_depth`), or at once outside a backward pass.

So DP gradient reduction overlapping backward, TP collectives on the compute stream, and pipeline bubbles
follow from the program's own stream use. `on_mark` records iteration starts: the summary gives each step's
emulated time.

Limitations: with several real ranks, two real ranks that issue ops of two groups they share in opposite
orders deadlock at the exchange (after the job's timeout it raises naming the group and this rule), where GPUs
would run both; ops of a stream other than the current one are issued on the current one; the host's time is one
figure per launch (a CUDA graph's replay is one launch, `prism_plugin.device.graphs`), not per op or per line of
Python, and the launches after the first of one compiled-extension call at the driver's figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prism_plugin.comm.context import OpEvent, OpWork
from prism_plugin.config.kinds import OpKind
from prism_plugin.device.active import Slot, slot
from prism_plugin.device.op_clock import WakeupStats

__all__ = ["CLOCKS", "KernelRecord", "VirtualTime", "native_call"]

StreamKey = tuple[int, int] | tuple[str, str]
"""``(device, stream id)`` for a program stream, ``("comm", group name)`` for a communication stream."""

KernelRecord = Callable[[str, str, float, float], None]
"""``(row, name, start_s, end_s)``: where a timeline receives each kernel and op (None: nothing records)."""


class VirtualTime:
    """The emulated host and stream clocks of this process; comm's op clock and its last op observer."""

    name = "emulated"

    def __init__(self, *, launch_overhead_s: float, current_stream: Callable[[], tuple[int, int]],
                 native_launch_s: float | None = None) -> None:
        if launch_overhead_s < 0:
            raise ValueError(f"launch_overhead_s={launch_overhead_s!r} must be >= 0")
        if native_launch_s is not None and native_launch_s < 0:
            raise ValueError(f"native_launch_s={native_launch_s!r} must be >= 0")
        self.launch_overhead_s = launch_overhead_s
        self.native_launch_s = launch_overhead_s if native_launch_s is None else native_launch_s
        """Host seconds of a launch after the first inside one `native_call` (the driver's part alone)."""
        self.last_launch_s = launch_overhead_s
        """What the latest launch cost the host (a trace places its launch there)."""
        self._native: list[bool] = []
        """One entry while a `native_call` is open: whether it launched yet."""
        self.native_launches = 0
        self.current_stream = current_stream
        """The key of the current stream of the current device (the shim answers)."""
        self.host_s = 0.0
        self.ends: dict[Any, float] = {}
        self.wakeups = WakeupStats()  # nothing sleeps: stays empty (the wall clock's figure, for the summary)
        self.kernels = 0
        self.kernel_s = 0.0
        self.launches = 0
        self.comm_ops = 0
        self.host_syncs = 0
        self.exchanges = 0
        self.backward_depth = 0
        """How many autograd backward passes are running (the shim counts them)."""
        self._future_wait_s = 0.0
        """The latest op whose future was taken in the running backward pass (the stream waits at its end)."""
        self.peer_wait_s = 0.0
        self.host_work_s = 0.0
        """Host seconds spent computing (`host_work`), not launching."""
        self.marks: list[tuple[int, float]] = []
        self.record: KernelRecord | None = None
        self.untimed_depth = 0
        """How many `untimed` blocks are open: the device times no op while it is above 0."""

    # -- streams ---------------------------------------------------------------------------------------------
    def position(self, stream: Any) -> float:
        """When work enqueued on `stream` now would start: max(host, the stream's last end)."""
        end = self.ends.get(stream, 0.0)
        return end if end > self.host_s else self.host_s

    def kernel(self, stream: Any, duration_s: float, name: str = "") -> float:
        """Launch a kernel of `duration_s` on `stream`; returns its end."""
        start = self.position(stream)
        end = start + duration_s
        self.ends[stream] = end
        self._launch()
        self.kernels += 1
        self.launches += 1
        self.kernel_s += duration_s
        if self.record is not None:
            self.record(_row(stream), name, start, end)
        return end

    def _launch(self) -> None:
        """The host pays one launch (module docstring: the first of a `native_call` in full, later ones the
        driver's part)."""
        cost = self.launch_overhead_s
        if self._native:
            if self._native[-1]:
                cost = self.native_launch_s
                self.native_launches += 1
            else:
                self._native[-1] = True
        self.last_launch_s = cost
        self.host_s += cost

    @contextmanager
    def native_call(self) -> Iterator[None]:
        """One call into a compiled extension: its launches after the first pay `native_launch_s` (a call made
        inside one is part of it)."""
        if self._native:
            yield
            return
        self._native.append(False)
        try:
            yield
        finally:
            self._native.pop()

    def captured_launch(self) -> None:
        """A launch recorded into a CUDA graph under capture: the host pays it, no stream runs anything."""
        self._launch()
        self.launches += 1

    def host_work(self, duration_s: float, name: str = "") -> float:
        """The host computes for `duration_s` (a CPU optimizer step): it launches nothing meanwhile; returns its end.
        On the timeline's ``host`` row."""
        start = self.host_s
        self.host_s = start + duration_s
        self.host_work_s += duration_s
        if self.record is not None:
            self.record("host", name, start, self.host_s)
        return self.host_s

    def wait_until(self, stream: Any, t_s: float) -> None:
        """`stream` runs nothing before `t_s` (an event it waits on, another stream's position)."""
        if t_s > self.ends.get(stream, 0.0):
            self.ends[stream] = t_s

    def sync_host(self, t_s: float) -> None:
        """The host blocks until device time `t_s`."""
        self.host_syncs += 1
        if t_s > self.host_s:
            self.host_s = t_s

    def sync_stream(self, stream: Any) -> None:
        self.sync_host(self.ends.get(stream, 0.0))

    def sync_device(self, device: int) -> None:
        """``torch.cuda.synchronize(device)``: every stream of `device` and every communication stream."""
        ends = [t for key, t in self.ends.items() if key[0] == device or key[0] == "comm"]
        self.sync_host(max(ends, default=0.0))

    # -- comm's op clock ---------------------------------------------------------------------------------------
    @contextmanager
    def untimed(self) -> Iterator[None]:
        """A block of comm's own data steps: its ops are no kernels (they write what the collective's kernel
        writes). One process's threads take turns here (a backward hook's collective runs while the thread
        that called ``backward()`` waits), so one count serves them."""
        self.untimed_depth += 1
        try:
            yield
        finally:
            self.untimed_depth -= 1

    def now_s(self) -> float:
        return self.position(self.current_stream())

    def sleep_until(self, deadline_s: float, record: bool = True) -> None:
        if record:  # work.wait(): the current stream waits for the op; the host goes on
            self.wait_until(self.current_stream(), deadline_s)
        else:  # a fault raises on the host at its time (a timeout the host sees)
            self.sync_host(deadline_s)

    def on_future(self, deadline_s: float) -> None:
        """A future of an op completing at `deadline_s` was taken (module docstring)."""
        if self.backward_depth:
            if deadline_s > self._future_wait_s:
                self._future_wait_s = deadline_s
        else:
            self.wait_until(self.current_stream(), deadline_s)

    def end_backward(self) -> None:
        """The outermost backward pass returned: the current stream waits for the futures taken in it."""
        if self._future_wait_s > 0.0:
            self.wait_until(self.current_stream(), self._future_wait_s)
            self._future_wait_s = 0.0

    # -- the last op observer ---------------------------------------------------------------------------------
    def on_op(self, event: OpEvent) -> None:
        stream = ("comm", event.group.name)
        end = self.ends.get(stream, 0.0)
        if end > event.arrival_s:  # the group's communication stream is busy with its previous op
            event.arrival_s = end
        if getattr(event.group, "num_real", 1) > 1:
            self._exchange(event)
        completion = event.arrival_s + event.cost_s
        self.ends[stream] = completion
        self._launch()
        self.launches += 1
        self.comm_ops += 1
        if self.record is not None:
            self.record(_row(stream), event.kind.value, event.arrival_s, completion)

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        pass

    def _exchange(self, event: OpEvent) -> None:
        """The real members' arrivals (module docstring): `event` starts at the latest of them."""
        group, own = event.group, event.arrival_s
        if event.kind is OpKind.SEND or event.kind is OpKind.RECV:
            peer = group.group_rank_of(event.peer) if event.peer is not None else None
            if peer is None or not group.is_real(peer):
                return
            if event.kind is OpKind.SEND:
                group.send_word(peer, event.tag, own)
            else:
                sent = group.recv_word(peer, event.tag)
                if sent > own:
                    event.arrival_s = sent
        else:
            arrival, cost = group.exchange_max((own, event.cost_s))
            event.arrival_s, event.cost_s = arrival, cost
        event.exchanged = True
        self.exchanges += 1
        self.peer_wait_s += event.arrival_s - own

    # -- iterations and report -------------------------------------------------------------------------------
    def on_mark(self, iteration: int, start_s: float) -> None:
        self.marks.append((iteration, start_s))

    def step_times_s(self) -> list[float]:
        """Emulated duration of each marked iteration that has a successor mark."""
        return [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        steps = self.step_times_s()
        return {"clock": self.name, "host_s": round(self.host_s, 9),
                "device_s": round(max(self.ends.values(), default=0.0), 9),
                "kernels": self.kernels, "kernel_s": round(self.kernel_s, 9), "launches": self.launches,
                "launch_overhead_us": round(1e6 * self.launch_overhead_s, 6), "comm_ops": self.comm_ops,
                "host_syncs": self.host_syncs, "exchanges": self.exchanges,
                "peer_wait_s": round(self.peer_wait_s, 9),
                **({"host_work_s": round(self.host_work_s, 9)} if self.host_work_s else {}),
                **({"native_launches": self.native_launches,
                    "native_launch_us": round(1e6 * self.native_launch_s, 6)} if self.native_launches else {}),
                "streams": len([k for k in self.ends if k[0] != "comm"]),
                "comm_streams": len([k for k in self.ends if k[0] == "comm"]),
                "step_times_s": [round(s, 9) for s in steps]}


CLOCKS: Slot[VirtualTime] = slot("virtual_time", stack=True)
"""The virtual GPU's running clock (its shim enters it at `start_clock`, leaves it at teardown)."""


@contextmanager
def native_call() -> Iterator[None]:
    """One call into a compiled extension on the running clock (`VirtualTime.native_call`); nothing without one."""
    clock = CLOCKS.current()
    if clock is None:
        yield
        return
    with clock.native_call():
        yield


def _row(stream: Any) -> str:
    if stream[0] == "comm":
        return f"comm stream {stream[1]}"
    return f"cuda:{stream[0]} stream {stream[1]}"
