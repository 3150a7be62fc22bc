"""The execution-graph commands: slice, profile, graph build/show, replay; plus `prism run` trace flags.

    prism slice --layout tp=8,pp=16,dp=64 [--framework megatron|deepspeed] --devices 2 [--output plan.json]
    prism profile --plan plan.json --output DIR [--profile P] -- script.py args     (or -m module args)
    prism graph build TRACES... (--plan plan.json | --layout ...) -o job.graph [--warmup 2]
    prism graph show job.graph
    prism replay job.graph [--profile dgx-h100] [--straggler RANK:FACTOR ...] [--set FIELD=VALUE ...] [--sampled]
                 [--chrome-trace out.json --ranks 0,5] [--json]
    prism run ... --trace DIR [--graph job.graph] [--iteration-marker auto|explicit|optimizer-step] -- ...

Each ``add_*_parser(subparsers)`` adds one command to the `prism` CLI (`prism_plugin.cli.main` wires them).
Bad input raises `ConfigError` (the CLI prints it and exits 2) before any process starts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError

__all__ = [
    "main",
    "make_parser",
    "profile_plan",
    "replay_prediction",
    "add_graph_parser",
    "add_profile_parser",
    "add_replay_parser",
    "add_slice_parser",
    "add_trace_run_args",
    "run_target_args",
    "trace_config_kwargs",
]


def _console() -> Any:
    from rich.console import Console

    return Console()


# -- prism run --trace / --graph ------------------------------------------------------------------
def add_trace_run_args(p: argparse.ArgumentParser) -> None:
    """The `prism run` flags of trace capture and hybrid emulation."""
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="write each real rank's per-iteration trace to DIR/rank<R>.trace.json")
    p.add_argument("--trace-iterations", type=int, default=64, help="iterations to trace (default 64)")
    p.add_argument("--graph", type=Path, default=None, metavar="FILE",
                   help="execution graph whose replay gives virtual participants' arrivals (hybrid emulation)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="a fault or what-if, repeatable (prism_plugin.config.faults), e.g. "
                        "straggler:ranks=4-7,factor=1.3 | link:nodes=0/1,bandwidth=0.25 | jitter:sigma=0.05,seed=7 | "
                        "hang:rank=1,group=tp,op=3 | crash:rank=5,step=2 | kill:rank=0,step=3")
    p.add_argument("--iteration-marker", default="auto", choices=["auto", "explicit", "optimizer-step"],
                   help="what delimits iterations: prism_plugin.mark_iteration() calls, optimizer steps, or "
                        "auto (optimizer steps until the first explicit mark)")


def trace_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EmulationConfig keyword arguments from `add_trace_run_args` flags."""
    return {"trace_dir": args.trace, "trace_max_iterations": args.trace_iterations, "graph": args.graph,
            "iteration_marker": args.iteration_marker, "faults": tuple(getattr(args, "fault", None) or ())}


# -- prism slice ---------------------------------------------------------------------------------------
def add_slice_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("slice", help="classes of ranks and the profiling runs that cover them")
    p.add_argument("--layout", required=True, help="parallel sizes, e.g. tp=8,pp=16,dp=64 (vpp=2 for chunks)")
    p.add_argument("--framework", default="megatron", choices=["megatron", "deepspeed"])
    p.add_argument("--world-size", type=int, default=None, help="N, if --layout leaves dp out")
    p.add_argument("--devices", type=int, required=True, help="physical devices per profiling run")
    p.add_argument("--output", "--out", type=Path, default=None,
                   help="write the plan (JSON) for `prism profile --plan`")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_slice)


