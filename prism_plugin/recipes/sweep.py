"""`prism sweep`: one recipe's job over several scales or layouts, each point a virtual-GPU emulation.

A sweep takes a ``device: virtual-gpu`` recipe (`prism_plugin.recipes.virtual_gpu`), its first emulation (or the
one named) and a list of world sizes N (x an optional list of layouts), and runs each point as that emulation with
N, the layout and the per-rank batch replaced: one ``prism run --device virtual-gpu`` process tree per point,
one real rank, the program at real size. Example::

    spec = SweepSpec(recipe=load_recipe("recipes/virtual-gpu-llama-1b.yaml"), world_sizes=(512, 1024, 2048),
                     global_batch=2048)
    points = derive_points(spec)   # n512: dp 512, micro 1 x accumulation 4 = 2048 sequences per step
    results = run_points(points, Path("out"), jobs=2)

**Batch.** With `SweepSpec.global_batch` G (sequences per step) the job trains at a fixed global batch: the
micro-batch stays the recipe's ``model.micro_batch_size`` m and the gradient accumulation k = G / (m x dp) changes
with dp (``model.microbatches_per_step``, the llama program's ``--accumulation``); G must be a multiple of m x dp
at every point. Without it each replica keeps the recipe's m x microbatches_per_step (weak scaling: the global
batch grows with dp).

**Figures of a point** (`point_figures`, from the real rank's prism summary and its timeline,
``PRISM_TIMELINE``; all emulated time, deterministic):

- step time: the median of the measured steps (``virtual_gpu.virtual_time.step_times_s``: every marked step
  after the first);
- tokens/s/GPU: global batch x seq length / step time / N;
- MFU: this rank's kernel FLOPs per step (``virtual_gpu.kernels.flops`` / steps: torch's flop registry, i.e.
  the matmuls and attention the rank's kernels execute, causal attention counting its unmasked half; the
  embedding lookup and elementwise ops count 0) / step time / the GPU's dense bf16 peak
  (`prism_plugin.cost.gpu.GpuSpec.peak_flops_per_s`);
- step-time breakdown (mean over measured steps, from the timeline's spans in each step's window): compute =
  time the rank's compute streams run a kernel; exposed communication = time a communication stream runs an op
  while no compute stream runs a kernel; bubble = 0 at pp = 1 (None otherwise: not measured yet); other = the
  rest of the step (no stream busy: the host's launch overhead and syncs). Without a timeline these are None;
- modelled communication per step (``modelled_comm_s`` / steps, hidden or not);
- the rank's own device: peak allocated / reserved, device total (reserved + CUDA context), the GPU's memory,
  fits, OOM count.

A point that fails (an OOM with ``oom: raise``, an error, a timeout) is a `PointResult` with its `error` (and the
memory figures of its summary, if it wrote one), never an exception out of `run_points`.

**Where points run.** Locally, at most `jobs` points at a time (each one process tree); or on a Ray cluster
(``ray_address``: ``ray.init(address=...)``, or ``"local"`` to start a local instance), each point one
``@ray.remote`` task running the same `run_point`. Ray is optional (the ``cluster`` extra) and imported only then.
On a remote cluster each point's files stay on the node that ran it; its figures come back to the driver.

Limitations: one real rank per point (symmetric DP ranks: any rank stands for all); the llama program is data
parallel only, so layouts other than tp = pp = cp = 1 are refused by the recipe schema until a virtual-GPU
program with model parallelism exists; a breakdown needs the timeline to keep every span of the measured steps
(``MAX_RECORDS``; a point whose timeline dropped spans says so in ``breakdown_note``).
Non-goals: choosing the best layout, real (non-virtual) runs, profiles or what-ifs as sweep axes (one recipe
per profile for now).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.recipes.expect_schema import Expect
from prism_plugin.recipes.plans import ProcessSpec, virtual_gpu_plan
from prism_plugin.recipes.runner import RunFailed, execute
from prism_plugin.recipes.schema import Emulation, Layout, Recipe, RecipeError
from prism_plugin.recipes.virtual_gpu import OomMode

__all__ = ["SCHEMA", "Breakdown", "PointFigures", "PointResult", "SweepError", "SweepPoint", "SweepSpec",
           "derive_points", "parse_layouts", "parse_world_sizes", "point_figures", "run_point", "run_points",
           "step_breakdown", "sweep_document"]

SCHEMA = "prism-sweep/1"
LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "vpp")


class SweepError(ConfigError):
    """A sweep that cannot run: the message names the option or recipe field and the fix."""


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"512,2048,8192"`` -> (512, 2048, 8192): positive, distinct, in the order given."""
    sizes = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part.isdigit() or int(part) < 1:
            raise SweepError(f"--world-sizes: {part!r} is not a positive integer; write e.g. 512,2048,8192")
        sizes.append(int(part))
    if len(set(sizes)) != len(sizes):
        raise SweepError(f"--world-sizes lists a size twice ({text}); give each once")
    return tuple(sizes)


