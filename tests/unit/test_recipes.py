"""Recipes: the schema and its errors, the pure comparison, the probe in process, command lines, reports, CLI.

Tier (a)/(b): no process is started here (the probe runs in this process, without torch.distributed);
integration_tests/recipes/ runs the small CPU recipes end to end.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from prism_plugin.cli.main import main
from prism_plugin.cli.recipes import DEFAULT_RECIPE, find_recipe
from prism_plugin.recipes.compare import compare, noise_spread, rank_figures, summarise
from prism_plugin.recipes.load import load_recipe, recipe_from_mapping, recipe_from_yaml
from prism_plugin.recipes.plans import (
    deepspeed_config,
    emulation_plan,
    logged_first_loss,
    megatron_args,
    real_plan,
    toy_args,
)
from prism_plugin.recipes.probe import Probe, _decimate, chrome_trace
from prism_plugin.recipes.report import _step_coordinates, plot_recipe, result_table, write_index, write_summary
from prism_plugin.recipes.runner import RecipeResult, RunOutcome
from prism_plugin.recipes.schema import Framework, Layout, RecipeError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

BASE: dict[str, Any] = {
    "name": "t",
    "framework": "torch",
    "model": {"hidden_size": 64, "micro_batch_size": 4},
    "layout": {"tp": 2},
    "steps": {"total": 6, "warmup": 2},
    "real": {"world_size": 4},
    "emulated": [{"name": "n4", "world_size": 4, "runs": [[0], [3]]}],
}


def _with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        keys = dotted.split("__")
        target = data
        for k in keys[:-1]:
            target = target[k] if not isinstance(target, list) else target[int(k)]
        if isinstance(target, list):
            target[int(keys[-1])] = value
        elif value is _DELETE:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return data


_DELETE = object()


# -- schema ----------------------------------------------------------------------------------------------


def test_minimal_recipe_and_derived_numbers() -> None:
    r = recipe_from_mapping(BASE)
    assert r.framework is Framework.TORCH
    assert r.layout.dp(4, "real") == 2 and r.layout.dp(8192, "x") == 4096
    assert r.steps.measured == 4
    assert r.emulated[0].real_ranks == (0, 3)
    assert r.tolerances.memory_bytes == 0 and r.tolerances.step_time_rel is None
    assert r.tolerances_for(r.emulated[0]) is r.tolerances


def test_layout_dp_example() -> None:
    assert Layout(tp=2, pp=2).dp(8192, "emulated[0]") == 2048


MEGATRON = {**BASE, "framework": "megatron", "real": {"world_size": 4, "launcher": "prism"},
            "model": {"hidden_size": 64, "num_layers": 4, "num_attention_heads": 4, "seq_length": 32,
                      "vocab_size": 128, "micro_batch_size": 2, "microbatches_per_step": 4}}

BAD = [
    (_with(modle={}), "unknown field `modle`; did you mean `model`?"),
    (_with(model={"hidden_size": 64, "micro_batch": 2}), "did you mean `micro_batch_size`?"),
    (_with(steps=_DELETE), "missing field `steps`"),
    (_with(real={"world_size": 3}), "real.world_size=3 is not a multiple of tp x pp x cp = 2"),
    (_with(steps={"total": 3, "warmup": 2}), "leaves 1 measured steps"),
    (_with(steps={"total": 5, "warmup": 0}), "steps.warmup must be an integer >= 1"),
    (_with(emulated__0__runs=[[0], [0, 3]]), "lists a rank twice"),
    (_with(emulated__0__runs=[[4]]), "ranks [4] are outside 0..3"),
    (_with(emulated__0__runs="0"), "runs must be a non-empty list"),
    (_with(emulated__0__compare_with="small"), "compare_with='small': use 'real' or the name of an earlier"),
    (_with(emulated__0__world_size=8192), "ranks is needed: world sizes differ"),
    (_with(emulated__0__data_policy="recorded"), "data_policy=recorded replays the real run's payloads"),
    (_with(emulated__0__data_policy="zeros"), "use mirror or recorded"),
    (_with(emulated__0__data_policy="magic"), "data_policy='magic' is not one of"),
    (_with(emulated__0__step_time_adjust="modelled_comm"), "the real run has no modelled communication"),
    (_with(emulated__0__name="n 4"), "short identifier"),
    (_with(tolerances={"step_time_rel": 0.2}), "needs tolerances.noise"),
    (_with(tolerances={"step_time_rel": 0.1, "noise": {"runs": 5, "spread_rel": 0.08}}),
     "tighter than noise_factor x measured noise = 2 x 0.08 = 0.16"),
    (_with(tolerances={"step_time_rel": 0.3, "noise": {"runs": 2, "spread_rel": 0.08}}), "noise.runs must be >= 3"),
    (_with(tolerances={"memory_bytes": -1}), "tolerances.memory_bytes must be an integer >= 0"),
    (_with(tolerances={"step_time_rel": 0.2, "noise": {"runs": 5, "spread_rel": 0.05}}),
     "repeats: 1, but emulation(s) n4 check step time (tolerances.step_time_rel): its width is held against the "
     "run-to-run noise measured in the same run, which needs repeats: 3 or more"),
    (_with(layout={"tp": 2, "pp": 2}), "framework torch (the toy TP x DP program) supports layout.tp only"),
    (_with(layout={"tp": 1, "vpp": 2}), "layout.vpp (interleaved pipeline) needs layout.pp >= 2"),
    (_with(tier="nightly"), "tier='nightly' is not one of ci, small, benchmark"),
    (_with(name="a b"), "without spaces or slashes"),
    (_with(repeats=0), "repeats must be an integer >= 1"),
    ({**MEGATRON, "model": {"hidden_size": 64, "micro_batch_size": 2}}, "framework megatron needs model.num_attention"),
    ({**MEGATRON, "layout": {"tp": 2, "pp": 2, "vpp": 4}}, "num_layers=4 must divide by pp x vpp = 8"),
    ({**MEGATRON, "layout": {"ep": 2}}, "layout.ep > 1 needs model.num_experts"),
    ({**BASE, "framework": "deepspeed", "layout": {"pp": 2}}, "framework deepspeed needs layout.zero_stage"),
    ({**BASE, "framework": "deepspeed", "layout": {"pp": 2, "zero_stage": 3}},
     "works with ZeRO stage 0 or 1, not 3"),
]


@pytest.mark.parametrize(("data", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_recipes_name_field_and_fix(data: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError) as exc:
        recipe_from_mapping(data, source=Path("recipes/x.yaml"))
    assert message in str(exc.value)
    assert str(exc.value).startswith("recipes/x.yaml: ")


def test_malformed_yaml_names_line() -> None:
    with pytest.raises(RecipeError, match=r"x.yaml:3:8: malformed YAML"):
        recipe_from_yaml("name: t\nframework: torch\nmodel: : x\n", source=Path("x.yaml"))


def test_unknown_profile_fails_at_load(tmp_path: Path) -> None:
    data = _with(emulated__0__profile="dgx-b900")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match="emulated\\[n4\\].profile: unknown profile 'dgx-b900'"):
        load_recipe(tmp_path / "r.yaml")


def test_profile_path_relative_to_recipe(tmp_path: Path) -> None:
    from prism_plugin.cost import load_profile
    from prism_plugin.cost.profiles import profile_to_yaml

    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "mine.yaml").write_text(profile_to_yaml(load_profile("dgx-h100")))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(_with(emulated__0__profile="profiles/mine.yaml")))
    r = load_recipe(tmp_path / "r.yaml")
    assert r.resolve_profile(r.emulated[0]) == str((tmp_path / "profiles" / "mine.yaml").resolve())


def test_per_emulation_tolerances_override() -> None:
    data = _with(emulated__0__tolerances={"loss_rel": 0})
    r = recipe_from_mapping(data)
    assert r.tolerances_for(r.emulated[0]).loss_rel == 0.0 and r.tolerances.loss_rel is None


def test_every_shipped_recipe_is_valid() -> None:
    paths = sorted(RECIPES.glob("*.yaml"))
    assert len(paths) >= 16
    names = set()
    for p in paths:
        r = load_recipe(p)
        assert r.name == p.stem, f"{p}: name must equal the file name"
        names.add(r.name)
        for emu in r.emulated:
            tol = r.tolerances_for(emu)
            assert tol.memory_bytes == 0, f"{p}: memory must be compared exactly"
            if tol.step_time_rel is not None:  # justified by the recorded noise (the schema checks the floor)
                assert tol.noise is not None and tol.noise.runs >= 3
    assert DEFAULT_RECIPE in names
    for required in ("megatron-tp2", "megatron-tp2-n2", "megatron-pp2", "megatron-dp4", "megatron-tp2-pp2",
                     "megatron-pp2-vpp2", "megatron-moe-ep2", "deepspeed-zero1", "deepspeed-zero3", "deepspeed-pipe2",
                     "megatron-scale-1024", "megatron-scale-8192", "megatron-scale-65536"):
        assert required in names
    scale = [load_recipe(RECIPES / f"megatron-scale-{n}.yaml") for n in (1024, 8192, 65536)]
    for n, r in zip((1024, 8192, 65536), scale, strict=True):
        assert max(e.world_size for e in r.emulated) == n
        assert all(len(run) == 1 for e in r.emulated for run in e.runs)  # one real rank per emulation
        assert r.tier.value == "benchmark"


# -- compare ----------------------------------------------------------------------------------------------


def _doc(rank: int, times: list[float], *, peak: int = 1000, step_peaks: list[int] | None = None,
         loss: float | None = 2.0, comm: float | None = None) -> dict[str, Any]:
    steps = [{"index": 0, "end_s": 1.0, "duration_s": None, "peak_bytes": step_peaks[0] if step_peaks else peak,
              "live_bytes": 10, "loss": loss, "modelled_comm_s": None}]
    for i, t in enumerate(times, start=1):
        steps.append({"index": i, "end_s": 1.0 + sum(times[:i]), "duration_s": t,
                      "peak_bytes": step_peaks[i] if step_peaks else peak, "live_bytes": 10, "loss": loss,
                      "modelled_comm_s": comm})
    return {"schema": "prism-recipe-metrics/1", "rank": rank, "world_size": 4, "label": "", "peak_bytes":
            max(step_peaks) if step_peaks else peak, "first_loss": loss, "steps": steps,
            "timeline": {"t_s": [0.5, 1.0], "live_bytes": [10, peak]}, "memory_source": "test"}


def test_rank_figures_median_mean_and_steady_peak() -> None:
    doc = _doc(0, [0.1, 0.3, 0.2, 0.2, 0.5], step_peaks=[900, 5000, 800, 800, 810, 800])
    f = rank_figures([doc], warmup=2, total=6, where="x")
    assert f.step_times_s == (0.3, 0.2, 0.2, 0.5)  # steps 2..5
    assert f.median_step_s == pytest.approx(0.25) and f.mean_step_s == pytest.approx(0.3)
    # steady peak: what every measured step reaches; not the warm-up transient, not step 4's extra 10 bytes
    assert f.peak_bytes == 800 and f.max_peak_bytes == 810 and f.run_peak_bytes == 5000
    pooled = rank_figures([doc, _doc(0, [0.1, 0.1, 0.1, 0.1, 0.1], step_peaks=[900, 900, 800, 800, 900, 800])],
                          warmup=2, total=6, where="x")
    assert len(pooled.step_times_s) == 8 and pooled.peak_bytes == 800 and pooled.max_peak_bytes == 900


def test_rank_figures_refuses_wrong_step_count() -> None:
    with pytest.raises(ValueError, match="made 4 optimizer steps, the recipe expects steps.total=6"):
        rank_figures([_doc(3, [0.1, 0.1, 0.1])], warmup=2, total=6, where="r: run real")


def _figs(recipe: Any, docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, ds in docs.items():
        out[label] = {d["rank"]: rank_figures([d], warmup=recipe.steps.warmup, total=recipe.steps.total,
                                              where=label) for d in ds}
    return out


def test_compare_errors_and_verdicts() -> None:
    data = _with(tolerances={"step_time_rel": 0.2, "loss_rel": 0, "noise": {"runs": 5, "spread_rel": 0.05}},
                 repeats=3)
    r = recipe_from_mapping(data)
    figs = _figs(r, {"real": [_doc(0, [1.0] * 5), _doc(3, [1.0] * 5, loss=3.0)],
                     "n4": [_doc(0, [1.1] * 5), _doc(3, [1.5] * 5, peak=1004, loss=3.0)]})
    c0, c3 = compare(r, figs)
    assert c0.step_error_median == pytest.approx(0.1) and c0.step_ok and c0.memory_ok and c0.loss_ok and c0.passed
    assert c3.step_error_mean == pytest.approx(0.5) and c3.step_ok is False
    assert c3.memory_error_bytes == 4 and c3.memory_ok is False and not c3.passed
    s = summarise([c0, c3])["n4"]
    assert s["step_error_median_max"] == pytest.approx(0.5) and s["step_error_median_mean"] == pytest.approx(0.3)
    assert s["memory_error_bytes_max"] == 4 and s["passed"] is False


def _repeated(recipe: Any, docs: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Rank 0's figures per label from one list of measured steps per repeat."""
    return {label: {0: rank_figures([_doc(0, [0.1, *steps]) for steps in repeats], warmup=recipe.steps.warmup,
                                    total=recipe.steps.total, where=label)} for label, repeats in docs.items()}


