"""Calibration by measurement: time real collectives over local processes and fit the cost model's profile.

The command line is `prism_plugin.cli.calibrate` (``prism calibrate``); this module measures.

Measuring: `num_processes` local processes (spawned, FileStore rendezvous in a temporary folder, one
thread each) run every (op, size) of the plan `warmup + repeats` times; each repeat is a barrier,
then the op. Its time is from the LAST rank's start to the last rank's end (the cost model's
definition: time once every member has arrived), read on the host's monotonic clock, which the local
processes share; the median over repeats is the measurement. gloo runs on CPU tensors; nccl on
``cuda:rank`` with a device synchronisation around the op (the code path exists; on this project's
machines only gloo is tested). The fit is `prism_plugin.cost.calibrate.fit_profile`.

Limitations: one machine only, so the intra- and inter-node tiers are the same link (the profile says
so; fit nccl-tests logs of a multi-node run for a real inter-node tier). send/recv is timed between
ranks 0 and 1 while the other ranks wait. Sizes are float32 buffers: each must split evenly over the
processes. A shared, noisy machine gives noisy medians: the YAML lists every measurement with its
spread; repeat the run and compare before trusting a figure.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_plugin.config.errors import ConfigError, coerce_enum, int_at_least
from prism_plugin.config.kinds import OpKind

if TYPE_CHECKING:  # the fit needs numpy: imported when used, so `prism --help` works without it
    from prism_plugin.cost.calibrate import CalibrationFit, Measurement
    from prism_plugin.cost.profiles import HardwareProfile

__all__ = [
    "BACKENDS",
    "CALIBRATION_OPS",
    "DEFAULT_SIZES",
    "CalibrationPlan",
    "calibrate",
    "calibrate_fit",
    "default_sizes",
    "measure_collectives",
]

DEFAULT_SIZES: tuple[int, ...] = tuple(2**k for k in range(10, 27, 2))
"""1 KiB .. 64 MiB, factor 4 (9 sizes); with a process count that is not a power of 2 each is rounded
down to a multiple of 4 x processes (see `default_sizes`)."""


def default_sizes(num_processes: int) -> tuple[int, ...]:
    """`DEFAULT_SIZES`, each rounded down to a multiple of 4 x `num_processes` (float32 split evenly).

    Example: default_sizes(3)[0] == 1020 (1024 rounded down to a multiple of 12).
    """
    step = 4 * max(num_processes, 1)
    return tuple(max(step, s // step * step) for s in DEFAULT_SIZES)
CALIBRATION_OPS: dict[str, OpKind] = {
    "all_reduce": OpKind.ALL_REDUCE,
    "all_gather": OpKind.ALL_GATHER,
    "reduce_scatter": OpKind.REDUCE_SCATTER,
    "broadcast": OpKind.BROADCAST,
    "send": OpKind.SEND,
}
"""The ops `calibrate` can time (send = a send/recv pair), by their names on the command line."""
BACKENDS: tuple[str, ...] = ("gloo", "nccl")
"""The backends `calibrate` can time (``prism calibrate --backend``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationPlan:
    """What to measure; validated before any process starts."""

    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU tensors) or nccl (one GPU per process)."""
    num_processes: int = 2
    """Local processes, >= 2 (on a 2-core machine keep it <= 4)."""
    sizes_bytes: tuple[int, ...] | None = None
    """Message sizes in the cost model's convention (all_gather: output; reduce_scatter: input), each a
    multiple of 4 x num_processes; None: `default_sizes(num_processes)`."""
    ops: tuple[OpKind, ...] = tuple(CALIBRATION_OPS.values())
    repeats: int = 10
    """Timed repetitions per (op, size); the median is kept."""
    warmup: int = 2
    """Untimed repetitions first (connection setup, allocator warm-up)."""
    timeout_s: float = 600.0
    """Give up (and stop the processes) after this long."""
    compute_gap_us: float = 0.0
    """Busy compute (a matmul loop) on every process between the barrier and each timed op, standing for the
    compute a training step does between collectives: a process that computed until the call, and whose
    gloo thread slept meanwhile, pays wake-ups that back-to-back ops hide (2 gloo processes on this 2-core
    machine: all_reduce of 4 KiB 0.52 ms median back to back, 0.71 ms after 2 ms of compute, 1.24 ms after
    5 ms). 0: barrier only."""
    statistic: str = "median"
    """How repeats become one measurement: ``median`` (the op's typical cost) or ``mean`` (what a step that
    sums many such ops pays, tail included: the figure step-time predictions need on a noisy machine)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"calibrate: backend {self.backend!r} is not one of {', '.join(BACKENDS)} (--backend)")
        n = int_at_least("calibrate: num_processes", self.num_processes, 2, hint="--processes")
        sizes = default_sizes(n) if self.sizes_bytes is None else tuple(self.sizes_bytes)
        object.__setattr__(self, "sizes_bytes", sizes)
        object.__setattr__(self, "ops", tuple(coerce_enum(OpKind, k, "calibrate: ops") for k in self.ops))
        if len(set(sizes)) < 2:
            raise ConfigError("calibrate: give at least 2 distinct sizes (--sizes): a rate needs two points")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0 or s % (4 * n):
                raise ConfigError(
                    f"calibrate: size {s!r} must be a positive multiple of {4 * n} bytes (float32 elements split "
                    f"over {n} processes) (--sizes)"
                )
        bad = [k.value for k in self.ops if k not in CALIBRATION_OPS.values()]
        if bad or not self.ops:
            raise ConfigError(f"calibrate: ops {bad or '(none)'} not timeable; choose from "
                              f"{', '.join(CALIBRATION_OPS)}")
        for field_name, low in (("repeats", 3), ("warmup", 0)):
            int_at_least(f"calibrate: {field_name}", getattr(self, field_name), low, hint=f"--{field_name}")
        if not self.timeout_s > 0:
            raise ConfigError(f"calibrate: timeout_s must be > 0, got {self.timeout_s!r}")
        if not 0 <= self.compute_gap_us <= 1e6:
            raise ConfigError(f"calibrate: compute_gap_us must be in 0..1e6, got {self.compute_gap_us!r} "
                             "(--compute-gap-us)")
        if self.statistic not in ("median", "mean"):
            raise ConfigError(f"calibrate: statistic must be median or mean, got {self.statistic!r} (--statistic)")

    def steps(self) -> list[tuple[OpKind, int]]:
        """(op, size) in the order the processes run them."""
        return [(k, s) for k in self.ops for s in sorted(set(self.sizes_bytes or ()))]