def parse_layouts(text: str, base: Layout) -> tuple[Layout, ...]:
    """``"tp=1;tp=2,pp=2"`` -> one `Layout` per ``;``-separated item, each `base` with the keys given replaced.

    Keys: tp, pp, cp, ep, vpp. Example: parse_layouts("tp=2;tp=4", Layout()) -> (Layout(tp=2), Layout(tp=4)).
    """
    layouts = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            raise SweepError(f"--layouts {text!r} has an empty item; separate layouts with ';', e.g. \"tp=1;tp=2\"")
        changes: dict[str, int] = {}
        for pair in item.split(","):
            key, sep, value = (s.strip() for s in pair.partition("="))
            if not sep or key not in LAYOUT_KEYS or not value.isdigit():
                raise SweepError(f"--layouts: {pair.strip()!r} in {item!r} is not KEY=INT with KEY one of "
                                 f"{', '.join(LAYOUT_KEYS)}; write e.g. \"tp=2,pp=2\"")
            changes[key] = int(value)
        try:
            layouts.append(dataclasses.replace(base, **changes))
        except RecipeError as exc:
            raise SweepError(f"--layouts {item!r}: {exc}") from None
    return tuple(layouts)


def _layout_label(layout: Layout) -> str:
    """``tp2_pp2`` (every size above 1; ``dp`` for data parallelism only)."""
    parts = [f"{k}{getattr(layout, k)}" for k in LAYOUT_KEYS if getattr(layout, k) not in (None, 1)]
    return "_".join(parts) or "dp"


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSpec:
    """What to sweep: the recipe's emulation at each world size (x each layout)."""

    recipe: Recipe
    world_sizes: tuple[int, ...]
    layouts: tuple[Layout, ...] = ()
    """Empty: the recipe's layout only."""
    global_batch: int | None = None
    """Sequences per step at every point (fixed global batch); None: the recipe's per-replica batch (weak scaling)."""
    rank: int | None = None
    """The real rank of every point; None: the emulation's first real rank."""
    emulation: str | None = None
    """The recipe emulation to sweep; None: its first."""
    oom: OomMode | None = None
    """What a virtual GPU does at an allocation past its memory; None: the emulation's own setting."""

    def __post_init__(self) -> None:
        if not self.world_sizes:
            raise SweepError("--world-sizes: give at least one world size, e.g. 512,2048")
        if self.global_batch is not None and (isinstance(self.global_batch, bool) or self.global_batch < 1):
            raise SweepError(f"--global-batch must be a positive number of sequences, got {self.global_batch!r}")
        if self.rank is not None and self.rank < 0:
            raise SweepError(f"--rank must be >= 0, got {self.rank}")

    def base_emulation(self) -> Emulation:
        """The swept emulation; it must run on virtual GPUs."""
        try:
            emu = self.recipe.emulated[0] if self.emulation is None else self.recipe.emulation(self.emulation)
        except KeyError:
            names = ", ".join(e.name for e in self.recipe.emulated)
            raise SweepError(f"--emulation {self.emulation!r}: recipe {self.recipe.name} has {names}") from None
        if emu.device is not DeviceMode.VIRTUAL_GPU:
            raise SweepError(f"recipe {self.recipe.name}: emulated[{emu.name}] has device: {emu.device.value}; a "
                             "sweep runs virtual-GPU emulations (device: virtual-gpu, e.g. virtual-gpu-llama-1b)")
        return emu


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPoint:
    """One point: the recipe rewritten to a single one-rank emulation at this world size and layout."""

    name: str
    """``n<N>`` (``n<N>_<layout>`` when layouts are swept): the point's folder and its emulation's name."""
    world_size: int
    layout: Layout
    dp: int
    rank: int
    micro_batch: int
    accumulation: int
    """Micro-batches per replica per step (gradient accumulation)."""
    recipe: Recipe
    """The rewritten recipe: its one emulation is this point."""

    @property
    def global_batch(self) -> int:
        """Sequences per step: micro x accumulation x dp."""
        return self.micro_batch * self.accumulation * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * (self.recipe.model.seq_length or 0)

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"name": self.name, "world_size": self.world_size, "rank": self.rank, "dp": self.dp,
                "layout": {k: getattr(lay, k) for k in LAYOUT_KEYS}, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "global_batch": self.global_batch,
                "tokens_per_step": self.tokens_per_step, "profile": self.recipe.emulated[0].profile,
                "oom": self.recipe.emulated[0].oom.value}