def test_a_step_tolerance_fails_on_both_sides() -> None:
    """emulated / reference must lie in [1 / (1 + t), 1 + t]: with t = 1.53 (2 x a 76% spread), 0.3x fails, which
    |error| <= t passed (any emulated step from 0 up to 2.53x did)."""
    r = recipe_from_mapping(_with(tolerances={"step_time_rel": 1.53, "noise": {"runs": 5, "spread_rel": 0.7637}},
                                  repeats=3, emulated=[{"name": "n4", "world_size": 4, "runs": [[0]]}]))
    quiet = [[1.0] * 4] * 3
    for ratio, ok in ((0.3, False), (0.4, True), (2.5, True), (2.6, False)):
        c, = compare(r, _repeated(r, {"real": quiet, "n4": [[ratio] * 4] * 3}))
        assert (c.step_ok, c.step_noisy, c.noise_rel) == (ok, False, 0.0), ratio


def test_a_miss_within_the_runs_own_noise_is_noisy_never_a_pass() -> None:
    """The width is held against the noise measured in the same run: repeats whose medians are 1.0, 1.0, 1.3 spread
    by 30%, and 2 x 30% exceeds t = 0.2, so a 1.3x emulated step is not checkable here (noisy); in a quiet run it
    fails; a 2x step is outside what 2 x 30% explains (1 / 1.6 .. 1.6x) and fails in the noisy run too; within the
    band it passes whatever the noise."""
    r = recipe_from_mapping(_with(tolerances={"step_time_rel": 0.2, "noise": {"runs": 5, "spread_rel": 0.05}},
                                  repeats=3, emulated=[{"name": "n4", "world_size": 4, "runs": [[0]]}]))
    noisy_real = [[1.0] * 4, [1.0] * 4, [1.3] * 4]
    c, = compare(r, _repeated(r, {"real": noisy_real, "n4": [[1.3] * 4] * 3}))
    assert c.noise_rel == pytest.approx(0.3) and c.step_noisy and c.step_ok is None
    assert summarise([c])["n4"]["step_noisy"] == 1
    c, = compare(r, _repeated(r, {"real": [[1.0] * 4] * 3, "n4": [[1.3] * 4] * 3}))
    assert c.noise_rel == 0.0 and not c.step_noisy and c.step_ok is False and not c.passed
    c, = compare(r, _repeated(r, {"real": noisy_real, "n4": [[2.0] * 4] * 3}))
    assert c.noise_rel == pytest.approx(0.3) and not c.step_noisy and c.step_ok is False
    c, = compare(r, _repeated(r, {"real": noisy_real, "n4": [[1.1] * 4] * 3}))
    assert c.step_ok is True and not c.step_noisy


