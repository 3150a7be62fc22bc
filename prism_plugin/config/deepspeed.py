"""The ``"prism"`` section of a DeepSpeed config: parsed and validated before any process group exists.

A DeepSpeed config (a dict, or a path to a JSON/HJSON file) turns emulation on with a top-level section::

    "prism": {
        "world_size": 8192,              # N, the job's rank count (required)
        "real_ranks": [0, 8191],         # or "0,8191" / "0-3": virtual ranks run by processes 0, 1 (required)
        "profile": "dgx-h100",           # hardware profile name or YAML path (default local-cpu-gloo; dgx-h100
                                         # for "device": "virtual-gpu" without "gpu": a policy default)
        "graph": null,                   # execution graph (`prism graph build`): hybrid emulation, see below
        "trace": null,                   # DIR: write each real rank's per-iteration trace (rank<R>.trace.json)
        "trace_iterations": 64,          # iterations traced
        "iteration_marker": "auto",      # auto | explicit | optimizer-step: what ends an iteration
        "output": "prism_output",        # where each real rank writes rank<R>.summary.json (default: none)
        "gpus_per_node": 8,              # node layout of the target cluster (default 8)
        "data_policy": "mirror",         # mirror | recorded | zeros (default mirror)
        "record": null,                  # recording run: write every payload received here ("record_dir" too)
        "replay": null,                  # data_policy "recorded": a recording run's record ("replay_dir" too)
        "timing": true,                  # hold each op until its emulated completion time
        "faults": ["straggler:ranks=4-7,factor=1.3"],   # faults and what-ifs (prism_plugin.config.faults), optional
        "topology": {"pipe": 4, "data": 2048, "model": 1},   # optional: checked against world_size
        "pipe_activations": {"shape": [2, 64], "dtype": "float32"},  # optional, see below
        "device": "real",                # real | virtual-gpu: fake cuda tensors on virtual GPUs (`virtual_gpu`)
        "gpu": null                      # virtual-gpu: the GPU model (default: the profile's), e.g. "h100-sxm"
    }

plus every other setting of the table (`prism_plugin.config.settings`; ``docs/configuration.md`` lists them all),
e.g. ``"virtual_time": "off"``, ``"kernel_model": "table"``, ``"timeline": "off"``, ``"memory_snapshot":
"snap/rank{rank}.pickle"``: one key per setting, checked by the same validator as every entry point's.

Checks (each a `ConfigError` naming the key and the fix): unknown keys; missing world_size/real_ranks;
ranks out of range or repeated; a path key (`output`, `record_dir`, `replay_dir`, `trace`, `graph`) that is
not a string; `topology` whose product is not world_size; DeepSpeed's batch arithmetic (``train_batch_size =
train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp``, the missing sizes derived as DeepSpeed
derives them) against the emulated world: with `topology`, dp = world_size / (pipe * model) exactly, without
it some dp dividing world_size; an `output` / `record_dir` / `trace` that is (or lies under) a file; a graph
of another world size; a `replay_dir` recorded at another world size or lacking a real rank's recording
(`prism_plugin.launch.preflight`, the checks `prism run` makes in its launcher).

`pipe_activations` describes what a pipeline stage receives from a *virtual* previous stage in its
tensor-meta handshake under the mirror policy (a dict: one tensor; a list of dicts: a tuple of
tensors). DeepSpeed allocates its receive buffers from that handshake, so a real middle or last
stage whose previous stage is virtual needs it, or the recorded policy (which replays the
handshake). Without either, such a stage is refused with an error naming this key.

This module reads and checks the section alone (`read_section`: keys, values, topology, batch arithmetic);
`prism_plugin.adapters.deepspeed.section.parse_section` adds the launcher checks of paths, environment, graph
and recording. No torch, no DeepSpeed import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_plugin.config.emulation import ConfigError, EmulationConfig
from prism_plugin.config.resolve import resolve, spellings
from prism_plugin.config.settings import Entry, section_keys

__all__ = ["PrismSection", "TensorSpec", "load_ds_config", "read_section", "SECTION_KEY", "ALLOWED_KEYS",
           "KEY_NAMES"]

SECTION_KEY = "prism"
ALLOWED_KEYS: tuple[str, ...] = tuple(section_keys())
"""Every key of the section (`prism_plugin.config.settings`: one per setting, older spellings kept)."""
_TOPOLOGY_AXES = ("pipe", "data", "model")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """Shape and dtype name of one tensor a pipeline stage receives (``dtype`` as in ``torch.<dtype>``)."""

    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True, kw_only=True, slots=True)
class PrismSection:
    """The validated ``"prism"`` section plus the DeepSpeed config it came from."""

    emulation: EmulationConfig
    """What `prism_plugin.activate` receives."""
    topology: dict[str, int] | None = None
    """Declared pipe/data/model sizes (their product is world_size), or None."""
    pipe_activations: tuple[TensorSpec, ...] | TensorSpec | None = None
    """What a stage receives from a virtual previous stage (mirror policy), see the module doc."""
    graph: Path | None = None
    ds_config: Mapping[str, Any] | None = None
    """The whole DeepSpeed config (without modification)."""
    policy_defaults: tuple[dict[str, str], ...] = ()
    """Keys the section left to a policy default (``setting``, ``value``, ``reason``): the profile of a virtual GPU
    named by neither ``"profile"`` nor ``"gpu"`` (`preflight.DEFAULT_PROFILE`)."""
    environ: Mapping[str, str] = field(default_factory=dict)
    """The variables the rank process reads for the settings the section gave (`Settings.environ`)."""

    @property
    def world_size(self) -> int:
        return self.emulation.world.world_size

    @property
    def real_ranks(self) -> tuple[int, ...]:
        return self.emulation.world.real_ranks


def load_ds_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The DeepSpeed config as a dict: a mapping as given, or a JSON (HJSON when installed) file."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise ConfigError(f"config must be a ds_config dict or a path to one, got {type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config file {str(path)!r} does not exist; pass the ds_config dict or its path")
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            import hjson  # type: ignore[import-untyped]  # DeepSpeed's own config reader accepts HJSON
        except ImportError:
            raise ConfigError(f"{path}: not valid JSON") from None
        try:
            return dict(hjson.loads(text))
        except Exception as exc:  # hjson's own error types
            raise ConfigError(f"{path}: not valid JSON/HJSON ({exc})") from None


def _tensor_spec(value: Any, where: str) -> TensorSpec:
    if not isinstance(value, Mapping) or set(value) - {"shape", "dtype"} or "shape" not in value:
        raise ConfigError(f'{where} must look like {{"shape": [2, 64], "dtype": "float32"}}, got {value!r}')
    shape = value["shape"]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ConfigError(f"{where}.shape={shape!r} must be a list of non-negative integers")
    dtype = value.get("dtype", "float32")
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}.dtype={dtype!r} is unknown; use one of {list(_DTYPES)}")
    return TensorSpec(shape=tuple(shape), dtype=dtype)


def _pipe_activations(value: Any) -> tuple[TensorSpec, ...] | TensorSpec | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _tensor_spec(value, '"prism.pipe_activations"')
    if isinstance(value, (list, tuple)) and value:
        return tuple(_tensor_spec(v, f'"prism.pipe_activations"[{i}]') for i, v in enumerate(value))
    raise ConfigError('"prism.pipe_activations" must be a tensor spec {"shape": [...], "dtype": ...} or a '
                      "non-empty list of them")


def _topology(value: Any, world_size: int) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value or set(value) - set(_TOPOLOGY_AXES):
        raise ConfigError(f'"prism.topology"={value!r} must map some of {list(_TOPOLOGY_AXES)} to sizes, '
                          'e.g. {"pipe": 4, "data": 2048}')
    topo = {axis: value.get(axis, 1) for axis in _TOPOLOGY_AXES}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in topo.values()):
        raise ConfigError(f'"prism.topology"={dict(value)!r}: every size must be a positive integer')
    product = topo["pipe"] * topo["data"] * topo["model"]
    if product != world_size:
        raise ConfigError(
            f'"prism.topology" {topo} spans {product} ranks but "prism.world_size" is {world_size}; '
            "make pipe * data * model equal world_size"
        )
    return topo


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _deepspeed_batch(tbs: int | None, mbs: int | None, gas: int | None, dp: int) -> tuple[int, int, int]:
    """DeepSpeed 0.19's ``_set_batch_related_parameters`` at data-parallel size `dp`: the missing sizes derived.

    Example: train_batch_size 32, micro 2, no accumulation given, dp 4 -> (32, 2, 32 // 2 // 4 = 4).
    """
    if tbs is not None and mbs is not None and gas is not None:
        return tbs, mbs, gas
    if tbs is not None and mbs is not None:
        return tbs, mbs, tbs // mbs // dp
    if tbs is not None and gas is not None:
        return tbs, tbs // dp // gas, gas
    if mbs is not None and gas is not None:
        return mbs * gas * dp, mbs, gas
    if tbs is not None:
        return tbs, tbs // dp, 1
    assert mbs is not None
    return mbs * dp, mbs, 1


def _fits(sizes: tuple[int | None, int | None, int | None], dp: int) -> bool:
    """DeepSpeed's ``_batch_assertion``: every size > 0 and train_batch_size = micro * accumulation * dp."""
    tbs, mbs, gas = _deepspeed_batch(*sizes, dp)
    return tbs > 0 and mbs > 0 and gas > 0 and tbs == mbs * gas * dp


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _check_batch(ds_config: Mapping[str, Any], world_size: int, topology: dict[str, int] | None) -> None:
    """DeepSpeed's batch arithmetic against the emulated world, before DeepSpeed's own assertion.

    DeepSpeed derives the batch sizes not given and asserts ``train_batch_size == train_micro_batch_size_per_gpu
    * gradient_accumulation_steps * dp``, where dp is the data-parallel size of the world it sees: N / (pipe *
    model) (N without an mpu). With ``prism.topology`` dp is known and the check is DeepSpeed's; without it
    the job's pipe * model is unknown here, so the sizes must fit some dp that divides N (a ZeRO job without
    pipeline or model parallelism has dp = N: declare ``"topology": {"data": N}`` to have that checked).
    Example: N=16, topology pipe 2 * data 8, micro 2, accumulation 1 -> train_batch_size must be 16.
    """
    # "auto": the Hugging Face Trainer fills the value in from its own arguments and the world size it sees (the
    # emulated one), so DeepSpeed's assertion holds by construction: such a key is left to it, unchecked here
    given = {key: None if ds_config.get(key) == "auto" else ds_config.get(key) for key in _BATCH_KEYS}
    for key, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} must be a positive integer (DeepSpeed's batch sizes)")
    tbs, mbs, gas = given.values()
    if tbs is None and mbs is None:
        if gas is not None:
            raise ConfigError("gradient_accumulation_steps is given without train_batch_size or "
                              "train_micro_batch_size_per_gpu; DeepSpeed needs one of them")
        return  # a config used only for init_distributed: DeepSpeed's own check runs if it is ever initialised
    sizes = (tbs, mbs, gas)
    if topology is not None:
        dp = topology["data"]
        if not _fits(sizes, dp):
            t, m, g = _deepspeed_batch(*sizes, dp)
            shown = ", ".join(f"{k}={v}" + ("" if given[k] is not None else " (derived)")
                              for k, v in zip(_BATCH_KEYS, (t, m, g), strict=True))
            implied = (f"the batch sizes imply data-parallel size {tbs // (mbs * gas)} but "
                       if tbs is not None and mbs is not None and gas is not None and tbs % (mbs * gas) == 0 else "")
            raise ConfigError(
                f"{implied}prism.topology has data={dp} (prism.world_size {world_size} / (pipe {topology['pipe']} "
                f"* model {topology['model']})) and {shown}: DeepSpeed will assert train_batch_size == "
                f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel size ({t} != {m} * "
                f"{g} * {dp}); make train_batch_size = micro batch * accumulation steps * {dp}, or fix prism.topology"
            )
        return
    if tbs is not None and mbs is not None and gas is not None:
        if tbs % (mbs * gas):
            raise ConfigError(
                f"train_batch_size={tbs} is not train_micro_batch_size_per_gpu={mbs} * gradient_accumulation_steps="
                f"{gas} * data-parallel size for any integer size; fix the batch sizes"
            )
        dp = tbs // (mbs * gas)
        if world_size % dp:
            raise ConfigError(
                f"the batch sizes imply data-parallel size {dp} (train_batch_size={tbs} / micro {mbs} / accumulation "
                f"{gas}), which does not divide prism.world_size={world_size}; world_size must be data * pipe * model"
            )
        return
    if not any(_fits(sizes, dp) for dp in _divisors(world_size)):
        shown = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
        t, m, g = _deepspeed_batch(*sizes, world_size)
        raise ConfigError(
            f"{shown} fit no data-parallel size that divides prism.world_size={world_size} (DeepSpeed derives the "
            f"others and asserts train_batch_size == micro * accumulation * data-parallel size; at data-parallel "
            f"{world_size}: {t} != {m} * {g} * {world_size}); give all three batch sizes, or make train_batch_size "
            "a multiple of the others"
        )


KEY_NAMES = spellings(Entry.DEEPSPEED)
"""How the section spells each EmulationConfig field (`launch.preflight`'s messages, `respell`)."""


def read_section(ds_config: Mapping[str, Any] | str | Path, *, required: bool = True) -> PrismSection | None:
    """The ``"prism"`` section of `ds_config` (dict or path), checked alone. None when absent and not `required`."""
    config = load_ds_config(ds_config)
    section = config.get(SECTION_KEY)
    if section is None:
        if required:
            raise ConfigError('the DeepSpeed config has no "prism" section; add "prism": {"world_size": N, '
                              '"real_ranks": [...]} to turn emulation on')
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f'"prism" must be an object like {{"world_size": 8192, "real_ranks": [0]}}, got {section!r}')
    keys = section_keys()
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f'"prism" has unknown keys {unknown}; allowed keys: {list(ALLOWED_KEYS)}')
    values: dict[str, object] = {}
    for key, value in section.items():
        name = keys[key].name
        if name in values and value is not None:
            raise ConfigError(f'"prism" gives {name} twice ("{name}" and its older spelling "{key}"); keep "{name}"')
        if value is not None:
            values[name] = value
    settings = resolve(values, Entry.DEEPSPEED)
    world_size = settings.world.world_size
    topology = _topology(settings.deepspeed.topology, world_size)
    _check_batch(config, world_size, topology)
    graph = settings.time.graph
    if graph is not None and not graph.is_file():
        raise ConfigError(f'"prism.graph"={str(graph)!r} does not exist; give an execution graph file or omit it')
    try:
        emulation = settings.emulation()
    except ConfigError as exc:
        raise ConfigError(f'"prism" section: {exc}') from None
    return PrismSection(emulation=emulation, topology=topology,
                        pipe_activations=_pipe_activations(section.get("pipe_activations")),
                        graph=graph, ds_config=config, policy_defaults=settings.policy_defaults,
                        environ=settings.environ())
