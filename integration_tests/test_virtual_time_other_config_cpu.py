"""Issue 21, part 6 (second item): virtual time predicts a job other than the one recorded, on this CPU.

`integration_tests.test_virtual_time_vs_cpu` predicts the very job it recorded. Here the recording and the
prediction are different jobs (the toy MLP, `prism_plugin.programs.toy_train`, micro-batch 64, one thread):

- recorded: ``--hidden 512 --layers 2`` (``prism kernels record --clock wall``), as one process (TP1) and as its TP2
  form on 2 gloo processes;
- predicted: ``--hidden 1024 --layers 4`` (2x the layers, 4x every GEMM's FLOPs) in the same two forms, each
  against real runs of that job taken in the same step.

Each form is predicted from the recording of its own form: on this 2-core host two ranks share one memory system,
so a TP2 recording's kernels carry the other rank's contention, which a TP1 job does not pay (measured: a TP1
prediction from the TP2 recording came out +16% and +27%). What carries over, and from where (never from the real
runs compared):

- each kernel: no tensor shape of the predicted jobs is in the tables; each kernel is its recorded neighbour of the
  same op scaled by the roofline the table measured on this CPU (`prism_plugin.cost.kernel_table.MeasuredRoofline`:
  the best FLOP/s and bytes/s its entries reached, the floor its shortest one);
- the host time per launch: the recording's (its step less its kernels and collective calls, per launch);
- communication (TP2): ``collective_overhead_us`` set so that the recorded job's TP all-reduces per step (2 forward,
  1 backward, of 64 x 512 fp32) cost what the recording measured in its collective calls; the predicted job's 7 of
  64 x 1024 fp32 then cost host-cpu's model of that size with that overhead.

Then, per predicted job and rank, the emulated step against the median of the real runs' mean steps: within
`BOUND` (15%, the issue's) passes; beyond it fails, whatever the load; it skips (never passes) only when the
machine's own noise, measured here, exceeds the bound: the trimmed spread of that job's real runs, or the host's
drift since the recording (the farthest of the recorded job's real runs, interleaved with the others, from its
recorded step). One round of real runs is discarded first (this VM's first jobs after an idle spell ran 30-50%
slower in three runs of this check).

Measured, 2026-12-04 (six runs of the check while it was built; errors of the predicted step against the median
of the real means): TP1 -6.8 / +0.5 / -6.9 / -29.8 / -8.2%, TP2 -20.5/-17.0 (before the heap setting below),
-13.7/-15.0, +4.5/+8.2, -12.2/-13.8, -35.3/-35.9, -12.8/-12.2% by rank. The -30% and -35% run is one where the
host slowed during the check (the recorded TP1 job's real runs 30.4, 33.1, 43.3 ms against 30.4 recorded; the
TP2 one's 24 -> 30 ms): such a run now skips, naming the drift. With drift of this size between runs a few minutes
apart, a 15% bound fails on the host's noise as often as on the model's error, so the check is `heavy`
(``scripts/test.sh --heavy``, where it runs in the wall-clock step, marker ``wallclock``) and not in CI, whose
wall-clock checks predict the job they record. A deliberately broken kernel model, the TP1 table with every GEMM
twice as slow (GEMM efficiency halved), must miss the bound on the TP1 job: the check can fail (+31 to +135% in
these runs).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration_tests import test_virtual_time_vs_cpu as same_job
from integration_tests.attempts import Attempt, check_once
from integration_tests.test_virtual_time_vs_cpu import REAL, _free_port

pytestmark = pytest.mark.slow

TOY = ["-m", "prism_plugin.programs.toy_train", "--batch", "64", "--json"]
FORMS = {"tp1": 1, "tp2": 2}
"""Each form's world size (= its TP degree: one DP replica)."""
RECORDED = {form: [*TOY, "--tp", str(tp), "--hidden", "512", "--layers", "2"] for form, tp in FORMS.items()}
PREDICTED = {form: [*TOY, "--tp", str(tp), "--hidden", "1024", "--layers", "4"] for form, tp in FORMS.items()}
RECORD_STEPS = 45
STEPS, WARMUP, REAL_RUNS = 20, 5, 3
BOUND = 0.15
RECORDED_ALL_REDUCES = (3, 64 * 512 * 4)
"""The recorded job's TP all-reduces per step, and their bytes: each layer's forward output, and the backward of the
second layer's input (the first's input needs no gradient); the DP ones and the loss's run on groups of one."""
HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
"""glibc keeps the blocks it frees (as torch's caching allocator keeps a GPU's): tensors up to 32 MiB come from the
heap, which is never trimmed. By default glibc returns the larger blocks to the kernel and every step faults them
back in: measured on the TP1 job here, 264 -> 222 ms a step, the time per launch outside the ops 246 -> 41 us, a
cost that grows with the tensors (so with the job), which no GPU step pays."""


