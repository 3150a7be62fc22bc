"""Validation of slicing, replay and hybrid emulation against a real pipeline run on this machine.

The job is `prism_plugin.programs.pipeline_train` (1F1B over send/recv, compute as sleeps, so the 2-core
machine keeps compute time steady) with ``pp`` stages. Runs, each through the `prism run` launcher:

1. *real*: every rank real (the prism backend with all members real is plain gloo underneath; the tracer
   records each rank's step times and per-op waits), twice (A, B): B measures run-to-run noise;
2. *profiling*: `prism slice --devices 1` plan: one real rank per stage, every other rank virtual
   (symmetric arrivals); their traces build the execution graph;
3. *replay*: the graph's steady-state step time (no process runs);
4. *hybrid*: each stage's rank alone, the others virtual, arriving as the graph's replay says.

Figures (``validate(...)`` returns them; ``python -m validation.pipeline`` prints
JSON): step-time errors of the replay and of each hybrid rank against real run A, as the error of the
mean and the mean / max over steps of |x - real step| / real step; per-op wait errors of each hybrid rank
(mean over steps of the time the rank was held by each op, hybrid vs real); run-to-run noise (A vs B).

Limitation: the real run must fit this machine (``pp`` processes on 2 cores); compute is slept, so the
comparison exercises the schedule, the transfers and the emulator, not compute contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.graph.rank_trace import RankTrace, load_rank_traces
from prism_plugin.launch.launcher import LaunchSpec, launch

if TYPE_CHECKING:
    from prism_plugin.config.kinds import OpKind
    from prism_plugin.cost import CostModel
    from prism_plugin.graph.schema import ExecutionGraph

__all__ = ["PipelineJob", "arrival_errors", "calibrated_profile", "compared_steps", "hybrid_errors",
           "measure_transfer_us", "op_waits_us", "replay_errors", "run_pipeline", "sampled_errors", "validate"]

MODULE = "prism_plugin.programs.pipeline_train"


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineJob:
    """The validated job and how long each run is."""

    pp: int = 2
    microbatches: int = 8
    fwd_ms: str = "3,4"
    bwd_ms: str = "6,8"
    steps: int = 24
    """Steps of the real and hybrid runs (the first is before the first iteration mark)."""
    warmup: int = 3
    """Traced iterations dropped before comparing."""
    profile_steps: int = 12
    profile: str = "local-cpu-gloo"
    """Cost model of the emulated runs and the replay (a name or a YAML path)."""
    calibrate: bool = True
    """Fit the profile's p2p overhead to transfers measured on this machine first (`calibrated_profile`)."""
    batch: int = 4
    hidden: int = 64
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def activation_bytes(self) -> int:
        return self.batch * self.hidden * 4  # float32

    def args(self, steps: int) -> list[str]:
        return ["-m", MODULE, "--microbatches", str(self.microbatches), "--fwd-ms", self.fwd_ms,
                "--bwd-ms", self.bwd_ms, "--batch", str(self.batch), "--hidden", str(self.hidden),
                "--steps", str(steps), *self.extra_args]


