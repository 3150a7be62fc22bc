"""The Megatron-core adapter: what an emulated process needs beyond the `prism` backend.

`MegatronAdapter(session).install()` runs after `prism_plugin.activate` and before the training
program builds its model. Every seam is explicit, listed here, and undone by `uninstall()`:

1. **CPU mode** (torch without CUDA): the numbered `cpu_shim` patches, and Megatron's GPU-only
   fusion defaults switched off on every namespace megatron.training's ``parse_args`` returns
   (`refusals.switch_offs`: one printed line each, ``switched_off`` in the summary; the native
   patch, already inside ``parse_args``, calls `MegatronAdapter.apply_switch_offs` itself).
   **Virtual-GPU mode** (``virtual_gpu=True``, device mode virtual-gpu: the runtime's virtual GPU is
   started): no CPU shim (Megatron takes its GPU paths on fake ``cuda`` tensors); its fused kernels
   (``@jit_fuser`` functions, apex's gradient-accumulation GEMM, the masked-softmax extensions) are one
   kernel each (`fused_kernels`), so only the virtual-GPU switch-offs of `refusals.switch_offs` apply (the
   data loader's worker processes among them);
   the device is the virtual GPU's current one; the other seams below are the same, but for 5 (a fake
   tensor has no values to be degenerate, and the all-zero test would be a data-dependent read).
2. **Device mapping**: physical process i uses physical device ``world.device_of(i)`` (CUDA) or
   the CPU; a virtual rank's LOCAL_RANK never selects a device. Megatron's own
   ``torch.cuda.set_device(args.local_rank)`` is skipped because torch.distributed is already
   initialised when Megatron's initialisation runs.
3. **Iteration marks**: each training call of a Megatron forward-backward schedule
   (``forward_backward_{no_pipelining, pipelining_without_interleaving,
   pipelining_with_interleaving}``) anchors the emulation clock (`prism_plugin.mark_iteration`). A
   forward-only call (evaluation: ``--eval-iters`` of them every ``--eval-interval`` and at the end of
   training) is not an iteration: it is counted (``evaluation_calls``) and its time falls into the iteration
   under way, the one the next training call closes (Megatron's own iteration timer stops around evaluation).
4. **Rank N-1 logs**: when rank N-1 is virtual, what Megatron keeps on the last rank (the
   training log line, `print_rank_last`, ``is_last_rank()`` writers, timers, TensorBoard,
   W&B, one-logger) is produced by the lowest real rank; `print_rank_0` output likewise when rank
   0 is virtual. Said once on stdout. See `logs`.
5. **Pipeline receives** from virtual neighbours (mirror policy): an all-zero receive (nothing to
   mirror) becomes deterministic normal values; likewise a tied output layer whose first stage is
   virtual. See `pipeline`.
6. **TP data broadcast** (mirror policy): a real rank whose tensor-parallel rank 0 is virtual
   receives a synthetic, valid batch instead of its uninitialised receive buffers, and the run
   flags megatron.training broadcasts from a virtual rank 0 are set as rank 0 would. See `data`.
7. **Checkpoints** (virtual GPUs): ``--save`` writes nothing and reports its bytes, modelled time and
   memory; ``--load`` of a real checkpoint reads its metadata, never its values. See `checkpoint`.

Group construction needs no hook: megatron's ``create_group`` reaches the backend's
``new_group`` (torch >= 2.13) or creator, gloo twins included, with no rendezvous; `groups`
checks the memberships against Megatron's own ``RankGenerator``. Pipeline transfers to virtual
neighbours are the backend's p2p (receives mirror the last tensor sent with that shape).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

from prism_plugin.adapters.megatron import compat
from prism_plugin.adapters.megatron.cpu_shim import CpuShim
from prism_plugin.device.active import Slot, slot
from prism_plugin.device.undo import Patches

__all__ = ["MegatronAdapter", "rebind_everywhere", "current_adapter"]

_ADAPTER: Slot[MegatronAdapter] = slot("megatron_adapter")
"""The installed adapter of this process (`prism_plugin.device.active`)."""

_SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_FAST_FORWARDED = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                   "forward_backward_pipelining_with_interleaving")
"""The schedules whose steady state is fast-forwarded (`fast_forward.ScheduleFastForward`)."""


def current_adapter() -> MegatronAdapter | None:
    """The installed adapter of this process, if any."""
    return _ADAPTER.current()


def rebind_everywhere(original: Any, replacement: Any, patches: Patches,
                      prefixes: tuple[str, ...] | None = None) -> int:
    """Replace `original` by `replacement` in every loaded module that holds it (under `prefixes` if given).

    Megatron imports helpers by name (``from megatron.training.utils import is_last_rank``), and so do
    launch scripts written like upstream's (``from megatron.core.utils import get_batch_on_this_tp_rank``
    at module level of ``__main__``, bound before the native patch activates the emulation inside
    ``parse_args``), so a patch of the defining module alone misses them. By default every loaded module
    is searched (``__main__`` and the program's own modules included); only bindings that *are* `original`
    (identity) change. Each replacement is undone when `patches` closes. Returns how many were replaced.
    """
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or (prefixes is not None and not name.startswith(prefixes)):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                patches.setattr(module, attr, replacement)
                count += 1
    return count


class MegatronAdapter:
    """Installs the Megatron seams for the active session (see the module docstring)."""

    def __init__(self, session: Any, *, cpu_mode: bool | None = None, redirect_logs: bool = True,
                 fix_tp_data: bool = True, import_training: bool | None = None, virtual_gpu: bool = False,
                 policy_defaults: tuple[dict[str, Any], ...] = (), stop_at_iteration: int | None = None) -> None:
        self.session = session
        self.virtual_gpu = virtual_gpu
        self.cpu_mode = False if virtual_gpu else (not torch.cuda.is_available()) if cpu_mode is None else cpu_mode
        self.redirect_logs = redirect_logs
        self.fix_tp_data = fix_tp_data
        self.import_training = import_training
        self.shim: CpuShim | None = None
        self.log_rank: int | None = None
        """The real rank that writes rank N-1's logs (None when N-1 is real)."""
        self.device: torch.device = torch.device("cpu")
        self._patches = Patches()
        self._p2p_fills = [0]
        self._tp_fills = [0]
        self.moe_routing: Any = None
        """Virtual GPUs: the MoE routing policy (`moe.RoutingPolicy`) answering the dispatcher's token counts."""
        self.switched_off: list[str] = []
        """The flags of the switch-offs applied (`refusals.switch_offs`), in order."""
        self.host_calls: Any = None
        """Host-hardware calls skipped on virtual GPUs (`host_calls`), for the summary."""
        self.policy_defaults = policy_defaults
        """Settings the launch left to a policy default (``setting``, ``value``, ``reason``), for the summary."""
        self.checkpoints: Any = None
        """Virtual GPUs: the checkpoint seams' records (`checkpoint.CheckpointSeams`)."""
        self.fast_forward: Any = None
        """Virtual GPUs: the 1F1B schedule's fast-forward (`fast_forward.ScheduleFastForward`), when on."""
        self.timers: Any = None
        """Virtual GPUs with virtual time: Megatron's timers on the emulated clock (`timers.TimerSeams`)."""
        self.stop_at_iteration = stop_at_iteration
        """``--prism-stop-at-iteration K``: the run ends at the iteration mark that starts iteration K."""
        self.stopped_at: int | None = None
        self.stop_refused: str | None = None
        self._requests: Any = None
        self._stop_reached = False
        """The mark that starts K has passed (the stop acts once: the run ended there, or iteration K runs)."""
        self.evaluation_calls = 0
        """Forward-only schedule calls (evaluation): not iteration marks."""

    # -- install / uninstall -------------------------------------------------------------------------
    def install(self) -> MegatronAdapter:
        if _ADAPTER.current() is not None:
            raise RuntimeError("prism: a Megatron adapter is already installed in this process")
        compat.import_megatron_core()
        training = self.import_training
        if training is None:
            training = "megatron.training" in sys.modules
        if training:
            compat.import_megatron_training()
        try:
            self._select_device()
            if self.cpu_mode:
                self.shim = CpuShim().install()
            elif self.virtual_gpu:  # the local spec's norm with sequence parallelism (the CPU shim's patch 10)
                from prism_plugin.adapters.megatron.cpu_shim import install_sp_norm

                install_sp_norm(self._patches)
                from prism_plugin.adapters.megatron import fused_kernels  # @jit_fuser and CUDA extensions: 1 kernel

                fused_kernels.install(self._patches)
                from prism_plugin.adapters.megatron import triton_kernels  # MLA's rotary kernels: 1 kernel each

                triton_kernels.install(self._patches)
                from prism_plugin.adapters.megatron import host_calls  # host-hardware calls: skipped, counted

                self.host_calls = host_calls.install(self._patches)
                from prism_plugin.adapters.megatron import attention  # --prism-attention flash: fused attention

                if attention.attention_mode() is attention.AttentionMode.FLASH:
                    self.attention = attention.install(self._patches, virtual_gpu=True)
                from prism_plugin.adapters.megatron import moe  # MoE token counts from the routing policy

                self.moe_routing = moe.install(self._patches)
                from prism_plugin.adapters.megatron import activation_offload  # fake activations offloaded too

                activation_offload.install(self._patches)
                from prism_plugin.adapters.megatron import fsdp_chunks  # Megatron-FSDP's uneven shards' offsets
                from prism_plugin.device.device import current_gpu

                gpu = current_gpu()
                if gpu is not None:
                    fsdp_chunks.install(self._patches, gpu.values)
                    fsdp_chunks.install_rng_sync(self._patches, gpu.values)
                self.timers = self._start_timers()
                if training:  # --save / --load: nothing written, no value read (`checkpoint`)
                    from prism_plugin.adapters.megatron import checkpoint
                    from prism_plugin.cost.profiles import load_profile

                    self.checkpoints = checkpoint.install(self._patches, load_profile(self.session.config.profile)
                                                          .storage, announce=self.session.process_index == 0)
            if self.cpu_mode or self.virtual_gpu:
                self._hook_parse_args()
            self._hook_schedules()
            if not self.virtual_gpu:  # fake tensors hold no values: a virtual GPU's receive is never all-zero
                from prism_plugin.adapters.megatron import pipeline

                self._p2p_fills = pipeline.install(self.session, self._patches)
            if self.fix_tp_data:
                from prism_plugin.adapters.megatron import data

                self._tp_fills = data.install(self.session, self._patches)
            if self.redirect_logs:
                from prism_plugin.adapters.megatron import logs

                self.log_rank = logs.install(self.session, self._patches)
        except BaseException:
            self._teardown()
            raise
        _ADAPTER.enter(self)
        return self

    def uninstall(self) -> None:
        self._teardown()
        _ADAPTER.leave(self)

    def _teardown(self) -> None:
        self._patches.close()
        if self.shim is not None:
            self.shim.uninstall()
            self.shim = None

    # -- seams -----------------------------------------------------------------------------------------
    def _select_device(self) -> None:
        """Physical device of this real process: ``devices[i]`` or ``i mod local count``; never LOCAL_RANK
        of a virtual rank (the launchers set LOCAL_RANK to the physical index i). A virtual GPU: its current one."""
        if self.virtual_gpu:
            self.device = torch.device("cuda", torch.cuda.current_device())
            return
        if self.cpu_mode or not torch.cuda.is_available():
            self.device = torch.device("cpu")
            return
        world = self.session.config.world
        local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()) or 1)
        index = world.device_of(self.session.process_index, local)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"prism: real process {self.session.process_index} maps to cuda:{index} but this host has "
                f"{torch.cuda.device_count()} device(s); pass devices= (one per real rank) or launch fewer processes"
            )
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)

    def _hook_schedules(self) -> None:
        import megatron.core.pipeline_parallel.schedules as schedules

        import prism_plugin

        self.fast_forward = self._start_fast_forward()
        for name in _SCHEDULES:
            original = getattr(schedules, name)
            inner = original
            if self.fast_forward is not None and name in _FAST_FORWARDED:
                inner = self.fast_forward.wrap(original, pipelined=name != "forward_backward_no_pipelining",
                                               interleaved=name == "forward_backward_pipelining_with_interleaving")

            def marked(*args: Any, _original: Any = inner, **kwargs: Any) -> Any:
                if kwargs.get("forward_only"):
                    self.evaluation_calls += 1
                else:
                    prism_plugin.mark_iteration()
                    self._stop_if_due()
                return _original(*args, **kwargs)

            functools.update_wrapper(marked, original)
            rebind_everywhere(original, marked, self._patches)

    def _stop_if_due(self) -> None:
        """``--prism-stop-at-iteration K`` on a virtual GPU, at each iteration mark: from the mark that starts K-2 the
        allocator's blocks are numbered, from K-1's its requests recorded (`iteration_replay`); the mark that starts K
        replays them once (iteration K's memory) and ends the program (a clean ``SystemExit``, which the run absorbs)
        before any of K's work. The iterations before K are closed by that mark, so their trace, timeline and step
        times are the whole run's. When the requests cannot be replayed, iteration K runs for real and the summary
        says why."""
        k, iteration = self.stop_at_iteration, self.session.clock.iteration
        if k is None or self._stop_reached or iteration < k - 2:
            return
        if self._requests is None:  # the mark of K-2 (or the first, for K = 2): births are numbered from here
            from prism_plugin.device.device import current_gpu
            from prism_plugin.device.iteration_replay import IterationRequests

            self._requests = IterationRequests(current_gpu().allocators)
            self._requests.start()
        if iteration == k - 1:
            self._requests.begin()
        if iteration < k:
            return
        from prism_plugin.cost.allocator import DeviceOutOfMemory
        from prism_plugin.device.device import current_gpu

        self._stop_reached = True
        try:
            why = self._requests.replay()
        except DeviceOutOfMemory as exc:
            raise torch.OutOfMemoryError(f"{exc} (iteration {iteration}'s requests, replayed)") from None
        if why is not None:
            self.stop_refused = why
            print(f"prism: --prism-stop-at-iteration {k}: iteration {k} runs: {why}", file=sys.stderr, flush=True)
            return
        self.stopped_at = iteration
        current_gpu().tracker.disown()
        print(f"prism: --prism-stop-at-iteration {k}: the run ends where iteration {k} starts (its allocator "
              f"requests replayed: {self._requests.replayed['mallocs']} mallocs)", file=sys.stderr, flush=True)
        raise SystemExit(0)

    def _start_timers(self) -> Any:
        """Megatron's timers read the emulated clock (`timers`) when the virtual GPU keeps time; None otherwise."""
        from prism_plugin.device.device import current_gpu

        gpu = current_gpu()
        if gpu is None or gpu.clock is None:
            return None
        from prism_plugin.adapters.megatron import timers

        return timers.install(self._patches, gpu.clock)

    def _start_fast_forward(self) -> Any:
        """Virtual GPUs (with virtual time or memory only) and ``--prism-fast-forward`` on (the default): the
        schedules' seams (`fast_forward`); None otherwise."""
        if not self.virtual_gpu:
            return None
        from prism_plugin.config.virtual_time import VirtualTimeOptions
        from prism_plugin.device.device import current_gpu

        gpu = current_gpu()
        if gpu is None or not VirtualTimeOptions.from_env().fast_forward:
            return None
        from prism_plugin.adapters.megatron.fast_forward import ScheduleFastForward

        driver = ScheduleFastForward(gpu, self.session, routing=self.moe_routing, host_calls=self.host_calls,
                                     attention=getattr(self, "attention", None))
        driver.install(self._patches)
        return driver

    def _hook_parse_args(self) -> None:
        """megatron.training's ``parse_args`` (wherever bound): its namespace gets the CPU-mode switch-offs."""
        arguments = sys.modules.get("megatron.training.arguments")
        if arguments is None:
            return
        original = arguments.parse_args

        @functools.wraps(original)
        def parse_args(*args: Any, **kwargs: Any) -> Any:
            namespace = original(*args, **kwargs)
            self.apply_switch_offs(namespace)
            return namespace

        rebind_everywhere(original, parse_args, self._patches)

    def apply_switch_offs(self, args: Any) -> list[str]:
        """Set the switch-offs of CPU mode or virtual GPUs on Megatron's parsed `args` (nothing on a CUDA host);
        returns their flags. Each is printed once, by the first real process, and recorded for the summary."""
        if not (self.cpu_mode or self.virtual_gpu):
            return []
        from prism_plugin.adapters.megatron.refusals import switch_offs

        offs = switch_offs(args, virtual_gpu=self.virtual_gpu)
        for off in offs:
            setattr(args, off.dest, off.value)
            if off.flag not in self.switched_off:
                self.switched_off.append(off.flag)
                if self.session.process_index == 0:
                    print(off.line("virtual GPU" if self.virtual_gpu else "CPU mode"), flush=True)
        return [off.flag for off in offs]

    def summary(self) -> dict[str, Any]:
        return {
            "cpu_mode": self.cpu_mode,
            "virtual_gpu": self.virtual_gpu,
            "cpu_patches": list(self.shim.applied) if self.shim is not None else [],
            "device": str(self.device),
            "last_rank_logs_by": self.log_rank,
            "p2p_virtual_receives_filled": self._p2p_fills[0],
            "tp_batches_filled": self._tp_fills[0],
            "switched_off": list(self.switched_off),
            **({"evaluation_calls": self.evaluation_calls} if self.evaluation_calls else {}),
            **({"attention": self.attention.summary()} if getattr(self, "attention", None) is not None else {}),
            **({"moe_routing": self.moe_routing.summary()} if self.moe_routing is not None else {}),
            **({"host_calls_skipped": self.host_calls.summary()} if self.host_calls is not None else {}),
            **({"checkpoints": self.checkpoints.summary()} if self.checkpoints is not None else {}),
            **({"fast_forward": self.fast_forward.summary()} if self.fast_forward is not None else {}),
            **({"timers": self.timers.summary()} if self.timers is not None else {}),
            **self._stop_summary(),
            "policy_defaults": [*self.policy_defaults, *self._storage_defaults()],
            **_job_figures(),
        }


    def _stop_summary(self) -> dict[str, Any]:
        """``stop_at_iteration`` when ``--prism-stop-at-iteration`` was given: where the run ended (None: at the
        job's end), the requests replayed for the iteration not run, or why they could not be."""
        if self.stop_at_iteration is None:
            return {}
        replayed = self._requests.replayed if self._requests is not None else {}
        return {"stop_at_iteration": {"stopped_at": self.stopped_at, "replayed_requests": replayed or None,
                                      "refused": self.stop_refused}}

    def _storage_defaults(self) -> list[dict[str, Any]]:
        """The storage figures a save or load took from `cost.storage`'s policy defaults."""
        if self.checkpoints is None:
            return []
        from prism_plugin.cost.storage import DEFAULTS_GBYTES_PER_S

        return [{"setting": key, "value": DEFAULTS_GBYTES_PER_S[key.removeprefix("storage.")],
                 "reason": "the profile sets no storage figure: the per-GPU share of Llama 3's checkpoint storage "
                           "(prism_plugin/cost/storage.py)"} for key in self.checkpoints.defaults_used()]


def _job_figures() -> dict[str, Any]:
    """The job's batch and Megatron's own model FLOPs per iteration (``num_floating_point_operations``, what its
    TFLOP/s/GPU log divides), from the parsed arguments; empty before Megatron parsed them, or when the program
    never imported megatron.training (importing it here would leave a half-imported package on Python 3.11)."""
    if "megatron.training.training" not in sys.modules or "megatron.training.global_vars" not in sys.modules:
        return {}
    try:
        from megatron.training.global_vars import get_args
        from megatron.training.training import num_floating_point_operations

        args = get_args()
        flops = num_floating_point_operations(args, args.global_batch_size)
    except Exception:  # arguments not parsed (the program never reached initialize_megatron)
        return {}
    return {"global_batch_size": int(args.global_batch_size), "seq_length": int(args.seq_length),
            "model_flops_per_iteration": int(flops)}
