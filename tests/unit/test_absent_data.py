"""A launch script's data and tokenizer files absent on this host: mock data and a null tokenizer instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prism_plugin.adapters.megatron.absent_data import substitute
from prism_plugin.config.errors import ConfigError

GPT3 = ["--seq-length", "2048", "--data-path", "0.7", "/lustre/a_text_document", "0.3", "/lustre/b_text_document",
        "--split", "98,2,0", "--vocab-file", "/lustre/gpt2-vocab.json", "--merge-file", "/lustre/gpt2-merges.txt",
        "--tokenizer-type", "GPT2BPETokenizer", "--num-layers", "96"]


def ns(**kwargs: object) -> SimpleNamespace:
    return SimpleNamespace(**{"mock_data": False, "tokenizer_type": "GPT2BPETokenizer", "vocab_size": None,
                              "seq_length": 2048, **kwargs})


def test_absent_files_become_mock_data_and_a_null_tokenizer_of_gpt2s_vocabulary() -> None:
    out = substitute(GPT3, ns(), exists=lambda path: False)
    assert out.argv == ["--seq-length", "2048", "--num-layers", "96", "--mock-data", "--tokenizer-type",
                        "NullTokenizer", "--vocab-size", "50257"]
    assert out.note is not None and out.note.startswith("prism: /lustre/a_text_document, /lustre/b_text_document, ")
    assert "mock data (sequence length 2048)" in out.note
    assert "null tokenizer of the job's vocabulary (50257)" in out.note


def test_files_that_exist_run_megatrons_real_path() -> None:
    out = substitute(GPT3, ns(), exists=lambda path: True)
    assert out.argv == GPT3 and out.note is None


def test_absent_data_with_a_present_tokenizer_keeps_the_tokenizer() -> None:
    out = substitute(GPT3, ns(), exists=lambda path: "gpt2-" in path)
    assert out.argv == ["--seq-length", "2048", "--vocab-file", "/lustre/gpt2-vocab.json", "--merge-file",
                        "/lustre/gpt2-merges.txt", "--tokenizer-type", "GPT2BPETokenizer", "--num-layers", "96",
                        "--mock-data"]


def test_an_unknowable_vocabulary_is_refused_naming_vocab_size() -> None:
    argv = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/models/llama3", "--mock-data"]
    with pytest.raises(ConfigError, match="pass --vocab-size V"):
        substitute(argv, ns(tokenizer_type="HuggingFaceTokenizer", mock_data=True), exists=lambda path: False)
    out = substitute(argv + ["--vocab-size", "128256"],
                     ns(tokenizer_type="HuggingFaceTokenizer", mock_data=True, vocab_size=128256),
                     exists=lambda path: False)
    assert out.argv == ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"]


def test_gpt2_files_without_a_tokenizer_type_name_the_type_megatron_needs() -> None:
    """GPT-3 175B's published example gives GPT-2's files and no --tokenizer-type, which megatron-core 0.19 refuses
    (``tokenizer_type None is not supported``): the message names the type, and the alternative."""
    argv = ["--vocab-file", "/data/gpt2-vocab.json", "--merge-file", "/data/gpt2-merges.txt", "--mock-data"]
    with pytest.raises(ConfigError, match="--tokenizer-type GPT2BPETokenizer") as info:
        substitute(argv, ns(tokenizer_type=None, mock_data=True), exists=lambda path: False)
    assert "--vocab-size V" in str(info.value)
