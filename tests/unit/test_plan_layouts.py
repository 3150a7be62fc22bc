"""`prism_plugin.topology.plan_space`: the layouts ``prism plan`` enumerates, and why the others are refused.

Exact candidate lists on toy models checked by hand, a flat reference (every combination tested against every
rule in `RULES` order, no pruning) that the pruned walk must match candidate for candidate and count for count,
NVIDIA's published layouts found at their scale, the no-candidate message and the bad-input errors.
"""

from __future__ import annotations

import dataclasses
import doctest
import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.models import Activation, ModelPreset, Normalization, PositionEmbedding, preset
from prism_plugin.topology import plan_space
from prism_plugin.topology.megatron import MegatronLayout
from prism_plugin.topology.plan_space import (
    RULES,
    Candidate,
    ExpertTp,
    Recompute,
    Space,
    enumerate_layouts,
    no_candidate_message,
)


def toy(*, layers: int = 4, heads: int = 4, groups: int = 2, ffn: int = 128, experts: int | None = None,
        name: str = "toy", untied: bool = True) -> ModelPreset:
    return ModelPreset(name=name, family="test", hidden_size=16 * heads, num_layers=layers, num_attention_heads=heads,
                       num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=128, seq_length=16,
                       max_position_embeddings=16, normalization=Normalization.RMS_NORM, activation=Activation.SWIGLU,
                       position_embedding=PositionEmbedding.ROPE, rotary_base=10000, untied_embeddings=untied,
                       bias=False, num_experts=experts, moe_router_topk=None if experts is None else 2, source="test")


ONE_EACH = dict(micro_batch=(1,), recompute=(Recompute.NONE,), distributed_optimizer=(False,), fp8=(False,))
"""Pins the axes after etp, so a candidate list reads as its parallel layouts."""


def test_module_doctests() -> None:
    assert doctest.testmod(plan_space).failed == 0


def test_dense_toy_on_8_gpus_exact() -> None:
    # 4 layers, 4 heads, 2 key/value groups; 8 GPUs, global batch 4, seq 16.
    # tp8: 4 heads % 8 -> 8 combinations (2 pp x 2 vp x 2 cp). vp2 with pp1 -> 3 tp x 2 cp = 6.
    # tp4 pp2 cp2: 16 GPUs > 8 -> 2 (vp1, vp2). tp1 pp1 cp1: dp 8 does not divide the batch of 4 -> 1.
    # tp1 pp2 vp2 cp1: dp 4, 4 // 4 = 1 micro-batch, not a multiple of pp 2 -> 1.
    space = Space(tp=(1, 2, 4, 8), pp=(1, 2), vp=(None, 2), cp=(1, 2), **ONE_EACH)
    found = enumerate_layouts(toy(), gpus=8, global_batch=4, seq=16, space=space)
    parallel = ["tp1 pp1 vp1 cp2", "tp1 pp2 vp1 cp1", "tp1 pp2 vp1 cp2", "tp1 pp2 vp2 cp2",
                "tp2 pp1 vp1 cp1", "tp2 pp1 vp1 cp2", "tp2 pp2 vp1 cp1", "tp2 pp2 vp1 cp2", "tp2 pp2 vp2 cp1",
                "tp2 pp2 vp2 cp2", "tp4 pp1 vp1 cp1", "tp4 pp1 vp1 cp2", "tp4 pp2 vp1 cp1", "tp4 pp2 vp2 cp1"]
    assert [c.label() for c in found.candidates] == [f"{p} ep1 mbs1 norc nodopt bf16" for p in parallel]
    assert [c.dp for c in found.candidates] == [4, 4, 2, 2, 4, 2, 2, 1, 2, 1, 2, 1, 1, 1]
    assert found.rejected == Counter({"tp divides heads": 8, "vp needs pp > 1": 6, "tp*pp*cp divides gpus": 2,
                                      "mbs*dp divides global batch": 1, "pp divides micro-batches": 1})
    assert found.combinations == 4 * 2 * 2 * 2 == 14 + 18


