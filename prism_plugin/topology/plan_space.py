"""The layouts ``prism plan`` may try: every Megatron layout of a model on N GPUs, and why the others fail.

`enumerate_layouts` walks the combinations of a `Space` (tp, pp, vp, cp, ep, etp, micro-batch, recompute,
distributed optimizer, FP8) and keeps each one Megatron-core 0.19 accepts for the model, GPU count, global
batch and sequence; every other combination is counted once, under the first of `RULES` that excludes it.
`no_candidate_message` turns an empty result into the sentence the CLI prints. The later stages of the
planner (memory pruning, emulation, ranking) take `Enumeration.candidates`.

    >>> from prism_plugin.config.models import preset
    >>> found = enumerate_layouts(preset("llama3-70b"), gpus=64, global_batch=128, seq=8192, space=Space())
    >>> len(found.candidates), found.combinations
    (9372, 20736)
    >>> found.candidates[0].label(), found.candidates[-1].label()
    ('tp1 pp1 vp1 cp1 ep1 mbs1 norc nodopt bf16', 'tp8 pp8 vp10 cp1 ep1 mbs4 full dopt fp8')
    >>> found.rejected.most_common(2)
    [('tp*pp*cp divides gpus', 11160), ('pp divides micro-batches', 192)]

Limitations: only rules a layout can break are checked, none of memory or speed (a valid layout may still
not fit the GPU). Not enumerated: uneven pipelines (``--decoder-first-pipeline-num-layers``,
``--pipeline-model-parallel-layout``), hierarchical CP, FSDP, expert tp other than 1 or tp, rank orders other
than "tp-cp-ep-dp-pp". Sequence parallelism is on whenever tp > 1 (this planner's choice, as in NVIDIA's
recipes; Megatron asks for it with experts and tp). Sources cited are files of the installed megatron-core 0.19.2.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from prism_plugin.config.errors import ConfigError, coerce_enum, int_at_least, positive_int
from prism_plugin.config.models import ModelPreset
from prism_plugin.topology.megatron import MegatronLayout

__all__ = ["RULES", "Candidate", "Enumeration", "ExpertTp", "Recompute", "Rule", "Space", "enumerate_layouts",
           "no_candidate_message"]


class Recompute(StrEnum):
    """Activation recomputation; the value is Megatron's ``--recompute-granularity`` (none: no flag)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class ExpertTp(StrEnum):
    """How a candidate's expert tensor-parallel size follows from its tp."""

    SAME_AS_TP = "tp"  # etp = tp, Megatron's default without --expert-tensor-parallel-size
    ONE = "1"  # etp = 1: each expert's matrices whole on one rank