def derive_points(spec: SweepSpec) -> list[SweepPoint]:
    """Every (layout, world size) point of `spec`, validated before anything runs.

    Example: llama-1b (micro 1), world sizes 512, 2048 at global batch 2048 -> n512 (dp 512, accumulation 4),
    n2048 (dp 2048, accumulation 1).
    """
    recipe = spec.recipe
    emu = spec.base_emulation()
    layouts = spec.layouts or (recipe.layout,)
    rank = emu.runs[0][0] if spec.rank is None else spec.rank
    micro = recipe.model.micro_batch_size
    points = []
    for layout in layouts:
        for n in spec.world_sizes:
            name = f"n{n}" if not spec.layouts else f"n{n}_{_layout_label(layout)}"
            if n % layout.model_parallel:
                raise SweepError(f"point {name}: world size {n} is not a multiple of tp x pp x cp = "
                                 f"{layout.model_parallel}; use multiples in --world-sizes or change --layouts")
            dp = n // layout.model_parallel
            if spec.global_batch is None:
                accumulation = recipe.model.microbatches_per_step
            elif spec.global_batch % (micro * dp):
                raise SweepError(
                    f"point {name}: --global-batch {spec.global_batch} is not a multiple of model.micro_batch_size x "
                    f"dp = {micro} x {dp} = {micro * dp} (each replica runs whole micro-batches); use a multiple of "
                    f"{micro * dp}, or lower model.micro_batch_size")
            else:
                accumulation = spec.global_batch // (micro * dp)
            if rank >= n:
                raise SweepError(f"point {name}: --rank {rank} is outside 0..{n - 1}; pass a --rank below the "
                                 "smallest world size")
            points.append(SweepPoint(name=name, world_size=n, layout=layout, dp=dp, rank=rank, micro_batch=micro,
                                     accumulation=accumulation,
                                     recipe=_point_recipe(recipe, emu, name, n, layout, rank, accumulation, spec.oom)))
    return points


def _point_recipe(recipe: Recipe, emu: Emulation, name: str, world_size: int, layout: Layout, rank: int,
                  accumulation: int, oom: OomMode | None) -> Recipe:
    try:  # the recipe schema's own checks (layout vs program, gpus_per_node vs N, ...) run on the point
        # the schema needs stated figures on a virtual-GPU emulation; a sweep reports figures and checks none
        point = dataclasses.replace(emu, name=name, world_size=world_size, runs=((rank,),), ranks=None,
                                    oom=emu.oom if oom is None else oom, expect=Expect(fits=True))
        model = dataclasses.replace(recipe.model, microbatches_per_step=accumulation)
        return dataclasses.replace(recipe, model=model, layout=layout, emulated=(point,))
    except ConfigError as exc:
        raise SweepError(f"point {name}: {exc}") from None


# -- figures ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    """Mean per measured step, seconds, from a timeline (`step_breakdown`); compute + exposed + other = step."""

    steps: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    other_s: float
    dropped_spans: int


