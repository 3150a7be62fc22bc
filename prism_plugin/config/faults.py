"""Faults and what-ifs on virtual participants: stragglers, slow links, jitter, hangs, crashes, killed ranks.

A fault is written as one compact string, the same on every surface (``prism run --fault``, ``prism replay
--fault``, ``--prism-fault`` of the Megatron wrapper, ``"faults": [...]`` in the DeepSpeed ``"prism"``
section; a recipe emulation's ``faults:`` list, with ``expect:`` stating what they must produce:
recipes/fault-*.yaml, recipes/README.md)::

    straggler:ranks=4-7,factor=1.3,from_step=2   ranks 4..7 compute 30% slower from step 2 on
                                                 (several sets: ranks=0-3+9, "+" joins them)
    link:nodes=0/1,bandwidth=0.25                the link between node 0 and node 1 runs at 25% bandwidth
    link:ranks=3/11,bandwidth=0.5                ... or between two sets of ranks
    jitter:sigma=0.05,seed=7                     every op's communication cost x exp(0.05 z), z ~ N(0, 1), seeded
    hang:rank=1,op=3,group=tp,step=1             virtual rank 1 never arrives at its 3rd op on a "tp" group
                                                 (counted from step 1 on) nor at any later op
    crash:rank=5,step=2                          virtual rank 5's process dies at step 2
    hang:rank=1,group=tp,op=3,strict=true        ... and the run fails at exit if the hang never fired
    kill:rank=0,step=3                           the real process playing rank 0 is SIGKILLed at step 3

Where to give them::

    prism run --world-size 16 --real-ranks 0 --timeout 60 --fault straggler:ranks=4-7,factor=1.3 -- train.py
    prism replay job.graph --fault link:nodes=0/1,bandwidth=0.25 --chrome-trace t.json --blame-plot blame.png
    prism replay job.graph --fault hang:rank=1,group=tp,op=3 --timeout 600 --json   # who blocks, when it raises
    python -m prism_plugin.megatron pretrain_gpt.py ... --prism-fault hang:rank=1,group=tp,op=3  (repeatable)
    ds_config.json: "prism": {"world_size": 16, "real_ranks": [0], "faults": ["crash:rank=5,step=2"]}
    EmulationConfig(..., faults=("jitter:sigma=0.05,seed=7",))

*Groups* (``group=`` of a hang) are named in one vocabulary (`GROUP_ROLES`, checked when the fault is parsed:
``group=tpp`` is refused with the list), matched against the frameworks' own group names:

    name      also accepted           Megatron-core group_desc               DeepSpeed (pipeline grid)
    tp        tensor, slice           TENSOR_MODEL_PARALLEL_GROUP            slice (the "model" axis)
    pp        pipe, pipeline          PIPELINE_MODEL_PARALLEL_GROUP          pipe
    dp        data                    DATA_PARALLEL_GROUP (+ _GLOO)          data
    cp        context                 CONTEXT_PARALLEL_GROUP
    dp_cp     data_cp                 DATA_PARALLEL_GROUP_WITH_CP (+ _GLOO)
    ep        expert                  EXPERT_MODEL_PARALLEL_GROUP
    etp       expert_tensor           EXPERT_TENSOR_PARALLEL_GROUP
    edp       expert_data             EXPERT_DATA_PARALLEL_GROUP (+ _GLOO)
    mp        model                   MODEL_PARALLEL_GROUP (tp x pp)         model (get_model_parallel_group)
    tp_dp                             TENSOR_AND_DATA_PARALLEL_GROUP
    tp_cp                             TENSOR_AND_CONTEXT_PARALLEL_GROUP
    tp_dp_cp                          TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    tp_ep                             EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP
    tp_ep_pp                          EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP
    embd      embedding               EMBEDDING_GROUP
    pos_embd  position_embedding      POSITION_EMBEDDING_GROUP
    world     default_pg              the default group

A group matches when its description (``new_group(..., group_desc=)``; Megatron sets it, DeepSpeed's grid
groups are labelled by the DeepSpeed adapter) or its name is one of these names, case-insensitive, ``-`` and
``_`` alike, a trailing index ignored (a plain script's ``group_desc="tp0"`` is a ``tp`` group); a name
spanning several groups (``tensor`` is not ``TENSOR_AND_DATA_PARALLEL_GROUP``) does not match. An execution
graph's roles are axis tokens ("tp", "cp-dp", "tp-dp"): ``dp_cp`` is the role "cp-dp".

*Steps* are the session's iteration counter: the number of iteration marks seen so far (0 before the
first mark; adapters mark every training step, plain scripts mark at the end of each optimizer step).
Ranks are global ranks of the emulated job; ``nodes`` are ``rank // gpus_per_node``.

Semantics of the live emulation (`prism_plugin.runtime.live_faults`). The replay honours straggler, link and
jitter (`prism_plugin.graph.replay`; with an execution graph loaded, live virtual arrivals come from that
faulty replay instead of the straggler model below, switched to it at the mark that starts a straggler's
``from_step``: `prism_plugin.runtime.arrivals.fault_phases`) and hang and crash (`prism_plugin.graph.fault_replay`).
With ``timing=False`` only hang, crash and kill apply.

- straggler: a member m of an op's group with factor f > 1 arrives at ``t0 + f * (a - t0)`` where ``a`` is
  this rank's own arrival and ``t0`` the later of the iteration anchor and the emulated end of the last op
  shared with a straggler that this rank had waited for when it issued this op (the last point where both
  were in step; an op issued async and not yet waited for, e.g. an overlapped gradient bucket, is not one:
  the straggler goes on computing past it too). That is "m spends f times this rank's compute since they
  last synchronised". Limitation: time this rank spent blocked in other groups' ops since t0 is scaled too.
- link: an op whose members sit on both sides of a degraded link costs ``cost / bandwidth`` (the whole
  alpha-beta cost, latency included: an upper bound, exact for bandwidth-bound messages).
- jitter: cost x ``exp(sigma * z)`` with ``z`` a standard normal hashed from ``f"{seed}/{group}/{seq}"``: the
  same op gets the same draw on every run and every real rank. The live key is the group's name, the
  replay's the group role, so live and replay draws differ (each is deterministic).
- hang: the faulty rank stops before its ``op``-th op on a matching group from ``step`` on. Every real rank
  decides when with one clock: its own ops on matching groups (counted from ``step``), which are the faulty
  rank's own when the two share the group (every member issues a group's ops in the same order), and stand
  in for them otherwise (ranks of one role issue the same sequence). From then on every op of a group
  holding the faulty rank never completes; the report's ``step`` is where it stopped, the same on every real
  rank (``raised_at_step``: the step of this rank's failing op). The op never completes; the real rank's
  ``wait()`` raises, ``timeout_s`` after the op was issued,
  the error the real backend raises (gloo: "Timed out waiting ...ms for recv operation to complete";
  CUDA/NCCL: the watchdog's "Watchdog caught collective operation timeout: WorkNCCL(...) ran for ...
  milliseconds before timing out"). It sleeps until then and no longer.
- crash: from step s every op of a group holding the crashed rank fails at once with gloo's peer-death
  error ("Read error ...: Connection reset by peer", as torch 2.13's gloo words it when a peer process
  dies); on CUDA a dead NCCL peer is not detected, so the op times out like a hang.
- never fired: a hang or crash whose group, op or step never occurred is reported at exit ("never fired",
  on stderr and as ``never_fired`` in the summary's faults); with ``strict=true`` the run fails then
  (`prism_plugin.runtime.live_faults.FaultNeverFiredError`).
- kill: the real process playing the rank SIGKILLs itself at the iteration mark that starts step s; the
  other real ranks' inner gloo exchanges with it fail ("Connection reset by peer") or time out after
  ``timeout_s``, and `prism run` stops the job with a message naming the killed rank.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

from prism_plugin.config.errors import ConfigError, int_at_least, parse_rank_list, positive_int

__all__ = [
    "FaultKind", "Straggler", "SlowLink", "Jitter", "Hang", "Crash", "Kill", "FaultSpec",
    "check_fault_ranks", "parse_fault", "parse_faults", "gloo_timeout_message", "nccl_watchdog_message",
    "peer_closed_message", "GroupRole", "GROUP_ROLES", "group_role", "desc_role", "graph_role_matches",
]

EXAMPLES = (
    "straggler:ranks=4-7,factor=1.3,from_step=2 | link:nodes=0/1,bandwidth=0.25 | jitter:sigma=0.05,seed=7 | "
    "hang:rank=1,op=3,group=tp | crash:rank=5,step=2 | kill:rank=0,step=3"
)


class FaultKind(StrEnum):
    STRAGGLER = "straggler"
    LINK = "link"
    JITTER = "jitter"
    HANG = "hang"
    CRASH = "crash"
    KILL = "kill"


def _ranks_text(ranks: Sequence[int]) -> str:
    """(4, 5, 6, 7, 9) -> "4-7+9": ranges joined by "+" (a comma would end the field)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return "+".join(parts)


