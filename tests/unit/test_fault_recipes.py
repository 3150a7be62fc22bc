"""Fault recipes: the schema's `faults` / `timeout` / `expect`, their command lines, the expectation checks.

Tier (a): pure, no process is started (integration_tests/recipes/test_fault_recipes_end_to_end.py runs the shipped
recipes/fault-*.yaml end to end).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from prism_plugin.recipes.compare import compare
from prism_plugin.recipes.expect import ExpectCheck, FailedRun, check_failure, check_figures
from prism_plugin.recipes.load import load_recipe, recipe_from_mapping
from prism_plugin.recipes.plans import emulation_plan
from prism_plugin.recipes.report import expect_table, write_summary
from prism_plugin.recipes.runner import RecipeResult
from prism_plugin.recipes.schema import Recipe, RecipeError, Tier

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAULT_RECIPES = ("fault-straggler", "fault-slow-link", "fault-jitter", "fault-hang", "fault-crash", "fault-kill")

BASE: dict[str, Any] = {
    "name": "f",
    "framework": "torch",
    "model": {"hidden_size": 64, "micro_batch_size": 4},
    "layout": {"tp": 1},
    "steps": {"total": 6, "warmup": 2},
    "real": {"world_size": 1},
    "emulated": [{"name": "n2", "world_size": 2, "runs": [[0]], "ranks": [[0, 0]],
                  "faults": ["straggler:ranks=1,factor=3,from_step=3"],
                  "expect": {"blame_root": 1, "wait_ms": [5, 500], "from_step": 3}}],
}


def _recipe(**emu: Any) -> Recipe:
    data = copy.deepcopy(BASE)
    for key, value in emu.items():
        if value is None:
            data["emulated"][0].pop(key, None)
        else:
            data["emulated"][0][key] = value
    return recipe_from_mapping(data)


# -- schema -----------------------------------------------------------------------------------------------


def test_faults_timeout_and_expect_are_read() -> None:
    emu = _recipe(timeout_s=3).emulated[0]
    assert emu.faults == ("straggler:ranks=1,factor=3,from_step=3",)
    assert emu.timeout == 3.0  # the older key timeout_s, read as the setting timeout
    assert emu.expect is not None and emu.expect.wait_ms == (5.0, 500.0) and emu.expect.from_step == 3
    assert not emu.expects_failure
    hang = _recipe(faults=["hang:rank=1,op=1"], expect={"failure": "Timed out", "within_s": 20, "after_s": 3})
    assert hang.emulated[0].expects_failure and hang.emulated[0].expect.within_s == 20.0  # type: ignore[union-attr]


@pytest.mark.parametrize(("emu", "message"), [
    ({"faults": ["straggler:ranks=1,factr=3"]}, "emulated[n2].faults"),
    ({"faults": ["straggler:ranks=5,factor=3"], "expect": None}, "emulated[n2].faults: fault"),
    ({"faults": "hang:rank=1"}, "emulated[n2].faults must be a list"),
    ({"timeout": 0}, "emulated[n2].timeout must be > 0"),
    ({"faults": [], "expect": {"failure": "x", "within_s": 5}}, "expect needs faults"),
    ({"expect": {"failure": "Timed out"}}, "within_s is required with failure"),
    ({"expect": {"failure": "Timed out", "within_s": 3, "after_s": 3}}, "within_s=3 must exceed after_s=3"),
    ({"expect": {"failure": "x", "within_s": 9, "blame_root": 1}}, "a failure expectation compares no figures"),
    ({"expect": {"within_s": 9, "blame_root": 1, "wait_ms": [1, 2]}}, "go with failure"),
    ({"expect": {"blame_root": 1}}, "blame_root goes with wait_ms"),
    ({"expect": {"wait_ms": [1, 2]}}, "blame_root goes with wait_ms"),
    ({"expect": {"blame_root": 1, "wait_ms": [5, 1]}}, "wait_ms: low 5 is above high 1"),
    ({"expect": {"blame_root": 1, "wait_rel": [1]}}, "wait_rel must be a [low, high] pair"),
    ({"expect": {"blame_root": 2, "wait_ms": [1, 2]}}, "blame_root=2 is outside 0..1"),
    ({"expect": {"min_comm_spread": 0.1}}, "min_comm_spread needs comm_factor"),
    ({"expect": {}}, "states nothing to check"),
    ({"expect": {"blame_rot": 1}}, "did you mean `blame_root`"),
])
def test_bad_fault_fields_name_field_and_fix(emu: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _recipe(**emu)


def test_deepspeed_timeout_and_comparing_with_a_failing_run_are_refused() -> None:
    data = copy.deepcopy(BASE)
    data.update(framework="deepspeed", layout={"zero_stage": 1})
    data["emulated"][0]["timeout"] = 3
    with pytest.raises(RecipeError, match=r"emulated\[n2\].timeout: a DeepSpeed job's timeout"):
        recipe_from_mapping(data)
    data = copy.deepcopy(BASE)
    data["emulated"][0].update(faults=["crash:rank=1,step=2"], expect={"failure": "reset", "within_s": 9})
    data["emulated"].append({"name": "again", "world_size": 2, "runs": [[0]], "compare_with": "n2"})
    with pytest.raises(RecipeError, match="is expected to fail"):
        recipe_from_mapping(data)


def test_shipped_fault_recipes() -> None:
    found = sorted(p.stem for p in RECIPES.glob("fault-*.yaml"))
    assert found == sorted(FAULT_RECIPES)
    kinds = set()
    for name in FAULT_RECIPES:
        r = load_recipe(RECIPES / f"{name}.yaml")
        assert r.tier is Tier.FAULTS and r.framework.value == "torch"
        assert r.real.world_size <= 2 and all(len(e.runs) == 1 for e in r.emulated)  # cheap: <= 2 processes
        (emu,) = [e for e in r.emulated if e.faults]
        assert emu.expect is not None
        kinds.add(emu.faults[0].split(":")[0])
        if emu.expects_failure:
            assert emu.expect.within_s is not None and emu.expect.within_s <= 30
    assert kinds == {"straggler", "link", "jitter", "hang", "crash", "kill"}


# -- command lines ------------------------------------------------------------------------------------------


def test_faults_and_timeout_reach_every_framework(tmp_path: Path) -> None:
    two = ["straggler:ranks=1,factor=2", "jitter:sigma=0.1,seed=3"]
    r = _recipe(faults=two, timeout=2.5, expect=None)
    argv = emulation_plan(r, r.emulated[0], 0, tmp_path, None).processes[0].argv
    i = argv.index("--fault")
    assert argv[i:i + 4] == ("--fault", two[0], "--fault", two[1])
    assert argv[argv.index("--timeout") + 1] == "2.5"
    assert argv.index("--timeout") < argv.index("prism_plugin.recipes.probe")  # prism run's options
    data = copy.deepcopy(BASE)
    data.update(framework="megatron", real={"world_size": 1, "launcher": "prism"},
                model={"hidden_size": 64, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 64})
    data["emulated"][0].update(faults=two, timeout=4, expect=None)
    meg = recipe_from_mapping(data)
    argv = emulation_plan(meg, meg.emulated[0], 0, tmp_path, None).processes[0].argv
    assert [argv[k + 1] for k, a in enumerate(argv) if a == "--prism-fault"] == two
    assert argv[argv.index("--prism-timeout") + 1] == "4"
    data = copy.deepcopy(BASE)
    data.update(framework="deepspeed", layout={"zero_stage": 1})
    data["emulated"][0].update(faults=two, expect=None)
    ds = recipe_from_mapping(data, source=RECIPES / "x.yaml")
    plan = emulation_plan(ds, ds.emulated[0], 0, tmp_path, None)
    (config,) = plan.files.values()
    assert json.loads(config)["prism"]["faults"] == two
    plain = emulation_plan(_recipe(faults=[], expect=None), _recipe(faults=[], expect=None).emulated[0], 0,
                           tmp_path, None).processes[0].argv
    assert "--fault" not in plain and "--timeout" not in plain


# -- expectations ------------------------------------------------------------------------------------------


def _failing(**expect: Any) -> Recipe:
    return _recipe(faults=["hang:rank=1,op=1"], timeout=3, expect={"failure": "Timed out waiting", **expect})


@pytest.mark.parametrize(("codes", "wall", "output", "ok", "says"), [
    ((1,), 9.0, "... Timed out waiting 3000ms ...", True, "exit codes [1] after 9.0 s; text found"),
    ((0,), 9.0, "Timed out waiting", False, "exit codes [0]"),  # did not fail
    ((1,), 9.0, "Connection reset by peer", False, "text NOT found"),  # failed, but not as expected
    ((None,), 20.0, "Timed out waiting", False, "still running after 20 s (stopped)"),  # never ended
    ((1,), 1.0, "Timed out waiting", False, "after 1.0 s"),  # before the timeout could have passed
])
def test_check_failure(codes: tuple[int | None, ...], wall: float, output: str, ok: bool, says: str) -> None:
    emu = _failing(within_s=20, after_s=3).emulated[0]
    check = check_failure(emu, FailedRun(label="n2/run0", wall_s=wall, exit_codes=codes, output=output))
    assert check.passed is ok and says in check.measured and check.rank is None and check.check == "failure"


def _summary(waits: dict[int, float], root: int = 1) -> dict[str, Any]:
    steps = [{"step": s, "waited_s": w, "ops_delayed": 1, "waited_on": [{"rank": root, "waited_s": w}],
              "blame_chain": [0, root]} for s, w in waits.items()]
    return {"rank": 0, "faults": {"specs": [], "extra_comm_s": 0.0, "steps": steps, "events": []}}


def _metrics(durations: list[float], comm: list[float] | None = None,
             extra: list[float] | None = None) -> dict[str, Any]:
    return {"rank": 0, "steps": [{"index": i, "duration_s": d if i else None,
                                  "modelled_comm_s": comm[i] if comm and i else None,
                                  "fault_extra_comm_s": extra[i] if extra and i else None}
                                 for i, d in enumerate(durations)]}


def _checks(recipe: Recipe, summary: dict[str, Any] | None, metrics: dict[str, Any],
            ref: dict[str, Any] | None = None) -> dict[str, ExpectCheck]:
    summaries = {"n2": {0: [summary] if summary is not None else []}}
    docs = {"n2": {0: [metrics]}, "real": {0: [ref or metrics]}}
    return {c.check: c for c in check_figures(recipe, recipe.emulated[0], summaries, docs)}


def test_straggler_waits_blame_and_from_step() -> None:
    r = _recipe(expect={"blame_root": 1, "wait_ms": [20, 40], "wait_rel": [1.5, 2.5], "from_step": 3})
    ref = _metrics([0.0, 0.015, 0.015, 0.015, 0.015, 0.015])
    good = _summary({3: 0.030, 4: 0.028, 5: 0.031, 6: 0.001})  # step 6 = total: the closing barrier, ignored
    c = _checks(r, good, ref, ref)
    assert all(x.passed for x in c.values()), c
    assert c["wait"].values["median_wait_ms"] == 30.0 and c["wait_rel"].values["wait_rel"] == pytest.approx(2.0)
    c = _checks(r, _summary({2: 0.01, 3: 0.030, 4: 0.03, 5: 0.03}), ref, ref)  # waits before from_step
    assert not c["blame"].passed and "waits before step 3" in c["blame"].measured
    c = _checks(r, _summary({3: 0.03, 4: 0.03, 5: 0.03}, root=0), ref, ref)  # blames the wrong rank
    assert not c["blame"].passed and not c["wait"].passed
    c = _checks(r, _summary({}), ref, ref)  # no straggler effect at all
    assert not c["wait"].passed and c["wait"].values["median_wait_ms"] == 0.0 and not c["wait_rel"].passed
    c = _checks(r, _summary({3: 0.09, 4: 0.09, 5: 0.09}), ref, ref)  # too long a wait
    assert not c["wait"].passed and not c["wait_rel"].passed
    assert not _checks(r, {"rank": 0}, ref)["wait"].passed  # no faults section
    assert not _checks(r, None, ref)["wait"].passed  # no summary at all


def test_comm_factor_and_spread() -> None:
    link = _recipe(faults=["link:nodes=0/1,bandwidth=0.25"], gpus_per_node=1,
                   expect={"comm_factor": [3.99, 4.01]})
    steps = [0.01] * 6
    c = _checks(link, None, _metrics(steps, comm=[0.002] * 6, extra=[0.006] * 6))
    assert c["comm_factor"].passed and c["comm_factor"].values["factors"] == [4.0] * 4
    assert not _checks(link, None, _metrics(steps, comm=[0.002] * 6, extra=[0.0] * 6))["comm_factor"].passed
    assert not _checks(link, None, _metrics(steps, comm=[0.002] * 6))["comm_factor"].passed  # no fault figures
    jitter = _recipe(faults=["jitter:sigma=0.3,seed=7"], expect={"comm_factor": [0.41, 2.46], "min_comm_spread": 0.05})
    varied = _checks(jitter, None, _metrics(steps, comm=[0.002] * 6, extra=[0, 0, 0.0004, -0.0002, 0.0, 0.001]))
    assert varied["comm_factor"].passed and varied["comm_spread"].passed
    flat = _checks(jitter, None, _metrics(steps, comm=[0.002] * 6, extra=[0.0] * 6))
    assert flat["comm_factor"].passed and not flat["comm_spread"].passed


def test_failing_emulation_is_not_compared_and_expectations_decide(tmp_path: Path) -> None:
    r = _failing(within_s=20)
    assert compare(r, {"real": {}}) == []  # nothing to compare: no figures needed
    check = check_failure(r.emulated[0], FailedRun(label="n2/run0", wall_s=5.0, exit_codes=(1,),
                                                   output="Timed out waiting"))
    result = RecipeResult(recipe=r, output=tmp_path, outcomes={"real": [], "n2": []}, figures={}, comparisons=[],
                          summary={}, expectations=[check])
    assert result.passed and result.to_dict()["expectations"][0]["passed"] is True
    table = expect_table(result)
    assert table is not None and "PASS" in str(table.title)
    text = write_summary(result, []).read_text()
    assert "## Fault expectations" in text and "| n2 | run | failure |" in text
    failed = RecipeResult(recipe=r, output=tmp_path, outcomes={}, figures={}, comparisons=[], summary={},
                          expectations=[ExpectCheck(emulation="n2", rank=None, check="failure", expected="",
                                                    measured="", passed=False)])
    assert not failed.passed


def test_probe_records_the_faults_extra_communication(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import torch

    from prism_plugin.recipes import probe as probe_module

    timeline = {"waits": [], "events": [], "waits_truncated": False}
    session = types.SimpleNamespace(modelled_comm_s=0.0, faults=types.SimpleNamespace(
        extra_comm_s=0.0, timeline=lambda origin_s: timeline))
    monkeypatch.setattr(probe_module, "_prism_session", lambda: session)
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    probe = probe_module.Probe(tmp_path, "test", track_memory=False).install()
    try:
        for _ in range(3):  # each step: 2 ms modelled, 6 ms more with the fault (a link at 25%)
            session.modelled_comm_s += 0.002
            session.faults.extra_comm_s += 0.006
            opt.step()
    finally:
        probe.uninstall()
    steps = probe.metrics()["steps"]
    assert [s["fault_extra_comm_s"] for s in steps] == [None, 0.006, 0.006]
    assert [s["modelled_comm_s"] for s in steps] == [None, 0.002, 0.002]
    session.faults = None  # an emulation without faults: no figure
    probe = probe_module.Probe(tmp_path, "test", track_memory=False).install()
    try:
        opt.step()
        opt.step()
    finally:
        probe.uninstall()
    assert [s["fault_extra_comm_s"] for s in probe.metrics()["steps"]] == [None, None]


def test_probe_and_chrome_trace_show_who_each_delayed_op_waited_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A live straggler (rank 1, x2) delays this rank's all-reduces; a hung rank 3 stops a later one. The metrics
    document carries each wait on the probe's clock and the Chrome trace draws it on a "fault waits" row."""
    import time
    import types

    import torch

    from prism_plugin.comm.context import OpEvent
    from prism_plugin.config.faults import parse_faults
    from prism_plugin.config.kinds import OpKind
    from prism_plugin.cost.faults import FaultSet
    from prism_plugin.recipes import probe as probe_module
    from prism_plugin.runtime.live_faults import LiveFaults

    clock = types.SimpleNamespace(iteration=0, iteration_start_s=time.perf_counter())
    faults = LiveFaults(FaultSet(parse_faults(["straggler:ranks=1,factor=2", "hang:rank=3,op=1"]), 4, 4), 0, clock,
                        5.0)
    session = types.SimpleNamespace(modelled_comm_s=0.0, faults=faults)
    monkeypatch.setattr(probe_module, "_prism_session", lambda: session)
    pair = types.SimpleNamespace(global_ranks=(0, 1), all_real=False, is_world=False, name="dp0", desc="",
                                 group_rank_of=lambda r: r if r in (0, 1) else None)
    quad = types.SimpleNamespace(global_ranks=(0, 1, 2, 3), all_real=False, is_world=True, name="world", desc="",
                                 group_rank_of=lambda r: r)
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    probe = probe_module.Probe(tmp_path, "emulated", track_memory=False).install()
    try:
        for step in range(2):
            clock.iteration, clock.iteration_start_s = step, time.perf_counter()
            time.sleep(0.002)  # "compute": the straggler takes twice as long, so this rank waits ~2 ms
            own = time.perf_counter()
            event = OpEvent(OpKind.ALL_REDUCE, pair, step + 1, 0, None, (), own, own, 0.0, 0.0)
            faults.on_op(event)
            assert event.failure is None and event.arrival_s - own == pytest.approx(own - clock.iteration_start_s)
            opt.step()
        now = time.perf_counter()
        event = OpEvent(OpKind.BARRIER, quad, 9, 0, None, (), now, now, 0.0, 0.0)
        faults.on_op(event)
        assert event.failure is not None
    finally:
        probe.uninstall()
    doc = probe.metrics()
    waits, events = doc["faults"]["waits"], doc["faults"]["events"]
    # the barrier that hangs on rank 3 also waits for the straggler first
    assert [(w["on_rank"], w["op"], w["group"], w["step"]) for w in waits] == [
        (1, "all_reduce", "dp0", 0), (1, "all_reduce", "dp0", 1), (1, "barrier", "world", 1)]
    ends = [s["end_s"] for s in doc["steps"]]
    for w, end in zip(waits[:2], ends, strict=True):  # each wait starts inside its step, on the probe's clock
        assert 0.0 < w["t_s"] < end and w["dur_s"] >= 0.002  # (no op really slept here: it may end later)
    assert [(e["event"], e["rank"], e["op"]) for e in events] == [("hang", 3, "barrier")]
    trace = probe_module.chrome_trace(doc)["traceEvents"]
    spans = [e for e in trace if e.get("cat") == "fault" and e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["waits on rank 1"] * 3 and all(e["tid"] == 1 for e in spans)
    assert spans[0]["args"]["blame_chain"] == [doc["rank"], 1]
    marks = [e for e in trace if e.get("cat") == "fault" and e["ph"] == "i"]
    assert [e["name"] for e in marks] == ["hang: hang:rank=3,op=1,step=0"]
