"""recipes/RESULTS.md is generated from validation/results/*.json: the committed file is current, its conclusions are
computed from the rows, and the producers' data files render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from validation.megatron_functional.run import CaseResult, CaseStatus, results_data
from validation.results import DATA_DIR, DOC_PATH, document, load_sources, main, merge_recipe_run, write_source
from validation.results.render import markdown, recipe_step_within, step_tolerance_counts, within_bound


def test_the_committed_document_is_generated_from_the_data() -> None:
    assert DOC_PATH.read_text() == document(), "recipes/RESULTS.md is stale: run python -m validation.results"


def test_check_names_the_command_when_the_document_is_stale(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "RESULTS.md"
    assert main(["--output", str(out)]) == 0 and main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text() + "hand-edited\n")
    assert main(["--check", "--output", str(out)]) == 1
    assert "run python -m validation.results" in capsys.readouterr().err


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for path in DATA_DIR.glob("*.json"):
        shutil.copy(path, folder / path.name)
    return folder


def _edit(folder: Path, name: str, change: Any) -> None:
    path = folder / f"{name}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_counts_within_tolerance_are_computed_from_the_rows(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    rows = load_sources(folder)["recipes"]["rows"]
    within, checked = step_tolerance_counts(rows)
    assert f"within the tolerance in {within} of {checked} checked comparisons" in document(folder)

    def slower(data: dict[str, Any]) -> None:  # one comparison now misses its 44% tolerance
        row = next(r for r in data["rows"] if r["comparison"] == "n1024 vs n4")
        row["step_err_median_pct"]["max"] = 50.0

    _edit(folder, "recipes", slower)
    text = document(folder)
    assert f"within the tolerance in {within - 1} of {checked} checked comparisons" in text
    assert "megatron-scale-1024 n1024 vs n4 (50.0% against 44%)" in text

    def worse(data: dict[str, Any]) -> None:  # one more validate case beyond 1% of the golden peak
        row = next(r for r in data["rows"] if r["ran"] and r["role"] == "validate"
                   and abs(r["peak_allocated_error_pct"]) < 1)
        row["peak_allocated_error_pct"] = 2.0

    before = load_sources(folder)["megatron_functional"]["rows"]
    ran = [r for r in before if r["ran"] and r["role"] == "validate"]
    close = sum(abs(r["peak_allocated_error_pct"]) <= 1 for r in ran)
    assert f"within 1%: {close} of {len(ran)}." in document(folder)
    _edit(folder, "megatron_functional", worse)
    assert f"within 1%: {close - 1} of {len(ran)}." in document(folder)
    assert document(folder) != DOC_PATH.read_text()


def test_stated_verdicts_agree_with_the_computed_ones() -> None:
    """Where a run states its verdict and nothing but step time could fail it, the computed check agrees."""
    sources = load_sources()
    for row in sources["recipes"]["rows"]:
        within = recipe_step_within(row)
        if row["passed"] is not None and within is not None and set(row.get("failed_on", ["step"])) == {"step"}:
            assert within is row["passed"], row
    ok, n = within_bound(sources["virtual_vs_real"]["rows"])
    assert ok == n == 14


def test_recipe_runs_replace_rows_and_drop_runs_no_row_names() -> None:
    data = {"source": "recipes", "command": "c", "fitting": "f", "fault_rows": [],
            "runs": [{"id": "A", "date": "d", "command": "c", "conditions": "x"},
                     {"id": "B", "date": "d", "command": "c", "conditions": "y"}],
            "rows": [{"recipe": "r1", "run": "A"}, {"recipe": "r2", "run": "B"}]}
    merged = merge_recipe_run(data, {"date": "e", "command": "c2", "conditions": "z"}, [{"recipe": "r1"}], [])
    assert [r["id"] for r in merged["runs"]] == ["B", "C"]
    assert merged["rows"] == [{"recipe": "r2", "run": "B"}, {"recipe": "r1", "run": "C"}]
    assert data["rows"][0] == {"recipe": "r1", "run": "A"}  # the input is left alone


def test_the_functional_tests_producer_writes_a_data_file_the_document_renders(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    mib = 2**20
    fit = "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap"
    validate = "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic"
    ok = {"status": CaseStatus.OK, "measured_peak_allocated_bytes": 1000 * mib, "measured_iteration_time_s": 0.1,
          "predicted_cublas_workspace_bytes": 64 * mib}
    results = [CaseResult(case="gpt3_mcore_tp1_pp2", status=CaseStatus.FAILED,
                          measured_peak_allocated_bytes=1000 * mib, measured_iteration_time_s=0.1,
                          reason="RuntimeError: no | pipes"),
               CaseResult(case=validate, **ok, predicted_peak_allocated_bytes=1010 * mib,
                          predicted_iteration_time_s=0.02, path="emulate"),
               CaseResult(case=fit, **ok, predicted_peak_allocated_bytes=1000 * mib, predicted_iteration_time_s=0.11,
                          graph_refusal="prism: invalid input: group [0, 1] of rank 0 is not a group of the layout")]
    doc = tmp_path / "RESULTS.md"
    write_source("megatron_functional", results_data(results, "abc123"), folder=folder, doc=doc)
    text = doc.read_text()
    validate_row = (f"| {validate} | validate | emulate | 1,000.0 | 1,010.0 | 64.0 | +1.00% | 0.1000 | 0.0200 | "
                    "-80.00% |")
    fit_row = f"| {fit} | fit | drop-in | 1,000.0 | 1,000.0 | 64.0 | +0.00% | 0.1000 | 0.1100 | +10.00% |"
    assert (f"1 pipelined cases predicted by the drop-in, their iteration without the other stages (`prism emulate`: "
            f"prism: invalid input: group [0, 1] of rank 0 is not a group of the layout): {fit}.") in text
    assert text.index(validate_row) < text.index(fit_row)  # validate rows first
    assert "**2 of 3 cases ran.**" in text
    assert ("- **validate** rows (1): peak allocated: mean |error| 1.00%, max 1.00%, within 1%: 1 of 1. iteration "
            "time: mean |error| 80.00%") in text
    assert "- **fit** rows (1): peak allocated: mean |error| 0.00%" in text
    assert "| RuntimeError: no / pipes | 1: gpt3_mcore_tp1_pp2 |" in text and "prism at abc123" in text
    assert text == markdown(load_sources(folder))
    with pytest.raises(ValueError, match="unknown results source"):
        write_source("nothing", {}, folder=folder, doc=doc)
