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
from prism_plugin.config.respell import DEFAULT_PROFILE, RUN_FLAGS, default_profile_note, respell, spell
from prism_plugin.config.settings import SETTINGS, Entry
from prism_plugin.graph.errors import GraphError

__all__ = ["DEFAULT_PROFILE", "ENVIRONMENT", "OUTPUT_MARKER", "RUN_FLAGS", "check_directories",
           "check_directory", "check_environment", "check_file_output", "check_graph", "check_launch", "check_program",
           "check_recording", "claim_output", "default_profile_note", "respell", "spell"]

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

    Example: ``check_file_output("--output", "plans/plan.json")`` without plans/ -> ``ConfigError: --output
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
ENVIRONMENT: Mapping[str, str] = {s.env: s.help for s in SETTINGS if s.env}
"""The settings a user may give a launch as environment variables (their documented aliases), with what each takes
(`check_environment`; the table is `prism_plugin.config.settings`)."""


def check_environment(real_ranks: Sequence[int], environ: Mapping[str, str] | None = None) -> None:
    """Every `ENVIRONMENT` setting present in `environ` (default ``os.environ``) is valid for a launch of these real
    ranks (processes that share the environment): each value by its setting's parser, their combinations, and the
    files they name, and NCCL's ``NCCL_ALGO`` / ``NCCL_NVLS_ENABLE`` as the cost model honours them; a `ConfigError`
    naming the variable and the fix, before any process starts."""
    from prism_plugin.config.resolve import resolve

    env = os.environ if environ is None else environ
    ranks = tuple(real_ranks) or (0,)
    settings = resolve({"world_size": max(ranks) + 1, "real_ranks": list(ranks), "gpus_per_node": 1}, Entry.ENVIRONMENT,
                       environ=env)
    outputs = settings.outputs
    for name, value in (("PRISM_TIMELINE", outputs.timeline), ("PRISM_KINETO", outputs.kineto)):
        if value is not None and value != "off":
            check_directory(name, value)
    if outputs.memory_snapshot is not None:
        template = outputs.memory_snapshot
        path = Path(template.replace("{rank}", str(ranks[0])))
        if path.is_dir():
            raise ConfigError(f"PRISM_MEMORY_SNAPSHOT={template!r} is a directory; name the snapshot file, e.g. "
                              f"{path / 'rank{rank}.pickle'}")
        check_directory(f"PRISM_MEMORY_SNAPSHOT={template!r}: the directory", path.parent)
    from prism_plugin.config.kinds import OpKind
    from prism_plugin.config.nccl import nccl_from_environ
    from prism_plugin.cost.model import allowed_algorithms

    nccl = nccl_from_environ(env)  # NCCL_ALGO's syntax, and an algorithm left for every collective
    for kind in OpKind:
        allowed_algorithms(kind, nccl)
    if settings.time.kernel_fit is not None:  # a malformed overlay would fail in every profiling run
        from prism_plugin.cost.kernel_fit import load_fit

        load_fit(settings.time.kernel_fit)


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
