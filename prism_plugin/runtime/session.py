"""The emulation session: the one process-wide owner of an active emulation.

`activate()` validates the configuration (before any process group exists), registers the `prism`
backend, and initialises torch.distributed as rank ``real_ranks[i]`` of N with a store that only
the real processes share. From then on the unmodified program's collectives reach the backend.
`deactivate()` tears it down and writes the recording, if any.

The session is comm's op context (`prism_plugin.comm.context.OpContext`): every virtual group reads this
rank, the data policy, the timeout, the op clock (`WallClock`), the cost of an op and the ordered op
observers from it (replayed arrivals, live faults, replayer, recorder, tracer, the op counters; the
order and its reasons are in `prism_plugin.comm.context`). comm imports nothing from here. The session is built
from its parts (`prism_plugin.runtime.parts`: the clock, the cost model, the observers), made by `activate` from
the config and injected, and it is held in the process's ``session`` slot (`prism_plugin.device.active`).

Seams owned here (each explicit, each undone by `deactivate`):
- `new_group` delegation (torch >= 2.13): the default group creates subgroups itself, no
  rendezvous with virtual ranks. On older torch (or with `PRISM_NEW_GROUP_DELEGATION=0`) the
  backend creator is used instead, and requests for a real side backend (``backend="gloo"``) are
  redirected to `prism`, since a real gloo group would wait forever for absent ranks.
- `broadcast_object_list` from a virtual source under the mirror policy: the virtual root sends
  what this rank holds (its own objects), so the objects deserialize instead of reading garbage.
- backend identity: the program's group reports the backend the program asked for (`activate`'s
  ``backend``; by default "gloo", or "nccl" on virtual GPUs): torch's ``get_backend(group)`` reads the
  name recorded in ``distributed_c10d._world.pg_map`` when the group was registered, so the session
  records the emulated name there (default group at activation; subgroups through torch's own
  ``new_group`` bookkeeping, or the helper redirect below), and the backend refuses what that backend
  refuses (`prism_plugin.comm.backend`). ``backend="prism"`` emulates no backend (everything accepted).
- torch DDP on virtual GPUs: its parameter-shape check on host metadata (`prism_plugin.runtime.virtual_ddp`).
- a failing collective raises its own error: torch's exception logger asks a group named "nccl" for
  ``torch.cuda.nccl.version()``, which a torch built without NCCL answers with an AttributeError.
- iteration marks of plain scripts: a global ``torch.optim`` step post-hook marks an iteration at the
  end of each optimizer step (``iteration_marker`` auto / optimizer-step); explicit
  `mark_iteration()` calls (the adapters') take over in auto mode. Each mark anchors the clock,
  closes the traced iteration (``trace_dir``) and restarts the replayed-arrival counts (``graph``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from prism_plugin.comm.backend import BACKEND_NAME, PrismProcessGroup
from prism_plugin.comm.context import OpEvent, OpObserver, OpWork
from prism_plugin.comm.group import VirtualGroup
from prism_plugin.config.emulation import ConfigError, EmulationConfig
from prism_plugin.config.kinds import ArrivalAssumption, DataPolicy, DeviceMode, IterationMarker, OpKind
from prism_plugin.cost.model import GroupPlacement
from prism_plugin.device import active
from prism_plugin.device.active import Slot
from prism_plugin.device.op_clock import WakeupStats
from prism_plugin.device.undo import Patches
from prism_plugin.runtime.parts import SessionParts, build_parts

__all__ = ["Session", "activate", "deactivate", "current_session", "mark_iteration"]

SESSION: Slot[Session] = active.slot("session")
"""The session of this process (`prism_plugin.device.active`: the owner of process-wide state)."""
_LOCK = threading.Lock()


def current_session() -> Session | None:
    """The active session of this process, if any."""
    return SESSION.current()


def _delegation_enabled() -> bool:
    return os.environ.get("PRISM_NEW_GROUP_DELEGATION", "1") != "0"



class _NoDelegationGroup(PrismProcessGroup):
    """The default group without `new_group`: torch falls back to the backend creator."""

    new_group = None  # type: ignore[assignment]


def emulated_backend(requested: Any, config: EmulationConfig) -> str:
    """The backend name the emulated program sees: the one it asked for, else "nccl" on virtual GPUs and
    "gloo" otherwise (the backends torch picks for CUDA and CPU tensors). "prism" emulates none.

    >>> from prism_plugin.config.emulation import VirtualWorld
    >>> emulated_backend(None, EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0,))))
    'gloo'
    """
    if requested is None or str(requested).strip().lower() in ("", "undefined"):
        return "nccl" if getattr(config, "device", None) is DeviceMode.VIRTUAL_GPU else "gloo"
    try:
        return str(dist.Backend(str(requested)))
    except ValueError as exc:
        raise ConfigError(f"backend={requested!r}: {exc}; name the backend the program uses (gloo, nccl)") from None


def _record_backend(pg: Any, name: str) -> None:
    """Make torch's ``get_backend(pg)`` / ``get_backend_config(pg)`` answer `name` (module docstring)."""
    world = c10d._world
    entry = world.pg_map.get(pg)
    if entry is None:
        return
    backend = dist.Backend(name)
    world.pg_map[pg] = (backend, entry[1])
    world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))


