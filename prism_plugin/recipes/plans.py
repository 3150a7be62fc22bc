"""The processes a recipe runs: command lines per framework and launcher (no process is started here).

Every process runs the recipe's program unmodified under the metrics probe
(``python -m prism_plugin.recipes.probe``), through the project's existing launchers:

- torch (``prism_plugin.programs.toy_train``): a plain real run is k processes with torchrun's
  environment (RANK, WORLD_SIZE, LOCAL_RANK) and a FileStore rendezvous (the probe's
  ``PRISM_PROBE_STORE``: no ports); a prism run (emulated, or every rank real for a recording) is one
  ``prism run`` launcher, which starts its k real processes itself.
- megatron (``prism_plugin/programs/pretrain_gpt.py``, Megatron's own training loop and mock
  data): k processes of the drop-in wrapper ``python -m prism_plugin.megatron script <args>
  --prism-*``, torchrun's environment, ``PRISM_STORE_FILE`` for the real processes' store. The real
  run is the same wrapper with every rank real (the CPU shim comes with the adapter).
- deepspeed (``prism_plugin/programs/deepspeed_mlp.py``, the one-line drop-in
  ``prism_plugin.deepspeed.init_distributed(config)``): k processes; the ds_config written next to the
  run carries a ``"prism"`` section for emulations and none for a plain real run.

A ``device: virtual-gpu`` emulation (program: llama, ``prism_plugin/programs/llama_ddp.py``) is one ``prism run
--device virtual-gpu`` launcher per real-rank set running the program itself, without the probe
(`virtual_gpu_plan`); its figures are prism's summary.

An emulation's `faults` travel as ``prism run --fault SPEC`` (torch), ``--prism-fault SPEC`` (megatron) or
the section's ``"faults": [...]`` (deepspeed), each repeated per spec; its `timeout` as ``--timeout`` /
``--prism-timeout`` (a DeepSpeed program sets its own).

Derived numbers: dp = world_size / (tp x pp x cp); Megatron's global batch = micro x
microbatches_per_step x dp, DeepSpeed's train_batch_size likewise, so every replica does the same work
whatever N is.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import prism_plugin
from prism_plugin.config.kinds import DataPolicy, DeviceMode
from prism_plugin.recipes.schema import Emulation, Framework, RealLauncher, Recipe, RecipeError
from prism_plugin.recipes.virtual_gpu import TorchProgram, program_module

__all__ = ["DEEPSPEED_SCRIPT", "MEGATRON_SCRIPT", "ProcessSpec", "RunPlan", "deepspeed_args", "deepspeed_config",
           "deepspeed_program", "emulation_plan", "llama_args", "logged_first_loss", "megatron_args", "real_plan",
           "toy_args", "virtual_gpu_plan"]

PACKAGE_DIR = Path(prism_plugin.__file__).resolve().parent
MEGATRON_SCRIPT = PACKAGE_DIR / "programs" / "pretrain_gpt.py"
DEEPSPEED_SCRIPT = PACKAGE_DIR / "programs" / "deepspeed_mlp.py"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessSpec:
    """One OS process: its command line, the environment it adds, where its output goes."""

    argv: tuple[str, ...]
    env: dict[str, str]
    log: Path


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """One run (the real run, or one real-rank set of an emulation): processes started together."""

    label: str
    """``real`` or ``<emulation>/run<i>``."""
    processes: tuple[ProcessSpec, ...]
    probe_dir: Path
    """Where each rank's metrics and Chrome trace land."""
    ranks: tuple[int, ...]
    """The ranks whose metrics this run must produce."""
    summary_dir: Path | None = None
    """Where prism writes rank<R>.summary.json (prism runs)."""
    files: dict[str, str] = field(default_factory=dict)
    """Files to write before starting (path -> text), e.g. a ds_config."""
    probe: bool = True
    """Its processes run under the metrics probe (False: virtual-GPU runs, figures from prism's summary)."""
    loss_from_log: bool = False
    """Take each process's first-step loss from Megatron's training log (`logged_first_loss`) instead of the
    probe: with pipeline parallelism Megatron hands autograd the last stage's loss after overwriting its data
    with a placeholder (``deallocate_pipeline_outputs``), so the backward root no longer holds the loss."""


_LOSS_LINE = re.compile(r"iteration\s+1/\s*\d+ \|.*?\blm loss: ([-+0-9.eE]+)")