def test_compare_loss_report_only_and_exact() -> None:
    r = recipe_from_mapping(BASE)
    figs = _figs(r, {"real": [_doc(0, [1.0] * 5, loss=2.0), _doc(3, [1.0] * 5)],
                     "n4": [_doc(0, [1.0] * 5, loss=2.5), _doc(3, [1.0] * 5)]})
    c0, _ = compare(r, figs)
    assert c0.loss_error == pytest.approx(0.25) and c0.loss_ok is None and c0.step_ok is None and c0.passed
    exact = recipe_from_mapping(_with(tolerances={"loss_rel": 0}))
    assert compare(exact, figs)[0].loss_ok is False


def test_compare_loss_only_where_both_have_one() -> None:
    r = recipe_from_mapping(_with(tolerances={"loss_rel": 0}))
    figs = _figs(r, {"real": [_doc(0, [1.0] * 5, loss=None), _doc(3, [1.0] * 5, loss=1.0)],
                     "n4": [_doc(0, [1.0] * 5, loss=None), _doc(3, [1.0] * 5, loss=1.0)]})
    c0, c3 = compare(r, figs)
    assert c0.loss_ok is None and c0.loss_error is None and c3.loss_ok is True
    nothing = _figs(r, {"real": [_doc(0, [1.0] * 5, loss=None), _doc(3, [1.0] * 5, loss=None)],
                        "n4": [_doc(0, [1.0] * 5, loss=None), _doc(3, [1.0] * 5, loss=1.0)]})
    with pytest.raises(ValueError, match="no compared rank has a first-step loss in both runs"):
        compare(r, nothing)