_LABEL = {Recompute.NONE: "norc", Recompute.SELECTIVE: "sel", Recompute.FULL: "full"}
_RECOMPUTE_ARGS = {Recompute.NONE: [], Recompute.SELECTIVE: ["--recompute-granularity", "selective"],
                   Recompute.FULL: ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"]}


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One valid layout: parallel sizes, micro-batch, recompute, optimizer and precision.

    >>> c = Candidate(tp=8, pp=4, vp=2, cp=1, ep=1, etp=8, dp=4, micro_batch=1, recompute=Recompute.SELECTIVE,
    ...               distributed_optimizer=True, fp8=True)
    >>> c.label()
    'tp8 pp4 vp2 cp1 ep1 mbs1 sel dopt fp8'
    """

    tp: int
    pp: int
    vp: int | None
    """Virtual stages per pipeline rank (Megatron's virtual_pipeline_model_parallel_size); None: no interleaving."""
    cp: int
    ep: int
    etp: int
    dp: int
    """Data-parallel size of the dense layers: gpus // (tp * pp * cp)."""
    micro_batch: int
    recompute: Recompute
    distributed_optimizer: bool
    fp8: bool

    def label(self) -> str:
        """A short name, each axis in a fixed place; vp1 is no interleaving; etp shows only when it is not tp."""
        etp = f" etp{self.etp}" if self.etp != self.tp else ""
        return (f"tp{self.tp} pp{self.pp} vp{self.vp or 1} cp{self.cp} ep{self.ep}{etp} mbs{self.micro_batch} "
                f"{_LABEL[self.recompute]} {'dopt' if self.distributed_optimizer else 'nodopt'} "
                f"{'fp8' if self.fp8 else 'bf16'}")

    def megatron_args(self) -> list[str]:
        """The ``pretrain_gpt.py`` flags of this layout; the job adds the model, batch, ``--bf16`` and data.

        vp goes as ``--num-virtual-stages-per-pipeline-rank``: the VP of NVIDIA's tables, taken as is by Megatron
        (training/arguments.py:validate_args) and, unlike ``--num-layers-per-virtual-pipeline-stage``, accepted with
        uneven first and last stages. Full recompute: every layer (uniform, a layer a unit); selective: core attention.

        >>> " ".join(Candidate(tp=2, pp=2, vp=None, cp=1, ep=1, etp=2, dp=2, micro_batch=1,
        ...   recompute=Recompute.FULL, distributed_optimizer=False, fp8=False).megatron_args()[-7:])
        '--sequence-parallel --recompute-granularity full --recompute-method uniform --recompute-num-layers 1'
        """
        args = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.vp is not None:
            args += ["--num-virtual-stages-per-pipeline-rank", str(self.vp)]
        args += ["--context-parallel-size", str(self.cp), "--expert-model-parallel-size", str(self.ep),
                 "--expert-tensor-parallel-size", str(self.etp), "--micro-batch-size", str(self.micro_batch)]
        if self.tp > 1:
            args.append("--sequence-parallel")
        args += _RECOMPUTE_ARGS[self.recompute]
        if self.distributed_optimizer:
            args.append("--use-distributed-optimizer")
        if self.fp8:
            args += ["--fp8-format", "hybrid"]
        return args


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


_EXAMPLES = {"tp": "(1, 2, 4, 8)", "pp": "(1, 2, 4)", "vp": "(None, 2)", "cp": "(1, 2)", "ep": "(1,)",
             "etp": "(ExpertTp.SAME_AS_TP,)", "micro_batch": "(1, 2)", "recompute": "(Recompute.NONE,)",
             "distributed_optimizer": "(True,)", "fp8": "(False,)"}  # each axis of a Space, a valid value


@dataclass(frozen=True, kw_only=True, slots=True)
class Space:
    """The values each axis may take. An axis left None fits the model (and the GPU, for fp8).

    >>> Space(tp=(8,), fp8_supported=False).fp8
    (False,)
    """

    tp: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor-parallel sizes: powers of two up to one node of 8 GPUs."""
    pp: tuple[int, ...] | None = None
    """Pipeline sizes; None: every divisor of the layer count."""
    vp: tuple[int | None, ...] | None = None
    """Virtual stages per pipeline rank (each >= 2; None in the tuple: no interleaving); None: no interleaving
    and, for each pp > 1, every vp >= 2 that divides layers / pp."""
    cp: tuple[int, ...] = (1, 2, 4, 8)
    """Context-parallel sizes."""
    ep: tuple[int, ...] | None = None
    """Expert-parallel sizes; None: every divisor of the expert count, (1,) for a dense model."""
    etp: tuple[ExpertTp, ...] | None = None
    """Expert tensor-parallel choices; None: both for a mixture of experts, SAME_AS_TP for a dense model."""
    micro_batch: tuple[int, ...] = (1, 2, 4)
    """Micro-batch sizes (sequences per micro-batch)."""
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    """Activation recomputation choices."""
    distributed_optimizer: tuple[bool, ...] = (False, True)
    """Megatron's distributed optimizer off and on."""
    fp8: tuple[bool, ...] | None = None
    """BF16 (False) and FP8 (True, ``--fp8-format hybrid``); None: both where `fp8_supported`, else BF16 only."""
    fp8_supported: bool = True
    """Whether the GPU has FP8 tensor cores (H100 and later); False excludes every fp8 candidate."""

    def __post_init__(self) -> None:
        if self.fp8 is None:
            object.__setattr__(self, "fp8", (False, True) if self.fp8_supported else (False,))
        for name, example in _EXAMPLES.items():
            values = getattr(self, name)
            if values is not None and (not isinstance(values, tuple) or not values):
                raise ConfigError(f"Space.{name}={values!r}: give a non-empty tuple of values, e.g. {example}")
            if values is not None and len(set(values)) != len(values):
                raise ConfigError(f"Space.{name}={values!r} repeats a value: list each value once")
        for name in ("tp", "pp", "cp", "ep", "micro_batch"):
            for value in getattr(self, name) or ():
                positive_int(f"Space.{name} value", value, hint=f"list integers >= 1 in Space.{name}")
        for value in self.vp or ():
            if value is not None:
                int_at_least("Space.vp value", value, 2, hint="None is no interleaving; Megatron reads 1 as None")
        object.__setattr__(self, "etp", self.etp and tuple(coerce_enum(ExpertTp, v, "Space.etp") for v in self.etp))
        object.__setattr__(self, "recompute",
                           tuple(coerce_enum(Recompute, r, "Space.recompute") for r in self.recompute))
        for name in ("distributed_optimizer", "fp8"):
            if not all(isinstance(v, bool) for v in getattr(self, name)):
                raise ConfigError(f"Space.{name}={getattr(self, name)!r}: give a tuple of True and/or False")


@dataclass(frozen=True, slots=True)
class Rule:
    """One reason a combination is not a layout: its `name` (the key of `Enumeration.rejected`), the `reason`,
    the `source` (the megatron-core file:function that enforces it, or "planner": this planner's own choice)
    and how to loosen it (`fix`, which may name {gpus} and {gpus_per_node})."""

    name: str
    reason: str
    source: str
    fix: str


TP_HEADS = Rule("tp divides heads", "tp divides the attention heads, and the key/value groups divide or are "
                "divided by tp", "core/transformer/transformer_config.py:TransformerConfig.__post_init__",
                "allow a tp that divides the heads")
TP_FFN = Rule("tp divides ffn", "tp divides the dense MLP's ffn_hidden_size", "core/tensor_parallel/layers.py:"
              "RowParallelLinear.__init__ (divide)", "allow a tp that divides ffn_hidden_size")
TP_NODE = Rule("tp within a node", "tp's all-reduces stay on NVLink", "planner", "allow a tp <= {gpus_per_node}")
PP_LAYERS = Rule("pp divides layers", "pp divides the layer count (even pipeline stages)", "core/transformer/"
                 "transformer_block.py:get_num_layers_to_build; training/arguments.py:validate_args",
                 "allow a pp that divides the layer count")
VP_PP = Rule("vp needs pp > 1", "the interleaved schedule needs pp > 1 (pp > 2 with "
             "--no-overlap-p2p-communication)", "core/parallel_state.py:initialize_model_parallel; "
             "training/arguments.py:validate_args", "allow vp None or a pp > 1")
VP_LAYERS = Rule("vp divides layers/pp", "vp divides the layers of each pipeline rank",
                 "core/transformer/transformer_block.py:get_num_layers_to_build",
                 "allow a vp that divides layers / pp, or vp None")
CP_SEQ = Rule("2*cp divides seq", "with cp > 1 the sequence splits into 2 * cp chunks (load balancing)",
              "training/arguments.py:validate_args; core/utils.py:get_batch_on_this_cp_rank",
              "give a --seq divisible by 2 * cp (a multiple of 16 covers cp up to 8), or allow cp 1")
SP_SEQ = Rule("tp divides seq/cp", "sequence parallelism (tp > 1) splits each CP rank's seq / cp tokens over tp",
              "core/tensor_parallel/mappings.py:_split_along_first_dim", "give a --seq divisible by cp * tp")
GPUS = Rule("tp*pp*cp divides gpus", "the dense grid tp * pp * cp * dp fills the GPUs", "training/arguments.py:"
            "validate_args; core/parallel_state.py:initialize_model_parallel (by MegatronLayout)",
            "try a GPU count that tp * pp * cp divides (a power of two suits every tp and cp), or allow tp, pp "
            "and cp whose product divides {gpus}")
EP_DENSE = Rule("ep needs experts", "ep > 1 needs a mixture-of-experts model", "training/arguments.py:validate_args",
                "allow ep 1 for a dense model")
EP_EXPERTS = Rule("ep divides experts", "ep divides the expert count", "training/arguments.py:validate_args",
                  "allow an ep that divides the expert count")
ETP_REPEAT = Rule("etp repeats a layout", "etp 1 is etp tp when tp is 1 or the model is dense; each layout counts "
                  "once", "planner", "nothing to loosen: the layout is counted under its first etp choice")
ETP_FFN = Rule("etp divides expert ffn", "etp divides each expert's ffn_hidden_size", "core/extensions/"
               "transformer_engine.py:TEGroupedLinear.__init__ (divide)", "allow etp 1")
EXPERT_GPUS = Rule("etp*ep*pp divides gpus", "the expert grid etp * ep * pp * expert-dp fills the GPUs",
                   "core/parallel_state.py:initialize_model_parallel (by MegatronLayout)", "allow a lower ep or etp 1")
BATCH = Rule("mbs*dp divides global batch", "the global batch is a whole number of micro-batches per data rank",
             "core/num_microbatches_calculator.py:ConstantNumMicroBatchesCalculator.__init__",
             "give a --global-batch that is a multiple of {gpus}, or allow micro_batch 1")
# schedules.py:1133-1154 (0.19.2) needs pp <= group <= M and M % group == 0 or >= pp, where M is the micro-batch
# count and group is microbatch_group_size_per_vp_stage, pp by default (core/model_parallel_config.py:567-568).
VP_MICRO = Rule("pp divides micro-batches", "interleaving needs the micro-batches per data rank in multiples of pp",
                "core/pipeline_parallel/schedules.py:forward_backward_pipelining_with_interleaving",
                "give a --global-batch whose micro-batches per data rank are a multiple of pp, or allow vp None")
FP8 = Rule("fp8 needs GPU support", "FP8 needs FP8 tensor cores (H100 and later)", "planner", "leave fp8 out")

RULES: tuple[Rule, ...] = (TP_HEADS, TP_FFN, TP_NODE, PP_LAYERS, VP_PP, VP_LAYERS, CP_SEQ, SP_SEQ, GPUS,
                           EP_DENSE, EP_EXPERTS, ETP_REPEAT, ETP_FFN, EXPERT_GPUS, BATCH, VP_MICRO, FP8)
"""Every rule, in the order a combination is tested: the axes are bound tp, pp, vp, cp, ep, etp, micro-batch,
then recompute, distributed optimizer and fp8, and each rule is tested as soon as its axes are bound."""


@dataclass(frozen=True, slots=True)
class Enumeration:
    """What `enumerate_layouts` found: the valid candidates and, per rule name, the combinations it excluded."""

    model: str
    gpus: int
    global_batch: int
    seq: int
    gpus_per_node: int
    candidates: tuple[Candidate, ...]
    rejected: Counter[str]

    @property
    def combinations(self) -> int:  # every combination tried
        return len(self.candidates) + sum(self.rejected.values())


def _grid(gpus: int, tp: int, pp: int, cp: int, ep: int = 1, etp: int | None = None) -> MegatronLayout | None:
    """The rank grids on `gpus` GPUs, or None where MegatronLayout's checks (Megatron's own) refuse them."""
    try:
        return MegatronLayout(world_size=gpus, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp)
    except ValueError:
        return None


@dataclass(slots=True)
class _Walk:
    """The nested walk over the axes, a stage per method; `excluded` counts what a failing rule cuts off."""

    model: ModelPreset
    gpus: int
    global_batch: int
    seq: int
    space: Space
    gpus_per_node: int
    rejected: Counter[str] = field(default_factory=Counter)
    pp: tuple[int, ...] = ()
    ep: tuple[int, ...] = ()
    etp: tuple[ExpertTp, ...] = ()
    below: dict[str, int] = field(default_factory=dict)
    """Per axis: the combinations under one of its values (the product of the axes after it)."""

    def __post_init__(self) -> None:
        s, m, dense = self.space, self.model, self.model.num_experts is None
        self.pp = s.pp or _divisors(m.num_layers)
        self.ep = s.ep or ((1,) if m.num_experts is None else _divisors(m.num_experts))
        self.etp = s.etp or ((ExpertTp.SAME_AS_TP,) if dense else (ExpertTp.SAME_AS_TP, ExpertTp.ONE))
        sizes = (len(s.fp8 or ()), len(s.distributed_optimizer), len(s.recompute), len(s.micro_batch),
                 len(self.etp), len(self.ep), len(s.cp))  # innermost first
        self.below = dict(zip(("fp8", "dopt", "recompute", "mbs", "etp", "ep", "cp", "vp"),
                              itertools.accumulate(sizes, operator.mul, initial=1), strict=True))
        self.below["tp"] = sum(len(self.vps(pp)) for pp in self.pp) * self.below["vp"]

    def vps(self, pp: int) -> tuple[int | None, ...]:
        """The Space's vp, or no interleaving and every vp >= 2 that divides the layers of a pipeline rank."""
        layers = self.model.num_layers
        fitting = (v for v in _divisors(layers // pp) if v > 1) if pp > 1 and layers % pp == 0 else ()
        return self.space.vp or (None, *fitting)

    def excluded(self, rule: Rule | None, combinations: int) -> bool:  # counts them under `rule`, if any
        if rule is not None:
            self.rejected[rule.name] += combinations
        return rule is not None

    def dense(self) -> Iterator[tuple[int, int, int | None, int]]:
        """(tp, pp, vp, cp) that pass the rules of the dense layers."""
        m, s, seq, groups, below = self.model, self.space, self.seq, self.model.num_query_groups, self.below
        for tp in s.tp:
            if self.excluded(TP_HEADS if m.num_attention_heads % tp or (groups % tp and tp % groups) else
                             TP_FFN if m.num_experts is None and m.ffn_hidden_size % tp else  # MoE: ETP_FFN
                             TP_NODE if tp > self.gpus_per_node else None, below["tp"]):
                continue
            for pp in self.pp:
                vps = self.vps(pp)
                if self.excluded(PP_LAYERS if m.num_layers % pp else None, len(vps) * below["vp"]):
                    continue
                for vp in vps:
                    if self.excluded(None if vp is None else VP_PP if pp == 1 else
                                     VP_LAYERS if m.num_layers // pp % vp else None, below["vp"]):
                        continue
                    for cp in s.cp:
                        if not self.excluded(CP_SEQ if cp > 1 and seq % (2 * cp) else
                                             SP_SEQ if tp > 1 and (seq % cp or seq // cp % tp) else
                                             GPUS if _grid(self.gpus, tp, pp, cp) is None else None, below["cp"]):
                            yield tp, pp, vp, cp

    def experts(self, tp: int, pp: int, cp: int) -> Iterator[tuple[int, int, MegatronLayout]]:
        """(ep, etp, both grids) that pass the rules of the expert layers; a dense model's etp is its tp."""
        experts, ffn, below = self.model.num_experts, self.model.ffn_hidden_size, self.below
        for ep in self.ep:
            if self.excluded(EP_DENSE if experts is None and ep > 1 else
                             EP_EXPERTS if experts is not None and experts % ep else None, below["ep"]):
                continue
            seen: set[int] = set()
            for choice in self.etp:
                etp = tp if choice is ExpertTp.SAME_AS_TP or experts is None else 1
                repeat, split = etp in seen, experts is None or ffn % etp == 0
                seen.add(etp)
                layout = _grid(self.gpus, tp, pp, cp, ep, etp) if split and not repeat else None
                if layout is None:
                    self.excluded(ETP_REPEAT if repeat else EXPERT_GPUS if split else ETP_FFN, below["etp"])
                else:
                    yield ep, etp, layout

    def micro_batches(self, pp: int, vp: int | None, dp: int) -> Iterator[int]:
        """Micro-batch sizes that split the global batch evenly, into a multiple of pp when interleaving."""
        for mbs in self.space.micro_batch:
            count, left = divmod(self.global_batch, mbs * dp)
            rule = BATCH if left else VP_MICRO if vp is not None and count % pp else None
            if not self.excluded(rule, self.below["mbs"]):
                yield mbs


def enumerate_layouts(model: ModelPreset, gpus: int, global_batch: int, seq: int, space: Space,
                      gpus_per_node: int = 8) -> Enumeration:
    """Every layout of `model` on `gpus` GPUs that passes `RULES`, in loop order (tp, pp, vp, cp, ep, etp,
    micro-batch, recompute, distributed optimizer, fp8; each axis in the Space's order), and per rule the
    combinations it excluded.

    A rule that fails once its axes are bound excludes every completion at once (the product of the axes
    still unbound), so the time grows with the partial layouts that pass, not with every combination.
    """
    positive_int("--gpus", gpus, hint="give an integer >= 1, e.g. --gpus 1024")
    positive_int("--global-batch", global_batch, hint="give an integer >= 1, e.g. --global-batch 1024")
    positive_int("--seq", seq, hint="give an integer >= 1, e.g. --seq 8192")
    positive_int("gpus_per_node", gpus_per_node, hint="give an integer >= 1, e.g. 8")
    walk, s = _Walk(model, gpus, global_batch, seq, space, gpus_per_node), space
    found: list[Candidate] = []
    for tp, pp, vp, cp in walk.dense():
        for ep, etp, layout in walk.experts(tp, pp, cp):
            for mbs in walk.micro_batches(pp, vp, layout.dp):
                for recompute, dopt, fp8 in itertools.product(s.recompute, s.distributed_optimizer, s.fp8 or ()):
                    if not walk.excluded(FP8 if fp8 and not s.fp8_supported else None, 1):
                        found.append(Candidate(tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp, dp=layout.dp,
                                               micro_batch=mbs, recompute=recompute, distributed_optimizer=dopt,
                                               fp8=fp8))
    return Enumeration(model.name, gpus, global_batch, seq, gpus_per_node, tuple(found), walk.rejected)


def no_candidate_message(enumeration: Enumeration) -> str:
    """Why no layout is left: the rule that excluded the most combinations (the first in `RULES` on a tie),
    why, where Megatron says so, and how to loosen it.

    >>> from prism_plugin.config.models import preset
    >>> space = Space(tp=(8,), pp=(4,), cp=(1,))
    >>> print(no_candidate_message(enumerate_layouts(preset("llama3-70b"), 24, 1024, 8192, space)))
    ... # doctest: +ELLIPSIS
    no layout of llama3-70b fits 24 GPUs (global batch 1024, seq 8192): 'tp*pp*cp divides gpus' excluded 216 of 216 ...
    """
    assert not enumeration.candidates, "no_candidate_message is for an enumeration without candidates"
    e = enumeration
    top = max(RULES, key=lambda r: e.rejected[r.name])  # max keeps the first of equal counts: RULES order
    return (f"no layout of {e.model} fits {e.gpus} GPUs (global batch {e.global_batch}, seq {e.seq}): "
            f"'{top.name}' excluded {e.rejected[top.name]:,} of {e.combinations:,} combinations ({top.reason}; "
            f"{top.source}); {top.fix.format(gpus=e.gpus, gpus_per_node=e.gpus_per_node)}")
