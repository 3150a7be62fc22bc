"""Model presets: the published architectures of the real-size jobs, as pure values (issue 12, item 4).

A `ModelPreset` holds what decides a decoder's tensor sizes (width, depth, heads and key/value groups, the
MLP's width and activation, vocabulary, sequence, normalization, position embedding, tied or untied output
layer, biases, experts) and where the figures come from (`source`: the Hugging Face ``config.json`` or the
paper and Megatron-LM example). Three functions read one:

- `parameters(preset)`: the exact parameter count of the unsharded model, in closed form;
- `megatron_args(preset)`: the ``pretrain_gpt.py`` arguments that build it
  (``prism_plugin/programs/pretrain_gpt.py``, Megatron's own parser);
- `preset(name)`: a preset by name, a `ConfigError` listing the names otherwise.

    >>> parameters(preset("llama3-8b"))
    8030261248
    >>> " ".join(megatron_args(preset("llama3-8b"))[:6])
    '--num-layers 32 --hidden-size 4096 --num-attention-heads 32'

Non-goals and limitations: no torch, no Megatron import (the config layer is pure; `megatron_args` writes
strings). `parameters` counts the model as published: Megatron pads the vocabulary (to a multiple of
``--make-vocab-size-divisible-by`` x TP, after its NullTokenizer adds an end-of-document id), so its own
count is larger by that padding times the hidden size (twice when untied). No rotary scaling
(Llama 3.1's long-context rope scaling changes no tensor size), no sliding window, no multi-latent
attention, no shared experts, no multi-token prediction. Training hyperparameters (batch, learning rate,
dropout) are the job's, not the model's, and are not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prism_plugin.config.errors import ConfigError, coerce_enum

__all__ = [
    "PRESETS", "Activation", "ModelPreset", "Normalization", "PositionEmbedding", "attention_parameters",
    "embedding_parameters", "layer_parameters", "megatron_args", "mlp_parameters", "model_of_megatron_args",
    "parameters", "preset",
    "preset_names",
]


class Normalization(StrEnum):
    """The layer norm of every block and of the final norm; the value is Megatron's ``--normalization``."""

    RMS_NORM = "RMSNorm"
    LAYER_NORM = "LayerNorm"


class Activation(StrEnum):
    """The MLP: SwiGLU (gate, up and down matrices) or GeLU (up and down)."""

    SWIGLU = "swiglu"
    GELU = "gelu"