def test_tied_embeddings_plan_over_any_pipeline() -> None:
    # pp 4 of a tied model: the embedding's gradient group (first and last stage) is the graph's "embedding" role
    space = Space(tp=(1,), pp=(1, 2, 4), vp=(None,), cp=(1,), **ONE_EACH)
    for untied in (False, True):
        found = enumerate_layouts(toy(untied=untied), gpus=4, global_batch=4, seq=16, space=space)
        assert [c.pp for c in found.candidates] == [1, 2, 4] and not found.rejected


def test_moe_toy_expert_rules_exact() -> None:
    # 4 experts, tp 2 on 4 GPUs (dp 2): ep8 does not divide 4 experts (2 etp choices); ep4 with etp2 needs
    # 2 * 4 * 1 = 8 GPUs; ep4 with etp1 fits.
    space = Space(tp=(2,), pp=(1,), cp=(1,), ep=(1, 2, 4, 8), **ONE_EACH)
    found = enumerate_layouts(toy(experts=4, ffn=64), gpus=4, global_batch=4, seq=16, space=space)
    assert [c.label() for c in found.candidates] == [
        "tp2 pp1 vp1 cp1 ep1 mbs1 norc nodopt bf16", "tp2 pp1 vp1 cp1 ep1 etp1 mbs1 norc nodopt bf16",
        "tp2 pp1 vp1 cp1 ep2 mbs1 norc nodopt bf16", "tp2 pp1 vp1 cp1 ep2 etp1 mbs1 norc nodopt bf16",
        "tp2 pp1 vp1 cp1 ep4 etp1 mbs1 norc nodopt bf16"]
    assert found.rejected == Counter({"ep divides experts": 2, "etp*ep*pp divides gpus": 1})


def test_etp_one_repeats_tp_one_and_dense() -> None:
    moe = enumerate_layouts(toy(experts=4), 4, 4, 16, Space(tp=(1,), pp=(1,), cp=(1,), ep=(1,), **ONE_EACH))
    assert [c.etp for c in moe.candidates] == [1]
    assert moe.rejected == Counter({"etp repeats a layout": 1})
    dense = enumerate_layouts(toy(), 4, 4, 16, Space(tp=(2,), pp=(1,), cp=(1,), etp=("1", "tp"), **ONE_EACH))
    assert [c.etp for c in dense.candidates] == [2]  # a dense model's etp is its tp
    assert dense.rejected == Counter({"etp repeats a layout": 1})


def test_expert_ffn_and_dense_ffn() -> None:
    found = enumerate_layouts(toy(experts=4, ffn=6), 4, 4, 16, Space(tp=(4,), pp=(1,), cp=(1,), ep=(1,), **ONE_EACH))
    assert [c.label() for c in found.candidates] == ["tp4 pp1 vp1 cp1 ep1 etp1 mbs1 norc nodopt bf16"]
    assert found.rejected == Counter({"etp divides expert ffn": 1})  # 6 % 4; an MoE's tp need not divide ffn
    dense = enumerate_layouts(toy(ffn=6), 4, 4, 16, Space(tp=(4,), pp=(1,), cp=(1,), **ONE_EACH))
    assert dense.rejected == Counter({"tp divides ffn": 1}) and not dense.candidates


