"""`prism emulate` of a DeepSpeed pipeline job: 2 stages x dp 4 on 8 virtual H100s, and hybrid ranks of both stages.

The script is the pipeline test's (integration_tests/deepspeed/scripts/ds_pipe_virtual_gpu_train.py: a
PipelineModule of 4 transformer-MLP blocks, 2 stages, 4 micro-batches of 1 x 512 x 1024), its ds_config with
``"prism": {"topology": {"pipe": 2, "data": 4}, "pipe_activations": ...}`` (the activation a stage receives from a
virtual previous stage: the tensor-meta message virtual GPUs cannot read). fp32 and ZeRO-0, so every data-parallel
rank of a stage does the same work (no partition boundaries) and its class describes it exactly.

emulate profiles one rank per stage (0 and 4), builds the graph and replays it; the hybrid runs of ranks 1 (stage
0) and 5 (stage 1), their virtual peers, stage neighbours included, arriving when the replay says, take exactly
the replay's step (modelled, to the reported nanosecond). ``--jobs 2``: the two profiling runs, then the two
hybrid runs, at once (one core each; the modelled figures do not change). About 35 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.profiles import launch_light_profile

pytestmark = pytest.mark.slow


SCRIPT = Path(__file__).parent / "deepspeed" / "scripts" / "ds_pipe_virtual_gpu_train.py"
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "train_batch_size": 16,
          "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 0},
          "prism": {"topology": {"pipe": 2, "data": 4},
                    "pipe_activations": {"shape": [1, 512, 1024], "dtype": "float32"}}}


def test_a_two_stage_deepspeed_pipeline_replays_exactly_for_ranks_of_both_stages(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    # a launch-light host (5 us a launch): the replay's compute spans are the GPU's, so it reproduces a live step
    # where the GPU bounds it (integration_tests/profiles.py)
    profile = str(launch_light_profile(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "8",
                           "--profile", profile,
                           "--output", str(tmp_path / "em"), "--json", "--seq-length", "512", "--hybrid", "1,5",
                           "--jobs", "2", "--", str(SCRIPT), "--deepspeed_config", str(config), "--hidden", "1024",
                           "--blocks", "4", "--seq", "512", "--steps", "3"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["layout"], report["classes_of_ranks"]) == ("pipe=2,model=1,data=4", 2)
    assert [(c["class"], c["rank"], c["ranks_like_it"]) for c in report["classes"]] == [("pp=0", 0, 4), ("pp=1", 4, 4)]
    assert report["step_ms"] == 8.85  # modelled
    assert all(c["bubble_ms"] > 0 for c in report["classes"])  # each stage waits for the other
    rows = {h["rank"]: h for h in report["hybrid"]}
    for rank, stage, representative in ((1, "pp=0", 0), (5, "pp=1", 4)):
        h = rows[rank]
        assert (h["class"], h["representative"]["rank"]) == (stage, representative)
        assert h["kernels"] == h["representative"]["kernels"]  # the same work as its class
        assert h["graph"]["ops_outside_graph"] == 0 and h["graph"]["ops_not_in_graph"] == 0
        # the live step, kept to the nanosecond, is the replay's to within that rounding (0.001 us)
        assert round(h["replay_step_ms"], 3) == 8.85 and abs(h["difference_us"]) <= 0.001