def _cmd_slice(args: argparse.Namespace) -> int:
    from rich.table import Table

    from prism_plugin.graph.slicing import make_plan, parse_layout, plan_rows
    from prism_plugin.launch.preflight import check_file_output

    if args.output is not None:
        check_file_output("--output", args.output)
    plan = make_plan(parse_layout(args.layout, args.framework, args.world_size), args.devices)
    if args.output is not None:
        plan.save(args.output)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    table = Table(title=f"prism slice: {plan.job.framework.value} {args.layout} ({plan.world_size} ranks), "
                        f"{len(plan.classes)} classes, {len(plan.runs)} profiling runs on {plan.devices} device(s)")
    for col in ("run", "class", "rank", "stands for", "role"):
        table.add_column(col, justify="left" if col == "role" else "right")
    for run, name, rank, role, count in plan_rows(plan):
        table.add_row(str(run), name, str(rank), f"{count} ranks", role)
    table.caption = "runs: " + "  ".join(f"{i}: --real-ranks {','.join(map(str, r))}" for i, r in enumerate(plan.runs))
    _console().print(table)
    return 0


# -- prism profile ---------------------------------------------------------------------------------------
def add_profile_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="run a slicing plan's profiling runs with tracing; build the graph")
    p.add_argument("--plan", type=Path, required=True, help="plan from `prism slice --output`")
    p.add_argument("--output", "--out", type=Path, required=True,
                   help="DIR: traces in DIR/run<i>/, graph DIR/job.graph")
    p.add_argument("--profile", default="local-cpu-gloo", help="hardware profile of the profiling runs")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--trace-iterations", type=int, default=64)
    p.add_argument("--iteration-marker", default="auto", choices=["auto", "explicit", "optimizer-step"])
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped when building the graph")
    p.add_argument("--no-graph", action="store_true", help="only write the traces")
    p.add_argument("--timeout", type=float, default=None, help="seconds per profiling run")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write the runs and the graph as one JSON document to PATH (the programs own stdout)")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None)
    p.add_argument("target", nargs=argparse.REMAINDER, help="-- script.py args")
    p.set_defaults(func=_cmd_profile)


def profile_plan(plan_path: Path, out: Path, target: list[str], *, profile: str = "local-cpu-gloo",
                 gpus_per_node: int = 8, trace_iterations: int = 64, iteration_marker: str = "auto",
                 timeout_s: float | None = None, progress: Any = None) -> list[Path]:
    """Run every profiling run of the plan (tracing on); returns the run directories. Raises on failure.
    `progress(text)`, when given, hears which run starts."""
    from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
    from prism_plugin.graph.slicing import SlicingPlan
    from prism_plugin.launch.launcher import LaunchSpec, launch
    from prism_plugin.launch.preflight import check_directory, check_program

    plan = SlicingPlan.load(plan_path)
    check_program(target)  # once, before run 0 creates its directory
    check_directory("--output", out)
    configs = []
    for i, run in enumerate(plan.runs):  # every config is checked before the first run starts
        run_dir = out / f"run{i}"
        configs.append((run_dir, EmulationConfig(
            world=VirtualWorld(world_size=plan.world_size, real_ranks=run, gpus_per_node=gpus_per_node),
            profile=profile, trace_dir=run_dir, trace_max_iterations=trace_iterations, output_dir=run_dir,
            iteration_marker=iteration_marker)))
    from prism_plugin.cost import load_profile

    load_profile(profile)
    dirs = []
    for i, (run_dir, config) in enumerate(configs):
        if progress is not None:
            progress(f"profiling run {i + 1}/{len(configs)}: real ranks {list(config.world.real_ranks)}")
        run_dir.mkdir(parents=True, exist_ok=True)
        rc = launch(LaunchSpec(config=config, target=target, store_dir=run_dir), timeout_s=timeout_s)
        if rc != 0:
            raise RuntimeError(f"prism profile: run {i} (real ranks {list(config.world.real_ranks)}) exited {rc}")
        dirs.append(run_dir)
    return dirs


def run_target_args(args: argparse.Namespace, what: str = "run") -> list[str]:
    """The program of `prism run` / `prism profile` / `prism kernels record`: ``-- script.py args`` or
    ``-m module args`` (a ConfigError saying what to give when there is none; `what` names the verb)."""
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if args.module:
        target = ["-m", *args.module]
    if not target or target == ["-m"]:
        raise ConfigError(f"name the program to {what}: `-- script.py args` or `-m module args`")
    return target