def logged_first_loss(log_text: str) -> float | None:
    """The ``lm loss`` of iteration 1 in Megatron's training log, if this process printed it.

    Megatron logs on the last rank (or, under prism, the lowest real rank standing in for a virtual last
    rank); the value is the loss averaged over the data-parallel group, printed to 7 significant digits.
    Example: "... iteration        1/       8 | ... | lm loss: 2.785017E+00 | ..." -> 2.785017.
    """
    match = _LOSS_LINE.search(log_text)
    return float(match.group(1)) if match else None


def toy_args(recipe: Recipe) -> list[str]:
    m = recipe.model
    return ["-m", "prism_plugin.programs.toy_train", "--tp", str(recipe.layout.tp), "--hidden", str(m.hidden_size),
            "--batch", str(m.micro_batch_size), "--steps", str(recipe.steps.total), "--json", *m.extra_args]


def llama_args(recipe: Recipe) -> list[str]:
    """``-m prism_plugin.programs.llama_ddp`` and its model flags (program: llama); ``microbatches_per_step`` > 1
    is its ``--accumulation`` (global batch = micro x microbatches_per_step x dp)."""
    m = recipe.model
    accumulation = ["--accumulation", str(m.microbatches_per_step)] if m.microbatches_per_step > 1 else []
    return ["-m", program_module(TorchProgram.LLAMA), "--hidden", str(m.hidden_size), "--layers", str(m.num_layers),
            "--heads", str(m.num_attention_heads), "--kv-heads", str(m.num_query_groups or m.num_attention_heads),
            "--ffn", str(m.ffn_hidden_size), "--vocab", str(m.vocab_size), "--seq", str(m.seq_length),
            "--micro-batch", str(m.micro_batch_size), *accumulation, "--steps", str(recipe.steps.total),
            *m.extra_args]


