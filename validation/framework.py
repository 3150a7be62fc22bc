"""Validation of replay and hybrid emulation against real Megatron-core and DeepSpeed pipeline runs.

The jobs are the recipes' tiny pipeline-parallel programs at N = 2 (pp = 2, tp = dp = 1, 1F1B), real
compute on this machine's CPU:

- megatron: ``recipes/megatron-pp2.yaml``'s GPT (4 layers, hidden 64, 4 micro-batches of 2) through the
  drop-in wrapper ``python -m prism_plugin.megatron pretrain_gpt.py ... --prism-*`` (Megatron's own
  training loop, mock data; iterations end at Megatron's optimizer step);
- deepspeed: ``recipes/deepspeed-pipe2.yaml``'s PipelineModule (4 Linear+GELU blocks, 4 micro-batches of 8,
  ZeRO stage 1; hidden 1024 instead of the recipe's 256 by default, see `FrameworkJob.hidden`) through
  ``prism_plugin/programs/deepspeed_mlp.py`` with a ``"prism"`` ds_config section.

The cost profile's p2p overhead is first fitted to an activation transfer measured on this machine
(`validation.pipeline.calibrated_profile`); without it the replay misses the ~0.3 ms
a gloo transfer costs here, ~10 ms per DeepSpeed step.

Runs (each rank's per-iteration trace written by prism's tracer):

1. *real*: both ranks real, through the prism backend (every member real: gloo underneath);
2. the execution graph: from the real run's traces (default), or, with ``graph_from="profiling"``, from
   ``prism slice --devices 1`` profiling runs (one real rank each, the other virtual with the symmetric
   assumption), started together so the machine is loaded as in the real run;
3. *replay*: the graph's steady-state step time;
4. *hybrid*: rank 0 real with rank 1 virtual (arriving as the graph's replay says), and vice versa; both
   hybrid runs are started together, again loading the machine's 2 cores as the real run does.

Figures (the same as `validation.pipeline`: `replay_errors`, `hybrid_errors`):
error of the mean and mean / max over steps of |x - real| / real for the replay and each hybrid rank, per-op
wait errors of each hybrid rank, the noise of the real run (coefficient of variation of its steps;
with ``real_runs=2`` also the run-to-run difference), each hybrid rank's own compute against the real
run's (``compute_delta_pct_of_step``) and how exactly its replayed ops completed when the replay said
(`arrival_errors`: ``arrivals_check``).

Compute coupling. In the real run both ranks share this machine's 2 cores and its memory bandwidth, and
the pipeline keeps them in phase (both run their optimizer step at once, for one); the hybrid runs are two
independent jobs whose phases drift. Measured (fresh-clone CI, DeepSpeed hidden 1024): the optimizer tail
of a real step took 18-25 ms, of a hybrid step 16.7-17.4 ms, and a hybrid rank's own compute per step was
up to 12-18% of the step below the real run's (Megatron: 4-16%). The graph carries the real run's
compute, so a hybrid rank can run faster than the replay predicts by that much, with its replayed ops
still completing within microseconds of when the replay says (median error 2-6 us). On a cluster each
GPU has its own memory, so this coupling is this machine's, not the job's.

Limitation: compute is real, on 2 shared cores: when other work holds them, every step moves (Megatron's
tiny GPT by tens of percent); read the errors next to the noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.graph.rank_trace import RankTrace, load_rank_traces
from validation.pipeline import (
    arrival_errors,
    calibrated_profile,
    compared_steps,
    hybrid_errors,
    replay_errors,
    sampled_errors,
)

__all__ = ["FRAMEWORKS", "FrameworkJob", "RunSpec", "run_commands", "validate_framework"]

FRAMEWORKS = ("megatron", "deepspeed")
_RECIPES = {"megatron": "megatron-pp2.yaml", "deepspeed": "deepspeed-pipe2.yaml"}
# the DeepSpeed recipe's hidden 256 makes ~20 ms steps, of which wake-ups on 2 busy cores are a third:
# 1024 (~80 ms steps) measures the schedule rather than the OS scheduler
_DEFAULT_HIDDEN = {"deepspeed": 1024}
REPO_DIR = Path(__file__).resolve().parents[1]
PP = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkJob:
    """The validated job and how its runs are made."""

    framework: str = "megatron"
    steps: int = 24
    """Steps of the real and hybrid runs (the first is before the first iteration mark)."""
    warmup: int = 3
    """Traced iterations dropped before comparing."""
    profile: str = "local-cpu-gloo"
    """Cost model of the emulated runs and the replay (a name or a YAML path)."""
    calibrate: bool = True
    """Fit the profile's p2p overhead to an activation transfer measured on this machine first (as
    `validation.pipeline` does): on 2 busy cores a transfer costs ~1 ms of wake-ups."""
    graph_from: str = "real"
    """``real``: the graph is built from the real run's traces; ``profiling``: from profiling runs."""
    hidden: int | None = None
    """Override of the recipe's hidden size (None: 1024 for deepspeed, the recipe's 64 for megatron)."""
    profile_steps: int = 12
    graph_warmup: int = 2
    real_runs: int = 1
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework {self.framework!r}: choose one of {', '.join(FRAMEWORKS)}")
        if self.graph_from not in ("real", "profiling"):
            raise ValueError(f"graph_from {self.graph_from!r}: choose real or profiling")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One run of the job: its real ranks, where its traces and summaries go, an optional graph."""

    out: Path
    real_ranks: tuple[int, ...]
    steps: int
    graph: Path | None = None


def _recipe(job: FrameworkJob, steps: int) -> Any:
    from prism_plugin.recipes.load import load_recipe
    from prism_plugin.recipes.schema import Steps

    recipe = load_recipe(REPO_DIR / "recipes" / _RECIPES[job.framework])
    hidden = job.hidden if job.hidden is not None else _DEFAULT_HIDDEN.get(job.framework)
    if hidden is not None:
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, hidden_size=hidden))
    return dataclasses.replace(recipe, steps=Steps(total=steps, warmup=min(job.warmup, steps - 2)))


def activation_bytes(job: FrameworkJob) -> int:
    """Bytes of one activation micro-batch a stage sends (float32)."""
    m = _recipe(job, job.steps).model
    return 4 * m.micro_batch_size * m.hidden_size * (m.seq_length if job.framework == "megatron" else 1)


def run_commands(job: FrameworkJob, run: RunSpec) -> list[tuple[list[str], dict[str, str]]]:
    """The processes of `run`: (argv, environment additions) each; files they need are written here."""
    recipe = _recipe(job, run.steps)
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = ",".join(str(r) for r in run.real_ranks)
    if job.framework == "megatron":
        from prism_plugin.recipes.plans import MEGATRON_SCRIPT, megatron_args

        argv = [sys.executable, "-m", "prism_plugin.megatron", str(MEGATRON_SCRIPT), *megatron_args(recipe, PP),
                "--prism-world-size", str(PP), "--prism-real-ranks", ranks, "--prism-profile", job.profile,
                "--prism-gpus-per-node", str(PP), "--prism-trace", str(run.out), "--prism-output", str(run.out)]
        if run.graph is not None:
            argv += ["--prism-graph", str(run.graph)]
        # K > 1 real ranks: the wrapper starts K processes itself
        return [(argv, {**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})]
    from prism_plugin.recipes.plans import deepspeed_args, deepspeed_config

    section: dict[str, object] = {"world_size": PP, "real_ranks": list(run.real_ranks), "profile": job.profile,
                                  "gpus_per_node": PP, "trace": str(run.out), "output": str(run.out),
                                  # what a stage receives from a virtual previous stage: one activation micro-batch
                                  "pipe_activations": {"shape": [recipe.model.micro_batch_size,
                                                                 recipe.model.hidden_size], "dtype": "float32"}}
    if run.graph is not None:
        section["graph"] = str(run.graph)
    cfg = run.out / "ds_config.json"
    cfg.write_text(json.dumps(deepspeed_config(recipe, PP, section), indent=2), encoding="utf-8")
    k = len(run.real_ranks)
    store = {"PRISM_STORE_FILE": str(run.out / "store")} if k > 1 else {}
    return [([sys.executable, *deepspeed_args(recipe, cfg)],
             {**env, **store, "RANK": str(i), "WORLD_SIZE": str(k), "LOCAL_RANK": str(i)}) for i in range(k)]


def _launch(job: FrameworkJob, runs: Sequence[RunSpec]) -> list[dict[int, RankTrace]]:
    """Start every process of `runs` together, wait for all, return each run's traces by rank."""
    procs: list[tuple[RunSpec, subprocess.Popen[bytes], Path]] = []
    try:
        for run in runs:
            run.out.mkdir(parents=True, exist_ok=True)
            for i, (argv, env) in enumerate(run_commands(job, run)):
                log = run.out / f"process{i}.log"
                with log.open("wb") as fh:
                    procs.append((run, subprocess.Popen(argv, env={**os.environ, **env}, stdout=fh,
                                                        stderr=subprocess.STDOUT, cwd=run.out), log))
        deadline = time.monotonic() + job.timeout_s
        for run, p, log in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{job.framework} run with real ranks {list(run.real_ranks)} exited {rc}:\n{tail}")
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for run in runs:
        traces = {t.rank: t for t in load_rank_traces([run.out])}
        if sorted(traces) != sorted(run.real_ranks):
            raise RuntimeError(f"{run.out}: traces of ranks {sorted(traces)}, expected {sorted(run.real_ranks)}")
        out.append(traces)
    return out