class OpCounters:
    """The last op observer but the clock: op counts and bytes per kind, the modelled communication time
    (the cost model's, before faults scale it), and which communicators NCCL would have created
    (`prism_plugin.cost.comm_memory`)."""

    __slots__ = ("rank", "op_counts", "op_bytes", "modelled_comm_s", "comm_use", "issued")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.op_counts: Counter[OpKind] = Counter()
        self.op_bytes: Counter[OpKind] = Counter()
        self.modelled_comm_s = 0.0
        self.comm_use: dict[str, list[Any]] = {}
        """Group name -> [its global ranks, a collective was used, the p2p peers used]."""
        self.issued: list[weakref.ref[OpWork]] | None = None
        """While a fast-forward records (`prism_plugin.device.fast_forward`): the handles of the ops issued since
        its last mark and of those still pending then (a work pending at a mark must be moved by its advance),
        held weakly: the program's objects die when the program lets go of them."""

    def on_op(self, event: OpEvent) -> None:
        kind = event.kind
        self.op_counts[kind] += 1
        self.op_bytes[kind] += event.size_bytes
        self.modelled_comm_s += event.model_cost_s
        vg, peer = event.group, event.peer
        use = self.comm_use.get(vg.name)
        if use is None:
            use = self.comm_use[vg.name] = [vg.global_ranks, False, set()]
        if peer is None:
            use[1] = True
        elif peer != self.rank:
            use[2].add(peer)

    def on_issued(self, event: OpEvent, work: OpWork) -> None:
        issued = self.issued
        if issued is not None:
            issued.append(weakref.ref(work))