def _cmd_profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from prism_plugin.graph.slicing import SlicingPlan

    plan = SlicingPlan.load(args.plan)
    if args.json is not None:
        from prism_plugin.launch.preflight import check_file_output

        check_file_output("--json", args.json)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        with err.status("prism profile") as status:
            dirs = profile_plan(args.plan, args.output, run_target_args(args), profile=args.profile,
                                gpus_per_node=args.gpus_per_node, trace_iterations=args.trace_iterations,
                                iteration_marker=args.iteration_marker, timeout_s=args.timeout,
                                progress=lambda text: status.update(f"prism profile: {text}"))
    except RuntimeError as exc:  # a profiling run failed: its own output says why
        err.print(f"[bold red]{exc}[/]")
        return 1
    doc: dict[str, Any] = {"plan": str(args.plan), "out": str(args.output), "profile": args.profile,
                           "runs": [{"run": i, "real_ranks": list(r), "dir": str(d)}
                                    for i, (r, d) in enumerate(zip(plan.runs, dirs, strict=True))],
                           "graph": None, "wall_s": None}
    if not args.no_graph:
        graph = _build(dirs, plan.job.world, plan.class_axes, args.warmup, {"plan": str(args.plan)})
        doc["graph"] = {"path": str(graph.save(args.output / "job.graph")), "classes": len(graph.classes),
                        "nodes": sum(len(t) for t in graph.classes.values())}
    doc["wall_s"] = round(time.perf_counter() - t0, 3)
    table = Table(title=f"prism profile: {len(dirs)} profiling runs of {args.plan} ({doc['wall_s']:.1f} s)")
    for col in ("run", "real ranks", "traces"):
        table.add_column(col, justify="left" if col == "traces" else "right")
    for run in doc["runs"]:
        table.add_row(str(run["run"]), ",".join(map(str, run["real_ranks"])), run["dir"])
    graph_doc = doc["graph"]
    table.caption = ("graph not built (--no-graph)" if graph_doc is None else
                     f"graph: {graph_doc['classes']} classes, {graph_doc['nodes']} nodes -> {graph_doc['path']}")
    _console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


# -- prism graph build / show -------------------------------------------------------------------------------
def add_graph_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("graph", help="build an execution graph from traces, or describe one")
    sub = p.add_subparsers(dest="graph_command", required=True)
    b = sub.add_parser("build", help="execution graph from rank traces (files or directories)")
    b.add_argument("traces", nargs="+", type=Path)
    b.add_argument("-o", "--output", "--out", type=Path, required=True)
    b.add_argument("--plan", type=Path, default=None, help="the slicing plan (gives the layout)")
    b.add_argument("--layout", default=None, help="parallel sizes if no plan, e.g. tp=8,pp=16,dp=64")
    b.add_argument("--framework", default="megatron", choices=["megatron", "deepspeed"])
    b.add_argument("--warmup", type=int, default=2, help="iterations dropped per trace")
    b.set_defaults(func=_cmd_graph_build)
    s = sub.add_parser("show", help="layout, classes and nodes of a graph")
    s.add_argument("graph", type=Path)
    s.set_defaults(func=_cmd_graph_show)


def _build(paths: list[Path], layout: Any, class_axes: tuple[str, ...], warmup: int,
           metadata: dict[str, Any]) -> Any:
    from prism_plugin.graph.convert import graph_from_rank_traces
    from prism_plugin.graph.rank_trace import load_rank_traces

    return graph_from_rank_traces(load_rank_traces(paths), layout, class_axes, warmup=warmup, metadata=metadata)


