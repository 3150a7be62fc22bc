"""The drop-in wrapper: an unmodified Megatron launch, plus the ``--prism-*`` flags.

    torchrun --nproc-per-node K -m prism_plugin.megatron pretrain_gpt.py <the job's args for N GPUs> \\
        --prism-world-size N --prism-real-ranks r1,...,rK [--prism-profile NAME] [--prism-graph FILE] \\
        [--prism-output DIR] [--prism-gpus-per-node G] [--prism-data-policy mirror|recorded|zeros] \\
        [--prism-record DIR] [--prism-replay DIR] [--prism-trace DIR] [--prism-trace-iterations K] \
        [--prism-iteration-marker auto|explicit|optimizer-step] [--prism-no-timing] \
        [--prism-fault SPEC ...] [--prism-timeout S] [--prism-device real|virtual-gpu] [--prism-gpu MODEL] \\
        [--prism-moe-routing balanced|skew:SEED[,ALPHA]] [--prism-attention local|flash] [--prism-iterations K] \\
        [--prism-stop-at-iteration K]

(or ``prism megatron ...``; without torchrun, K > 1 real ranks are launched as K local processes by the
shared watch loop of `prism_plugin.runtime.lifecycle`, as ``prism run`` does.)

What it does, in order, before the script runs:
1. strips the ``--prism-*`` flags (anywhere in the argv, ``--flag value`` or ``--flag=value``);
2. checks them (`preflight`: the script exists, the output / record / trace paths can be directories, the graph
   and the recording describe N; once, in a self-launching parent, before any process starts) and the job's
   Megatron arguments (parsed by Megatron's own parser): the layout must divide N, refused features
   (`refusals`) fail here, before any process group exists;
3. torchrun process i (its RANK) plays virtual rank ``r_{i+1}``: the environment the script sees
   becomes RANK = that virtual rank and WORLD_SIZE = N; LOCAL_RANK stays the physical index i;
4. activates the emulation with a store shared by the K real processes only (torchrun's own
   rendezvous store under a ``prism/`` prefix, or a FileStore when self-launched);
5. installs the Megatron adapter (CPU shim on a CPU-only torch, device mapping, log redirection)
   and, in CPU mode, the tensor-storage tracker (peak memory);
6. runs the script unmodified as ``__main__``; at exit prints ``PRISM_SUMMARY <json>`` and writes
   ``<output>/rank<R>.summary.json`` (`lifecycle.EmulatedRun`), also when the launcher's SIGTERM stops it.

``--prism-graph FILE`` (an execution graph from ``prism graph build``) turns on hybrid emulation: every
virtual participant arrives at each op when the graph's replay says (re-anchored each iteration, at
Megatron's optimizer step). ``--prism-trace DIR`` writes each real rank's per-iteration trace (the input
of ``prism graph build``); ``prism profile`` runs a slicing plan's profiling runs with it.

``--prism-device virtual-gpu`` (``--prism-gpu MODEL``, else the profile's GPU) trains on virtual GPUs: fake
``cuda`` tensors, exact per-device memory, no CPU shim (`virtual`: how the process is started fresh with the
device library, what is refused and switched off). Without ``--prism-profile`` and ``--prism-gpu`` it runs on
profile ``dgx-h100`` (a policy default: one line on stderr, listed in the summary's
``megatron.policy_defaults``). Messages name the settings as this entry point spells them (``--prism-*``).

``--prism-fault SPEC`` (repeatable; `prism_plugin.config.faults`) injects a fault on virtual participants
(straggler, link, jitter, hang, crash) or kills a real rank. The collective timeout is the job's own:
Megatron's ``--distributed-timeout-minutes`` (default 10), unless ``--prism-timeout S`` overrides it, so a
hung virtual peer surfaces after the time Megatron would wait at scale.

``--prism-attention flash`` (virtual GPUs; travels to the processes as ``PRISM_ATTENTION``, which ``prism emulate``'s
runs inherit) computes the local spec's core attention with fused flash attention, context parallelism included
(`attention`); ``local`` (the default) runs the program's own kernels.
"""

from __future__ import annotations

import os
import runpy
import sys

