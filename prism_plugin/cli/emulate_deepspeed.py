"""`prism emulate` for DeepSpeed jobs: the framework check, the layout from the DeepSpeed config, each run's config.

    prism emulate --world-size 64 [--framework deepspeed] [--seq-length 1024] \\
        [--model-flops-per-iteration F] -- train.py --deepspeed_config ds_config.json <the script's arguments>

The job is a DeepSpeed job (`detect_framework`) with ``--framework deepspeed``, or with ``--framework auto`` (the
default) when the script's arguments name a JSON config (``--deepspeed_config``, ``--deepspeed-config``,
``--ds_config``, ``--ds-config``, ``--config``) holding DeepSpeed batch or ZeRO keys, or the script's text calls
``deepspeed.initialize``; otherwise it is a Megatron job. The script must call
``prism_plugin.deepspeed.init_distributed(config)`` (the one change DeepSpeed emulation asks of it).

Layout (`DeepSpeedJob.from_argv`): dp = N / (pipe x model), with ``pipe`` and ``model`` from the config's
``"prism": {"topology": {...}}`` (default 1; the script's ``--pp`` / ``--pipeline-parallel-size`` /
``--pipe-parallel-size`` gives pipe too); the ZeRO stage from ``zero_optimization.stage`` (reported). The slicing
makes each pipeline stage a class of its dp ranks (the stage's first rank profiled); a ZeRO rank whose partition
cuts the parameters otherwise does other work (ZeRO-1 at dp 4: rank 1), which ``--hybrid`` shows (its kernels beside
its representative's). Each profiling run gets a copy of the config with emulate's own ``"prism"`` section
(world_size, the run's real rank, profile, gpus_per_node, ``"device": "virtual-gpu"``, output, trace; for a hybrid
run the graph), the script's config argument pointing at it. Of a ``"prism"`` section already in the config,
``gpu``, ``data_policy``, ``iteration_marker``, ``topology`` and ``pipe_activations`` are kept; any other key
(``faults``, ``graph``, ``record_dir``, ...) is refused: emulate sets or does not support it.

Pipelines: DeepSpeed's pipeline engine runs on virtual GPUs (`prism_plugin.adapters.deepspeed.pipe_values`); a
stage after the first receives its activations from a virtual stage, whose tensor-meta message carries values
fake tensors do not hold, so ``pipe > 1`` needs ``"pipe_activations"`` (refused without it, before any run).

Refused: what fake execution cannot run (FusedAdam, NVMe offload, ...:
`prism_plugin.adapters.deepspeed.virtual_gpu.check_config`).

Figures: tokens per step = ``train_batch_size`` (DeepSpeed's global batch, derived from micro x accumulation x dp
when absent) x the sequence length (``--seq-length``, else the script's ``--seq-length`` / ``--seq_length`` /
``--seq-len``); model FLOPs per iteration only from ``--model-flops-per-iteration`` (DeepSpeed has no model-FLOPs
formula of the job): without it TFLOP/s/GPU and MFU are reported unavailable, with the reason, never estimated.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError

__all__ = ["CONFIG_FLAGS", "DeepSpeedJob", "detect_framework"]

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--ds_config", "--ds-config", "--config")
"""The script arguments whose value is taken for the DeepSpeed config (the first one present)."""
_DS_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization")
_PP_FLAGS = ("--pp", "--pipeline-parallel-size", "--pipe-parallel-size")
_SEQ_FLAGS = ("--seq-length", "--seq_length", "--seq-len")
_KEPT_KEYS = ("gpu", "data_policy", "iteration_marker", "topology", "pipe_activations")


def _flag_value(argv: list[str], flags: tuple[str, ...]) -> tuple[int, str] | None:
    """(index of the value, value) of the first of `flags` in `argv` (``--flag v`` or ``--flag=v``)."""
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if arg.startswith(flag + "="):
                return i, arg[len(flag) + 1:]
    return None


def _config_of(argv: list[str]) -> tuple[int, Path] | None:
    found = _flag_value(argv, CONFIG_FLAGS)
    return None if found is None else (found[0], Path(found[1]))


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def detect_framework(script_argv: list[str], requested: str = "auto") -> str:
    """``"megatron"`` or ``"deepspeed"``: `requested` unless ``auto`` (then the module docstring's rule).

    >>> detect_framework(["pretrain_gpt.py", "--num-layers", "2"], "megatron")
    'megatron'
    """
    if requested not in ("auto", "megatron", "deepspeed"):
        raise ConfigError(f"--framework {requested!r}: use auto, megatron or deepspeed")
    if requested != "auto":
        return requested
    found = _config_of(script_argv[1:])
    if found is not None:
        config = _load_json(found[1])
        if config is not None and any(k in config for k in _DS_KEYS):
            return "deepspeed"
    try:
        text = Path(script_argv[0]).read_text(errors="replace") if script_argv else ""
    except OSError:
        text = ""
    return "deepspeed" if "deepspeed.initialize" in text else "megatron"


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedJob:
    """A DeepSpeed job as `prism emulate` runs it (see the module docstring)."""

    script_argv: list[str]
    """The script and its arguments, as the user gave them."""
    config: dict[str, Any]
    """The DeepSpeed config (its own "prism" section dropped)."""
    kept: dict[str, Any]
    """The kept keys of the config's own "prism" section."""
    config_index: int
    """Index in ``script_argv[1:]`` of the config argument's value (``--flag=v``: of that argument)."""
    config_inline: str | None
    """The flag when the value was given as ``--flag=v``, else None."""
    world_size: int
    pp: int
    model: int
    dp: int
    zero_stage: int
    global_batch: int
    seq_length: int | None

    @property
    def layout(self) -> str:
        return f"pipe={self.pp},model={self.model},data={self.dp}"

    @classmethod
    def from_argv(cls, script_argv: list[str], world_size: int, seq_length: int | None = None) -> DeepSpeedJob:
        from prism_plugin.adapters.deepspeed.virtual_gpu import check_config

        args = script_argv[1:]
        found = _config_of(args)
        if found is None:
            raise ConfigError("prism emulate --framework deepspeed: name the DeepSpeed config in the script's "
                              f"arguments with one of {', '.join(CONFIG_FLAGS)} (emulate writes each run's copy)")
        index, path = found
        config = _load_json(path)
        if config is None:
            raise ConfigError(f"DeepSpeed config {str(path)!r}: not a readable JSON object; give the job's ds_config")
        section = config.pop("prism", None) or {}
        extra = sorted(set(section) - set(_KEPT_KEYS) - {"world_size", "real_ranks", "profile", "device",
                                                         "output", "trace", "gpus_per_node"})
        if extra:
            raise ConfigError(f"DeepSpeed config {str(path)!r}: prism emulate sets the \"prism\" section itself and "
                              f"does not run its keys {', '.join(extra)}; drop them (kept: {', '.join(_KEPT_KEYS)})")
        kept = {k: section[k] for k in _KEPT_KEYS if k in section}
        topology = kept.get("topology") or {}
        pp_arg = _flag_value(args, _PP_FLAGS)
        pp = int(topology.get("pipe", 1)) if pp_arg is None else int(pp_arg[1])
        model = int(topology.get("model", 1))
        if pp < 1 or model < 1 or world_size % (pp * model):
            raise ConfigError(f"--world-size {world_size} is not a multiple of pipe x model = {pp} x {model} "
                              "(\"prism.topology\" or the script's pipeline flag)")
        if pp > 1 and "pipe_activations" not in kept:
            raise ConfigError(f"prism emulate --framework deepspeed: pipe={pp}: a stage after the first receives "
                              "from a virtual stage, whose tensor-meta message virtual GPUs cannot read; give its "
                              "shape in the config's \"prism\": {\"pipe_activations\": {\"shape\": [micro, seq, "
                              "hidden], \"dtype\": \"bfloat16\"}}")
        dp = world_size // (pp * model)
        check_config(config)
        micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
        gbs = config.get("train_batch_size")
        if gbs is None:
            if micro is None:
                raise ConfigError(f"DeepSpeed config {str(path)!r}: give train_batch_size or "
                                  "train_micro_batch_size_per_gpu (the tokens per step come from it)")
            gbs = int(micro) * int(gas or 1) * dp
        if seq_length is None:
            seq = _flag_value(args, _SEQ_FLAGS)
            seq_length = int(seq[1]) if seq is not None else None
        inline = args[index].split("=", 1)[0] if args[index].startswith("--") else None
        return cls(script_argv=list(script_argv), config=config, kept=kept, config_index=index,
                   config_inline=inline, world_size=world_size, pp=pp, model=model, dp=dp,
                   zero_stage=int((config.get("zero_optimization") or {}).get("stage", 0)), global_batch=int(gbs),
                   seq_length=seq_length)

    def run_config(self, rank: int, run_dir: Path, *, profile: str, gpus_per_node: int, trace: bool = True,
                   graph: Path | None = None) -> dict[str, Any]:
        """The config of one run: the job's, with emulate's "prism" section for `rank`."""
        config = copy.deepcopy(self.config)
        section: dict[str, Any] = {**copy.deepcopy(self.kept), "world_size": self.world_size, "real_ranks": [rank],
                                   "profile": profile, "gpus_per_node": gpus_per_node, "device": "virtual-gpu",
                                   "output": str(run_dir)}
        section.setdefault("topology", {"pipe": self.pp, "data": self.dp, "model": self.model})
        if trace:
            section["trace"] = str(run_dir / "trace")
        if graph is not None:
            section["graph"] = str(graph)
        config["prism"] = section
        return config

    def command(self, python: str, rank: int, run_dir: Path, *, profile: str, gpus_per_node: int,
                trace: bool = True, graph: Path | None = None) -> list[str]:
        """The run's command line (its config written to ``<run_dir>/ds_config.json``)."""
        path = run_dir / "ds_config.json"
        path.write_text(json.dumps(self.run_config(rank, run_dir, profile=profile, gpus_per_node=gpus_per_node,
                                                   trace=trace, graph=graph), indent=1))
        args = list(self.script_argv[1:])
        args[self.config_index] = f"{self.config_inline}={path}" if self.config_inline else str(path)
        return [python, self.script_argv[0], *args]

    def figures(self, model_flops_per_iteration: float | None) -> dict[str, Any]:
        """The job figures for the report, and why any is unavailable."""
        unavailable = {}
        if self.seq_length is None:
            unavailable["tokens_per_s_per_gpu"] = ("no sequence length: give --seq-length (or the script's "
                                                   "--seq-length) to count tokens per step")
        if model_flops_per_iteration is None:
            unavailable["model_tflops_per_s_per_gpu"] = unavailable["mfu"] = (
                "DeepSpeed does not define the job's model FLOPs: give --model-flops-per-iteration")
        return {"global_batch_size": self.global_batch, "seq_length": self.seq_length,
                "model_flops_per_iteration": model_flops_per_iteration, "zero_stage": self.zero_stage,
                "unavailable": unavailable}


def add_deepspeed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--framework", default="auto", choices=("auto", "megatron", "deepspeed"),
                   help="the job's framework (auto: a DeepSpeed config in the script's arguments, or "
                        "deepspeed.initialize in the script, means deepspeed)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="DeepSpeed: tokens per sample, for tokens/s (default: the script's --seq-length)")
    p.add_argument("--model-flops-per-iteration", type=float, default=None,
                   help="DeepSpeed: the job's model FLOPs per step, for TFLOP/s/GPU and MFU (else unavailable)")