def _cmd_graph_build(args: argparse.Namespace) -> int:
    from prism_plugin.graph.rank_trace import load_rank_traces
    from prism_plugin.graph.slicing import SlicingPlan, parse_layout
    from prism_plugin.launch.preflight import check_file_output

    if (args.plan is None) == (args.layout is None):
        raise ConfigError("graph build: give the layout with exactly one of --plan FILE or --layout SIZES")
    check_file_output("--output", args.output)
    if args.plan is not None:
        plan = SlicingPlan.load(args.plan)
        layout, class_axes = plan.job.world, plan.class_axes
    else:
        world_size = load_rank_traces(args.traces)[0].world_size
        layout, class_axes = parse_layout(args.layout, args.framework, world_size).world, ("pp",)
    graph = _build(list(args.traces), layout, class_axes, args.warmup, {})
    graph.save(args.output)
    _console().print(f"prism graph: {len(graph.classes)} classes, "
                     f"{sum(len(t) for t in graph.classes.values())} nodes -> {args.output}")
    return 0


def _load_graph(path: Path) -> Any:
    from prism_plugin.graph.schema import ExecutionGraph

    return ExecutionGraph.load(path)  # a GraphError naming the file when it cannot be used


def _cmd_graph_show(args: argparse.Namespace) -> int:
    from rich.table import Table

    graph = _load_graph(args.graph)
    axes = ", ".join(f"{a.name}={a.size}" for a in graph.layout.axes)
    table = Table(title=f"{args.graph}: {graph.layout.world_size} ranks ({axes}), class axes {list(graph.class_axes)}")
    for col in ("class", "nodes", "compute (ms)", "collectives", "sends", "recvs", "async"):
        table.add_column(col, justify="right")
    for name, trace in graph.classes.items():
        kinds = [n.kind.value for n in trace.nodes]
        table.add_row(name, str(len(trace)), f"{trace.total_compute_us() / 1e3:.3f}", str(kinds.count("collective")),
                      str(kinds.count("send")), str(kinds.count("recv")), str(sum(n.is_async for n in trace.nodes)))
    _console().print(table)
    return 0


# -- prism replay ----------------------------------------------------------------------------------------------
def add_replay_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("replay", help="predict iteration time and per-rank breakdown from a graph")
    p.add_argument("graph", type=Path)
    p.add_argument("--profile", default=None, help="hardware profile (default: the one the traces were taken on)")
    p.add_argument("--straggler", action="append", default=[], metavar="RANK:FACTOR",
                   help="slow one rank's compute, e.g. 4100:1.5 (repeatable)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="a fault the replay honours (straggler, link, jitter; prism_plugin.config.faults), repeatable, "
                        "e.g. link:nodes=0/1,bandwidth=0.25; adds who-waited-on-whom (blame) per step")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="the job's collective timeout, seconds: when a hang's blocked ranks raise (hang faults)")
    p.add_argument("--blame-plot", type=Path, default=None, metavar="PNG",
                   help="plot each listed rank's longest wait per step, coloured by the root rank (matplotlib)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a profile field, e.g. inter_node.bandwidth_gbytes_per_s=25 (repeatable)")
    p.add_argument("--iterations", type=int, default=3, help="chained iterations replayed; the last is reported")
    p.add_argument("--sampled", action="store_true",
                   help="also replay the traced iterations one after another, each with its own compute spans, and "
                        "report their mean / median / p90 step (spans that vary make waits longer than the mean)")
    p.add_argument("--ranks", default=None, help="ranks to list (and export), e.g. 0,5,8-11")
    p.add_argument("--chrome-trace", type=Path, default=None, help="write a Chrome/Perfetto trace of --ranks")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=_cmd_replay)