class Session:
    """Process-wide state of one emulation: config, cost model, groups' shared parts, counters; comm's op
    context (`prism_plugin.comm.context.OpContext`)."""

    def __init__(self, config: EmulationConfig, process_index: int, real_store: dist.Store | None,
                 parts: SessionParts, backend: str = "gloo") -> None:
        """The session of real process `process_index` under `config`, made of `parts` (`build_parts`)."""
        world = config.world
        self.config = config
        self.backend_name = backend
        """The backend the program sees and whose refusals apply (`emulated_backend`)."""
        self.process_index = process_index
        self.rank = world.virtual_rank_of(process_index)
        # the op context's plain figures (the config is frozen): comm reads them on every op
        self.world_size = world.world_size
        self.real_ranks = world.real_ranks
        self.data_policy = config.data_policy
        self.timeout_s = config.timeout_s
        self.gpus_per_node = world.gpus_per_node
        self.real_store = real_store
        self.profile, self.cost_model = parts.profile, parts.cost_model
        self.op_clock, self.virtual_time, self.clock = parts.op_clock, parts.virtual_time, parts.clock
        self.timing = parts.timing
        """Whether ops take their modelled time (sleeping on the wall clock, advancing a virtual one)."""
        self.recorder, self.replayer, self.tracer = parts.recorder, parts.replayer, parts.tracer
        self.replayed, self.faults, self.timeline = parts.replayed, parts.faults, parts.timeline
        self.profiler_ranges, self.kineto = parts.profiler_ranges, parts.kineto
        self.arrivals = ArrivalAssumption.SYMMETRIC if self.replayed is None else ArrivalAssumption.REPLAYED
        self.counters = OpCounters(self.rank)
        self.observers: tuple[OpObserver, ...] = parts.observers(self.counters)
        """The op observers, in the order of `prism_plugin.comm.context` (which says why)."""
        self.groups_created = 0
        self.virtual_groups: list[VirtualGroup] = []
        """This rank's groups, in creation order (their sequence numbers: `prism_plugin.device.fast_forward`)."""
        self._placements: dict[int, GroupPlacement] = {}
        self._costs: dict[tuple[int, OpKind, int, int | None], float] = {}
        self._patches = Patches()
        self._explicit_marks = False

    # -- figures kept by the op clock and the op counters ---------------------------------------------
    @property
    def wakeups(self) -> WakeupStats:
        """How late each wait that slept woke past the emulated completion (the wall clock's)."""
        return self.op_clock.wakeups

    @property
    def op_counts(self) -> Counter[OpKind]:
        return self.counters.op_counts

    @property
    def op_bytes(self) -> Counter[OpKind]:
        return self.counters.op_bytes

    @property
    def modelled_comm_s(self) -> float:
        """The cost model's communication time of every op so far (before faults scale it)."""
        return self.counters.modelled_comm_s

    # -- groups -----------------------------------------------------------------------------
    def create_group(self, ranks: Sequence[int] | None, group_name: str | None,
                     group_desc: str | None = None, *, world: bool = False) -> PrismProcessGroup | None:
        """The prism group over `ranks` (global), or None when this rank is not a member."""
        if not world and self.rank not in ranks:  # type: ignore[operator]
            return None
        vg = VirtualGroup(self, group_name or "", None if world else ranks, group_desc or "")
        cls = _NoDelegationGroup if world and not _delegation_enabled() else PrismProcessGroup
        pg = cls(vg)
        pg.backend_name = self.backend_name  # until torch records the group's own (a side backend's) name
        if group_name is not None:
            pg.setGroupName(group_name)
        if group_desc is not None:
            pg.setGroupDesc(group_desc)
        self.groups_created += 1
        self.virtual_groups.append(vg)
        return pg

    def make_inner_group(self, prefix: str, rank: int, size: int, device_type: str,
                         timeout: timedelta) -> Any:
        """A real group among real processes (gloo on CPU, NCCL on CUDA) over the real store."""
        store = dist.PrefixStore(prefix + "/", self.real_store)
        if device_type == "cuda":
            return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        if device_type != "cpu":
            raise NotImplementedError(f"prism: no inner real backend for device type {device_type!r}")
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    # -- timing -----------------------------------------------------------------------------------
    def cost_s(self, kind: OpKind, size_bytes: int, vg: VirtualGroup, peer: int | None) -> float:
        """Emulated duration of an op on `vg` (0 when timing is off, or when the group has no virtual member and
        the wall clock times the real exchange; on virtual time every op takes its modelled time).

        A cached lookup: the op counters add each op's cost to `modelled_comm_s`."""
        if not self.timing or (vg.all_real and self.virtual_time is None):
            return 0.0
        key = (id(vg), kind, size_bytes, peer)
        cost = self._costs.get(key)
        if cost is None:
            if peer is not None:
                placement = GroupPlacement.from_ranks((self.rank, peer), self.gpus_per_node)
            else:
                placement = self._placements.get(id(vg))
                if placement is None:
                    placement = GroupPlacement.from_ranks(vg.global_ranks, self.gpus_per_node)
                    self._placements[id(vg)] = placement
            cost = self.cost_model.collective_us_placed(kind, size_bytes, placement) * 1e-6
            if len(self._costs) > 100_000:
                self._costs.clear()
            self._costs[key] = cost
        return cost

    def communicator_memory(self) -> dict[str, Any]:
        """Modelled NCCL buffer bytes of the groups this rank used (never part of the measured peak)."""
        from prism_plugin.cost.comm_memory import CommUse, NcclBufferModel

        uses = [CommUse(size=len(ranks), num_nodes=GroupPlacement.from_ranks(ranks, self.gpus_per_node).num_nodes,
                        collective=collective, p2p_peers=len(peers))
                for ranks, collective, peers in self.counters.comm_use.values()]
        return NcclBufferModel().report(uses)

    def summary(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.config.world.world_size,
            "real_ranks": list(self.config.world.real_ranks),
            "profile": self.profile.name,
            "data_policy": self.config.data_policy.value,
            "arrivals": self.arrivals.value,
            "arrivals_note": "virtual participants assumed to arrive at each op with this rank "
            "(no execution graph loaded)" if self.arrivals is ArrivalAssumption.SYMMETRIC else
            f"virtual participants arrive when the replay of execution graph {self.config.graph} says",
            "groups_created": self.groups_created,
            "iterations_marked": self.clock.iteration,
            "op_counts": {k.value: v for k, v in self.op_counts.items()},
            "op_bytes": {k.value: v for k, v in self.op_bytes.items()},
            "modelled_comm_s": round(self.modelled_comm_s, 9),
            "clock": "wall" if self.virtual_time is None else "emulated",
            "communicator_memory": self.communicator_memory(),
            "emulated_waits": {**self.wakeups.summary(), "note": "how late each wait() that slept until an "
                               "op's emulated completion woke past it: this host's scheduling, the emulator's own "
                               "timing error"},
            **({"graph": self.replayed.summary()} if self.replayed is not None else {}),
            **({"trace": self.tracer.summary()} if self.tracer is not None else {}),
            **({"timeline": self.timeline.summary()} if self.timeline is not None else {}),
            **({"kineto": self.kineto.summary()} if self.kineto is not None else {}),
            **({"faults": self._faults_summary()} if self.faults is not None else {}),
        }

    def _faults_summary(self) -> dict[str, Any]:
        """Live fault report, plus (hybrid) the graph replay's blame chain of this rank's steady step."""
        assert self.faults is not None
        out = self.faults.summary()
        if self.replayed is not None and self.replayed.blame:
            out["replay_blame"] = self.replayed.blame
        return out

    # -- iterations ---------------------------------------------------------------------------------
    def mark_iteration(self, iteration: int | None = None, *, explicit: bool = True) -> None:
        """Anchor the clock at an iteration start; close the traced iteration; restart replayed counts.

        `explicit=False` is the optimizer-step marker: ignored once an explicit mark was seen (AUTO).
        """
        if explicit:
            self._explicit_marks = True
        elif self._explicit_marks and self.config.iteration_marker is IterationMarker.AUTO:
            return
        self.clock.anchor(iteration)
        if self.tracer is not None:
            self.tracer.on_iteration(self.clock.iteration_start_s, self.clock.iteration)
        if self.replayed is not None:
            self.replayed.on_iteration(self.clock.iteration)
        if self.faults is not None:
            self.faults.on_mark(self.clock.iteration)
        if self.timeline is not None:
            self.timeline.on_mark(self.clock.iteration, self.clock.iteration_start_s)
        if self.virtual_time is not None:
            self.virtual_time.on_mark(self.clock.iteration, self.clock.iteration_start_s)
        if self.kineto is not None:
            self.kineto.on_mark(self.clock.iteration)

    # -- process-wide seams ------------------------------------------------------------------------
    def install(self) -> None:
        """Install the seams of the module docstring; `uninstall` undoes them in reverse order."""
        patches = self._patches
        original_bol = c10d.broadcast_object_list

        @functools.wraps(original_bol)
        def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                                  device: Any = None, group_src: int | None = None) -> None:
            self._queue_object_payloads(object_list, src, group, device, group_src)
            return original_bol(object_list, src=src, group=group, device=device, group_src=group_src)

        patches.setattr(c10d, "broadcast_object_list", broadcast_object_list)
        patches.setattr(dist, "broadcast_object_list", broadcast_object_list)
        if not hasattr(torch._C, "_nccl_version"):  # a failing op's own error, not the logger's, when emulating nccl
            import torch.distributed.c10d_logger as c10d_logger

            msg_dict = c10d_logger._get_msg_dict

            def get_msg_dict(func_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
                try:
                    return msg_dict(func_name, *args, **kwargs)
                except AttributeError:  # torch.cuda.nccl.version() of a torch built without NCCL
                    return {"func_name": func_name, "backend": "nccl (emulated; this torch has no NCCL)"}

            patches.setattr(c10d_logger, "_get_msg_dict", get_msg_dict)
        if getattr(self.config, "device", None) is DeviceMode.VIRTUAL_GPU:  # torch DDP on fake parameters
            from prism_plugin.runtime import virtual_ddp as ddp

            ddp.install(patches)
        self.profiler_ranges.install()  # exported profiler traces get the emulated ops' metadata and kernels
        patches.callback(self.profiler_ranges.uninstall)
        # iterations of plain scripts: the end of each optimizer step (IterationMarker)
        if self.config.iteration_marker is not IterationMarker.EXPLICIT:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            handle = register_optimizer_step_post_hook(lambda *_: self.mark_iteration(explicit=False))
            patches.callback(handle.remove)
        if not _delegation_enabled() or not hasattr(dist.ProcessGroup, "new_group"):
            original_helper = c10d._new_process_group_helper

            @functools.wraps(original_helper)
            def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
                # redirect every requested backend (gloo twins included) to prism; torch then records the
                # requested name (what get_backend(group) answers), as its new_group delegation does
                requested = kwargs.get("backend", args[3] if len(args) > 3 else None)
                if "backend" in kwargs:
                    kwargs["backend"] = BACKEND_NAME
                    kwargs.pop("backend_options", None)
                elif len(args) > 3:
                    args = args[:3] + (BACKEND_NAME,) + args[4:]
                out = original_helper(*args, **kwargs)
                pg = out[0] if isinstance(out, tuple) else out
                name = str(requested) if requested and str(requested).lower() != BACKEND_NAME else None
                if isinstance(pg, PrismProcessGroup) and name is not None and c10d._world.pg_map:
                    _record_backend(pg, name)
                return out

            patches.setattr(c10d, "_new_process_group_helper", new_process_group_helper)

    def uninstall(self) -> None:
        """Undo `install` (once; a second call does nothing)."""
        self._patches.close()

    def _queue_object_payloads(self, object_list: list[Any], src: int | None, group: Any,
                               device: Any, group_src: int | None) -> None:
        if self.config.data_policy is DataPolicy.RECORDED:
            return  # the recorded sizes and bytes replay exactly
        pg = group if group is not None else c10d._get_default_group()
        if not isinstance(pg, PrismProcessGroup):
            return
        vg = pg.vg
        root = group_src if group_src is not None else (vg.group_rank_of(src) if src is not None else 0)
        if root is None or vg.is_real(root):
            return
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

        # pickled bytes are real host bytes: under a virtual GPU's modes, made outside them and on the CPU (where its
        # object collectives run: `device._object_collectives_on_cpu`)
        on_host = bool(_get_current_dispatch_mode_stack())
        dev = torch.device("cpu") if on_host or device is None else torch.device(device)
        with (_disable_current_modes() if on_host else contextlib.nullcontext(),
              torch._C.DisableTorchFunction() if on_host else contextlib.nullcontext()):
            pairs = [c10d._object_to_tensor(obj, dev, pg) for obj in object_list]
            vg.pending_root_payloads.append(torch.cat([size for _, size in pairs]))
            vg.pending_root_payloads.append(torch.cat([tensor for tensor, _ in pairs]))


def _creator(opts: Any, backend_options: Any) -> PrismProcessGroup:
    session = SESSION.current()
    if session is None:
        raise RuntimeError("prism: the prism backend is only usable through prism_plugin.activate()")
    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default group
        pg = session.create_group(None, opts.group_id, "default_pg", world=True)
    else:
        pg = session.create_group(ranks, opts.group_id)
    assert pg is not None
    return pg


def activate(config: EmulationConfig, process_index: int = 0, real_store: dist.Store | None = None,
             init_timeout_s: float | None = None, num_processes: int | None = None,
             backend: str | None = None) -> Session:
    """Initialise torch.distributed as rank ``config.world.real_ranks[process_index]`` of N.

    `backend` is the backend the program asked for (its ``init_process_group(backend=...)``): the groups
    report it (``dist.get_backend()``) and refuse what it refuses (module docstring); None: "gloo", or
    "nccl" on virtual GPUs.

    `real_store` is a store shared by the real processes only (TCPStore/FileStore sized to the
    real process count); it is needed when there are 2+ real ranks. `num_processes`, when known
    (a launcher's process count), must equal the number of real ranks. Raises `ConfigError`
    before touching torch.distributed when the input is invalid.
    """
    if not isinstance(config, EmulationConfig):
        raise ConfigError("activate() needs an EmulationConfig(world=VirtualWorld(...), ...)")
    if num_processes is not None and num_processes != config.world.num_real:
        raise ConfigError(
            f"real_ranks lists {config.world.num_real} real ranks but {num_processes} processes were "
            f"launched; launch {config.world.num_real} processes or list {num_processes} real ranks"
        )
    rank = config.world.virtual_rank_of(process_index)  # ConfigError naming an index with no real rank
    if config.world.num_real > 1 and real_store is None:
        raise ConfigError(
            f"{config.world.num_real} real ranks need a store shared by the real processes: pass real_store=, "
            "or launch with `prism run` / torchrun (MASTER_ADDR and MASTER_PORT set)"
        )
    with _LOCK:
        if SESSION.current() is not None or dist.is_initialized():
            raise RuntimeError(
                "prism: torch.distributed is already initialised; activate() must run before "
                "init_process_group (or call prism_plugin.deactivate() first)"
            )
        name = emulated_backend(backend, config)
        session = Session(config, process_index, real_store, build_parts(config, rank, name), name)
        if os.environ.get("TORCH_DIST_INIT_BARRIER", "0") != "0":
            os.environ["TORCH_DIST_INIT_BARRIER"] = "0"  # a store barrier over N ranks would wait forever
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _creator, extended_api=True, devices=["cpu", "cuda"])
        SESSION.enter(session)
        session.install()
        try:
            dist.init_process_group(
                backend=BACKEND_NAME,
                rank=session.rank,
                world_size=config.world.world_size,
                store=dist.HashStore(),  # never contacted: the default group talks to no one
                timeout=timedelta(seconds=init_timeout_s or config.timeout_s),
            )
        except BaseException:
            session.uninstall()
            SESSION.leave(session)
            raise
        if session.backend_name != BACKEND_NAME:
            default_pg = c10d._get_default_group()
            _record_backend(default_pg, session.backend_name)
            if hasattr(c10d, "_backend"):
                session._patches.setattr(c10d, "_backend", dist.Backend(session.backend_name))
        return session


