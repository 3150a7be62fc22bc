"""Evaluation is not an iteration: Megatron's forward-only schedule calls (``--eval-iters`` of them every
``--eval-interval`` iterations, then at the end of training on the validation and test sets) leave the emulation's
iteration marks to the training calls, so a job that evaluates reports as many iterations, steps and stops as it
trains (before, each forward-only call was marked: a 2-iteration job with evaluation reported 6 iterations and its
last step was an evaluation's forward pass).

The job: the pipelined GPT of `test_stop_at_iteration` (PP2, rank 0 of 8) evaluating after every iteration.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration_tests.megatron.test_stop_at_iteration import JOB, _run

pytestmark = pytest.mark.slow


def _with(job: list[str], **flags: str) -> list[str]:
    out = list(job)
    for name, value in flags.items():
        out[out.index(f"--{name.replace('_', '-')}") + 1] = value
    return out


def test_forward_only_calls_are_counted_not_marked(tmp_path: Path) -> None:
    job = _with(JOB, train_iters="2", eval_iters="1", eval_interval="1")
    summary, trace, _ = _run(tmp_path / "out", job=job)
    evaluations = summary["megatron"]["evaluation_calls"]
    assert evaluations >= 3, evaluations  # after iterations 1 and 2, and the end of training's validation
    assert summary["iterations_marked"] == 2
    clock = summary["virtual_gpu"]["virtual_time"]
    assert len(clock["step_times_s"]) == 1 and len(trace) == 1
    # the evaluation after iteration 1 ran inside it: its forward passes add to the step's kernels and time
    bare, bare_trace, _ = _run(tmp_path / "bare", job=_with(JOB, train_iters="2"))
    assert "evaluation_calls" not in bare["megatron"] and bare["iterations_marked"] == 2
    assert clock["step_times_s"][0] > bare["virtual_gpu"]["virtual_time"]["step_times_s"][0]
