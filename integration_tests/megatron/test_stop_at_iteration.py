"""``--prism-stop-at-iteration K`` (issue 22): a run that ends where iteration K starts gives the figures of the run
that trains K whole iterations for everything before that mark.

`prism emulate`'s profiling runs end so: the mark that starts the last stated iteration closes the steady one the
execution graph keeps, and nothing of the last iteration is needed. The job: a pipelined GPT (PP2, rank 0 of 8, 4
micro-batches a step, distributed optimizer) on a virtual H100 through the drop-in, traced; both runs start together
(`integration_tests.at_once`: their figures are modelled, deterministic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
JOB = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--ffn-hidden-size", "3584", "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size",
       "32000", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--pipeline-model-parallel-size", "2",
       "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "3", "--lr", "1e-4", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
       "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]


BASE = [a for i, a in enumerate(JOB) if not {a, JOB[i - 1]} & {"--pipeline-model-parallel-size", "--global-batch-size"}]
OTHERS = {  # job, world size, rank: blocks carried across iteration marks (Megatron's kept pipeline inputs and logged
    # losses), FP8 scaling state, the fast-forwarded last stage
    "te_fp8_tp2_sp": ([*BASE, "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--global-batch-size", "16", "--fp8-format", "hybrid",
                       "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
                       "--overlap-grad-reduce", "--overlap-param-gather"], 16, 1),
    "te_pp4_last_stage": ([*BASE, "--transformer-impl", "transformer_engine", "--pipeline-model-parallel-size", "4",
                           "--num-layers", "4", "--global-batch-size", "32", "--recompute-granularity", "selective"],
                          8, 7),
}


def _run(out: Path, *extra: str, job: list[str] = JOB, world: int = 8, rank: int = 0,
         ) -> tuple[dict[str, Any], list[Any], str]:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *job, "--prism-world-size",
                           str(world), "--prism-real-ranks", str(rank), "--prism-profile", "dgx-h100", "--prism-device",
                           "virtual-gpu", "--prism-output", str(out), "--prism-trace", str(out / "trace"), *extra],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    summary = json.loads((out / f"rank{rank}.summary.json").read_text())
    [trace] = (out / "trace").glob("rank*.trace.json")
    return summary, json.loads(trace.read_text())["iterations"], proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict[str, Any], list[Any], str]]:
    tmp = tmp_path_factory.mktemp("stop")
    return at_once(lambda: _run(tmp / "whole"), lambda: _run(tmp / "stopped", "--prism-stop-at-iteration", "3"))


def test_a_run_ended_at_the_third_mark_keeps_the_first_two_iterations_exactly(runs: list[Any]) -> None:
    (whole, whole_trace, _), (stopped, stopped_trace, stderr) = runs
    assert "the run ends where iteration 3 starts" in stderr
    assert "Traceback" not in stderr  # the storages that die at exit free none of the replay's blocks
    stop = stopped["megatron"]["stop_at_iteration"]
    assert stopped["exit_code"] == 0 and stop["stopped_at"] == 3 and stop["refused"] is None
    assert stop["replayed_requests"]["mallocs"] > 0 and "stop_at_iteration" not in whole["megatron"]
    assert whole["iterations_marked"] == stopped["iterations_marked"] == 3
    # the two closed iterations: their emulated steps to the nanosecond and their traced ops, op for op
    clock, clock_stopped = (s["virtual_gpu"]["virtual_time"] for s in (whole, stopped))
    assert clock_stopped["step_times_s"] == clock["step_times_s"] and len(clock["step_times_s"]) == 2
    assert stopped_trace == whole_trace and len(whole_trace) == 2
    # memory: the third iteration's allocator requests, replayed, give the whole run's peaks to the byte (without the
    # replay, the peak allocated was 5 MiB lower here: the third iteration's same requests split blocks differently)
    for key in ("peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes", "fragmentation_at_peak"):
        assert stopped["virtual_gpu"]["devices"][0][key] == whole["virtual_gpu"]["devices"][0][key], key
    # and nothing of the third ran: 4 micro-batches fewer, fewer kernels
    ff, ff_stopped = whole["megatron"]["fast_forward"], stopped["megatron"]["fast_forward"]
    assert (ff["microbatches"], ff_stopped["microbatches"]) == (12, 8)
    assert clock_stopped["kernels"] < clock["kernels"]


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_blocks_carried_across_the_marks_replay_to_the_same_memory(name: str, tmp_path: Path) -> None:
    job, world, rank = OTHERS[name]
    (whole, whole_trace, _), (stopped, stopped_trace, stderr) = at_once(
        lambda: _run(tmp_path / "whole", job=job, world=world, rank=rank),
        lambda: _run(tmp_path / "stopped", "--prism-stop-at-iteration", "3", job=job, world=world, rank=rank))
    stop = stopped["megatron"]["stop_at_iteration"]
    assert stop["stopped_at"] == 3 and stop["replayed_requests"]["carried"] > 0, stop
    assert "Traceback" not in stderr
    assert stopped_trace == whole_trace
    steps = [s["virtual_gpu"]["virtual_time"]["step_times_s"] for s in (stopped, whole)]
    assert steps[0] == steps[1]
    keys = ("peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes", "fragmentation_at_peak")
    assert ({k: stopped["virtual_gpu"]["devices"][0][k] for k in keys}
            == {k: whole["virtual_gpu"]["devices"][0][k] for k in keys})