def _check_backend_available(plan: CalibrationPlan) -> None:
    import torch.distributed as dist

    if plan.backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError("calibrate: this torch build has no gloo backend; use --backend nccl on a GPU machine")
    if plan.backend == "nccl":
        import torch

        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ConfigError("calibrate: --backend nccl needs CUDA and a torch build with NCCL; use --backend gloo")
        if torch.cuda.device_count() < plan.num_processes:
            raise ConfigError(
                f"calibrate: --backend nccl needs one GPU per process: {plan.num_processes} processes, "
                f"{torch.cuda.device_count()} GPUs; lower --processes"
            )


def measure_collectives(
    plan: CalibrationPlan, *, on_round: Callable[[int, int], None] | None = None
) -> list[Measurement]:
    """Run `plan` over local processes; one median `Measurement` per (op, size).

    The processes are ``python -m prism_plugin.runtime.calibrate --worker ...`` children (no multiprocessing
    re-import of the caller's main module). The processes time every (op, size) once per round,
    `warmup` untimed rounds then `repeats` timed ones; `on_round(done, total)` is called here as each
    round completes (progress bars). Raises RuntimeError with a failed worker's stderr, TimeoutError past the
    plan's timeout (the workers are stopped either way).
    """
    _check_backend_available(plan)
    with tempfile.TemporaryDirectory(prefix="prism-calibrate-") as tmp:
        folder = Path(tmp)
        (folder / "plan.json").write_text(json.dumps(_plan_to_json(plan)))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = []
        for rank in range(plan.num_processes):
            cmd = [sys.executable, "-m", "prism_plugin.runtime.calibrate", "--worker", str(rank), str(folder)]
            with open(folder / f"rank{rank}.stderr", "wb") as err:
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
        deadline = time.monotonic() + plan.timeout_s
        progress = folder / "progress"
        reported = 0
        try:
            while True:
                done = progress.read_text().count("\n") if progress.exists() else 0
                for round_index in range(reported, done):
                    if on_round is not None:
                        on_round(round_index + 1, plan.warmup + plan.repeats)
                reported = max(reported, done)
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    tail = (folder / f"rank{failed[0]}.stderr").read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"calibrate: process {failed[0]} exited with code {codes[failed[0]]}:\n{tail}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"calibrate: not done after {plan.timeout_s:g} s; fewer sizes/repeats or a larger timeout"
                    )
                time.sleep(0.05)
            per_rank = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(plan.num_processes)}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    return _medians(plan, per_rank)