def _cv_pct(values: Sequence[float]) -> float:
    return round(100 * statistics.stdev(values) / statistics.fmean(values), 3)


def validate_framework(job: FrameworkJob, workdir: Path, *, hybrid_ranks: Sequence[int] = (0, 1)) -> dict[str, Any]:
    """Run the real, (profiling) and hybrid runs of `job` under `workdir` and compare (module docstring)."""
    from prism_plugin.cost import CostModel, load_profile
    from prism_plugin.graph.convert import graph_from_rank_traces
    from prism_plugin.graph.slicing import make_plan, parse_layout
    from prism_plugin.graph.steady import steady_state

    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    measured_us = None
    if job.calibrate:
        path, measured_us = calibrated_profile(job.profile, activation_bytes(job), workdir / "calibrated.yaml")
        job = dataclasses.replace(job, profile=str(path), calibrate=False)
    real = [_launch(job, [RunSpec(out=workdir / f"real{i}", real_ranks=(0, 1), steps=job.steps)])[0]
            for i in range(job.real_runs)]
    plan = make_plan(parse_layout(f"pp={PP},dp=1", job.framework), devices=1)
    if job.graph_from == "profiling":
        runs = [RunSpec(out=workdir / f"profile{i}", real_ranks=tuple(ranks), steps=job.profile_steps)
                for i, ranks in enumerate(plan.runs)]
        sources = [t for traces in _launch(job, runs) for t in traces.values()]
    else:
        sources = list(real[0].values())
    graph = graph_from_rank_traces(sources, plan.job.world, plan.class_axes, warmup=job.graph_warmup,
                                   metadata={"validation": job.framework, "graph_from": job.graph_from})
    graph_path = graph.save(workdir / "job.graph")
    cost = CostModel(load_profile(job.profile))
    state = steady_state(graph, cost)
    a = real[0]
    real_steps = [s for r in sorted(a) for s in compared_steps(a[r], job.warmup)]
    figures: dict[str, Any] = {
        "job": {"framework": job.framework, "pp": PP, "recipe": _RECIPES[job.framework], "profile": job.profile,
                "graph_from": job.graph_from, "steps_compared": len(compared_steps(a[0], job.warmup)),
                "transfer_us_measured": None if measured_us is None else round(measured_us, 1)},
        "real_step_ms": {str(r): round(statistics.fmean(compared_steps(a[r], job.warmup)) / 1e3, 4) for r in sorted(a)},
        "real_step_median_ms": round(statistics.median(real_steps) / 1e3, 4),
        "real_step_cv_pct": _cv_pct(real_steps),
        "replay": {**replay_errors(state.step_us, real_steps), **sampled_errors(graph, cost, real_steps)},
        "predicted_rank_step_ms": {str(r): round(state.rank_step_us(r) / 1e3, 4) for r in range(PP)},
    }
    if job.real_runs > 1:
        b_steps = [s for r in sorted(real[1]) for s in compared_steps(real[1][r], job.warmup)]
        figures["real_run_to_run_pct"] = round(100 * abs(statistics.fmean(b_steps) / statistics.fmean(real_steps)
                                                         - 1), 3)
    hybrid_runs = [RunSpec(out=workdir / f"hybrid{r}", real_ranks=(r,), steps=job.steps, graph=graph_path)
                   for r in hybrid_ranks]
    hybrid: dict[str, Any] = {}
    for run, traces in zip(hybrid_runs, _launch(job, hybrid_runs), strict=True):
        r = run.real_ranks[0]
        summary = json.loads((run.out / f"rank{r}.summary.json").read_text())
        hybrid[str(r)] = {**hybrid_errors(a[r], traces[r], job.warmup),
                          "arrivals_check": arrival_errors(traces[r], graph, cost, job.warmup),
                          "arrivals": summary.get("arrivals"), "graph_ops": summary.get("graph")}
    figures["hybrid"] = hybrid
    figures["graph"] = str(graph_path)
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--framework", choices=FRAMEWORKS, default="megatron")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--graph-from", choices=("real", "profiling"), default="real")
    ap.add_argument("--profile", default="local-cpu-gloo")
    ap.add_argument("--hidden", type=int, default=None, help="override the recipe's hidden size")
    ap.add_argument("--no-calibrate", action="store_true", help="use --profile as it is")
    args = ap.parse_args()
    job = FrameworkJob(framework=args.framework, steps=args.steps, graph_from=args.graph_from, profile=args.profile,
                       calibrate=not args.no_calibrate, hidden=args.hidden)
    print(json.dumps(validate_framework(job, args.workdir)))


if __name__ == "__main__":
    main()
