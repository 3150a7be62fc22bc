"""`prism emulate`: the paper's whole pipeline for a Megatron or DeepSpeed job in one command, on virtual GPUs.

    prism emulate --world-size 8192 [--profile dgx-h100] [--output DIR] [--warmup 1] [--json] [--hybrid RANKS] \\
        -- pretrain_gpt.py <the job's Megatron arguments, unchanged>
    prism emulate --world-size 64 [--framework deepspeed] [--seq-length S] [--model-flops-per-iteration F] \\
        -- train.py --deepspeed_config ds_config.json <the script's arguments>

DeepSpeed jobs (detected or named with ``--framework``): `prism_plugin.cli.emulate_deepspeed` (layout, each run's
config, the figures it can and cannot give); the steps below are the same.

1. **slice**: the layout comes from the job's own arguments (``--tensor-model-parallel-size``,
   ``--pipeline-model-parallel-size``, ``--context-parallel-size``, ``--expert-model-parallel-size``,
   ``--num-virtual-stages-per-pipeline-rank``; dp = N / (tp x cp x pp)); `prism_plugin.graph.slicing` gives the
   classes of ranks and one profiling run per class;
2. **profile**: each run is the unmodified script as one real rank of N on a virtual GPU of the profile's model
   (``python -m prism_plugin.megatron ... --prism-device virtual-gpu --prism-trace``), with virtual time
   (`prism_plugin.device.clock`): its trace holds the modelled kernel time between its ops, its
   summary the exact per-rank memory. A Megatron run trains the job's first ``--warmup`` + 1 iterations (at least
   2) and ends at the mark that starts the next one, which closes the last (``--prism-iterations``,
   ``--prism-stop-at-iteration``, `profiled_iterations`: a launch script's ``--train-iters 500000`` is not run to
   its end; what a job does after its last iteration, a final evaluation or checkpoint save, is not run), and its
   pipeline's steady state is fast-forwarded (`prism_plugin.device.fast_forward`);
3. **graph**: the traces become the N-rank execution graph (``<out>/job.graph``);
4. **replay**: the graph's replay on the profile gives every class's step time, compute, exposed communication
   and pipeline bubble (`prism_plugin.cli.graph.replay_prediction`);
5. **hybrid** (``--hybrid RANKS``, optional): each named rank runs again as a real process on a virtual GPU
   against the graph (``--prism-graph`` / ``"prism.graph"``): its virtual peers arrive on its emulated clock when
   the replay says (`prism_plugin.runtime.arrivals`), so its emulated steps check the replay's figure for that
   rank: the report gives both and their difference (``hybrid``). One process per named rank.

The report: per class its rank, step, compute / exposed communication / bubble, peak allocated / reserved / device
total, and the job's step time, tokens/s/GPU (global batch x sequence / step / N), model TFLOP/s/GPU (Megatron's own
``num_floating_point_operations`` per iteration / step / N) and MFU (that / the GPU's dense bf16 peak). All figures
are modelled (kernel model, cost model), none measured; ``<out>/emulate.json`` keeps them.

Limitations: one real rank per profiling run and per hybrid run (several real ranks of one process group now couple
in emulated time, but emulate does not put consecutive stages into one run yet); DeepSpeed: no pipeline engine (see
`prism_plugin.cli.emulate_deepspeed`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prism_plugin.cli.emulate_runs import RunFailed, run_one
from prism_plugin.cli.settings_args import add_setting_arguments, given_settings
from prism_plugin.config.errors import ConfigError, int_at_least, positive_int

__all__ = ["add_emulate_parser", "check_job_argv", "check_megatron_job", "emulate", "layout_of_megatron_args",
           "profiled_iterations", "run_command"]

_LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                 "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
                 "vpp": "--num-virtual-stages-per-pipeline-rank"}


def add_emulate_parser(subparsers: Any) -> None:
    from prism_plugin.cli.emulate_deepspeed import add_deepspeed_arguments

    p = subparsers.add_parser("emulate", help="slice, profile on virtual GPUs, build the graph and replay a "
                                              "Megatron or DeepSpeed job: its step time, throughput and memory at N "
                                              "GPUs")
    p.add_argument("--world-size", type=int, required=True, help="N, the job's number of GPUs")
    p.add_argument("--profile", default="dgx-h100", help="hardware profile with a GPU model (default dgx-h100)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--output", "--out", type=Path, default=Path("prism_emulate"), help="DIR for runs, graph and report")
    p.add_argument("--jobs", type=int, default=1, help="profiling (and hybrid) runs at a time on this machine "
                                                        "(default 1; each run is one process of the job's size)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the profiling (and hybrid) runs as Ray tasks: local (an instance here with --jobs CPUs), "
                        "auto, HOST:PORT or ray://HOST:PORT; the nodes must share this Python and --output")
    p.add_argument("--overwrite", action="store_true", help="replace a previous emulate output in --output (a used "
                                                             "--output is refused without it)")
    p.add_argument("--warmup", type=int, default=1, help="traced iterations dropped when building the graph")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per profiling run")
    p.add_argument("--hybrid", default=None, metavar="RANKS",
                   help="after the replay, run these ranks (e.g. 0,7 or 0-3) as real processes against the graph")
    add_deepspeed_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_setting_arguments(p, RUN_SETTINGS)
    p.add_argument("target", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py <Megatron arguments> | -- "
                                                             "train.py --deepspeed_config ds.json <arguments>")
    p.set_defaults(func=_cmd_emulate)


def layout_of_megatron_args(argv: list[str], world_size: int) -> str:
    """The ``prism slice`` layout of a Megatron command line (its parallel sizes, the experts' tp where it is not tp;
    dp from N; the rank order when ``--use-tp-pp-dp-mapping`` puts dp last).

    >>> layout_of_megatron_args(["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"], 64)
    'tp=8,pp=2,cp=1,ep=1,dp=4'
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, flag in _LAYOUT_FLAGS.items():
        parser.add_argument(flag, dest=name, type=int, default=None)
    parser.add_argument("--use-tp-pp-dp-mapping", dest="dp_last", action="store_true")
    parser.add_argument("--expert-tensor-parallel-size", dest="etp", type=int, default=None)
    known, _ = parser.parse_known_args(argv)
    sizes = {name: getattr(known, name) or 1 for name in ("tp", "pp", "cp", "ep")}
    model = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world_size % model:
        raise ConfigError(f"--world-size {world_size} is not a multiple of tp x pp x cp = {model} (the job's "
                          "--tensor/--pipeline/--context-model-parallel-size): give a multiple of it")
    text = ",".join(f"{k}={v}" for k, v in sizes.items()) + f",dp={world_size // model}"
    if known.vpp:
        text += f",vpp={known.vpp}"
    if known.etp is not None and known.etp != sizes["tp"]:
        text += f",etp={known.etp}"
    if known.dp_last:  # Megatron's rank order with --use-tp-pp-dp-mapping (parallel_state.initialize_model_parallel)
        text += ",order=tp-cp-ep-pp-dp"
    return text


