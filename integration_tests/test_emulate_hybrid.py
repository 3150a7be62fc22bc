"""`prism emulate --hybrid`: real ranks of a pipelined Megatron job run against its graph in virtual time.

The job is `test_emulate`'s (2 layers of width 1024, TP1 PP2 DP4 on 8 virtual H100s, GBS 16: 4 micro-batches per
pipeline). After the profiling runs, graph and replay, ``--hybrid 0,7`` runs rank 0 (stage 0) and rank 7 (stage 1,
dp 3) again as real processes on virtual GPUs with ``--prism-graph``: their virtual peers (the other stage included)
arrive on their emulated clocks when the replay says (`prism_plugin.runtime.arrivals` moves each op's arrival; the
virtual-GPU clock completes it at max(arrivals) + cost). So:

- in its profiling run (symmetric arrivals: every peer arrives with it) stage 0 never waits for stage 1's backward,
  and its step is much shorter than the job's; against the graph it waits as in the replay;
- each hybrid rank's steady step (its last) is the replay's step when the hybrid run executes the same kernels in
  the same order as the profiling run of its class (measured: 12.250519 ms both, 0 difference). It does not always:
  this program's optimizer step does not issue the same kernel sequence in every run (seen: identical runs of
  rank 0 diverge after the grad-norm all-reduce, an Adam update in one where the other scales gradients with
  mul/copy_ pairs; same kernels, same total emulated time, another order against the communication), so its
  steady step in virtual time takes one of a few values 12.179-12.285 ms, the profiling runs' too. The assertion
  is therefore the replay's step within 1% (the widest measured gap: 105.8 us of 12.18 ms, 0.87%), and the
  coupling itself is asserted against the profiling run (stage 0 alone takes under half the step). The exact form
  of the hybrid check is in tests/emulated/test_pipeline_bubble.py (a program with one kernel order).

About 90 s (two profiling runs, two hybrid runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # minutes of CI each; `scripts/test.sh --heavy` runs them

SCRIPT = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "pretrain_gpt.py"
JOB = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "3584", "--seq-length", "1024",
       "--max-position-embeddings", "1024", "--vocab-size", "32000", "--normalization", "RMSNorm", "--swiglu",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
       "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--pipeline-model-parallel-size", "2",
       "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "3", "--lr", "1e-4", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
       "--eval-iters", "0", "--eval-interval", "1000000", "--disable-gloo-process-groups"]


def test_hybrid_ranks_of_a_pipelined_job_take_the_replays_step(tmp_path: Path) -> None:
    out = tmp_path / "em"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "8", "--out",
                           str(out), "--json", "--hybrid", "0,7", "--", str(SCRIPT), *JOB],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["framework"] == "megatron"  # its step is pinned in test_emulate
    hybrid = {h["rank"]: h for h in report["hybrid"]}
    assert {r: h["class"] for r, h in hybrid.items()} == {0: "pp=0", 7: "pp=1"}
    replay_ms = round(report["replay"]["step_us"] / 1e3, 6)
    for rank, h in hybrid.items():
        assert h["replay_step_ms"] == replay_ms
        assert abs(h["difference_us"]) <= 0.01 * replay_ms * 1e3  # the program's kernel order (module docstring)
        g = h["graph"]
        # two iterations' ops (the run ends at the third's mark): pipeline sends and receives, DP reductions
        assert g["ops_replayed"] >= 30 and g["ops_outside_graph"] <= 0.1 * (g["ops_replayed"] + g["ops_outside_graph"])
        assert (out / "hybrid" / f"rank{rank}" / f"rank{rank}.summary.json").is_file()
    # the same stage-0 rank with symmetric arrivals (its profiling run) does not wait for stage 1
    profiled = json.loads((out / "run0" / "rank0.summary.json").read_text())
    assert profiled["arrivals"] == "symmetric"
    assert profiled["virtual_gpu"]["virtual_time"]["step_times_s"][-1] * 1e3 < 0.5 * hybrid[0]["step_ms"]
