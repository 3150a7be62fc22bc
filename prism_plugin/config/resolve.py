"""The one validator of the settings table: `resolve` turns what a launch gave into a typed, nested `Settings`.

Every entry point calls it in its launcher, before any process starts: ``prism run`` with its flags, the Megatron
drop-in with its ``--prism-*`` flags, the DeepSpeed ``"prism"`` section with its keys. The settings it leaves
unset come from their documented environment aliases (`Setting.env`), then from the table's defaults. The rank
processes receive the result: `Settings.emulation` (the launcher's JSON) and `Settings.environ` (the variables
the rank process reads).

    >>> s = resolve({"world_size": "8192", "real_ranks": "0,8191", "device": "virtual-gpu"}, Entry.DROP_IN,
    ...             environ={})
    >>> s.world.world_size, s.device.profile, s.outputs.trace_iterations, s.policy_defaults[0]["setting"]
    (8192, 'dgx-h100', 64, '--prism-profile')
    >>> resolve({"world_size": 8, "real_ranks": [0], "kernel_model": "tabel"}, Entry.DEEPSPEED, environ={})
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: "prism.kernel_model": "tabel": use one of roofline, table, fit
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.faults import parse_faults
from prism_plugin.config.kinds import DataPolicy, DeviceMode, IterationMarker
from prism_plugin.config.respell import DEFAULT_PROFILE, respell
from prism_plugin.config.settings import SETTINGS, Entry, by_name

__all__ = ["DEFAULT_PROFILE", "CONFIG_FIELDS", "DataSettings", "DeepSpeedSettings", "DeviceSettings",
           "MegatronSettings", "OutputSettings", "Settings", "TimeSettings", "resolve", "spellings"]


CONFIG_FIELDS: Mapping[str, str] = {
    "world_size": "world_size", "real_ranks": "real_ranks", "gpus_per_node": "gpus_per_node", "device": "device",
    "profile": "profile", "gpu": "gpu", "timing": "timing", "timeout": "timeout_s",
    "iteration_marker": "iteration_marker", "graph": "graph", "data_policy": "data_policy", "record": "record_dir",
    "replay": "replay_dir", "output": "output_dir", "trace": "trace_dir", "trace_iterations": "trace_max_iterations",
    "faults": "faults",
}
"""Each setting the launcher's JSON carries, to its `EmulationConfig` (or `VirtualWorld`) field."""

_NEED_VIRTUAL_GPU = ("virtual_time", "fast_forward", "kernel_model", "kernel_table", "kernel_fit", "program_time",
                     "oom")


