"""`prism emulate --hybrid` finds a ZeRO rank that is not like its class: ZeRO-1 at dp 4, rank 1 against the graph.

The slicing puts every data-parallel rank of a DeepSpeed job in one class (every ZeRO rank owns an equal
partition), so the graph replays rank 0's trace for all four. Rank 1's own work is not rank 0's: its partition's
boundaries cut the parameters differently, and over the run it launches 1583 kernels to rank 0's 956 (more
``_to_copy`` / ``add_`` / ``copy_`` / ``cat`` of gradient pieces; measured). Its hybrid run, the virtual peers
arriving when the replay says, therefore takes longer than the replay's step, by a deterministic amount (pinned):
the replay's 8.077364 ms vs rank 1's 8.620782 ms, +543.418 us. Rank 0 itself agrees to 1 ns
(`test_emulate_deepspeed`). This is what the hybrid phase is for: a rank the classes do not describe shows.

About 50 s (one profiling run, one hybrid run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.profiles import launch_light_profile

pytestmark = pytest.mark.slow


SCRIPT = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "deepspeed_lm.py"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 16,
          "bf16": {"enabled": True}, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}


def test_a_zero1_rank_whose_partition_differs_from_its_class_shows_in_the_hybrid_run(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / "em"
    # a launch-light host (5 us a launch): the replay's compute spans are the GPU's, so a rank that does its class's
    # work replays to its live step where the GPU bounds it (integration_tests/profiles.py)
    profile = str(launch_light_profile(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "4", "--out",
                           str(out), "--profile", profile, "--json", "--hybrid", "1", "--", str(SCRIPT),
                           "--deepspeed_config", str(config),
                           "--seq-length", "1024", "--steps", "3"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["layout"], report["zero_stage"], report["classes_of_ranks"]) == ("pipe=1,model=1,data=4", 1, 1)
    (h,) = report["hybrid"]
    assert (h["rank"], h["class"], h["representative"]["rank"]) == (1, "pp=0", 0)
    assert h["graph"]["ops_replayed"] > 0 and h["graph"]["ops_outside_graph"] == 0
    assert (h["kernels"], h["representative"]["kernels"]) == (1571, 944)  # its own work is not rank 0's
    assert h["replay_step_ms"] == 8.50099 and h["step_ms"] == 9.039407  # modelled, deterministic
    assert h["difference_us"] == 538.417