def _positive_number(flag: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} {value!r}: give a finite number > 0")


def _check_numbers(*, world_size: int, gpus_per_node: int, warmup: int, timeout_s: float, seq_length: int | None,
                   model_flops_per_iteration: float | None) -> None:
    """Every numeric argument of `emulate` in range, named as its flag (before any process starts)."""
    positive_int("--world-size", world_size, hint="N, the job's number of GPUs, e.g. --world-size 8192")
    positive_int("--gpus-per-node", gpus_per_node, hint="the cluster's GPUs per node, e.g. --gpus-per-node 8")
    if world_size > gpus_per_node and world_size % gpus_per_node:  # a job smaller than a node runs on part of it
        raise ConfigError(f"--gpus-per-node {gpus_per_node} does not divide --world-size {world_size}: the job would "
                          "end on a partial node; give a world size that is a multiple of it, or the cluster's GPUs "
                          "per node")
    int_at_least("--warmup", warmup, 0, hint="traced iterations dropped before the graph is built; 0 keeps all")
    _positive_number("--timeout", timeout_s)
    if seq_length is not None:
        positive_int("--seq-length", seq_length, hint="the tokens per sample, e.g. --seq-length 4096")
    if model_flops_per_iteration is not None:
        _positive_number("--model-flops-per-iteration", model_flops_per_iteration)


