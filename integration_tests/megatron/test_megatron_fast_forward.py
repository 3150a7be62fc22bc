"""Fast-forward of Megatron's 1F1B steady state through the drop-in (issue 22, part 1; DESIGN.md section 14).

The same job runs twice on a virtual H100, with ``--prism-fast-forward on`` (the default) and ``off``: a 4-layer
GPT, pipeline-parallel 4, 32 micro-batches per iteration, 2 iterations. Fast-forward must skip part of the steady
state (the summary counts it) and give the full run's figures: every number of the rank's summary but wall times
(memory to the byte, emulated times to 1e-9 s, kernel and communication counts, value-policy answers), and
Megatron's own memory log lines. The two runs start together (`integration_tests.at_once`): every figure compared is
modelled, none measured.

- rank 0 (the first stage, 3 warm-up micro-batches: a period of 3 iterations), local spec; with
  ``--prism-attention flash`` (the stand-in's forward counts are advanced with the device's); and memory only
  (``--prism-virtual-time off``: the proof and the advance are the allocations and counts);
- rank 0 of 2 without pipelining (data-parallel 2, 32 micro-batches per call: Megatron's no-pipelining schedule,
  a period of one micro-batch; heavy: with TransformerEngine and FP8, whose first micro-batch differs); and a
  GPU-bound form of it (hidden 8192, sequence 2048: each micro-batch's kernels take longer than its launches, so
  the GPU runs ahead of the host by a lead that grows every period, proven and advanced in the GPU's frame);
- rank 3 (the last stage: no warm-up, a period of 1 iteration; each micro-batch's reported loss is kept in the
  schedule's ``forward_data_store`` until the step ends, so the skipped ones' entries are made to own the blocks
  the allocator's replay left for them), local spec, as `prism emulate` profiles it (``--prism-output`` and
  ``--prism-trace``, 3 iterations): the trace the execution graph is built from and the timeline must be the full
  run's too, record for record, and so must the class trace (the graph's) made from the trace (heavy: without
  trace and timeline);
- heavy: rank 2 of 8 (TP2 with sequence parallelism, the second stage), TransformerEngine with FP8 (hybrid,
  delayed scaling); rank 0 of 8 with TE and 4 experts over EP2 (all-to-all dispatcher, grouped GEMM), 32
  micro-batches per call (the MoE routing policy's answer counts are advanced with the device's);
- the interleaved schedule (8 layers, 2 model chunks per stage, 64 micro-batches per call: a period of 8 steady
  iterations), with Megatron-LM's overlapped exchanges (each handle waited on an iteration after it is issued, so
  some are pending at every mark) and without them, and memory only: rank 0, rank 1 (heavy: TE with FP8 at TP2),
  and the last stage as `prism emulate` profiles it (its trace, timeline and class trace too);
- a hybrid run (rank 1 of the 1F1B job against the execution graph `prism emulate` built for it): its virtual
  peers arrive when the graph's replay says, so the proof also signs the arrivals each period met and the advance
  stops where the replayed table stops repeating them (`prism_plugin.runtime.periods.ArrivalPeriods`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once
from integration_tests.compare import assert_same_figures

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
ARGS = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
        "--global-batch-size", "32", "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "1024", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--disable-gloo-process-groups",
        "--pipeline-model-parallel-size", "4"]
WALL = frozenset({"fast_forward", "wall_s", "write_s", "late_median_us", "late_p90_us", "late_max_us"})


def _run(tmp_path: Path, fast_forward: str, world: int, rank: int, extra: list[str],
         *more: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra, *more,
                           "--prism-world-size", str(world), "--prism-real-ranks", str(rank), "--prism-profile",
                           "dgx-h100", "--prism-device", "virtual-gpu", "--prism-fast-forward", fast_forward],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PRISM_SUMMARY ")]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1]), proc.stdout


def _memory_lines(log: str) -> list[str]:
    return re.findall(r"\[Rank \d+\] \(after \d+ iterations\) memory \(MB\).*", log)


@pytest.mark.parametrize(("world", "rank", "extra"), [
    pytest.param(4, 0, ["--transformer-impl", "local"], id="first-stage-local"),
    pytest.param(4, 0, ["--transformer-impl", "local", "--prism-attention", "flash"], id="first-stage-flash"),
    pytest.param(4, 0, ["--transformer-impl", "local", "--prism-virtual-time", "off"], id="first-stage-memory-only",
                 marks=pytest.mark.heavy),
    pytest.param(4, 3, ["--transformer-impl", "local"], id="last-stage-local", marks=pytest.mark.heavy),
    pytest.param(2, 0, ["--transformer-impl", "local", "--pipeline-model-parallel-size", "1", "--global-batch-size",
                        "64"], id="no-pipelining-local"),
    pytest.param(2, 0, ["--transformer-impl", "local", "--pipeline-model-parallel-size", "1", "--global-batch-size",
                        "64", "--num-layers", "2", "--hidden-size", "8192", "--ffn-hidden-size", "32768",
                        "--num-attention-heads", "64", "--seq-length", "2048", "--max-position-embeddings", "2048"],
                 id="no-pipelining-gpu-bound"),
    pytest.param(2, 0, ["--transformer-impl", "transformer_engine", "--pipeline-model-parallel-size", "1",
                        "--global-batch-size", "64", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
                 id="no-pipelining-te-fp8", marks=pytest.mark.heavy),
    pytest.param(8, 2, ["--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
                 id="middle-stage-te-fp8", marks=pytest.mark.heavy),
    pytest.param(8, 0, ["--transformer-impl", "transformer_engine", "--num-experts", "4", "--moe-token-dispatcher-type",
                        "alltoall", "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--disable-bias-linear",
                        "--global-batch-size", "64"], id="first-stage-te-moe-ep2", marks=pytest.mark.heavy),
])
def test_fast_forward_gives_the_full_runs_figures(tmp_path: Path, world: int, rank: int, extra: list[str]) -> None:
    (fast, fast_log), (full, full_log) = at_once(lambda: _run(tmp_path, "on", world, rank, extra),
                                                 lambda: _run(tmp_path, "off", world, rank, extra))
    ff = fast["megatron"]["fast_forward"]
    assert ff["schedule_calls"] == {"fast-forwarded": 2}, ff
    assert ff["microbatches"] == 64 and ff["microbatches_skipped"] >= 16, ff  # 2 calls of 32 micro-batches
    assert "fast_forward" not in full["megatron"]
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL)
    assert _memory_lines(fast_log) == _memory_lines(full_log) and len(_memory_lines(full_log)) == 2


INTERLEAVED = ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "64"]


@pytest.mark.parametrize(("world", "rank", "extra"), [
    pytest.param(4, 0, ["--transformer-impl", "local"], id="first-stage-local"),
    pytest.param(4, 0, ["--transformer-impl", "local", "--no-overlap-p2p-communication"], id="first-stage-no-overlap"),
    pytest.param(4, 0, ["--transformer-impl", "local", "--prism-virtual-time", "off"], id="first-stage-memory-only",
                 marks=pytest.mark.heavy),
    pytest.param(8, 2, ["--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
                 id="second-stage-te-fp8", marks=pytest.mark.heavy),
])
def test_the_interleaved_schedules_fast_forward_gives_the_full_runs_figures(tmp_path: Path, world: int, rank: int,
                                                                             extra: list[str]) -> None:
    """Proven once the seam results reach 16 iterations back (the longest a micro-batch's chunk lives, in whole
    periods) and the allocations back to the oldest block a period frees repeat (rank 0: at the mark before steady
    iteration 33 of 118), then whole periods of 8 iterations are advanced up to the last micro-batch group (rank 0:
    10 periods, 40 micro-batches' worth, in each of the 2 calls); every figure is the full run's."""
    (fast, fast_log), (full, full_log) = at_once(lambda: _run(tmp_path, "on", world, rank, [*INTERLEAVED, *extra]),
                                                 lambda: _run(tmp_path, "off", world, rank, [*INTERLEAVED, *extra]))
    ff = fast["megatron"]["fast_forward"]
    assert ff["schedule_calls"] == {"fast-forwarded": 2}, ff
    assert ff["microbatches"] == 128 and ff["microbatches_skipped"] >= 64, ff
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL)
    assert _memory_lines(fast_log) == _memory_lines(full_log) and len(_memory_lines(full_log)) == 2


@pytest.mark.parametrize("interleaved", [False, True], ids=["1f1b", "interleaved"])
def test_a_profiling_runs_trace_and_timeline_are_the_full_runs(tmp_path: Path, interleaved: bool) -> None:
    from prism_plugin.graph.convert import class_trace
    from prism_plugin.graph.layout import WorldLayout
    from prism_plugin.graph.rank_trace import RankTrace
    from prism_plugin.topology import MegatronLayout

    def profiled(mode: str) -> tuple[dict[str, Any], str]:
        out = tmp_path / mode
        return _run(tmp_path, mode, 4, 3, ["--transformer-impl", "local", "--train-iters", "3",
                    "--untie-embeddings-and-output-weights", *(INTERLEAVED if interleaved else [])], "--prism-output",
                    str(out), "--prism-trace", str(out / "trace"))

    (fast, _), (full, _) = at_once(lambda: profiled("on"), lambda: profiled("off"))
    ff = fast["megatron"]["fast_forward"]
    assert ff["schedule_calls"] == {"fast-forwarded": 3} and ff["microbatches_skipped"] >= 24, ff
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL | {"path"})
    traces = {mode: json.loads((tmp_path / mode / "trace" / "rank3.trace.json").read_text()) for mode in ("on", "off")}
    assert len(traces["off"]["iterations"]) == 2 and len(traces["off"]["iterations"][1]["ops"]) > 100
    # times are microseconds rounded to 1e-6: the advance multiplies where the full run adds (far below 1e-6 s)
    assert_same_figures(traces["on"], traces["off"], rel_tol=0, abs_tol=2e-3)
    timelines = {mode: json.loads((tmp_path / mode / "timeline" / "rank3.timeline.json").read_text())
                 for mode in ("on", "off")}
    assert len(timelines["off"]["traceEvents"]) > 1000
    assert_same_figures(timelines["on"], timelines["off"], rel_tol=0, abs_tol=2e-3, ignore=frozenset({"write_s"}))
    layout = WorldLayout(MegatronLayout(world_size=4, pp=4))
    graphs = [[node.to_dict() for node in class_trace(RankTrace.from_dict(traces[mode]), layout, warmup=1)[0].nodes]
              for mode in ("on", "off")]
    assert len(graphs[1]) > 100
    assert_same_figures(graphs[0], graphs[1], rel_tol=1e-9, abs_tol=1e-6)


def test_a_hybrid_runs_fast_forward_gives_the_full_runs_figures(tmp_path: Path) -> None:
    """Rank 1 (a middle stage: virtual peers on both sides) against the graph of the job's own profiling runs:
    advanced where both the rank's periods and the virtual arrivals the replay gives them repeat; every figure, the
    graph block's counts of replayed ops included, is the full run's."""
    job = [*ARGS, "--transformer-impl", "local", "--train-iters", "3"]
    emulate = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "4",
                              "--profile", "dgx-h100", "--warmup", "1", "--out", str(tmp_path / "emulate"), "--",
                              str(SCRIPT), *job], capture_output=True, text=True, timeout=900, cwd=ROOT,
                             env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert emulate.returncode == 0, emulate.stdout[-3000:] + emulate.stderr[-4000:]
    graph = ["--train-iters", "3", "--prism-graph", str(tmp_path / "emulate" / "job.graph")]
    (fast, fast_log), (full, full_log) = at_once(lambda: _run(tmp_path, "on", 4, 1, ["--transformer-impl", "local"],
                                                              *graph),
                                                 lambda: _run(tmp_path, "off", 4, 1, ["--transformer-impl", "local"],
                                                              *graph))
    ff = fast["megatron"]["fast_forward"]
    assert ff["schedule_calls"] == {"fast-forwarded": 3} and ff["microbatches_skipped"] >= 48, ff
    assert fast["graph"]["ops_replayed"] > 300 and fast["graph"]["ops_outside_graph"] <= 3, fast["graph"]
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL)
    assert _memory_lines(fast_log) == _memory_lines(full_log) and len(_memory_lines(full_log)) == 2
