"""A fault whose group never occurs, under `prism run`: reported at exit as never fired; strict fails the job.

One real rank of a 4-rank job that only ever uses a DP group: ``hang:rank=1,group=tp,op=1`` never fires. The
summary's ``faults.never_fired`` says why and stderr names it; with ``strict=true`` the process ends with
`FAULT_NEVER_FIRED_EXIT_CODE` after writing its summary (the program itself succeeded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.faults import parse_fault
from prism_plugin.launch.launcher import LaunchSpec, launch
from prism_plugin.runtime.lifecycle import FAULT_NEVER_FIRED_EXIT_CODE

PROGRAM = """
import torch
import torch.distributed as dist
import prism_plugin as P

dist.init_process_group("gloo")
dp = dist.new_group([0, 2], group_desc="dp0")
t = torch.ones(4)
for step in range(3):
    P.mark_iteration()
    dist.all_reduce(t, group=dp)
"""


@pytest.mark.slow  # launches `prism run` processes
@pytest.mark.parametrize("strict", [False, True])
def test_a_fault_on_a_group_the_program_never_uses_is_reported_and_strict_fails(tmp_path: Path, capfd,
                                                                                strict: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    fault = "hang:rank=1,group=tp,op=1" + (",strict=true" if strict else "")
    config = EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0,), gpus_per_node=2), timeout_s=30.0,
                             output_dir=tmp_path / "out", faults=(fault,))
    code = launch(LaunchSpec(config=config, target=[str(script)]), timeout_s=120)
    err = capfd.readouterr().err
    assert code == (FAULT_NEVER_FIRED_EXIT_CODE if strict else 0), err[-2000:]
    assert "never fired on rank 0" in err
    summary = json.loads((tmp_path / "out" / "rank0.summary.json").read_text())
    assert [entry["fault"] for entry in summary["faults"]["never_fired"]] == [parse_fault(fault).to_text()]
    assert ("FaultNeverFiredError" in summary.get("error", "")) is strict
