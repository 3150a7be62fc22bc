"""The `prism` command line.

    prism run --world-size N --real-ranks 0,5 [--profile dgx-h100] -- script.py args
    prism run --world-size N --real-ranks 0 -m package.module args
    prism run ... --fault straggler:ranks=4-7,factor=1.3 --fault hang:rank=1,group=tp,op=3 --timeout 60 -- script.py
    prism profiles [NAME]
    prism megatron pretrain_gpt.py <megatron args> --prism-world-size N --prism-real-ranks r1,...
    prism calibrate [--backend gloo|nccl] [--processes 2] [--from-nccl-tests DIR] --output profile.yaml
    prism models [--json] | prism models show NAME [--json]
    prism sweep RECIPE --world-sizes 512,2048,8192 [--global-batch G] [--jobs K] [--ray ADDRESS] [--json]
    prism kernels record [--output table.json] [--steps K] [--warmup W] -- script.py args
    prism emulate --world-size N [--profile dgx-h100] [--output DIR] -- pretrain_gpt.py <Megatron args>
    prism plan --model NAME | -- pretrain_gpt.py <args>  --gpus N [--gpu h100] [--max-candidates K] [--jobs K]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prism_plugin.cli.calibrate import add_calibrate_parser
from prism_plugin.cli.graph import (
    add_graph_parser,
    add_profile_parser,
    add_replay_parser,
    add_slice_parser,
    run_target_args,
)
from prism_plugin.cli.kernels import add_kernels_parser
from prism_plugin.cli.models import add_models_parser
from prism_plugin.cli.plan import add_plan_parser
from prism_plugin.cli.settings_args import add_setting_arguments, given_settings
from prism_plugin.cli.sweep import add_sweep_parser
from prism_plugin.config.emulation import EmulationConfig
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.config.resolve import Settings, resolve
from prism_plugin.config.settings import Entry

__all__ = ["main", "build_config", "build_settings"]

console = Console(stderr=True)


def build_settings(args: argparse.Namespace) -> Settings:
    """The settings of parsed `prism run` arguments, resolved and checked (`prism_plugin.config.resolve`; a
    ConfigError naming the flag), the profile and the GPU model included, before any process starts."""
    settings = resolve(given_settings(args), Entry.RUN)
    from prism_plugin.cost import load_profile

    config = settings.emulation()
    profile = load_profile(config.profile)  # an unknown profile fails here, before any process starts
    if config.device is DeviceMode.VIRTUAL_GPU:
        from prism_plugin.runtime.device_session import resolve_gpu

        resolve_gpu(config, profile)  # the GPU model: named, or the profile's; refused before any process
    return settings


def build_config(args: argparse.Namespace) -> EmulationConfig:
    """The EmulationConfig for parsed `prism run` arguments (raises ConfigError on bad input)."""
    return build_settings(args).emulation()


def _run_summaries(output: Path, run_id: str | None = None) -> list[dict]:
    """The summaries in `output` written by run `run_id` (None: every summary there), by rank."""
    summaries = []
    for f in output.glob("rank*.summary.json"):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):  # being written by a concurrent run
            continue
        if isinstance(s, dict) and "rank" in s and (run_id is None or s.get("run_id") == run_id):
            summaries.append(s)
    return sorted(summaries, key=lambda s: int(s["rank"]))


def _summaries_table(output: Path, run_id: str | None = None, real_ranks: tuple[int, ...] = ()) -> Table | None:
    """The table of the summaries in `output` written by run `run_id` (None: every summary there); None when
    there is none. A concurrent run into the same folder, or an older one, is not shown; a real rank of
    `real_ranks` without a summary of this run is named in the caption."""
    summaries = _run_summaries(output, run_id)
    if not summaries:
        return None
    table = Table(title=f"prism: what the real ranks saw ({output})")
    virtual = any("virtual_gpu" in s for s in summaries)
    for col in ("rank", "of N", "profile", "policy", "groups", "ops", "bytes", "modelled comm (ms)",
                *(("emulated step (ms)", "peak allocated", "fits") if virtual else ())):
        table.add_column(col, justify="right")
    notes: list[str] = []
    for s in summaries:
        if s.get("emulated") is False:  # the script never called init_process_group
            table.add_row(str(s["rank"]), str(s["world_size"]), *["-"] * (9 if virtual else 6))
            notes.append(f"rank {s['rank']}: {s['note']}")
            continue
        table.add_row(str(s["rank"]), str(s["world_size"]), s["profile"], s["data_policy"],
                      str(s["groups_created"]), str(sum(s["op_counts"].values())),
                      f"{sum(s['op_bytes'].values()):,}", f"{1e3 * s['modelled_comm_s']:.3f}",
                      *(_virtual_cells(s) if virtual else ()))
        notes.extend(_graph_and_fault_notes(s))
    emulated = [s for s in summaries if s.get("emulated") is not False]
    caption = ["arrivals: " + emulated[0]["arrivals_note"]] if emulated else []
    missing = sorted(set(real_ranks) - {int(s["rank"]) for s in summaries})
    if missing:
        notes.append(f"no summary of this run from real rank(s) {missing} (ended before writing one, or "
                     "overwritten by another run into the same --output)")
    table.caption = "\n".join(caption + notes)
    return table


def _timeline_line(output: Path, run_id: str | None) -> str | None:
    """Where this run's per-rank timelines are (Perfetto / chrome://tracing), for the line under the summaries."""
    paths = [s["timeline"]["path"] for s in _run_summaries(output, run_id) if isinstance(s.get("timeline"), dict)]
    if not paths:
        return None
    return "timeline: " + (paths[0] if len(paths) == 1 else
                           f"{Path(paths[0]).parent}/rank*.timeline.json ({len(paths)} ranks)")


