"""The ``fit`` kernel model (prism_plugin.cost.kernel_fit): exact recovery of known efficiencies, the (0, 1]
bound, refusals naming the field, the overlay applied on the roofline, fitting rows, the options and the CLI verb.
Pure: no torch, no processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernel_fit import FitModel, FitRun, fit_efficiencies, job_key, load_fit, run_from_summary
from prism_plugin.cost.kernel_models import kernel_model
from prism_plugin.cost.kernels import KernelClass, KernelCost, KernelEfficiency, RooflineModel

H100 = gpu_spec("h100-sxm")
EFF = {"gemm": (0.75, 0.8), "attention": (0.5, 0.8), "elementwise": (0.5, 0.85), "norm": (0.5, 0.7)}


def _run(name: str, gemm: float, attention: float, other: float, x_gemm: float, x_att: float) -> FitRun:
    """A run whose measured step is what the linear model gives at scales (x_gemm, x_att)."""
    step = gemm + attention + other
    return FitRun(name=name, emulated_step_s=step, measured_step_s=other + gemm * x_gemm + attention * x_att,
                  class_step_s={"gemm": gemm, "attention": attention, "elementwise": other / 2}, efficiency=EFF)


def test_two_classes_recover_known_efficiencies_exactly() -> None:
    # GEMMs really 1.25x the profile's time (efficiency 0.75 -> 0.6), attention 2x (0.5 -> 0.25)
    runs = [_run("a", 0.5, 0.25, 0.125, 1.25, 2.0), _run("b", 0.25, 0.5, 0.125, 1.25, 2.0),
            _run("c", 0.125, 0.0625, 0.25, 1.25, 2.0)]
    result = fit_efficiencies(runs, ["gemm", "attention"])
    assert result.scale == {"gemm": 1.25, "attention": 2.0}
    assert result.efficiency == {"gemm": (0.6, 0.64), "attention": (0.25, 0.4)}
    assert result.residual_rms_s == 0.0 and result.at_bound == ()
    assert result.fitted_step_s == tuple(r.measured_step_s for r in runs) == (1.25, 1.4375, 0.53125)
    overlay = result.overlay()
    assert overlay["kernels"] == {"gemm": {"compute_efficiency": 0.6, "memory_efficiency": 0.64},
                                  "attention": {"compute_efficiency": 0.25, "memory_efficiency": 0.4}}
    assert [r["name"] for r in overlay["fitted_on"]] == ["a", "b", "c"]
    assert [r["measured_step_s"] for r in overlay["fitted_on"]] == [1.25, 1.4375, 0.53125]


def test_one_class_one_run_and_least_squares_over_noisy_runs() -> None:
    # module docstring example: GEMMs 6 ms of a 10 ms step, measured 13 ms -> x 1.5, efficiency 0.75 -> 0.5
    one = FitRun(name="one", emulated_step_s=0.010, measured_step_s=0.013, class_step_s={"gemm": 0.006},
                 efficiency=EFF)
    result = fit_efficiencies([one])
    assert result.scale["gemm"] == pytest.approx(1.5, rel=1e-15)
    assert result.efficiency["gemm"] == pytest.approx((0.5, 0.8 / 1.5), rel=1e-15)
    # two runs disagreeing: the least-squares x over (T, b) = (1, 1.5) and (1, 2.5) is their mean, 2
    runs = [FitRun(name=n, emulated_step_s=1.0, measured_step_s=m, class_step_s={"gemm": 1.0}, efficiency=EFF)
            for n, m in (("p", 1.5), ("q", 2.5))]
    result = fit_efficiencies(runs)
    assert result.scale == {"gemm": 2.0} and result.fitted_step_s == (2.0, 2.0) and result.residual_rms_s == 0.5


def test_efficiencies_stay_within_the_bound() -> None:
    # measured faster than GEMMs at peak allow: held at x = max(0.75, 0.8) = 0.8 (memory efficiency exactly 1)
    fast = FitRun(name="fast", emulated_step_s=1.0, measured_step_s=0.25, class_step_s={"gemm": 1.0},
                  efficiency=EFF)
    result = fit_efficiencies([fast])
    assert result.scale == {"gemm": 0.8} and result.at_bound == ("gemm",)
    assert result.efficiency == {"gemm": (0.75 / 0.8, 1.0)}
    # two classes, one of them pushed to its bound: the other refits with it clamped
    runs = [_run("a", 0.5, 0.25, 0.125, 0.25, 2.0), _run("b", 0.25, 0.5, 0.125, 0.25, 2.0),
            _run("c", 0.125, 0.0625, 0.25, 0.25, 2.0)]
    result = fit_efficiencies(runs, ["gemm", "attention"])
    assert result.at_bound == ("gemm",) and result.scale["gemm"] == 0.8
    assert 0 < result.efficiency["attention"][0] <= 1 and max(result.efficiency["gemm"]) == 1.0


@pytest.mark.parametrize(("runs", "classes", "message"), [
    ([], ["gemm"], "no runs"),
    ([_run("a", 0.5, 0.25, 0.1, 1, 1)], ["gemm", "attention"], r"1 run\(s\) cannot determine 2 classes"),
    ([_run("a", 0.5, 0.25, 0.1, 1, 1)], ["gem"], "class 'gem' is not a kernel class"),
    ([_run("a", 0.5, 0.25, 0.1, 1, 1), _run("a", 0.4, 0.2, 0.1, 1, 1)], ["gemm"], "run names repeat"),
    ([_run("a", 0.5, 0.25, 0.1, 1, 1), _run("b", 1.0, 0.5, 0.1, 1, 1)], ["gemm", "attention"],
     "cannot tell gemm, attention apart"),
    ([_run("a", 0.5, 0.25, 0.1, 1, 1)], ["norm"], "no run has norm kernels"),
])
def test_bad_fits_are_refused(runs: list[FitRun], classes: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        fit_efficiencies(runs, classes)


def test_runs_of_different_profiles_are_refused() -> None:
    a = _run("a", 0.5, 0.25, 0.1, 1, 1)
    b = FitRun(name="b", emulated_step_s=1, measured_step_s=1, class_step_s={"gemm": 0.5},
               efficiency={"gemm": (0.7, 0.8)})
    with pytest.raises(ConfigError, match="different gemm efficiencies"):
        fit_efficiencies([a, b])


def _summary(**kernels: Any) -> dict[str, Any]:
    base = {"model": "roofline", "step_by_class_s": [{"gemm": 0.001}, {"gemm": 0.002}],
            "efficiency": {c: list(e) for c, e in EFF.items()},
            "job": {"key": "abc", "argv": ["train.py"], "world_size": 8}}
    return {"rank": 3, "world_size": 8, "run_id": "r1",
            "virtual_gpu": {"virtual_time": {"step_times_s": [0.004, 0.005]}, "kernels": {**base, **kernels}}}


def test_a_run_from_a_summary_takes_its_last_step() -> None:
    run = run_from_summary(_summary(), name="x", measured_step_s=0.006)
    assert (run.emulated_step_s, dict(run.class_step_s), run.job, run.rank, run.world_size, run.run_id) == (
        0.005, {"gemm": 0.002}, "abc", 3, 8, "r1")
    assert run.efficiency["gemm"] == (0.75, 0.8)


@pytest.mark.parametrize(("summary", "measured", "message"), [
    (_summary(), 0, "measured step time must be a number of seconds > 0"),
    (_summary(model="table"), 1.0, r"`virtual_gpu.kernels.model` is table"),
    (_summary(step_by_class_s=[{}]), 1.0, r"`virtual_gpu.kernels.step_by_class_s` missing"),
    ({"virtual_gpu": {"virtual_time": {"step_times_s": []}, "kernels": {}}}, 1.0,
     r"`virtual_gpu.virtual_time.step_times_s` is empty"),
    ({"rank": 0}, 1.0, r"field `virtual_gpu` missing"),
    ({"summaries": []}, 1.0, "holds several summaries"),
    ({"classes": [], "replay": {}}, 1.0, "emulate report's step is the graph replay's"),
])
def test_bad_summaries_are_refused_naming_the_field(summary: dict[str, Any], measured: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_from_summary(summary, name="x", measured_step_s=measured)


def _overlay(tmp_path: Path, **changes: Any) -> Path:
    runs = [_run("a", 0.5, 0.25, 0.125, 1.25, 2.0), _run("b", 0.25, 0.5, 0.125, 1.25, 2.0)]
    runs = [FitRun(**{**{f: getattr(r, f) for f in r.__slots__}, "job": f"job-{r.name}"}) for r in runs]
    data = {**fit_efficiencies(runs, ["gemm", "attention"]).overlay(), **changes}
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_overlay_scales_every_kernel_of_a_class_exactly(tmp_path: Path) -> None:
    path = _overlay(tmp_path)
    base = KernelEfficiency.from_mapping({"gemm": {"compute_efficiency": 0.75, "memory_efficiency": 0.8},
                                          "attention": {"compute_efficiency": 0.5, "memory_efficiency": 0.8}})
    model = kernel_model("fit", H100, base, fit_path=path)
    assert isinstance(model, FitModel) and model.name == "fit"
    roof = RooflineModel(H100, base)
    compute_bound = KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=2 * 4096**3,
                               bytes=3 * 4096**2 * 2, dtype="bfloat16", shape=(4096, 4096, 4096))
    memory_bound = KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=2 * 8192 * 8192 * 16,
                              bytes=(2 * 8192 * 16 + 8192 * 8192) * 2, dtype="bfloat16", shape=(8192, 8192, 16))
    for cost in (compute_bound, memory_bound):
        assert model.duration_s(cost) == pytest.approx(1.25 * roof.duration_s(cost), rel=1e-12)
    assert model.efficiency.compute_efficiency(KernelClass.ATTENTION) == 0.25
    # other classes keep the profile's figures
    assert model.efficiency.memory_efficiency(KernelClass.NORM) == base.memory_efficiency(KernelClass.NORM)
    assert model.is_fitting_row("job-a") and not model.is_fitting_row("job-z")
    report = model.report("job-b")
    assert report["fitting_row"] is True and [r["name"] for r in report["fitted_on"]] == ["a", "b"]


def test_bad_overlays_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="`fitted_on` must list the fitting runs"):
        load_fit(_overlay(tmp_path, fitted_on=[]))
    with pytest.raises(ConfigError, match=r"`kernels.gemm.compute_efficiency` must be a fraction in \(0, 1\]"):
        load_fit(_overlay(tmp_path, kernels={"gemm": {"compute_efficiency": 1.5}}))
    with pytest.raises(ConfigError, match="not a kernel fit"):
        load_fit(_overlay(tmp_path, format="prism-kernel-table"))
    with pytest.raises(ConfigError, match="cannot read kernel fit"):
        load_fit(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="kernel_model=fit goes with a fit overlay"):
        kernel_model("roofline", H100, None, fit_path=tmp_path / "fit.yaml")


def test_job_keys_ignore_output_locations_not_arguments() -> None:
    assert job_key(["t.py", "--prism-output=x", "--lr", "1"], 2) == job_key(["t.py", "--lr", "1"], 2)
    assert job_key(["t.py", "--lr", "1"], 2) != job_key(["t.py", "--lr", "2"], 2)
    assert job_key(["t.py"], 2) != job_key(["t.py"], 4)


def test_options_take_the_fit_from_the_environment(tmp_path: Path) -> None:
    from prism_plugin.runtime.device_session import VirtualTimeOptions

    path = _overlay(tmp_path)
    options = VirtualTimeOptions.from_env({"PRISM_KERNEL_MODEL": "fit", "PRISM_KERNEL_FIT": str(path)})
    assert (options.kernel_model, options.kernel_fit) == ("fit", path)
    for env, match in (({"PRISM_KERNEL_MODEL": "fit"}, "PRISM_KERNEL_MODEL='fit' needs PRISM_KERNEL_FIT="),
                       ({"PRISM_KERNEL_FIT": str(path)}, "is read by the fit kernel model, not by "
                                                         "PRISM_KERNEL_MODEL='roofline'"),
                       ({"PRISM_KERNEL_MODEL": "fit", "PRISM_KERNEL_FIT": str(tmp_path / "none.yaml")},
                        "none.yaml' is not a file; write one with `prism kernels fit`")):
        with pytest.raises(ConfigError, match=match):
            VirtualTimeOptions.from_env(env)


def test_the_cli_writes_an_overlay_naming_its_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from prism_plugin.cli.main import main

    (tmp_path / "s.json").write_text(json.dumps(_summary()))
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump({"runs": [{"name": "y", "summary": "s.json",
                                                                   "measured_step_s": 0.007}]}))
    out = tmp_path / "fit.yaml"
    assert main(["kernels", "fit", "--run", f"x={tmp_path / 's.json'}:0.006", "--runs", str(tmp_path / "runs.yaml"),
                 "--output", str(out)]) == 0
    data = load_fit(out)
    assert [(r["name"], r["measured_step_s"]) for r in data.fitted_on] == [("x", 0.006), ("y", 0.007)]
    # least squares over b = 0.006 - 0.003 and 0.007 - 0.003 with T = 0.002: x = 1.75
    assert data.kernels["gemm"]["compute_efficiency"] == pytest.approx(0.75 / 1.75, rel=1e-12)
    with pytest.raises(SystemExit):
        main(["kernels", "fit", "--run", "s.json", "--output", str(out)])
    assert "give [NAME=]SUMMARY.json:MEASURED_STEP_SECONDS" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "message"), [
    ("0", "measured step time 0.0 s must be > 0"), ("-0.5", "measured step time -0.5 s must be > 0"),
    ("1e-9", "is under 1e-06 s, shorter than one kernel launch"), ("nan", "is not a number")])
def test_the_cli_says_what_is_wrong_with_a_measured_time(value: str, message: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from prism_plugin.cli.main import main

    with pytest.raises(SystemExit):
        main(["kernels", "fit", "--run", f"s.json:{value}", "--output", str(tmp_path / "fit.yaml")])
    assert message in capsys.readouterr().err
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump({"runs": [{"summary": "s.json",
                                                                   "measured_step_s": float(value)}]}))
    assert main(["kernels", "fit", "--runs", str(tmp_path / "runs.yaml"), "--output", str(tmp_path / "f.yaml")]) == 2
    err = capsys.readouterr().err
    assert "runs[0]: measured step time" in err
    assert not (tmp_path / "f.yaml").exists()


def test_time_settings_are_named_as_the_entry_point_spells_them(tmp_path: Path) -> None:
    from prism_plugin.config.resolve import resolve
    from prism_plugin.config.settings import Entry
    from prism_plugin.runtime.device_session import VirtualTimeOptions

    table = tmp_path / "t.json"
    table.write_text("{}")
    cases = [({"kernel_model": "roofline", "kernel_table": str(table)},
              f"--kernel-table {table} is read by the table kernel model, not by --kernel-model roofline: add "
              "--kernel-model table or drop --kernel-table"),
             ({"kernel_model": "table"}, "--kernel-model table needs --kernel-table <file>"),
             ({"virtual_time": "off", "kernel_model": "table", "kernel_table": str(table)},
              "--virtual-time off keeps no time, so --kernel-model table and --kernel-table"),
             ({"virtual_time": "off", "program_time": "emulated"},
              "--virtual-time off keeps no time, so --program-time emulated would do nothing"),
             ({"virtual_time": "maybe"}, "--virtual-time maybe: use one of on, off")]
    for values, message in cases:  # prism run's flags, through the one validator
        with pytest.raises(ConfigError) as exc:
            resolve({"world_size": 1, "real_ranks": "0", "device": "virtual-gpu", **values}, Entry.RUN, environ={})
        assert message in str(exc.value)
    assert VirtualTimeOptions.from_env({"PRISM_VIRTUAL_TIME": "off"}).enabled is False
