"""`prism emulate`: the paper's whole pipeline for a Megatron job in one command, on virtual GPUs.

    prism emulate --world-size 8192 [--profile dgx-h100] [--out DIR] [--warmup 1] [--json] \\
        -- pretrain_gpt.py <the job's Megatron arguments, unchanged>

1. **slice**: the layout comes from the job's own arguments (``--tensor-model-parallel-size``,
   ``--pipeline-model-parallel-size``, ``--context-parallel-size``, ``--expert-model-parallel-size``,
   ``--num-virtual-stages-per-pipeline-rank``; dp = N / (tp x cp x pp)); `prism_plugin.graph.slicing` gives the
   classes of ranks and one profiling run per class;
2. **profile**: each run is the unmodified script as one real rank of N on a virtual GPU of the profile's model
   (``python -m prism_plugin.megatron ... --prism-device virtual-gpu --prism-trace``), with virtual time
   (`prism_plugin.runtime.virtual_gpu.clock`): its trace holds the modelled kernel time between its ops, its
   summary the exact per-rank memory;
3. **graph**: the traces become the N-rank execution graph (``<out>/job.graph``);
4. **replay**: the graph's replay on the profile gives every class's step time, compute, exposed communication
   and pipeline bubble (`prism_plugin.cli.graph.replay_prediction`).

The report: per class its rank, step, compute / exposed communication / bubble, peak allocated / reserved / device
total, and the job's step time, tokens/s/GPU (global batch x sequence / step / N), model TFLOP/s/GPU (Megatron's own
``num_floating_point_operations`` per iteration / step / N) and MFU (that / the GPU's dense bf16 peak). All figures
are modelled (kernel model, cost model), none measured; ``<out>/emulate.json`` keeps them.

Limitations: Megatron jobs only (DeepSpeed: `prism slice` / `prism profile` by hand); one real rank per profiling
run (virtual time couples ranks through their ops' issue times only within one process); no hybrid phase yet (the
`--prism-graph` rerun of chosen ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError

__all__ = ["add_emulate_parser", "emulate", "layout_of_megatron_args"]

_LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                 "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
                 "vpp": "--num-virtual-stages-per-pipeline-rank"}


def add_emulate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("emulate", help="slice, profile on virtual GPUs, build the graph and replay a "
                                              "Megatron job: its step time, throughput and memory at N GPUs")
    p.add_argument("--world-size", type=int, required=True, help="N, the job's number of GPUs")
    p.add_argument("--profile", default="dgx-h100", help="hardware profile with a GPU model (default dgx-h100)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("prism_emulate"), help="DIR for runs, graph and report")
    p.add_argument("--warmup", type=int, default=1, help="traced iterations dropped when building the graph")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per profiling run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("target", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py <Megatron arguments>")
    p.set_defaults(func=_cmd_emulate)


def layout_of_megatron_args(argv: list[str], world_size: int) -> str:
    """The ``prism slice`` layout of a Megatron command line (its parallel sizes; dp from N).

    >>> layout_of_megatron_args(["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"], 64)
    'tp=8,pp=2,cp=1,ep=1,dp=4'
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, flag in _LAYOUT_FLAGS.items():
        parser.add_argument(flag, dest=name, type=int, default=None)
    known, _ = parser.parse_known_args(argv)
    sizes = {name: getattr(known, name) or 1 for name in ("tp", "pp", "cp", "ep")}
    model = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world_size % model:
        raise ConfigError(f"--world-size {world_size} is not a multiple of tp x pp x cp = {model} (the job's "
                          "--tensor/--pipeline/--context-model-parallel-size): give a multiple of it")
    text = ",".join(f"{k}={v}" for k, v in sizes.items()) + f",dp={world_size // model}"
    if known.vpp:
        text += f",vpp={known.vpp}"
    return text


def _run_command(script_argv: list[str], rank: int, run_dir: Path, world_size: int, profile: str,
                 gpus_per_node: int) -> list[str]:
    return [sys.executable, "-m", "prism_plugin.megatron", *script_argv,
            "--prism-world-size", str(world_size), "--prism-real-ranks", str(rank), "--prism-profile", profile,
            "--prism-gpus-per-node", str(gpus_per_node), "--prism-device", "virtual-gpu",
            "--prism-output", str(run_dir), "--prism-trace", str(run_dir / "trace")]


