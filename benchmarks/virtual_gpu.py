"""A Megatron GPT job on a virtual H100: host time per training iteration, start-up, and the modelled memory.

    python benchmarks/virtual_gpu.py [--model llama3-8b] [--layers L] [--layout tp=8] [--world-size 64]
        [--rank R] [--iterations 5] [--warmup 2] [--repeats 3] [--seq-length S] [--global-batch B]
        [--no-sequence-parallel] [--attention local|flash] [--dropout P] [--no-virtual-time | --only-virtual-time]
    python benchmarks/virtual_gpu.py --model llama3-70b --layout tp=8,pp=8 --world-size 8192 --global-batch 1024
    python benchmarks/virtual_gpu.py --model llama3.1-405b --layout tp=8,pp=16,cp=2 --world-size 16384 \
        --global-batch 2048
    python benchmarks/virtual_gpu.py --model llama3.1-405b --layout tp=8,pp=16,cp=2 --world-size 16384 \
        --global-batch 2048 --emulate [--jobs 2] [--repeats 3]

Each repeat is one real process: the repo's ``prism_plugin/programs/pretrain_gpt.py`` (Megatron's own
``pretrain`` loop, mock data, ``--transformer-impl local``, bf16, distributed optimizer, micro-batch 1,
sequence parallelism when TP > 1) through the drop-in ``python -m prism_plugin.megatron`` with
``--prism-device virtual-gpu --prism-profile dgx-h100``, as rank `rank` of `world-size`, at a model preset
(``prism models``; ``prism_plugin.config.models``): its width and sequence length (Llama 3: 8,192), and by
default its full depth (``--layers`` cuts it: the per-stage count is layers / pp; a depth pp does not divide,
as 405B's 126 over 16 stages, gives the first and last stages the remainder's shortfall, as Megatron's
``--decoder-first/last-pipeline-num-layers``: 7 + 14 x 8 + 7). The default rank is the last TP rank of data-
and context-parallel rank 0 on pipeline stage 0 (Megatron's rank order tp-cp-ep-dp-pp: rank tp - 1), the
stage that holds the most activations under 1F1B (pp micro-batches in flight) and the embedding.
``--attention flash`` passes ``--prism-attention flash`` (the FlashAttention stand-in for Megatron's local
attention), which context parallelism needs: it is the default when cp > 1. Dropout (attention and hidden) is
0 by default, as Llama 3 trains (Megatron's default, 0.1, is ``--dropout 0.1``). A rank whose memory does not fit
its GPU still runs (``PRISM_VIRTUAL_GPU_OOM=report``): ``fits`` is false and the figures are what it would
need. Tensors are fake (no storage, no compute), so the host figures are the emulator's and Megatron's host
cost, not a GPU's step time.

Prints one JSON object:
- ``step_time_s``: median over repeats of each repeat's median host wall seconds per iteration, after
  `warmup` iterations; each iteration's time is Megatron's own ``elapsed time per iteration`` (its
  ``interval-time`` timer, wall clock; log interval 1); ``step_time_s_per_repeat`` lists the repeats';
- ``iteration_cpu_s``: the same median in CPU seconds of the job's processes (user + system, all threads, from
  ``/proc`` at each iteration's log line): on a machine others load, wall time stretches with their load and CPU
  time much less, so it is the figure to compare across loads (``load_average_at_start`` / ``load_average``:
  ``os.getloadavg()`` before and after);
- ``iteration_s`` / ``build_s``: the issue's names for ``step_time_s`` and ``startup_s`` (of the runs with virtual
  time when they ran);
- ``startup_s``: median over repeats of the process's wall time less the sum of its iterations: interpreter
  and imports, the drop-in's re-execution with the device library, Megatron's initialisation, model and
  optimizer build, and exit;
- ``peak_allocated_bytes`` / ``peak_reserved_bytes`` / ``device_total_bytes`` / ``fits``: the virtual GPU's,
  from the rank's summary (the allocator model: deterministic, the same every repeat, which
  ``memory_same_every_repeat`` checks); ``megatron_parameters``: the rank's count as Megatron logs it
  (data-parallel rank 0 only, else null); ``rss_mb``: peak resident memory of the largest run;
- ``emulation_overhead_pct``: what virtual time (the default in virtual-GPU mode: each op a kernel of modelled
  duration on emulated streams) adds to the host time per iteration, ``100 * (t_with / t_without - 1)`` of the
  two medians; each repeat runs without (``PRISM_VIRTUAL_TIME=off``), then with it, alternated, so a shared
  machine's drift falls on both alike; ``step_time_s`` is the with-virtual-time median,
  ``step_time_s_without_virtual_time`` the other; ``--no-virtual-time`` runs only the latter;
- ``emulated_step_time_s``: virtual time's step of the rank (modelled H100 time, deterministic:
  ``emulated_step_time_same_every_repeat`` checks it, ``emulated_step_time_s_per_repeat`` lists them);
  ``emulation_overhead_cpu_pct``: the overhead from the CPU-second medians.

``--emulate`` times ``prism emulate`` of the same job instead (issue 22's target for Llama-3.1-405B TP8 PP16 CP2 at
16384 GPUs: under 10 minutes): every class of ranks, one profiling run each, ``--jobs`` at a time, ``--attention``
as above. It prints ``emulate_s`` (median wall seconds of the whole command over ``--repeats``, measured), and per
repeat the report's modelled step (``step_ms``) and largest peak allocated, and each profiling run's wall seconds
and fast-forward figures (micro-batches run, micro-batches skipped).

Measured on the host: ``iteration_s``, ``build_s``, ``startup_s``, ``rss_mb``, ``emulation_overhead_pct``;
modelled (deterministic): the memory figures and ``emulated_step_time_s``. The small case of issue 13 item 5
(Llama-3-8B width, 2 layers, TP8, rank 7 of 64, 5 iterations, 3 repeats) is ``--layers 2`` and takes about a
minute on this 2-core machine. Not measured here: MoE presets (Megatron's local MoE path on virtual GPUs is
untested).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _emulate  # noqa: E402
from prism_plugin.config.models import megatron_args, preset  # noqa: E402

SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size"}
VIRTUAL_TIME_NOTE = "run without virtual time (--no-virtual-time): no emulation overhead measured"
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
_PARAMETERS = re.compile(r"number of parameters on \(tensor, [^)]*\) model parallel rank \([^)]*\): (\d+)")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """One benchmark job: the preset cut to `layers`, its layout, and which rank of how many runs."""

    model: str
    layers: int
    layout: dict[str, int]
    world_size: int
    rank: int
    iterations: int
    seq_length: int
    global_batch: int
    profile: str
    sequence_parallel: bool = True
    dropout: float = 0.0
    attention: str = "local"
    """``local`` (Megatron's local-spec attention) or ``flash`` (``--prism-attention flash``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One process's figures."""

    iteration_s: list[float]
    wall_s: float
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    fits: bool
    megatron_parameters: int | None
    emulated_step_s: float | None = None
    """Virtual time's step of the rank (median of its marked iterations); None without virtual time."""
    iteration_cpu_s: list[float] | None = None
    """CPU seconds of the job's processes between consecutive iteration log lines (one fewer than iterations)."""


def parse_layout(text: str) -> dict[str, int]:
    """``"tp=8,pp=2"`` -> ``{"tp": 8, "pp": 2}`` (keys tp, pp, cp, ep; missing ones are 1).

    >>> parse_layout("tp=8,pp=2")
    {'tp': 8, 'pp': 2, 'cp': 1, 'ep': 1}
    """
    layout = dict.fromkeys(LAYOUT_FLAGS, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in LAYOUT_FLAGS or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--layout: {part!r} is not one of tp=N, pp=N, cp=N, ep=N (N >= 1)")
        layout[key] = int(value)
    return layout


def stage_layers(layers: int, pp: int) -> tuple[int, int, int]:
    """Blocks on the first, each middle, and the last pipeline stage: even when pp divides `layers`, else the
    middle stages take ceil(layers / pp) and the first and last share the shortfall (larger first).

    >>> stage_layers(80, 8), stage_layers(126, 16), stage_layers(2, 1)
    ((10, 10, 10), (7, 8, 7), (2, 2, 2))
    """
    if pp == 1 or layers % pp == 0:
        return (layers // pp,) * 3
    middle = -(-layers // pp)
    ends = layers - middle * (pp - 2)
    if pp < 3 or ends < 2:
        raise SystemExit(f"--layers {layers} over pp={pp} stages: no split with equal middle stages; "
                         "pick --layers divisible by pp")
    return ends - ends // 2, middle, ends // 2


def _job(spec: JobSpec) -> list[str]:
    """The job's program and its Megatron arguments (no prism setting)."""
    arch = megatron_args(preset(spec.model))
    arch[arch.index("--num-layers") + 1] = str(spec.layers)
    arch[arch.index("--seq-length") + 1] = str(spec.seq_length)
    layout = [x for key, flag in LAYOUT_FLAGS.items() for x in (flag, str(spec.layout[key]))]
    first, middle, last = stage_layers(spec.layers, spec.layout["pp"])
    if (first, last) != (middle, middle):
        layout += ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    if spec.sequence_parallel and spec.layout["tp"] > 1:
        layout.append("--sequence-parallel")
    layout += ["--attention-dropout", str(spec.dropout), "--hidden-dropout", str(spec.dropout)]
    return [str(SCRIPT), "--transformer-impl", "local", *arch, *layout, "--micro-batch-size", "1",
            "--global-batch-size", str(spec.global_batch), "--train-iters", str(spec.iterations), "--lr", "1e-4",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16", "--use-distributed-optimizer",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10**6), "--disable-gloo-process-groups"]


def _command(spec: JobSpec, output: Path) -> list[str]:
    """The job through the drop-in, as rank `spec.rank` of `spec.world_size` on a virtual GPU."""
    attention = ["--prism-attention", spec.attention] if spec.attention != "local" else []
    return [sys.executable, "-m", "prism_plugin.megatron", *_job(spec), *attention,
            "--prism-world-size", str(spec.world_size), "--prism-real-ranks", str(spec.rank),
            "--prism-profile", spec.profile, "--prism-device", "virtual-gpu", "--prism-output", str(output)]


def emulate(spec: JobSpec, *, repeats: int, jobs: int, timeout_s: float) -> dict:
    """``prism emulate`` of the whole job (every class of ranks, `jobs` profiling runs at a time), `repeats`
    times: ``emulate_s``, the median wall seconds of the command (measured), with each repeat's runs and the
    report's modelled step and peak."""
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = [_emulate.emulate_once(_job(spec), world_size=spec.world_size, jobs=jobs, timeout_s=timeout_s, env=env,
                                  options=("--profile", spec.profile, "--attention", spec.attention))
            for _ in range(repeats)]
    walls = [d["wall_s"] for d in done if d["exit_code"] == 0]
    dp = spec.world_size // (spec.layout["tp"] * spec.layout["pp"] * spec.layout["cp"])
    return {"benchmark": "virtual_gpu_emulate", "model": spec.model, "layers": spec.layers,
            "seq_length": spec.seq_length, "layout": {**spec.layout, "dp": dp}, "global_batch": spec.global_batch,
            "world_size": spec.world_size, "attention": spec.attention, "profile": spec.profile, "jobs": jobs,
            "repeats": repeats, "emulate_s": statistics.median(walls) if len(walls) == len(done) else None,
            "load_average_at_start": load_at_start, "load_average": [round(x, 2) for x in os.getloadavg()],
            "cpu_count": os.cpu_count(), "repeat_runs": done}


def measure(spec: JobSpec, *, virtual_time: bool = False) -> Measurement:
    """Run `spec` once in a fresh process (virtual time on or off) and read its log and summary."""
    with tempfile.TemporaryDirectory(prefix="prism-vgpu-bench-") as tmp:
        output = Path(tmp) / "out"
        command = _command(spec, output)
        start = time.perf_counter()
        stdout, stderr, cpu_marks, returncode = _run_sampling_cpu(command, env={
            **os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PRISM_VIRTUAL_GPU_OOM": "report",
            "PYTHONUNBUFFERED": "1", "PRISM_VIRTUAL_TIME": "on" if virtual_time else "off"})
        wall_s = time.perf_counter() - start
        if returncode != 0:
            sys.stderr.write(stdout[-3000:] + stderr[-4000:])
            raise SystemExit(f"the virtual-GPU job exited {returncode}")
        iterations = [float(ms) / 1e3 for _, ms in _ITERATION.findall(stdout)]
        if len(iterations) != spec.iterations:
            raise SystemExit(f"expected {spec.iterations} iteration log lines, read {len(iterations)}")
        summary = json.loads((output / f"rank{spec.rank}.summary.json").read_text())
    device = max(summary["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])
    counted = _PARAMETERS.findall(stdout)
    emulated = summary["virtual_gpu"].get("virtual_time", {}).get("step_times_s") or []
    return Measurement(iteration_s=iterations, wall_s=wall_s, peak_allocated_bytes=device["peak_allocated_bytes"],
                       emulated_step_s=statistics.median(emulated) if emulated else None,
                       peak_reserved_bytes=device["peak_reserved_bytes"],
                       device_total_bytes=device["device_total_bytes"], fits=device["fits"],
                       megatron_parameters=int(counted[0]) if counted else None,
                       iteration_cpu_s=[b - a for a, b in zip(cpu_marks, cpu_marks[1:], strict=False)])


_CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of process `root` and its live descendants (``/proc``; all their threads)."""
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) * _CLOCK_TICK_S  # utime, stime (fields 14, 15)
            for task in Path(f"/proc/{pid}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):  # exited meanwhile
            continue
    return total


def _run_sampling_cpu(command: list[str], env: dict[str, str]) -> tuple[str, str, list[float], int]:
    """Run `command`, reading its stdout as it comes; at its first ``iteration`` log line and each one after, the
    process tree's CPU seconds so far (so consecutive marks differ by one iteration's CPU time: what this host's
    other load inflates least). Returns stdout, stderr, the marks and the exit code."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)
        lines, marks = [], []
        started = time.monotonic()
        assert proc.stdout is not None
        for line in proc.stdout:
            if _ITERATION.search(line):
                marks.append(_tree_cpu_s(proc.pid))
            lines.append(line)
            if time.monotonic() - started > 1800:
                proc.kill()
                raise SystemExit("the virtual-GPU job ran past 1800 s")
        returncode = proc.wait()
        err.seek(0)
        return "".join(lines), err.read(), marks, returncode


def emulation_overhead_pct(t_without_s: float, t_with_s: float) -> float:
    """What virtual time adds to the host step time, in percent: ``100 * (t_with / t_without - 1)``.

    >>> emulation_overhead_pct(0.40, 0.42)
    5.0
    """
    return round(100.0 * (t_with_s / t_without_s - 1.0), 3)


def _cpu_median(ms: list[Measurement], warmup: int) -> float | None:
    """Median CPU seconds per iteration after `warmup` (mark k - 1 to k times iteration k, k >= 1), median of the
    repeats' medians."""
    per = [statistics.median(m.iteration_cpu_s[max(warmup, 1) - 1:]) for m in ms
           if m.iteration_cpu_s and m.iteration_cpu_s[max(warmup, 1) - 1:]]
    return round(statistics.median(per), 3) if per else None


def _step_s(m: Measurement, warmup: int) -> float:
    return statistics.median(m.iteration_s[warmup:])


def run(spec: JobSpec, *, repeats: int, warmup: int, virtual_time_pairs: bool = True,
        configurations: tuple[bool, ...] | None = None) -> dict:
    """`repeats` measurements (with `virtual_time_pairs`: each repeat without, then with, virtual time) as
    the benchmark's JSON object; ``step_time_s`` is the host time per iteration with virtual time (the default
    mode) when it ran, else without. `configurations`: the virtual-time settings each repeat runs, in order
    (default: from `virtual_time_pairs`; ``(True,)``: only with virtual time, no overhead figure)."""
    configurations = configurations or ((False, True) if virtual_time_pairs else (False,))
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    runs: dict[bool, list[Measurement]] = {vt: [] for vt in configurations}
    for _ in range(repeats):
        for vt in configurations:  # alternated: drift of a shared machine falls on both alike
            runs[vt].append(measure(spec, virtual_time=vt))
    base = runs.get(False) or runs[True]
    steps_without = [_step_s(m, warmup) for m in runs.get(False, [])]
    timed = runs.get(True) or base
    steps = [_step_s(m, warmup) for m in timed]
    step_time_s = statistics.median(steps)
    overhead = None
    overhead_cpu = None
    if steps_without and True in runs:
        overhead = emulation_overhead_pct(statistics.median(steps_without), step_time_s)
        cpu_with, cpu_without = _cpu_median(timed, warmup), _cpu_median(base, warmup)
        if cpu_with and cpu_without:
            overhead_cpu = emulation_overhead_pct(cpu_without, cpu_with)
    emulated = [m.emulated_step_s for m in timed if m.emulated_step_s is not None]
    memory = {(m.peak_allocated_bytes, m.peak_reserved_bytes, m.device_total_bytes) for m in base}
    first = base[0]
    dp = spec.world_size // (spec.layout["tp"] * spec.layout["pp"] * spec.layout["cp"])
    return {
        "benchmark": "virtual_gpu", "model": spec.model, "layers": spec.layers, "seq_length": spec.seq_length,
        "layout": {**spec.layout, "dp": dp}, "global_batch": spec.global_batch, "world_size": spec.world_size,
        "rank": spec.rank, "pipeline_stage_layers": list(stage_layers(spec.layers, spec.layout["pp"])),
        "sequence_parallel": spec.sequence_parallel and spec.layout["tp"] > 1, "attention": spec.attention,
        "dropout": spec.dropout, "load_average_at_start": load_at_start,
        "processes": 1, "profile": spec.profile, "iterations": spec.iterations,
        "warmup_iterations": warmup, "repeats": repeats,
        "iteration_s": round(step_time_s, 4), "build_s": round(statistics.median(m.wall_s - sum(m.iteration_s)
                                                                                for m in timed), 3),
        "step_time_s": round(step_time_s, 4), "step_time_s_per_repeat": [round(s, 4) for s in steps],
        "iteration_cpu_s": _cpu_median(timed, warmup), "iteration_cpu_s_per_repeat": [
            _cpu_median([m], warmup) for m in timed],
        "step_time_s_without_virtual_time": round(statistics.median(steps_without), 4) if steps_without else None,
        "emulated_step_time_s": emulated[0] if emulated else None,
        "emulated_step_time_same_every_repeat": len(set(emulated)) <= 1,
        "emulated_step_time_s_per_repeat": emulated,
        "startup_s": round(statistics.median(m.wall_s - sum(m.iteration_s) for m in base), 3),
        "peak_allocated_bytes": first.peak_allocated_bytes, "peak_reserved_bytes": first.peak_reserved_bytes,
        "device_total_bytes": first.device_total_bytes, "fits": first.fits,
        "memory_same_every_repeat": len(memory) == 1, "megatron_parameters": first.megatron_parameters,
        "rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "emulation_overhead_pct": overhead, "emulation_overhead_cpu_pct": overhead_cpu,
        "iteration_cpu_s_without_virtual_time": _cpu_median(base, warmup) if False in runs else None,
        "emulation_overhead_note": None if overhead is not None else (
            VIRTUAL_TIME_NOTE if False in runs else "run with virtual time only (--only-virtual-time)"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", help="a preset of `prism models` (default llama3-8b)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default: the preset's depth; the preset's width either way)")
    ap.add_argument("--layout", default="tp=8", help="tp=N,pp=N,cp=N,ep=N (default tp=8); dp is the rest")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--rank", type=int, default=None,
                    help="the real rank (default tp - 1: last TP rank, DP/CP rank 0, pipeline stage 0)")
    ap.add_argument("--iterations", type=int, default=5, help="training iterations per run (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations left out of the median (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs, one process each (default 3)")
    ap.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    ap.add_argument("--global-batch", type=int, default=None, help="default: one micro-batch per DP rank")
    ap.add_argument("--profile", default="dgx-h100", help="hardware profile: the virtual GPU's model")
    ap.add_argument("--no-sequence-parallel", action="store_true", help="leave out --sequence-parallel")
    ap.add_argument("--attention", choices=("local", "flash"), default=None,
                    help="local: Megatron's local attention; flash: --prism-attention flash (default when cp > 1)")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention and hidden dropout (default 0, as Llama 3)")
    ap.add_argument("--emulate", action="store_true",
                    help="time `prism emulate` of the whole job instead (every class of ranks; --repeats times)")
    ap.add_argument("--jobs", type=int, default=2, help="with --emulate: profiling runs at a time (default 2)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="with --emulate: seconds per profiling run")
    timing = ap.add_mutually_exclusive_group()
    timing.add_argument("--no-virtual-time", action="store_true",
                        help="only the runs without virtual time (no emulation_overhead_pct)")
    timing.add_argument("--only-virtual-time", action="store_true",
                        help="only the runs with virtual time (no emulation_overhead_pct; half the processes)")
    args = ap.parse_args()
    model = preset(args.model)
    layout = parse_layout(args.layout)
    model_parallel = layout["tp"] * layout["pp"] * layout["cp"]
    layers = args.layers or model.num_layers
    if args.world_size % model_parallel:
        ap.error(f"--world-size must divide by tp x pp x cp = {model_parallel}")
    stage_layers(layers, layout["pp"])
    rank = layout["tp"] - 1 if args.rank is None else args.rank
    if not 0 <= rank < args.world_size:
        ap.error(f"--rank {rank} is not a rank of --world-size {args.world_size}")
    attention = args.attention or ("flash" if layout["cp"] > 1 else "local")
    if not 0 <= args.warmup < args.iterations:
        ap.error("--warmup must leave at least one of --iterations")
    spec = JobSpec(model=model.name, layers=layers, layout=layout, world_size=args.world_size, rank=rank,
                   iterations=args.iterations, seq_length=args.seq_length or model.seq_length,
                   global_batch=args.global_batch or args.world_size // model_parallel, profile=args.profile,
                   sequence_parallel=not args.no_sequence_parallel, attention=attention, dropout=args.dropout)
    if args.emulate:
        print(json.dumps(emulate(spec, repeats=args.repeats, jobs=args.jobs, timeout_s=args.timeout), indent=1))
        return
    configurations = (True,) if args.only_virtual_time else ((False,) if args.no_virtual_time else (False, True))
    print(json.dumps(run(spec, repeats=args.repeats, warmup=args.warmup, configurations=configurations)))


if __name__ == "__main__":
    main()