def _first_failure(model: ModelPreset, gpus: int, gbs: int, seq: int, space: Space, node: int,
                   combination: tuple) -> tuple[str | None, Candidate]:
    """The first rule, in `RULES` order, that `combination` breaks (None: none), and the candidate it makes."""
    tp, pp, vp, cp, ep, i, mbs, rc, dopt, fp8 = combination
    heads, groups, ffn, layers, experts = (model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size,
                                           model.num_layers, model.num_experts)
    etps = [tp if choice is ExpertTp.SAME_AS_TP or experts is None else 1 for choice in space.etp or ()]
    etp, dp = etps[i], gpus // (tp * pp * cp)
    checks = {
        "tp divides heads": lambda: heads % tp == 0 and (groups % tp == 0 or tp % groups == 0),
        "tp divides ffn": lambda: experts is not None or ffn % tp == 0,
        "tp within a node": lambda: tp <= node,
        "pp divides layers": lambda: layers % pp == 0,
        "vp needs pp > 1": lambda: vp is None or pp > 1,
        "vp divides layers/pp": lambda: vp is None or layers // pp % vp == 0,
        "2*cp divides seq": lambda: cp == 1 or seq % (2 * cp) == 0,
        "tp divides seq/cp": lambda: tp == 1 or (seq % cp == 0 and seq // cp % tp == 0),
        "tp*pp*cp divides gpus": lambda: gpus % (tp * pp * cp) == 0,
        "ep needs experts": lambda: experts is not None or ep == 1,
        "ep divides experts": lambda: experts is None or experts % ep == 0,
        "etp repeats a layout": lambda: etp not in etps[:i],
        "etp divides expert ffn": lambda: experts is None or ffn % etp == 0,
        "etp*ep*pp divides gpus": lambda: gpus % (etp * ep * pp) == 0,
        "mbs*dp divides global batch": lambda: gbs % (mbs * dp) == 0,
        "pp divides micro-batches": lambda: vp is None or gbs // (mbs * dp) % pp == 0,
        "fp8 needs GPU support": lambda: not fp8 or space.fp8_supported,
    }
    assert list(checks) == [rule.name for rule in RULES]
    failed = next((name for name, holds in checks.items() if not holds()), None)
    return failed, Candidate(tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp, dp=dp, micro_batch=mbs, recompute=rc,
                             distributed_optimizer=dopt, fp8=fp8)


def _reference(model: ModelPreset, gpus: int, gbs: int, seq: int, space: Space, node: int) -> tuple[list[str], Counter]:
    """Every combination of an explicit Space against every rule, in loop order, without pruning."""
    assert space.pp and space.vp and space.ep and space.etp and space.fp8
    axes = (space.tp, space.pp, space.vp, space.cp, space.ep, range(len(space.etp)), space.micro_batch,
            space.recompute, space.distributed_optimizer, space.fp8)
    kept, rejected = [], Counter()
    for combination in itertools.product(*axes):
        failed, candidate = _first_failure(model, gpus, gbs, seq, space, node, combination)
        if failed:
            rejected[failed] += 1
        else:
            kept.append(candidate.label())
    return kept, rejected


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 64), gbs=st.integers(1, 64), seq=st.sampled_from([4, 12, 16, 24, 64]),
       node=st.sampled_from([2, 8]), moe=st.booleans(), fp8_supported=st.booleans())
def test_pruned_walk_matches_flat_reference(gpus: int, gbs: int, seq: int, node: int, moe: bool,
                                            fp8_supported: bool) -> None:
    model = toy(layers=6, heads=8, groups=2, ffn=12, experts=6 if moe else None)
    space = Space(tp=(1, 2, 3, 4, 8), pp=(1, 2, 3, 4), vp=(None, 2, 3), cp=(1, 2, 4), ep=(1, 2, 3, 4),
                  etp=(ExpertTp.SAME_AS_TP, ExpertTp.ONE), micro_batch=(1, 2), recompute=(Recompute.NONE,),
                  distributed_optimizer=(True,), fp8=(False, True), fp8_supported=fp8_supported)
    found = enumerate_layouts(model, gpus, gbs, seq, space, gpus_per_node=node)
    kept, rejected = _reference(model, gpus, gbs, seq, space, node)
    assert [c.label() for c in found.candidates] == kept
    assert found.rejected == rejected
    assert found.combinations == 5 * 4 * 3 * 3 * 4 * 2 * 2 * 2
    for c in found.candidates:  # Megatron's own grids (MegatronLayout) agree on dp
        assert MegatronLayout(world_size=gpus, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, expert_tp=c.etp).dp == c.dp
    if not found.candidates:
        top = max(RULES, key=lambda r: rejected[r.name])
        assert f"'{top.name}' excluded {rejected[top.name]:,} of" in no_candidate_message(found)


