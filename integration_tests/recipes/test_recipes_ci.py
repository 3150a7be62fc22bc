"""The CI-tier recipes end to end: a real run and its emulations, compared against the recipes' tolerances.

Each `tier: ci` recipe under recipes/ runs as `prism recipe run` would (real processes, then the
emulations), and the test FAILS when any comparison exceeds its tolerance: peak memory exactly, the
first-step loss where the recipe checks it, and step time within the tolerance the recipe justifies
by the measured run-to-run noise of its real run. Besides the verdict it checks the structure: every
compared rank made exactly `steps.total` optimizer steps and wrote its metrics and Chrome trace, and
the report (result.json, summary.md, PNGs) exists.

Step time is checked two-sided (emulated / real within [1 / (1 + t), 1 + t], `prism_plugin.recipes.compare`)
and against the noise measured in the same run: each recipe repeats its real run and emulations 3 times,
interleaved, and the spread of each rank's repeat medians is this run's own noise. A step time outside its band
fails the test, whatever the machine's load (a model error fails rather than skips); only a miss inside
noise_factor x the noise measured in this run, wider than the band (the comparison is "noisy"), skips the test,
naming the figures: a visible skip, never a pass. Memory and loss are checked exactly first. The machine's load
average and the CPU time of processes outside the recipe (``machine``) are reported beside it.

The 4-process recipes (tier small) are not in CI: with 2 ranks per core a real rank waits at every
collective for a descheduled peer, which an emulated rank (virtual peers arrive
with it) never does; recipes/RESULTS.md shows that bias.

`test_a_violated_tolerance_fails` shows the check bites: the same toy job emulated on a profile whose
collectives cost 250 ms each must fail its step-time tolerance (and `prism recipe run` exit 1).

Processes: at most 4 ranks run at a time (plus idle `prism run` launchers); recipes are run one after
another. Budget: toy-tp2 (the one not marked heavy) 75 s on 2 cores with its 3 repeats (measured, 2026-12-03).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from prism_plugin.cli.main import main
from prism_plugin.cost import load_profile, override_profile
from prism_plugin.cost.profiles import profile_to_yaml
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.runner import run_recipe
from prism_plugin.recipes.schema import Tier

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CI = sorted(p.stem for p in RECIPES.glob("*.yaml") if load_recipe(p).tier is Tier.CI)

pytestmark = pytest.mark.slow


def _needs(framework: str) -> None:
    if framework == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")
    if framework == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (extra: deepspeed)")


def test_ci_tier_is_not_empty() -> None:
    assert set(CI) == {"toy-tp2", "megatron-tp2-n2", "deepspeed-zero1"}
    for name in CI:  # one rank per core: like-for-like step times
        recipe = load_recipe(RECIPES / f"{name}.yaml")
        assert max(recipe.real.world_size, *(len(e.runs) for e in recipe.emulated)) <= max(2, os.cpu_count() or 1)


@pytest.mark.wallclock  # compares wall-clock step times: CI runs it alone, in its wall-clock step
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "toy-tp2" else pytest.mark.heavy) for n in CI])
def test_ci_recipe_within_tolerances(name: str, tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    _needs(recipe.framework.value)
    result = run_recipe(recipe, tmp_path / name, timeout_s=400)
    loads = [result.machine[k]["load_average_1m"] for k in ("before", "after")]
    foreign = result.machine["foreign_cpu_cores"]
    assert result.machine["repeats"] == recipe.repeats >= 3
    assert all(c.noise_rel is not None for c in result.comparisons)  # measured in this run
    # structure: every run produced every rank, each with exactly steps.total optimizer steps
    for label, outcomes in result.outcomes.items():
        for outcome in outcomes:
            for rank, doc in outcome.docs.items():
                assert len(doc["steps"]) == recipe.steps.total, (label, rank)
                assert (outcome.folder / "metrics" / f"rank{rank}.trace.json").is_file()
                if label != "real":  # emulated ranks ran as rank r of N under prism
                    assert doc["world_size"] == recipe.emulation(label).world_size
    assert (tmp_path / name / "result.json").is_file()
    doc = json.loads((tmp_path / name / "result.json").read_text())
    assert doc["recipe"] == name and len(doc["comparisons"]) == len(result.comparisons) > 0
    # memory (exact in every shipped recipe) and loss: always checked
    assert all(c.memory_ok and c.memory_error_bytes == 0 for c in result.comparisons), \
        json.dumps([c.to_dict() for c in result.comparisons], indent=1)
    assert all(c.loss_ok is not False for c in result.comparisons)
    slow = [c.to_dict() for c in result.comparisons if c.step_ok is False]
    assert not slow, (f"{name}: step time beyond tolerance (load average {loads}, foreign CPU {foreign} cores):\n"
                      f"{json.dumps(slow, indent=1)}")
    if result.noisy:
        figures = [f"{c.emulation} rank {c.emulated_rank}: median / mean errors {c.step_error_median:.3f} / "
                   f"{c.step_error_mean:.3f}, tolerance "
                   f"{recipe.tolerances_for(recipe.emulation(c.emulation)).step_time_rel}, noise in this run "
                   f"{c.noise_rel:.3f}" for c in result.noisy]
        pytest.skip(f"{name}: step time outside its band but inside this run's own noise (load average "
                    f"{loads}, foreign CPU {foreign} cores): not checkable; {figures}")


@pytest.mark.heavy  # about 30 s
def test_a_violated_tolerance_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = override_profile(load_profile("local-cpu-gloo"), {"collective_overhead_us": 250_000.0})
    (tmp_path / "slow.yaml").write_text(profile_to_yaml(slow))
    data = yaml.safe_load((RECIPES / "toy-tp2.yaml").read_text())
    data.update(name="toy-tp2-slow", steps={"total": 8, "warmup": 3},
                model={"hidden_size": 64, "micro_batch_size": 8},
                tolerances={"memory_bytes": 0, "step_time_rel": 0.5,
                            "noise": {"runs": 5, "spread_rel": 0.2, "measured_on": "test"}})
    data["emulated"] = [{"name": "n2", "world_size": 2, "runs": [[0], [1]], "profile": "slow.yaml"}]
    path = tmp_path / "toy-tp2-slow.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = main(["recipe", "run", str(path), "--output", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
               "--no-plots"])
    assert rc == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["passed"] is False
    for c in doc["comparisons"]:
        # one 250 ms collective per step (the TP all-reduce); the real step takes milliseconds
        assert c["step_ok"] is False and c["step_error_median"] > 1.0
        assert c["memory_ok"] is True and c["memory_error_bytes"] == 0
    assert "FAIL" in capsys.readouterr().err