def emulate(script_argv: list[str], *, world_size: int, profile: str = "dgx-h100", out: Path = Path("prism_emulate"),
            gpus_per_node: int = 8, warmup: int = 1, timeout_s: float = 3600.0,
            progress: Any = None) -> dict[str, Any]:
    """Run the pipeline of the module docstring; returns the report (also written to ``<out>/emulate.json``).

    Raises `ConfigError` on bad input (before any process starts) and `RuntimeError` when a profiling run fails
    (naming its log)."""
    from prism_plugin.cli.graph import _build, replay_prediction
    from prism_plugin.cost import load_profile
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.graph.slicing import make_plan, parse_layout
    from prism_plugin.runtime.preflight import check_directory

    if not script_argv or not script_argv[0].endswith(".py") or not Path(script_argv[0]).is_file():
        raise ConfigError("prism emulate: name the job's script and its Megatron arguments after `--`, e.g. "
                          "`-- pretrain_gpt.py --num-layers 32 ...`")
    if any(a.startswith("--prism-") for a in script_argv):
        raise ConfigError("prism emulate sets the --prism-* flags of each profiling run itself: drop them from the "
                          "job's arguments")
    hw = load_profile(profile)
    if hw.gpu is None:
        raise ConfigError(f"--profile {profile}: names no GPU model; use a GPU profile such as dgx-h100")
    gpu = gpu_spec(hw.gpu)
    layout = layout_of_megatron_args(script_argv[1:], world_size)
    plan = make_plan(parse_layout(layout, "megatron", world_size), 1)
    check_directory("--out", out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, ranks in enumerate(plan.runs):
        rank = ranks[0]
        run_dir = out / f"run{i}"
        run_dir.mkdir(parents=True, exist_ok=True)
        command = _run_command(script_argv, rank, run_dir, world_size, profile, gpus_per_node)
        t0 = time.perf_counter()
        if progress is not None:
            progress(f"profiling run {i + 1}/{len(plan.runs)}: rank {rank} on a virtual {gpu.name}")
        log = run_dir / "log.txt"
        with log.open("w") as f:
            rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=dict(os.environ, PRISM_VIRTUAL_TIME="on")).returncode
        if rc != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"prism emulate: profiling run {i} (rank {rank}) exited {rc}; log {log}:\n{tail}")
        summary = json.loads((run_dir / f"rank{rank}.summary.json").read_text())
        runs.append({"run": i, "rank": rank, "wall_s": round(time.perf_counter() - t0, 3), "summary": summary})
    if progress is not None:
        progress("building the execution graph and replaying it")
    graph = _build([r_dir / "trace" for r_dir in (out / f"run{i}" for i in range(len(runs)))], plan.job.world,
                   plan.class_axes, warmup, {"emulate": " ".join(script_argv)})
    graph.save(out / "job.graph")
    prediction, _ = replay_prediction(graph, profile)
    report = _report(runs, prediction, plan, layout, gpu, world_size, profile)
    (out / "emulate.json").write_text(json.dumps(report, indent=1))
    return report


def _report(runs: list[dict[str, Any]], prediction: dict[str, Any], plan: Any, layout: str, gpu: Any,
            world_size: int, profile: str) -> dict[str, Any]:
    step_s = prediction["step_us"] * 1e-6
    first = runs[0]["summary"].get("megatron", {})
    gbs, seq, flops = first.get("global_batch_size"), first.get("seq_length"), first.get("model_flops_per_iteration")
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
            "profiling_run_wall_s": run["wall_s"]})
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
        "classes": classes,
        "kernel_model": runs[0]["summary"]["virtual_gpu"].get("kernels", {}).get("model"),
        "figures": "modelled: kernel model (per-op time), cost model (communication), allocator model (memory); "
                   "step, throughput and MFU from the graph's replay",
        "replay": {k: prediction[k] for k in ("step_us", "num_actors", "events", "replay_s")},
    }


def _cmd_emulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    console = Console(stderr=True)
    with console.status("prism emulate") as status:
        report = emulate(target, world_size=args.world_size, profile=args.profile, out=args.out,
                         gpus_per_node=args.gpus_per_node, warmup=args.warmup, timeout_s=args.timeout,
                         progress=lambda text: status.update(f"prism emulate: {text}"))
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
    table.caption = (f"step {report['step_ms']:.3f} ms | {report['tokens_per_s_per_gpu']} tokens/s/GPU | "
                     f"{report['model_tflops_per_s_per_gpu']} model TFLOP/s/GPU | MFU "
                     f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | kernel model {report['kernel_model']}; "
                     f"{args.out}/emulate.json")
    Console().print(table)
    return 0