def _probe(rank: int, path: str, queue: Any, size_bytes: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(path, 2))
    out, got, peer = torch.ones(size_bytes // 4), torch.empty(size_bytes // 4), 1 - rank
    spans = []
    for i in range(2 * rounds):
        time.sleep(0.003 if rank == 0 else 0.005)  # both asleep between transfers, as pipeline stages are
        t0 = time.perf_counter()
        if i % 2:  # a paired exchange (send_forward_recv_backward and its peer's twin)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)]):
                req.wait()
        elif rank == 0:
            dist.send(out, 1)
        else:
            dist.recv(got, 0)
        spans.append((t0, time.perf_counter()))
    queue.put((rank, spans))
    dist.barrier()
    dist.destroy_process_group()


def measure_transfer_us(size_bytes: int, rounds: int = 40, workdir: Path | None = None) -> float:
    """Median time of a gloo transfer between 2 local processes, from the later arrival to the first completion.

    Half single send/recv, half paired exchanges (isend + irecv both ways), each after a sleep, as the
    pipeline's transfers are. The median: on a shared machine the tail (milliseconds when another job holds
    the cores as a process wakes up) is other work's noise, not the link's cost.
    """
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    folder = Path(tempfile.mkdtemp(prefix="prism-probe-", dir=workdir))
    procs = [ctx.Process(target=_probe, args=(r, str(folder / "store"), queue, size_bytes, rounds)) for r in range(2)]
    for p in procs:
        p.start()
    spans = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    skip = 4  # first transfers connect the pair
    costs = [min(spans[0][i][1], spans[1][i][1]) - max(spans[0][i][0], spans[1][i][0]) for i in range(skip, 2 * rounds)]
    return 1e6 * statistics.median(costs)


def calibrated_profile(base: str, size_bytes: int, path: Path, rounds: int = 40) -> tuple[Path, float]:
    """`base` with its p2p overhead set so a `size_bytes` transfer costs what `measure_transfer_us` measures.

    Returns (the profile YAML written to `path`, the measured transfer time in us).
    """
    from prism_plugin.cost import CostModel, load_profile, override_profile
    from prism_plugin.cost.profiles import profile_to_yaml

    profile = load_profile(base)
    measured = measure_transfer_us(size_bytes, rounds, path.parent)
    modelled = CostModel(profile).p2p_us(size_bytes, 0, 1)
    overhead = max(0.0, profile.p2p_overhead_us + measured - modelled)
    tuned = override_profile(profile, {"p2p_overhead_us": round(overhead, 1), "name": f"{profile.name}-calibrated",
                                       "description": f"{base}, p2p overhead fitted to {measured:.0f} us per "
                                                      f"{size_bytes} B transfer measured by pipeline_validation"})
    path.write_text(profile_to_yaml(tuned), encoding="utf-8")
    return path, measured


def run_pipeline(job: PipelineJob, out: Path, real_ranks: Sequence[int], steps: int, profile: str,
                 graph: Path | None = None, timeout_s: float = 300.0,
                 faults: Sequence[str] = ()) -> dict[int, RankTrace]:
    """One `prism run` of the job with `real_ranks` real (the others virtual); the real ranks' traces by rank."""
    config = EmulationConfig(world=VirtualWorld(world_size=job.pp, real_ranks=tuple(real_ranks), gpus_per_node=2),
                             profile=profile, trace_dir=out, output_dir=out, graph=graph, faults=tuple(faults))
    rc = launch(LaunchSpec(config=config, target=job.args(steps), store_dir=out), timeout_s=timeout_s)
    if rc != 0:
        raise RuntimeError(f"pipeline run with real ranks {list(real_ranks)} exited {rc} (see its output)")
    return {t.rank: t for t in load_rank_traces([out])}


def _plain_run(job: PipelineJob, out: Path, timeout_s: float = 300.0) -> list[float]:
    """Step times (us) the program prints in a plain gloo run without prism (FileStore rendezvous)."""
    import os
    import re
    import subprocess
    import sys

    out.mkdir(parents=True, exist_ok=True)
    init = f"file://{out / 'store'}"
    procs = [subprocess.Popen([sys.executable, *job.args(job.steps), "--init-method", init],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(job.pp)},
                              stdout=subprocess.PIPE, text=True) for r in range(job.pp)]
    times: list[float] = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout_s)
        if p.returncode:
            raise RuntimeError(f"plain gloo run exited {p.returncode}")
        times += [1e3 * float(t) for t in re.findall(r"step_time_ms ([0-9.]+)", text)[job.warmup + 1:]]
    return times


def compared_steps(trace: RankTrace, warmup: int) -> list[float]:
    """The step times (us) a validation compares: the traced iterations after the first `warmup`."""
    return trace.step_times_us()[warmup:]


def _compute_ms(trace: RankTrace, warmup: int) -> float:
    """Mean per step of the time the rank was not held by an op (its own compute and host work), in ms."""
    its = trace.iterations[warmup:]
    return statistics.fmean(it.duration_us - sum(op.blocked_us for op in it.ops) for it in its) / 1e3


def op_waits_us(trace: RankTrace, warmup: int) -> list[float]:
    """Mean over steady iterations of the time each op (by position) held the rank in wait(), in us.

    (A blocking op is waited on right after its issue, so this is its duration but for the issue call.)
    Iterations whose op count differs from the first steady one are skipped.
    """
    its = trace.iterations[warmup:]
    n = len(its[0].ops)
    its = [it for it in its if len(it.ops) == n]
    return [statistics.fmean(it.ops[k].blocked_us for it in its) for k in range(n)]


def _errors(values: Sequence[float], reference: Sequence[float]) -> dict[str, float]:
    """Error of the mean of `values` against the mean of `reference`, and per-step |v - ref_mean| / ref_mean."""
    ref = statistics.fmean(reference)
    per_step = [abs(v - ref) / ref for v in values]
    return {"mean_error_pct": round(100 * (statistics.fmean(values) / ref - 1), 3),
            "per_step_mean_error_pct": round(100 * statistics.fmean(per_step), 3),
            "per_step_max_error_pct": round(100 * max(per_step), 3)}


def replay_errors(predicted_us: float, real_steps: Sequence[float]) -> dict[str, float]:
    """The replay's predicted step time against the real steps: error of the mean, mean / max per step."""
    per_step = [abs(predicted_us - s) / s for s in real_steps]
    return {"predicted_step_ms": round(predicted_us / 1e3, 4), **_errors([predicted_us], real_steps),
            "per_step_mean_error_pct": round(100 * statistics.fmean(per_step), 3),
            "per_step_max_error_pct": round(100 * max(per_step), 3)}


