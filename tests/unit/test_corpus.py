"""The validation corpus: row files load and are checked, the model fingerprint moves with the model files, a result
computed under another fingerprint is stale and left out of the error summaries, fit and validate are apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from validation.corpus.fingerprint import MODEL_FILES, ROOT, model_files, model_fingerprint
from validation.corpus.rows import ROWS_DIR, Row, RowError, load_rows, throughput_row
from validation.corpus.table import corpus_data, row_entry, summary, weak_scaling
from validation.results import DATA_DIR

ROW = ROWS_DIR / "dgxc2502-nemotron4-15b-16-bf16.yaml"


def test_every_row_file_loads_with_a_role_a_source_and_a_prism_command() -> None:
    rows = load_rows()
    assert len(rows) >= 25
    assert {r.kind for r in rows} == {"throughput", "functional"}
    for row in rows:
        assert row.role in ("fit", "validate") and row.source and row.measured_step_s and row.measured_step_s > 0
        assert row.command.split()[:2] in (["prism", "emulate"], ["python", "-m"]) or "=" in row.command.split()[0]
    row = next(r for r in rows if r.name == ROW.stem)
    assert row.command.startswith("prism emulate --world-size 16 --profile dgx-h100 ")
    assert row.layout == "TP4 PP1 MBS4 GBS64 seq 4096" and row.measured_step_s == 2.812


def test_a_row_printing_only_tokens_per_second_gets_its_step_from_them(tmp_path: Path) -> None:
    data = yaml.safe_load(ROW.read_text())
    data["measured"] = {"tokens_per_s_per_gpu": 5825.6}
    row = throughput_row(data, ROW)
    assert row.measured_step_derived and row.measured_step_s == pytest.approx(4096 * 64 / (5825.6 * 16))


def _bad(change: Any) -> str:
    data = yaml.safe_load(ROW.read_text())
    change(data)
    with pytest.raises(RowError) as info:
        throughput_row(data, ROW)
    return str(info.value)


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.pop("measured"), "field `measured` is missing"),
    (lambda d: d.update(role="train"), "field `role` is 'train'; use fit"),
    (lambda d: d.update(name="other"), "name the file other.yaml"),
    (lambda d: d["layout"].update(tp=8), "has --tensor-model-parallel-size 4 but layout.tp is 8"),
    (lambda d: d["layout"].update(gbs=66, mbs=4), "(66) is not a multiple of mbs x dp = 4 x 4"),
    (lambda d: d.update(gpus=18), "(18) is not a multiple of tp x pp x cp = 4"),
    (lambda d: d.update(precision="fp8"), "lacks --fp8-format but precision is fp8"),
    (lambda d: d["measured"].update(step_s=-1), "field `measured.step_s` is -1; it must be a number > 0"),
    (lambda d: d["measured"].update(mfu=0.6), "field `measured.mfu` is not a measured figure"),
    (lambda d: d.update(colour="red"), "field `colour` is not a row field"),
    (lambda d: d["source"].pop("url"), "field `source.url` is missing"),
])
def test_a_bad_row_file_is_refused_naming_the_field_and_the_fix(change: Any, words: str) -> None:
    message = _bad(change)
    assert str(ROW) in message and words in message


def test_an_unknown_row_name_is_refused_naming_the_list_command() -> None:
    with pytest.raises(RowError, match="python -m validation.corpus list"):
        load_rows(["no-such-row*"])


def test_the_fingerprint_moves_with_any_model_file(tmp_path: Path) -> None:
    files = model_files()
    assert any(p.name == "kernels.py" and p.parent.name == "cost" for p in files)
    assert any(p.suffix == ".yaml" for p in files) and len(MODEL_FILES) > 3
    for path in files:
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    assert model_fingerprint(tmp_path) == model_fingerprint()
    profile = tmp_path / "prism_plugin/cost/profiles/dgx-h100.yaml"
    text = profile.read_text()
    assert "min_kernel_us: 2.5" in text
    profile.write_text(text.replace("min_kernel_us: 2.5", "min_kernel_us: 25"))
    assert model_fingerprint(tmp_path) != model_fingerprint()


def _result(row: Row, step_s: float, fingerprint: str | None) -> dict[str, Any]:
    return {"row": row.name, "outcome": "ran", "fingerprint": fingerprint, "prism_commit": "abc",
            "command": row.command,
            "predicted": {"step_s": step_s, "peak_allocated_bytes": row.measured_peak_allocated_bytes}}


def test_stale_results_are_shown_but_left_out_and_fit_rows_are_summarised_apart() -> None:
    rows = {r.name: r for r in load_rows()}
    validate = [r for r in rows.values() if r.role == "validate"][:3]
    fit = Row(**{**{f: getattr(validate[0], f) for f in Row.__slots__}, "name": "a-fit-row", "role": "fit"})
    entries = [row_entry(validate[0], _result(validate[0], validate[0].measured_step_s * 1.04, "now"), "now"),
               row_entry(validate[1], _result(validate[1], validate[1].measured_step_s * 0.90, "now"), "now"),
               row_entry(validate[2], _result(validate[2], validate[2].measured_step_s * 3.0, "old"), "now"),
               row_entry(fit, _result(fit, fit.measured_step_s * 1.5, "now"), "now")]
    assert [e["stale_because"] for e in entries] == [None, None, "model", None]
    assert [e["step_error_pct"] for e in entries] == [4.0, -10.0, 200.0, 50.0]
    valid = summary(entries, "validate")
    assert (valid["rows"], valid["current"], valid["stale"], valid["step_rows"]) == (3, 2, 1, 2)
    assert valid["mean_abs_step_error_pct"] == 7.0 and valid["max_abs_step_error_pct"] == 10.0
    assert valid["step_within_10_pct"] == 2
    fitted = summary(entries, "fit")
    assert (fitted["rows"], fitted["mean_abs_step_error_pct"]) == (1, 50.0)


def test_weak_scaling_series_join_the_rows_that_differ_only_in_gpus_and_global_batch() -> None:
    def entry(gpus: int, gbs: int, measured: float, predicted: float, **kw: Any) -> dict[str, Any]:
        return {"role": "validate", "kind": "throughput", "outcome": "ran", "stale": False, "model": "15B",
                "precision": "bf16", "layout": f"TP4 PP1 MBS4 GBS{gbs} seq 4096", "gpus": gpus,
                "measured_step_s": measured, "predicted_step_s": predicted, **kw}

    entries = [entry(16, 64, 2.812, 2.569), entry(256, 1024, 2.852, 2.569), entry(2048, 8192, 2.887, 2.589),
               entry(512, 1024, 2.0, 2.0),  # another batch per GPU: strong scaling, not in the series
               entry(64, 256, 2.0, 2.0, stale=True), entry(128, 512, 2.0, 2.0, role="fit")]
    (series,) = weak_scaling(entries)
    assert (series["base_gpus"], series["layout"]) == (16, "TP4 PP1 MBS4 GBS seq 4096")
    assert [s["gpus"] for s in series["scales"]] == [256, 2048]
    assert series["scales"][1] == {"gpus": 2048, "measured_pct": -2.6, "predicted_pct": -0.77, "miss_points": 1.83}
    assert weak_scaling(entries[:1]) == []


def test_a_result_of_another_command_than_the_rows_is_stale() -> None:
    row = load_rows([ROW.stem])[0]
    result = _result(row, 3.0, "now")
    assert row_entry(row, result, "now")["stale_because"] is None
    result["command"] = row.command.replace("--tp-comm-overlap", "")
    assert row_entry(row, result, "now")["stale_because"] == "command"
    assert "--tp-comm-overlap" in row.command


def test_the_committed_table_is_current_with_the_rows_results_and_model() -> None:
    committed = json.loads((DATA_DIR / "corpus.json").read_text())
    current = corpus_data(load_rows(), date=committed["date"])
    assert committed == json.loads(json.dumps(current)), (
        "validation/results/corpus.json is not what the rows, their results and the model give (a row, a result or "
        "a model file changed): run python -m validation.corpus table --write-results")


def test_a_functional_case_nvidia_lists_only_as_broken_is_marked() -> None:
    """A case Megatron-LM's own H100 recipe lists only in broken scopes (``mr-broken``) is marked in the table (its
    golden values may predate the branch's code); one that also runs in another scope is not."""
    rows = {r.name: r for r in load_rows(["gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",
                                          "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_decoupled_lr", ROW.stem])}
    broken, nightly, throughput = (row_entry(rows[n], None, "f") for n in (
        "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",
        "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_decoupled_lr", ROW.stem))
    assert rows["gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading"].data["source"]["ci_scope"] == \
        ["mr-broken"]
    assert broken["ci_broken"] is True
    assert nightly["ci_broken"] is False  # mr-broken and mr-github-broken, but nightly too
    assert "ci_broken" not in throughput


def test_rows_at_once_predicts_each_row_once_in_processes_of_their_own(tmp_path: Path, monkeypatch) -> None:
    import os

    from validation.corpus import __main__ as corpus_main

    def fake_run_row(row: Row, **_: Any) -> dict[str, Any]:
        return {"row": row.name, "outcome": "ran", "wall_s": 0.0, "pid": os.getpid()}

    def fake_write(result: dict[str, Any]) -> Path:
        path = tmp_path / f"{result['row']}.json"
        path.write_text(json.dumps(result))
        return path

    monkeypatch.setattr(corpus_main, "run_row", fake_run_row)
    monkeypatch.setattr(corpus_main, "write_result", fake_write)
    rows = load_rows(["dgxc2502-nemotron4-15b-1*"])
    corpus_main._run_rows(rows, timeout_s=1.0, jobs=1, at_once=2)
    written = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(written) == sorted(r.name for r in rows) and len(rows) == 6
    assert os.getpid() not in {w["pid"] for w in written.values()}
    assert corpus_main.main(["run", "--rows", "no-row-here*", "--rows-at-once", "0"]) == 2
