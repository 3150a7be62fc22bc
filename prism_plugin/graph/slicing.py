"""Slicing: the job's classes of ranks, one representative each, grouped into profiling runs (DESIGN.md 6).

Classes. Ranks whose traces are identical up to relabelling of groups and peers fall in one class:

- Megatron-core: one class per pipeline stage (coordinate on "pp"). A stage's rank runs all of its
  virtual-pipeline chunks (stage s holds model chunks s, s + pp, ... with ``vpp`` > 1), so chunks do not
  split classes; the first stage (embedding, no activations received) and the last (loss, no activations
  sent) are classes of their own whatever pp. Tensor-, context-, expert- and data-parallel peers are
  symmetric (same shapes, same collectives; Megatron balances context-parallel work and expert routing
  is symmetric on average), so they share their stage's class.
- DeepSpeed: one class per pipe stage; data-parallel ranks (ZeRO partitions included: every rank owns
  one equal partition) and model-parallel ranks are symmetric. DeepSpeed's ``PipeModelDataParallelTopology``
  (axes pipe, data, model; model fastest) is Megatron's dense grid with tp=model, dp=data, pp=pipe in the
  default order, so both frameworks share `WorldLayout`.

The representative of a class is its lowest rank (pp = s, every other coordinate 0). A *profiling run*
executes up to `devices` representatives for real (everything else virtual): consecutive stages share a
run, so their transfers to each other are real. PP=16 on 2 devices gives 8 runs.

Plan file (``save`` / ``load``), version 1::

    {"format": "prism-slicing-plan", "version": 1, "framework": "megatron", "vpp": 1, "devices": 2,
     "layout": {...WorldLayout...}, "class_axes": ["pp"],
     "classes": [{"name": "pp=0", "rank": 0, "role": "first stage: ..."}, ...],
     "runs": [[0, 512], [1024, 1536], ...]}

Limitation: a model whose middle stages differ (uneven layer split) is still one class per stage, the
minimum that captures it; a job with asymmetric data-parallel replicas is not sliced correctly.

`Framework` is `prism_plugin.config.kinds.Framework` (re-exported); TORCH jobs are refused with a `GraphError`.

Pure: stdlib, prism_plugin.config and prism_plugin.topology only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import coerce_enum, positive_int
from prism_plugin.config.kinds import Framework
from prism_plugin.graph.build import representatives
from prism_plugin.graph.errors import GraphError
from prism_plugin.graph.layout import WorldLayout
from prism_plugin.topology import MegatronLayout

__all__ = ["Framework", "JobLayout", "PlanClass", "SlicingPlan", "make_plan", "parse_layout"]

PLAN_FORMAT = "prism-slicing-plan"
PLAN_VERSION = 1

_ALIASES = {"pipe": "pp", "data": "dp", "model": "tp"}  # DeepSpeed axis names


_SLICEABLE = (Framework.MEGATRON, Framework.DEEPSPEED)


def _sliceable(framework: Framework | str) -> Framework:
    fw = coerce_enum(Framework, framework, "framework", error=GraphError)
    if fw not in _SLICEABLE:
        raise GraphError(f"framework {fw.value!r} cannot be sliced (its classes of ranks are unknown to the "
                         "slicer): use megatron or deepspeed")
    return fw


@dataclass(frozen=True, kw_only=True, slots=True)
class JobLayout:
    """A job's parallel layout as the slicer sees it (a Megatron or DeepSpeed job: `Framework.TORCH` is refused)."""

    framework: Framework
    world: WorldLayout
    vpp: int = 1
    """Megatron virtual-pipeline chunks per stage (interleaved 1F1B); 1 without interleaving."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "framework", _sliceable(self.framework))
        positive_int("vpp", self.vpp, hint="virtual pipeline chunks per stage, 1 without interleaving",
                     error=GraphError)

    @property
    def pp(self) -> int:
        return self.world.axis("pp").size


def parse_layout(text: str, framework: Framework | str = Framework.MEGATRON,
                 world_size: int | None = None) -> JobLayout:
    """``"tp=8,pp=16,dp=64"`` (also cp, ep, etp (the experts' tp, default tp), vpp, and Megatron's rank ``order``,
    e.g. ``order=tp-cp-ep-pp-dp``;
    DeepSpeed: pipe, data, model) -> `JobLayout`.

    dp may be left out when `world_size` is given (dp = N / (tp*cp*pp)).

    >>> j = parse_layout("tp=8,pp=16,dp=64")
    >>> j.world.world_size, j.pp
    (8192, 16)
    >>> parse_layout("pipe=4,data=2", "deepspeed").world.group_of(1, "dp")
    (0, 1)
    >>> parse_layout("tp=2,pp=2,dp=2,order=tp-cp-ep-pp-dp").world.group_of(1, "pp")
    (1, 3)
    """
    fw = _sliceable(framework)
    sizes: dict[str, int] = {}
    order = None
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = _ALIASES.get(name.strip(), name.strip())
        if name == "order" and sep and fw is Framework.MEGATRON:
            order = value.strip()
            continue
        if not sep or name not in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp"):
            raise GraphError(
                f"--layout entry {part!r} is not NAME=SIZE with NAME in tp, pp, dp, cp, ep, etp, vpp (or order=AXES) "
                "(DeepSpeed: pipe, data, model), e.g. --layout tp=8,pp=16,dp=64"
            )
        try:
            size = int(value)
        except ValueError:
            raise GraphError(f"--layout {name}={value!r} is not an integer") from None
        positive_int(f"--layout {name}", size, hint="every axis size must be >= 1", error=GraphError)
        if name in sizes:
            raise GraphError(f"--layout names {name} twice")
        sizes[name] = size
    vpp = sizes.pop("vpp", 1)
    etp = sizes.pop("etp", None)
    if fw is Framework.DEEPSPEED and (sizes.get("cp", 1) > 1 or sizes.get("ep", 1) > 1 or vpp > 1 or etp):
        raise GraphError("--framework deepspeed layouts have pipe, data and model axes only (no cp, ep, vpp)")
    model = sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("pp", 1)
    if "dp" in sizes:
        n = model * sizes["dp"]
        if world_size is not None and world_size != n:
            raise GraphError(f"--layout gives {n} ranks but the world size is {world_size}: make them agree")
    elif world_size is not None:
        if world_size % model:
            raise GraphError(f"world size {world_size} is not divisible by tp*cp*pp={model}")
        n = world_size
    else:
        raise GraphError("--layout needs dp (or a world size to derive it), e.g. --layout tp=8,pp=16,dp=64")
    if vpp > 1 and sizes.get("pp", 1) < 2:
        raise GraphError(f"vpp={vpp} needs pp >= 2 (virtual chunks interleave pipeline stages)")
    try:
        layout = MegatronLayout(world_size=n, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1),
                                ep=sizes.get("ep", 1), expert_tp=etp, **({"order": order} if order else {}))
    except ValueError as exc:  # prism_plugin.topology's own checks (e.g. ep must divide dp x cp)
        raise GraphError(f"--layout {text!r}: {exc}") from None
    return JobLayout(framework=fw, world=WorldLayout(layout), vpp=vpp)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanClass:
    """One class of ranks and the rank that represents it."""

    name: str
    """E.g. "pp=3"."""
    rank: int
    """The representative (lowest) rank, executed for real by a profiling run."""
    role: str
    """What distinguishes the class, e.g. "last stage: loss, sends no activations"."""
    num_ranks: int
    """How many ranks the class stands for."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlicingPlan:
    """Classes, representatives and profiling runs of one job on `devices` physical devices."""

    job: JobLayout
    devices: int
    classes: tuple[PlanClass, ...]
    runs: tuple[tuple[int, ...], ...]
    """Real ranks of each profiling run (at most `devices` each; every representative exactly once)."""
    class_axes: tuple[str, ...] = ("pp",)

    @property
    def world_size(self) -> int:
        return self.job.world.world_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "framework": self.job.framework.value,
            "vpp": self.job.vpp, "devices": self.devices, "layout": self.job.world.to_dict(),
            "class_axes": list(self.class_axes),
            "classes": [{"name": c.name, "rank": c.rank, "role": c.role, "num_ranks": c.num_ranks}
                        for c in self.classes],
            "runs": [list(r) for r in self.runs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SlicingPlan:
        if data.get("format") != PLAN_FORMAT or data.get("version") != PLAN_VERSION:
            raise GraphError(f"not a version-{PLAN_VERSION} slicing plan (write one with `prism slice --output`)")
        job = JobLayout(framework=data["framework"], world=WorldLayout.from_dict(data["layout"]),
                        vpp=int(data["vpp"]))
        return cls(job=job, devices=int(data["devices"]), class_axes=tuple(data["class_axes"]),
                   classes=tuple(PlanClass(**c) for c in data["classes"]),
                   runs=tuple(tuple(r) for r in data["runs"]))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> SlicingPlan:
        """Read a plan file; every refusal is a `GraphError` naming the file ("plan file plan.json: ...")."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except OSError as exc:
            raise GraphError(f"plan file {path}: cannot be read ({exc.strerror or exc}); write one with "
                             "`prism slice --output`") from None
        except KeyError as exc:
            raise GraphError(f"plan file {path}: missing field {exc}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise GraphError(f"plan file {path}: {exc}") from None


def _role(job: JobLayout, stage: int) -> str:
    pp = job.pp
    if job.framework is Framework.MEGATRON:
        chunks = [stage + j * pp for j in range(job.vpp)]
        held = f"model chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, chunks))}"
        first, last = "embedding", "loss"
    else:
        held = f"pipe stage {stage}"
        first, last = "loads the batch", "loss, loads the labels"
    if pp == 1:
        return f"every rank ({held}): no pipeline"
    if stage == 0:
        return f"first stage ({held}): {first}" + (", receives no activations" if job.vpp == 1 else "")
    if stage == pp - 1:
        return f"last stage ({held}): {last}" + (", sends no activations" if job.vpp == 1 else "")
    return f"middle stage ({held})"


def make_plan(job: JobLayout, devices: int) -> SlicingPlan:
    """One representative per pipeline stage, consecutive stages grouped `devices` at a time.

    >>> plan = make_plan(parse_layout("tp=8,pp=16,dp=64"), devices=2)
    >>> len(plan.classes), len(plan.runs), plan.runs[0]
    (16, 8, (0, 512))
    """
    positive_int("--devices", devices, hint="a positive integer, the physical devices per profiling run",
                 error=GraphError)
    class_axes = ("pp",)
    reps = representatives(job.world, class_axes)
    per_class = job.world.world_size // job.pp
    classes = tuple(
        PlanClass(name=name, rank=rank, role=_role(job, stage), num_ranks=per_class)
        for stage, (name, rank) in enumerate(reps.items())
    )
    ranks = [c.rank for c in classes]
    runs = tuple(tuple(ranks[i:i + devices]) for i in range(0, len(ranks), devices))
    return SlicingPlan(job=job, devices=devices, classes=classes, runs=runs, class_axes=class_axes)


def plan_rows(plan: SlicingPlan) -> Sequence[tuple[int, str, int, str, int]]:
    """(run, class, rank, role, ranks represented) rows, for printing."""
    run_of = {r: i for i, run in enumerate(plan.runs) for r in run}
    return [(run_of[c.rank], c.name, c.rank, c.role, c.num_ranks) for c in plan.classes]