def _env(**extra: str) -> dict[str, str]:
    return same_job._env(**HEAP, **extra)


def _both_ranks(cmd: list[str], cwd: Path, per_rank: list[list[str]] | None = None) -> list[str]:
    return same_job._both_ranks(cmd, cwd, per_rank, extra_env=HEAP)


def _steps(program: list[str]) -> list[str]:
    return [*program, "--steps", str(STEPS)]


def _mean_steps(out: str) -> float:
    steps = json.loads(next(line for line in out.splitlines() if line.startswith("REAL_STEPS "))[11:])
    assert len(steps) == STEPS - 1
    return statistics.fmean(steps[WARMUP - 1:])


def _one_rank(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180,
                          env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                                   WORLD_SIZE="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def real_means_s(tmp: Path, world: int, program: list[str]) -> list[float]:
    """One real run of `program` on `world` gloo processes: each rank's mean wall step after the warm-up."""
    cmd = [sys.executable, "-c", REAL, *_steps(program)]
    return [_mean_steps(out) for out in (_both_ranks(cmd, tmp) if world == 2 else [_one_rank(cmd, tmp)])]


def record(tmp: Path, form: str) -> list[Path]:
    """Each rank's table of the recorded job in `form`."""
    world = FORMS[form]
    tables = [tmp / f"recorded-{form}-rank{r}.json" for r in range(world)]
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "kernels", "record", "--warmup", str(WARMUP), "--threads",
           "1", "--clock", "wall", "--statistic", "mean"]
    args = [["--output", str(t), *RECORDED[form], "--steps", str(RECORD_STEPS)] for t in tables]
    if world == 2:
        _both_ranks(cmd, tmp, per_rank=args)
    else:
        _one_rank([*cmd, *args[0]], tmp)
    return tables


def comm_overhead_us(meta: dict[str, Any]) -> float:
    """host-cpu's ``collective_overhead_us`` moved so that the recorded job's TP all-reduces cost what the
    recording measured per step in its collective calls."""
    from prism_plugin.config.kinds import OpKind
    from prism_plugin.cost.model import CostModel
    from prism_plugin.cost.profiles import load_profile

    profile = load_profile("host-cpu")
    count, size = RECORDED_ALL_REDUCES
    modelled_us = CostModel(profile).collective_us(OpKind.ALL_REDUCE, size, [0, 1])
    return profile.collective_overhead_us + 1e6 * meta["comm_time_per_step_mean_s"] / count - modelled_us


def emulate(tmp: Path, tag: str, world: int, rank: int, program: list[str], table: Path, meta: dict[str, Any]
            ) -> dict[str, Any]:
    """`program` as rank `rank` of `world` on a virtual GPU timed by `table` and the recording's host figures;
    its summary (the steady steps checked equal)."""
    from prism_plugin.cost.profiles import load_profile, profile_to_yaml

    profile = yaml.safe_load(profile_to_yaml(load_profile("host-cpu")))
    profile.update(name=f"host-cpu-{tag}",
                   kernels={**profile.get("kernels", {}), "launch_overhead_us": meta["host_overhead_us_per_launch"]})
    if world > 1:  # TP1's collectives run on groups of one: they cost nothing
        profile["collective_overhead_us"] = comm_overhead_us(meta)
    path, out = tmp / f"{tag}.profile.yaml", tmp / f"emulated-{tag}"
    path.write_text(yaml.safe_dump(profile))
    proc = subprocess.run(
        [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", str(world), "--real-ranks", str(rank),
         "--profile", str(path), "--gpu", "h100-sxm", "--device", "virtual-gpu", "--output", str(out),
         "--kernel-model", "table", "--kernel-table", str(table), *_steps(program), "--device", "cuda"],
        cwd=tmp, env=_env(CUDA_LAUNCH_BLOCKING="1"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / f"rank{rank}.summary.json").read_text())
    steps = summary["virtual_gpu"]["virtual_time"]["step_times_s"]
    assert len(steps) == STEPS - 1 and max(steps[WARMUP:]) - min(steps[WARMUP:]) <= 1.000001e-9
    return summary


def _checked_kernels(summary: dict[str, Any], world: int) -> None:
    """No tensor shape of the predicted job was recorded: every kernel but the loss's two scalar ones a step
    (``ones_like``, ``clone``) is a scaled neighbour, by the CPU's own roofline, and none misses (the emulator's
    mirror fill of TP2's virtual peer's share is the all-reduce's own data, no kernel)."""
    kernels = summary["virtual_gpu"]["kernels"]
    assert kernels["model"] == "table" and kernels["table"]["scaled_by"] == "measured"
    assert kernels["table"]["exact"] == 2 * STEPS and kernels["interpolated"]["aten.mm.default"] == 23 * STEPS
    assert kernels["misses"] == {}


