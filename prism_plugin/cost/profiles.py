"""Hardware profiles: the link figures the cost model turns into time (DESIGN.md section 5).

A profile is a frozen value object loaded from YAML: a built-in name (`dgx-h100`, `dgx-h200`, `dgx-b200`,
`dgx-a100`, `local-cpu-gloo`, aliases `H100` / `H200` / `B200` / `A100`, case-insensitive) or a path to a file of
the same schema.

The optional ``kernels:`` section holds the virtual-time kernel model's efficiencies
(`prism_plugin.cost.kernels.KernelEfficiency`); a profile without one uses that module's policy defaults. The
optional ``storage:`` section holds the per-GPU checkpoint bandwidths (`prism_plugin.cost.storage.StorageSpec`),
the optional ``host:`` section the host's per-GPU memory bandwidth (`prism_plugin.cost.host.HostSpec`),
likewise with policy defaults.

Limitations: a profile describes one homogeneous cluster (every node alike, one NIC per GPU);
there is no PCIe tier, no per-switch oversubscription and no congestion. The built-in figures are
datasheet values or one-off measurements: calibrate them before trusting absolute times.

Pure: stdlib + pyyaml (and the config layer's error contract).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.host import HostSpec
from prism_plugin.cost.kernels import KernelEfficiency
from prism_plugin.cost.storage import StorageSpec

__all__ = [
    "HardwareProfile",
    "LinkSpec",
    "ProfileError",
    "available_profiles",
    "load_profile",
    "override_profile",
    "profile_from_yaml",
    "profile_to_yaml",
]

_ALIASES = {"h100": "dgx-h100", "h200": "dgx-h200", "b200": "dgx-b200", "a100": "dgx-a100"}
_LINK_FIELDS = ("bandwidth_gbytes_per_s", "latency_us")


class ProfileError(ConfigError):
    """A hardware profile could not be found, parsed or validated; the message names the file and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One tier of the interconnect, seen from one GPU (rank).

    Example: NVLink 4 on an H100 is ``LinkSpec(bandwidth_gbytes_per_s=450.0, latency_us=1.0)``.
    """

    bandwidth_gbytes_per_s: float
    """Per-GPU bandwidth in one direction, in 1e9 bytes/s (datasheet link rate; derated by the
    profile's efficiencies). For the inter-node tier: the bandwidth of the one NIC this GPU uses."""
    latency_us: float
    """Latency of one hop on this tier (one step of an algorithm, one p2p message), in microseconds.
    Zero is allowed (an ideal link, for what-if studies)."""

    def __post_init__(self) -> None:
        for field_name in _LINK_FIELDS:
            value = getattr(self, field_name)
            _check_number(value, field_name, "LinkSpec", allow_zero=field_name == "latency_us")
            object.__setattr__(self, field_name, float(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """A named cluster description: node size, two link tiers, efficiencies, per-op overheads.

    Example: ``load_profile("H100").intra_node.bandwidth_gbytes_per_s == 450.0``.
    """

    name: str
    """Profile name (the built-in file's stem, or any label for a user file)."""
    description: str
    """Free text: hardware, sources of the figures, whether they were calibrated."""
    gpus_per_node: int
    """Ranks per node; rank r sits on node r // gpus_per_node."""
    intra_node: LinkSpec
    """The tier between GPUs of one node (NVLink/NVSwitch, or loopback on a CPU machine)."""
    inter_node: LinkSpec
    """The tier between nodes, per GPU: each GPU owns one NIC of this bandwidth."""
    bus_efficiency: float
    """Fraction of the link rate collectives reach, in (0, 1] (nccl-tests bus bandwidth / link rate)."""
    p2p_efficiency: float
    """Fraction of the link rate a send/recv reaches, in (0, 1]."""
    collective_overhead_us: float
    """Fixed cost of one collective (launch, setup, completion), in microseconds, >= 0."""
    p2p_overhead_us: float
    """Fixed cost of one send/recv pair (launch, handshake), in microseconds, >= 0."""
    op_transfer_factors: tuple[tuple[str, float], ...] = ()
    """Optional per-op multipliers of the transfer (size-dependent) term, as sorted (op, factor) pairs; YAML:
    a mapping such as ``{all_gather: 2.9, reduce_scatter: 4.1}``. For backends whose ops differ in more than
    hop count and traffic (gloo reduces on the CPU, copies all_gather chunks one by one); `prism calibrate
    --per-op` fits them. An op not listed has factor 1; ``send`` also applies to ``recv``. Empty by default."""
    gpu: str | None = None
    """The GPU model of the nodes (`prism_plugin.cost.gpu.GPUS`: h100-sxm, h200-sxm, b200-sxm, a100-sxm-80gb, or
    an alias such as b200, stored as the key it stands for): what a virtual GPU presents (``--device
    virtual-gpu``). None for CPU profiles."""
    kernels: KernelEfficiency = KernelEfficiency()
    """Optional: the virtual-time kernel model's efficiencies (YAML: a ``kernels:`` mapping, see
    `KernelEfficiency`); absent, every figure is the policy default (listed by ``kernels.defaults_used``)."""
    storage: StorageSpec = StorageSpec()
    """Optional: the per-GPU checkpoint write and read bandwidths (YAML: a ``storage:`` mapping, see `StorageSpec`);
    a figure not set is the policy default (listed by ``storage.defaults_used``)."""
    host: HostSpec = HostSpec()
    """Optional: the host's per-GPU figures (YAML: a ``host:`` mapping, see `HostSpec`): the memory bandwidth a
    CPU optimizer streams at; a figure not set is the policy default (listed by ``host.defaults_used``)."""

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        object.__setattr__(self, "op_transfer_factors", _op_factors(self.op_transfer_factors, where))
        if not isinstance(self.kernels, KernelEfficiency):
            object.__setattr__(self, "kernels", KernelEfficiency.from_mapping(self.kernels, where=where,
                                                                              error=ProfileError))
        if not isinstance(self.storage, StorageSpec):
            object.__setattr__(self, "storage", StorageSpec.from_mapping(self.storage, where=where,
                                                                         error=ProfileError))
        if not isinstance(self.host, HostSpec):
            object.__setattr__(self, "host", HostSpec.from_mapping(self.host, where=where, error=ProfileError))
        if not isinstance(self.name, str) or not self.name.strip():
            raise ProfileError(f"`name` must be a non-empty string, got {self.name!r}; e.g. name: my-cluster")
        if not isinstance(self.description, str):
            raise ProfileError(f"{where}: `description` must be a string, got {self.description!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise ProfileError(f"{where}: `gpus_per_node` must be a positive integer (8 on DGX nodes)")
        if self.gpus_per_node < 1:
            raise ProfileError(f"{where}: `gpus_per_node` must be >= 1 (8 on DGX nodes)")
        if self.gpu is not None:
            from prism_plugin.cost.gpu import gpu_name

            try:
                object.__setattr__(self, "gpu", gpu_name(self.gpu))
            except ConfigError as exc:
                raise ProfileError(f"{where}: `gpu: {self.gpu}`: {exc}") from None
        for tier in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, tier), LinkSpec):
                raise ProfileError(f"{where}: `{tier}` must be a LinkSpec")
        for field_name in ("bus_efficiency", "p2p_efficiency"):
            value = getattr(self, field_name)
            _check_number(value, field_name, where, allow_zero=False)
            if value > 1:
                raise ProfileError(
                    f"{where}: `{field_name}` must be a fraction in (0, 1], got {value!r}; "
                    "e.g. 0.8 for 80% of link rate"
                )
            object.__setattr__(self, field_name, float(value))
        for field_name in ("collective_overhead_us", "p2p_overhead_us"):
            value = getattr(self, field_name)
            _check_number(value, field_name, where, allow_zero=True)
            object.__setattr__(self, field_name, float(value))


def _op_factors(value: object, where: str) -> tuple[tuple[str, float], ...]:
    """`op_transfer_factors` as sorted (op, factor) pairs, each op a known OpKind value, each factor > 0."""
    from prism_plugin.config.kinds import OpKind

    if value is None:
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        if not isinstance(pairs, Iterable):
            raise TypeError  # as iterating it would
        items = [(str(k), f) for k, f in pairs]
    except (TypeError, ValueError):
        raise ProfileError(
            f"{where}: `op_transfer_factors` must map op names to factors, e.g. {{all_gather: 2.5}}; got {value!r}"
        ) from None
    known = [k.value for k in OpKind]
    out = {}
    for op, factor in items:
        if op not in known:
            close = difflib.get_close_matches(op, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"known ops: {', '.join(known)}"
            raise ProfileError(f"{where}: `op_transfer_factors.{op}`: unknown op; {hint}")
        _check_number(factor, f"op_transfer_factors.{op}", where, allow_zero=False)
        out[op] = float(factor)
    return tuple(sorted(out.items()))


def _check_number(value: object, field_path: str, where: str, *, allow_zero: bool) -> None:
    """Raise ProfileError unless `value` is a finite number, > 0 (or >= 0 when `allow_zero`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(
            f"{where}: `{field_path}` must be a number, got {value!r} ({type(value).__name__}); "
            "write a bare number in the unit its name says, e.g. 450.0"
        )
    bound_ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not bound_ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ProfileError(f"{where}: `{field_path}` must be finite and {bound}, got {value!r}")


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(HardwareProfile))
# older profile files do not have these
_OPTIONAL_FIELDS = frozenset({"op_transfer_factors", "gpu", "kernels", "storage", "host"})


def _profile_from_mapping(data: object, source: str) -> HardwareProfile:
    """Validate the parsed YAML of one profile (structure first, then values) and build it."""
    if data is None:
        raise ProfileError(f"{source}: the profile is empty; it needs the fields {', '.join(_FIELDS)}")
    if not isinstance(data, Mapping):
        raise ProfileError(
            f"{source}: a profile must be a YAML mapping of field: value, got {type(data).__name__}"
        )
    _check_keys(data, _FIELDS, "", source)
    links = {}
    for tier in ("intra_node", "inter_node"):
        raw = data[tier]
        if not isinstance(raw, Mapping):
            raise ProfileError(
                f"{source}: `{tier}` must be a mapping with {' and '.join(_LINK_FIELDS)}, got {raw!r}"
            )
        _check_keys(raw, _LINK_FIELDS, f"{tier}.", source)
        for key in _LINK_FIELDS:
            _check_number(raw[key], f"{tier}.{key}", source, allow_zero=key == "latency_us")
        links[tier] = LinkSpec(**{key: raw[key] for key in _LINK_FIELDS})
    scalars = {key: data[key] for key in _FIELDS if key not in links and key in data}
    try:
        return HardwareProfile(**scalars, intra_node=links["intra_node"], inter_node=links["inter_node"])
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def _check_keys(data: Mapping[Any, Any], expected: tuple[str, ...], prefix: str, source: str) -> None:
    for key in data:
        if key not in expected:
            close = difflib.get_close_matches(str(key), expected, n=1)
            hint = f"did you mean `{prefix}{close[0]}`?" if close else f"known fields: {', '.join(expected)}"
            raise ProfileError(f"{source}: unknown field `{prefix}{key}`; {hint}")
    for key in expected:
        if key not in data and key not in _OPTIONAL_FIELDS:
            raise ProfileError(
                f"{source}: missing field `{prefix}{key}`; add it (see the built-in dgx-h100.yaml for an "
                "example with units and sources)"
            )


def profile_from_yaml(text: str, *, source: str = "<string>") -> HardwareProfile:
    """Parse one profile from YAML text; `source` names it in error messages (a path or a label)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(f"{where}: malformed YAML ({problem}); fix the syntax at that line") from None
    return _profile_from_mapping(data, source)


def profile_to_yaml(profile: HardwareProfile) -> str:
    """Serialise a profile to YAML (no comments); `profile_from_yaml` reads it back equal."""
    return yaml.safe_dump(_as_mapping(profile), sort_keys=False, default_flow_style=False)


def _as_mapping(profile: HardwareProfile) -> dict[str, Any]:
    """The profile as plain YAML data: op_transfer_factors and kernels as mappings, left out when empty."""
    data = dataclasses.asdict(profile)
    data.pop("kernels")
    data.pop("storage")
    data.pop("host")
    factors = data.pop("op_transfer_factors")
    if data.get("gpu") is None:
        data.pop("gpu", None)
    if factors:
        data["op_transfer_factors"] = dict(factors)
    if profile.kernels.given:
        data["kernels"] = profile.kernels.to_mapping()
    if profile.storage.to_mapping():
        data["storage"] = profile.storage.to_mapping()
    if profile.host.to_mapping():
        data["host"] = profile.host.to_mapping()
    return data


def _builtin_dir() -> Any:
    return resources.files("prism_plugin.cost").joinpath("profiles")


def available_profiles() -> list[str]:
    """Names of the built-in profiles, sorted (aliases `H100`, `H200`, `B200`, `A100` not included)."""
    return sorted(
        entry.name.removesuffix(".yaml") for entry in _builtin_dir().iterdir() if entry.name.endswith(".yaml")
    )


def _looks_like_path(name_or_path: str) -> bool:
    return name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path or "\\" in name_or_path


def load_profile(name_or_path: str) -> HardwareProfile:
    """Load a built-in profile by name (case-insensitive; aliases H100, H200, B200, A100) or a YAML file by path.

    A string ending in .yaml/.yml or containing a path separator is read as a file path.
    Example: ``load_profile("a100").name == "dgx-a100"``; ``load_profile("./my_cluster.yaml")``.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ProfileError(f"profile must be a name or a path to a YAML file, got {name_or_path!r}")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(
                f"cannot read profile file {str(path)!r} ({exc.strerror or exc}); check the path, "
                f"or use a built-in profile: {', '.join(available_profiles())}"
            ) from None
        return profile_from_yaml(text, source=str(path))
    return _load_builtin(_ALIASES.get(name_or_path.lower(), name_or_path.lower()))


_BUILTIN_CACHE: dict[str, HardwareProfile] = {}


def _load_builtin(name: str) -> HardwareProfile:
    if name in _BUILTIN_CACHE:
        return _BUILTIN_CACHE[name]
    names = available_profiles()
    if name not in names:
        aliases = ", ".join(f"{alias.upper()} -> {target}" for alias, target in _ALIASES.items())
        raise ProfileError(
            f"unknown profile {name!r}; built-in profiles: {', '.join(names)} (aliases: {aliases}); "
            "or pass a path to a YAML file, e.g. ./my_cluster.yaml"
        )
    entry = _builtin_dir().joinpath(f"{name}.yaml")
    profile = profile_from_yaml(entry.read_text(encoding="utf-8"), source=f"built-in profile {name}.yaml")
    _BUILTIN_CACHE[name] = profile
    return profile


def override_profile(profile: HardwareProfile, overrides: Mapping[str, object]) -> HardwareProfile:
    """A copy of `profile` with dotted fields replaced, validated like a file (what-if studies).

    Example: ``override_profile(p, {"inter_node.bandwidth_gbytes_per_s": 25.0, "bus_efficiency": 0.7})``;
    ``{"kernels.gemm.compute_efficiency": 0.7}`` sets one kernel-model figure (validated as in a file).
    """
    data = _as_mapping(profile)
    data.setdefault("op_transfer_factors", {})
    data.setdefault("kernels", {})
    data.setdefault("storage", {})
    data.setdefault("host", {})
    for dotted, value in overrides.items():
        head, _, tail = dotted.partition(".")
        # these heads are mappings (set above)
        if head == "op_transfer_factors" and tail:  # any op may be added
            data[head][tail] = value
            continue
        if head == "kernels" and tail:  # `kernels.<field>` or `kernels.<class>.<field>`, checked when parsed
            group, _, sub = tail.partition(".")
            if sub:
                data[head].setdefault(group, {})[sub] = value
            else:
                data[head][group] = value
            continue
        if head in ("storage", "host") and tail:  # `storage.<field>` / `host.<field>`, checked when parsed
            data[head][tail] = value
            continue
        target = data.get(head)
        if head not in data or (tail and (not isinstance(target, dict) or tail not in target)):
            valid = [f for f in _FIELDS if f not in ("intra_node", "inter_node")]
            valid += [f"{tier}.{key}" for tier in ("intra_node", "inter_node") for key in _LINK_FIELDS]
            valid += ["op_transfer_factors.<op>", "kernels.<field>", "kernels.<class>.<field>", "storage.<field>",
                      "host.<field>"]
            raise ProfileError(f"override: unknown field `{dotted}`; valid fields: {', '.join(valid)}")
        if tail and isinstance(target, dict):  # with a tail, a dict holding it (checked above)
            target[tail] = value
        else:
            data[head] = value
    return _profile_from_mapping(data, f"override of profile {profile.name!r}")
