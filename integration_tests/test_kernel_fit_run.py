"""The fit kernel model end to end (issue 13, 1c): `prism kernels fit` on a virtual-GPU run's summary, then
``prism run --kernel-model fit --kernel-fit F`` of the same job and of another one.

The job: the ci toy (``prism_plugin.programs.toy_train``, TP2, hidden 512, batch 64) as rank 0 of 2 on a virtual
H100, profile local-cpu-gloo-train with a host time per launch of 5 us (`launch_light_profile`). Fitting GEMMs to
a measured step of 2.5 ms (a stated figure, not a measurement: this checks the mechanism) must give, on the re-run,
an emulated steady step of exactly 2.5 ms (the linear model is exact here: every GEMM is above the kernel floor and
on the step's critical path; at the policy default's 85 us a launch the host would be), a summary that names the
model and the run it was fitted on and marks itself ``fitting_row: true``; a run of another job (other
``--steps``) under the same overlay is not a fitting row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from integration_tests.profiles import launch_light_profile

pytestmark = pytest.mark.slow

RUN = ["run", "--world-size", "2", "--real-ranks", "0", "--profile", "local-cpu-gloo-train-launch-light.yaml",
       "--gpu", "h100-sxm", "--device", "virtual-gpu"]
"""local-cpu-gloo-train at 5 us a launch (`launch_light_profile`, in the test's folder): the GPU bounds the step."""


def _program(steps: int) -> list[str]:
    return ["-m", "prism_plugin.programs.toy_train", "--tp", "2", "--hidden", "512", "--batch", "64", "--steps",
            str(steps), "--json", "--device", "cuda"]


def _prism(args: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRISM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _kernels(out: Path) -> tuple[dict[str, Any], list[float]]:
    vgpu = json.loads((out / "rank0.summary.json").read_text())["virtual_gpu"]
    return vgpu["kernels"], vgpu["virtual_time"]["step_times_s"]


def test_a_fit_reproduces_its_measured_step_and_marks_its_fitting_row(tmp_path: Path) -> None:
    launch_light_profile(tmp_path, base="local-cpu-gloo-train")
    _prism([*RUN, "--output", "base", *_program(6)], tmp_path)
    kernels, steps = _kernels(tmp_path / "base")
    assert kernels["model"] == "roofline" and len(kernels["step_by_class_s"]) == len(steps) == 5
    assert kernels["step_by_class_s"][-1]["gemm"] > 0 and kernels["job"]["world_size"] == 2
    _prism(["kernels", "fit", "--run", "toy=base/rank0.summary.json:0.0025", "--output", "fit.yaml"], tmp_path)
    overlay = yaml.safe_load((tmp_path / "fit.yaml").read_text())
    assert [(r["name"], r["measured_step_s"], r["fitted_step_s"]) for r in overlay["fitted_on"]] == [
        ("toy", 0.0025, 0.0025)]
    assert overlay["fitted_on"][0]["job"] == kernels["job"]["key"]
    assert 0 < overlay["kernels"]["gemm"]["compute_efficiency"] < 0.75  # slower than the profile said

    _prism([*RUN, "--output", "again", "--kernel-model", "fit", "--kernel-fit", "fit.yaml", *_program(6)], tmp_path)
    kernels, steps = _kernels(tmp_path / "again")
    assert kernels["model"] == "fit" and kernels["fit"]["fitting_row"] is True
    assert [r["name"] for r in kernels["fit"]["fitted_on"]] == ["toy"]
    assert steps[-1] == 0.0025  # the linear model's prediction, to the summary's nanosecond

    _prism([*RUN, "--output", "other", "--kernel-model", "fit", "--kernel-fit", "fit.yaml", *_program(7)], tmp_path)
    kernels, steps = _kernels(tmp_path / "other")
    assert kernels["model"] == "fit" and kernels["fit"]["fitting_row"] is False and steps[-1] == 0.0025
