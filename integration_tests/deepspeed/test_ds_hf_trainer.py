"""Issue 20 part 8: the Hugging Face Trainer path with ``--deepspeed ds_config.json`` takes the "prism" section with
no code edit, on virtual GPUs.

The script (`scripts/hf_trainer_train.py`) is a plain Trainer script; the ds_config's section asks for rank 3 of 8
virtual H100s, with ``--bf16`` as Trainer users pass it. The startup hook (`prism_plugin.startup`) sees
``transformers`` imported by a launched script (``RANK`` set) whose ds_config asks for virtual GPUs, and the
process re-executes on one then, before ``TrainingArguments`` checks the host for bf16 (before: "Your setup doesn't
support bf16/gpu"); Accelerate's ``deepspeed.init_distributed`` then starts the emulation, and the Trainer trains.
The Trainer builds its AdamW on the CPU model before ``deepspeed.initialize``; the engine's move of the model to
the virtual GPU gives it new parameters (a real CPU parameter cannot take a fake tensor as its ``.data``), and the
adapter re-points the optimizer at them, as parameter identity does on a GPU (before: ZeRO's parameter mapping
failed with a ``KeyError``). Checked: the run ends, the rank's summary is rank 3 of 8 on a virtual GPU, the 21
parameters re-pointed are counted, ZeRO-2's collectives ran (the parameters broadcast, the updated partitions
all-gathered).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf extra (scripts/setup_env.sh installs it)

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_trainer_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_trainer_script_runs_unedited_on_virtual_gpus(tmp_path: Path) -> None:
    out = tmp_path / "prism"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
        "prism": {"world_size": 8, "real_ranks": [3], "profile": "dgx-h100", "device": "virtual-gpu",
                  "output": str(out)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--deepspeed", str(config), "--output_dir",
                           str(tmp_path / "trainer"), "--max_steps", "2", "--per_device_train_batch_size", "2",
                           "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--bf16"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TRAINED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "rank3.summary.json").read_text())
    assert (summary["rank"], summary["world_size"], summary["device_mode"]) == (3, 8, "virtual-gpu")
    sites = {s["site"]: s["count"] for s in summary["virtual_gpu"]["values"]["by_site"]}
    assert sites["deepspeed/runtime/engine.py:_configure_distributed_model"] == 21  # the Llama's parameters
    assert summary["op_counts"]["broadcast"] == 21 and summary["op_counts"]["all_gather"] > 0  # ZeRO-2 on 8
    assert summary["virtual_gpu"]["virtual_time"]["kernels"] > 0