def _parse_stragglers(items: list[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for item in items:
        rank, sep, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise ConfigError(f"--straggler {item!r} must be RANK:FACTOR, e.g. 4100:1.5") from None
        if not sep:
            raise ConfigError(f"--straggler {item!r} must be RANK:FACTOR, e.g. 4100:1.5")
    return out


def replay_prediction(graph: Any, profile_name: str, *, stragglers: dict[int, float] | None = None,
                      overrides: dict[str, Any] | None = None, iterations: int = 3,
                      ranks: list[int] | None = None, faults: tuple[Any, ...] = (),
                      timeout_s: float = 1800.0, sampled: bool = False) -> tuple[dict[str, Any], Any]:
    """(JSON-ready prediction, SteadyState) of `graph` on `profile_name` (see `prism replay`)."""
    from prism_plugin.config.nccl import nccl_from_environ
    from prism_plugin.cost import CostModel, load_profile, override_profile
    from prism_plugin.graph.steady import steady_state

    profile = load_profile(profile_name)
    if overrides:
        profile = override_profile(profile, overrides)
    nccl = nccl_from_environ()  # the job's NCCL_ALGO: the same algorithms its profiling runs were timed with
    from prism_plugin.config.faults import Crash, Hang, Kill

    stops = [f for f in faults if isinstance(f, Hang | Crash)]
    timing = tuple(f for f in faults if not isinstance(f, Hang | Crash | Kill))  # kill: a live-only fault
    t0 = time.perf_counter()
    state = steady_state(graph, CostModel(profile, nccl), iterations=iterations, stragglers=stragglers, faults=timing)
    replay_s = time.perf_counter() - t0
    space = state.result.space
    listed = sorted(({a.rep_rank for a in space.actors} if ranks is None else set(ranks)) | set(stragglers or {}))
    rows = {}
    for r in listed:
        b = state.breakdown(r)
        rows[str(r)] = {"class": graph.class_of(r), "step_us": round(b.iteration_us, 3),
                        "compute_us": round(b.compute_us, 3), "exposed_comm_us": round(b.exposed_comm_us, 3),
                        "bubble_us": round(b.bubble_us, 3), "ranks_like_it": space.actor_of(r).num_ranks}
    out = {"step_us": round(state.step_us, 3), "profile": profile.name, "iterations": iterations,
           "world_size": graph.layout.world_size, "classes": len(graph.classes), "num_actors": state.result.num_actors,
           "events": state.result.events, "replay_s": round(replay_s, 4),
           "stragglers": {str(k): v for k, v in (stragglers or {}).items()}, "ranks": rows}
    if sampled:
        from prism_plugin.graph.steady import sampled_steps

        out["sampled"] = sampled_steps(graph, CostModel(profile, nccl), stragglers=stragglers, faults=timing).summary()
    if faults:  # issue 7: the faults replayed and who waited on whom, per step, back to the root
        from prism_plugin.graph.blame import blame_report

        out["faults"] = [f.to_text() for f in faults]
        out["blame"] = blame_report(state.result, [int(r) for r in rows], steps=iterations)
    if stops:  # hangs and crashes: who blocks where, when each raises, and the chain back to the faulty rank
        from prism_plugin.graph.fault_replay import failure_replay

        out["failures"] = [failure_replay(graph, CostModel(profile, nccl), f, timeout_s=timeout_s,
                                          iterations=iterations, others=timing).to_dict() for f in stops]
    return out, state


def _cmd_replay(args: argparse.Namespace) -> int:
    from rich.table import Table

    from prism_plugin.config.errors import parse_rank_list
    from prism_plugin.graph.export import write_chrome_trace
    from prism_plugin.launch.preflight import check_file_output

    for flag, path in (("--chrome-trace", args.chrome_trace), ("--blame-plot", args.blame_plot)):
        if path is not None:  # before the replay runs
            check_file_output(flag, path)
    graph = _load_graph(args.graph)
    profile = args.profile or graph.metadata.get("capture", {}).get("profile") or "local-cpu-gloo"
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must be FIELD=VALUE, e.g. inter_node.bandwidth_gbytes_per_s=25")
        overrides[key] = float(value)
    ranks = list(parse_rank_list(args.ranks, field_name="--ranks")) if args.ranks else None
    from prism_plugin.config.faults import parse_faults

    out, state = replay_prediction(graph, profile, stragglers=_parse_stragglers(args.straggler), overrides=overrides,
                                   iterations=args.iterations, ranks=ranks, faults=parse_faults(args.fault),
                                   timeout_s=args.timeout, sampled=args.sampled)
    if args.blame_plot is not None:
        from prism_plugin.graph.blame import plot_blame

        plot_blame(out.get("blame") or {}, args.blame_plot, title=f"prism replay {args.graph.name}: waits per step")
    if args.chrome_trace is not None:
        write_chrome_trace(state.result, args.chrome_trace, ranks or [int(r) for r in out["ranks"]])
        if args.fault:  # blame: who each wait was on, as span args and flow arrows
            from prism_plugin.graph.blame import annotate_chrome_trace

            trace = annotate_chrome_trace(json.loads(args.chrome_trace.read_text()), state.result)
            args.chrome_trace.write_text(json.dumps(trace), encoding="utf-8")
    if args.json:
        print(json.dumps(out))
        return 0
    table = Table(title=f"prism replay {args.graph}: step {out['step_us'] / 1e3:.3f} ms on {out['profile']} "
                        f"({out['world_size']} ranks, {out['num_actors']} actors, {out['events']} events, "
                        f"{out['replay_s']:.3f} s)")
    for col in ("rank", "class", "like it", "step (ms)", "compute (ms)", "exposed comm (ms)", "bubble (ms)"):
        table.add_column(col, justify="right")
    for r, row in out["ranks"].items():
        table.add_row(r, row["class"], str(row["ranks_like_it"]), f"{row['step_us'] / 1e3:.3f}",
                      f"{row['compute_us'] / 1e3:.3f}", f"{row['exposed_comm_us'] / 1e3:.3f}",
                      f"{row['bubble_us'] / 1e3:.3f}")
    table.caption = (f"steady state: iteration {args.iterations} of {args.iterations} chained; "
                     + (f"stragglers {out['stragglers']}" if out["stragglers"] else "no what-if")
                     + (f"; faults {out['faults']}" if out.get("faults") else ""))
    if "sampled" in out:
        sm = out["sampled"]
        table.caption += (f"\nsampled: {sm['iterations']} traced iterations replayed in order: step mean "
                          f"{sm['step_us_mean'] / 1e3:.3f} ms, median {sm['step_us_median'] / 1e3:.3f}, "
                          f"p90 {sm['step_us_p90'] / 1e3:.3f}")
    for r, rows in (out.get("blame") or {}).items():
        last = rows[-1]
        if last["waited_us"] > 0:
            hops = " -> ".join(f"{h['rank']}" + (f" waited {h['waited_us'] / 1e3:.3f} ms in {h['op']}" if h["op"] else
                                                  " (root)") for h in last["chain"])
            table.caption += f"\nblame, rank {r}, last step: {hops}"
    _console().print(table)
    for failure in out.get("failures", []):
        first = min(failure["blocked"].items(), key=lambda kv: kv[1]["raises_at_us"], default=None)
        _console().print(f"{failure['fault']}: rank {failure['faulty_rank']} stops at "
                         f"{failure['stopped_at_us'] / 1e3:.3f} ms before {failure['stopped_before'] or 'its end'}; "
                         f"{failure['blocked_ranks']} rank(s) block"
                         + (f", first error on rank {first[0]} at {first[1]['raises_at_us'] / 1e6:.3f} s in "
                            f"{first[1]['op']} (chain {' -> '.join(map(str, first[1]['blame_chain']))})"
                            if first else ""))
    return 0


def make_parser() -> argparse.ArgumentParser:
    """These commands alone (``python -m prism_plugin.cli.graph``), as `prism` offers them."""
    ap = argparse.ArgumentParser(prog="prism", description="execution-graph commands of prism")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (add_slice_parser, add_profile_parser, add_graph_parser, add_replay_parser):
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:  # every user-input error: GraphError, ProfileError, fault specs, flags
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]prism: invalid input:[/] {escape(str(exc))}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
