"""The probe realigns a real run's ranks after its own step-end work (`Probe._realign`).

Two plain gloo processes run a tiny all-reduce training loop under the probe; rank 1's garbage collection, the
probe's own work at each step end, is made 0.2 s slower than rank 0's. Without the barrier that follows that
work, rank 0 would wait those 0.2 s in the next step's all-reduce and count them in its step; with it, rank 0's
steps stay short. Wall-clock, but the margin is the injected delay: a step of this loop takes a few
milliseconds, and the check is that rank 0's median step is under a quarter of the delay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import gc, time
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
if dist.get_rank() == 1:  # the probe's step-end collection, slower on this rank
    collect = gc.collect
    gc.collect = lambda *a: (time.sleep(0.2), collect(*a))[1]
w = torch.nn.Parameter(torch.ones(8, 8))
opt = torch.optim.SGD([w], lr=0.01)
for _ in range(6):
    loss = (torch.ones(4, 8) @ w).sum()
    loss.backward()
    dist.all_reduce(w.grad)
    opt.step()
    opt.zero_grad()
dist.barrier()
"""


def test_a_slow_step_end_on_one_rank_does_not_lengthen_its_peers_steps(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PRISM_PROBE_DIR": str(tmp_path / "out"),
               "PRISM_PROBE_STORE": str(tmp_path / "store"), "PRISM_PROBE_LABEL": "real"}
        procs.append(subprocess.Popen([sys.executable, "-m", "prism_plugin.recipes.probe", str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    steps = json.loads((tmp_path / "out" / "rank0.metrics.json").read_text())["steps"]
    durations = sorted(s["duration_s"] for s in steps if s["index"] >= 1)
    assert len(durations) == 5
    assert durations[len(durations) // 2] < 0.05, durations  # unaligned: each step would hold rank 1's 0.2 s
