"""A Megatron job's argument list read and rewritten flag by flag (`prism_plugin.adapters.megatron.argv`)."""

from __future__ import annotations

from prism_plugin.adapters.megatron.argv import flag_values, without_flags

ARGV = ["--data-path", "0.3", "a", "0.7", "b", "--split=99,1,0", "--mock-data", "--vocab-file", "v.json", "-x"]


def test_a_flags_values_run_to_the_next_flag_in_both_spellings() -> None:
    assert flag_values(ARGV, "--data-path") == ["0.3", "a", "0.7", "b"]
    assert flag_values(ARGV, "--split") == ["99,1,0"]
    assert flag_values(ARGV, "--vocab-file") == ["v.json", "-x"]  # a single dash does not end the values
    assert flag_values(ARGV, "--mock-data") == [] and flag_values(ARGV, "--merge-file") == []
    assert flag_values(["--data-path-extra", "c"], "--data-path") == []  # a longer flag is another flag


def test_without_drops_the_flags_and_their_values_only() -> None:
    assert without_flags(ARGV, ("--data-path", "--split")) == ["--mock-data", "--vocab-file", "v.json", "-x"]
    assert without_flags(ARGV, ("--vocab-file", "--mock-data")) == ARGV[:6]
    assert without_flags(ARGV, ()) == ARGV