def mark_iteration(iteration: int | None = None) -> None:
    """Anchor the emulation clock at the start of a training iteration (adapters call this)."""
    session = SESSION.current()
    if session is None:
        raise RuntimeError("prism: mark_iteration() needs an active emulation (prism_plugin.activate)")
    session.mark_iteration(iteration)


def deactivate() -> dict[str, Any] | None:
    """Destroy the process groups, write the recording (if any) and return the session summary.

    Faults that never fired are said on stderr; when one of them is ``strict=true``,
    `prism_plugin.runtime.live_faults.FaultNeverFiredError` is raised after the teardown, carrying the summary.
    """
    with _LOCK:
        session = SESSION.current()
        if session is None:
            return None
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            session.uninstall()
            if session.recorder is not None:
                session.recorder.close()
            if session.tracer is not None:
                session.tracer.close()
            if session.timeline is not None:
                session.timeline.write()
            if session.kineto is not None:
                session.kineto.write()
            SESSION.leave(session)
        summary = session.summary()
        if session.faults is not None:
            strict = session.faults.report_never_fired()
            if strict is not None:
                from prism_plugin.runtime.live_faults import FaultNeverFiredError

                summary["faults"]["strict_failure"] = strict
                raise FaultNeverFiredError(strict, summary)
        return summary