def _virtual_cells(s: dict) -> tuple[str, str, str]:
    """Emulated step (virtual time's median, modelled), peak allocated and fits of a virtual-GPU summary."""
    vgpu = s.get("virtual_gpu")
    if not vgpu:
        return ("-", "-", "-")
    steps = (vgpu.get("virtual_time") or {}).get("step_times_s") or []
    step = f"{1e3 * sorted(steps)[len(steps) // 2]:.3f}" if steps else "n/a"
    device = max(vgpu["devices"], key=lambda d: d["peak_allocated_bytes"])
    return (step, f"{device['peak_allocated_bytes'] / 2**30:.2f} GiB", "yes" if device["fits"] else "NO")


def _graph_and_fault_notes(s: dict) -> list[str]:
    """Caption lines of one summary: how its ops matched the graph (hybrid), its waits on faulty ranks."""
    notes = []
    graph, check = s.get("graph"), s.get("graph_check")
    if graph:  # always said: a graph that the program does not follow is no replay (issue 11)
        line = (f"rank {s['rank']}: graph: {graph['ops_replayed']} ops replayed, "
                f"{graph['ops_not_in_graph'] + graph['ops_kind_mismatch']} outside the graph "
                f"({graph['ops_not_in_graph']} not in it, {graph['ops_kind_mismatch']} of another kind), "
                f"{graph['ops_before_first_mark']} before the first iteration mark")
        if check and check.get("verdict") == "refused":
            line += f"; REFUSED: {check['reason']}"
        notes.append(line)
    faults = s.get("faults")
    if faults:  # faults (issue 7): each real rank's waits on faulty ranks and its fault events
        waited = sum(step["waited_s"] for step in faults["steps"])
        on = sorted({w["rank"] for step in faults["steps"] for w in step["waited_on"]})
        events = ", ".join(f"{e['event']} of rank {e['rank']} at step {e['step']}" for e in faults["events"][:3])
        notes.append(f"rank {s['rank']}: waited {1e3 * waited:.3f} ms on faulty ranks {on} over "
                     f"{len(faults['steps'])} steps" + (f"; {events}" if events else ""))
    if s.get("error"):
        notes.append(f"rank {s['rank']}: {s['error']}")
    return notes