def broken(table: Path) -> Path:
    """The same table with every GEMM twice as slow (GEMM efficiency halved)."""
    data = json.loads(table.read_text())
    for entry in data["entries"]:
        if entry["kernel_class"] == "gemm":
            entry["duration_us"] *= 2
    path = table.with_name(f"broken-{table.name}")
    path.write_text(json.dumps(data))
    return path


def noise(measured: list[float]) -> float:
    """The real runs' trimmed spread: (max - min) / median once the run farthest from the median is dropped (as
    ``prism recipe noise`` trims).

    >>> round(noise([0.20, 0.21, 0.30]), 4)
    0.0488
    """
    median = statistics.median(measured)
    kept = sorted(measured, key=lambda m: abs(m - median))[:-1] if len(measured) > 2 else measured
    return (max(kept) - min(kept)) / statistics.median(kept)


def _ms(values: list[float]) -> list[float]:
    return [round(1e3 * v, 2) for v in values]


def other_config_attempt(tmp: Path) -> Attempt:
    for form, world in FORMS.items():  # discarded: this VM runs its first jobs after an idle spell slower
        real_means_s(tmp, world, PREDICTED[form])
    metas, tables = {}, {}
    for form in FORMS:
        tables[form] = record(tmp, form)
        metas[form] = [json.loads(t.read_text())["metadata"] for t in tables[form]]
    real: dict[tuple[str, str], list[list[float]]] = {(job, form): [] for job in ("recorded", "predicted")
                                                      for form in FORMS}
    for _ in range(REAL_RUNS):  # interleaved, so a drift of the host's speed reaches every job alike
        for form, world in FORMS.items():
            real["recorded", form].append(real_means_s(tmp, world, RECORDED[form]))
            real["predicted", form].append(real_means_s(tmp, world, PREDICTED[form]))
    lines, missed, noisy = [], [], []
    for form, world in FORMS.items():
        # the host's drift since the recording: the recorded job's own real runs now against its recorded step
        drift = max(abs(run[r] - m["step_time_mean_s"]) / m["step_time_mean_s"]
                    for r, m in enumerate(metas[form]) for run in real["recorded", form])
        lines.append(f"{form}: recorded step {_ms([m['step_time_mean_s'] for m in metas[form]])} ms, "
                     f"{[m['host_overhead_us_per_launch'] for m in metas[form]]} us per launch, comm per step "
                     f"{_ms([m['comm_time_per_step_mean_s'] for m in metas[form]])} ms; its real runs now "
                     f"{[_ms(run) for run in real['recorded', form]]} ms (drift {100 * drift:.1f}%)")
        for rank in range(world):
            meta = metas[form][rank]
            summary = emulate(tmp, f"{form}-rank{rank}", world, rank, PREDICTED[form], tables[form][rank], meta)
            _checked_kernels(summary, world)
            predicted = summary["virtual_gpu"]["virtual_time"]["step_times_s"][-1]
            measured = [run[rank] for run in real["predicted", form]]
            median = statistics.median(measured)
            error, spread = (predicted - median) / median, noise(measured)
            lines.append(f"{form} rank {rank}: real means {_ms(measured)} ms, predicted {1e3 * predicted:.2f} ms "
                         f"({100 * error:+.1f}%, spread {100 * spread:.1f}%)")
            if max(spread, drift) > BOUND:
                noisy.append(f"{form} rank {rank}")
            elif abs(error) > BOUND:
                missed.append(f"{form} rank {rank}")
    summary = emulate(tmp, "tp1-broken", 1, 0, PREDICTED["tp1"], broken(tables["tp1"][0]), metas["tp1"][0])
    wrong = summary["virtual_gpu"]["virtual_time"]["step_times_s"][-1]
    median = statistics.median(run[0] for run in real["predicted", "tp1"])
    lines.append(f"GEMMs x2 (broken model): tp1 predicted {1e3 * wrong:.2f} ms "
                 f"({100 * (wrong - median) / median:+.1f}%)")
    if abs(wrong - median) / median <= BOUND:
        missed.append("the broken model passed: the check cannot fail")
    return Attempt("; ".join(lines), missed, noisy)


@pytest.mark.heavy  # this VM's speed drifts by 10-40% within the check's 3 minutes: see the module's figures
@pytest.mark.wallclock
def test_virtual_time_predicts_a_job_other_than_the_one_recorded(tmp_path: Path) -> None:
    check_once(other_config_attempt, tmp_path, f"{BOUND:.0%}")