def sampled_errors(graph: ExecutionGraph, cost: CostModel, real_steps: Sequence[float]) -> dict[str, float]:
    """The sampled replay (traced iterations in order, each with its own spans) against the real steps."""
    from prism_plugin.graph.steady import sampled_steps

    mean_us = sampled_steps(graph, cost).mean_step_us()
    return {"sampled_step_ms": round(mean_us / 1e3, 4),
            "sampled_mean_error_pct": round(100 * (mean_us / statistics.fmean(real_steps) - 1), 3)}


def hybrid_errors(real: RankTrace, hybrid: RankTrace, warmup: int) -> dict[str, Any]:
    """One rank's hybrid run against its real run: step-time errors and per-op wait errors (module docstring)."""
    mine, steps_h = compared_steps(real, warmup), compared_steps(hybrid, warmup)
    waits_real, waits_h = op_waits_us(real, warmup), op_waits_us(hybrid, warmup)
    if len(waits_real) != len(waits_h):
        raise RuntimeError(f"rank {real.rank}: the hybrid run issued {len(waits_h)} ops per step, the real run "
                           f"{len(waits_real)}")
    diffs = [abs(x - y) for x, y in zip(waits_h, waits_real, strict=True)]
    step = statistics.fmean(mine)
    compute_real, compute_h = _compute_ms(real, warmup), _compute_ms(hybrid, warmup)
    return {
        "step_ms": round(statistics.fmean(steps_h) / 1e3, 4),
        "step_cv_pct": round(100 * statistics.stdev(steps_h) / statistics.fmean(steps_h), 3),
        **_errors(steps_h, mine),
        "ops_per_step": len(diffs),
        "wait_total_ms_real": round(sum(waits_real) / 1e3, 4),
        "wait_total_ms_hybrid": round(sum(waits_h) / 1e3, 4),
        "wait_mean_abs_error_us": round(statistics.fmean(diffs), 1),
        "wait_max_abs_error_us": round(max(diffs), 1),
        "wait_total_error_pct_of_step": round(100 * abs(sum(waits_h) - sum(waits_real)) / step, 3),
        "wait_mean_abs_error_pct_of_step": round(100 * statistics.fmean(diffs) / step, 3),
        "compute_ms_real": round(compute_real, 4),
        "compute_ms_hybrid": round(compute_h, 4),
        "compute_delta_pct_of_step": round(100 * (compute_h - compute_real) / (step / 1e3), 3),
    }


def arrival_errors(hybrid: RankTrace, graph: ExecutionGraph, cost: CostModel, warmup: int) -> dict[str, Any]:
    """How exactly a hybrid rank's replayed ops completed when the replay said (the mechanism, not the job).

    For each op of the steady iterations that has a virtual member in the graph's arrival table, the
    emulator must complete it at ``max(own arrival, anchor + table offset) + modelled cost`` (or at the
    wait() entry, when later): the error is the traced wait return minus that, in us (positive: woken
    late). Independent of how fast this machine ran the rank's own compute. The op -> table entry lookup is
    written out here rather than taken from `prism_plugin.runtime.arrivals.ReplayedArrivals`: an oracle that shared
    the emulator's lookup could not catch a mistake in it.
    """
    from prism_plugin.graph.convert import group_role
    from prism_plugin.graph.steady import ArrivalTable, steady_state

    rank = hybrid.rank
    table = ArrivalTable.for_rank(steady_state(graph, cost), rank, [rank])
    errors: list[float] = []
    waited_on_virtual = 0
    for it in hybrid.iterations[warmup:]:
        coll: dict[str, int] = {}
        p2p: dict[tuple[OpKind, int], int] = {}
        for op in it.ops:
            ranks = hybrid.groups[op.group]
            if op.peer >= 0:
                k = p2p.get((op.op, op.peer), 0)
                p2p[(op.op, op.peer)] = k + 1
                offset = table.p2p.get((op.op, op.peer, k))
                members: Sequence[int] = (rank, op.peer)
            else:
                role = group_role(graph.layout, rank, ranks)
                k = coll.get(role, 0)
                coll[role] = k + 1
                entry = table.collectives.get((role, k))
                offset = None if entry is None or entry[0] is not op.op else entry[1]
                members = range(hybrid.world_size) if ranks is None else ranks
            if offset is None or not op.waited:
                continue
            done = max(op.issue_us, offset) + cost.collective_us(op.op, op.size_bytes, members)
            waited_on_virtual += offset > op.issue_us
            errors.append(op.end_us - max(done, op.wait_us))
    if not errors:
        raise RuntimeError(f"rank {rank}: no traced op matches the graph's arrival table")
    errors.sort()
    return {"ops_checked": len(errors), "ops_waiting_on_virtual": waited_on_virtual,
            "median_us": round(statistics.median(errors), 1), "p90_us": round(errors[int(0.9 * (len(errors) - 1))], 1),
            "min_us": round(errors[0], 1), "max_us": round(errors[-1], 1)}