class PositionEmbedding(StrEnum):
    """Rotary (no parameters) or learned absolute positions (``max_position_embeddings`` x hidden)."""

    ROPE = "rope"
    LEARNED = "learned"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPreset:
    """One published decoder architecture; validated at construction.

    >>> ModelPreset(name="x", family="test", hidden_size=100, num_layers=1, num_attention_heads=3,
    ...             num_query_groups=1, ffn_hidden_size=4, vocab_size=8, seq_length=4, max_position_embeddings=4,
    ...             normalization=Normalization.RMS_NORM, activation=Activation.SWIGLU,
    ...             position_embedding=PositionEmbedding.ROPE, rotary_base=10000, untied_embeddings=True,
    ...             bias=False, num_experts=None, moe_router_topk=None, source="-")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: model x: hidden_size=100 does not divide into num_attention_heads=3 ...
    """

    name: str
    """The preset's name, as `preset` and ``prism models show`` take it (lower case, e.g. ``llama3-8b``)."""
    family: str
    """The model family (``llama3``, ``gpt3``, ``mixtral``)."""
    hidden_size: int
    """The model width (Megatron ``--hidden-size``; HF ``hidden_size``)."""
    num_layers: int
    """Transformer blocks."""
    num_attention_heads: int
    """Query heads; each is ``hidden_size // num_attention_heads`` wide."""
    num_query_groups: int
    """Key/value heads (grouped-query attention); equal to the query heads for multi-head attention."""
    ffn_hidden_size: int
    """The MLP's inner width (per expert for a mixture of experts)."""
    vocab_size: int
    """The tokenizer's vocabulary, unpadded (GPT-3: the GPT-2 BPE's 50,257 padded to 51,200, as Megatron does)."""
    seq_length: int
    """The pretraining sequence length."""
    max_position_embeddings: int
    """The longest sequence the position embedding covers (learned: its rows; rope: the config's figure)."""
    normalization: Normalization
    """RMSNorm (a weight) or LayerNorm (a weight and a bias)."""
    activation: Activation
    """SwiGLU or GeLU MLP."""
    position_embedding: PositionEmbedding
    """Rotary or learned absolute positions."""
    rotary_base: int | None
    """Rope's theta (Megatron ``--rotary-base``; HF ``rope_theta``); None exactly when positions are learned."""
    untied_embeddings: bool
    """True: the output layer is its own vocab x hidden matrix; False: it reuses the input embedding."""
    bias: bool
    """Biases on the linear layers (GPT-3); False is Megatron's ``--disable-bias-linear`` (Llama, Mixtral)."""
    num_experts: int | None
    """Experts of each MoE MLP; None for a dense model."""
    moe_router_topk: int | None
    """Experts each token is routed to; None exactly when `num_experts` is None."""
    source: str
    """Where the figures come from: the HF ``config.json`` URL, or the paper and the Megatron-LM example."""

    def __post_init__(self) -> None:
        where = f"model {self.name}"
        for field_name in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                           "ffn_hidden_size", "vocab_size", "seq_length", "max_position_embeddings"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {field_name}={value!r} must be an integer >= 1")
        for field_name, enum in (("normalization", Normalization), ("activation", Activation),
                                 ("position_embedding", PositionEmbedding)):
            if not isinstance(getattr(self, field_name), enum):
                choices = ", ".join(m.value for m in enum)
                raise ConfigError(f"{where}: {field_name}={getattr(self, field_name)!r} must be a "
                                  f"{enum.__name__} ({choices})")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{where}: hidden_size={self.hidden_size} does not divide into "
                              f"num_attention_heads={self.num_attention_heads} heads; pick a hidden size that is a "
                              "multiple of the head count")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_query_groups={self.num_query_groups}; each key/value group serves whole heads")
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(f"{where}: seq_length={self.seq_length} exceeds max_position_embeddings="
                              f"{self.max_position_embeddings}; raise max_position_embeddings or shorten the sequence")
        if (self.rotary_base is None) != (self.position_embedding is PositionEmbedding.LEARNED):
            raise ConfigError(f"{where}: rotary_base={self.rotary_base!r} with position_embedding="
                              f"{self.position_embedding.value}: give rope a rotary base, learned positions none")
        if (self.num_experts is None) != (self.moe_router_topk is None):
            raise ConfigError(f"{where}: num_experts={self.num_experts!r} and moe_router_topk="
                              f"{self.moe_router_topk!r}: set both (a mixture of experts) or neither (dense)")
        if self.num_experts is not None and self.moe_router_topk is not None and \
                not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(f"{where}: moe_router_topk={self.moe_router_topk} must be in [1, num_experts="
                              f"{self.num_experts}]")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``hidden_size // num_attention_heads`` (Llama-3-8B: 4096 // 32 = 128)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """True for a mixture of experts."""
        return self.num_experts is not None


def _llama3(name: str, *, hidden: int, layers: int, heads: int, ffn: int, max_positions: int, tied: bool,
            source: str) -> ModelPreset:
    """A Llama 3 decoder: 8 key/value groups, vocab 128,256, rope theta 500,000, RMSNorm, SwiGLU, no biases,
    pretrained at 8,192 tokens."""
    return ModelPreset(name=name, family="llama3", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                       num_query_groups=8, ffn_hidden_size=ffn, vocab_size=128256, seq_length=8192,
                       max_position_embeddings=max_positions, normalization=Normalization.RMS_NORM,
                       activation=Activation.SWIGLU, position_embedding=PositionEmbedding.ROPE, rotary_base=500000,
                       untied_embeddings=not tied, bias=False, num_experts=None, moe_router_topk=None, source=source)


def _gpt3(name: str, *, hidden: int, layers: int, heads: int, source: str) -> ModelPreset:
    """A GPT-3 decoder as Megatron trains it: ffn 4 x hidden, GeLU, LayerNorm, learned positions over 2,048
    tokens, biases, the output layer tied to the embedding, the GPT-2 BPE vocabulary padded to 51,200."""
    return ModelPreset(name=name, family="gpt3", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                       num_query_groups=heads, ffn_hidden_size=4 * hidden, vocab_size=51200, seq_length=2048,
                       max_position_embeddings=2048, normalization=Normalization.LAYER_NORM,
                       activation=Activation.GELU, position_embedding=PositionEmbedding.LEARNED, rotary_base=None,
                       untied_embeddings=False, bias=True, num_experts=None, moe_router_topk=None, source=source)


_GPT3_SOURCE = ("Brown et al. 2020, arXiv:2005.14165, table 2.1; vocab and sequence as "
                "https://github.com/NVIDIA/Megatron-LM/blob/main/examples/gpt3/train_gpt3_175b_distributed.sh")

PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    _llama3("llama3.2-1b", hidden=2048, layers=16, heads=32, ffn=8192, max_positions=131072, tied=True,
            source="https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json"),
    _llama3("llama3-8b", hidden=4096, layers=32, heads=32, ffn=14336, max_positions=8192, tied=False,
            source="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"),
    _llama3("llama3-70b", hidden=8192, layers=80, heads=64, ffn=28672, max_positions=8192, tied=False,
            source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"),
    _llama3("llama3.1-405b", hidden=16384, layers=126, heads=128, ffn=53248, max_positions=131072, tied=False,
            source="https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json"),
    _gpt3("gpt3-1.3b", hidden=2048, layers=24, heads=16, source=_GPT3_SOURCE),
    # the paper's table gives d_model 5140 for 13B, which 40 heads of 128 do not fill: 40 x 128 = 5120 (as NeMo's
    # gpt3 13b config)
    _gpt3("gpt3-13b", hidden=5120, layers=40, heads=40, source=_GPT3_SOURCE),
    _gpt3("gpt3-175b", hidden=12288, layers=96, heads=96, source=_GPT3_SOURCE),
    ModelPreset(name="mixtral-8x7b", family="mixtral", hidden_size=4096, num_layers=32, num_attention_heads=32,
                num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000,
                seq_length=4096,  # as Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh
                max_position_embeddings=32768, normalization=Normalization.RMS_NORM, activation=Activation.SWIGLU,
                position_embedding=PositionEmbedding.ROPE, rotary_base=1000000, untied_embeddings=True, bias=False,
                num_experts=8, moe_router_topk=2,
                source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json"),
)}
"""Every preset by name, smallest family member first."""


def preset_names() -> list[str]:
    """The names `preset` accepts, in `PRESETS` order."""
    return list(PRESETS)


def preset(name: str) -> ModelPreset:
    """The preset called `name` (case-insensitive), else a `ConfigError` listing every name.

    >>> preset("Llama3-70B").num_layers
    80
    >>> preset("llama3-7b")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: no model preset 'llama3-7b'; the presets are llama3.2-1b, llama3-8b, ...
    """
    found = PRESETS.get(str(name).strip().lower())
    if found is None:
        raise ConfigError(f"no model preset {name!r}; the presets are {', '.join(PRESETS)} (see `prism models`)")
    return found


def _norm(p: ModelPreset) -> int:
    """One norm's parameters: RMSNorm a weight, LayerNorm a weight and a bias."""
    return p.hidden_size * (2 if p.normalization is Normalization.LAYER_NORM else 1)


def _linear(p: ModelPreset, inputs: int, outputs: int) -> int:
    return inputs * outputs + (outputs if p.bias else 0)


def attention_parameters(p: ModelPreset) -> int:
    """One block's attention: query, key and value projections (key and value per group) and the output
    projection. Llama-3-8B: 4096 x (4096 + 2 x 8 x 128) + 4096 x 4096 = 41,943,040.

    >>> attention_parameters(preset("llama3-8b"))
    41943040
    """
    kv = p.num_query_groups * p.head_dim
    return _linear(p, p.hidden_size, p.hidden_size + 2 * kv) + _linear(p, p.hidden_size, p.hidden_size)


def mlp_parameters(p: ModelPreset) -> int:
    """One dense MLP (one expert): SwiGLU's gate, up and down matrices, or GeLU's up and down.
    Llama-3-8B: 3 x 4096 x 14336 = 176,160,768.

    >>> mlp_parameters(preset("llama3-8b"))
    176160768
    """
    up = 2 if p.activation is Activation.SWIGLU else 1
    return _linear(p, p.hidden_size, up * p.ffn_hidden_size) + _linear(p, p.ffn_hidden_size, p.hidden_size)


def layer_parameters(p: ModelPreset) -> int:
    """One transformer block: attention, the MLP (or every expert and the router, a hidden x experts matrix
    without bias), and its two norms. Mixtral-8x7B: 41,943,040 + 8 x 176,160,768 + 4096 x 8 + 2 x 4096 =
    1,451,270,144.

    >>> layer_parameters(preset("mixtral-8x7b"))
    1451270144
    """
    mlp = mlp_parameters(p)
    if p.num_experts is not None:
        mlp = p.num_experts * mlp + p.hidden_size * p.num_experts
    return attention_parameters(p) + mlp + 2 * _norm(p)


def embedding_parameters(p: ModelPreset) -> int:
    """The input embedding (vocab x hidden) and, with learned positions, the position table."""
    positions = p.max_position_embeddings * p.hidden_size if p.position_embedding is PositionEmbedding.LEARNED else 0
    return p.vocab_size * p.hidden_size + positions


