"""`prism plan`'s job and its candidates' runs: the command line of each layout, its memory run, its emulation,
and the cache that lets an interrupted plan resume.

A `PlanJob` is the job being planned: the script, its arguments without any layout flag (`LAYOUT_FLAGS`: the
planner sets them), the model they build, N GPUs, the global batch and sequence, and the hardware profile. It
comes from a model preset (`PlanJob.from_preset`: Megatron-LM's ``pretrain_gpt.py`` flags of the preset on mock
data) or from a job's own command line (`PlanJob.from_args`). Every candidate runs with ``--train-iters``
`ITERATIONS`.

`run_candidate` runs one candidate in its folder, two stages:

1. **memory**: the first rank (first pipeline stage: the most activations in flight under 1F1B, and the input
   embedding) as one virtual-GPU process without virtual time (``PRISM_VIRTUAL_TIME=off``: allocations only) and
   ``--prism-oom report`` (an allocation past the GPU is counted, so the run reports how far over it went). Its
   device total over the GPU's memory ends the candidate: it does not fit;
2. **emulation**: the whole `prism emulate` pipeline (every class of ranks profiled, the graph built and
   replayed): step time, tokens/s/GPU, MFU and each class's memory. A class that does not fit, or runs out of
   memory, makes the candidate not fit.

The candidate's `CandidateResult` is written to ``<folder>/result.json`` with a `cache_key` (its command line, N,
profile and prism's version): a later plan into the same output reads it instead of running again. Results
that depend on this run's circumstances (stopped, past ``--timeout``) are not cached.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prism_plugin import __version__
from prism_plugin.cli.emulate import check_job_argv, emulate, run_command
from prism_plugin.cli.emulate_runs import RunFailed, run_one
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.models import ModelPreset, megatron_args, model_of_megatron_args, preset
from prism_plugin.cost.plan_estimate import Guess
from prism_plugin.topology.plan_space import Candidate

__all__ = ["ITERATIONS", "LAYOUT_FLAGS", "MEMORY_ITERATIONS", "CandidateResult", "PlanJob", "run_candidate",
           "strip_flags"]

ITERATIONS = 3
"""``--train-iters`` of every candidate run: the first iteration, whose trace the graph drops (warm-up), the steady
one it keeps, and the third, whose mark closes it (the profiling runs end there: `emulate.run_command`)."""

MEMORY_ITERATIONS = 2
"""``--train-iters`` of a memory run: the second iteration is the first whose forward and backward run with the
optimizer's state allocated (Adam's moments are created at the first step), so its peak is the steady one."""

LAYOUT_FLAGS: dict[str, int] = {
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
    "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1, "--micro-batch-size": 1,
    "--num-virtual-stages-per-pipeline-rank": 1, "--num-layers-per-virtual-pipeline-stage": 1,
    "--virtual-pipeline-model-parallel-size": 1, "--recompute-granularity": 1, "--recompute-method": 1,
    "--recompute-num-layers": 1, "--fp8-format": 1, "--sequence-parallel": 0, "--use-distributed-optimizer": 0,
    "--global-batch-size": 1, "--seq-length": 1, "--train-iters": 1}
"""Flags a candidate sets (their values: how many arguments follow), dropped from the job's own command line."""

