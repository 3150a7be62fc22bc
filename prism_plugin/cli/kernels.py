"""`prism kernels record` (a kernel table measured on this machine's device, for ``PRISM_KERNEL_MODEL=table``) and
`prism kernels fit` (efficiencies fitted to measured step times, for ``PRISM_KERNEL_MODEL=fit``).

    prism kernels record --output table.json --warmup 2 --steps 10 -- train.py --lr 0.1
    prism kernels record --clock cpu -m prism_plugin.programs.toy_train --tp 1 --steps 12

Runs the program once, in this process, on whatever device it uses (``--device auto``: ``cuda`` when torch has one,
else ``cpu``), under `prism_plugin.runtime.kernel_recorder.KernelRecorder`: after ``--warmup`` optimizer steps it
times every ATen op on that device in ``--steps`` timed optimizer steps (default: to the end), each followed by a
plain step run without the recorder (the step and its collective calls timed: what the table's step, comm and
host figures come from), and writes one entry per (op, shape, dtype) with its median duration (``--statistic
mean``: its mean), plus metadata (torch version, threads, host, program, steps, and on ``cpu`` the host overhead per
launch to use as ``kernels.launch_overhead_us``).
``--clock cpu`` times a ``cpu`` run by this thread's CPU time instead of the wall clock (a shared machine's
descheduling left out). ``--threads`` (default 1) is ``torch.set_num_threads`` before the program starts (a program
may set its own; the table's metadata reports what was in force at the end). A program that is not a
torch.distributed job runs as it is; one that calls ``init_process_group`` without a rendezvous in the environment
runs as rank 0 of 1. Bad input (no program, ``--steps 0``, no step recorded) exits 2 with one line
saying what to fix. A Megatron job on a CPU host records through the drop-in, one process per rank with its
``RANK``/``WORLD_SIZE`` set (the wrapper then runs the job in this process, the adapter's CPU shim installed)::

    RANK=0 WORLD_SIZE=2 ... prism kernels record --output table-rank0.json -m prism_plugin.megatron \
        pretrain_gpt.py <megatron args> --prism-world-size 2 --prism-real-ranks 0,1

    prism kernels fit --run out/rank0.summary.json:0.0131 [--run NAME=FILE:SECONDS ...] [--runs runs.yaml] \\
        [--classes gemm,attention] --output fit.yaml

fits per-class efficiencies (`prism_plugin.cost.kernel_fit`) so each run's emulated steady step matches its
measured step time, and writes the overlay with ``fitted_on`` (every run it saw). ``--runs`` is YAML: ``runs:
[{name: a, summary: out/rank0.summary.json, measured_step_s: 0.0131}]`` (paths relative to that file). Use the
overlay with ``prism run --kernel-model fit --kernel-fit fit.yaml`` (or ``PRISM_KERNEL_MODEL=fit
PRISM_KERNEL_FIT=fit.yaml``); a run of a fitted job then says ``fitting_row: true`` in its summary.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console

from prism_plugin.config.errors import ConfigError
from prism_plugin.launch.preflight import check_directory

__all__ = ["add_kernels_parser"]


def _positive(name: str, minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {value}")
        return value

    return parse


def _target(args: argparse.Namespace) -> list[str]:
    from prism_plugin.cli.graph import run_target_args

    target = run_target_args(args, "record")
    if target[0] != "-m" and not Path(target[0]).is_file():
        raise ConfigError(f"prism kernels record: program {target[0]!r} is not a file; give a script path "
                          "(`-- script.py args`) or a module (`-m package.module args`)")
    return target


def _cmd_record(args: argparse.Namespace) -> int:
    target = _target(args)
    if args.output.is_dir():
        raise ConfigError(f"--output {str(args.output)!r} is a directory; give the table's file name, e.g. "
                          f"--output {args.output / 'kernel_table.json'}")
    check_directory("--output", args.output.parent)
    import torch

    from prism_plugin.runtime.kernel_recorder import KernelRecorder, run_program, table_data

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("prism kernels record --device cuda: this torch has no CUDA device; use --device cpu")
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and device != "cpu":
        raise ConfigError("prism kernels record --clock cpu times a cpu device; on cuda the clock is CUDA events")
    recorder = KernelRecorder(device, warmup=args.warmup, steps=args.steps, clock=args.clock)
    with recorder.record():
        rc = run_program(target)
    if rc != 0:
        Console(stderr=True).print(f"[bold red]prism kernels record: the program exited {rc}; no table written[/]")
        return rc
    try:
        table = table_data(recorder, program=target, statistic=args.statistic)
    except ValueError as exc:
        raise ConfigError(f"prism kernels record: {exc}") from None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    meta = table["metadata"]
    host = meta["host_overhead_us_per_launch"]
    Console(stderr=True).print(
        f"prism kernels record: {len(table['entries'])} kernels (op, shape, dtype) from {meta['recorded_steps']} "
        f"steps (+{meta['plain_steps']} plain) on {meta['device']} ({meta['threads']} thread(s), {meta['clock']} "
        f"clock) -> {args.output}; per step: "
        f"{meta['kernels_per_step']:g} kernels, {1e3 * meta['kernel_time_per_step_median_s']:.3f} ms kernel time, "
        f"{1e3 * meta['step_time_median_s']:.3f} ms a {meta['step_source']} step"
        + (f"; host overhead {host:g} us per launch (profile kernels.launch_overhead_us)" if host is not None else ""),
        soft_wrap=True)
    raw = meta["host_overhead_raw_us_per_launch"]
    if raw is not None and raw < 0:
        Console(stderr=True).print(
            f"[yellow]prism kernels record: the host time per launch came out {raw:g} us (the timed steps' kernels "
            "took longer than the plain steps' time outside collectives): 0 written; record more steps on a "
            "quieter machine for a measured figure[/]", soft_wrap=True)
    return 0


MIN_MEASURED_STEP_S = 1e-6
"""The shortest measured step `prism kernels fit` takes: one kernel launch costs microseconds, so a shorter "step" is
a unit slip (nanoseconds, or a per-token figure) rather than a measurement."""


def _measured_step_s(value: object, where: str) -> float:
    """A measured step time in seconds: a finite number >= `MIN_MEASURED_STEP_S`, else a `ConfigError` naming
    `where` and what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: measured step time {value!r} is not a number; give seconds, e.g. 0.0131")
    if value <= 0:
        raise ConfigError(f"{where}: measured step time {value!r} s must be > 0 (the step's wall time in seconds)")
    if value < MIN_MEASURED_STEP_S:
        raise ConfigError(f"{where}: measured step time {value!r} s is under {MIN_MEASURED_STEP_S:g} s, shorter than "
                          "one kernel launch; give the step's wall time in seconds (e.g. 0.0131 for 13.1 ms)")
    return float(value)