def spellings(entry: Entry) -> dict[str, str]:
    """Each `EmulationConfig` field as `entry` spells its setting (what `respell` and the preflight checks take)."""
    return {config_field: by_name(name).spelled(entry) for name, config_field in CONFIG_FIELDS.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSettings:
    device: DeviceMode
    profile: str
    gpu: str | None
    oom: str
    te: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeSettings:
    timing: bool
    timeout: float | None
    virtual_time: bool
    kernel_model: str
    kernel_table: Path | None
    kernel_fit: Path | None
    program_time: str
    iteration_marker: IterationMarker
    graph: Path | None
    graph_max_outside: float
    fast_forward: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSettings:
    data_policy: DataPolicy
    record: Path | None
    replay: Path | None


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputSettings:
    output: Path | None
    trace: Path | None
    trace_iterations: int
    timeline: str | None
    kineto: str | None
    memory_snapshot: str | None
    memory_snapshot_max_entries: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSettings:
    attention: str
    moe_routing: str
    iterations: int | None = None
    stop_at_iteration: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedSettings:
    topology: object | None
    pipe_activations: object | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """A launch's settings, resolved and checked: what the launcher hands the ranks."""

    entry: Entry
    world: VirtualWorld
    device: DeviceSettings
    time: TimeSettings
    data: DataSettings
    outputs: OutputSettings
    faults: tuple[str, ...]
    megatron: MegatronSettings
    deepspeed: DeepSpeedSettings
    given: frozenset[str] = frozenset()
    """The settings the launch gave (flags or keys)."""
    from_environment: frozenset[str] = frozenset()
    """The settings taken from their environment alias."""
    policy_defaults: tuple[dict[str, str], ...] = field(default=())
    """Settings left to a policy default (``setting``, ``value``, ``reason``), reported in the summary."""

    def value(self, name: str) -> object:
        """The resolved value of setting `name`."""
        return getattr(getattr(self, by_name(name).group.value), name)

    def emulation(self, *, timeout_s: float = 1800.0) -> EmulationConfig:
        """The `EmulationConfig` of these settings (the launcher's JSON to the ranks); `timeout_s` when the
        launch left the timeout to the job (`TimeSettings.timeout` None)."""
        try:
            return EmulationConfig(
                world=self.world, profile=self.device.profile, gpu=self.device.gpu, device=self.device.device,
                data_policy=self.data.data_policy, record_dir=self.data.record, replay_dir=self.data.replay,
                timing=self.time.timing, timeout_s=self.time.timeout if self.time.timeout is not None else timeout_s,
                output_dir=self.outputs.output, trace_dir=self.outputs.trace,
                trace_max_iterations=self.outputs.trace_iterations, graph=self.time.graph,
                iteration_marker=self.time.iteration_marker, faults=parse_faults(self.faults))
        except ConfigError as exc:
            raise ConfigError(respell(str(exc), spellings(self.entry))) from None

    def environ(self) -> dict[str, str]:
        """The variables the rank processes read, for every setting that travels as one and that the launch gave
        (or took from the environment): the launcher puts them in the ranks' environment."""
        env = {}
        for s in SETTINGS:
            if s.env and (s.name in self.given or s.name in self.from_environment):
                value = self.value(s.name)
                env[s.env] = ("on" if value else "off") if isinstance(value, bool) else str(value)
        return env


def resolve(values: Mapping[str, object], entry: Entry, *, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings `values` (by setting name: strings from flags, JSON values from a config) give at `entry`, the
    rest from their environment aliases in `environ` (default ``os.environ``) and the defaults, each checked by its
    setting's parser and the combinations checked together: a `ConfigError` naming the setting as `entry` spells
    it and the fix."""
    env = os.environ if environ is None else environ
    unknown = sorted(set(values) - {s.name for s in SETTINGS})
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}")
    parsed: dict[str, object] = {}
    given, from_env = set(), set()
    for s in SETTINGS:
        raw = values.get(s.name)
        if raw is not None and (entry in s.entries or entry is Entry.ENVIRONMENT):
            parsed[s.name] = s.parse(raw, s.said(entry, raw))
            given.add(s.name)
        elif s.env and env.get(s.env, "").strip():
            parsed[s.name] = s.parse(env[s.env], s.said(Entry.ENVIRONMENT, env[s.env]))
            from_env.add(s.name)
        else:
            parsed[s.name] = s.default
    for required in ("world_size", "real_ranks"):
        if required not in given:
            example = {"world_size": 8192, "real_ranks": "0,8191"}[required]
            raise ConfigError(f"{by_name(required).spelled(entry)} is required, e.g. "
                              f"{by_name(required).said(entry, example)}")
    world = _world(parsed, entry)
    _check_together(parsed, given, from_env, entry, world)
    device = DeviceMode(str(parsed["device"]))
    policy_defaults: tuple[dict[str, str], ...] = ()
    profile = parsed["profile"]
    if profile is None:
        profile = "local-cpu-gloo"
        if device is DeviceMode.VIRTUAL_GPU and parsed["gpu"] is None:
            profile = DEFAULT_PROFILE
            policy_defaults = ({"setting": by_name("profile").spelled(entry), "value": DEFAULT_PROFILE,
                                "reason": f"{by_name('device').said(entry, 'virtual-gpu')} without "
                                          f"{by_name('profile').spelled(entry)} or {by_name('gpu').spelled(entry)}"},)
    policy = parsed["data_policy"] or ("recorded" if parsed["replay"] is not None else "mirror")
    return Settings(
        entry=entry, world=world,
        device=DeviceSettings(device=device, profile=str(profile), gpu=_opt(parsed["gpu"]), oom=str(parsed["oom"]),
                              te=bool(parsed["te"])),
        time=TimeSettings(timing=bool(parsed["timing"]), timeout=_opt_float(parsed["timeout"]),
                          virtual_time=parsed["virtual_time"] == "on", kernel_model=str(parsed["kernel_model"]),
                          kernel_table=_opt_path(parsed["kernel_table"]), kernel_fit=_opt_path(parsed["kernel_fit"]),
                          program_time=str(parsed["program_time"]),
                          iteration_marker=IterationMarker(str(parsed["iteration_marker"])),
                          graph=_opt_path(parsed["graph"]), graph_max_outside=_float(parsed["graph_max_outside"]),
                          fast_forward=bool(parsed["fast_forward"])),
        data=DataSettings(data_policy=DataPolicy(str(policy)), record=_opt_path(parsed["record"]),
                          replay=_opt_path(parsed["replay"])),
        outputs=OutputSettings(output=_opt_path(parsed["output"]), trace=_opt_path(parsed["trace"]),
                               trace_iterations=_int(parsed["trace_iterations"]), timeline=_opt(parsed["timeline"]),
                               kineto=_opt(parsed["kineto"]), memory_snapshot=_opt(parsed["memory_snapshot"]),
                               memory_snapshot_max_entries=_int(parsed["memory_snapshot_max_entries"])),
        faults=tuple(parsed["faults"]),  # type: ignore[arg-type]
        megatron=MegatronSettings(attention=str(parsed["attention"]), moe_routing=str(parsed["moe_routing"]),
                                  iterations=None if parsed.get("iterations") is None else _int(parsed["iterations"]),
                                  stop_at_iteration=(None if parsed.get("stop_at_iteration") is None
                                                     else _int(parsed["stop_at_iteration"]))),
        deepspeed=DeepSpeedSettings(topology=parsed["topology"], pipe_activations=parsed["pipe_activations"]),
        given=frozenset(given), from_environment=frozenset(from_env), policy_defaults=policy_defaults)


def _world(parsed: Mapping[str, object], entry: Entry) -> VirtualWorld:
    try:
        return VirtualWorld(world_size=parsed["world_size"], real_ranks=parsed["real_ranks"],  # type: ignore[arg-type]
                            gpus_per_node=parsed["gpus_per_node"])  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(respell(str(exc), spellings(entry))) from None


def _check_together(parsed: Mapping[str, object], given: set[str], from_env: set[str], entry: Entry,
                    world: VirtualWorld) -> None:
    """The combinations no single parser sees."""
    def said(name: str, value: object | None = None) -> str:
        where = Entry.ENVIRONMENT if name in from_env else entry
        s = by_name(name)
        return s.spelled(where) if value is None else s.said(where, value)

    if parsed["device"] != "virtual-gpu":
        for name in (*_NEED_VIRTUAL_GPU, "gpu"):
            if name in given:
                raise ConfigError(f"{said(name, parsed[name])} is a setting of virtual GPUs: add "
                                  f"{by_name('device').said(entry, 'virtual-gpu')} or drop it")
    model = parsed["kernel_model"]
    for name, wanted, source in (("kernel_table", "table", "`prism kernels record`"),
                                 ("kernel_fit", "fit", "`prism kernels fit`")):
        path = parsed[name]
        if path is not None and model != wanted:
            raise ConfigError(f"{said(name, path)} is read by the {wanted} kernel model, not by "
                              f"{said('kernel_model', model)}: add {said('kernel_model', wanted)} or drop {said(name)}")
        if path is None and model == wanted:
            raise ConfigError(f"{said('kernel_model', wanted)} needs {said(name, '<file>')} (a file from {source})")
        if path is not None and not Path(str(path)).is_file():
            raise ConfigError(f"{said(name, path)} is not a file; write one with {source}")
    if parsed["virtual_time"] == "off":
        timed = [said(n, parsed[n]) for n in ("kernel_model", "kernel_table", "kernel_fit")
                 if n in given or n in from_env]
        timed += [said("program_time", "emulated")] if parsed["program_time"] == "emulated" else []
        if timed:
            raise ConfigError(f"{said('virtual_time', 'off')} keeps no time, so {' and '.join(timed)} would do "
                              f"nothing: drop {said('virtual_time', 'off')} or the time settings")
    template = parsed["memory_snapshot"]
    if template is not None and world.num_real > 1 and "{rank}" not in str(template):
        raise ConfigError(f"{said('memory_snapshot', template)}: the {world.num_real} real ranks would all write this "
                          "one file; put {rank} in the name, e.g. snapshots/rank{rank}.pickle")
    if parsed["replay"] is None and parsed["data_policy"] == "recorded":
        raise ConfigError(f"{said('data_policy', 'recorded')} needs {said('replay', 'DIR')}: the directory a "
                          f"recording run wrote (run it with {said('record', 'DIR')} first)")


def _opt(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_path(value: object) -> Path | None:
    return None if value is None else Path(str(value))


def _opt_float(value: object) -> float | None:
    return None if value is None else _float(value)


def _float(value: object) -> float:
    assert isinstance(value, int | float), value  # the setting's parser made it a number
    return float(value)


def _int(value: object) -> int:
    assert isinstance(value, int), value  # the setting's parser made it an integer
    return value