def _plan_to_json(plan: CalibrationPlan) -> dict[str, Any]:
    return {
        "backend": plan.backend, "num_processes": plan.num_processes, "sizes_bytes": list(plan.sizes_bytes or ()),
        "ops": [k.value for k in plan.ops], "repeats": plan.repeats, "warmup": plan.warmup,
        "timeout_s": plan.timeout_s, "compute_gap_us": plan.compute_gap_us, "statistic": plan.statistic,
    }


def _medians(plan: CalibrationPlan, per_rank: dict[int, dict[str, list[list[int]]]]) -> list[Measurement]:
    from prism_plugin.cost.calibrate import Measurement, one_node_placement

    out = []
    source = f"{plan.backend} x{plan.num_processes} local processes"
    for kind, size in plan.steps():
        ranks = (0, 1) if kind is OpKind.SEND else tuple(range(plan.num_processes))
        placement = one_node_placement(2 if kind is OpKind.SEND else plan.num_processes)
        key = f"{kind.value}/{size}"
        samples = []
        for i in range(plan.repeats):
            start = max(per_rank[r][key][0][i] for r in ranks)
            end = max(per_rank[r][key][1][i] for r in ranks)
            samples.append(max(end - start, 1) / 1e3)  # ns -> us
        reduce = statistics.mean if plan.statistic == "mean" else statistics.median
        out.append(Measurement(kind=kind, size_bytes=size, placement=placement, time_us=reduce(samples),
                               samples_us=tuple(samples), source=source))
    return out