def test_default_space_fits_the_model() -> None:
    # llama3-70b: 80 layers. pp: the 10 divisors of 80; per pp the vp values are None and the divisors >= 2 of
    # 80 / pp: pp1 1, pp2 8, pp4 6, pp5 5, pp8 4, pp10 4, pp16 2, pp20 3, pp40 2, pp80 1 = 36.
    # 4 tp x 36 (pp, vp) x 4 cp x 1 ep x 1 etp x 3 mbs x 3 recompute x 2 dopt x 2 fp8 = 20,736.
    found = enumerate_layouts(preset("llama3-70b"), gpus=1024, global_batch=2048, seq=8192, space=Space())
    assert found.combinations == 4 * 36 * 4 * 36 == 20736
    assert {c.vp for c in found.candidates if c.pp == 4} == {None, 2, 4, 5, 10, 20}
    assert Space(fp8_supported=False).fp8 == (False,) and Space().fp8 == (False, True)
    mixtral = enumerate_layouts(preset("mixtral-8x7b"), gpus=64, global_batch=256, seq=4096, space=Space())
    assert {c.ep for c in mixtral.candidates} == {1, 2, 4, 8}
    assert {c.etp for c in mixtral.candidates if c.tp == 8} == {1, 8}


def test_fp8_only_where_supported() -> None:
    space = Space(tp=(8,), pp=(4,), vp=(None,), cp=(1,), micro_batch=(1,), recompute=(Recompute.NONE,),
                  distributed_optimizer=(True,), fp8=(False, True), fp8_supported=False)
    found = enumerate_layouts(preset("llama3-70b"), 64, 128, 8192, space)
    assert [c.fp8 for c in found.candidates] == [False]
    assert found.rejected == Counter({"fp8 needs GPU support": 1})


NEMOTRON4_340B = ModelPreset(
    name="nemotron4-340b", family="nemotron4", hidden_size=18432, num_layers=96, num_attention_heads=96,
    num_query_groups=8, ffn_hidden_size=73728, vocab_size=256000, seq_length=4096, max_position_embeddings=4096,
    normalization=Normalization.LAYER_NORM,
    activation=Activation.GELU,  # squared ReLU in the paper: the same two matrices, which is what counts here
    position_embedding=PositionEmbedding.ROPE, rotary_base=10000, untied_embeddings=True, bias=False,
    num_experts=None, moe_router_topk=None, source="Nemotron-4 340B Technical Report, arXiv:2406.11704, table 1")
"""Not among the presets; built here from the paper's architecture table."""

PUBLISHED = [
    # NeMo Framework 24.12 performance summary (pre-training, LLAMA3-70B: 64 GPUs, GBS 128, MBS 1, seq 8192,
    # TP4 PP4 CP2 VP5), also NGC "NeMo Llama 3.1 Pretrain 25.04.01 (DGXC Benchmarking)", 70b BF16 on 64 GPUs.
    pytest.param(preset("llama3-70b"), 64, 128, 8192, (4, 4, 5, 2), id="llama3-70b-64gpus"),
    # NVIDIA dgxc-benchmarking nemotron4-340b README, H100: 2048 GPUs, seq 4096, 96 layers, TP8 PP8 CP1 VP12,
    # MBS 1, GBS 512 (DP 32, 16 micro-batches).
    pytest.param(NEMOTRON4_340B, 2048, 512, 4096, (8, 8, 12, 1), id="nemotron4-340b-2048gpus"),
    # NGC "Llama 3.1 405B 24.11.1 (DGXC Benchmarking)": 576 GPUs, seq 8192, GBS 252 (its throughput example,
    # 8192 * 252 tokens a step), with TP8 PP9 CP2 VP7: DP 576 / 144 = 4, 63 micro-batches, 126 layers / 9 / 7 = 2.
    pytest.param(preset("llama3.1-405b"), 576, 252, 8192, (8, 9, 7, 2), id="llama3.1-405b-576gpus"),
]


@pytest.mark.parametrize(("model", "gpus", "global_batch", "seq", "layout"), PUBLISHED)
def test_published_layouts_are_candidates(model: ModelPreset, gpus: int, global_batch: int, seq: int,
                                          layout: tuple[int, int, int, int]) -> None:
    tp, pp, vp, cp = layout  # vp: virtual stages per pipeline rank
    found = enumerate_layouts(model, gpus, global_batch, seq, Space())
    published = Candidate(tp=tp, pp=pp, vp=vp, cp=cp, ep=1, etp=tp, dp=gpus // (tp * pp * cp), micro_batch=1,
                           recompute=Recompute.NONE, distributed_optimizer=True, fp8=False)
    assert published in found.candidates
    assert dataclasses.replace(published, fp8=True) in found.candidates


