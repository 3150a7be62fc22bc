"""The recipe schema: a paired real small-scale run and emulated run(s), with the figures to compare.

A recipe (``recipes/*.yaml``) names a training program (`framework`: the torch toy, Megatron-core's GPT,
DeepSpeed), its model sizes, its parallel layout, how many steps to run and discard, the **real run**
(a layout that fits this machine, every rank a real process) and one or more **emulations** (N ranks,
a few of them real), which ranks to compare, and the tolerances a comparison must meet. Example::

    name: toy-tp2-dp2
    framework: torch
    model: {hidden_size: 256, micro_batch_size: 16}
    layout: {tp: 2}
    steps: {total: 10, warmup: 3}
    real: {world_size: 4}                       # dp = 4 / tp 2 = 2
    emulated:
      - {name: n4, world_size: 4, runs: [[0], [1], [2], [3]], profile: local-cpu-gloo}
    tolerances:
      memory_bytes: 0
      step_time_rel: 0.30                       # >= 2 x the recorded noise below
      noise: {runs: 5, spread_rel: 0.12, measured_on: "2-core VM, 2026-05"}

Semantics:
- `emulated[i].runs` lists the real-rank sets of that emulation; all of them are launched at the same
  time, each set as one emulation (a set of two ranks shares data through inner real groups). Several
  one-rank runs load the machine like the real run does (one process per rank), which is what makes
  CPU step times comparable on a machine with fewer cores than ranks.
- `compare_with` is ``real`` (the paired real run) or the `name` of an earlier emulation; `ranks` pairs
  a reference rank with an emulated rank (default: every emulated real rank with itself, which needs
  equal world sizes). With ``step_time_adjust: modelled_comm`` the emulated step time is compared after
  subtracting the change in modelled communication per step between the two emulations (scale
  recipes: what is left must not depend on N).
- Tolerances (recipe-wide, or per emulation with its own `tolerances`): memory exact by default
  (``memory_bytes: 0``); step time as a relative error of the median and of the mean step time, never
  tighter than the run-to-run noise of the real run recorded in `noise` (``prism recipe noise``
  measures it); loss relative error (0: exact, the recorded data policy), or null to report only.

- Virtual GPUs (`prism_plugin.recipes.virtual_gpu`): an emulation with ``device: virtual-gpu`` runs a CUDA
  program (``program: llama``) on fake cuda tensors; with ``compare_with: none`` its `expect` states the exact
  modelled memory (peak allocated / reserved bytes, fits, OOMs); ``real: none`` when no emulation compares
  with a real run.

- Faults: an emulation's `faults` (`prism_plugin.config.faults` specs, checked against its world size) go to its
  run as ``--fault`` / ``--prism-fault`` / the DeepSpeed section's ``"faults"``; its `expect` (`Expect`)
  states what they must produce: a failure (error text, within a time) or figures (who is waited on and
  how long, how much the modelled communication grows), checked by `prism_plugin.recipes.expect`.

Reading YAML: `prism_plugin.recipes.load` (`load_recipe`). Pure: stdlib and the cost layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from prism_plugin.config.emulation import VirtualWorld, check_fault_nodes
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.faults import check_fault_ranks, parse_faults
from prism_plugin.config.kinds import DataPolicy, DeviceMode, Framework
from prism_plugin.recipes.expect_schema import Expect
from prism_plugin.recipes.schema_common import RecipeError
from prism_plugin.recipes.schema_common import enum_field as _enum
from prism_plugin.recipes.schema_common import fraction as _fraction
from prism_plugin.recipes.schema_common import positive_int as _positive_int
from prism_plugin.recipes.virtual_gpu import (
    NO_REFERENCE,
    OomMode,
    TorchProgram,
    check_device,
    check_virtual_gpu_recipe,
)

__all__ = [
    "Emulation", "Expect", "Framework", "Layout", "ModelSpec", "Noise", "RealLauncher", "RealRun", "Recipe",
    "RecipeError", "StepAdjust", "Steps", "Tier", "Tolerances",
]


class RealLauncher(StrEnum):
    PLAIN = "plain"  # the unmodified program on gloo, every rank a process (no prism at all)
    PRISM = "prism"  # every rank a real process under the prism backend (needed for recordings)
    NONE = "none"  # no real run (``real: none``): every emulation states its own figures (virtual GPUs)


class StepAdjust(StrEnum):
    NONE = "none"
    MODELLED_COMM = "modelled_comm"  # subtract the change in modelled communication per step


class Tier(StrEnum):
    CI = "ci"  # small, and run by CI's integration tests (their total time is budgeted)
    SMALL = "small"  # small CPU recipe (well under a minute or two here), run by hand: not in CI's time budget
    BENCHMARK = "benchmark"  # scale recipes: run by the benchmark (benchmarks/recipes.py), not in CI
    FAULTS = "faults"  # fault demonstrations (recipes/fault-*.yaml), run by test_fault_recipes_end_to_end.py
    VIRTUAL_GPU = "virtual-gpu"  # real-size jobs on virtual GPUs (recipes/virtual-gpu-*.yaml), emulation only


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Model sizes; each framework reads the fields it needs (`Recipe` checks they are given)."""

    hidden_size: int
    num_layers: int = 1
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    micro_batch_size: int = 1
    microbatches_per_step: int = 1
    """Micro-batches per data-parallel replica per step (Megatron: global batch = micro x this x dp;
    DeepSpeed: gradient_accumulation_steps). Fixed per replica so real and emulated ranks do equal work."""
    num_experts: int | None = None
    num_query_groups: int | None = None
    """Key/value heads of grouped-query attention (program: llama; None: one per attention head)."""
    extra_args: tuple[str, ...] = ()
    """Passed verbatim to the program (e.g. ``[--sequence-parallel]``)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "micro_batch_size", "microbatches_per_step"):
            _positive_int(getattr(self, name), f"model.{name}")
        for name in ("num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size", "num_experts",
                     "num_query_groups"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"model.{name}")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise RecipeError(f"model.extra_args must be a list of strings, got {self.extra_args!r}")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Parallel sizes other than data parallelism (dp = world_size / (tp x pp x cp), per run)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallelism (Megatron MoE): divides dp x cp."""
    vpp: int | None = None
    """Megatron interleaved pipeline: model chunks per stage (needs pp > 1)."""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0-3 (DeepSpeed recipes only)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            _positive_int(getattr(self, name), f"layout.{name}")
        if self.vpp is not None:
            _positive_int(self.vpp, "layout.vpp")
            if self.pp < 2:
                raise RecipeError("layout.vpp (interleaved pipeline) needs layout.pp >= 2; set pp or drop vpp")
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3)):
            raise RecipeError(f"layout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int, where: str) -> int:
        """Data-parallel size at `world_size` (RecipeError naming `where` when the layout does not divide it).

        Example: Layout(tp=2, pp=2).dp(8192, "emulated[0]") == 2048  (8192 / (2 x 2)).
        """
        if world_size % self.model_parallel:
            raise RecipeError(
                f"{where}.world_size={world_size} is not a multiple of tp x pp x cp = {self.model_parallel}; "
                f"use a multiple, e.g. {self.model_parallel * max(1, world_size // self.model_parallel)}"
            )
        dp = world_size // self.model_parallel
        if (dp * self.cp) % self.ep:
            raise RecipeError(f"{where}: layout.ep={self.ep} must divide dp x cp = {dp * self.cp} at world_size "
                              f"{world_size}")
        return dp


@dataclass(frozen=True, kw_only=True, slots=True)
class Steps:
    """Training steps per run; the first `warmup` are discarded (step 0 is always discarded)."""

    total: int
    warmup: int = 2

    def __post_init__(self) -> None:
        _positive_int(self.total, "steps.total")
        _positive_int(self.warmup, "steps.warmup")
        if self.total - self.warmup < 2:
            raise RecipeError(f"steps: total={self.total} leaves {self.total - self.warmup} measured steps after "
                              f"warmup={self.warmup}; measure at least 2 (raise total)")

    @property
    def measured(self) -> int:
        return self.total - self.warmup


@dataclass(frozen=True, kw_only=True, slots=True)
class RealRun:
    """The paired real run: every one of its `world_size` ranks is a local process (``real: none``: no real run,
    `RealRun.none()`, world_size 0)."""

    world_size: int
    launcher: RealLauncher = RealLauncher.PLAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "launcher", _enum(RealLauncher, self.launcher, "real.launcher"))
        if self.launcher is RealLauncher.NONE:
            if self.world_size != 0:
                raise RecipeError("real: launcher none is no real run: write real: none")
            return
        _positive_int(self.world_size, "real.world_size")

    @classmethod
    def none(cls) -> RealRun:
        return cls(world_size=0, launcher=RealLauncher.NONE)

    @property
    def exists(self) -> bool:
        return self.launcher is not RealLauncher.NONE