def test_compare_modelled_comm_adjustment() -> None:
    data = _with(emulated=[{"name": "n4", "world_size": 4, "runs": [[0]]},
                           {"name": "big", "world_size": 8192, "runs": [[0]], "compare_with": "n4",
                            "ranks": [[0, 0]], "step_time_adjust": "modelled_comm"}])
    r = recipe_from_mapping(data)
    figs = _figs(r, {"real": [_doc(0, [1.0] * 5)], "n4": [_doc(0, [1.0] * 5, comm=0.1)],
                     "big": [_doc(0, [1.3] * 5, comm=0.4)]})
    _, big = compare(r, figs)
    assert big.adjustment_s == pytest.approx(0.3)
    assert big.emulated_median_s == pytest.approx(1.0) and big.step_error_median == pytest.approx(0.0)


def test_compare_missing_rank_is_explained() -> None:
    r = recipe_from_mapping(BASE)
    with pytest.raises(ValueError, match="no metrics for rank 3 of run 'n4'"):
        compare(r, _figs(r, {"real": [_doc(0, [1.0] * 5), _doc(3, [1.0] * 5)], "n4": [_doc(0, [1.0] * 5)]}))


def test_noise_spread_example() -> None:
    assert noise_spread({0: [10.0, 11.0, 9.5]}) == pytest.approx(0.1)
    assert noise_spread({0: [10.0, 11.0, 9.5]}, discard=1) == pytest.approx(0.05)
    assert noise_spread({0: [10.0, 40.0, 9.5, 10.2, 10.1]}, discard=1) == pytest.approx(0.6 / 10.1)  # a burst
    assert noise_spread({0: [10.0, 10.0, 10.0], 3: [1.0, 1.2, 1.0]}) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        noise_spread({0: [1.0]})


