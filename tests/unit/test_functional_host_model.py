"""The host model by kind (`validation.megatron_functional.host_model`): its fit, its linearised prediction and
which runs' counts it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation.megatron_functional import host_model


def test_nnls_finds_the_non_negative_optimum() -> None:
    assert host_model._nnls([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [2.0, 3.0, 5.0]) == pytest.approx([2.0, 3.0])
    # unconstrained, the second figure would be negative: the fit drops it and refits the first alone
    theta = host_model._nnls([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]], [0.5, 1.5, 2.5])
    assert theta[1] == 0.0 and theta[0] == pytest.approx((0.5 + 3.0 + 7.5) / 14)


def _row(measured: float, predicted: float, launches: float, ops: float) -> dict:
    return {"case": "c", "role": "fit", "measured_s": measured, "predicted_s": predicted, "c0_s": 80e-6,
            "x": {"launches": launches, "non_launch_ops": ops}}


def test_the_current_figure_predicts_what_the_rows_ran() -> None:
    row = _row(0.1, 0.12, 1000, 5000)
    assert host_model.predict(row, {"launches": 80e-6}) == pytest.approx(0.12)


def test_a_form_fitted_on_rows_a_host_of_that_form_made_recovers_its_figures() -> None:
    # a host that pays 30 us a launch and 4 us an op beyond: each row's measured iteration
    rows = []
    for launches, ops in ((1000, 4000), (2000, 3000), (1500, 9000), (3000, 12000)):
        measured = 30e-6 * launches + 4e-6 * ops + 0.01
        predicted = 80e-6 * launches + 0.01  # the run's host: 80 us a launch, the same 10 ms besides
        rows.append(_row(measured, predicted, launches, ops))
    theta = host_model.fit_form(rows, ("launches", "non_launch_ops"))
    assert theta == pytest.approx({"launches": 30e-6, "non_launch_ops": 4e-6})
    assert [host_model.predict(r, theta) for r in rows] == pytest.approx([r["measured_s"] for r in rows])


def _write_run(out: Path, case: str, *, skipped: int = 0, graphs: bool = False) -> None:
    (out / case).mkdir(parents=True)
    (out / f"{case}.result.json").write_text(json.dumps(
        {"status": "ok", "path": "drop-in", "measured_iteration_time_s": 0.1, "predicted_iteration_time_s": 0.12}))
    gpu = {"virtual_time": {"launches": 3000, "native_launches": 300, "launch_overhead_us": 80.0},
           "host_counts": {"device_ops": 12000, "backward_device_ops": 5000,
                           "module_calls": {"megatron": 300, "transformer_engine": 60, "torch": 3}}}
    if graphs:
        gpu["cuda_graphs"] = {"captures": 1}
    (out / case / "rank7.summary.json").write_text(json.dumps(
        {"iterations_marked": 3, "virtual_gpu": gpu, "megatron": {"fast_forward": {"microbatches_skipped": skipped}}}))


def test_row_counts_per_iteration_and_the_runs_left_out(tmp_path: Path) -> None:
    _write_run(tmp_path, "plain")
    row = host_model.row_counts("plain", "fit", tmp_path)
    assert row is not None
    assert row["x"] == pytest.approx({"launches": 900, "non_launch_ops": 3100, "forward_ops": 7000 / 3,
                                      "backward_ops": 5000 / 3, "te_modules": 20, "megatron_modules": 100,
                                      "other_modules": 1, "iteration": 1})
    _write_run(tmp_path, "skipped", skipped=4)
    _write_run(tmp_path, "graphs", graphs=True)
    assert host_model.row_counts("skipped", "fit", tmp_path) is None
    assert host_model.row_counts("graphs", "fit", tmp_path) is None
    assert host_model.row_counts("absent", "fit", tmp_path) is None