def _cmd_run(args: argparse.Namespace) -> int:
    import os
    import uuid

    from prism_plugin.launch.launcher import LaunchSpec, launch
    from prism_plugin.runtime.lifecycle import RUN_ID_ENV, check_memory

    target = run_target_args(args)
    settings = build_settings(args)
    config = settings.emulation()
    check_memory(config.world, config.world.num_real)  # N too large for this machine: refused before any process
    if args.json is not None:
        from prism_plugin.launch.preflight import check_file_output

        if config.output_dir is None:
            raise ConfigError("--json PATH writes this run's summaries, which the ranks write into --output DIR: "
                              "give --output too")
        check_file_output("--json", args.json)
    os.environ.update(settings.environ())  # the settings the real ranks read from their environment
    run_id = uuid.uuid4().hex[:16]  # this launch's summaries carry it; the table shows only those
    previous = os.environ.get(RUN_ID_ENV)
    os.environ[RUN_ID_ENV] = run_id
    try:
        rc = launch(LaunchSpec(config=config, target=target, store_dir=config.output_dir))
    finally:
        if previous is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = previous
    if config.output_dir is not None:
        table = _summaries_table(config.output_dir, run_id, config.world.real_ranks)
        if table is not None:
            console.print(table)
            timeline = _timeline_line(config.output_dir, run_id)
            if timeline is not None:
                console.print(timeline, soft_wrap=True, markup=False, highlight=False)
        else:
            console.print(f"prism run: no real rank of this run wrote a summary into {config.output_dir}")
        if args.json is not None:  # the program owns stdout: the document goes to a file
            doc = {"run_id": run_id, "exit_code": rc, "world_size": config.world.world_size,
                   "real_ranks": list(config.world.real_ranks), "summaries": _run_summaries(config.output_dir, run_id)}
            args.json.write_text(json.dumps(doc, indent=1))
    return rc


def _cmd_profiles(args: argparse.Namespace) -> int:
    from prism_plugin.cost import available_profiles, load_profile
    from prism_plugin.cost.profiles import profile_to_yaml

    if args.name:
        print(profile_to_yaml(load_profile(args.name)))
        return 0
    table = Table(title="hardware profiles")
    for col in ("name", "gpus/node", "intra GB/s", "inter GB/s", "description"):
        table.add_column(col)
    for name in available_profiles():
        p = load_profile(name)
        table.add_row(name, str(p.gpus_per_node), f"{p.intra_node.bandwidth_gbytes_per_s:g}",
                      f"{p.inter_node.bandwidth_gbytes_per_s:g}", p.description.splitlines()[0][:60])
    Console().print(table)
    return 0


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="prism", description="Emulate an N-rank job with a few real ranks.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="launch real ranks of an N-rank torch.distributed program")
    add_setting_arguments(run)
    run.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None,
                     help="run a module and its arguments, like python -m")
    run.add_argument("--json", type=Path, default=None, metavar="PATH",
                     help="write this run's summaries (one per real rank) as one JSON document to PATH (needs "
                          "--output; the program itself owns stdout)")
    run.add_argument("target", nargs=argparse.REMAINDER, help="-- script.py args")
    run.set_defaults(func=_cmd_run)
    sub.add_parser("megatron", help="run a Megatron script emulated: prism megatron pretrain_gpt.py <args> "
                   "--prism-world-size N --prism-real-ranks r1,..")
    prof = sub.add_parser("profiles", help="list hardware profiles, or print one as YAML")
    prof.add_argument("name", nargs="?")
    prof.set_defaults(func=_cmd_profiles)
    add_calibrate_parser(sub)  # prism calibrate (issue 6, item 5)
    add_models_parser(sub)  # prism models (issue 12, item 4)
    add_sweep_parser(sub)  # prism sweep (issue 14, part 4)
    add_plan_parser(sub)  # prism plan (issue 22, item 3)
    add_kernels_parser(sub)  # prism kernels record (issue 13, item 1b)
    from prism_plugin.cli.emulate import add_emulate_parser  # prism emulate (issue 13, item 3)

    add_emulate_parser(sub)
    from prism_plugin.cli.recipes import add_recipe_parser  # prism recipe (issue 6)

    add_recipe_parser(sub)
    for add in (add_slice_parser, add_profile_parser, add_graph_parser, add_replay_parser):  # issue 5
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["megatron"]:
        # prism megatron pretrain_gpt.py <megatron args> --prism-...: argparse would reject --prism-* flags
        from prism_plugin.adapters.megatron.wrapper import main as megatron_main

        return int(megatron_main(argv[1:]) or 0)
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:  # every user-input error (profile, recipe, graph, fault spec, flags)
        print_config_error(exc)
        return 2


def print_config_error(exc: ConfigError) -> None:
    """``prism: invalid input: <message>`` on stderr: one line (not wrapped to the terminal), no traceback;
    the message is printed as it is (brackets in it are not read as rich markup)."""
    from rich.markup import escape

    console.print(f"[bold red]prism: invalid input:[/] {escape(str(exc))}", soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