_COMPUTE_ROW = re.compile(r"^cuda:\d+ stream \S+$")
_COMM_ROW = re.compile(r"^comm stream ")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of `spans` not covered by `cover` (both merged, sorted)."""
    return _length(spans) - sum(_length(_clip(cover, a, b)) for a, b in spans)


def step_breakdown(timeline: Mapping[str, Any]) -> Breakdown | None:
    """Compute / exposed communication / other per measured step from a prism timeline (Chrome trace JSON,
    ``prism-timeline`` format: kernel rows ``cuda:D stream S``, ``comm stream G`` rows, the host row's closed
    ``iteration i`` spans); only steps i >= 1 whose iterations i - 1 and i + 1 the timeline kept too
    (``otherData.iterations_kept``: it drops the oldest when over its record budget); None when no step qualifies.

    Example: a 10 ms step whose compute stream runs 7 ms and whose comm stream runs 4 ms, 1 ms of it while a
    kernel runs -> compute 7 ms, exposed 3 ms, other 0 ms.
    """
    events = timeline.get("traceEvents", [])
    other = timeline.get("otherData", {})
    rank = other.get("rank")
    kept = other.get("iterations_kept")
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    windows: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X" or (rank is not None and e.get("pid") != rank):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        if e.get("cat") == "iteration":
            i = e["args"].get("iteration", 0)
            # a measured step whose neighbours were kept too: the one before holds kernels that run into this
            # window, and a step that alone filled the timeline's budget is dropped by the next one's records
            if not e["args"].get("open") and i >= 1 and (kept is None or {i - 1, i + 1} <= set(kept)):
                windows.append(span)
            continue
        row = rows.get((e["pid"], e["tid"]), "")
        if _COMPUTE_ROW.match(row):
            compute.append(span)
        elif _COMM_ROW.match(row):
            comm.append(span)
    if not windows:
        return None
    # spans of one row do not overlap, but the program's streams (or comm streams) may: their union counts
    compute, comm = _union(compute), _union(comm)
    parts = []
    for lo, hi in windows:
        busy = _clip(compute, lo, hi)
        exposed = _minus(_clip(comm, lo, hi), busy)
        parts.append((hi - lo, _length(busy), exposed))
    n = len(parts)
    step, comp, exp = (sum(p[i] for p in parts) / n * 1e-6 for i in range(3))
    dropped = int(other.get("dropped", {}).get("spans", 0))
    return Breakdown(steps=n, step_s=step, compute_s=comp, exposed_comm_s=exp, other_s=max(step - comp - exp, 0.0),
                     dropped_spans=dropped)


@dataclass(frozen=True, kw_only=True, slots=True)
class PointFigures:
    """A point's figures (see the module docstring for each definition); times in emulated seconds."""

    step_time_s: float | None
    step_times_s: tuple[float, ...]
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    flops_per_step: int | None
    """This rank's kernel FLOPs in one step."""
    peak_bf16_flops_per_s: float | None
    compute_s: float | None
    exposed_comm_s: float | None
    bubble_s: float | None
    other_s: float | None
    modelled_comm_s: float | None
    """Modelled communication per step (hidden or exposed)."""
    breakdown_note: str
    gpu: str
    gpu_memory_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    fits: bool
    ooms: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        return d


def _own_device(vgpu: Mapping[str, Any], local_rank: int = 0) -> Mapping[str, Any]:
    devices = vgpu["devices"]
    return devices[local_rank % max(1, len(devices))]


def point_figures(summary: Mapping[str, Any], point: SweepPoint, *, peak_bf16_flops_per_s: float | None,
                  timeline: Mapping[str, Any] | None = None) -> PointFigures:
    """The figures of `point` from its real rank's prism summary (and timeline, for the breakdown).

    The rank's own device is ``cuda:0`` (one real rank per point: LOCAL_RANK 0).
    """
    vgpu = summary.get("virtual_gpu")
    if not vgpu:
        raise RunFailed(f"point {point.name}: the summary has no virtual_gpu section (not a virtual-GPU run?)")
    steps_total = point.recipe.steps.total
    vt = vgpu.get("virtual_time") or {}
    steps = tuple(float(s) for s in vt.get("step_times_s", ()))
    step = statistics.median(steps) if steps else None
    kernels = vgpu.get("kernels") or {}
    flops = int(kernels["flops"]) // steps_total if "flops" in kernels else None  # every step runs the same kernels
    mfu = None
    if step and flops is not None and peak_bf16_flops_per_s:
        mfu = flops / step / peak_bf16_flops_per_s
    tokens = point.tokens_per_step / step / point.world_size if step and point.tokens_per_step else None
    bd = step_breakdown(timeline) if timeline is not None else None
    note = "no timeline: breakdown not measured"
    if timeline is not None and bd is None:
        dropped = timeline.get("otherData", {}).get("dropped", {}).get("spans", 0)
        note = (f"the timeline kept no complete measured step ({dropped} spans dropped by its record budget): "
                "breakdown not measured; fewer micro-batches per step fit")
    if bd is not None:
        note = f"timeline: mean of {bd.steps} measured steps"
        if bd.dropped_spans:
            note += f" ({bd.dropped_spans} spans dropped by the timeline's bound: kept steps only)"
    bubble = (0.0 if point.layout.pp == 1 else None) if bd is not None else None
    comm = summary.get("modelled_comm_s")
    dev = _own_device(vgpu)
    return PointFigures(
        step_time_s=step, step_times_s=steps, tokens_per_s_per_gpu=tokens, mfu=mfu, flops_per_step=flops,
        peak_bf16_flops_per_s=peak_bf16_flops_per_s, compute_s=None if bd is None else bd.compute_s,
        exposed_comm_s=None if bd is None else bd.exposed_comm_s, bubble_s=bubble,
        other_s=None if bd is None else bd.other_s,
        modelled_comm_s=None if comm is None else float(comm) / steps_total, breakdown_note=note,
        gpu=vgpu["gpu"], gpu_memory_bytes=int(vgpu["gpu_memory_bytes"]),
        peak_allocated_bytes=int(dev["peak_allocated_bytes"]), peak_reserved_bytes=int(dev["peak_reserved_bytes"]),
        device_total_bytes=int(dev["device_total_bytes"]), fits=bool(dev["fits"]), ooms=len(dev["ooms"]))