def check_megatron_job(argv: list[str], capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> None:
    """What a Megatron job's arguments and environment make it fail on in every profiling run, refused before the
    first (a `ConfigError` naming the argument and the fix): Megatron's own asserts on TP/CP without
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (GPUs before Blackwell, `capability`), heads not divisible by TP, expert
    parallelism without experts and context parallelism on the local spec without the flash stand-in."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, flag in _LAYOUT_FLAGS.items():
        parser.add_argument(flag, dest=name, type=int, default=None)
    parser.add_argument("--num-attention-heads", dest="heads", type=int, default=None)
    parser.add_argument("--num-experts", dest="experts", type=int, default=None)
    parser.add_argument("--transformer-impl", dest="impl", default="transformer_engine")
    for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp", "--overlap-moe-expert-parallel-comm"):
        parser.add_argument(flag, action="store_true")
    known, _ = parser.parse_known_args(argv)
    tp, cp, ep = known.tp or 1, known.cp or 1, known.ep or 1
    fsdp_or_overlap = known.use_torch_fsdp2 or known.use_megatron_fsdp or known.overlap_moe_expert_parallel_comm
    if (tp > 1 or cp > 1) and capability[0] < 10 and not fsdp_or_overlap \
            and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        raise ConfigError(f"the job's tensor/context parallelism (tp={tp}, cp={cp}) needs "
                          "CUDA_DEVICE_MAX_CONNECTIONS=1 on this GPU (Megatron asserts it before Blackwell; "
                          "Megatron-LM's launch scripts export it): run CUDA_DEVICE_MAX_CONNECTIONS=1 prism emulate "
                          "...")
    if known.heads is not None and known.heads % tp:
        raise ConfigError(f"--num-attention-heads {known.heads} is not divisible by --tensor-model-parallel-size "
                          f"{tp}: give a tensor-parallel size that divides the heads")
    if ep > 1 and not known.experts:
        raise ConfigError(f"--expert-model-parallel-size {ep} without --num-experts: expert parallelism needs an "
                          "MoE model (add --num-experts E, a multiple of it) or drop it")
    if cp > 1 and known.impl == "local" and env.get("PRISM_ATTENTION", "local").strip().lower() != "flash":
        raise ConfigError(f"--context-parallel-size {cp} with --transformer-impl local: Megatron's local attention "
                          "has no context parallelism; run PRISM_ATTENTION=flash prism emulate ... (the fused-"
                          "attention stand-in) or --transformer-impl transformer_engine")


def check_job_argv(script_argv: list[str], command: str, other: str) -> None:
    """A job after `--` as `command` (``prism emulate``, ``prism plan``) takes it: an existing ``.py`` script first
    (`other`: the message's alternative), and no ``--prism-*`` flag (the command sets them for each run)."""
    if not script_argv or not script_argv[0].endswith(".py") or not Path(script_argv[0]).is_file():
        raise ConfigError(f"{command}: name the job's script and its arguments after `--`, e.g. "
                          f"`-- pretrain_gpt.py --num-layers 32 ...` {other}")
    if any(a.startswith("--prism-") for a in script_argv):
        raise ConfigError(f"{command} sets the --prism-* flags of each run itself: drop them from the job's "
                          "arguments")


def run_command(script_argv: list[str], rank: int, run_dir: Path, world_size: int, profile: str,
                gpus_per_node: int, *, trace: bool = True, graph: Path | None = None,
                iterations: int | None = None) -> list[str]:
    """One profiling (or hybrid, with `graph`) run's command: the job as real rank `rank` of `world_size` on a
    virtual GPU of `profile`, writing into `run_dir` (and its trace, with `trace`); with `iterations`, the job's
    first that many iterations (``--prism-iterations``: a job stated longer is shortened, a shorter one runs as
    it is), ending where the last of them starts (``--prism-stop-at-iteration``: its mark closes the one before;
    nothing of it is needed)."""
    command = [sys.executable, "-m", "prism_plugin.megatron", *script_argv,
               "--prism-world-size", str(world_size), "--prism-real-ranks", str(rank), "--prism-profile", profile,
               "--prism-gpus-per-node", str(gpus_per_node), "--prism-device", "virtual-gpu",
               "--prism-output", str(run_dir)]
    if trace:
        command += ["--prism-trace", str(run_dir / "trace")]
    if graph is not None:
        command += ["--prism-graph", str(graph)]
    if iterations is not None:
        command += ["--prism-iterations", str(iterations), "--prism-stop-at-iteration", str(iterations)]
    return command


def profiled_iterations(warmup: int) -> int:
    """The iterations a Megatron profiling run states: the `warmup` ones the graph drops, one steady iteration, and
    the one whose start closes it (the run ends there: `run_command`); at least 3, so that a
    graph that keeps every iteration (``--warmup 0``) still holds a steady one beside the first (whose
    allocations, FP8 casts and optimizer state differ)."""
    return max(warmup + 2, 3)




def _run_all(runs: list[tuple[list[str], Path, int, str]], jobs: int, timeout_s: float,
             progress: Any = None, ray_address: str | None = None, env: Mapping[str, str] | None = None,
             stop: threading.Event | None = None) -> list[dict[str, Any]]:
    """Every run of `runs` ((command, run_dir, rank, what)), `jobs` at a time (or as Ray tasks: `emulate_ray`);
    results in order. The first failure (or Ctrl-C / SIGTERM here, or `stop` set by a caller's thread) stops the
    others and starts no more, and is raised. `env`: the local runs' environment (default this process's)."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    if ray_address is not None and runs:
        from prism_plugin.cli.emulate_ray import run_on_ray

        return run_on_ray(runs, ray_address, jobs=jobs, timeout_s=timeout_s, progress=progress, env=env, stop=stop)

    if jobs <= 1 or len(runs) <= 1:
        out = []
        for i, (command, run_dir, rank, what) in enumerate(runs):
            if progress is not None:
                progress(f"{what} ({i + 1}/{len(runs)}): rank {rank}")
            out.append(run_one(command, run_dir, rank, what, timeout_s, stop, env))
        return out
    caller_stop, stop = stop, threading.Event()  # a failure here stops this call's runs, not the caller's others
    if caller_stop is not None:  # the caller's stop reaches these runs (a daemon: it waits as long as the process)
        threading.Thread(target=lambda: (caller_stop.wait(), stop.set()), daemon=True).start()

    def one(i: int) -> dict[str, Any]:
        command, run_dir, rank, what = runs[i]
        if stop.is_set():
            raise RunFailed(f"prism emulate: {what} (rank {rank}) not started (another run failed)")
        if progress is not None:
            progress(f"{what} ({i + 1}/{len(runs)}, {jobs} at a time): rank {rank}")
        return run_one(command, run_dir, rank, what, timeout_s, stop, env)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(one, i) for i in range(len(runs))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            stop.set()
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
    except BaseException:
        stop.set()  # Ctrl-C, SIGTERM: the running runs kill their groups, the queued ones never start
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def emulate(script_argv: list[str], *, world_size: int, profile: str = "dgx-h100", out: Path = Path("prism_emulate"),
            gpus_per_node: int = 8, warmup: int = 1, timeout_s: float = 3600.0, progress: Any = None,
            framework: str = "auto", seq_length: int | None = None,
            model_flops_per_iteration: float | None = None, hybrid: str | None = None,
            overwrite: bool = False, jobs: int = 1, ray_address: str | None = None,
            env: Mapping[str, str] | None = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Run the pipeline of the module docstring; returns the report (also written to ``<out>/emulate.json``).

    `env`: the environment of the runs and of the job's checks (default this process's: `prism plan` passes each
    candidate's); `stop`: set from another thread, the runs in flight are killed and `RunFailed` raised.
    Raises `ConfigError` on bad input (before any process starts) and `RuntimeError` when a profiling run fails
    (naming its log)."""
    from prism_plugin.cli.emulate_deepspeed import DeepSpeedJob, detect_framework
    from prism_plugin.cli.graph import _build, replay_prediction
    from prism_plugin.config.emulation import parse_rank_list
    from prism_plugin.cost import load_profile
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.graph.slicing import make_plan, parse_layout
    from prism_plugin.launch.preflight import check_environment, claim_output

    check_job_argv(script_argv, "prism emulate", "or `-- train.py --deepspeed_config ds.json`")
    _check_numbers(world_size=world_size, gpus_per_node=gpus_per_node, warmup=warmup, timeout_s=timeout_s,
                   seq_length=seq_length, model_flops_per_iteration=model_flops_per_iteration)
    positive_int("--jobs", jobs, hint="profiling runs at a time on this machine, e.g. --jobs 2")
    if ray_address is not None:  # a dead address hung ray.init: refused before any run
        from prism_plugin.cli.emulate_ray import _import_ray
        from prism_plugin.cli.sweep import check_ray_address

        check_ray_address(ray_address)
        _import_ray()
    hw = load_profile(profile)
    if hw.gpu is None:
        raise ConfigError(f"--profile {profile}: names no GPU model; use a GPU profile such as dgx-h100")
    gpu = gpu_spec(hw.gpu)
    framework = detect_framework(script_argv, framework)
    ds_job = None
    if framework == "deepspeed":
        ds_job = DeepSpeedJob.from_argv(script_argv, world_size, seq_length)
        layout = ds_job.layout
    else:
        if seq_length is not None or model_flops_per_iteration is not None:
            raise ConfigError("--seq-length / --model-flops-per-iteration are for DeepSpeed jobs: a Megatron job's "
                              "figures come from its own arguments; drop them")
        layout = layout_of_megatron_args(script_argv[1:], world_size)
        check_megatron_job(script_argv[1:], gpu.capability, env)
    hybrid_ranks: tuple[int, ...] = ()
    if hybrid is not None:
        try:
            hybrid_ranks = parse_rank_list(hybrid)
        except ValueError as exc:
            raise ConfigError(f"--hybrid {hybrid!r}: {exc}") from None
        bad = [r for r in hybrid_ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"--hybrid {hybrid!r}: ranks {bad} are not in 0..{world_size - 1}")
    plan = make_plan(parse_layout(layout, framework, world_size), 1)
    # the runs share this environment; a hybrid rank may be a class's profiled one
    check_environment(sorted({ranks[0] for ranks in plan.runs} | set(hybrid_ranks)))
    claim_output("--output", out, "prism emulate", overwrite=overwrite)
    if progress is not None:
        progress(f"{layout} on N={world_size}: {len(plan.runs)} profiling run(s), one real rank each, output {out}")

    def command(rank: int, run_dir: Path, graph: Path | None = None) -> list[str]:
        if ds_job is not None:
            return ds_job.command(sys.executable, rank, run_dir, profile=profile, gpus_per_node=gpus_per_node,
                                  trace=graph is None, graph=graph)
        return run_command(script_argv, rank, run_dir, world_size, profile, gpus_per_node, trace=graph is None,
                           graph=graph, iterations=profiled_iterations(warmup))

    specs = []
    for i, ranks in enumerate(plan.runs):
        run_dir = out / f"run{i}"
        run_dir.mkdir(parents=True, exist_ok=True)
        specs.append((command(ranks[0], run_dir), run_dir, ranks[0], f"profiling run {i}"))
    if progress is not None:
        progress(f"profiling on virtual {gpu.name}s, {min(jobs, len(specs))} run(s) at a time")
    runs = [{"run": i, **result}
            for i, result in enumerate(_run_all(specs, jobs, timeout_s, progress, ray_address, env, stop))]
    if progress is not None:
        progress("building the execution graph and replaying it")
    graph = _build([r_dir / "trace" for r_dir in (out / f"run{i}" for i in range(len(runs)))], plan.job.world,
                   plan.class_axes, warmup, {"emulate": " ".join(script_argv), "framework": framework})
    graph_path = out / "job.graph"
    graph.save(graph_path)
    prediction, state = replay_prediction(graph, profile,
                                          ranks=sorted({r["rank"] for r in runs} | set(hybrid_ranks)))
    if ds_job is not None:
        figures = ds_job.figures(model_flops_per_iteration)
    else:
        first = runs[0]["summary"].get("megatron", {})
        figures = {k: first.get(k) for k in ("global_batch_size", "seq_length", "model_flops_per_iteration")}
    report = _report(runs, prediction, plan, layout, gpu, world_size, profile, figures)
    report["framework"] = framework
    report["runs_on"] = f"ray {ray_address}" if ray_address is not None else f"local, {jobs} at a time"
    if hybrid_ranks:
        hybrid_specs = []
        for rank in hybrid_ranks:
            run_dir = out / "hybrid" / f"rank{rank}"
            run_dir.mkdir(parents=True, exist_ok=True)
            hybrid_specs.append((command(rank, run_dir, graph_path), run_dir, rank, "hybrid run"))
        hybrid_runs = _run_all(hybrid_specs, jobs, timeout_s, progress, ray_address, env, stop)
        report["hybrid"] = _hybrid_rows(hybrid_runs, prediction, state, runs)
    (out / "emulate.json").write_text(json.dumps(report, indent=1))
    return report


def _hybrid_rows(runs: list[dict[str, Any]], prediction: dict[str, Any], state: Any,
                 profiled: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hybrid rank: its emulated steps (virtual time, virtual peers from the replay) against the replay's
    (unrounded: the summary keeps each step to the nanosecond, so ``difference_us`` is exact to 0.001 us), and its
    kernels beside its class representative's (whole runs): a rank whose own work differs from the
    representative's (e.g. a ZeRO partition spanning more parameters) differs from the replay by that much."""
    by_class = {prediction["ranks"][str(r["rank"])]["class"]: r for r in profiled}
    rows = []
    for run in runs:
        s, rank = run["summary"], run["rank"]
        steps_s = s["virtual_gpu"]["virtual_time"]["step_times_s"]
        replay_us = state.breakdown(rank).iteration_us
        last_us = steps_s[-1] * 1e6 if steps_s else None
        rows.append({"rank": rank, "class": prediction["ranks"][str(rank)]["class"],
                     "steps_ms": [round(t * 1e3, 6) for t in steps_s],
                     "step_ms": None if last_us is None else round(last_us / 1e3, 6),
                     "replay_step_ms": round(replay_us / 1e3, 6),
                     "difference_us": None if last_us is None else round(last_us - replay_us, 3),
                     "kernels": s["virtual_gpu"]["virtual_time"]["kernels"],
                     "kernel_s": s["virtual_gpu"]["virtual_time"]["kernel_s"],
                     "representative": _representative(by_class.get(prediction["ranks"][str(rank)]["class"])),
                     "graph": s.get("graph"), "wall_s": run["wall_s"]})
    return rows


def _representative(run: dict[str, Any] | None) -> dict[str, Any] | None:
    if run is None:
        return None
    clock = run["summary"]["virtual_gpu"]["virtual_time"]
    return {"rank": run["rank"], "kernels": clock["kernels"], "kernel_s": clock["kernel_s"]}


def _report(runs: list[dict[str, Any]], prediction: dict[str, Any], plan: Any, layout: str, gpu: Any,
            world_size: int, profile: str, figures: dict[str, Any]) -> dict[str, Any]:
    step_s = prediction["step_us"] * 1e-6
    gbs, seq, flops = figures["global_batch_size"], figures["seq_length"], figures["model_flops_per_iteration"]
    classes = []
    for run in runs:
        s, rank = run["summary"], run["rank"]
        row = prediction["ranks"].get(str(rank), {})
        device = max(s["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])  # the rank's own GPU
        classes.append({
            "class": row.get("class"), "rank": rank, "ranks_like_it": row.get("ranks_like_it"),
            "step_ms": round(row.get("step_us", 0.0) / 1e3, 3),
            "compute_ms": round(row.get("compute_us", 0.0) / 1e3, 3),
            "exposed_comm_ms": round(row.get("exposed_comm_us", 0.0) / 1e3, 3),
            "bubble_ms": round(row.get("bubble_us", 0.0) / 1e3, 3),
            "peak_allocated_bytes": device["peak_allocated_bytes"],
            "peak_reserved_bytes": device["peak_reserved_bytes"],
            "device_total_bytes": device["device_total_bytes"], "fits": device["fits"],
            "profiling_run_wall_s": run["wall_s"], "fast_forward": _fast_forwarded(s)})
    peak = gpu.peak_flops_per_s.get("bfloat16")
    tflops = flops / step_s / world_size / 1e12 if flops and step_s > 0 else None
    return {
        "world_size": world_size, "layout": layout, "profile": profile, "gpu": gpu.name,
        "classes_of_ranks": len(plan.classes), "profiling_runs": len(runs),
        "step_ms": round(step_s * 1e3, 3),
        "global_batch_size": gbs, "seq_length": seq,
        "tokens_per_s_per_gpu": round(gbs * seq / step_s / world_size, 1) if gbs and seq and step_s > 0 else None,
        "model_flops_per_iteration": flops,
        "model_tflops_per_s_per_gpu": round(tflops, 1) if tflops is not None else None,
        "mfu": round(tflops * 1e12 / peak, 4) if tflops is not None and peak else None,
        **{k: v for k, v in figures.items() if k not in ("global_batch_size", "seq_length",
                                                          "model_flops_per_iteration")},
        "classes": classes,
        "fast_forward": {k: sum(c["fast_forward"][k] for c in classes) for k in ("microbatches",
                                                                                 "microbatches_skipped")},
        "kernel_model": runs[0]["summary"]["virtual_gpu"].get("kernels", {}).get("model"),
        **_fit_fields([r["summary"]["virtual_gpu"].get("kernels", {}).get("fit") for r in runs]),
        "figures": "modelled: kernel model (per-op time), cost model (communication), allocator model (memory); "
                   "step, throughput and MFU from the graph's replay",
        "replay": {k: prediction[k] for k in ("step_us", "num_actors", "events", "replay_s")},
    }


def _fast_forwarded(summary: dict[str, Any]) -> dict[str, int]:
    """A profiling run's micro-batches (over its schedule calls) and how many of them were fast-forwarded
    (`prism_plugin.device.fast_forward`; 0 and 0 when it was off or had no schedule to drive)."""
    ff = summary.get("megatron", {}).get("fast_forward") or {}
    return {"microbatches": int(ff.get("microbatches", 0)), "microbatches_skipped": int(ff.get("microbatches_skipped",
                                                                                                 0))}


def _fit_fields(fits: list[Any]) -> dict[str, Any]:
    """Under the fit model: the runs it was fitted on, and ``fitting_row`` (a profiling run is one of this job's
    fitting runs: the report is not validation)."""
    fits = [f for f in fits if f]
    if not fits:
        return {}
    return {"kernel_fit": {k: fits[0][k] for k in ("file", "fitted_on")},
            "fitting_row": any(f["fitting_row"] for f in fits)}


RUN_SETTINGS = ("kernel_model", "kernel_table", "kernel_fit", "attention", "moe_routing", "te")
"""The settings of the table (`prism_plugin.config.settings`) `prism emulate` hands its profiling and hybrid runs."""


def _run_settings_env(args: argparse.Namespace) -> None:
    """The `RUN_SETTINGS` given (or taken from their environment aliases), checked by the table's validator and put in
    the environment the profiling runs inherit."""
    from prism_plugin.config.resolve import resolve
    from prism_plugin.config.settings import Entry

    given = given_settings(args, RUN_SETTINGS)
    settings = resolve({"world_size": 1, "real_ranks": "0", "gpus_per_node": 1, "device": "virtual-gpu", **given},
                       Entry.RUN)
    os.environ.update(settings.environ())


def _cmd_emulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    _run_settings_env(args)
    console = Console(stderr=True)
    t0 = time.perf_counter()

    def progress(text: str) -> None:  # a spinner on a terminal; a line per stage otherwise (a log, CI, a pipe)
        if console.is_terminal:
            status.update(f"prism emulate: {text}")
        else:
            console.print(f"prism emulate [{time.perf_counter() - t0:7.1f} s]: {text}", markup=False,
                          highlight=False, soft_wrap=True)

    # SIGTERM unwinds as SystemExit(143): each run's process group is killed on the way out
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        with console.status("prism emulate") as status:
            report = emulate(target, world_size=args.world_size, profile=args.profile, out=args.output,
                             gpus_per_node=args.gpus_per_node, warmup=args.warmup, timeout_s=args.timeout,
                             progress=progress, framework=args.framework,
                             seq_length=args.seq_length, model_flops_per_iteration=args.model_flops_per_iteration,
                             hybrid=args.hybrid, overwrite=args.overwrite, jobs=args.jobs,
                             ray_address=args.ray)
    except RunFailed as exc:  # one message naming the run's log, no traceback
        console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    table = Table(title=f"prism emulate: {report['layout']} on {report['world_size']} x {report['gpu']} "
                        f"({report['profile']}; {report['profiling_runs']} profiling runs, all figures modelled)")
    for col in ("class", "rank", "ranks", "step ms", "compute ms", "exposed comm ms", "bubble ms",
                "peak allocated", "peak reserved", "device total", "fits"):
        table.add_column(col, justify="right")
    for c in report["classes"]:
        table.add_row(str(c["class"]), str(c["rank"]), str(c["ranks_like_it"]), f"{c['step_ms']:.3f}",
                      f"{c['compute_ms']:.3f}", f"{c['exposed_comm_ms']:.3f}", f"{c['bubble_ms']:.3f}",
                      f"{c['peak_allocated_bytes'] / 2**30:.2f} GiB", f"{c['peak_reserved_bytes'] / 2**30:.2f} GiB",
                      f"{c['device_total_bytes'] / 2**30:.2f} GiB", "yes" if c["fits"] else "NO")
    mfu = report["mfu"]

    def shown(value: Any) -> str:
        return "n/a" if value is None else str(value)

    table.caption = (f"step {report['step_ms']:.3f} ms | {shown(report['tokens_per_s_per_gpu'])} tokens/s/GPU | "
                     f"{shown(report['model_tflops_per_s_per_gpu'])} model TFLOP/s/GPU | MFU "
                     f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | kernel model {report['kernel_model']}; "
                     f"{args.output}/emulate.json")
    console = Console()
    console.print(table)
    for name, why in (report.get("unavailable") or {}).items():
        console.print(f"{name}: n/a ({why})")
    if report.get("hybrid"):
        hybrid = Table(title="hybrid: real ranks against the graph (virtual peers from the replay), emulated time")
        for col in ("rank", "class", "step ms", "replay step ms", "difference us", "ops replayed", "outside graph",
                    "kernels (class rep.)"):
            hybrid.add_column(col, justify="right")
        for h in report["hybrid"]:
            g, rep = h["graph"] or {}, h["representative"] or {}
            hybrid.add_row(str(h["rank"]), str(h["class"]), shown(h["step_ms"]), str(h["replay_step_ms"]),
                           shown(h["difference_us"]), shown(g.get("ops_replayed")), shown(g.get("ops_outside_graph")),
                           f"{h['kernels']} ({shown(rep.get('kernels'))})")
        console.print(hybrid)
    return 0
