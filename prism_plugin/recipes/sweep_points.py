"""The points of a sweep (`prism_plugin.recipes.sweep`): what to sweep, and each point as a rewritten recipe.

`derive_points` turns a `SweepSpec` (a virtual-GPU recipe, world sizes, optional layouts, hardware profiles and
global batch) into one `SweepPoint` per (profile, layout, world size): the recipe with its swept emulation
replaced by a single one-rank emulation at that N, layout and profile, and its ``model.microbatches_per_step``
set so that micro-batch x accumulation x dp = the global batch. Every point is validated (by the recipe schema
too) before anything runs; errors name the option or recipe field and the fix. Pure: no process is started.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import DeviceMode
from prism_plugin.recipes.expect_schema import Expect
from prism_plugin.recipes.schema import Emulation, Layout, Recipe, RecipeError
from prism_plugin.recipes.virtual_gpu import OomMode

__all__ = ["LAYOUT_KEYS", "SweepError", "SweepPoint", "SweepSpec", "check_profiles", "derive_points", "parse_layouts",
           "parse_world_sizes"]

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
    """What to sweep: the recipe's emulation at each world size (x each layout, x each hardware profile)."""

    recipe: Recipe
    world_sizes: tuple[int, ...]
    layouts: tuple[Layout, ...] = ()
    """Empty: the recipe's layout only."""
    profiles: tuple[str, ...] = ()
    """Hardware profiles (names or YAML paths) to run each point on, a what-if of the cluster: each must name a
    GPU model unless the emulation sets ``gpu`` (which then stays, and only the network changes). Empty: the
    emulation's profile."""
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
    """``n<N>``, ``n<N>_<layout>`` when layouts are swept, ``_<profile>`` appended when profiles are: the point's
    folder and its emulation's name (e.g. ``n512_tp2_dgx_a100``)."""
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
    """Every (profile, layout, world size) point of `spec`, validated before anything runs.

    Example: llama-1b (micro 1), world sizes 512, 2048 at global batch 2048 -> n512 (dp 512, accumulation 4),
    n2048 (dp 2048, accumulation 1).
    """
    recipe = spec.recipe
    emu = spec.base_emulation()
    check_profiles(spec.profiles, emu, recipe)
    layouts = spec.layouts or (recipe.layout,)
    rank = emu.runs[0][0] if spec.rank is None else spec.rank
    micro = recipe.model.micro_batch_size
    points = []
    for profile, layout, n in ((pr, lay, n) for pr in spec.profiles or (None,) for lay in layouts
                               for n in spec.world_sizes):
        name = f"n{n}" if not spec.layouts else f"n{n}_{_layout_label(layout)}"
        if profile is not None:
            name += "_" + _profile_label(profile)
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
                                 recipe=_point_recipe(recipe, emu, name, n, layout, rank, accumulation, spec.oom,
                                                      profile)))
    return points


def _profile_label(profile: str) -> str:
    """``dgx-a100`` -> ``dgx_a100``; a YAML path -> its file name's stem, likewise."""
    stem = Path(profile).stem if profile.endswith((".yaml", ".yml")) else profile
    return re.sub(r"\W", "_", stem)


def check_profiles(spec_profiles: tuple[str, ...], emu: Emulation, recipe: Recipe) -> None:
    """Each swept profile loads and gives the virtual GPUs a model (SweepError naming --profiles otherwise)."""
    from prism_plugin.cost.profiles import load_profile

    for name in spec_profiles:
        resolved = recipe.resolve_profile(dataclasses.replace(emu, profile=name))
        try:
            profile = load_profile(resolved)
        except ConfigError as exc:
            raise SweepError(f"--profiles {name!r}: {exc}") from None
        if profile.gpu is None and emu.gpu is None:
            raise SweepError(f"--profiles {name!r} names no GPU model (a CPU profile); sweep GPU profiles such as "
                             "dgx-h100 or dgx-a100, or set the emulation's gpu")


def _point_recipe(recipe: Recipe, emu: Emulation, name: str, world_size: int, layout: Layout, rank: int,
                  accumulation: int, oom: OomMode | None, profile: str | None) -> Recipe:
    try:  # the recipe schema's own checks (layout vs program, gpus_per_node vs N, ...) run on the point
        # the schema needs stated figures on a virtual-GPU emulation; a sweep reports figures and checks none
        point = dataclasses.replace(emu, name=name, world_size=world_size, runs=((rank,),), ranks=None,
                                    oom=emu.oom if oom is None else oom, expect=Expect(fits=True),
                                    profile=emu.profile if profile is None else profile)
        model = dataclasses.replace(recipe.model, microbatches_per_step=accumulation)
        return dataclasses.replace(recipe, model=model, layout=layout, emulated=(point,))
    except ConfigError as exc:
        raise SweepError(f"point {name}: {exc}") from None


