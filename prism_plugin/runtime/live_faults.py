"""Live faults: what one real rank's ops see of the job's faults (`prism_plugin.config.faults` states the semantics).

`LiveFaults` is an op observer (`prism_plugin.comm.context`), in the session's list once faults are
configured (absent otherwise). `on_op` moves the op's arrival later (stragglers arrive late), scales its
cost (degraded links, jitter) and, for a hung or crashed member, sets the failure whose error the op's
`wait()` raises and when; `on_issued` remembers the ops shared with a straggler until they complete.
`Session.mark_iteration` calls `on_mark`, which carries out a `kill` of this real rank.

Report (`summary()`, under "faults" in the session summary): per step, how long this rank waited on
faulty ranks, on whom (the blame chain runs from this real rank to the faulty rank: live, every wait is
on a direct member of the op's group), plus the hang/crash events with their op and timing, and
``never_fired``: the hangs and crashes whose group, op or step never occurred on this rank (each said on
stderr at exit too; a ``strict=true`` one makes `Session` raise `FaultNeverFiredError`).

When a hang fires is decided by one clock on every real rank (`prism_plugin.config.faults`, hang): this rank's
own ops on groups matching the hang's group, counted from its step. The event's ``step`` is the step the
faulty rank stopped in (the same on every real rank of a symmetric job); ``raised_at_step`` the step of this
rank's failing op (later when this rank shares no group with the faulty rank at the op it stopped before).

Non-goals: a real rank's own compute is not slowed (a real straggler is modelled by delaying its
arrivals, as every other rank's view of it is); no partial data is delivered by a failing op.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prism_plugin.comm.context import OpEvent, OpWork
from prism_plugin.config.faults import (
    Crash,
    Hang,
    desc_role,
    gloo_timeout_message,
    graph_role_matches,
    nccl_watchdog_message,
    peer_closed_message,
)
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost.faults import FaultSet

__all__ = ["LiveFaults", "MAX_WAITS", "OpFailure", "FaultNeverFiredError"]

MAX_WAITS = 20_000
"""Delayed ops kept for timelines (`LiveFaults.waits`); the per-step blame counts every one."""


class FaultNeverFiredError(RuntimeError):
    """A ``strict=true`` hang or crash never fired; `summary` is the session summary (already complete)."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.summary = summary


class OpFailure:
    """How a faulty op ends: `error` is raised by wait() once the op clock reaches `raise_at_s`; `on_raise`
    (if any) is told just before (`raised`)."""

    __slots__ = ("raise_at_s", "error", "fault", "on_raise")

    def __init__(self, raise_at_s: float, error: BaseException, fault: str,
                 on_raise: Callable[[OpFailure], None] | None = None) -> None:
        self.raise_at_s = raise_at_s
        self.error = error
        self.fault = fault
        self.on_raise = on_raise

    def raised(self) -> None:
        if self.on_raise is not None:
            self.on_raise(self)