_MOCK_DATA = ["--mock-data", "--no-create-attention-mask-in-dataloader", "--tokenizer-type", "NullTokenizer", "--bf16",
              "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
              "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
"""What a preset's job adds to its architecture: mock data without a materialised causal mask (as NVIDIA's
recipes run it: the attention kernel masks causally itself, and a (seq, seq) mask per sample costs the host
64 MB at seq 8192), bf16 mixed precision, no evaluation, no dropout."""

_SCRIPT = Path(__file__).resolve().parents[1] / "programs" / "pretrain_gpt.py"


def strip_flags(argv: list[str], flags: Mapping[str, int]) -> list[str]:
    """`argv` without each of `flags` (``--flag value`` or ``--flag=value``; a switch takes no value).

    >>> strip_flags(["--num-layers", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel", "--bf16"],
    ...             LAYOUT_FLAGS)
    ['--num-layers', '2', '--bf16']
    """
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in flags:
            i += 1 if "=" in argv[i] else 1 + flags[name]
            continue
        out.append(argv[i])
        i += 1
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanJob:
    """The job `prism plan` lays out: ``script base_args`` plus each candidate's flags."""

    script: Path
    base_args: tuple[str, ...]
    model: ModelPreset
    gpus: int
    global_batch: int
    seq: int
    profile: str
    gpus_per_node: int = 8

    @classmethod
    def from_preset(cls, name: str, *, gpus: int, global_batch: int, seq: int | None, profile: str,
                    gpus_per_node: int = 8) -> PlanJob:
        """Preset `name` on mock data (``seq`` None: the preset's pretraining sequence)."""
        model = preset(name)
        seq = seq or model.seq_length
        base = strip_flags(megatron_args(model), {"--max-position-embeddings": 1, **LAYOUT_FLAGS})
        base += ["--max-position-embeddings", str(max(seq, model.max_position_embeddings)), *_MOCK_DATA]
        return cls(script=_SCRIPT, base_args=tuple(base), model=model, gpus=gpus, global_batch=global_batch,
                   seq=seq, profile=profile, gpus_per_node=gpus_per_node)

    @classmethod
    def from_args(cls, argv: list[str], *, gpus: int, global_batch: int | None, seq: int | None, profile: str,
                  gpus_per_node: int = 8) -> PlanJob:
        """A job's own ``script args``; ``--global-batch`` / ``--seq`` (when given) replace its own."""
        check_job_argv(argv, "prism plan", "or plan a preset with --model NAME")
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--global-batch-size", type=int, default=None)
        known, _ = parser.parse_known_args(argv[1:])
        global_batch = global_batch or known.global_batch_size
        if global_batch is None:
            raise ConfigError("prism plan: the job gives no --global-batch-size: pass --global-batch B")
        model = model_of_megatron_args(argv[1:], name=Path(argv[0]).stem)
        return cls(script=Path(argv[0]), base_args=tuple(strip_flags(argv[1:], LAYOUT_FLAGS)), model=model,
                   gpus=gpus, global_batch=global_batch, seq=seq or model.seq_length, profile=profile,
                   gpus_per_node=gpus_per_node)

    def argv(self, c: Candidate) -> list[str]:
        """The job's command line with candidate `c`'s layout: ``script args``."""
        return [str(self.script), *self.base_args, "--global-batch-size", str(self.global_batch), "--seq-length",
                str(self.seq), "--train-iters", str(ITERATIONS), *c.megatron_args()]


@dataclass(kw_only=True, slots=True)
class CandidateResult:
    """What one candidate's runs gave. ``status``: ``fits`` (ranked), ``out of memory`` (its memory run or a
    class of its emulation exceeded the GPU), ``failed`` (a run failed: ``error``) or ``stopped``."""

    label: str
    argv: list[str]
    guess_position: int
    guess: dict[str, float]
    status: str
    error: str | None = None
    memory_run: dict[str, Any] | None = None
    emulation: dict[str, Any] | None = None
    cache_key: str = ""
    cached: bool = False
    wall_s: float = 0.0
    marks: list[str] = field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return None if self.emulation is None else self.emulation.get("tokens_per_s_per_gpu")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_key(argv: list[str], job: PlanJob) -> str:
    """What a cached result must match: the command line, N, profile, GPUs per node and prism's version."""
    text = json.dumps([argv[1:], job.gpus, job.profile, job.gpus_per_node, __version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _own_device(summary: dict[str, Any]) -> dict[str, Any]:
    return max(summary["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])


def _memory_run(argv: list[str], job: PlanJob, folder: Path, timeout_s: float, stop: threading.Event | None,
                env: Mapping[str, str], ray_address: str | None) -> dict[str, Any]:
    run_dir = folder / "memory"
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = list(argv)
    argv[argv.index("--train-iters") + 1] = str(MEMORY_ITERATIONS)
    command = run_command(argv, 0, run_dir, job.gpus, job.profile, job.gpus_per_node, trace=False)
    command += ["--prism-oom", "report", "--prism-timeline", "off"]  # wall-clock times: none to draw, and
    # without records of them fast-forward advances the memory run's steady state
    if ray_address is not None:
        from prism_plugin.cli.emulate_ray import run_on_ray

        result = run_on_ray([(command, run_dir, 0, "memory run")], ray_address, jobs=1, timeout_s=timeout_s, env=env,
                            stop=stop, virtual_time=False)[0]
    else:
        result = run_one(command, run_dir, 0, "memory run", timeout_s, stop, env, virtual_time=False)
    device = _own_device(result["summary"])
    return {"rank": 0, "peak_allocated_bytes": device["peak_allocated_bytes"],
            "peak_reserved_bytes": device["peak_reserved_bytes"], "device_total_bytes": device["device_total_bytes"],
            "ooms": len(device["ooms"]), "fits": bool(device["fits"]) and not device["ooms"],
            "wall_s": result["wall_s"]}


def _emulation(report: dict[str, Any]) -> dict[str, Any]:
    classes = report["classes"]
    return {k: report[k] for k in ("step_ms", "tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "mfu",
                                   "classes_of_ranks", "profiling_runs")} | {
        "peak_allocated_bytes": max(c["peak_allocated_bytes"] for c in classes),
        "device_total_bytes": max(c["device_total_bytes"] for c in classes),
        "fits": all(c["fits"] for c in classes),
        "wall_s": round(sum(c["profiling_run_wall_s"] for c in classes), 3)}


def read_cached(folder: Path, key: str) -> CandidateResult | None:
    """The result cached in `folder` under `key`, if any (a result of another command line or version: None)."""
    path = folder / "result.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("cache_key") != key:
        return None
    return CandidateResult(**{**data, "cached": True})


def run_candidate(job: PlanJob, c: Candidate, g: Guess, position: int, folder: Path, *, timeout_s: float,
                  env: Mapping[str, str], stop: threading.Event | None = None,
                  ray_address: str | None = None) -> CandidateResult:
    """Candidate `c`'s memory run and, if it fits, its emulation (the module docstring), in `folder`; cached.
    `ray_address`: every run is a Ray task (Ray initialised by the caller)."""
    import time

    argv = job.argv(c)
    key = cache_key(argv, job)
    cached = read_cached(folder, key)
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    result = CandidateResult(label=c.label(), argv=argv, guess_position=position, cache_key=key, status="fits",
                             guess={"memory_bytes": g.memory_bytes, "tokens_per_s_per_gpu": g.tokens_per_s_per_gpu})
    t0 = time.perf_counter()
    try:
        result.memory_run = _memory_run(argv, job, folder, timeout_s, stop, env, ray_address)
        if not result.memory_run["fits"]:
            result.status = "out of memory"
        else:
            report = emulate(argv, world_size=job.gpus, profile=job.profile, out=folder / "emulate",
                             gpus_per_node=job.gpus_per_node, warmup=1, timeout_s=timeout_s, overwrite=True,
                             env=env, stop=stop, ray_address=ray_address)
            result.emulation = _emulation(report)
            if not result.emulation["fits"]:
                result.status = "out of memory"
    except (RunFailed, ConfigError) as exc:  # a refusal of this layout (ConfigError) ends it alone, as a failure
        text = str(exc)
        result.error = text[-2000:]
        if stop is not None and stop.is_set():
            result.status = "stopped"
        elif "OutOfMemoryError" in text:
            result.status = "out of memory"
        else:
            result.status = "failed"
    result.wall_s = round(time.perf_counter() - t0, 3)
    if result.status != "stopped" and "--timeout" not in (result.error or ""):
        (folder / "result.json").write_text(json.dumps(result.to_dict(), indent=1))
    return result