from prism_plugin.device import cuda_runtime

_PRELOADED = cuda_runtime.preload_if_launched()  # --prism-device virtual-gpu: before torch is imported (`virtual`)

import tempfile  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from prism_plugin.adapters.megatron.refusals import Refusal  # noqa: E402
from prism_plugin.config.emulation import ConfigError, EmulationConfig  # noqa: E402
from prism_plugin.config.kinds import DeviceMode  # noqa: E402
from prism_plugin.config.resolve import Settings, resolve, spellings  # noqa: E402
from prism_plugin.config.settings import Entry, flag_names  # noqa: E402

if TYPE_CHECKING:
    from prism_plugin.adapters.megatron.absent_data import Substitution
    from prism_plugin.runtime.lifecycle import EmulatedRun

__all__ = ["PrismFlags", "split_prism_flags", "main"]

_MEGATRON_TIMEOUT_MIN = 10.0  # megatron.training.arguments: --distributed-timeout-minutes default


@dataclass(frozen=True, kw_only=True, slots=True)
class PrismFlags:
    """The ``--prism-*`` flags of one launch (names without the prefix)."""

    values: dict[str, str] = field(default_factory=dict)
    switches: frozenset[str] = frozenset()

    def settings(self, environ: Mapping[str, str] | None = None) -> Settings:
        """The launch's settings (`prism_plugin.config.resolve`): these flags, then the environment aliases and the
        defaults; a `ConfigError` naming the ``--prism-*`` flag when invalid."""
        flags = flag_names(Entry.DROP_IN)
        values: dict[str, object] = {}
        for name, value in self.values.items():
            values[flags["prism-" + name].name] = value
        for name in self.switches:
            values[flags["prism-" + name].name] = False  # the only switch: --prism-no-timing
        return resolve(values, Entry.DROP_IN, environ=environ)

    def to_config(self, settings: Settings | None = None) -> EmulationConfig:
        """The EmulationConfig these flags describe (ConfigError naming the flag when invalid); `settings`: these
        flags' `settings()`, when the caller already resolved them."""
        settings = self.settings() if settings is None else settings
        graph = settings.time.graph
        if graph is not None and not graph.is_file():
            raise ConfigError(f"--prism-graph {graph}: no such file; build one with `prism graph build`")
        return settings.emulation(timeout_s=_MEGATRON_TIMEOUT_MIN * 60.0)

    def policy_defaults(self) -> tuple[dict[str, str], ...]:
        """The settings these flags leave to a policy default (``setting``, ``value``, ``reason``): the profile of a
        virtual GPU named by neither ``--prism-profile`` nor ``--prism-gpu``."""
        return self.settings().policy_defaults


def job_timeout_s(script_args: list[str]) -> float | None:
    """Megatron's ``--distributed-timeout-minutes M`` among the job's arguments, in seconds (None: absent)."""
    for i, token in enumerate(script_args):
        name, eq, value = token.partition("=")
        if name == "--distributed-timeout-minutes":
            text = value if eq else (script_args[i + 1] if i + 1 < len(script_args) else "")
            try:
                return float(text) * 60.0
            except ValueError:
                raise ConfigError(f"--distributed-timeout-minutes {text!r} must be a number of minutes") from None
    return None


def split_prism_flags(argv: list[str]) -> tuple[list[str], PrismFlags]:
    """(argv without the ``--prism-*`` flags, the flags). Unknown ``--prism-*`` flags are errors."""
    flags = flag_names(Entry.DROP_IN)
    rest: list[str] = []
    values: dict[str, str] = {}
    switches: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--prism-"):
            rest.append(token)
            i += 1
            continue
        flag, eq, value = token[2:].partition("=")
        setting = flags.get(flag)
        name = flag[len("prism-"):]
        if setting is None:
            known = ", ".join(f"--{n}" for n in flags)
            raise ConfigError(f"unknown flag --{flag}; the prism flags are {known}")
        if flag == f"prism-{setting.switch}":
            if eq:
                raise ConfigError(f"--{flag} takes no value")
            switches.add(name)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{flag} needs a value")
            value = argv[i + 1]
            i += 1
        values[name] = values[name] + ";" + value if setting.repeatable and name in values else value
        i += 1
    return rest, PrismFlags(values=values, switches=frozenset(switches))