def _fit_run_arg(text: str) -> tuple[str | None, Path, float]:
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = None, text
    path, sep, seconds = rest.rpartition(":")
    try:
        value = float(seconds)
    except ValueError:
        value = None
    if not sep or not path or value is None:
        raise argparse.ArgumentTypeError(f"--run {text!r}: give [NAME=]SUMMARY.json:MEASURED_STEP_SECONDS, e.g. "
                                         "out/rank0.summary.json:0.0131")
    try:
        return name, Path(path), _measured_step_s(value, f"--run {text!r}")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fit_runs(args: argparse.Namespace) -> list[Any]:
    import yaml

    from prism_plugin.cost.kernel_fit import run_from_summary

    specs = list(args.run or [])
    if args.runs is not None:
        try:
            data = yaml.safe_load(args.runs.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--runs {args.runs}: cannot read it ({exc})") from None
        rows = data.get("runs") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ConfigError(f"--runs {args.runs}: expected `runs: [{{name, summary, measured_step_s}}, ...]`")
        for i, row in enumerate(rows):
            missing = [k for k in ("summary", "measured_step_s") if not isinstance(row, dict) or k not in row]
            if missing:
                raise ConfigError(f"--runs {args.runs}: runs[{i}] has no `{missing[0]}`")
            specs.append((row.get("name"), args.runs.parent / str(row["summary"]),
                          _measured_step_s(row["measured_step_s"], f"--runs {args.runs}: runs[{i}]")))
    runs = []
    for name, path, measured in specs:
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"prism kernels fit: cannot read summary {str(path)!r} ({exc})") from None
        runs.append(run_from_summary(summary, name=name or str(path), measured_step_s=measured))
    return runs