def test_megatron_args() -> None:
    c = Candidate(tp=8, pp=4, vp=5, cp=2, ep=1, etp=8, dp=2, micro_batch=1, recompute=Recompute.SELECTIVE,
                  distributed_optimizer=True, fp8=True)
    assert c.megatron_args() == [
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
        "--num-virtual-stages-per-pipeline-rank", "5", "--context-parallel-size", "2",
        "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "8", "--micro-batch-size", "1",
        "--sequence-parallel", "--recompute-granularity", "selective", "--use-distributed-optimizer",
        "--fp8-format", "hybrid"]
    plain = dataclasses.replace(c, tp=1, etp=1, vp=None, recompute=Recompute.NONE, distributed_optimizer=False,
                                fp8=False)
    assert plain.megatron_args() == [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--context-parallel-size", "2",
        "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1"]
    assert c.label() == "tp8 pp4 vp5 cp2 ep1 mbs1 sel dopt fp8"


def test_no_candidate_message_names_the_top_rule() -> None:
    # 24 GPUs, global batch 7: tp*pp*cp must divide 24 and mbs*dp divide 7
    found = enumerate_layouts(preset("llama3-70b"), gpus=24, global_batch=7, seq=8192, space=Space())
    assert not found.candidates
    assert found.rejected == Counter({"tp*pp*cp divides gpus": 17856, "mbs*dp divides global batch": 2880})
    message = no_candidate_message(found)
    assert message.startswith("no layout of llama3-70b fits 24 GPUs (global batch 7, seq 8192): "
                              "'tp*pp*cp divides gpus' excluded 17,856 of 20,736 combinations")
    assert "core/parallel_state.py:initialize_model_parallel" in message and "divides 24" in message
    seq = enumerate_layouts(toy(), 8, 8, 6, Space(tp=(2,), pp=(1,), cp=(2, 4), **ONE_EACH))
    assert "'2*cp divides seq' excluded 2 of 2 combinations" in no_candidate_message(seq)


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(gpus=0), "--gpus=0 must be a positive int: give an integer >= 1, e.g. --gpus 1024"),
    (dict(gpus=True), "--gpus=True must be a positive int"),
    (dict(global_batch=0), "--global-batch=0 must be a positive int: give an integer >= 1, e.g. --global-batch 1024"),
    (dict(seq=-1), "--seq=-1 must be a positive int: give an integer >= 1, e.g. --seq 8192"),
    (dict(gpus_per_node=0), "gpus_per_node=0 must be a positive int"),
])
def test_bad_numbers_name_the_flag_and_the_fix(kwargs: dict[str, int], expected: str) -> None:
    args = dict(model=toy(), gpus=8, global_batch=8, seq=16, space=Space()) | kwargs
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        enumerate_layouts(**args)


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(tp=()), "Space.tp=(): give a non-empty tuple of values, e.g. (1, 2, 4, 8)"),
    (dict(pp=()), "Space.pp=(): give a non-empty tuple of values, e.g. (1, 2, 4)"),
    (dict(micro_batch=[1, 2]), "Space.micro_batch=[1, 2]: give a non-empty tuple of values"),
    (dict(cp=(1, 1)), "Space.cp=(1, 1) repeats a value: list each value once"),
    (dict(tp=(0, 2)), "Space.tp value=0 must be a positive int: list integers >= 1 in Space.tp"),
    (dict(vp=(None, 1)), "Space.vp value must be an integer >= 2, got 1 (None is no interleaving"),
    (dict(recompute=("partial",)), "Space.recompute='partial' is not one of none, selective, full"),
    (dict(fp8=(0,)), "Space.fp8=(0,): give a tuple of True and/or False"),
])
def test_bad_space_names_the_axis_and_the_fix(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        Space(**kwargs)
    assert str(error.value).startswith(expected)