def _check_job(config: EmulationConfig, script_args: list[str], cpu_mode: bool, ns: Any = None) -> Any:
    """Megatron's view of the job's arguments (`ns`, parsed here when None), checked against N and the refusals
    (no process group yet)."""
    from prism_plugin.adapters.megatron.attention import attention_mode, check_job
    from prism_plugin.adapters.megatron.refusals import check_args, parse_megatron_argv

    ns = parse_megatron_argv(script_args) if ns is None else ns
    check_args(ns, cpu_mode=cpu_mode, virtual_gpu=config.device is DeviceMode.VIRTUAL_GPU)
    check_job(ns, attention_mode(), virtual_gpu=config.device is DeviceMode.VIRTUAL_GPU)
    _check_layout(config, ns)
    from prism_plugin.adapters.megatron.log_values import tensorboard_note, wandb_mode

    wandb_note = wandb_mode(ns)  # every process: W&B reads WANDB_MODE from its own environment
    if os.environ.get("RANK", "0") == "0":  # once: TensorBoard flags on a host without tensorboard, W&B offline
        for note in (tensorboard_note(ns), wandb_note):
            if note is not None:
                print(note, file=sys.stderr, flush=True)
    return ns


def _rewritten(script_argv: list[str], ns: Any,
               rewrite: Callable[[list[str], Any], Substitution]) -> tuple[list[str], Any]:
    """The script's arguments as `rewrite` changes them (given its Megatron arguments and Megatron's parse `ns` of
    them, parsed here when None), and Megatron's parse of the result (None: parse the new ones); the rewrite's note
    is printed on one line (from the first process)."""
    from prism_plugin.adapters.megatron.refusals import parse_megatron_argv

    ns = parse_megatron_argv(script_argv[1:]) if ns is None else ns
    rewritten = rewrite(script_argv[1:], ns)
    if rewritten.note is None:
        return script_argv, ns
    if os.environ.get("RANK", "0") == "0":
        print(rewritten.note, file=sys.stderr, flush=True)
    return [script_argv[0], *rewritten.argv], None


def _check_layout(config: EmulationConfig, ns: Any) -> None:
    """N must fit the job's tp/pp/cp/ep layout; an execution graph must load and match N."""
    from prism_plugin.topology import MegatronLayout

    try:
        MegatronLayout(world_size=config.world.world_size, tp=ns.tensor_model_parallel_size,
                       pp=ns.pipeline_model_parallel_size, cp=ns.context_parallel_size,
                       ep=ns.expert_model_parallel_size, expert_tp=ns.expert_tensor_parallel_size)
    except ValueError as exc:
        raise ConfigError(f"--prism-world-size {config.world.world_size} does not fit the job's layout: {exc}") \
            from None
    if config.graph is not None:
        from prism_plugin.runtime.arrivals import load_job_graph

        try:
            load_job_graph(config.graph, config.world.world_size)
        except ValueError as exc:
            raise ConfigError(f"--prism-graph: {exc}") from None


FLAG_NAMES = spellings(Entry.DROP_IN)
"""How the drop-in spells each EmulationConfig field (`launch.preflight.RUN_FLAGS` is `prism run`'s)."""


def preflight(script_argv: list[str], config: EmulationConfig) -> None:
    """The launch's pre-checks, named by the ``--prism-*`` flags (`launch.preflight.check_launch`): the script
    exists, the output / record / trace directories can be created, the graph and the recording describe N.

    A self-launching parent runs them once before it starts the K processes; each process runs them again
    (cheap) before Megatron parses the job's arguments.
    """
    from prism_plugin.launch.preflight import check_launch

    usage = "name the training script first: python -m prism_plugin.megatron pretrain_gpt.py <args>"
    if not script_argv or script_argv[0].startswith("-"):
        raise ConfigError(usage)
    check_launch(config, script_argv[:1], FLAG_NAMES, usage=usage)


