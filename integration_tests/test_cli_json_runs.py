"""Issue 14, part 5, for the commands whose programs own stdout: ``prism run --json PATH`` and
``prism profile --json PATH`` write their document to a file (the toy program, one real rank of 2, a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_plugin.cli.main import main

pytestmark = pytest.mark.slow

TOY = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "toy_train.py"


def test_prism_run_json_writes_this_runs_summaries(tmp_path: Path) -> None:
    doc_path = tmp_path / "run.json"
    rc = main(["run", "--world-size", "2", "--real-ranks", "1", "--output", str(tmp_path / "out"), "--json",
               str(doc_path), "--", str(TOY), "--tp", "2", "--steps", "3"])
    assert rc == 0
    doc = json.loads(doc_path.read_text())
    assert (doc["exit_code"], doc["world_size"], doc["real_ranks"]) == (0, 2, [1])
    (summary,) = doc["summaries"]
    assert summary["rank"] == 1 and summary["run_id"] == doc["run_id"] and summary["op_counts"]["all_reduce"] > 0


def test_prism_profile_json_names_its_runs_and_graph(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    assert main(["slice", "--layout", "tp=2,dp=1", "--devices", "1", "--out", str(plan)]) == 0
    doc_path = tmp_path / "profile.json"
    assert main(["profile", "--plan", str(plan), "--out", str(tmp_path / "prof"), "--json", str(doc_path), "--",
                 str(TOY), "--tp", "2", "--steps", "4"]) == 0
    doc = json.loads(doc_path.read_text())
    assert [r["real_ranks"] for r in doc["runs"]] == [[0]]  # TP peers are one class: one run covers them
    assert doc["graph"]["path"] == str(tmp_path / "prof" / "job.graph") and Path(doc["graph"]["path"]).is_file()
    assert doc["graph"]["classes"] >= 1 and doc["wall_s"] > 0
