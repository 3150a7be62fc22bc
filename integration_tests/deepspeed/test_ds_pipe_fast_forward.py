"""Fast-forward of DeepSpeed's pipeline engine on virtual GPUs (issue 22, part 1; DESIGN.md section 14).

The same job runs twice with virtual time, with ``"fast_forward"`` on (the default) and off: a 2-stage
transformer-MLP pipeline (scripts/ds_pipe_virtual_gpu_train.py, hidden 1024, 4 blocks, sequence 512) as one rank of
8 (pp 2 x dp 4, ZeRO-1, bf16), 16 micro-batches per step, 2 steps. Every figure of the rank's summary but wall
times (memory to the byte, emulated times to 1e-9 s, kernel and communication counts) and the script's own memory
lines must be the full run's, and the summary's ``deepspeed.fast_forward`` must count what was skipped:

- stage 0 and stage 1 (the last: its losses are kept in ``fwd_outputs`` until the next batch) with batches made
  on the host, as a DataLoader makes them: 20 of the 32 micro-batches advanced (2 buffers: whole turns of 2); and
  stage 1 memory only (``"virtual_time": "off"``, no timeline: its times would be the wall clock's);
- stage 0 with batches the data iterator makes on the device: taking them in a skip would change the device, so
  nothing is advanced (counted) and the figures are still the full run's;
- a hybrid run (fp32, ZeRO-0, 3 steps): stage 1 against the execution graph `prism emulate` built for the job, its
  virtual peers arriving when the replay says: 30 of the 48 micro-batches advanced, as far as the replay's
  arrivals repeat the proven period (`prism_plugin.runtime.periods.ArrivalPeriods`).

The two runs start together (`integration_tests.at_once`); every figure compared is modelled.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integration_tests.at_once import at_once
from integration_tests.compare import assert_same_figures

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_pipe_virtual_gpu_train.py"
HIDDEN, SEQ, GAS, DP = 1024, 512, 16, 4
WALL = frozenset({"deepspeed", "wall_s", "write_s", "late_median_us", "late_p90_us", "late_max_us", "path"})


def _run(out: Path, rank: int, fast_forward: bool, host_data: bool,
         virtual_time: str = "on") -> tuple[dict[str, Any], list[str]]:
    out.mkdir(parents=True)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "train_batch_size": GAS * DP,
              "bf16": {"enabled": True}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 1},
              "prism": {"world_size": 2 * DP, "real_ranks": [rank], "profile": "dgx-h100", "device": "virtual-gpu",
                        "output": str(out), "fast_forward": fast_forward, "virtual_time": virtual_time,
                        **({"timeline": "off"} if virtual_time == "off" else {}),
                        "pipe_activations": {"shape": [1, SEQ, HIDDEN], "dtype": "bfloat16"}}}
    (out / "ds_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(SCRIPT), "ds_config.json", "--hidden", str(HIDDEN), "--blocks", "4",
                           "--seq", str(SEQ), "--steps", "2", *(["--host-data"] if host_data else [])],
                          capture_output=True, text=True, timeout=900, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("MEM ", "LOSS "))]
    return json.loads((out / f"rank{rank}.summary.json").read_text()), lines


@pytest.mark.parametrize(("rank", "host_data", "skipped", "virtual_time"), [
    pytest.param(4, True, 20, "on", id="stage0", marks=pytest.mark.heavy),
    pytest.param(5, True, 20, "on", id="stage1-last"),
    pytest.param(5, True, 20, "off", id="stage1-last-memory-only"),
    pytest.param(4, False, 0, "on", id="stage0-device-data"),
])
def test_the_pipeline_engines_fast_forward_gives_the_full_runs_figures(tmp_path: Path, rank: int, host_data: bool,
                                                                       skipped: int, virtual_time: str) -> None:
    (fast, fast_lines), (full, full_lines) = at_once(
        lambda: _run(tmp_path / "on", rank, True, host_data, virtual_time),
        lambda: _run(tmp_path / "off", rank, False, host_data, virtual_time))
    ff = fast["deepspeed"]["fast_forward"]
    assert ff["microbatches"] == 2 * GAS and ff["microbatches_skipped"] == skipped, ff
    if not host_data:
        assert set(ff["not_proven"]) == {"the data iterator works on the device"}, ff
        assert ff["schedule_calls"] == {"not proven": 2}, ff
    assert "deepspeed" not in full
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL)
    assert fast_lines == full_lines and len(full_lines) == 5


def test_a_hybrid_stage_is_fast_forwarded_with_the_full_runs_figures(tmp_path: Path) -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "train_batch_size": GAS * DP,
            "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 0}}
    prism = {"topology": {"pipe": 2, "data": DP}, "pipe_activations": {"shape": [1, SEQ, HIDDEN], "dtype": "float32"}}
    args = ["--hidden", str(HIDDEN), "--blocks", "4", "--seq", str(SEQ), "--steps", "3", "--host-data"]
    (tmp_path / "ds_config.json").write_text(json.dumps({**base, "prism": prism}))
    emulate = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", str(2 * DP),
                              "--profile", "dgx-h100", "--output", str(tmp_path / "em"), "--seq-length", str(SEQ),
                              "--", str(SCRIPT), "--deepspeed_config", str(tmp_path / "ds_config.json"), *args],
                             capture_output=True, text=True, timeout=900)
    assert emulate.returncode == 0, emulate.stdout[-3000:] + emulate.stderr[-3000:]

    def hybrid(fast_forward: bool) -> dict[str, Any]:
        out = tmp_path / ("on" if fast_forward else "off")
        out.mkdir()
        config = {**base, "prism": {**prism, "world_size": 2 * DP, "real_ranks": [5], "profile": "dgx-h100",
                                    "device": "virtual-gpu", "output": str(out), "fast_forward": fast_forward,
                                    "graph": str(tmp_path / "em" / "job.graph")}}
        (out / "ds_config.json").write_text(json.dumps(config))
        proc = subprocess.run([sys.executable, str(SCRIPT), "ds_config.json", *args], capture_output=True, text=True,
                              timeout=900, cwd=out)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        return json.loads((out / "rank5.summary.json").read_text())

    fast, full = at_once(lambda: hybrid(True), lambda: hybrid(False))
    ff = fast["deepspeed"]["fast_forward"]
    assert ff["microbatches"] == 3 * GAS and ff["microbatches_skipped"] == 30, ff
    assert fast["graph"]["ops_replayed"] > 50 and fast["graph"]["ops_outside_graph"] == 0, fast["graph"]
    assert_same_figures(fast, full, rel_tol=1e-12, abs_tol=1e-9, ignore=WALL)