def _self_launch(argv: list[str], config: EmulationConfig, extra_env: dict[str, str] | None = None) -> int:
    """Run K copies of this wrapper as local processes (torchrun-like env, FileStore rendezvous) through the
    shared watch loop (`launch.processes.launch_processes`): signals reach every copy, a failure stops the others."""
    from prism_plugin.launch.processes import RealProcess, launch_processes

    k = config.world.num_real
    store_dir = Path(tempfile.mkdtemp(prefix="prism-megatron-"))
    processes = [
        RealProcess(argv=(sys.executable, "-m", "prism_plugin.megatron", *argv),
                    env=dict(os.environ, **(extra_env or {}), RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(k),
                             LOCAL_WORLD_SIZE=str(k),
                             PRISM_STORE_FILE=str(store_dir / "store")),
                    virtual_rank=config.world.real_ranks[i], process_index=i)
        for i in range(k)
    ]
    return launch_processes(processes, launcher="prism megatron", remove=[store_dir])


def start_run(config: EmulationConfig, process_index: int, k: int, cpu_mode: bool, *,
              cuda_peak: bool, virtual_gpu: bool = False,
              policy_defaults: tuple[dict[str, str], ...] = (), stop_at_iteration: int | None = None) -> EmulatedRun:
    """The real processes' store, this process's environment (RANK = its virtual rank, WORLD_SIZE = N), the
    emulation, the Megatron adapter and, in CPU mode, the tensor-storage tracker; shared with `native`.

    The run's summary gains ``megatron`` (the adapter's, with `policy_defaults`: settings the launch left to a
    policy default; `stop_at_iteration`: ``--prism-stop-at-iteration``) and ``memory`` (the tracker's peak; with
    `cuda_peak`, ``torch.cuda.max_memory_allocated`` on a CUDA host). A failure after activation is
    summarised (``exit_code`` 1, ``error``) before it propagates.
    """
    import torch

    from prism_plugin.adapters.megatron.adapter import MegatronAdapter, current_adapter
    from prism_plugin.device.memory import StorageTracker
    from prism_plugin.runtime.lifecycle import EmulatedRun, real_store

    store = real_store(k, process_index)
    os.environ.update(RANK=str(config.world.virtual_rank_of(process_index)), WORLD_SIZE=str(config.world.world_size),
                      PRISM_PROCESS_INDEX=str(process_index))
    os.environ.setdefault("LOCAL_RANK", str(process_index))
    run = EmulatedRun(config, process_index, store, num_processes=k)
    session = run.start()
    try:
        adapter = current_adapter() or MegatronAdapter(session, cpu_mode=cpu_mode, import_training=True,
                                                           virtual_gpu=virtual_gpu,
                                                           policy_defaults=policy_defaults,
                                                           stop_at_iteration=stop_at_iteration).install()
        run.add_summary(lambda: {"megatron": adapter.summary()})
        run.cleanup.callback(adapter.uninstall)
        if cpu_mode:
            tracker = StorageTracker().start()
            run.on_stop(tracker.stop)
            _cpu_snapshot_on_stop(run, tracker, config.world.virtual_rank_of(process_index))
            run.add_summary(lambda: {"memory": {"source": "cpu tensor-storage tracker", **tracker.summary()}})
        elif cuda_peak and torch.cuda.is_available():
            run.add_summary(lambda: {"memory": {"source": "torch.cuda",
                                                "peak_bytes": int(torch.cuda.max_memory_allocated())}})
    except BaseException as exc:
        run.record_exit(exc)
        run.finish()
        raise
    return run


def _cpu_snapshot_on_stop(run: EmulatedRun, tracker: Any, rank: int) -> None:
    """``PRISM_MEMORY_SNAPSHOT=<path, {rank}>`` in CPU mode: the tracker's allocations and frees, dumped at the end
    in torch's ``_dump_snapshot`` format where it fits (`StorageTracker.snapshot`; memory_viz's trace_plot)."""
    template = os.environ.get("PRISM_MEMORY_SNAPSHOT")
    if not template:
        return
    import pickle

    path = Path(template.replace("{rank}", str(rank)))
    tracker.record_history()

    def dump() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(tracker.snapshot()))

    run.on_stop(dump)


