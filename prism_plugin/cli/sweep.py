"""`prism sweep`: a virtual-GPU recipe's job over several world sizes (and layouts), one table, plots and JSON.

    prism sweep recipes/virtual-gpu-llama-1b.yaml --world-sizes 512,1024,2048,4096 --global-batch 4096
    prism sweep virtual-gpu-llama-1b --world-sizes 8,64,512 [--layouts "tp=1;tp=2"] [--rank 5]
    prism sweep virtual-gpu-llama-1b --world-sizes 512,4096 --profiles dgx-h100,dgx-a100   # hardware what-if
    prism sweep ... --jobs 2                          # points at a time on this machine (default min(2, cores))
    prism sweep ... --ray auto | --ray ray://head:10001 | --ray local   # points as Ray tasks (pip install .[cluster])
    prism sweep ... --json                            # the sweep.json document on stdout instead of the table

Writes ``OUTPUT/sweep.json``, ``sweep.md``, ``step_time.png``, ``memory.png``, ``mfu.png`` and one folder per
point (its prism summary, timeline and log); OUTPUT defaults to ``prism_output/sweeps/<recipe>``. Shows rich
progress while points run (on stderr) and one summary table at the end. Exits 0 when every point ran, 1 when one
failed (its row carries the error), 2 on invalid input (before anything runs). The logic is
`prism_plugin.recipes.sweep`; see its docstring for the figures' definitions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prism_plugin.cli.recipes import find_recipe
from prism_plugin.config.errors import ConfigError
from prism_plugin.launch.preflight import claim_output
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.sweep import (
    PointResult,
    SweepInterrupted,
    SweepPoint,
    SweepSpec,
    default_jobs,
    derive_points,
    parse_layouts,
    parse_world_sizes,
    run_points,
    sweep_document,
)
from prism_plugin.recipes.sweep_report import plot_sweep, rich_table, write_markdown
from prism_plugin.recipes.virtual_gpu import OomMode

__all__ = ["add_sweep_parser"]

console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 200)
out_console = Console(width=None if Console().is_terminal else 240)


def _cmd_sweep(args: argparse.Namespace) -> int:
    recipe = load_recipe(find_recipe(args.recipe))
    spec = SweepSpec(recipe=recipe, world_sizes=parse_world_sizes(args.world_sizes),
                     layouts=parse_layouts(args.layouts, recipe.layout) if args.layouts else (),
                     profiles=tuple(x.strip() for x in args.profiles.split(",")) if args.profiles else (),
                     global_batch=args.global_batch, rank=args.rank, emulation=args.emulation,
                     oom=None if args.oom is None else OomMode(args.oom))
    points = derive_points(spec)  # every point validated before any runs
    output: Path = args.output or Path("prism_output") / "sweeps" / recipe.name
    if args.ray:
        check_ray_address(args.ray)
    claim_output("--output", output, "prism sweep", overwrite=args.overwrite)
    jobs = default_jobs() if args.jobs is None else args.jobs
    engine = f"ray ({args.ray})" if args.ray else f"local ({jobs} at a time)"
    console.print(f"[bold]prism sweep {recipe.name}[/]: {len(points)} points ({', '.join(p.name for p in points)}) "
                  f"on {engine}; output {output}")
    lock = threading.Lock()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        overall = bar.add_task("points", total=len(points))
        tasks: dict[str, Any] = {}

        def started(p: SweepPoint) -> None:
            with lock:
                tasks[p.name] = bar.add_task(f"{p.name}: N={p.world_size}, {p.micro_batch} x {p.accumulation} "
                                             "micro-batches", total=1)

        def done(r: PointResult) -> None:
            with lock:
                if r.point.name in tasks:
                    bar.remove_task(tasks.pop(r.point.name))
                bar.advance(overall)
                step = r.figures.step_time_s if r.figures is not None else None
                text = (f"[red]failed: {r.error}" if r.error else
                        f"step {1e3 * step:.2f} ms" if step is not None else "no step time")
                console.print(f"  {r.point.name}: {text} ({r.wall_s:.1f} s)", soft_wrap=True)

        try:
            with _sigterm_as_interrupt():
                results = run_points(points, output, jobs=jobs, ray_address=args.ray, timeout_s=args.timeout,
                                     on_start=started, on_done=done)
        except SweepInterrupted as stop:  # no point started after it, the running ones stopped: keep what finished
            doc = sweep_document(spec, stop.finished, engine=engine)
            doc["interrupted"] = {"signal": stop.signal_name, "finished": len(stop.finished), "points": len(points)}
            (output / "sweep.json").write_text(json.dumps(doc, indent=2))
            console.print(f"prism sweep: interrupted by {stop.signal_name}; {len(stop.finished)} of {len(points)} "
                          f"point(s) had finished: {output / 'sweep.json'}", soft_wrap=True)
            return 128 + stop.signal_number
    doc = sweep_document(spec, results, engine=engine)
    plots = [] if args.no_plots else plot_sweep(doc, results, output)
    doc["plots"] = [str(p) for p in plots]
    (output / "sweep.json").write_text(json.dumps(doc, indent=2))
    md = write_markdown(doc, results, output, plots)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        out_console.print(rich_table(doc, results))
        console.print(f"sweep: {output / 'sweep.json'}, {md}" + (f", plots {', '.join(p.name for p in plots)}"
                                                                   if plots else ""))
    return 0 if all(r.ok for r in results) else 1


RAY_CONNECT_TIMEOUT_S = 10.0
"""How long `check_ray_address` waits for a cluster's port to answer (ray.init itself waits without a limit)."""


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """A ``--ray HOST:PORT`` (or ``ray://HOST:PORT``) answers a TCP connection within `timeout_s`, else a
    `ConfigError` naming it and the fix, before any point runs (``ray.init`` hung on a dead address). ``auto`` and
    ``local`` are Ray's and this command's own and are not checked."""
    import socket

    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray {address!r}: give HOST:PORT (a cluster's GCS, e.g. 10.0.0.1:6379), "
                          "ray://HOST:10001, auto, or local")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"--ray {address!r}: no Ray cluster answers there ({exc.strerror or exc}); start one "
                          "(`ray start --head`), give its address, or run points here with --ray local") from None


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so both stop a sweep the same way."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def raise_terminated(_signum: int, _frame: Any) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except SweepInterrupted as stop:
        terminated = isinstance(stop.__cause__, _Terminated)
        stop.signal_name, stop.signal_number = ("SIGTERM", 15) if terminated else ("SIGINT (Ctrl-C)", 2)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_sweep_parser(sub: Any) -> None:
    """Add ``prism sweep`` to the `prism` command's subparsers."""
    p = sub.add_parser("sweep", help="run a virtual-GPU recipe's job over several world sizes / layouts: table, "
                                     "plots, JSON")
    p.add_argument("recipe", help="a device: virtual-gpu recipe file or name (see `prism recipe list`)")
    p.add_argument("--world-sizes", required=True, help="comma-separated N of each point, e.g. 512,2048,8192")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step at every point (fixed global batch: gradient accumulation = G / "
                        "(micro-batch x dp)); default: the recipe's per-replica batch (grows with dp)")
    p.add_argument("--layouts", default=None, help="';'-separated layouts, each KEY=INT[,...] of tp, pp, cp, ep, "
                                                   "vpp, e.g. \"tp=1;tp=2\" (default: the recipe's)")
    p.add_argument("--profiles", default=None, help="comma-separated hardware profiles to run every point on "
                                                   "(a what-if of the cluster), e.g. dgx-h100,dgx-a100")
    p.add_argument("--rank", type=int, default=None, help="the real rank of every point (default: the "
                                                          "emulation's first)")
    p.add_argument("--emulation", default=None, help="the recipe emulation to sweep (default: its first)")
    p.add_argument("--oom", choices=[m.value for m in OomMode], default=None,
                   help="at an allocation past the GPU: raise (the point fails) or report (count, run on); "
                        "default: the emulation's")
    p.add_argument("--jobs", type=int, default=None, help="points run at a time locally (default min(2, cores))")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run points as Ray tasks: a cluster address (auto, ray://host:10001) or 'local' to start "
                        "a local instance of --jobs CPUs (needs the cluster extra)")
    p.add_argument("--output", type=Path, default=None, help="default prism_output/sweeps/<recipe>")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per point (default 900)")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    p.add_argument("--overwrite", action="store_true", help="replace a previous sweep output in --output (a used "
                                                             "--output is refused without it)")
    p.add_argument("--json", action="store_true", help="print the sweep.json document on stdout instead of "
                                                       "the table")
    p.set_defaults(func=_cmd_sweep)
