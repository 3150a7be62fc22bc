"""A job's data and tokenizer files that are not on this host: the emulation runs on mock data instead.

A launch script from a cluster names its dataset (``--data-path`` prefixes of ``.bin`` / ``.idx`` files, or the
per-split and data-args forms) and its tokenizer files (``--vocab-file`` / ``--merge-file``, ``--tokenizer-model``).
Where they exist, Megatron's real data path runs as written. Where they are absent, `substitute` rewrites the
arguments to Megatron's own mock dataset (``--mock-data``) with the job's sequence length and a tokenizer of the
job's vocabulary size (``--tokenizer-type NullTokenizer --vocab-size V``, whose embedding Megatron pads as it pads
the real tokenizer's), and says so in one line. The vocabulary size comes from ``--vocab-size`` when the job gives
it, else from the tokenizer when its size is fixed (GPT-2's BPE: 50257); otherwise the job is refused, naming
``--vocab-size``.

Non-goal: the real data's host time (reading, blending, index building) and the token values; the mock dataset's
batches have the job's shapes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.adapters.megatron.argv import flag_values, without_flags
from prism_plugin.config.errors import ConfigError

__all__ = ["Substitution", "substitute"]

_DATA_LISTS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
_DATA_FILES = ("--data-args-path", "--per-split-data-args-path")
_TOKENIZER_FILES = ("--vocab-file", "--merge-file", "--tokenizer-model")
_FIXED_VOCAB = {"GPT2BPETokenizer": 50257}
"""Tokenizers whose vocabulary size does not depend on their files' contents beyond the standard ones."""


@dataclass(frozen=True, slots=True)
class Substitution:
    """The rewritten arguments and the line that says what was replaced (None: nothing was)."""

    argv: list[str]
    note: str | None


def _prefixes(values: Sequence[str]) -> list[str]:
    """Dataset prefixes of a ``--data-path`` list (``[weight] prefix ...``: numbers are blend weights)."""
    out = []
    for value in values:
        try:
            float(value)
        except ValueError:
            out.append(value)
    return out


def substitute(argv: Sequence[str], namespace: Any,
               exists: Callable[[str], bool] = os.path.exists) -> Substitution:
    """`argv` (the script's Megatron arguments) with absent data and tokenizer files replaced by mock data and a
    null tokenizer of the job's vocabulary (`namespace`: Megatron's parse of `argv`). Raises `ConfigError` naming
    ``--vocab-size`` when the vocabulary size cannot be known."""
    argv = list(argv)
    absent_data = []
    if not getattr(namespace, "mock_data", False):
        for flag in _DATA_LISTS:
            absent_data += [p for p in _prefixes(flag_values(argv, flag))
                            if not (exists(p + ".bin") and exists(p + ".idx")) and not exists(p)]
        absent_data += [p for flag in _DATA_FILES for p in flag_values(argv, flag) if not exists(p)]
    tokenizer = getattr(namespace, "tokenizer_type", None)
    absent_tokenizer = [p for flag in _TOKENIZER_FILES for p in flag_values(argv, flag) if not exists(p)]
    if not absent_data and not absent_tokenizer:
        return Substitution(argv, None)
    rewritten, said = argv, []
    if absent_data:  # Megatron's mock dataset, with the job's tokenizer (real or null)
        rewritten = without_flags(rewritten, (*_DATA_LISTS, *_DATA_FILES, "--split", "--mock-data")) + ["--mock-data"]
        said.append(f"Megatron's mock data (sequence length {getattr(namespace, 'seq_length', '?')})")
    if absent_tokenizer:
        vocab = getattr(namespace, "vocab_size", None) or _FIXED_VOCAB.get(tokenizer or "")
        if vocab is None and tokenizer is None:
            raise ConfigError(f"{', '.join(absent_tokenizer)}: not on this host, and --tokenizer-type is unset, which "
                              "megatron-core 0.19 refuses (it builds no tokenizer without a type); name it, e.g. "
                              "--tokenizer-type GPT2BPETokenizer for GPT-2's vocab and merge files, or pass "
                              "--vocab-size V to emulate with a null tokenizer of that size")
        if vocab is None:
            raise ConfigError(f"{', '.join(absent_tokenizer)}: not on this host, and the vocabulary size of "
                              f"--tokenizer-type {tokenizer} cannot be known without it; pass --vocab-size V (the "
                              "tokenizer's vocabulary) to emulate with a null tokenizer of that size")
        rewritten = without_flags(rewritten, (*_TOKENIZER_FILES, "--tokenizer-type", "--vocab-size"))
        rewritten += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(int(vocab))]
        said.append(f"a null tokenizer of the job's vocabulary ({int(vocab)})")
    absent = ", ".join([*absent_data, *absent_tokenizer])
    return Substitution(rewritten, f"prism: {absent}: not on this host; the emulation runs on {' and '.join(said)}")