def parameters(p: ModelPreset) -> int:
    """The exact parameter count of the unsharded model as published (unpadded vocabulary): embeddings,
    `num_layers` blocks, the final norm, and the output layer when untied (no bias).

    Llama-3-8B: 128,256 x 4096 (embedding) + 32 x 218,112,000 (blocks) + 4096 (final norm) + 128,256 x 4096
    (output layer) = 8,030,261,248, the count Meta publishes.

    >>> f"{parameters(preset('llama3-70b')):,}"
    '70,553,706,496'
    """
    output = p.vocab_size * p.hidden_size if p.untied_embeddings else 0
    return embedding_parameters(p) + p.num_layers * layer_parameters(p) + _norm(p) + output


def megatron_args(p: ModelPreset) -> list[str]:
    """The ``pretrain_gpt.py`` arguments (Megatron's own parser) that build preset `p`: architecture only;
    the job adds the layout, batch, steps, precision and data (``--mock-data --tokenizer-type NullTokenizer``).

    >>> " ".join(megatron_args(preset("mixtral-8x7b"))[-4:])
    '--num-experts 8 --moe-router-topk 2'
    """
    args = ["--num-layers", str(p.num_layers), "--hidden-size", str(p.hidden_size),
            "--num-attention-heads", str(p.num_attention_heads)]
    if p.num_query_groups != p.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(p.num_query_groups)]
    args += ["--ffn-hidden-size", str(p.ffn_hidden_size), "--seq-length", str(p.seq_length),
             "--max-position-embeddings", str(p.max_position_embeddings), "--vocab-size", str(p.vocab_size),
             "--normalization", p.normalization.value]
    if p.activation is Activation.SWIGLU:
        args.append("--swiglu")
    if p.position_embedding is PositionEmbedding.ROPE:
        args += ["--position-embedding-type", "rope", "--rotary-base", str(p.rotary_base)]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    if p.untied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not p.bias:
        args.append("--disable-bias-linear")
    if p.num_experts is not None:
        args += ["--num-experts", str(p.num_experts), "--moe-router-topk", str(p.moe_router_topk)]
    return args


def model_of_megatron_args(argv: list[str], name: str = "job") -> ModelPreset:
    """The architecture a ``pretrain_gpt.py`` command line builds, read as Megatron's parser reads it (its defaults:
    ffn 4 x hidden, multi-head attention, LayerNorm, GeLU, learned positions, biases, tied output layer); what
    `prism plan -- pretrain_gpt.py <args>` plans for. A flag it needs and lacks is a `ConfigError` naming it.

    >>> m = model_of_megatron_args(megatron_args(preset("llama3-8b")))
    >>> (m.num_layers, m.num_query_groups, m.ffn_hidden_size, m.activation.value, parameters(m))
    (32, 8, 14336, 'swiglu', 8030261248)
    >>> model_of_megatron_args(["--num-layers", "2"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: the job's arguments lack --hidden-size: give it ...
    """
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
                 "--seq-length", "--max-position-embeddings", "--vocab-size", "--rotary-base", "--num-experts",
                 "--moe-router-topk"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--normalization", default="LayerNorm")
    parser.add_argument("--position-embedding-type", default="learned_absolute")
    for flag in ("--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights",
                 "--disable-bias-linear"):
        parser.add_argument(flag, action="store_true")
    known, _ = parser.parse_known_args(argv)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size"):
        if getattr(known, flag[2:].replace("-", "_")) is None:
            raise ConfigError(f"the job's arguments lack {flag}: give it (the planner sizes the model from the "
                              "job's own arguments; --vocab-size stands for a tokenizer it cannot read)")
    rope = known.position_embedding_type == "rope"
    experts = known.num_experts
    return ModelPreset(
        name=name, family="job", hidden_size=known.hidden_size, num_layers=known.num_layers,
        num_attention_heads=known.num_attention_heads,
        num_query_groups=known.num_query_groups if known.group_query_attention and known.num_query_groups
        else known.num_attention_heads,
        ffn_hidden_size=known.ffn_hidden_size or 4 * known.hidden_size, vocab_size=known.vocab_size,
        seq_length=known.seq_length, max_position_embeddings=known.max_position_embeddings or known.seq_length,
        normalization=coerce_enum(Normalization, known.normalization, "--normalization"),
        activation=Activation.SWIGLU if known.swiglu else Activation.GELU,
        position_embedding=PositionEmbedding.ROPE if rope else PositionEmbedding.LEARNED,
        rotary_base=(known.rotary_base or 10000) if rope else None,
        untied_embeddings=known.untie_embeddings_and_output_weights, bias=not known.disable_bias_linear,
        num_experts=experts, moe_router_topk=(known.moe_router_topk or 2) if experts else None,
        source="the job's pretrain_gpt.py arguments")
