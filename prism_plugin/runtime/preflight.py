"""What a launcher checks once, before any real process starts: the program, the paths, the graph, the recording.

Each check raises a `ConfigError` (a `GraphError` for the graph) whose message starts with the flag the user
wrote (``--output``, ``--prism-output``, ``"prism.output"``: `flags` maps config fields to those names), so
`prism run`, the Megatron wrapper's self-launch and the DeepSpeed section say one line once, instead of every
real process failing with a traceback after the launcher has already created its output directory.

- `check_program`: ``script.py`` exists (a directory needs ``__main__.py``); ``-m module`` is found from the
  current directory and ``sys.path`` as ``python -m`` would find it (a package needs ``__main__``). No code of
  the program runs in the launcher.
- `check_directories`: ``output_dir``, ``record_dir`` and ``trace_dir`` can be directories: neither they nor a
  parent are files, and the closest existing parent is writable. Nothing is created.
- `check_graph`: the execution graph loads (`graph.schema.ExecutionGraph.load`) and describes N ranks.
- `check_environment`: the settings given as environment variables (`ENVIRONMENT`: timeline, Kineto and memory
  snapshot paths, virtual time, OOM policy, attention, MoE routing) are valid here, in the launcher, where a bad
  one used to surface only inside the rank, after the job ran (a lost summary, a corrupt pickle, exit code 0).
- `check_recording`: ``replay_dir`` holds ``rank<R>.pt`` for every real rank, in the format this prism reads,
  recorded at the same N (`prism_plugin.comm.recording`; read memory-mapped, torch imported only then).

Not checked here: what needs the program's own arguments (Megatron's layout, DeepSpeed's batch sizes: their
adapters check them) and anything only the program's run can tell (an op sequence that diverges).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from prism_plugin.config.emulation import ConfigError, EmulationConfig
from prism_plugin.graph.errors import GraphError

__all__ = ["DEFAULT_PROFILE", "ENVIRONMENT", "OUTPUT_MARKER", "RUN_FLAGS", "TIME_FLAGS", "check_directories",
           "check_directory", "check_environment", "check_file_output", "check_graph", "check_launch", "check_program",
           "check_recording", "claim_output", "default_profile_note", "respell", "spell"]

RUN_FLAGS: Mapping[str, str] = {
    "world_size": "--world-size", "output_dir": "--output", "record_dir": "--record", "replay_dir": "--replay",
    "trace_dir": "--trace", "graph": "--graph", "real_ranks": "--real-ranks", "gpus_per_node": "--gpus-per-node",
    "profile": "--profile", "gpu": "--gpu", "device": "--device", "data_policy": "--data-policy",
}
"""How `prism run` spells each EmulationConfig field (the default of every check). Messages of the layers below
the entry points name settings this way; an entry point that spells them otherwise passes its own mapping or
re-spells the message (`respell`)."""


TIME_FLAGS = {"PRISM_VIRTUAL_TIME": "--virtual-time", "PRISM_KERNEL_MODEL": "--kernel-model",
              "PRISM_KERNEL_TABLE": "--kernel-table", "PRISM_KERNEL_FIT": "--kernel-fit",
              "PRISM_PROGRAM_TIME": "--program-time"}
"""The virtual-time flags of `prism run` and `prism emulate`, by the variable that carries each to the ranks."""


def spell(flags: Mapping[str, str], field: str, value: object | None = None) -> str:
    """How the entry point of `flags` writes `field` (set to `value`): a flag, or a key of a config section.

    Example: ``spell(RUN_FLAGS, "profile", "dgx-h100") == "--profile dgx-h100"``; with the DeepSpeed section's
    mapping (``'"prism.profile"'``): ``'"prism.profile": "dgx-h100"'``.
    """
    name = flags.get(field, RUN_FLAGS.get(field, field))
    if value is None:
        return name
    if name.startswith("-"):
        return f"{name} {value}"
    return f"{name}: {value}" if isinstance(value, int | float) else f'{name}: "{value}"'


DEFAULT_PROFILE = "dgx-h100"
"""The hardware profile of a virtual-GPU launch that names neither a profile nor a GPU model: a policy default
(H100 SXM, 8 per node: the GPU of Megatron-LM's own functional tests and most published large training runs)."""


def default_profile_note(flags: Mapping[str, str]) -> str:
    """The one line a launcher says when `DEFAULT_PROFILE` applies, the settings spelled as `flags` spells them."""
    return (f"prism: {spell(flags, 'device', 'virtual-gpu')} without {spell(flags, 'profile')} or "
            f"{spell(flags, 'gpu')}: running on profile {DEFAULT_PROFILE} (8 H100 SXM per node, its links and "
            f"kernel figures); name another with {spell(flags, 'profile', '<name>')}")


def respell(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each of `prism run`'s flags (`RUN_FLAGS`) written as the entry point of `flags` writes it,
    a value right after the flag kept with it.

    Example: ``respell("e.g. --world-size 8192", {"world_size": "--prism-world-size"}) == "e.g.
    --prism-world-size 8192"``; with ``'"prism.world_size"'``: ``'e.g. "prism.world_size": 8192'``.
    """
    import re

    for field, run_flag in RUN_FLAGS.items():
        if field not in flags or flags[field] == run_flag:
            continue

        def one(match: re.Match[str], field: str = field) -> str:
            value = match.group(1)
            if value is None:
                return spell(flags, field)
            return spell(flags, field, int(value) if value.isdigit() else value)

        message = re.sub(rf"(?<![\w-]){re.escape(run_flag)}(?![\w-])(?: ([\w./:-]*\w))?", one, message)
    return message


_RUN_USAGE = "give the training script's path: -- script.py args, or a module: -m module args"


def check_launch(config: EmulationConfig, target: Sequence[str], flags: Mapping[str, str] = RUN_FLAGS, *,
                 usage: str = _RUN_USAGE) -> None:
    """Every check of this module, in the order a user meets them: program, directories, graph, recording.

    `usage` ends the message of a missing program (how this entry point names its program)."""
    check_program(target, usage=usage)
    check_directories(config, flags)
    check_environment(config.world.real_ranks)
    check_graph(config, flags)
    check_recording(config, flags)


# -- the program ---------------------------------------------------------------------------------------------
def check_program(target: Sequence[str], *, usage: str = _RUN_USAGE) -> None:
    """``[script.py, args...]`` or ``["-m", module, args...]`` names a program that exists.

    Example: ``check_program(["train.py"])`` in a directory without train.py -> ``ConfigError: script
    'train.py' does not exist (in /work); give the training script's path: -- script.py args, or a module:
    -m module args``.
    """
    if not target:
        raise ConfigError("name the program to run: `-- script.py args` or `-m module args`")
    if target[0] == "-m":
        if len(target) < 2 or not target[1]:
            raise ConfigError("-m needs a module name, e.g. -m package.train")
        _check_module(target[1])
        return
    path = Path(target[0])
    if not path.exists():
        raise ConfigError(f"script {target[0]!r} does not exist (in {os.getcwd()}); {usage}")
    if path.is_dir() and not (path / "__main__.py").is_file():
        raise ConfigError(f"script {target[0]!r} is a directory without __main__.py; {usage}")


def _check_module(name: str) -> None:
    where = "the current directory, PYTHONPATH or site-packages"
    found = _find_module(name)
    if found is None:
        raise ConfigError(f"-m {name}: no module named {name!r} in {where}; check the name, or give a script: "
                          "-- script.py args")
    if found and _find_module(f"{name}.__main__") is None:
        raise ConfigError(f"-m {name}: {name!r} is a package without a __main__ module; name the module to run, "
                          f"e.g. -m {name}.train")


def _find_module(name: str) -> bool | None:
    """None: not found; True: a package; False: a module, or not decidable here (the real process will say).

    Found as ``python -m`` finds it, the current directory first, without importing anything: the top-level
    name through the import system's finders, each submodule in its parent's search locations. A package that
    extends its ``__path__`` at import (pkgutil-style) is asked in a throwaway interpreter (`_find_in_child`),
    so no code of the program ever runs in the launcher.
    """
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())  # `python -m` puts the current directory first
    try:
        top, *rest = name.split(".")
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        for part in rest:
            locations = spec.submodule_search_locations if spec is not None else None
            spec = importlib.machinery.PathFinder.find_spec(part, list(locations)) if locations else None
            if spec is None:
                return _find_in_child(name)
    except (ImportError, ValueError):  # ValueError: a module already imported without a spec
        return False
    finally:
        sys.path[:] = saved
    if spec is None:
        return None
    return spec.submodule_search_locations is not None


_FIND_SPEC = """import importlib.util, sys
name = sys.argv[1]
try:
    spec = importlib.util.find_spec(name)
except ModuleNotFoundError as exc:
    sys.exit(3 if exc.name and (name + ".").startswith(exc.name + ".") else 4)
except Exception:
    sys.exit(4)
sys.exit(3 if spec is None else 5 if spec.submodule_search_locations is not None else 6)
"""


def _find_in_child(name: str) -> bool | None:
    """`_find_module`'s answer from ``importlib.util.find_spec`` in a fresh interpreter (it imports the parents)."""
    import subprocess

    try:
        rc = subprocess.run([sys.executable, "-c", _FIND_SPEC, name], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired):
        return False
    return {3: None, 5: True}.get(rc, False)


# -- the paths -----------------------------------------------------------------------------------------------
def check_directory(flag: str, path: str | os.PathLike[str]) -> None:
    """`path` can be a directory prism writes into (created if missing): no file on the way, writable.

    Example: ``check_directory("--output", "notes.txt")`` with notes.txt a file -> ``ConfigError: --output
    notes.txt is a file, not a directory; give a directory (created if missing)``.
    """
    p = Path(path)
    for q in (p, *p.parents):
        if not q.exists():
            continue
        if not q.is_dir():
            what = " is a file" if q == p else f": its parent {str(q)!r} is a file"
            raise ConfigError(f"{flag} {str(p)!r}{what}, not a directory; give a directory (created if missing)")
        if q != p and not os.access(q, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {str(p)!r} cannot be created: no write permission in {str(q)!r}")
        return


OUTPUT_MARKER = ".prism-output"
"""The file a command that owns its output directory (`claim_output`) writes there: the command's name."""


def claim_output(flag: str, path: str | os.PathLike[str], command: str, *, overwrite: bool = False) -> None:
    """Make `path` this run's own output directory: new or empty, or, with `overwrite`, a previous output of the
    same `command` (its `OUTPUT_MARKER`), emptied. A used directory is refused otherwise (a `ConfigError` naming
    `flag` and ``--overwrite``): a re-run into it mixed old and new run folders, unflagged. Then the marker is
    written.
    """
    import shutil

    p = Path(path)
    check_directory(flag, p)
    entries = sorted(q.name for q in p.iterdir()) if p.is_dir() else []
    if entries:
        marker = p / OUTPUT_MARKER
        owner = marker.read_text(encoding="utf-8").strip() if marker.is_file() else None
        if not overwrite:
            raise ConfigError(f"{flag} {str(p)!r} holds a previous run ({len(entries)} entries: "
                              f"{', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}); this run's folders "
                              "would mix with them: give a new directory, or pass --overwrite to replace it")
        if owner != command:
            raise ConfigError(f"--overwrite: {flag} {str(p)!r} is not an output of `{command}` (no {OUTPUT_MARKER} "
                              "naming it); refusing to delete what it holds: give a new directory")
        shutil.rmtree(p)
    p.mkdir(parents=True, exist_ok=True)
    (p / OUTPUT_MARKER).write_text(command + "\n", encoding="utf-8")


def check_file_output(flag: str, path: str | os.PathLike[str]) -> None:
    """`path` can be written as a file: it is not a directory, and its directory exists.

    Example: ``check_file_output("--out", "plans/plan.json")`` without plans/ -> ``ConfigError: --out
    'plans/plan.json': directory 'plans' does not exist; create it or write the file elsewhere``.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a directory; give a file path, e.g. {str(p / 'out.json')!r}")
    parent = p.parent
    if not parent.exists():
        raise ConfigError(f"{flag} {str(p)!r}: directory {str(parent)!r} does not exist; create it or write the "
                          "file elsewhere")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {str(p)!r}: {str(parent)!r} is a file, not a directory")


def check_directories(config: EmulationConfig, flags: Mapping[str, str] = RUN_FLAGS) -> None:
    """The directories the real processes write (summaries, recording, traces) can be created."""
    for name in ("output_dir", "record_dir", "trace_dir"):
        value = getattr(config, name)
        if value is not None:
            check_directory(flags[name], value)


# -- settings given as environment variables ---------------------------------------------------------------------
ENVIRONMENT: Mapping[str, str] = {
    "PRISM_TIMELINE": "a directory for each real rank's Chrome/Perfetto timeline (default <output>/timeline with "
                      "an output directory), or off",
    "PRISM_KINETO": "a directory for each real rank's Kineto trace (virtual time)",
    "PRISM_MEMORY_SNAPSHOT": "a file for each real rank's memory snapshot; {rank} is replaced by the rank",
    "PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES": "trace entries a memory snapshot keeps (default 100000)",
    "PRISM_VIRTUAL_GPU_OOM": "raise (torch's OutOfMemoryError, the default) or report (count it, go on)",
    "PRISM_VIRTUAL_TIME": "on (default) or off", "PRISM_KERNEL_MODEL": "roofline (default), table or fit",
    "PRISM_KERNEL_TABLE": "the table of the table kernel model", "PRISM_KERNEL_FIT": "the fit model's overlay",
    "PRISM_PROGRAM_TIME": "wall (default) or emulated",
    "PRISM_ATTENTION": "local (default) or flash", "PRISM_MOE_ROUTING": "balanced (default) or skew:SEED[,ALPHA]",
}
"""The settings a user may give a launch as environment variables, with what each takes (`check_environment`)."""


def _check_snapshot_template(template: str, real_ranks: Sequence[int]) -> None:
    import re

    name = "PRISM_MEMORY_SNAPSHOT"
    unknown = sorted({m for m in re.findall(r"\{([^{}]*)\}", template) if m != "rank"})
    if unknown:
        raise ConfigError(f"{name}={template!r}: unknown placeholder {{{unknown[0]}}}; the one placeholder is {{rank}}")
    if len(real_ranks) > 1 and "{rank}" not in template:
        raise ConfigError(f"{name}={template!r}: the {len(real_ranks)} real ranks would all write this one file; put "
                          "{rank} in the name, e.g. snapshots/rank{rank}.pickle")
    for rank in real_ranks[:1] or (0,):
        path = Path(template.replace("{rank}", str(rank)))
        if path.is_dir():
            raise ConfigError(f"{name}={template!r} is a directory; name the snapshot file, e.g. "
                              f"{path / 'rank{rank}.pickle'}")
        check_directory(f"{name}={template!r}: the directory", path.parent)


def check_environment(real_ranks: Sequence[int], environ: Mapping[str, str] | None = None) -> None:
    """Every `ENVIRONMENT` setting present in `environ` (default ``os.environ``) is valid for a launch of these real
    ranks (processes that share the environment): a `ConfigError` naming the variable and the fix, before any
    process starts."""
    env = os.environ if environ is None else environ
    for name in ("PRISM_TIMELINE", "PRISM_KINETO"):
        if env.get(name) and not (name == "PRISM_TIMELINE" and env[name] == "off"):
            check_directory(name, env[name])
    if env.get("PRISM_MEMORY_SNAPSHOT"):
        _check_snapshot_template(env["PRISM_MEMORY_SNAPSHOT"], tuple(real_ranks))
    entries = env.get("PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES")
    if entries is not None and (not entries.isdigit() or int(entries) < 1):
        raise ConfigError(f"PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES={entries!r}: give a positive number of trace entries, "
                          "e.g. 100000")
    oom = env.get("PRISM_VIRTUAL_GPU_OOM")
    if oom is not None and oom not in ("raise", "report"):
        raise ConfigError(f"PRISM_VIRTUAL_GPU_OOM={oom!r}: use raise (torch's OutOfMemoryError, the default) or "
                          "report (count the allocation and go on)")
    from prism_plugin.config.program_options import ATTENTION_ENV, ROUTING_ENV, parse_attention, parse_routing
    from prism_plugin.config.virtual_time import TIME_VARIABLES, VirtualTimeOptions

    if any(env.get(name) for name in TIME_VARIABLES):
        options = VirtualTimeOptions.from_env(env)
        if options.kernel_fit is not None:  # a malformed overlay failed in every profiling run
            from prism_plugin.cost.kernel_fit import load_fit

            load_fit(options.kernel_fit)
    if env.get(ATTENTION_ENV):
        parse_attention(env[ATTENTION_ENV])
    if env.get(ROUTING_ENV):
        parse_routing(env[ROUTING_ENV])


# -- the graph and the recording ---------------------------------------------------------------------------------
def check_graph(config: EmulationConfig, flags: Mapping[str, str] = RUN_FLAGS) -> None:
    """The execution graph (if any) loads and describes N ranks; a `GraphError` naming the flag and the file.

    Example: a graph of 4 ranks with --world-size 8 -> ``GraphError: --graph 'job.graph' describes 4 ranks but
    --world-size is 8; load the graph of this job (built from traces of a run at --world-size 8)``.
    """
    if config.graph is None:
        return
    from prism_plugin.graph.schema import ExecutionGraph

    flag, path, n = flags["graph"], config.graph, config.world.world_size
    try:
        graph = ExecutionGraph.load(path)
    except GraphError as exc:  # "graph file <path>: <why>": said once, after the flag
        detail = str(exc).removeprefix(f"graph file {path}: ")
        raise GraphError(f"{flag} {str(path)!r} cannot be read: {detail}") from None
    if graph.layout.world_size != n:
        world_flag = flags["world_size"]
        raise GraphError(f"{flag} {str(path)!r} describes {graph.layout.world_size} ranks but {world_flag} is {n}; "
                         f"load the graph of this job (built from traces of a run at {world_flag} {n})")


def check_recording(config: EmulationConfig, flags: Mapping[str, str] = RUN_FLAGS) -> None:
    """``replay_dir`` (if any) holds a recording of every real rank, in this prism's format, made at N ranks.

    Example: a recording made with --world-size 2, replayed with --world-size 8 -> ``ConfigError: --replay
    rec: rank0.pt was recorded at world size 2 but --world-size is 8; replay a recording of this job ...``.
    """
    if config.replay_dir is None:
        return
    import torch

    from prism_plugin.comm.recording import FORMAT_VERSION

    flag, n, directory = flags["replay_dir"], config.world.world_size, config.replay_dir
    fix = f"replay a recording of this job (made with {flags['record_dir']} DIR at {flags['world_size']} {n})"
    for rank in config.world.real_ranks:
        path = directory / f"rank{rank}.pt"
        if not path.is_file():
            raise ConfigError(f"{flag} {str(directory)!r} has no recording of real rank {rank} ({path.name}); "
                              f"record a run in which rank {rank} is real, or {fix}")
        try:
            data = torch.load(path, mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch's unpickling and zip errors have no common type
            raise ConfigError(f"{flag} {str(directory)!r}: {path.name} is not a prism recording ({exc}); {fix}") \
                from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(f"{flag} {str(directory)!r}: {path.name} has recording format {got!r}, this prism "
                              f"reads format {FORMAT_VERSION}; {fix}")
        if data.get("world_size") != n:
            raise ConfigError(f"{flag} {str(directory)!r}: {path.name} was recorded at world size "
                              f"{data.get('world_size')} but {flags['world_size']} is {n}; {fix}")
