"""A hung virtual TP peer under `prism run`: tier (c), 2 real gloo processes, FileStore rendezvous.

Real ranks 0 and 2 of a 4-rank job (2 per node; TP groups [0, 1] and [2, 3], DP groups [0, 2] and [1, 3]).
``hang:rank=1,group=tp,op=3``: virtual rank 1 never arrives at its 3rd TP op, so real rank 0's 3rd TP
all-reduce times out after the job's timeout with gloo's message; rank 2, waiting for rank 0 in their DP
all-reduce, fails as well; the job ends, never hangs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.launch.launcher import LaunchSpec, launch

TIMEOUT_S = 3.0
PROGRAM = """
import torch
import torch.distributed as dist
import prism_plugin as P

dist.init_process_group("gloo")
rank = dist.get_rank()
tp = [dist.new_group(r, group_desc=f"tp{i}") for i, r in enumerate([[0, 1], [2, 3]])][rank // 2]
dp = [dist.new_group(r, group_desc=f"dp{i}") for i, r in enumerate([[0, 2], [1, 3]])][rank % 2]
t = torch.ones(4)
for step in range(1, 5):
    P.mark_iteration()
    dist.all_reduce(t, group=tp)
    dist.all_reduce(t, group=dp)
    print(f"rank {rank} done step {step}", flush=True)
"""


@pytest.mark.slow  # launches `prism run` processes
def test_hung_virtual_tp_peer_times_out_on_the_real_rank_and_ends_the_job(tmp_path: Path, capfd) -> None:
    script = tmp_path / "tp_dp.py"
    script.write_text(PROGRAM)
    config = EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0, 2), gpus_per_node=2),
                             timeout_s=TIMEOUT_S, iteration_marker="explicit", faults=("hang:rank=1,group=tp,op=3",))
    start = time.monotonic()
    rc = launch(LaunchSpec(config=config, target=[str(script)], store_dir=tmp_path), timeout_s=60.0)
    elapsed = time.monotonic() - start
    captured = capfd.readouterr()
    assert rc == 1
    assert "rank 0 done step 2" in captured.out and "rank 0 done step 3" not in captured.out
    assert "Timed out waiting 3000ms for recv operation to complete" in captured.err
    assert "fault hang:rank=1,op=3,group=tp,step=0: rank 0 raises" in captured.err
    # rank 2, blocked in its DP all-reduce with rank 0, fails too (timeout or reset when rank 0 exits): either
    # may end first, and the launcher names it
    assert re.search(r"prism run: real rank [02] \(process [01]\) ended with exit code 1", captured.err)
    # two torch start-ups (about 3-6 s each on a loaded 2-core machine) + 3 s timeout; far below the 60 s limit
    assert TIMEOUT_S < elapsed < 30.0
