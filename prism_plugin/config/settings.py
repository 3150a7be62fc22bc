"""Every user-facing setting of an emulation, in one table, with one validator (issue 19, part 1).

`SETTINGS` is the table. Each `Setting` has one name, used everywhere: the `prism` command line writes it
``--world-size``, the Megatron drop-in ``--prism-world-size``, the ``"prism"`` section of a DeepSpeed config
``"world_size"``, and the launcher hands the ranks what it resolved (`EmulationConfig` as JSON, and the settings
the rank process reads from its environment as their ``PRISM_*`` variable: `Setting.env`). Each input form is
derived from the table (`Setting.spelled`, `flag_names`, `section_keys`), and every value goes through the
setting's one parser, whatever form it came in.

`prism_plugin.config.resolve.resolve(values, entry)` is the one validator: it takes the settings a launch
gave (by name; a string from a flag or a JSON value from a config), fills the rest from the documented
environment aliases (``PRISM_*``) and the defaults, checks each value and the combinations, and returns a typed,
nested `Settings`: world, device, time, data, outputs, faults, Megatron and DeepSpeed options. Each `ConfigError`
names the setting as the entry point in use spells it and says the fix; it runs in the launcher, before any
process starts.

    >>> by_name("trace_iterations").spelled(Entry.DROP_IN), by_name("trace_iterations").spelled(Entry.DEEPSPEED)
    ('--prism-trace-iterations', '"prism.trace_iterations"')

The generated reference (`prism_plugin.config.reference`, ``docs/configuration.md``) lists every setting in all
its spellings. Pure: no torch, no framework.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from prism_plugin.config.errors import ConfigError, parse_rank_list

__all__ = ["SETTINGS", "Entry", "Group", "Setting", "by_name", "flag_names", "from_environ", "section_keys",
           "setting_for_flag"]


class Entry(StrEnum):
    """The ways a user gives settings."""

    RUN = "prism"
    """The ``prism`` command line (``prism run``, ``prism emulate``, ``prism sweep``): ``--world-size``."""
    DROP_IN = "drop-in"
    """The Megatron drop-in (``prism megatron``, ``python -m prism_plugin.megatron``): ``--prism-world-size``."""
    DEEPSPEED = "deepspeed"
    """The ``"prism"`` section of a DeepSpeed config: ``"world_size"``."""
    ENVIRONMENT = "environment"
    """A documented environment alias (``PRISM_VIRTUAL_TIME=off``); a flag or key given with it wins."""


class Group(StrEnum):
    """The sections of the nested `Settings`, in the reference's order."""

    WORLD = "world"
    DEVICE = "device"
    TIME = "time"
    DATA = "data"
    OUTPUTS = "outputs"
    FAULTS = "faults"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"


Parser = Callable[[object, str], object]
"""A setting's validator: (the value as given, how the entry point spells it) -> the typed value, or a
`ConfigError` naming the spelling and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One setting: its name, what it takes, its default, and how each entry point writes it."""

    name: str
    """The one name (snake case): the DeepSpeed key; the flags write it in kebab case."""
    group: Group
    help: str
    """What it does and what it takes, one sentence (the reference and ``--help``)."""
    parse: Parser
    default: object = None
    """The value when nothing gives it (None: unset; the reference says what unset means)."""
    metavar: str = "VALUE"
    env: str | None = None
    """The variable that carries it to the rank processes, also accepted as its documented alias; None: it travels
    in the launcher's JSON (`EmulationConfig`)."""
    switch: str | None = None
    """A boolean setting given on the command line as this value-less flag (e.g. ``no-timing`` sets False)."""
    repeatable: str | None = None
    """A list given on the command line one item per flag, named so (``--fault`` for ``faults``)."""
    entries: frozenset[Entry] = frozenset({Entry.RUN, Entry.DROP_IN, Entry.DEEPSPEED})
    aliases: tuple[str, ...] = ()
    """Older spellings of the DeepSpeed key still accepted (e.g. ``record_dir`` for ``record``)."""

    def spelled(self, entry: Entry) -> str:
        """How `entry` writes this setting: ``--trace-iterations``, ``--prism-trace-iterations``,
        ``"prism.trace_iterations"`` or ``PRISM_…``."""
        flag = (self.repeatable or self.name).replace("_", "-")
        if entry is Entry.RUN:
            return f"--{flag}"
        if entry is Entry.DROP_IN:
            return f"--prism-{flag}"
        if entry is Entry.DEEPSPEED:
            return f'"prism.{self.name}"'
        return self.env or self.name

    def said(self, entry: Entry, value: object) -> str:
        """The setting given `value`, as `entry` writes it (``--kernel-model tabel``, ``"prism.x": "tabel"``)."""
        name = self.spelled(entry)
        if entry is Entry.ENVIRONMENT:
            return f"{name}={str(value)!r}"
        if entry is Entry.DEEPSPEED:
            return f"{name}: {value!r}" if not isinstance(value, str) else f'{name}: "{value}"'
        return f"{name} {value}"