def virtual_gpu_plan(recipe: Recipe, emu: Emulation, index: int, out: Path) -> RunPlan:
    """Run `index` of a ``device: virtual-gpu`` emulation: ``prism run --device virtual-gpu`` with the program
    itself, no probe (the process ends with ``os._exit`` after prism's summary, and a virtual GPU's step time is
    not modelled): its figures are the summary's ``virtual_gpu`` memory. ``oom`` travels as
    ``PRISM_VIRTUAL_GPU_OOM``."""
    ranks, summary_dir = emu.runs[index], out / "prism"
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", str(emu.world_size),
           "--real-ranks", _rank_text(ranks), "--profile", recipe.resolve_profile(emu),
           "--gpus-per-node", str(emu.gpus_per_node), "--data-policy", emu.data_policy.value,
           "--device", emu.device.value, "--output", str(summary_dir)]
    if emu.gpu is not None:
        cmd += ["--gpu", emu.gpu]
    if emu.timeout is not None:
        cmd += ["--timeout", f"{emu.timeout:g}"]
    cmd += ["--", *llama_args(recipe)]
    env = {"PRISM_VIRTUAL_GPU_OOM": emu.oom.value, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = ProcessSpec(argv=tuple(cmd), env=env, log=out / "launcher.log")
    return RunPlan(label=f"{emu.name}/run{index}", processes=(proc,), probe_dir=out / "metrics", ranks=ranks,
                   summary_dir=summary_dir, probe=False)


def megatron_args(recipe: Recipe, world_size: int) -> list[str]:
    """Megatron arguments of the recipe's job at `world_size` (global batch derived from dp)."""
    m, lay = recipe.model, recipe.layout
    dp = lay.dp(world_size, "megatron")
    args = [
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
        "--context-parallel-size", str(lay.cp),
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--num-attention-heads", str(m.num_attention_heads), "--seq-length", str(m.seq_length),
        "--max-position-embeddings", str(m.seq_length), "--micro-batch-size", str(m.micro_batch_size),
        # global batch = micro x micro-batches per replica x dp
        "--global-batch-size", str(m.micro_batch_size * m.microbatches_per_step * dp),
        "--train-iters", str(recipe.steps.total), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size),
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10**6), "--seed", "1234",
        "--disable-gloo-process-groups", "--no-load-optim", "--no-save-optim",
        # no data-loader worker processes: each rank would fork 2 per split (6 processes holding copies of the
        # dataset index, gigabytes at N=65536) on a machine that runs at most 4 processes at a time
        "--num-workers", "0",
    ]
    if m.ffn_hidden_size is not None:
        args += ["--ffn-hidden-size", str(m.ffn_hidden_size)]
    if lay.vpp is not None:
        args += ["--num-layers-per-virtual-pipeline-stage", str(m.num_layers // (lay.pp * lay.vpp))]
    if m.num_experts:
        args += ["--num-experts", str(m.num_experts), "--expert-model-parallel-size", str(lay.ep)]
    return args + list(m.extra_args)


def deepspeed_config(recipe: Recipe, world_size: int, prism_section: dict[str, object] | None) -> dict[str, object]:
    """The ds_config of the recipe's job at `world_size` (train batch derived from dp)."""
    m, lay = recipe.model, recipe.layout
    dp = lay.dp(world_size, "deepspeed")
    config: dict[str, object] = {
        # train_batch_size = micro x gradient accumulation x dp
        "train_batch_size": m.micro_batch_size * m.microbatches_per_step * dp,
        "train_micro_batch_size_per_gpu": m.micro_batch_size,
        "gradient_accumulation_steps": m.microbatches_per_step,
        # buckets of 2**20 elements (4 MiB fp32), not DeepSpeed's 5e8 defaults (2 GB buffers on a CPU)
        "zero_optimization": {"stage": lay.zero_stage, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20,
                              "stage3_prefetch_bucket_size": 2**20, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if prism_section is not None:
        config["prism"] = prism_section
    return config


def deepspeed_program(recipe: Recipe) -> Path:
    """The DeepSpeed training program recipes run (shipped with the package)."""
    return DEEPSPEED_SCRIPT


def deepspeed_args(recipe: Recipe, config_path: Path) -> list[str]:
    """argv (after the interpreter) of the recipe's DeepSpeed program reading the ds_config at `config_path`."""
    m, lay = recipe.model, recipe.layout
    return [str(deepspeed_program(recipe)), "--config", str(config_path), "--pp", str(lay.pp),
            "--hidden", str(m.hidden_size), "--layers", str(m.num_layers), "--steps", str(recipe.steps.total),
            *m.extra_args]


def _probe(*target: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "prism_plugin.recipes.probe", *target)


def _env(label: str, probe_dir: Path, **extra: str) -> dict[str, str]:
    return {"PRISM_PROBE_DIR": str(probe_dir), "PRISM_PROBE_LABEL": label, "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def _torchrun_env(i: int, k: int) -> dict[str, str]:
    return {"RANK": str(i), "WORLD_SIZE": str(k), "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(k),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _rank_text(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)


def real_plan(recipe: Recipe, out: Path, record_dir: Path | None = None) -> RunPlan:
    """The paired real run: every rank a process; `record_dir` makes it a recording (prism launcher)."""
    if not recipe.real.exists:
        raise RecipeError(f"recipe {recipe.name} has real: none (an emulation-only recipe): there is no real run")
    k = recipe.real.world_size
    ranks = tuple(range(k))
    if recipe.real.launcher is RealLauncher.PRISM:
        return _prism_plan(recipe, "real", out, k, ranks, profile="local-cpu-gloo", gpus_per_node=8,
                           policy=DataPolicy.MIRROR, record_dir=record_dir, replay_dir=None)
    if record_dir is not None:
        raise RecipeError("a recording needs real.launcher: prism")
    if recipe.framework is Framework.MEGATRON:
        raise RecipeError("framework megatron: set real.launcher: prism (Megatron needs the adapter's CPU shim on "
                          "this machine; every rank is then real, through the prism backend)")
    probe_dir = out / "metrics"
    store = str(out / "store")
    files: dict[str, str] = {}
    if recipe.framework is Framework.TORCH:
        target = toy_args(recipe)
    else:
        cfg = out / "ds_config.json"
        files[str(cfg)] = json.dumps(deepspeed_config(recipe, k, None), indent=2)
        target = deepspeed_args(recipe, cfg)
    procs = tuple(
        ProcessSpec(argv=_probe(*target), env={**_env("real", probe_dir, PRISM_PROBE_STORE=store),
                                               **_torchrun_env(i, k)}, log=out / f"process{i}.log")
        for i in range(k)
    )
    return RunPlan(label="real", processes=procs, probe_dir=probe_dir, ranks=ranks, files=files)


def emulation_plan(recipe: Recipe, emu: Emulation, index: int, out: Path, replay_dir: Path | None) -> RunPlan:
    """Run `index` of emulation `emu` (its real ranks ``emu.runs[index]``)."""
    if emu.device is DeviceMode.VIRTUAL_GPU:
        return virtual_gpu_plan(recipe, emu, index, out)
    policy = emu.data_policy
    return _prism_plan(recipe, f"{emu.name}/run{index}", out, emu.world_size, emu.runs[index],
                       profile=recipe.resolve_profile(emu), gpus_per_node=emu.gpus_per_node, policy=policy,
                       record_dir=None, replay_dir=replay_dir if policy is DataPolicy.RECORDED else None,
                       faults=emu.faults, timeout_s=emu.timeout)


def _prism_plan(recipe: Recipe, label: str, out: Path, world_size: int, ranks: tuple[int, ...], *, profile: str,
                gpus_per_node: int, policy: DataPolicy, record_dir: Path | None, replay_dir: Path | None,
                faults: tuple[str, ...] = (), timeout_s: float | None = None) -> RunPlan:
    probe_dir, summary_dir = out / "metrics", out / "prism"
    kind = "real" if label == "real" else "emulated"
    k = len(ranks)
    files: dict[str, str] = {}
    if recipe.framework is Framework.TORCH:
        cmd = [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", str(world_size),
               "--real-ranks", _rank_text(ranks), "--profile", profile, "--gpus-per-node", str(gpus_per_node),
               "--data-policy", policy.value, "--output", str(summary_dir)]
        if record_dir is not None:
            cmd += ["--record", str(record_dir)]
        if replay_dir is not None:
            cmd += ["--replay", str(replay_dir)]
        cmd += [arg for f in faults for arg in ("--fault", f)]
        if timeout_s is not None:
            cmd += ["--timeout", f"{timeout_s:g}"]
        cmd += ["-m", "prism_plugin.recipes.probe", *toy_args(recipe)]
        procs: tuple[ProcessSpec, ...] = (
            ProcessSpec(argv=tuple(cmd), env=_env(kind, probe_dir), log=out / "launcher.log"),)
        return RunPlan(label=label, processes=procs, probe_dir=probe_dir, ranks=ranks, summary_dir=summary_dir)
    if recipe.framework is Framework.MEGATRON:
        flags = ["--prism-world-size", str(world_size), "--prism-real-ranks", _rank_text(ranks),
                 "--prism-profile", profile, "--prism-gpus-per-node", str(gpus_per_node),
                 "--prism-data-policy", policy.value, "--prism-output", str(summary_dir)]
        if record_dir is not None:
            flags += ["--prism-record", str(record_dir)]
        if replay_dir is not None:
            flags += ["--prism-replay", str(replay_dir)]
        flags += [arg for f in faults for arg in ("--prism-fault", f)]
        if timeout_s is not None:
            flags += ["--prism-timeout", f"{timeout_s:g}"]
        target = ["-m", "prism_plugin.megatron", str(MEGATRON_SCRIPT), *megatron_args(recipe, world_size), *flags]
    else:
        section: dict[str, object] = {"world_size": world_size, "real_ranks": list(ranks), "profile": profile,
                                      "gpus_per_node": gpus_per_node, "data_policy": policy.value,
                                      "output": str(summary_dir)}
        if record_dir is not None:
            section["record_dir"] = str(record_dir)
        if replay_dir is not None:
            section["replay_dir"] = str(replay_dir)
        if faults:
            section["faults"] = list(faults)
        if recipe.layout.pp > 1 and policy is DataPolicy.MIRROR:
            # what a stage receives from a virtual previous stage: one activation micro-batch
            section["pipe_activations"] = {"shape": [recipe.model.micro_batch_size, recipe.model.hidden_size],
                                           "dtype": "float32"}
        cfg = out / "ds_config.json"
        files[str(cfg)] = json.dumps(deepspeed_config(recipe, world_size, section), indent=2)
        target = deepspeed_args(recipe, cfg)
    store = {"PRISM_STORE_FILE": str(out / "store")} if k > 1 else {}
    if recipe.framework is Framework.MEGATRON:
        store["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron asserts it with TP/CP (as every Megatron launch sets)
    procs = tuple(
        ProcessSpec(argv=_probe(*target), env={**_env(kind, probe_dir, **store), **_torchrun_env(i, k)},
                    log=out / f"process{i}.log")
        for i in range(k)
    )
    return RunPlan(label=label, processes=procs, probe_dir=probe_dir, ranks=ranks, summary_dir=summary_dir,
                   files=files, loss_from_log=recipe.framework is Framework.MEGATRON and recipe.layout.pp > 1)