def validate(job: PipelineJob, workdir: Path, *, hybrid_ranks: Sequence[int] | None = None,
             real_runs: int = 2, plain_run: bool = False) -> dict[str, Any]:
    """Run the real, profiling and hybrid runs of `job` under `workdir` and compare (module docstring).

    `plain_run`: also run the program on plain gloo without prism and report its step time next to the
    real run's (which goes through the prism backend with every member real, as the traces need).
    """
    from prism_plugin.cost import CostModel, load_profile
    from prism_plugin.graph.convert import graph_from_rank_traces
    from prism_plugin.graph.slicing import make_plan, parse_layout
    from prism_plugin.graph.steady import steady_state

    t0 = time.perf_counter()
    profile, measured_us = job.profile, None
    if job.calibrate:
        path, measured_us = calibrated_profile(job.profile, job.activation_bytes, workdir / "calibrated.yaml")
        profile = str(path)
    real = [run_pipeline(job, workdir / f"real{i}", range(job.pp), job.steps, profile) for i in range(real_runs)]
    plan = make_plan(parse_layout(f"pp={job.pp},dp=1"), devices=1)
    profiled: list[RankTrace] = []
    for i, run in enumerate(plan.runs):
        profiled += run_pipeline(job, workdir / f"profile{i}", run, job.profile_steps, profile).values()
    graph = graph_from_rank_traces(profiled, plan.job.world, plan.class_axes, warmup=2)
    graph_path = graph.save(workdir / "job.graph")
    cost = CostModel(load_profile(profile))
    state = steady_state(graph, cost)
    predicted = state.step_us
    a = real[0]
    real_steps = [s for r in sorted(a) for s in compared_steps(a[r], job.warmup)]
    figures: dict[str, Any] = {
        "job": {"pp": job.pp, "microbatches": job.microbatches, "fwd_ms": job.fwd_ms, "bwd_ms": job.bwd_ms,
                "profile": job.profile, "steps_compared": len(compared_steps(a[0], job.warmup)),
                "transfer_us_measured": None if measured_us is None else round(measured_us, 1)},
        "real_step_ms": {str(r): round(statistics.fmean(compared_steps(a[r], job.warmup)) / 1e3, 4) for r in sorted(a)},
        "real_step_stdev_ms": round(statistics.stdev(real_steps) / 1e3, 4),
        "real_step_cv_pct": round(100 * statistics.stdev(real_steps) / statistics.fmean(real_steps), 3),
        "replay": {**replay_errors(predicted, real_steps), **sampled_errors(graph, cost, real_steps)},
    }
    if plain_run:
        plain = _plain_run(job, workdir / "plain")
        figures["plain_gloo_step_ms"] = round(statistics.fmean(plain) / 1e3, 4)
        figures["real_vs_plain_gloo_pct"] = round(100 * (statistics.fmean(real_steps) / statistics.fmean(plain) - 1),
                                                  3)
    if real_runs > 1:
        b_steps = [s for r in sorted(real[1]) for s in compared_steps(real[1][r], job.warmup)]
        figures["real_run_to_run_pct"] = round(100 * abs(statistics.fmean(b_steps) / statistics.fmean(real_steps)
                                                         - 1), 3)
    hybrid: dict[str, Any] = {}
    for r in (range(job.pp) if hybrid_ranks is None else hybrid_ranks):
        h = run_pipeline(job, workdir / f"hybrid{r}", [r], job.steps, profile, graph=graph_path)[r]
        hybrid[str(r)] = {**hybrid_errors(a[r], h, job.warmup),
                          "arrivals_check": arrival_errors(h, graph, cost, job.warmup),
                          "summary": json.loads((workdir / f"hybrid{r}" / f"rank{r}.summary.json").read_text())}
    figures["hybrid"] = hybrid
    figures["graph"] = str(graph_path)
    figures["predicted_rank_step_ms"] = {str(r): round(state.rank_step_us(r) / 1e3, 4) for r in range(job.pp)}
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--fwd-ms", default="3,4")
    ap.add_argument("--bwd-ms", default="6,8")
    ap.add_argument("--profile", default="local-cpu-gloo")
    ap.add_argument("--no-calibrate", action="store_true", help="use --profile as it is")
    args = ap.parse_args()
    job = PipelineJob(pp=args.pp, steps=args.steps, microbatches=args.microbatches, fwd_ms=args.fwd_ms,
                      bwd_ms=args.bwd_ms, profile=args.profile, calibrate=not args.no_calibrate)
    print(json.dumps(validate(job, args.workdir)))


if __name__ == "__main__":
    main()