# -- parsers -----------------------------------------------------------------------------------------------------
def _int_at_least(minimum: int, example: int) -> Parser:
    def parse(value: object, said: str) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{said}: give an integer >= {minimum}, e.g. {example}")
        return value
    return parse


def _number(value: object) -> float:
    """`value` as a float (a number, or a string of one); NaN when it is neither."""
    try:
        return float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else math.nan
    except ValueError:
        return math.nan


def _seconds(value: object, said: str) -> float:
    seconds = _number(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{said}: give a positive number of seconds, e.g. 600")
    return seconds


def _fraction(value: object, said: str) -> float:
    number = _number(value)
    if not 0.0 <= number <= 1.0:
        raise ConfigError(f"{said}: give a fraction in [0, 1]")
    return number


def _choice(*choices: str) -> Parser:
    def parse(value: object, said: str) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else value
        if text not in choices:
            raise ConfigError(f"{said}: use one of {', '.join(choices)}")
        return str(text)
    return parse


def _on_off(value: object, said: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise ConfigError(f"{said}: use on or off (true or false)")


def _text(value: object, said: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{said}: give a non-empty string")
    return value.strip()


def _path(value: object, said: str) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{said}: give a path (a string)")
    return Path(value)


def _ranks(value: object, said: str) -> tuple[int, ...]:
    if isinstance(value, str):
        return parse_rank_list(value, field_name=said)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        return tuple(value)
    raise ConfigError(f'{said}: give a list of ranks, e.g. [0, 5], or a string like "0,5,8-11"')


def _faults(value: object, said: str) -> tuple[str, ...]:
    items = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(f, str) for f in items):
        raise ConfigError(f'{said}: give fault specs, e.g. ["straggler:ranks=4-7,factor=1.3"]')
    return tuple(f.strip() for f in items if f.strip())


def _routing(value: object, said: str) -> str:
    from prism_plugin.config.program_options import parse_routing

    try:
        return parse_routing(_text(value, said)).name
    except ConfigError as exc:
        raise ConfigError(f"{said}: {str(exc).partition(': ')[2]}") from None


def _snapshot_template(value: object, said: str) -> str:
    import re

    template = _text(value, said)
    unknown = sorted({m for m in re.findall(r"\{([^{}]*)\}", template) if m != "rank"})
    if unknown:
        raise ConfigError(f"{said}: unknown placeholder {{{unknown[0]}}}; the one placeholder is {{rank}}")
    return template


def _timeline(value: object, said: str) -> str:
    text = _text(value, said)
    return "off" if text.lower() == "off" else text


def _mapping(value: object, said: str) -> object:
    if not isinstance(value, Mapping | list):
        raise ConfigError(f"{said}: give a JSON object (see the DeepSpeed page of the documentation)")
    return value


_CLI = frozenset({Entry.RUN, Entry.DROP_IN, Entry.DEEPSPEED})
_DS_ONLY = frozenset({Entry.DEEPSPEED})

SETTINGS: tuple[Setting, ...] = (
    # world
    Setting(name="world_size", group=Group.WORLD, parse=_int_at_least(1, 8192), metavar="N",
            help="N, the job's total number of ranks (required)."),
    Setting(name="real_ranks", group=Group.WORLD, parse=_ranks, metavar="RANKS",
            help="The virtual ranks real processes play, in process order, e.g. 0,5 or 0-3 (required)."),
    Setting(name="gpus_per_node", group=Group.WORLD, parse=_int_at_least(1, 8), default=8, metavar="G",
            help="Ranks per node of the target cluster (group placement for the cost model)."),
    # device
    Setting(name="device", group=Group.DEVICE, parse=_choice("real", "virtual-gpu"), default="real",
            metavar="real|virtual-gpu",
            help="real: tensors on this host's devices; virtual-gpu: fake CUDA tensors on virtual GPUs (exact memory, "
                 "modelled time)."),
    Setting(name="profile", group=Group.DEVICE, parse=_text, metavar="NAME|YAML",
            help="Hardware profile name (`prism profiles`) or a profile YAML; unset: local-cpu-gloo, or dgx-h100 on "
                 "virtual GPUs without --gpu (a policy default, said and reported)."),
    Setting(name="gpu", group=Group.DEVICE, parse=_text, metavar="MODEL",
            help="GPU model of the virtual GPUs, e.g. h100-sxm or b200; unset: the profile's."),
    Setting(name="oom", group=Group.DEVICE, parse=_choice("raise", "report"), default="raise",
            env="PRISM_VIRTUAL_GPU_OOM", metavar="raise|report",
            help="A virtual GPU out of memory: raise torch's OutOfMemoryError, or report (count it and go on)."),
    Setting(name="te", group=Group.DEVICE, parse=_on_off, default=True, env="PRISM_TE", metavar="on|off",
            help="off: emulate a GPU host without TransformerEngine (Megatron takes its non-TE paths)."),
    # time
    Setting(name="timing", group=Group.TIME, parse=_on_off, default=True, switch="no-timing", metavar="on|off",
            help="Hold each op until its emulated completion time (real devices); off (--no-timing): complete ops when "
                 "their data is ready."),
    Setting(name="timeout", group=Group.TIME, parse=_seconds, metavar="SECONDS",
            help="Collective timeout of the job's groups, seconds; unset: the job's own (Megatron's "
                 "--distributed-timeout-minutes, default 10 min; torch's 30 min otherwise)."),
    Setting(name="virtual_time", group=Group.TIME, parse=_choice("on", "off"), default="on",
            env="PRISM_VIRTUAL_TIME", metavar="on|off",
            help="Virtual GPUs: modelled kernel and communication time on emulated streams (on), or memory only "
                 "(off)."),
    Setting(name="fast_forward", group=Group.TIME, parse=_on_off, default=True, env="PRISM_FAST_FORWARD",
            metavar="on|off",
            help="Virtual GPUs: advance the proven steady-state periods of a Megatron schedule or DeepSpeed's pipeline "
                 "engine without running them again (memory and emulated time stay those of running them; "
                 "docs/fast-forward.md); off: run every one. DeepSpeed's ZeRO engines without a pipeline run every "
                 "micro-batch either way."),
    Setting(name="kernel_model", group=Group.TIME, parse=_choice("roofline", "table", "fit"), default="roofline",
            env="PRISM_KERNEL_MODEL", metavar="roofline|table|fit",
            help="How a kernel's time is modelled: the GPU's roofline, a recorded table (--kernel-table) or a fitted "
                 "overlay (--kernel-fit)."),
    Setting(name="kernel_table", group=Group.TIME, parse=_path, env="PRISM_KERNEL_TABLE", metavar="FILE",
            help="The table kernel model's table (`prism kernels record`)."),
    Setting(name="kernel_fit", group=Group.TIME, parse=_path, env="PRISM_KERNEL_FIT", metavar="FILE",
            help="The fit kernel model's overlay (`prism kernels fit`)."),
    Setting(name="program_time", group=Group.TIME, parse=_choice("wall", "emulated"), default="wall",
            env="PRISM_PROGRAM_TIME", metavar="wall|emulated",
            help="What the program's time.time/perf_counter read: the host's clock, or the emulated clock (its logs "
                 "print emulated figures). Megatron's timers read the emulated clock on virtual GPUs either way."),
    Setting(name="iteration_marker", group=Group.TIME, parse=_choice("auto", "explicit", "optimizer-step"),
            default="auto", metavar="auto|explicit|optimizer-step",
            help="What ends an iteration: prism_plugin.mark_iteration() calls, optimizer steps, or auto (both)."),
    Setting(name="graph", group=Group.TIME, parse=_path, metavar="FILE",
            help="Hybrid emulation: an execution graph (`prism graph build`) whose replay gives virtual arrivals."),
    Setting(name="graph_max_outside", group=Group.TIME, parse=_fraction, default=0.1, env="PRISM_GRAPH_MAX_OUTSIDE",
            metavar="FRACTION",
            help="Hybrid emulation: the fraction of ops after the first iteration mark that may be outside the graph "
                 "before the run is refused (1: never)."),
    # data
    Setting(name="data_policy", group=Group.DATA, parse=_choice("mirror", "recorded", "zeros"), metavar="POLICY",
            help="What virtual participants contribute: mirror, recorded (with --replay) or zeros; unset: recorded "
                 "with --replay, mirror otherwise."),
    Setting(name="record", group=Group.DATA, parse=_path, metavar="DIR", aliases=("record_dir",),
            help="A recording run: write every payload this rank receives into DIR."),
    Setting(name="replay", group=Group.DATA, parse=_path, metavar="DIR", aliases=("replay_dir",),
            help="A recording run's DIR to replay (data policy recorded)."),
    # outputs
    Setting(name="output", group=Group.OUTPUTS, parse=_path, metavar="DIR", aliases=("output_dir",),
            help="Where each real rank writes its summary, timeline and metrics; unset: nothing written."),
    Setting(name="trace", group=Group.OUTPUTS, parse=_path, metavar="DIR", aliases=("trace_dir",),
            help="Write each real rank's per-iteration trace (the input of `prism graph build`) into DIR."),
    Setting(name="trace_iterations", group=Group.OUTPUTS, parse=_int_at_least(1, 64), default=64, metavar="K",
            aliases=("trace_max_iterations",), help="Iterations traced from the first mark (bounds memory)."),
    Setting(name="timeline", group=Group.OUTPUTS, parse=_timeline, env="PRISM_TIMELINE", metavar="DIR|off",
            help="Each real rank's Chrome/Perfetto timeline; unset: <output>/timeline when there is an output."),
    Setting(name="kineto", group=Group.OUTPUTS, parse=_text, env="PRISM_KINETO", metavar="DIR",
            help="Each real rank's Kineto trace in virtual time (torch.profiler / HTA)."),
    Setting(name="memory_snapshot", group=Group.OUTPUTS, parse=_snapshot_template, env="PRISM_MEMORY_SNAPSHOT",
            metavar="FILE",
            help="Each real rank's memory snapshot (memory_viz format); {rank} in the name is replaced by the rank."),
    Setting(name="memory_snapshot_max_entries", group=Group.OUTPUTS, parse=_int_at_least(1, 100000), default=100000,
            env="PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES", metavar="K", help="Trace entries a memory snapshot keeps."),
    # faults
    Setting(name="faults", group=Group.FAULTS, parse=_faults, default=(), repeatable="fault", metavar="SPEC",
            help="Faults and what-ifs on virtual participants, e.g. straggler:ranks=4-7,factor=1.3 (the Faults page); "
                 "the command line takes one per --fault."),
    # Megatron
    Setting(name="attention", group=Group.MEGATRON, parse=_choice("local", "flash"), default="local",
            env="PRISM_ATTENTION", metavar="local|flash",
            help="Virtual GPUs: Megatron's local attention as written, or computed as fused flash attention."),
    Setting(name="moe_routing", group=Group.MEGATRON, parse=_routing, default="balanced", env="PRISM_MOE_ROUTING",
            metavar="balanced|skew:SEED[,ALPHA]",
            help="Virtual GPUs: the tokens each expert receives (MoE routing holds no values)."),
    Setting(name="iterations", group=Group.MEGATRON, parse=_int_at_least(1, 3), metavar="K",
            entries=frozenset({Entry.DROP_IN}),
            help="Train the job's first K iterations, then stop as Megatron does at --train-iters (its dataset sized "
                 "for K, its learning-rate schedule kept); unset: the job's whole length."),
    Setting(name="stop_at_iteration", group=Group.MEGATRON, parse=_int_at_least(2, 3), metavar="K",
            entries=frozenset({Entry.DROP_IN}),
            help="End the run where iteration K starts (its iteration mark, before any of its work): iterations "
                 "1..K-1 complete, nothing after them runs (Megatron's final evaluation and checkpoint save among "
                 "them); prism emulate's profiling runs end so. Unset: the run ends as the job does."),
    # DeepSpeed
    Setting(name="topology", group=Group.DEEPSPEED, parse=_mapping, entries=_DS_ONLY, metavar="{pipe,data,model}",
            help="Declared pipe/data/model sizes, checked against world_size."),
    Setting(name="pipe_activations", group=Group.DEEPSPEED, parse=_mapping, entries=_DS_ONLY,
            metavar='{"shape": [...], "dtype": ...}',
            help="What a pipeline stage receives from a virtual previous stage (mirror policy)."),
)
"""Every setting, in the reference's order."""

_BY_NAME = {s.name: s for s in SETTINGS}


def by_name(name: str) -> Setting:
    """The setting called `name` (a `KeyError` for a name the table lacks: a programming error)."""
    return _BY_NAME[name]


def flag_names(entry: Entry) -> dict[str, Setting]:
    """The command-line flags of `entry` (without ``--``), each to its setting: value flags, switches
    (``prism-no-timing``) and the singular of repeatable ones (``prism-fault``)."""
    prefix = "prism-" if entry is Entry.DROP_IN else ""
    flags = {}
    for s in SETTINGS:
        if entry in s.entries:
            flags[s.spelled(entry).lstrip("-")] = s
            if s.switch:
                flags[prefix + s.switch] = s
    return flags


def setting_for_flag(entry: Entry, flag: str) -> Setting | None:
    """The setting a command-line flag (without ``--``) gives, or None."""
    return flag_names(entry).get(flag)


def section_keys() -> dict[str, Setting]:
    """The keys of DeepSpeed's ``"prism"`` section, each to its setting (older spellings included)."""
    keys = {}
    for s in SETTINGS:
        if Entry.DEEPSPEED in s.entries:
            keys[s.name] = s
            keys.update(dict.fromkeys(s.aliases, s))
    return keys


def from_environ(name: str, environ: Mapping[str, str] | None = None) -> object:
    """Setting `name` as a rank process reads it: its variable in `environ` (default ``os.environ``; the launcher
    put it there, or the user as its alias), parsed by the setting's parser, else its default."""
    s = _BY_NAME[name]
    assert s.env is not None, f"{name} does not travel as an environment variable"
    text = (os.environ if environ is None else environ).get(s.env, "")
    return s.parse(text, s.said(Entry.ENVIRONMENT, text)) if text.strip() else s.default