def run(script_argv: list[str], flags: PrismFlags) -> dict[str, Any]:
    """Run the script in this process as the real rank torchrun's RANK selects; returns the summary."""
    import torch

    config = flags.to_config()
    preflight(script_argv, config)
    job_timeout = job_timeout_s(script_argv[1:])
    if job_timeout is not None and "timeout" not in flags.values:  # the job's own collective timeout
        from dataclasses import replace

        config = replace(config, timeout_s=job_timeout)
    virtual_gpu = config.device is DeviceMode.VIRTUAL_GPU
    cpu_mode = not virtual_gpu and not torch.cuda.is_available()
    stop_at = flags.settings().megatron.stop_at_iteration
    if stop_at is not None and not virtual_gpu:  # the iteration not run has its memory by the allocator model's replay
        raise ConfigError(f"--prism-stop-at-iteration {stop_at} needs --prism-device virtual-gpu (the iteration it "
                          "does not run has its memory from the allocator model); drop it to run the job to its end")
    if virtual_gpu:  # before Megatron's first import: its @jit_fuser functions and CUDA extensions become one kernel
        from prism_plugin.adapters.megatron.fused_kernels import install_for_process

        install_for_process()
    from prism_plugin.adapters.megatron.absent_data import substitute

    # data and tokenizer files absent on this host: Megatron's mock data and a null tokenizer (`absent_data`)
    script_argv, ns = _rewritten(script_argv, None, substitute)
    iterations = flags.settings().megatron.iterations
    if iterations is not None:  # --prism-iterations K: the job's first K iterations (`job_length`)
        from prism_plugin.adapters.megatron.job_length import shorten

        script_argv, ns = _rewritten(script_argv, ns, lambda argv, parsed: shorten(argv, parsed, iterations))
    _check_job(config, script_argv[1:], cpu_mode, ns)
    process_index = int(os.environ.get("RANK", "0"))
    k = int(os.environ.get("WORLD_SIZE", "1"))
    if k != config.world.num_real:
        raise ConfigError(f"--prism-real-ranks lists {config.world.num_real} ranks but {k} processes were "
                          f"launched; use torchrun --nproc-per-node {config.world.num_real}")
    if virtual_gpu:
        from prism_plugin.adapters.megatron.virtual import run_script

        # ends the process (os._exit) after the summary
        run_script(config, script_argv, process_index, k, policy_defaults=flags.policy_defaults(),
                   stop_at_iteration=stop_at)
    emulated = start_run(config, process_index, k, cpu_mode, cuda_peak=True, stop_at_iteration=stop_at)
    with emulated:  # the program's exit status and error go into the summary; its exception propagates
        sys.argv = list(script_argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
        runpy.run_path(script_argv[0], run_name="__main__")
    return emulated.summary or {}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m prism_plugin.megatron`` and ``prism megatron``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        script_argv, flags = split_prism_flags(argv)
        settings = flags.settings()
        os.environ.update(settings.environ())  # the settings the rank processes read, for every process it starts
        config = flags.to_config(settings)
        if settings.policy_defaults and ("RANK" not in os.environ or (os.environ["RANK"] == "0" and not _PRELOADED)):
            from prism_plugin.launch.preflight import default_profile_note

            print(default_profile_note(FLAG_NAMES), file=sys.stderr, flush=True)  # once: launcher or process 0
        if config.device is DeviceMode.VIRTUAL_GPU:  # the Megatron process starts fresh with the device library
            from prism_plugin.adapters.megatron import virtual

            if "RANK" not in os.environ:
                preflight(script_argv, config)
                return _self_launch(argv, config, extra_env=virtual.library_env(config))
            if not _PRELOADED:
                virtual.reexec(argv, config)
        if "RANK" not in os.environ and config.world.num_real > 1:
            preflight(script_argv, config)  # once, in the parent: one message, no process started
            return _self_launch(argv, config)
        run(script_argv, flags)
    except Refusal as exc:  # a ConfigError too; its message already says what prism cannot emulate
        print(f"prism: {exc}", file=sys.stderr, flush=True)
        return 2
    except ConfigError as exc:
        print(f"prism: invalid input: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
