"""A Megatron job through the drop-in on virtual H100s, as one rank of a small world: its summary, after checking
that it exited 0 and that Megatron logged each iteration itself (shared by the tests that compare two forms of a
job on figures that are modelled)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"


def train(out: Path, args: list[str], *, iterations: int, world_size: int = 2, rank: int = 1) -> dict[str, Any]:
    """``pretrain_gpt.py`` with `args` (which set ``--train-iters`` to `iterations`) as `rank` of `world_size`, on
    dgx-h100 virtual GPUs, writing to `out`; the rank's summary."""
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *args,
                           "--prism-world-size", str(world_size), "--prism-real-ranks", str(rank),
                           "--prism-profile", "dgx-h100", "--prism-device", "virtual-gpu", "--prism-output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    logged = re.findall(rf"iteration\s+(\d+)/\s+{iterations} \|", proc.stdout)
    assert logged == [str(i + 1) for i in range(iterations)]  # Megatron's own iteration lines
    summary: dict[str, Any] = json.loads((out / f"rank{rank}.summary.json").read_text())
    return summary
