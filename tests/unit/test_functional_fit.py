"""The functional rows' fit/validate split and the fit of the host time per launch
(`validation.megatron_functional`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation.megatron_functional.collect import role
from validation.megatron_functional.fit import fit
from validation.megatron_functional.run import load_cases


def test_every_third_case_by_name_is_a_fit_row_as_the_row_files_say() -> None:
    rows = load_cases()
    names = [r["case"] for r in rows]
    assert {r["case"]: r["role"] for r in rows} == {n: role(n, names) for n in names}
    assert (len(rows), sum(r["role"] == "fit" for r in rows)) == (78, 26)


def _run(out: Path, case: str, measured_s: float, predicted_s: float, launches_per_iteration: int,
         launch_overhead_us: float) -> None:
    """A case's run as `run` leaves it: its result and its rank's summary (3 iterations)."""
    (out / f"{case}.result.json").write_text(json.dumps({
        "case": case, "status": "ok", "measured_iteration_time_s": measured_s,
        "predicted_iteration_time_s": predicted_s}))
    (out / case).mkdir()
    (out / case / "rank7.summary.json").write_text(json.dumps({
        "iterations_marked": 3, "virtual_gpu": {"virtual_time": {
            "launches": 3 * launches_per_iteration, "launch_overhead_us": launch_overhead_us}}}))


def test_the_fit_is_the_median_of_the_figures_that_make_each_fit_row_its_measured_time(tmp_path: Path) -> None:
    cases = load_cases()
    fits = [r["case"] for r in cases if r["role"] == "fit"]
    # c + (measured - predicted) / launches: 50 + 50 = 100, 50 + 10 = 60, 50 - 20 = 30 us
    for case, predicted in zip(fits, (0.05, 0.09, 0.12), strict=False):
        _run(tmp_path, case, 0.1, predicted, 1000, 50.0)
    validate = next(r["case"] for r in cases if r["role"] == "validate")
    _run(tmp_path, validate, 100.0, 0.001, 10, 50.0)  # never read: it would pull the figure far up
    got = fit(tmp_path)
    assert [r["implied_launch_overhead_us"] for r in got["rows"]] == [100.0, 60.0, 30.0]
    assert (got["fitted_launch_overhead_us"], got["converged"], got["ran"]) == (60.0, False, 3)
    assert got["not_ran"] == sorted(fits[3:])
    assert got["fit_error_mean_abs_pct"] == round((50 + 10 + 20) / 3, 2)


def test_the_fit_refuses_rows_run_under_different_figures(tmp_path: Path) -> None:
    fits = [r["case"] for r in load_cases() if r["role"] == "fit"]
    _run(tmp_path, fits[0], 0.1, 0.05, 1000, 50.0)
    _run(tmp_path, fits[1], 0.1, 0.05, 1000, 60.0)
    with pytest.raises(SystemExit, match=r"different host times per launch \[50.0, 60.0\]"):
        fit(tmp_path)
    with pytest.raises(SystemExit, match="no fit row has a run in"):
        fit(tmp_path / "nothing")


def test_a_case_with_te_cuda_graphs_runs_one_step_past_their_capture() -> None:
    from validation.megatron_functional.collect import TRAIN_ITERS
    from validation.megatron_functional.run import command, iterations

    plain = {"args": {"--pipeline-model-parallel-size": "2", "--train-iters": "3"}, "world_size": 8, "rank": 7}
    graphed = {**plain, "args": {**plain["args"], "--cuda-graph-impl": "transformer_engine"}}
    at_once = {**plain, "args": {**graphed["args"], "--cuda-graph-warmup-steps": "0"}}
    # captured at the top of iteration 3 (0-based; Megatron's default warm-up): step 4 holds it, step 5 replays
    assert (iterations(plain), iterations(graphed), iterations(at_once)) == (TRAIN_ITERS, 5, TRAIN_ITERS)
    argv = command(graphed, Path("/tmp/out"))
    assert argv[argv.index("--warmup") + 1] == "4" and argv[argv.index("--train-iters") + 1] == "6"
    dropin = command({**graphed, "args": {**graphed["args"], "--pipeline-model-parallel-size": "1"}}, Path("/tmp/o"))
    assert dropin[dropin.index("--train-iters") + 1] == "5"