@dataclass(frozen=True, kw_only=True, slots=True)
class Emulation:
    """One emulated job: N ranks, `runs` real-rank sets launched together, compared with a reference."""

    name: str
    world_size: int
    runs: tuple[tuple[int, ...], ...]
    profile: str = "local-cpu-gloo"
    """Hardware profile name, or a YAML path (relative paths are relative to the recipe file)."""
    gpus_per_node: int = 8
    data_policy: DataPolicy = DataPolicy.MIRROR
    compare_with: str = "real"
    ranks: tuple[tuple[int, int], ...] | None = None
    """(reference rank, emulated rank) pairs; None: each emulated real rank with itself."""
    step_time_adjust: StepAdjust = StepAdjust.NONE
    tolerances: Tolerances | None = None
    """Replaces the recipe's tolerances for this emulation's comparisons (None: the recipe's)."""
    faults: tuple[str, ...] = ()
    """Fault specs (`prism_plugin.config.faults`), passed as ``--fault`` / ``--prism-fault`` / ds ``"faults"``."""
    timeout: float | None = None
    """The job's collective timeout, seconds: the setting ``timeout`` (``--timeout`` / ``--prism-timeout``; the
    older key ``timeout_s`` is read too); None: the launcher's default."""
    expect: Expect | None = None
    """What the faults (or a virtual GPU) must produce (`Expect`); None: the run must succeed, compared as usual."""
    device: DeviceMode = DeviceMode.REAL
    """``virtual-gpu``: ``prism run --device virtual-gpu`` (`prism_plugin.recipes.virtual_gpu`)."""
    gpu: str | None = None
    """The virtual GPUs' model (``prism run --gpu``), e.g. h100-sxm; None: the profile's."""
    oom: OomMode = OomMode.RAISE
    """virtual-gpu: ``report`` counts allocations past the GPU's memory and runs on (PRISM_VIRTUAL_GPU_OOM)."""

    def __post_init__(self) -> None:
        where = f"emulated[{self.name}]"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise RecipeError(f"emulated[].name must be a short identifier (letters, digits, _), got {self.name!r}")
        _positive_int(self.world_size, f"{where}.world_size")
        _positive_int(self.gpus_per_node, f"{where}.gpus_per_node")
        object.__setattr__(self, "data_policy", _enum(DataPolicy, self.data_policy, f"{where}.data_policy"))
        object.__setattr__(self, "step_time_adjust", _enum(StepAdjust, self.step_time_adjust,
                                                           f"{where}.step_time_adjust"))
        object.__setattr__(self, "device", _enum(DeviceMode, self.device, f"{where}.device"))
        object.__setattr__(self, "oom", _enum(OomMode, self.oom, f"{where}.oom"))
        if isinstance(self.runs, str) or not self.runs:
            raise RecipeError(f"{where}.runs must be a non-empty list of real-rank lists, e.g. [[0], [3]]")
        runs = tuple(tuple(_rank_list(r, f"{where}.runs")) for r in self.runs)
        flat = [r for run in runs for r in run]
        if len(set(flat)) != len(flat):
            raise RecipeError(f"{where}.runs lists a rank twice ({flat}); each real rank belongs to one run")
        bad = [r for r in flat if not 0 <= r < self.world_size]
        if bad:
            raise RecipeError(f"{where}.runs: ranks {bad} are outside 0..{self.world_size - 1}")
        object.__setattr__(self, "runs", runs)
        try:  # gpus_per_node dividing world_size, as prism run checks it
            world = VirtualWorld(world_size=self.world_size, real_ranks=flat, gpus_per_node=self.gpus_per_node)
        except ConfigError as exc:
            raise RecipeError(f"{where}: {exc}") from None
        if self.ranks is not None:
            pairs = []
            for pair in self.ranks:
                if isinstance(pair, str) or len(pair) != 2:
                    raise RecipeError(f"{where}.ranks: each entry is [reference rank, emulated rank], got {pair!r}")
                ref, emu = (_positive_int(x, f"{where}.ranks", zero=True) for x in pair)
                if emu not in flat:
                    raise RecipeError(f"{where}.ranks: emulated rank {emu} is not real in any run {list(runs)}; "
                                      "add it to runs or compare another rank")
                pairs.append((ref, emu))
            object.__setattr__(self, "ranks", tuple(pairs))
        if not isinstance(self.profile, str) or not self.profile:
            raise RecipeError(f"{where}.profile must be a profile name (see `prism profiles`) or a YAML path")
        self._check_faults(where, world)
        check_device(self, where, RecipeError)

    def _check_faults(self, where: str, world: VirtualWorld) -> None:
        if isinstance(self.faults, str) or not all(isinstance(f, str) for f in self.faults):
            raise RecipeError(f"{where}.faults must be a list of fault strings, e.g. [\"straggler:ranks=1,factor=2\"]")
        faults = tuple(self.faults)
        try:
            specs = parse_faults(faults)
            check_fault_ranks(specs, self.world_size)
            check_fault_nodes(specs, world)  # link:nodes=A/B names nodes the job has
        except ConfigError as exc:
            raise RecipeError(f"{where}.faults: {exc}") from None
        object.__setattr__(self, "faults", faults)
        if self.timeout is not None:
            object.__setattr__(self, "timeout", _fraction(self.timeout, f"{where}.timeout"))
            if not self.timeout:
                raise RecipeError(f"{where}.timeout must be > 0 seconds, e.g. 3")
        if self.expect is None:
            return
        if not isinstance(self.expect, Expect):
            raise RecipeError(f"{where}.expect must be a mapping (failure/within_s, blame_root/wait_ms, comm_factor)")
        if not faults and not (self.device is DeviceMode.VIRTUAL_GPU
                               and (self.expect.states_memory or self.expect.failure is not None)):
            raise RecipeError(f"{where}.expect needs faults: the expectation states what the faults produce")
        self.expect.check(f"{where}.expect")
        if self.expect.blame_root is not None and self.expect.blame_root >= self.world_size:
            raise RecipeError(f"{where}.expect.blame_root={self.expect.blame_root} is outside 0..{self.world_size - 1}")

    @property
    def expects_failure(self) -> bool:
        return self.expect is not None and self.expect.failure is not None

    @property
    def real_ranks(self) -> tuple[int, ...]:
        return tuple(r for run in self.runs for r in run)


