"""The per-rank summary's typed model and its published JSON schema (issue 19, part 2)."""

from __future__ import annotations

import json

import pytest

from prism_plugin.runtime.lifecycle import write_summary
from prism_plugin.runtime.summary import SCHEMA_PATH, check, schema

GOOD = {"rank": 5, "world_size": 8192, "real_ranks": [5], "profile": "dgx-h100", "data_policy": "mirror",
        "arrivals": "symmetric", "arrivals_note": "...", "groups_created": 3, "iterations_marked": 2,
        "op_counts": {"all_reduce": 4}, "op_bytes": {"all_reduce": 64}, "modelled_comm_s": 0.001, "clock": "wall",
        "communicator_memory": {"modelled_bytes": 0}, "emulated_waits": {"waits_slept": 0}, "exit_code": 0}


def test_the_published_schema_is_the_models() -> None:
    assert json.loads(SCHEMA_PATH.read_text()) == schema(), "run python -m prism_plugin.runtime.summary"


def test_a_summary_matches_or_the_mismatch_names_the_field() -> None:
    assert check(GOOD) is None
    assert check({"rank": 3, "world_size": 8, "real_ranks": [3], "emulated": False, "exit_code": 0,
                  "note": "never called init_process_group"}) is None
    assert "RankSummary.clock: Input should be 'wall' or 'emulated'" in str(check({**GOOD, "clock": "lunar"}))
    assert "RankSummary.surprise: Extra inputs are not permitted" in str(check({**GOOD, "surprise": 1}))


def test_a_mismatching_summary_is_written_and_said(tmp_path: pytest.TempPathFactory,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = write_summary({**GOOD, "surprise": 1}, tmp_path, stdout=False)  # type: ignore[arg-type]
    assert path is not None and json.loads(path.read_text())["surprise"] == 1  # never lost
    assert "prism: the summary of rank 5 does not match its schema" in capsys.readouterr().err