def _cmd_fit(args: argparse.Namespace) -> int:
    import yaml

    from prism_plugin.cost.kernel_fit import fit_efficiencies

    runs = _fit_runs(args)
    result = fit_efficiencies(runs, [c.strip() for c in args.classes.split(",") if c.strip()])
    overlay = result.overlay()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("# prism kernels fit: a `fit` kernel model overlay; its fitted_on runs are fitting rows, "
                           "never validation\n" + yaml.safe_dump(overlay, sort_keys=False), encoding="utf-8")
    console = Console(stderr=True)
    for c in result.classes:
        e = result.efficiency[c]
        console.print(f"prism kernels fit: {c}: time x{result.scale[c]:.4f}, compute efficiency {e[0]:.4f}, memory "
                      f"efficiency {e[1]:.4f}" + (" (held at the bound 1)" if c in result.at_bound else ""))
    for r, f in zip(result.runs, result.fitted_step_s, strict=True):
        console.print(f"  {r.name}: measured {1e3 * r.measured_step_s:.3f} ms, emulated {1e3 * r.emulated_step_s:.3f}"
                      f" ms, fitted (linear) {1e3 * f:.3f} ms")
    console.print(f"  rms residual {1e3 * result.residual_rms_s:.3f} ms over {len(runs)} fitting run(s) -> "
                  f"{args.output}")
    return 0


def add_kernels_parser(sub: Any) -> None:
    """Add ``prism kernels record [--output F] [--steps K] [--warmup W] [--threads T] [--device D] -- program``."""
    kernels = sub.add_parser("kernels", help="kernel tables (record) and fitted efficiencies (fit) for virtual time")
    actions = kernels.add_subparsers(dest="kernels_command", required=True)
    rec = actions.add_parser("record", help="run a program and record each ATen op's measured duration")
    rec.add_argument("--output", type=Path, default=Path("kernel_table.json"),
                     help="the table file to write (default kernel_table.json)")
    rec.add_argument("--steps", type=_positive("--steps", 1), default=None,
                     help="optimizer steps to record after the warm-up (default: to the program's end)")
    rec.add_argument("--warmup", type=_positive("--warmup", 0), default=1,
                     help="optimizer steps to skip before recording (default 1)")
    rec.add_argument("--threads", type=_positive("--threads", 1), default=1,
                     help="torch.set_num_threads before the program starts (default 1)")
    rec.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                     help="the device type whose ops are recorded (auto: cuda if available, else cpu)")
    rec.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                     help="cpu device: time ops and steps by the wall clock (default), or by this thread's CPU time "
                          "(a shared machine's descheduling left out)")
    rec.add_argument("--statistic", choices=["median", "mean"], default="median",
                     help="each entry's figure over its samples: median (default) or mean (a shared machine's "
                          "descheduled samples kept, as a real step pays them)")
    rec.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None,
                     help="record a module and its arguments, like python -m")
    rec.add_argument("target", nargs=argparse.REMAINDER, help="-- script.py args")
    rec.set_defaults(func=_cmd_record)
    fit = actions.add_parser("fit", help="fit per-class kernel efficiencies to measured step times (a fit overlay)")
    fit.add_argument("--run", type=_fit_run_arg, action="append", metavar="[NAME=]SUMMARY.json:SECONDS",
                     help="a virtual-time rank summary and the step time measured for that job (repeatable)")
    fit.add_argument("--runs", type=Path, default=None, help="YAML: runs: [{name, summary, measured_step_s}]")
    fit.add_argument("--classes", default="gemm", help="kernel classes to fit, comma-separated (default gemm)")
    fit.add_argument("--output", type=Path, default=Path("kernel_fit.yaml"),
                     help="the overlay to write (default kernel_fit.yaml)")
    fit.set_defaults(func=_cmd_fit)