_STEP_HINT = "a step number; 0 = from the start"
_RANK_HINT = "a global rank, e.g. rank=5; the job's world size is checked by check_fault_ranks"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupRole:
    """One name of the group vocabulary (module docstring): what the user writes, what the frameworks call it."""

    name: str
    words: tuple[str, ...] = ()
    """Other words accepted for it (``tensor`` for ``tp``)."""
    megatron: tuple[str, ...] = ()
    """Megatron-core's ``group_desc`` of these groups (`parallel_state.create_group`)."""
    deepspeed: tuple[str, ...] = ()
    """The DeepSpeed pipeline grid's names for them (the descs the DeepSpeed adapter gives its groups)."""
    axes: frozenset[str] = frozenset()
    """The execution graph's role axes ("cp-dp" -> {"cp", "dp"}); empty: no graph role."""


def _role(name: str, words: str = "", megatron: str = "", deepspeed: str = "", axes: str = "") -> GroupRole:
    return GroupRole(name=name, words=tuple(words.split()), megatron=tuple(megatron.split()),
                     deepspeed=tuple(deepspeed.split()), axes=frozenset(axes.split()))


GROUP_ROLES: dict[str, GroupRole] = {r.name: r for r in (
    _role("tp", "tensor tensor_model_parallel", "TENSOR_MODEL_PARALLEL_GROUP", "slice", "tp"),
    _role("pp", "pipeline pipeline_model_parallel", "PIPELINE_MODEL_PARALLEL_GROUP", "pipe", "pp"),
    _role("dp", "data data_parallel", "DATA_PARALLEL_GROUP DATA_PARALLEL_GROUP_GLOO", "data", "dp"),
    _role("cp", "context context_parallel", "CONTEXT_PARALLEL_GROUP", "", "cp"),
    _role("dp_cp", "data_cp cp_dp", "DATA_PARALLEL_GROUP_WITH_CP DATA_PARALLEL_GROUP_WITH_CP_GLOO", "", "dp cp"),
    _role("ep", "expert expert_model_parallel", "EXPERT_MODEL_PARALLEL_GROUP"),
    _role("etp", "expert_tensor", "EXPERT_TENSOR_PARALLEL_GROUP"),
    _role("edp", "expert_data", "EXPERT_DATA_PARALLEL_GROUP EXPERT_DATA_PARALLEL_GROUP_GLOO"),
    _role("mp", "model model_parallel", "MODEL_PARALLEL_GROUP", "model", "tp pp"),
    _role("tp_dp", "dp_tp", "TENSOR_AND_DATA_PARALLEL_GROUP", "", "tp dp"),
    _role("tp_cp", "cp_tp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP", "", "tp cp"),
    _role("tp_dp_cp", "tp_cp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "", "tp cp dp"),
    _role("tp_ep", "", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"),
    _role("tp_ep_pp", "", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP"),
    _role("embd", "embedding", "EMBEDDING_GROUP"),
    _role("pos_embd", "position_embedding", "POSITION_EMBEDDING_GROUP"),
    _role("world", "default_pg all", "", "", "tp cp dp pp"),
)}


def _norm(text: str) -> str:
    return "_".join(t for t in text.strip().lower().replace("-", "_").replace(" ", "_").split("_") if t)


_LOOKUP: dict[str, str] = {}
for _r in GROUP_ROLES.values():
    for _w in (_r.name, *_r.words, *_r.megatron, *_r.deepspeed):
        _LOOKUP.setdefault(_norm(_w), _r.name)
_BY_AXES: dict[frozenset[str], str] = {r.axes: r.name for r in GROUP_ROLES.values() if r.axes and r.name != "world"}


def _lookup(text: str) -> str | None:
    key = _norm(text)
    found = _LOOKUP.get(key)
    if found is None and key:  # an axis token in another order: "cp-dp", "dp_tp"
        found = _BY_AXES.get(frozenset(key.split("_")))
    return found


def group_role(text: str, *, field_name: str = "hang: group") -> str:
    """The canonical vocabulary name of `text` ('' stays ''); `ConfigError` listing the names otherwise.

    >>> group_role("tensor"), group_role("TENSOR_MODEL_PARALLEL_GROUP"), group_role("cp-dp"), group_role("pipe")
    ('tp', 'tp', 'dp_cp', 'pp')
    """
    if not isinstance(text, str):
        raise ConfigError(f"{field_name}={text!r} must be a group name, one of {list(GROUP_ROLES)}")
    if not text.strip():
        return ""
    found = _lookup(text)
    if found is None:
        raise ConfigError(f"{field_name}={text!r} is not a group name; use one of {list(GROUP_ROLES)} (or a "
                          "framework's own name, e.g. TENSOR_MODEL_PARALLEL_GROUP; see prism_plugin.config.faults)")
    return found


def desc_role(desc: str) -> str | None:
    """The vocabulary name a group description (or name) stands for, a trailing index ignored; None if none.

    >>> desc_role("TENSOR_MODEL_PARALLEL_GROUP"), desc_role("tp0"), desc_role("TENSOR_AND_DATA_PARALLEL_GROUP")
    ('tp', 'tp', 'tp_dp')
    >>> desc_role("undefined"), desc_role("3")
    (None, None)
    """
    if not desc:
        return None
    found = _lookup(desc)
    if found is None:
        stripped = desc.rstrip("0123456789").rstrip("_- ")
        if stripped and stripped != desc:
            found = _lookup(stripped)
    return found


def graph_role_matches(role: str, graph_role: str) -> bool:
    """Whether an execution graph's group role (an axis token, "cp-dp") is the vocabulary name `role`.

    >>> graph_role_matches("dp_cp", "cp-dp"), graph_role_matches("tp", "tp-dp")
    (True, False)
    """
    if not role:
        return True
    axes = GROUP_ROLES[role].axes
    return bool(axes) and frozenset(graph_role.lower().split("-")) == axes


def _strict(kind: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{kind}: strict={value!r} must be true or false (true: fail the run if the fault never fires)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler:
    """Ranks whose compute takes `factor` times as long, from step `from_step` on."""

    ranks: tuple[int, ...]
    factor: float
    from_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"straggler: factor={f!r} must be a finite number > 0 (1.3 = 30% slower)")
        object.__setattr__(self, "factor", float(f))
        if not self.ranks:
            raise ConfigError("straggler: ranks= is empty; name the slow ranks, e.g. ranks=4-7")
        int_at_least("straggler: from_step", self.from_step, 0, hint=_STEP_HINT)

    kind = FaultKind.STRAGGLER

    def to_text(self) -> str:
        return f"straggler:ranks={_ranks_text(self.ranks)},factor={self.factor!r},from_step={self.from_step}"


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowLink:
    """A degraded link between two sets of nodes (or ranks): ops crossing it run at `bandwidth` x speed."""

    side_a: tuple[int, ...]
    side_b: tuple[int, ...]
    bandwidth: float
    """Fraction of the healthy bandwidth, in (0, 1]."""
    by_node: bool = True
    """True: sides are node indices (rank // gpus_per_node); False: global ranks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "side_a", tuple(int(r) for r in self.side_a))
        object.__setattr__(self, "side_b", tuple(int(r) for r in self.side_b))
        b = self.bandwidth
        if isinstance(b, bool) or not isinstance(b, int | float) or not (0 < b <= 1):
            raise ConfigError(f"link: bandwidth={b!r} must be in (0, 1] (0.25 = a quarter of the healthy bandwidth)")
        object.__setattr__(self, "bandwidth", float(b))
        if set(self.side_a) & set(self.side_b):
            raise ConfigError(f"link: both sides name {sorted(set(self.side_a) & set(self.side_b))}; "
                              "give two disjoint sets, e.g. nodes=0/1")

    kind = FaultKind.LINK

    def crosses(self, ranks: Iterable[int], node_of: Callable[[int], int]) -> bool:
        """Whether a group (or send/recv pair) over global `ranks` has members on both sides (`node_of`: a
        placement's rank -> node, used when the sides are nodes)."""
        a, b = set(self.side_a), set(self.side_b)
        seen_a = seen_b = False
        for r in ranks:
            key = node_of(r) if self.by_node else r
            seen_a = seen_a or key in a
            seen_b = seen_b or key in b
            if seen_a and seen_b:
                return True
        return False

    def to_text(self) -> str:
        scope = "nodes" if self.by_node else "ranks"
        return f"link:{scope}={_ranks_text(self.side_a)}/{_ranks_text(self.side_b)},bandwidth={self.bandwidth!r}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Jitter:
    """Seeded log-normal noise on every op's communication cost."""

    sigma: float
    seed: int = 0

    def __post_init__(self) -> None:
        s = self.sigma
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s < 0:
            raise ConfigError(f"jitter: sigma={s!r} must be a finite number >= 0 (0.05 = about 5% noise)")
        object.__setattr__(self, "sigma", float(s))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"jitter: seed={self.seed!r} must be an integer")

    kind = FaultKind.JITTER

    def to_text(self) -> str:
        return f"jitter:sigma={self.sigma!r},seed={self.seed}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Hang:
    """Virtual `rank` stops arriving at its `op`-th op (1-based) on groups matching `group`, from `step` on."""

    rank: int
    op: int = 1
    group: str = ""
    """Which groups count: '' any group; else a name of the vocabulary (`GROUP_ROLES`, stored canonical:
    "tensor" -> "tp"), matched against the groups' descriptions and an execution graph's roles."""
    step: int = 0
    strict: bool = False
    """True: the run fails at exit when the hang never fired (its group, op or step never occurred)."""

    def __post_init__(self) -> None:
        int_at_least("hang: rank", self.rank, 0, hint=_RANK_HINT)
        positive_int("hang: op", self.op, hint="an integer >= 1 (1 = the first op)")
        int_at_least("hang: step", self.step, 0, hint=_STEP_HINT)
        object.__setattr__(self, "group", group_role(self.group))
        _strict("hang", self.strict)

    kind = FaultKind.HANG

    def to_text(self) -> str:
        group = f",group={self.group}" if self.group else ""
        strict = ",strict=true" if self.strict else ""
        return f"hang:rank={self.rank},op={self.op}{group},step={self.step}{strict}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Crash:
    """Virtual `rank`'s process dies at step `step`."""

    rank: int
    step: int = 0
    strict: bool = False
    """True: the run fails at exit when the crash never fired (no op with the rank from its step on)."""

    def __post_init__(self) -> None:
        int_at_least("crash: rank", self.rank, 0, hint=_RANK_HINT)
        int_at_least("crash: step", self.step, 0, hint=_STEP_HINT)
        _strict("crash", self.strict)

    kind = FaultKind.CRASH

    def to_text(self) -> str:
        return f"crash:rank={self.rank},step={self.step}" + (",strict=true" if self.strict else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class Kill:
    """The real process playing `rank` is SIGKILLed at the iteration mark that starts step `step`."""

    rank: int
    step: int = 1

    def __post_init__(self) -> None:
        int_at_least("kill: rank", self.rank, 0, hint=_RANK_HINT)
        int_at_least("kill: step", self.step, 0, hint=_STEP_HINT)

    kind = FaultKind.KILL

    def to_text(self) -> str:
        return f"kill:rank={self.rank},step={self.step}"


FaultSpec = Straggler | SlowLink | Jitter | Hang | Crash | Kill

_FIELDS: dict[str, dict[str, str]] = {  # kind -> field -> value type
    "straggler": {"ranks": "ranks", "rank": "ranks", "factor": "float", "from_step": "int"},
    "link": {"nodes": "sides", "ranks": "sides", "between": "sides", "bandwidth": "float"},
    "jitter": {"sigma": "float", "seed": "int"},
    "hang": {"rank": "int", "op": "int", "group": "group", "step": "int", "strict": "bool"},
    "crash": {"rank": "int", "step": "int", "strict": "bool"},
    "kill": {"rank": "int", "step": "int"},
}
_REQUIRED = {"straggler": ("factor",), "link": ("bandwidth",), "jitter": ("sigma",), "hang": ("rank",),
             "crash": ("rank",), "kill": ("rank",)}


def _value(kind: str, name: str, typ: str, text: str) -> object:
    try:
        if typ == "int":
            return int(text)
        if typ == "float":
            return float(text)
        if typ == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{kind}: {name}={text!r} must be true or false")
        if typ == "group":
            return group_role(text, field_name=f"{kind}: {name}")
        if typ == "ranks":
            return parse_rank_list(text.replace("+", ","), field_name=f"{kind}: {name}")
        if typ == "sides":
            a, sep, b = text.partition("/")
            if not sep:
                raise ConfigError(f"link: {name}={text!r} must be two sides A/B, e.g. {name}=0/1 or {name}=0-3/4-7")
            return (parse_rank_list(a.replace("+", ","), field_name=f"link: {name}"),
                    parse_rank_list(b.replace("+", ","), field_name=f"link: {name}"))
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{kind}: {name}={text!r} is not a valid {typ}; e.g. {EXAMPLES}") from None
    return text


def parse_fault(text: str) -> FaultSpec:
    """Parse one fault string (module docstring); ConfigError names the field and the fix.

    >>> parse_fault("straggler:ranks=4-7,factor=1.3,from_step=2")
    Straggler(ranks=(4, 5, 6, 7), factor=1.3, from_step=2)
    """
    if not isinstance(text, str):
        raise ConfigError(f"fault {text!r} must be a string like {EXAMPLES}")
    kind, sep, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in _FIELDS:
        raise ConfigError(f"fault {text!r}: unknown kind {kind!r}; choose one of {list(_FIELDS)}, e.g. {EXAMPLES}")
    fields: dict[str, object] = {}
    for item in (p.strip() for p in rest.split(",") if sep):
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip().lower()
        if not eq or name not in _FIELDS[kind]:
            raise ConfigError(f"fault {text!r}: {kind} has no field {name!r}; its fields are {list(_FIELDS[kind])}")
        if name in fields or (name in ("nodes", "ranks", "between") and kind == "link" and "sides" in fields):
            raise ConfigError(f"fault {text!r}: {name} given twice; give each field once")
        parsed = _value(kind, name, _FIELDS[kind][name], value.strip())
        if kind == "link" and name in ("nodes", "ranks", "between"):
            fields["sides"] = (parsed, name != "ranks")
        else:
            fields["ranks" if kind == "straggler" and name == "rank" else name] = parsed
    missing = [f for f in _REQUIRED[kind] if f not in fields]
    if kind == "straggler" and "ranks" not in fields:
        missing.insert(0, "ranks")
    if kind == "link" and "sides" not in fields:
        missing.insert(0, "nodes (or ranks)")
    if missing:
        raise ConfigError(f"fault {text!r}: {kind} needs {', '.join(missing)}; e.g. {EXAMPLES}")
    if kind == "straggler":
        return Straggler(**fields)  # type: ignore[arg-type]
    if kind == "link":
        sides, by_node = cast(tuple[tuple[tuple[int, ...], tuple[int, ...]], bool], fields.pop("sides"))
        return SlowLink(side_a=sides[0], side_b=sides[1], by_node=by_node, **fields)  # type: ignore[arg-type]
    if kind == "jitter":
        return Jitter(**fields)  # type: ignore[arg-type]
    if kind == "hang":
        return Hang(**fields)  # type: ignore[arg-type]
    if kind == "crash":
        return Crash(**fields)  # type: ignore[arg-type]
    return Kill(**fields)  # type: ignore[arg-type]


def parse_faults(items: Iterable[str | FaultSpec] | None) -> tuple[FaultSpec, ...]:
    """Parse a list of fault strings (specs pass through); None or empty gives ()."""
    if items is None:
        return ()
    if isinstance(items, str):
        raise ConfigError(f"faults={items!r} must be a list of fault strings, e.g. [{EXAMPLES.split(' | ')[0]!r}]")
    return tuple(item if isinstance(item, FaultSpec) else parse_fault(item) for item in items)


def check_fault_ranks(specs: Sequence[FaultSpec], world_size: int) -> None:
    """Raise a `ConfigError` naming the fault when one of its ranks is outside ``0..world_size-1``."""
    for spec in specs:
        ranks: tuple[int, ...] = ()
        if isinstance(spec, Straggler):
            ranks = spec.ranks
        elif isinstance(spec, Hang | Crash | Kill):
            ranks = (spec.rank,)
        elif isinstance(spec, SlowLink) and not spec.by_node:
            ranks = spec.side_a + spec.side_b
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"fault {spec.to_text()!r}: ranks {bad} are outside the job's 0..{world_size - 1}")


def gloo_timeout_message(timeout_s: float) -> str:
    """The text of the RuntimeError torch's gloo backend raises when a collective times out."""
    return (f"[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            f"{int(round(timeout_s * 1000))}ms for recv operation to complete")


def nccl_watchdog_message(rank: int, seq: int, op_type: str, numel: int, timeout_s: float) -> str:
    """The text of torch's NCCL watchdog when a collective runs past the process group's timeout."""
    ms = int(round(timeout_s * 1000))
    return (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op_type}, "
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)={ms}) ran for {ms + 1} milliseconds before timing out.")


def peer_closed_message(peer: int) -> str:
    """The text of the RuntimeError gloo raises when a peer process died (its connection closed)."""
    return (f"[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [virtual rank {peer}]: Connection reset "
            "by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs "
            "of the remote worker before reporting an error.")