def peak_bf16(point: SweepPoint) -> float | None:
    """The dense bf16 peak FLOP/s of the point's GPU (the emulation's ``gpu``, else its profile's)."""
    from prism_plugin.cost.gpu import gpu_spec
    from prism_plugin.cost.profiles import load_profile

    emu = point.recipe.emulated[0]
    name = emu.gpu or load_profile(point.recipe.resolve_profile(emu)).gpu
    return None if name is None else gpu_spec(name).peak_flops_per_s.get("bfloat16")


# -- running ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class PointResult:
    """What one point produced: its figures, or its error (with what figures its summary still had)."""

    point: SweepPoint
    figures: PointFigures | None
    error: str | None
    wall_s: float
    folder: str

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point.to_dict(), "ok": self.ok, "error": self.error, "wall_s": round(self.wall_s, 3),
                "folder": self.folder, "figures": None if self.figures is None else self.figures.to_dict()}


_OOM_LINE = re.compile(r"(?:torch\.)?OutOfMemoryError: (CUDA out of memory\.[^\n]*)")


def _error_text(exc: BaseException, log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    oom = _OOM_LINE.search(text)
    if oom:
        return oom.group(1)[:300]
    return str(exc).splitlines()[0][:300]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_point(point: SweepPoint, output: str | Path, *, timeout_s: float = 900.0) -> PointResult:
    """Run `point` into ``output/<point.name>`` (its folder is emptied first) and read its figures.

    Never raises for a failed run: the result carries the error (an OOM names torch's message).
    """
    out = Path(output) / point.name
    recipe, emu = point.recipe, point.recipe.emulated[0]
    plan = virtual_gpu_plan(recipe, emu, 0, out)
    timeline_dir = out / "timeline"
    plan = dataclasses.replace(plan, processes=tuple(
        ProcessSpec(argv=p.argv, env={**p.env, "PRISM_TIMELINE": str(timeline_dir)}, log=p.log)
        for p in plan.processes))
    t0 = time.monotonic()
    error = None
    try:
        execute([plan], steps_total=recipe.steps.total, timeout_s=timeout_s)
    except RunFailed as exc:
        error = _error_text(exc, plan.processes[0].log)
    except OSError as exc:
        error = f"could not start the point's run: {exc}"
    wall = time.monotonic() - t0
    assert plan.summary_dir is not None
    summary = _read_json(plan.summary_dir / f"rank{point.rank}.summary.json")
    figures = None
    if summary is not None and summary.get("virtual_gpu"):
        timeline = _read_json(timeline_dir / f"rank{point.rank}.timeline.json")
        try:
            figures = point_figures(summary, point, peak_bf16_flops_per_s=peak_bf16(point), timeline=timeline)
        except (KeyError, TypeError, ValueError, RunFailed) as exc:
            error = error or f"unreadable summary: {type(exc).__name__}: {exc}"
    elif error is None:
        error = f"rank {point.rank} wrote no virtual-GPU summary; see {plan.processes[0].log}"
    if error is None and summary is not None and summary.get("error"):
        error = str(summary["error"])[:300]
    return PointResult(point=point, figures=figures, error=error, wall_s=wall, folder=str(out))


PointDone = Callable[[PointResult], None]
PointStarted = Callable[[SweepPoint], None]


def default_jobs() -> int:
    """min(2, this machine's cores): points run this many at a time by default."""
    return max(1, min(2, os.cpu_count() or 1))


def run_points(points: Sequence[SweepPoint], output: Path, *, jobs: int | None = None, ray_address: str | None = None,
               timeout_s: float = 900.0, on_start: PointStarted | None = None,
               on_done: PointDone | None = None) -> list[PointResult]:
    """Run every point, at most `jobs` at a time locally or as Ray tasks (`ray_address`); results in point order."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise SweepError(f"--jobs must be >= 1, got {jobs}")
    Path(output).mkdir(parents=True, exist_ok=True)
    if ray_address is not None:
        return _run_on_ray(points, Path(output), ray_address, jobs=jobs, timeout_s=timeout_s, on_start=on_start,
                           on_done=on_done)
    results: dict[str, PointResult] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        def one(p: SweepPoint) -> PointResult:
            if on_start is not None:
                on_start(p)
            return run_point(p, output, timeout_s=timeout_s)

        futures = [pool.submit(one, p) for p in points]
        for fut in as_completed(futures):
            res = fut.result()
            results[res.point.name] = res
            if on_done is not None:
                on_done(res)
    return [results[p.name] for p in points]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray, the optional `cluster` extra: pip install prism_plugin[cluster]") from None
    return ray


def _run_on_ray(points: Sequence[SweepPoint], output: Path, address: str, *, jobs: int, timeout_s: float,
                on_start: PointStarted | None, on_done: PointDone | None) -> list[PointResult]:
    ray = _import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address == "local":  # a local instance for this sweep: `jobs` CPUs, no dashboard
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(run_point)
        pending = {}
        for p in points:
            pending[task.remote(p, str(output), timeout_s=timeout_s)] = p
            if on_start is not None:
                on_start(p)
        results: dict[str, PointResult] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                p = pending.pop(ref)
                try:
                    res = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a task that died (node lost, worker crash) is the point's error
                    res = PointResult(point=p, figures=None, error=f"ray task failed: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:300] if str(exc) else ''}", wall_s=0.0,
                                      folder=str(output / p.name))
                results[p.name] = res
                if on_done is not None:
                    on_done(res)
        return [results[p.name] for p in points]
    finally:
        if started_here:
            ray.shutdown()


def sweep_document(spec: SweepSpec, results: Sequence[PointResult], *, engine: str,
                   plots: Sequence[Path] = ()) -> dict[str, Any]:
    """The ``sweep.json`` document: the spec, how points ran, every point's figures or error."""
    recipe = spec.recipe
    emu = spec.base_emulation()
    return {
        "schema": SCHEMA, "recipe": recipe.name, "source": str(recipe.source) if recipe.source else None,
        "emulation": emu.name, "program": recipe.program.value,
        "spec": {"world_sizes": list(spec.world_sizes),
                 "layouts": [{k: getattr(lay, k) for k in LAYOUT_KEYS} for lay in spec.layouts] or None,
                 "global_batch": spec.global_batch,
                 "batch": ("fixed global batch: micro-batch x accumulation x dp = global_batch" if spec.global_batch
                           else "fixed per-replica batch (the recipe's micro x microbatches_per_step): grows with dp"),
                 "rank": results[0].point.rank if results else spec.rank, "profile": emu.profile,
                 "seq_length": recipe.model.seq_length, "steps": {"total": recipe.steps.total,
                                                                  "warmup": recipe.steps.warmup}},
        "engine": engine,
        "definitions": {
            "step_time_s": "median of the measured emulated steps (virtual_time.step_times_s)",
            "tokens_per_s_per_gpu": "global_batch x seq_length / step_time_s / world_size",
            "mfu": "this rank's kernel FLOPs per step (torch flop registry: matmuls + attention) / step_time_s / "
                   "the GPU's dense bf16 peak",
            "compute_s": "mean per measured step: time a compute stream runs a kernel (timeline)",
            "exposed_comm_s": "mean per measured step: time a comm stream runs an op while no kernel runs",
            "bubble_s": "pipeline bubble: 0 at pp = 1",
            "other_s": "the rest of the step: no stream busy (host launch overhead, syncs)",
            "modelled_comm_s": "modelled communication per step, hidden or exposed",
            "device_total_bytes": "peak reserved + CUDA context"},
        "plots": [str(p) for p in plots],
        "points": [r.to_dict() for r in results],
    }