# -- probe (in this process, no torch.distributed) ----------------------------------------------------------


def test_probe_counts_steps_bytes_and_loss_exactly(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([param], lr=0.1)
    probe = Probe(tmp_path, "test").install()
    try:
        x = torch.ones(8)  # 32 bytes, alive throughout
        for step in range(4):
            scratch = torch.empty(1000 * (step + 1))  # 4000 * (step + 1) bytes, freed before the step ends
            del scratch
            loss = ((param - x) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        probe.uninstall()
    doc = probe.metrics()
    assert [s["index"] for s in doc["steps"]] == [0, 1, 2, 3]
    assert doc["steps"][0]["duration_s"] is None and all(s["duration_s"] > 0 for s in doc["steps"][1:])
    # step k's peak is its scratch tensor on top of what is alive then (x, plus grads/temporaries of step k)
    peaks = [s["peak_bytes"] for s in doc["steps"]]
    assert peaks[3] - peaks[2] == 4000 and peaks[2] - peaks[1] == 4000  # exact, to the byte
    assert doc["peak_bytes"] == peaks[3]
    assert doc["first_loss"] == pytest.approx(8.0)  # sum((0 - 1)^2) over 8 elements
    assert doc["steps"][1]["loss"] < 8.0  # the SGD step moved the parameter
    written = probe.write()
    assert json.loads(written.read_text())["peak_bytes"] == doc["peak_bytes"]
    trace = json.loads((tmp_path / "rank0.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["step 1", "step 2", "step 3"]
    assert any(e["ph"] == "C" for e in trace["traceEvents"])


def test_probe_loss_ignores_pipeline_placeholder_roots(tmp_path: Path) -> None:
    from torch.autograd.variable import Variable

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.0)
    probe = Probe(tmp_path, track_memory=False).install()
    try:
        act = w * 3.0  # an earlier stage's output, sent on, then pseudo-freed by Megatron's schedule
        act.data = torch.empty((1,))
        Variable._execution_engine.run_backward(tensors=(act,), grad_tensors=(torch.ones(4),), keep_graph=False,
                                                create_graph=False, inputs=(), allow_unreachable=True,
                                                accumulate_grad=True)
        loss = (w * 2.0).sum().reshape(1)  # a one-element loss, implicit gradient (Megatron's last stage)
        Variable._execution_engine.run_backward(tensors=(loss,), grad_tensors=(torch.ones(1),), keep_graph=False,
                                                create_graph=False, inputs=(), allow_unreachable=True,
                                                accumulate_grad=True)
        opt.step()
    finally:
        probe.uninstall()
    assert probe.metrics()["first_loss"] == 8.0


def test_probe_uninstall_restores_autograd_engine_and_gc(tmp_path: Path) -> None:
    import gc

    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    enabled = gc.isenabled()
    probe = Probe(tmp_path).install()
    assert Variable._execution_engine is not engine and not gc.isenabled()
    probe.uninstall()
    assert Variable._execution_engine is engine and gc.isenabled() == enabled


def test_probe_counts_only_the_first_optimizer(tmp_path: Path) -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    probe = Probe(tmp_path, track_memory=False).install()
    try:
        for _ in range(3):
            opt_a.step()
            opt_b.step()  # a chained second optimizer: not a new step
    finally:
        probe.uninstall()
    assert len(probe.metrics()["steps"]) == 3


def test_decimate_keeps_peaks_and_chrome_trace_units() -> None:
    t = [i * 0.001 for i in range(10_000)]
    v = [(i * 7919) % 1000 for i in range(10_000)]
    v[4321] = 5000
    dt, dv = _decimate(t, v, 500)
    assert len(dt) <= 1000 and max(dv) == 5000 and dt == sorted(dt)
    doc = _doc(2, [0.5, 0.25])
    doc["label"] = "real"
    events = chrome_trace(doc)["traceEvents"]
    span = next(e for e in events if e["ph"] == "X" and e["name"] == "step 2")
    assert span["dur"] == pytest.approx(0.25e6) and span["ts"] == pytest.approx(1.5e6)


def test_step_coordinates_example() -> None:
    assert _step_coordinates([0.0, 0.5, 1.0, 1.5, 2.0], [1.0, 2.0]) == [-1.0, -0.5, 0.0, 0.5, 1.0]


# -- command lines ----------------------------------------------------------------------------------------------


def test_torch_plans(tmp_path: Path) -> None:
    r = recipe_from_mapping(BASE)
    assert toy_args(r)[:4] == ["-m", "prism_plugin.programs.toy_train", "--tp", "2"]
    real = real_plan(r, tmp_path / "real")
    assert len(real.processes) == 4 and real.ranks == (0, 1, 2, 3)
    env = real.processes[3].env
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["PRISM_PROBE_STORE"].endswith("store")
    assert "prism_plugin.recipes.probe" in real.processes[0].argv
    emu = emulation_plan(r, r.emulated[0], 1, tmp_path / "n4", None)
    (proc,) = emu.processes
    argv = list(proc.argv)
    assert argv[argv.index("--world-size") + 1] == "4" and argv[argv.index("--real-ranks") + 1] == "3"
    assert argv.index("-m") < argv.index("prism_plugin.recipes.probe")


def test_megatron_args_derive_global_batch(tmp_path: Path) -> None:
    r = recipe_from_mapping({**MEGATRON, "layout": {"tp": 2, "pp": 2, "vpp": 2}})
    args = megatron_args(r, 8192)
    assert args[args.index("--global-batch-size") + 1] == str(2 * 4 * 2048)  # micro x mb/step x dp
    assert args[args.index("--num-layers-per-virtual-pipeline-stage") + 1] == "1"  # 4 / (2 x 2)
    plan = emulation_plan(r, r.emulated[0], 0, tmp_path, None)
    assert len(plan.processes) == 1 and "--prism-world-size" in plan.processes[0].argv
    assert plan.processes[0].env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    plain = recipe_from_mapping({**MEGATRON, "real": {"world_size": 4}})
    with pytest.raises(RecipeError, match="set real.launcher: prism"):
        real_plan(plain, tmp_path)


def test_megatron_logged_loss_parsing(tmp_path: Path) -> None:
    line = (" [2026-11-29 18:23:02.363882] iteration        1/      10 | consumed samples:            4 | "
            "elapsed time per iteration (ms): 1750.0 | learning rate: 1.000000E-04 | global batch size:     4 | "
            "lm loss: 5.513128E+00 | loss scale: 1.0 |")
    later = line.replace("iteration        1/", "iteration        2/").replace("5.513128E+00", "5.1E+00")
    assert logged_first_loss("noise\n" + later + "\n" + line) == 5.513128
    assert logged_first_loss(later) is None
    pp = recipe_from_mapping({**MEGATRON, "layout": {"pp": 2}})
    assert emulation_plan(pp, pp.emulated[0], 0, tmp_path, None).loss_from_log
    assert not emulation_plan(recipe_from_mapping(MEGATRON), pp.emulated[0], 0, tmp_path, None).loss_from_log


def test_deepspeed_config_batch_arithmetic() -> None:
    r = recipe_from_mapping({**BASE, "framework": "deepspeed", "layout": {"zero_stage": 1},
                             "model": {"hidden_size": 64, "micro_batch_size": 4, "microbatches_per_step": 3},
                             "real": {"world_size": 2}, "emulated": [{"name": "n2", "world_size": 2,
                                                                      "runs": [[0]]}]})
    cfg = deepspeed_config(r, 1024, {"world_size": 1024})
    assert cfg["train_batch_size"] == 4 * 3 * 1024 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["prism"] == {"world_size": 1024} and cfg["zero_optimization"]["stage"] == 1
    assert "prism" not in deepspeed_config(r, 2, None)


# -- reports and CLI ---------------------------------------------------------------------------------------------


def _result(tmp_path: Path) -> RecipeResult:
    data = _with(tolerances={"step_time_rel": 0.2, "noise": {"runs": 5, "spread_rel": 0.05}}, repeats=3)
    r = recipe_from_mapping(data)
    docs = {"real": [_doc(0, [1.0] * 5), _doc(3, [1.0] * 5)], "n4": [_doc(0, [1.05] * 5, comm=0.2),
                                                                     _doc(3, [0.9] * 5, comm=0.2)]}
    figs = _figs(r, docs)
    comps = compare(r, figs)
    outcomes = {label: [RunOutcome(label=label, wall_s=1.0, docs={d["rank"]: d for d in ds}, summaries={},
                                   folder=tmp_path / label)] for label, ds in docs.items()}
    return RecipeResult(recipe=r, output=tmp_path, outcomes=outcomes, figures=figs, comparisons=comps,
                        summary=summarise(comps), machine={"before": {"load_average_1m": 0.5}})


def test_reports_table_markdown_plots(tmp_path: Path) -> None:
    from rich.console import Console

    result = _result(tmp_path)
    assert result.passed
    console = Console(width=200, record=True)
    console.print(result_table(result))
    text = console.export_text()
    assert "n4 vs real 0->0" in text and "+5.0%" in text and "-10.0%" in text
    pytest.importorskip("matplotlib")
    plots = plot_recipe(result)
    assert [p.name for p in plots] == ["step_time.png", "memory.png", "errors.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    md = write_summary(result, plots).read_text()
    assert "# Recipe `t`: PASS" in md and "![memory](memory.png)" in md
    assert "[trace](real/metrics/rank0.trace.json)" in md
    index = write_index([result], tmp_path).read_text()
    assert "| n4 | 2 | 7.5% / 10.0% |" in index  # mean and max of |+5%|, |-10%|
    doc = result.to_dict()
    assert doc["passed"] and math.isclose(doc["summary"]["n4"]["step_error_median_max"], 0.1)


def test_cli_list_check_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "list"]) == 0
    out = capsys.readouterr().out
    assert "megatron-tp2" in out and DEFAULT_RECIPE in out
    assert main(["recipe", "check", DEFAULT_RECIPE, str(RECIPES / "megatron-pp2.yaml")]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "framework": "jax"}))
    assert main(["recipe", "run", str(bad)]) == 2
    assert "framework='jax' is not one of torch, megatron, deepspeed" in _flat(capsys.readouterr().err)
    assert main(["recipe", "run", "no-such-recipe"]) == 2
    assert "no recipe named 'no-such-recipe'; known:" in _flat(capsys.readouterr().err)


def _flat(text: str) -> str:
    """Console output without the line breaks rich inserts."""
    return " ".join(text.split())
    assert find_recipe(DEFAULT_RECIPE).name == f"{DEFAULT_RECIPE}.yaml"


def test_doctests_of_the_comparison_and_report() -> None:
    import doctest

    from prism_plugin.recipes import compare as compare_module
    from prism_plugin.recipes import report as report_module

    assert doctest.testmod(compare_module).failed == 0 and doctest.testmod(report_module).failed == 0