def _worker(rank: int, folder: Path) -> None:
    """One local process: join the group, time every (op, size), write the raw start/end stamps."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    data = json.loads((folder / "plan.json").read_text())
    plan = CalibrationPlan(**{**data, "sizes_bytes": tuple(data["sizes_bytes"]),
                              "ops": tuple(OpKind(k) for k in data["ops"])})
    torch.set_num_threads(1)
    n = plan.num_processes
    device = torch.device("cpu")
    if plan.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.FileStore(str(folder / "store"), n)
    dist.init_process_group(plan.backend, store=store, rank=rank, world_size=n,
                            timeout=timedelta(seconds=plan.timeout_s))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier() -> None:
        if device.type == "cuda":
            dist.barrier(device_ids=[rank])
        else:
            dist.barrier()
        sync()

    # Rounds: every (op, size) once per round, so a burst of load from elsewhere on the machine spoils one
    # sample of many steps instead of every sample of one step (the median then ignores it).
    steps = plan.steps()
    ops = [_make_op(kind, size, rank, n, device) for kind, size in steps]
    work = torch.randn(128, 128, device=device)

    def compute() -> None:  # plan.compute_gap_us of busy work, as a training step does between collectives
        end = time.perf_counter() + plan.compute_gap_us * 1e-6
        while time.perf_counter() < end:
            work @ work
        sync()
    stamps: dict[str, tuple[list[int], list[int]]] = {f"{k.value}/{s}": ([], []) for k, s in steps}
    for round_index in range(plan.warmup + plan.repeats):
        for (kind, size), op in zip(steps, ops, strict=True):
            barrier()
            if plan.compute_gap_us > 0:
                compute()
            t0 = time.perf_counter_ns()  # CLOCK_MONOTONIC: one clock for every process of this host
            op()
            sync()
            t1 = time.perf_counter_ns()
            if round_index >= plan.warmup:
                starts, ends = stamps[f"{kind.value}/{size}"]
                starts.append(t0)
                ends.append(t1)
        if rank == 0:
            with open(folder / "progress", "a") as f:
                f.write(f"{round_index}\n")
    tmp = folder / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(stamps))
    tmp.rename(folder / f"rank{rank}.json")
    dist.destroy_process_group()


def _make_op(kind: OpKind, size_bytes: int, rank: int, n: int, device: Any) -> Callable[[], None]:
    """A closure running one `kind` op on preallocated zero float32 buffers (zeros: sums never overflow)."""
    import torch
    import torch.distributed as dist

    numel = size_bytes // 4
    zeros = lambda k: torch.zeros(k, dtype=torch.float32, device=device)  # noqa: E731
    if kind is OpKind.ALL_REDUCE:
        buf = zeros(numel)
        return lambda: dist.all_reduce(buf)
    if kind is OpKind.ALL_GATHER:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        inp, out = zeros(numel // n), zeros(numel)
        return lambda: gather(out, inp)
    if kind is OpKind.REDUCE_SCATTER:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        inp, out = zeros(numel), zeros(numel // n)
        return lambda: scatter(out, inp)
    if kind is OpKind.BROADCAST:
        buf = zeros(numel)
        return lambda: dist.broadcast(buf, src=0)
    if kind is OpKind.SEND:
        buf = zeros(numel)
        if rank == 0:
            return lambda: dist.send(buf, dst=1)
        if rank == 1:
            return lambda: dist.recv(buf, src=0)
        return lambda: None
    raise NotImplementedError(f"calibrate cannot time {kind.value}; choose from {', '.join(CALIBRATION_OPS)}")


def _describe(plan: CalibrationPlan) -> str:
    import torch

    n = plan.num_processes
    where = f"{platform.node() or 'this host'} ({os.cpu_count()} CPUs"
    if plan.backend == "nccl":
        where += f", {torch.cuda.get_device_name(0)}"
    sizes = sorted(set(plan.sizes_bytes or ()))
    return (
        f"Calibrated by prism calibrate on {where}): torch {torch.__version__} {plan.backend}, {n} local processes, "
        f"{', '.join(k.value for k in plan.ops)} at {len(sizes)} sizes {sizes[0]}..{sizes[-1]} B, {plan.statistic} of "
        f"{plan.repeats} repeats, {plan.compute_gap_us:g} us of compute before each op. All {n} processes share "
        "one machine, so the intra- and inter-node links are the "
        f"same ({'loopback' if plan.backend == 'gloo' else 'this node'}): inter_node = intra_node, gpus_per_node = {n}."
    )


def calibrate_fit(plan: CalibrationPlan, *, name: str = "local-calibrated",
                  on_round: Callable[[int, int], None] | None = None, per_op: bool = False) -> CalibrationFit:
    """Measure `plan` and fit a profile (with the measurements, predictions and residuals); `per_op` also fits
    a transfer multiplier per op (`prism_plugin.cost.calibrate.fit_op_factors`)."""
    from prism_plugin.cost.calibrate import fit_profile

    ms = measure_collectives(plan, on_round=on_round)
    return fit_profile(ms, name=name, description=_describe(plan), gpus_per_node=plan.num_processes,
                       per_op_factors=per_op)


def calibrate(
    backend: str = "gloo",
    num_processes: int = 2,
    sizes: Sequence[int] | None = None,
    ops: Sequence[OpKind | str] = tuple(CALIBRATION_OPS.values()),
    repeats: int = 10,
    *,
    name: str = "local-calibrated",
) -> HardwareProfile:
    """Time real collectives over `num_processes` local processes and return the fitted profile.

    Example: ``calibrate("gloo", 2, sizes=[2**12, 2**20, 2**24], repeats=5)``; residuals are in its description.
    """
    plan = CalibrationPlan(backend=backend, num_processes=num_processes, repeats=repeats,
                           sizes_bytes=None if sizes is None else tuple(sizes), ops=tuple(OpKind(o) for o in ops))
    return calibrate_fit(plan, name=name).profile


if __name__ == "__main__":  # a worker process of measure_collectives
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m prism_plugin.runtime.calibrate --worker RANK FOLDER (started by prism calibrate)")
    _worker(int(sys.argv[2]), Path(sys.argv[3]))
