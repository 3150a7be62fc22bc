"""A killed real rank (fault ``kill``) ends the job cleanly: tier (c), 2 real gloo processes, FileStore rendezvous.

The program: real ranks 0 and 1 of a 4-rank job, each step an all-reduce over the world group (its inner
real exchange links the two processes). ``kill:rank=0,step=3`` SIGKILLs process 0 at its 3rd iteration mark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prism_plugin.config.channel import config_to_env
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.launch.launcher import LaunchSpec, launch

TIMEOUT_S = 5.0
PROGRAM = """
import torch
import torch.distributed as dist
import prism_plugin as P

dist.init_process_group("gloo")
t = torch.ones(4)
for step in range(1, 7):
    P.mark_iteration()
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} done step {step}", flush=True)
"""


def _config(tmp_path: Path) -> EmulationConfig:
    return EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0, 1), gpus_per_node=2),
                           timeout_s=TIMEOUT_S, iteration_marker="explicit", faults=("kill:rank=0,step=3",))


@pytest.mark.slow  # launches `prism run` processes
def test_killed_real_rank_stops_the_job_with_a_message_naming_it(tmp_path: Path, capfd) -> None:
    script = tmp_path / "steps.py"
    script.write_text(PROGRAM)
    start = time.monotonic()
    rc = launch(LaunchSpec(config=_config(tmp_path), target=[str(script)], store_dir=tmp_path),
                timeout_s=60.0)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 137  # the killed process's status as a shell reports it: 128 + SIGKILL (9)
    assert "fault kill:rank=0,step=3: real rank 0" in err
    assert "prism run: real rank 0 (process 0) ended with killed by signal 9 (SIGKILL, exit code 137)" in err
    assert elapsed < 30.0  # two torch start-ups (~5 s each on a loaded core) + the job; never the 60 s limit


@pytest.mark.slow  # launches `prism run` processes
def test_surviving_real_rank_exits_with_an_error_within_the_timeout(tmp_path: Path) -> None:
    """Without the launcher's stop signal (torchrun-like), the survivor's own inner gloo op fails."""
    script = tmp_path / "steps.py"
    script.write_text(PROGRAM)
    config = _config(tmp_path)
    procs = []
    for i, rank in enumerate(config.world.real_ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(i), LOCAL_WORLD_SIZE="2",
                   PRISM_CONFIG=config_to_env(config), PRISM_PROCESS_INDEX=str(i),
                   PRISM_STORE_FILE=str(tmp_path / "store"), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        procs.append(subprocess.Popen([sys.executable, "-m", "prism_plugin.runtime.bootstrap", str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out0, _ = procs[0].communicate(timeout=60)
    killed_at = time.monotonic()
    out1, err1 = procs[1].communicate(timeout=TIMEOUT_S + 30)
    waited = time.monotonic() - killed_at
    assert procs[0].returncode == -9 and "done step 2" in out0 and "done step 3" not in out0
    assert procs[1].returncode != 0, "the survivor must fail, not finish or hang"
    assert "done step 2" in out1 and "done step 3" not in out1
    # gloo words a dead peer "Connection reset by peer" or "Connection closed by peer" (which side reads first)
    assert "RuntimeError" in err1 and any(m in err1 for m in ("Connection reset by peer", "Connection closed by peer",
                                                              "Timed out")), err1[-2000:]
    assert waited < TIMEOUT_S + 10.0  # the job timeout (5 s) + process teardown on a loaded core
