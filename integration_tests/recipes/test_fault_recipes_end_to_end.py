"""The fault recipes end to end: each of recipes/fault-*.yaml demonstrates its fault and passes its `expect`.

Each `tier: faults` recipe runs as `prism recipe run` would: the fault-free real run (one plain torch
process), then the faulty emulation (one `prism run` launcher and its one real rank), and the test
fails unless every expectation holds: the straggler is blamed and waited on for about (factor - 1) x
the compute, the slow link makes each step's modelled communication exactly 4x, jitter makes it vary
within its band, the hang raises gloo's timeout error after the 3 s timeout, the crash gloo's
peer-death error at once, the kill ends the job with the launcher naming the killed rank. Memory (exact)
and the first loss (exact) are compared with the real run too.

Timing: the straggler's wait is a measured duration. When the machine is shared (other processes used
more than `MAX_FOREIGN_CORES` of CPU while the recipe ran, or the load average exceeded `MAX_LOAD`; the
same rule and environment variables as test_recipes_ci.py), a missed wait bound skips the test naming
the figures instead of failing it (a visible skip, never a pass); every other expectation is still checked
first.

Two more runs show the harness's verdicts: an expected failure that does not happen fails the recipe
(``prism recipe run`` exits 1), and a fault that fails an emulation with no `expect` is still an error.

Processes: at most 2 at a time (a launcher and its real rank). Budget: about 80 s for the six recipes and
20 s for the two verdict runs on 2 idle cores (the session-8 runs, on 2 shared cores: 95 s + 25 s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from prism_plugin.cli.main import main
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.runner import RunFailed, run_recipe
from prism_plugin.recipes.schema import Tier

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAULTS = sorted(p.stem for p in RECIPES.glob("*.yaml") if load_recipe(p).tier is Tier.FAULTS)
MAX_LOAD = float(os.environ.get("PRISM_RECIPES_MAX_LOAD", (os.cpu_count() or 1) + 1))
MAX_FOREIGN_CORES = float(os.environ.get("PRISM_RECIPES_MAX_FOREIGN_CORES", 0.25))
TIMED = ("wait", "wait_rel")  # checks on measured durations (lenient on a shared machine)

pytestmark = pytest.mark.slow
CI_FAULTS = ("fault-hang", "fault-crash", "fault-straggler")  # the others are heavy: 15-20 s each


def test_fault_tier_is_one_recipe_per_fault() -> None:
    assert set(FAULTS) == {"fault-straggler", "fault-slow-link", "fault-jitter", "fault-hang", "fault-crash",
                           "fault-kill"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in CI_FAULTS else pytest.mark.heavy) for n in FAULTS])
def test_fault_recipe_demonstrates_its_fault(name: str, tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    result = run_recipe(recipe, tmp_path / name, timeout_s=120)
    rows = [e.to_dict() for e in result.expectations]
    detail = json.dumps({"expectations": rows, "comparisons": [c.to_dict() for c in result.comparisons],
                         "machine": result.machine}, indent=1, default=str)
    assert rows, detail
    # memory exact and the first loss exact against the fault-free real run, where the emulation completes
    assert all(c.memory_ok and c.memory_error_bytes == 0 and c.loss_ok is not False for c in result.comparisons), \
        detail
    for emu in recipe.emulated:
        if emu.expects_failure:  # it failed (as it had to): no metrics, nothing compared
            assert result.outcomes[emu.name] == [] and not any(c.emulation == emu.name for c in result.comparisons)
        else:
            assert [c.emulation for c in result.comparisons].count(emu.name) == len(emu.real_ranks)
    if name == "fault-straggler":  # the live Chrome trace shows each wait on the straggler, from its from_step
        metrics = json.loads((tmp_path / name / "n2" / "run0" / "metrics" / "rank0.metrics.json").read_text())
        waits = metrics["faults"]["waits"]
        assert waits and {w["on_rank"] for w in waits} == {1} and min(w["step"] for w in waits) == 3, waits
        trace = json.loads((tmp_path / name / "n2" / "run0" / "metrics" / "rank0.trace.json").read_text())
        spans = [e for e in trace["traceEvents"] if e.get("cat") == "fault"]
        assert len(spans) == len(waits) and {e["name"] for e in spans} == {"waits on rank 1"}
    doc = json.loads((tmp_path / name / "result.json").read_text())
    assert doc["expectations"] == json.loads(json.dumps(rows, default=str))
    loads = [result.machine[k]["load_average_1m"] for k in ("before", "after")]
    foreign = result.machine["foreign_cpu_cores"]
    busy = (MAX_LOAD > 0 and loads[0] > MAX_LOAD) or (MAX_FOREIGN_CORES > 0 and (foreign or 0.0) > MAX_FOREIGN_CORES)
    missed = [e for e in result.expectations if not e.passed]
    if missed and busy and all(e.check in TIMED for e in missed):
        pytest.skip(f"{name}: timing expectation missed on a shared machine (load {loads}, max {MAX_LOAD}; foreign "
                    f"CPU {foreign} cores, max {MAX_FOREIGN_CORES}): not checkable; {[e.measured for e in missed]}")
    assert not missed, detail
    assert result.passed


def _variant(tmp_path: Path, base: str, **emulation: object) -> Path:
    data = yaml.safe_load((RECIPES / f"{base}.yaml").read_text())
    data["name"] = f"{base}-variant"
    data["steps"] = {"total": 4, "warmup": 1}
    for key, value in emulation.items():
        if value is None:
            data["emulated"][0].pop(key, None)
        else:
            data["emulated"][0][key] = value
    path = tmp_path / f"{base}-variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_expected_failure_that_does_not_happen_fails_the_recipe(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the hang recipe's expectation, but a fault that only slows rank 1 down: the run completes
    path = _variant(tmp_path, "fault-hang", faults=["straggler:ranks=1,factor=1.5"])
    rc = main(["recipe", "run", str(path), "--output", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
               "--no-plots"])
    assert rc == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    (check,) = doc["expectations"]
    assert doc["passed"] is False and check["passed"] is False
    assert check["values"]["exit_codes"] == [0] and "exit codes [0]" in check["measured"]
    assert "FAIL" in capsys.readouterr().err


@pytest.mark.heavy
def test_a_fault_without_expect_is_still_a_run_error(tmp_path: Path) -> None:
    recipe = load_recipe(_variant(tmp_path, "fault-crash", expect=None))
    with pytest.raises(RunFailed, match="Connection reset by peer"):
        run_recipe(recipe, tmp_path / "out", timeout_s=120)
