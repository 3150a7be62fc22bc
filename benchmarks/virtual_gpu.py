"""A Megatron GPT job on a virtual H100: host time per training iteration, start-up, and the modelled memory.

    python benchmarks/virtual_gpu.py [--model llama3-8b] [--layers 2] [--layout tp=8] [--world-size 64]
        [--rank 7] [--iterations 5] [--warmup 2] [--repeats 3] [--seq-length S] [--global-batch B]

Each repeat is one real process: the repo's ``prism_plugin/programs/pretrain_gpt.py`` (Megatron's own
``pretrain`` loop, mock data, ``--transformer-impl local``, bf16, distributed optimizer) through the drop-in
``python -m prism_plugin.megatron`` with ``--prism-device virtual-gpu --prism-profile dgx-h100``, as rank
`rank` of `world-size`, at the width of a model preset (``prism models``; ``prism_plugin.config.models``)
cut to `layers` blocks. Tensors are fake (no storage, no compute), so the figures are the emulator's and
Megatron's host cost, not a GPU's step time.

Prints one JSON object:
- ``step_time_s``: median over repeats of each repeat's median host wall seconds per iteration, after
  `warmup` iterations; each iteration's time is Megatron's own ``elapsed time per iteration`` (its
  ``interval-time`` timer, wall clock; log interval 1); ``step_time_s_per_repeat`` lists the repeats';
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
  ``emulated_step_time_same_every_repeat`` checks it).

Defaults (Llama-3-8B width, 2 layers, TP8, rank 7 of 64, 5 iterations, 3 repeats) take about a minute on
this 2-core machine. Not measured here: sequence parallelism (not yet with the local spec), MoE presets
(Megatron's local MoE path on virtual GPUs is untested), the issue's full-depth targets (item 6).
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


def _command(spec: JobSpec, output: Path) -> list[str]:
    arch = megatron_args(preset(spec.model))
    arch[arch.index("--num-layers") + 1] = str(spec.layers)
    arch[arch.index("--seq-length") + 1] = str(spec.seq_length)
    layout = [x for key, flag in LAYOUT_FLAGS.items() for x in (flag, str(spec.layout[key]))]
    return [sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), "--transformer-impl", "local", *arch,
            *layout, "--micro-batch-size", "1", "--global-batch-size", str(spec.global_batch),
            "--train-iters", str(spec.iterations), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", str(10**6), "--disable-gloo-process-groups",
            "--prism-world-size", str(spec.world_size), "--prism-real-ranks", str(spec.rank),
            "--prism-profile", spec.profile, "--prism-device", "virtual-gpu", "--prism-output", str(output)]


def measure(spec: JobSpec, *, virtual_time: bool = False) -> Measurement:
    """Run `spec` once in a fresh process (virtual time on or off) and read its log and summary."""
    with tempfile.TemporaryDirectory(prefix="prism-vgpu-bench-") as tmp:
        output = Path(tmp) / "out"
        command = _command(spec, output)
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                                   "PRISM_VIRTUAL_TIME": "on" if virtual_time else "off"})
        wall_s = time.perf_counter() - start
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-4000:])
            raise SystemExit(f"the virtual-GPU job exited {proc.returncode}")
        iterations = [float(ms) / 1e3 for _, ms in _ITERATION.findall(proc.stdout)]
        if len(iterations) != spec.iterations:
            raise SystemExit(f"expected {spec.iterations} iteration log lines, read {len(iterations)}")
        summary = json.loads((output / f"rank{spec.rank}.summary.json").read_text())
    device = max(summary["virtual_gpu"]["devices"], key=lambda d: d["peak_allocated_bytes"])
    counted = _PARAMETERS.findall(proc.stdout)
    emulated = summary["virtual_gpu"].get("virtual_time", {}).get("step_times_s") or []
    return Measurement(iteration_s=iterations, wall_s=wall_s, peak_allocated_bytes=device["peak_allocated_bytes"],
                       emulated_step_s=statistics.median(emulated) if emulated else None,
                       peak_reserved_bytes=device["peak_reserved_bytes"],
                       device_total_bytes=device["device_total_bytes"], fits=device["fits"],
                       megatron_parameters=int(counted[0]) if counted else None)


def emulation_overhead_pct(t_without_s: float, t_with_s: float) -> float:
    """What virtual time adds to the host step time, in percent: ``100 * (t_with / t_without - 1)``.

    >>> emulation_overhead_pct(0.40, 0.42)
    5.0
    """
    return round(100.0 * (t_with_s / t_without_s - 1.0), 3)


def _step_s(m: Measurement, warmup: int) -> float:
    return statistics.median(m.iteration_s[warmup:])


def run(spec: JobSpec, *, repeats: int, warmup: int, virtual_time_pairs: bool = True) -> dict:
    """`repeats` measurements (with `virtual_time_pairs`: each repeat without, then with, virtual time) as
    the benchmark's JSON object; ``step_time_s`` is the host time per iteration with virtual time (the default
    mode) when it ran, else without."""
    configurations = (False, True) if virtual_time_pairs else (False,)
    runs: dict[bool, list[Measurement]] = {vt: [] for vt in configurations}
    for _ in range(repeats):
        for vt in configurations:  # alternated: drift of a shared machine falls on both alike
            runs[vt].append(measure(spec, virtual_time=vt))
    base = runs[False]
    steps_without = [_step_s(m, warmup) for m in base]
    timed = runs[True] if virtual_time_pairs else base
    steps = [_step_s(m, warmup) for m in timed]
    step_time_s = statistics.median(steps)
    overhead = None
    if virtual_time_pairs:
        overhead = emulation_overhead_pct(statistics.median(steps_without), step_time_s)
    emulated = [m.emulated_step_s for m in timed if m.emulated_step_s is not None]
    memory = {(m.peak_allocated_bytes, m.peak_reserved_bytes, m.device_total_bytes) for m in base}
    first = base[0]
    dp = spec.world_size // (spec.layout["tp"] * spec.layout["pp"] * spec.layout["cp"])
    return {
        "benchmark": "virtual_gpu", "model": spec.model, "layers": spec.layers, "seq_length": spec.seq_length,
        "layout": {**spec.layout, "dp": dp}, "global_batch": spec.global_batch, "world_size": spec.world_size,
        "rank": spec.rank, "processes": 1, "profile": spec.profile, "iterations": spec.iterations,
        "warmup_iterations": warmup, "repeats": repeats,
        "iteration_s": round(step_time_s, 4), "build_s": round(statistics.median(m.wall_s - sum(m.iteration_s)
                                                                                for m in timed), 3),
        "step_time_s": round(step_time_s, 4), "step_time_s_per_repeat": [round(s, 4) for s in steps],
        "step_time_s_without_virtual_time": round(statistics.median(steps_without), 4),
        "emulated_step_time_s": emulated[0] if emulated else None,
        "emulated_step_time_same_every_repeat": len(set(emulated)) <= 1,
        "startup_s": round(statistics.median(m.wall_s - sum(m.iteration_s) for m in base), 3),
        "peak_allocated_bytes": first.peak_allocated_bytes, "peak_reserved_bytes": first.peak_reserved_bytes,
        "device_total_bytes": first.device_total_bytes, "fits": first.fits,
        "memory_same_every_repeat": len(memory) == 1, "megatron_parameters": first.megatron_parameters,
        "rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "emulation_overhead_pct": overhead,
        "emulation_overhead_note": None if virtual_time_pairs else VIRTUAL_TIME_NOTE,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", help="a preset of `prism models` (default llama3-8b)")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2; the preset's width)")
    ap.add_argument("--layout", default="tp=8", help="tp=N,pp=N,cp=N,ep=N (default tp=8); dp is the rest")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--rank", type=int, default=7, help="the real rank (default 7: TP rank 7, DP rank 0)")
    ap.add_argument("--iterations", type=int, default=5, help="training iterations per run (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations left out of the median (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs, one process each (default 3)")
    ap.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    ap.add_argument("--global-batch", type=int, default=None, help="default: one micro-batch per DP rank")
    ap.add_argument("--profile", default="dgx-h100", help="hardware profile: the virtual GPU's model")
    ap.add_argument("--no-virtual-time", action="store_true",
                    help="only the runs without virtual time (no emulation_overhead_pct)")
    args = ap.parse_args()
    model = preset(args.model)
    layout = parse_layout(args.layout)
    model_parallel = layout["tp"] * layout["pp"] * layout["cp"]
    if args.world_size % model_parallel or args.layers % layout["pp"]:
        ap.error(f"--world-size must divide by tp x pp x cp = {model_parallel} and --layers by pp")
    if not 0 <= args.warmup < args.iterations:
        ap.error("--warmup must leave at least one of --iterations")
    spec = JobSpec(model=model.name, layers=args.layers, layout=layout, world_size=args.world_size, rank=args.rank,
                   iterations=args.iterations, seq_length=args.seq_length or model.seq_length,
                   global_batch=args.global_batch or args.world_size // model_parallel, profile=args.profile)
    print(json.dumps(run(spec, repeats=args.repeats, warmup=args.warmup,
                         virtual_time_pairs=not args.no_virtual_time)))


if __name__ == "__main__":
    main()