@dataclass(frozen=True, kw_only=True, slots=True)
class Noise:
    """Measured run-to-run noise of the real run's step time (``prism recipe noise``)."""

    runs: int
    """Repetitions of the real run it was measured over (>= 3)."""
    spread_rel: float
    """max over compared ranks of max_i |median_i - median| / median (median_i: one run's median step), the
    run farthest from the median discarded when runs >= 5 (see `prism_plugin.recipes.compare.noise_spread`)."""
    measured_on: str = ""
    """Machine and date, free text."""

    def __post_init__(self) -> None:
        if _positive_int(self.runs, "tolerances.noise.runs") < 3:
            raise RecipeError("tolerances.noise.runs must be >= 3: a spread needs several repetitions")
        object.__setattr__(self, "spread_rel", _fraction(self.spread_rel, "tolerances.noise.spread_rel"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerances:
    """What a comparison must meet (see the module docstring)."""

    memory_bytes: int = 0
    """Allowed |emulated - real| peak bytes; 0 = exact."""
    step_time_rel: float | None = None
    """The two-sided band of the median step time: emulated / reference from 1 / (1 + t) to 1 + t (None: report;
    `prism_plugin.recipes.compare`)."""
    loss_rel: float | None = None
    """Allowed relative error of the first-step loss (0: exact; None: report only)."""
    noise: Noise | None = None
    """The measured noise that justifies `step_time_rel`; required when step_time_rel is set."""
    noise_factor: float = 2.0
    """step_time_rel must be >= noise_factor x noise.spread_rel (default 2: a run's error adds the real
    run's and the emulated run's own noise)."""

    def __post_init__(self) -> None:
        _positive_int(self.memory_bytes, "tolerances.memory_bytes", zero=True)
        if self.loss_rel is not None:
            object.__setattr__(self, "loss_rel", _fraction(self.loss_rel, "tolerances.loss_rel"))
        object.__setattr__(self, "noise_factor", _fraction(self.noise_factor, "tolerances.noise_factor"))
        if self.step_time_rel is None:
            return
        object.__setattr__(self, "step_time_rel", _fraction(self.step_time_rel, "tolerances.step_time_rel"))
        if self.noise is None:
            raise RecipeError("tolerances.step_time_rel needs tolerances.noise (the real run's measured run-to-run "
                              "noise): run `prism recipe noise <recipe>` and paste its output, or set "
                              "step_time_rel: null to report step times without checking them")
        floor = self.noise_factor * self.noise.spread_rel
        if self.step_time_rel < floor - 1e-12:
            raise RecipeError(
                f"tolerances.step_time_rel={self.step_time_rel:g} is tighter than noise_factor x measured noise = "
                f"{self.noise_factor:g} x {self.noise.spread_rel:g} = {floor:.4g}; raise it to at least {floor:.4g} "
                "or re-measure the noise"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """A complete recipe; cross-field checks at construction (`load_recipe` reads YAML into it)."""

    name: str
    framework: Framework
    model: ModelSpec
    layout: Layout
    steps: Steps
    real: RealRun
    emulated: tuple[Emulation, ...]
    tolerances: Tolerances
    description: str = ""
    tier: Tier = Tier.CI
    repeats: int = 1
    """Times the whole sequence (real run, emulations) runs, interleaved; measured steps are pooled. At least 3
    when a step time is checked: the spread of the repeats is the run's own noise (`compare`)."""
    program: TorchProgram = TorchProgram.TOY
    """framework torch: ``toy`` (toy_train) or ``llama`` (llama_ddp, a CUDA program for virtual GPUs)."""
    source: Path | None = None
    """The YAML file this recipe came from (relative profile paths resolve against its folder)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() or c in "/\\" for c in self.name):
            raise RecipeError(f"name must be a non-empty string without spaces or slashes, got {self.name!r}")
        object.__setattr__(self, "framework", _enum(Framework, self.framework, "framework"))
        object.__setattr__(self, "tier", _enum(Tier, self.tier, "tier"))
        object.__setattr__(self, "program", _enum(TorchProgram, self.program, "program"))
        _positive_int(self.repeats, "repeats")
        if self.real.exists:
            self.layout.dp(self.real.world_size, "real")
        if not self.emulated:
            raise RecipeError("emulated must list at least one emulation (name, world_size, runs)")
        names: dict[str, Emulation] = {}
        for emu in self.emulated:
            self._check_emulation(emu, names)
            names[emu.name] = emu
        self._check_framework()
        check_virtual_gpu_recipe(self, RecipeError)
        checked = [e.name for e in self.emulated if self.tolerances_for(e).step_time_rel is not None
                   and not e.expects_failure and e.compare_with != "none"]
        if checked and self.repeats < 3:
            raise RecipeError(
                f"repeats: {self.repeats}, but emulation(s) {', '.join(checked)} check step time "
                "(tolerances.step_time_rel): its width is held against the run-to-run noise measured in the same "
                "run, which needs repeats: 3 or more; set repeats: 3, or step_time_rel: null to report step times")

    def _check_emulation(self, emu: Emulation, earlier: Mapping[str, Emulation]) -> None:
        where = f"emulated[{emu.name}]"
        if emu.name in earlier or emu.name == "real":
            raise RecipeError(f"{where}.name is used twice (or is 'real'); give each emulation its own name")
        self.layout.dp(emu.world_size, where)
        if emu.compare_with == NO_REFERENCE:
            return
        if emu.compare_with == "real" and not self.real.exists:
            raise RecipeError(f"{where}.compare_with: real, but real: none; compare with none or give a real run")
        if emu.compare_with == "real":
            ref_world = self.real.world_size
            if emu.step_time_adjust is not StepAdjust.NONE:
                raise RecipeError(f"{where}.step_time_adjust: the real run has no modelled communication; "
                                  "adjust only against another emulation (compare_with: <its name>)")
        elif emu.compare_with in earlier:
            if earlier[emu.compare_with].expects_failure or earlier[emu.compare_with].compare_with == NO_REFERENCE:
                raise RecipeError(f"{where}.compare_with={emu.compare_with!r} is expected to fail (no figures); "
                                  "compare with real or a run that completes")
            ref_world = earlier[emu.compare_with].world_size
        else:
            raise RecipeError(f"{where}.compare_with={emu.compare_with!r}: use 'real' or the name of an earlier "
                              f"emulation ({', '.join(earlier) or 'none yet'}), or none (device: virtual-gpu)")
        if emu.ranks is None and emu.world_size != ref_world:
            raise RecipeError(f"{where}.ranks is needed: world sizes differ ({ref_world} vs {emu.world_size}), so say "
                              "which reference rank each emulated rank is compared with, e.g. [[0, 0], [3, 8191]]")
        for ref, _ in emu.ranks or ():
            if ref >= ref_world:
                raise RecipeError(f"{where}.ranks: reference rank {ref} is outside 0..{ref_world - 1}")
        if emu.ranks is None:
            bad = [r for r in emu.real_ranks if r >= ref_world]
            if bad:
                raise RecipeError(f"{where}: ranks {bad} do not exist in the reference run")
        if emu.data_policy is DataPolicy.RECORDED:
            if emu.compare_with != "real" or self.real.launcher is not RealLauncher.PRISM \
                    or emu.world_size != self.real.world_size:
                raise RecipeError(f"{where}.data_policy=recorded replays the real run's payloads: it needs "
                                  "compare_with: real, real.launcher: prism (the recording run) and the real run's "
                                  "world_size")
        if emu.timeout is not None and self.framework is Framework.DEEPSPEED:
            raise RecipeError(f"{where}.timeout: a DeepSpeed job's timeout is init_distributed(timeout=...) in its "
                              "program; remove timeout (recipes set it for torch and megatron)")
        if emu.data_policy is DataPolicy.ZEROS:
            raise RecipeError(f"{where}.data_policy=zeros gives meaningless losses; use mirror or recorded")

    def _check_framework(self) -> None:
        lay, model = self.layout, self.model
        if self.framework is Framework.TORCH:
            if (lay.pp, lay.cp, lay.ep, lay.vpp, lay.zero_stage) != (1, 1, 1, None, None):
                raise RecipeError("framework torch (the toy TP x DP program) supports layout.tp only; "
                                  "remove pp/cp/ep/vpp/zero_stage or use framework megatron/deepspeed")
            if (4 * model.hidden_size) % lay.tp:
                raise RecipeError(f"model.hidden_size x 4 = {4 * model.hidden_size} must divide by layout.tp={lay.tp}")
        elif self.framework is Framework.MEGATRON:
            for name in ("num_attention_heads", "seq_length", "vocab_size"):
                if getattr(model, name) is None:
                    raise RecipeError(f"framework megatron needs model.{name}")
            if lay.zero_stage is not None:
                raise RecipeError("layout.zero_stage is DeepSpeed's; Megatron uses --use-distributed-optimizer "
                                  "(model.extra_args)")
            if model.num_layers % (lay.pp * (lay.vpp or 1)):
                raise RecipeError(f"model.num_layers={model.num_layers} must divide by pp x vpp = "
                                  f"{lay.pp * (lay.vpp or 1)}")
            if model.num_attention_heads % lay.tp:  # type: ignore[operator]
                raise RecipeError(f"model.num_attention_heads={model.num_attention_heads} must divide by "
                                  f"layout.tp={lay.tp}")
            if lay.ep > 1 and not model.num_experts:
                raise RecipeError("layout.ep > 1 needs model.num_experts (a MoE model)")
            if model.num_experts and model.num_experts % lay.ep:
                raise RecipeError(f"model.num_experts={model.num_experts} must divide by layout.ep={lay.ep}")
        else:
            if lay.zero_stage is None:
                raise RecipeError("framework deepspeed needs layout.zero_stage (0-3)")
            if (lay.tp, lay.cp, lay.ep, lay.vpp) != (1, 1, 1, None):
                raise RecipeError("framework deepspeed recipes support layout.pp and zero_stage only")
            if lay.pp > 1 and lay.zero_stage > 1:
                raise RecipeError(f"DeepSpeed pipeline parallelism (pp={lay.pp}) works with ZeRO stage 0 or 1, not "
                                  f"{lay.zero_stage}; lower layout.zero_stage")
            if model.num_layers % lay.pp:
                raise RecipeError(f"model.num_layers={model.num_layers} must divide by layout.pp={lay.pp}")

    def tolerances_for(self, emu: Emulation) -> Tolerances:
        """The tolerances `emu`'s comparisons must meet (its own, else the recipe's)."""
        return emu.tolerances if emu.tolerances is not None else self.tolerances

    def emulation(self, name: str) -> Emulation:
        for emu in self.emulated:
            if emu.name == name:
                return emu
        raise KeyError(name)

    def resolve_profile(self, emu: Emulation) -> str:
        """The profile argument for `prism run`: a built-in name, or a path made absolute."""
        from prism_plugin.cost.profiles import _looks_like_path

        if _looks_like_path(emu.profile) and self.source is not None and not Path(emu.profile).is_absolute():
            return str((self.source.parent / emu.profile).resolve())
        return emu.profile


def _rank_list(value: Any, where: str) -> list[int]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise RecipeError(f"{where}: each run is a non-empty list of ranks, e.g. [0] or [0, 3]; got {value!r}")
    return [_positive_int(r, where, zero=True) for r in value]
