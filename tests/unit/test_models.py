"""Model presets (`prism_plugin.config.models`) and `prism models` (issue 12, item 4): exact parameter counts
against the published ones, the Megatron arguments, validation, and the CLI's table, JSON and errors."""

from __future__ import annotations

import doctest
import json
import shlex

import pytest

from prism_plugin.cli.main import main
from prism_plugin.config import models
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.models import (
    PRESETS,
    Activation,
    ModelPreset,
    Normalization,
    PositionEmbedding,
    layer_parameters,
    megatron_args,
    parameters,
    preset,
    preset_names,
)

PUBLISHED = {
    # Meta's model cards / `model.num_parameters()` of the HF checkpoints, and Mistral's for Mixtral
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,  # tied embeddings: the output layer reuses the 128,256 x 2048 embedding
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name: str) -> None:
    assert parameters(preset(name)) == PUBLISHED[name]


def test_gpt3_175b_is_174_6_billion_in_closed_form() -> None:
    """GPT-3 175B as Megatron builds it (vocab 51,200, 2,048 learned positions, biases, tied output)."""
    p = preset("gpt3-175b")
    h = 12288
    layer = 12 * h * h + 13 * h  # QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h
    assert layer_parameters(p) == layer
    assert parameters(p) == 51200 * h + 2048 * h + 96 * layer + 2 * h == 174_615_846_912
    assert round(parameters(p) / 1e9, 1) == 174.6


def test_llama3_8b_closed_form_by_part() -> None:
    p = preset("llama3-8b")
    attention = 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096
    mlp = 3 * 4096 * 14336
    assert layer_parameters(p) == attention + mlp + 2 * 4096 == 218_112_000
    assert parameters(p) == 2 * 128256 * 4096 + 32 * 218_112_000 + 4096


def test_mixtral_counts_every_expert_and_the_router() -> None:
    p = preset("mixtral-8x7b")
    dense = preset("llama3-8b")
    assert p.is_moe and not dense.is_moe
    one_expert = 3 * 4096 * 14336
    assert layer_parameters(p) - layer_parameters(dense) == 7 * one_expert + 4096 * 8  # 7 more experts, router


def test_megatron_args_of_a_dense_llama() -> None:
    args = megatron_args(preset("llama3-70b"))
    assert shlex.join(args) == (
        "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
        "--ffn-hidden-size 28672 --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256 "
        "--normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 500000 "
        "--untie-embeddings-and-output-weights --disable-bias-linear")


def test_megatron_args_of_tied_gpt3_and_moe_mixtral() -> None:
    gpt3 = megatron_args(preset("gpt3-175b"))
    assert shlex.join(gpt3) == (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152 --seq-length 2048 "
        "--max-position-embeddings 2048 --vocab-size 51200 --normalization LayerNorm "
        "--position-embedding-type learned_absolute")  # GeLU, biases and tied embeddings are Megatron's defaults
    tied = megatron_args(preset("llama3.2-1b"))
    assert "--untie-embeddings-and-output-weights" not in tied and "--disable-bias-linear" in tied
    mixtral = megatron_args(preset("mixtral-8x7b"))
    assert mixtral[-4:] == ["--num-experts", "8", "--moe-router-topk", "2"]
    assert mixtral[mixtral.index("--rotary-base") + 1] == "1000000"


def test_every_preset_is_consistent() -> None:
    assert preset_names() == list(PRESETS) and len(PRESETS) >= 6
    for name, p in PRESETS.items():
        assert p.name == name and p.hidden_size == p.head_dim * p.num_attention_heads
        assert p.source.startswith("https://") or "arXiv" in p.source
        args = megatron_args(p)
        assert args[args.index("--num-layers") + 1] == str(p.num_layers)


def test_preset_names_are_case_insensitive_and_a_typo_lists_them() -> None:
    assert preset(" Llama3-8B ") is PRESETS["llama3-8b"]
    with pytest.raises(ConfigError) as info:
        preset("llama3-7b")
    message = str(info.value)
    assert "'llama3-7b'" in message and all(name in message for name in PRESETS)


def _kwargs(**over: object) -> dict:
    base = dict(name="t", family="test", hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=100, seq_length=16, max_position_embeddings=16,
                normalization=Normalization.RMS_NORM, activation=Activation.SWIGLU,
                position_embedding=PositionEmbedding.ROPE, rotary_base=10000, untied_embeddings=True, bias=False,
                num_experts=None, moe_router_topk=None, source="-")
    return {**base, **over}


@pytest.mark.parametrize(("over", "needle"), [
    ({"num_attention_heads": 3}, "does not divide"),
    ({"num_query_groups": 3}, "not a multiple of num_query_groups"),
    ({"seq_length": 32}, "exceeds max_position_embeddings"),
    ({"rotary_base": None}, "rotary base"),
    ({"position_embedding": PositionEmbedding.LEARNED}, "rotary base"),
    ({"num_experts": 8}, "set both"),
    ({"num_experts": 2, "moe_router_topk": 3}, "must be in [1, num_experts=2]"),
    ({"num_layers": 0}, "num_layers=0 must be an integer >= 1"),
    ({"normalization": "RMSNorm"}, "must be a Normalization"),
])
def test_a_preset_that_cannot_be_built_is_refused(over: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelPreset(**_kwargs(**over))
    assert needle in str(info.value)


def test_a_small_custom_preset_counts_by_hand() -> None:
    p = ModelPreset(**_kwargs())
    # attention 64 x (64 + 2 x 2 x 16) + 64 x 64, SwiGLU 3 x 64 x 128, two RMSNorms; embedding, final norm, output
    layer = 64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert parameters(p) == 100 * 64 + 2 * layer + 64 + 100 * 64


def test_prism_models_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "8,030,261,248" in out and "405,853,388,800" in out and "46,702,792,704" in out
    assert "32/8" in out and "8 top-2" in out  # heads/kv and the experts column
    assert "huggingface.co/meta-llama/Meta-Llama-3-8B" in out


def test_prism_models_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in records] == list(PRESETS)
    by_name = {r["name"]: r for r in records}
    for name, count in PUBLISHED.items():
        assert by_name[name]["parameters"] == count
    assert by_name["llama3-8b"]["normalization"] == "RMSNorm" and by_name["mixtral-8x7b"]["num_experts"] == 8
    assert by_name["gpt3-175b"]["megatron_args"] == megatron_args(preset("gpt3-175b"))


def test_prism_models_show_prints_one_pasteable_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "show", "llama3.1-405b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["parameters", "405,853,388,800"] for line in lines)
    assert lines[-1] == shlex.join(megatron_args(preset("llama3.1-405b")))
    assert main(["models", "show", "mixtral-8x7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe_router_topk"] == 2


def test_prism_models_show_a_typo_exits_2_naming_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "show", "llama-3-8b"]) == 2
    err = capsys.readouterr().err
    assert "no model preset 'llama-3-8b'" in err and all(name in err for name in PRESETS)


def test_docstring_examples() -> None:
    assert doctest.testmod(models).failed == 0