class LiveFaults:
    """Per-op fault decisions of one real rank."""

    def __init__(self, faults: FaultSet, rank: int, clock: Any, timeout_s: float) -> None:
        self.faults = faults
        self.rank = rank
        self.clock = clock
        self.timeout_s = timeout_s
        self._sync_s = 0.0  # end of the last op shared with a straggler that this rank waited for
        self._open: deque[Any] = deque(maxlen=256)  # ops shared with a straggler, not yet waited for
        self._track = False
        self._hang_counts = [0] * len(faults.hangs)  # this rank's ops on matching groups from the hang's step
        self._hang_matched = [0] * len(faults.hangs)  # ... at any step (0: the group never occurred)
        self._hung: dict[int, tuple[Hang, int]] = {}  # rank -> (the hang that stopped it, the step it stopped in)
        self._crashed = [False] * len(faults.crashes)
        self._max_step = 0
        self._roles: dict[int, tuple[Any, str, str, tuple[str | None, ...]]] = {}  # id(group) -> its names' roles
        self._links: dict[int, float] = {}
        self._named: dict[int, tuple[Any, frozenset[int]]] = {}  # id(group) -> (group, fault ranks in it)
        self._fault_ranks = frozenset(
            [r for st in faults.stragglers for r in st.ranks] + [f.rank for f in (*faults.hangs, *faults.crashes)])
        self.steps: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.waits: list[tuple[float, float, int, str, str, int, int]] = []
        """Each delayed op, for timelines (`timeline`): (from perf_counter s, waited s, on rank, op, group, seq,
        step); the first `MAX_WAITS` kept."""
        self._event_at: list[float] = []
        self.extra_comm_s = 0.0
        self.timing = True
        """False with ``EmulationConfig.timing=False``: only hangs, crashes and kills apply."""
        self.live_stragglers = True
        """False with an execution graph: its replay (with the faults) gives the virtual arrivals."""
        self.role_of: Any = None
        """Group -> role of the loaded execution graph (set by the session when a graph is loaded)."""

    # -- per op -------------------------------------------------------------------------------
    def on_op(self, event: OpEvent) -> None:
        """This rank's op ``event.seq`` on ``event.group``: its effective arrival, its cost, its failure if any."""
        faults = self.faults
        vg, kind, seq, peer, own_arrival_s = event.group, event.kind, event.seq, event.peer, event.issue_s
        step = self.clock.iteration
        members: Any = (self.rank, peer) if peer is not None else vg.global_ranks
        named = frozenset(r for r in (self.rank, peer) if r in self._fault_ranks) if peer is not None \
            else self._named_in(vg)
        failure = self._failure(event, own_arrival_s, named, step)
        if failure is not None:
            event.failure = failure
        if vg.all_real or not self.timing:  # timing off: ops complete when their data is ready
            return
        arrival_s, cost_s = event.arrival_s, event.cost_s
        if faults.stragglers and not self.live_stragglers and arrival_s > own_arrival_s:
            _, who = faults.straggler_factor(named, step)
            if who >= 0:  # hybrid: the replay delayed this op; blame the slowest straggler member
                self._blame(step, who, own_arrival_s, arrival_s - own_arrival_s, vg, kind, seq)
        if cost_s > 0.0 and (faults.links or faults.jitters):
            factor = self._cost_factor(vg, members, peer, seq)
            self.extra_comm_s += cost_s * (factor - 1.0)
            cost_s *= factor
        if faults.stragglers and self.live_stragglers:
            factor, who = faults.straggler_factor(named, step)
            if who >= 0:
                self._settle()
                t0 = max(self.clock.iteration_start_s, self._sync_s)
                late_s = t0 + factor * (own_arrival_s - t0)
                if late_s > arrival_s:
                    self._blame(step, who, arrival_s, late_s - arrival_s, vg, kind, seq)
                    arrival_s = late_s
                self._track = True
        event.arrival_s, event.cost_s = arrival_s, cost_s

    def _named_in(self, vg: Any) -> frozenset[int]:
        """The ranks named by stragglers, hangs and crashes that are members of `vg` (cached per group)."""
        entry = self._named.get(id(vg))
        if entry is None:
            ranks = frozenset(r for r in self._fault_ranks if vg.group_rank_of(r) is not None)
            entry = self._named[id(vg)] = (vg, ranks)
        return entry[1]

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        """The work of the op `on_op` just decided: remembered while open when it was shared with a straggler."""
        if self._track:
            self._track = False
            self._open.append(work)

    def _settle(self) -> None:
        """Ops shared with a straggler that completed (were waited for): both ranks left them at their end."""
        while self._open and self._open[0].is_completed_flag():
            self._sync_s = max(self._sync_s, self._open.popleft().deadline_s)

    def _cost_factor(self, vg: Any, members: Any, peer: int | None, seq: int) -> float:
        faults = self.faults
        if peer is not None:
            return faults.link_factor(members) * faults.jitter(f"{vg.name}>{peer}", seq)
        link = self._links.get(id(vg))
        if link is None:  # a group's members never change: test the links once per group
            link = self._links[id(vg)] = faults.link_factor(members)
        return link * faults.jitter(vg.name, seq)

    def _failure(self, event: OpEvent, arrival_s: float, named: frozenset[int], step: int) -> OpFailure | None:
        faults = self.faults
        if not (faults.hangs or faults.crashes):
            return None
        if step > self._max_step:
            self._max_step = step
        vg, kind, seq, peer = event.group, event.kind, event.seq, event.peer
        for i, hang in enumerate(faults.hangs):  # the one clock: this rank's own ops on matching groups
            if hang.rank in self._hung or not self._matches(hang.group, vg, peer):
                continue
            self._hang_matched[i] += 1
            if step >= hang.step:
                self._hang_counts[i] += 1
                if self._hang_counts[i] >= hang.op:
                    self._hung[hang.rank] = (hang, step)
        if not named:
            return None
        holds = named.__contains__
        for i, crash in enumerate(faults.crashes):
            if step >= crash.step and holds(crash.rank):
                self._crashed[i] = True
                text = crash.to_text()
                if event.device_type == "cuda":  # a dead NCCL peer is not detected: the op times out
                    return self._timeout(event, arrival_s, crash.rank, text, crash.step, step)
                self._event("crash", text, crash.rank, vg, kind, seq, crash.step, step, arrival_s, 0.0)
                return OpFailure(arrival_s, RuntimeError(peer_closed_message(crash.rank)), text, self.on_raise)
        for rank, (hang, stopped_in) in self._hung.items():
            if holds(rank):
                return self._timeout(event, arrival_s, rank, hang.to_text(), stopped_in, step)
        return None

    def _timeout(self, event: OpEvent, arrival_s: float, culprit: int, text: str, stopped_in: int,
                 step: int) -> OpFailure:
        vg, kind, seq = event.group, event.kind, event.seq
        if event.device_type == "cuda":
            message = nccl_watchdog_message(self.rank, seq, kind.name.replace("_", ""), event.numel, self.timeout_s)
        else:
            message = gloo_timeout_message(self.timeout_s)
        self._event("hang", text, culprit, vg, kind, seq, stopped_in, step, arrival_s, self.timeout_s)
        return OpFailure(arrival_s + self.timeout_s, RuntimeError(message), text, self.on_raise)

    def _matches(self, selector: str, vg: Any, peer: int | None) -> bool:
        """Whether `vg` is a group the hang's `group=` names (a vocabulary name: `prism_plugin.config.faults`).

        The group's description, then its name, stand for a vocabulary name (`desc_role`: Megatron's
        TENSOR_MODEL_PARALLEL_GROUP and a script's "tp0" are "tp"); with an execution graph loaded, its
        role of the group ("cp-dp" is "dp_cp") too."""
        if not selector:
            return True
        if selector == "world":
            return bool(vg.is_world)
        desc, name = str(getattr(vg, "desc", "") or ""), str(vg.name or "")
        entry = self._roles.get(id(vg))
        if entry is None or entry[1] != desc or entry[2] != name:  # descs may be set after creation
            entry = self._roles[id(vg)] = (vg, desc, name, (desc_role(desc), desc_role(name)))
        if selector in entry[3]:
            return True
        if self.role_of is not None and peer is None:
            try:
                return graph_role_matches(selector, str(self.role_of(vg)))
            except ValueError:
                return False
        return False

    # -- report ------------------------------------------------------------------------------------
    def _blame(self, step: int, who: int, from_s: float, waited_s: float, vg: Any, kind: OpKind, seq: int) -> None:
        if len(self.waits) < MAX_WAITS:
            self.waits.append((from_s, waited_s, who, kind.value, vg.name, seq, step))
        entry = self.steps.setdefault(step, {"step": step, "waited_s": 0.0, "ops": 0, "on": {}, "longest": None})
        entry["waited_s"] += waited_s
        entry["ops"] += 1
        entry["on"][who] = entry["on"].get(who, 0.0) + waited_s
        longest = entry["longest"]
        if longest is None or waited_s > longest["waited_s"]:
            entry["longest"] = {"waited_s": waited_s, "on_rank": who, "op": kind.value, "group": vg.name, "seq": seq}

    def _event(self, what: str, fault: str, culprit: int, vg: Any, kind: OpKind, seq: int, step: int,
               raised_at_step: int, at_s: float, after_s: float) -> None:
        """`step`: where the faulty rank stopped (one definition on every real rank); `raised_at_step`: this
        rank's step at the failing op."""
        if len(self.events) < 64:
            self._event_at.append(at_s)
            self.events.append({"event": what, "fault": fault, "step": step, "raised_at_step": raised_at_step,
                                "rank": culprit, "op": kind.value, "group": vg.name,
                                "group_desc": str(getattr(vg, "desc", "") or ""), "seq": seq,
                                "raises_after_s": after_s, "blame_chain": [self.rank, culprit]})

    def timeline(self, origin_s: float) -> dict[str, Any]:
        """The delayed ops and the fault events on a clock starting at perf_counter `origin_s` (a probe's).

        ``{"waits": [{"t_s", "dur_s", "on_rank", "op", "group", "seq", "step"}, ...], "events": [...]}``, an
        event being a `summary` event plus ``t_s`` (when the failing op was issued).
        """
        waits = [{"t_s": round(t - origin_s, 9), "dur_s": round(d, 9), "on_rank": who, "op": op, "group": group,
                  "seq": seq, "step": step} for t, d, who, op, group, seq, step in self.waits]
        events = [{"t_s": round(t - origin_s, 9), **e} for t, e in zip(self._event_at, self.events, strict=True)]
        return {"waits": waits, "events": events, "waits_truncated": len(self.waits) >= MAX_WAITS}

    def on_raise(self, failure: OpFailure) -> None:
        """Called by the work just before it raises: the error reaches the program now."""
        print(f"prism: fault {failure.fault}: rank {self.rank} raises {failure.error}", file=sys.stderr, flush=True)

    def on_mark(self, step: int) -> None:
        """At an iteration mark: carry out a `kill` of this real rank due at `step`."""
        for kill in self.faults.kills:
            if kill.rank == self.rank and step == kill.step:
                print(f"prism: fault kill:rank={kill.rank},step={kill.step}: real rank {self.rank} (pid {os.getpid()}) "
                      "is killed now (SIGKILL)", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(10)  # not reached: SIGKILL cannot be caught

    def never_fired(self) -> list[tuple[Hang | Crash, str]]:
        """The hangs and crashes that never fired on this rank, each with why (its group, op or step never
        occurred here)."""
        out: list[tuple[Hang | Crash, str]] = []
        last = max(self._max_step, self.clock.iteration)
        for i, hang in enumerate(self.faults.hangs):
            if hang.rank in self._hung:
                continue
            where = f"a {hang.group!r} group" if hang.group else "any group"
            if not self._hang_matched[i]:
                why = f"no op of this rank ran on {where}"
                if hang.group:
                    why += " (no group's description names it: see prism_plugin.config.faults for the names)"
            elif last < hang.step:
                why = f"the run ended at step {last}, before step {hang.step}"
            else:
                why = (f"only {self._hang_counts[i]} op(s) on {where} from step {hang.step} (op={hang.op}; "
                       f"{self._hang_matched[i]} in all)")
            out.append((hang, why))
        for i, crash in enumerate(self.faults.crashes):
            if not self._crashed[i]:
                why = (f"the run ended at step {last}, before step {crash.step}" if last < crash.step else
                       f"no op of this rank involved rank {crash.rank} from step {crash.step} on")
                out.append((crash, why))
        return out

    def report_never_fired(self) -> str | None:
        """Say each fault that never fired on stderr; the text of the strict ones' failure (None: none)."""
        strict = []
        for spec, why in self.never_fired():
            line = f"prism: fault {spec.to_text()}: never fired on rank {self.rank}: {why}"
            print(line, file=sys.stderr, flush=True)
            if spec.strict:
                strict.append(line)
        return "\n".join(strict) if strict else None

    def summary(self) -> dict[str, Any]:
        steps = []
        for step in sorted(self.steps):
            e = self.steps[step]
            on = sorted(e["on"].items(), key=lambda kv: -kv[1])
            steps.append({
                "step": step, "waited_s": round(e["waited_s"], 9), "ops_delayed": e["ops"],
                "waited_on": [{"rank": r, "waited_s": round(s, 9)} for r, s in on],
                "longest_wait": {**e["longest"], "waited_s": round(e["longest"]["waited_s"], 9)},
                "blame_chain": [self.rank, on[0][0]],
            })
        return {
            "specs": [s.to_text() for s in self.faults.specs],
            "extra_comm_s": round(self.extra_comm_s, 9),
            "steps": steps,
            "events": list(self.events),
            "never_fired": [{"fault": spec.to_text(), "why": why, "strict": spec.strict}
                            for spec, why in self.never_fired()],
        }
