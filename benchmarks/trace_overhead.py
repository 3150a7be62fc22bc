"""Cost of trace capture: per op (in process) and on the toy example's step time (end to end).

1. Per op: one process plays rank 5 of 8192 and all-reduces 4 KiB on its 8-rank group (timing off, so
   the figure is the backend's own cost) with and without ``trace_dir``; CPU time per call, medians of
   --repeats runs, the two configurations alternated --pairs times.
2. End to end: ``prism_plugin.programs.toy_train`` as rank 0 of 8192 (1 real process, dgx-h100 timing),
   without and with tracing, --pairs times each. Wall-clock step times on a shared 2-core machine move by
   more than the effect, so the overhead is measured in CPU time, which other processes' load barely
   touches: each configuration runs --steps and --steps + --extra-steps steps, and the CPU time of the
   extra steps (getrusage of the child, less the trace file's write at exit, which the summary reports)
   divided by --extra-steps is its CPU per step. The overhead is
   (traced - untraced CPU per step) / untraced median wall step time. The measured wall times are
   printed too.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")


def _per_op_us(iters: int, repeats: int, trace_dir: str | None) -> float:
    import torch
    import torch.distributed as dist

    import prism_plugin as P

    P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=8192, real_ranks=(5,)), timing=False,
                                 trace_dir=trace_dir, trace_max_iterations=10**6))
    g = dist.new_group(list(range(8)))
    t = torch.ones(1024)
    P.mark_iteration()
    for _ in range(200):
        dist.all_reduce(t, group=g)
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()  # CPU time: what tracing adds, without other processes' load
        for _ in range(iters):
            dist.all_reduce(t, group=g)
        runs.append((time.process_time() - t0) / iters * 1e6)
        P.mark_iteration()
    P.deactivate()
    return statistics.median(runs)


def _toy(steps: int, trace_dir: str | None) -> tuple[float, list[float]]:
    """(CPU seconds of the child, its printed step times in ms)."""
    import resource

    from prism_plugin.config.channel import config_to_env
    from prism_plugin.config.emulation import EmulationConfig, VirtualWorld

    config = EmulationConfig(world=VirtualWorld(world_size=8192, real_ranks=(0,)), profile="dgx-h100",
                             trace_dir=trace_dir, trace_max_iterations=10**6)
    env = dict(os.environ, RANK="0", WORLD_SIZE="8192", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               PRISM_CONFIG=config_to_env(config), PRISM_PROCESS_INDEX="0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "prism_plugin.runtime.bootstrap",
                          "-m", "prism_plugin.programs.toy_train", "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = json.loads(re.search(r"^PRISM_SUMMARY (.*)$", out, re.M).group(1))  # type: ignore[union-attr]
    cpu -= summary["trace"]["write_s"] if "trace" in summary else 0.0  # the file written at exit: not a step
    return cpu, [float(m) for m in re.findall(r"step_time_ms ([0-9.]+)", out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--extra-steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    cpu: dict[bool, list[float]] = {False: [], True: []}
    wall: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        per_op: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.pairs):
            per_op[False].append(_per_op_us(args.iters, args.repeats, None))
            per_op[True].append(_per_op_us(args.iters, args.repeats, d))
        off_us, on_us = statistics.median(per_op[False]), statistics.median(per_op[True])
        for i in range(args.pairs):
            for traced in (False, True):
                where = os.path.join(d, f"toy{i}-{traced}") if traced else None
                short, _ = _toy(args.steps, where)
                long, times = _toy(args.steps + args.extra_steps, where)
                cpu[traced].append((long - short) / args.extra_steps)
                wall[traced] += times[args.warmup:]
        from prism_plugin.graph.rank_trace import RankTrace

        trace = RankTrace.load(os.path.join(d, "toy0-True", "rank0.trace.json"))
        ops_per_step = statistics.median(len(it.ops) for it in trace.iterations)
    step_ms = statistics.median(wall[False])
    cpu_off, cpu_on = statistics.median(cpu[False]), statistics.median(cpu[True])
    print(json.dumps({
        "allreduce_us_untraced": round(off_us, 2),
        "allreduce_us_traced": round(on_us, 2),
        "trace_us_per_op": round(on_us - off_us, 2),
        "toy_ops_per_step": ops_per_step,
        "toy_step_ms_median_untraced": round(step_ms, 4),
        "toy_step_ms_median_traced": round(statistics.median(wall[True]), 4),
        "toy_cpu_ms_per_step_untraced": round(1e3 * cpu_off, 4),
        "toy_cpu_ms_per_step_traced": round(1e3 * cpu_on, 4),
        "toy_overhead_pct": round(100 * (cpu_on - cpu_off) * 1e3 / step_ms, 3),
        "toy_overhead_pct_from_per_op": round(100 * ops_per_step * (on_us - off_us) / 1e3 / step_ms, 3),
        "pairs": args.pairs,
    }))


if __name__ == "__main__":
    main()
