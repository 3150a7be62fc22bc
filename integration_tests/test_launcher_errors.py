"""Errors early and plain (issue 11, item 4), as a user meets them: the launchers as commands, real processes.

`prism run`, ``prism megatron`` (self-launching 2 real ranks) and ``python -m prism_plugin.megatron`` refuse
a missing script or module, a graph or a recording of another N and an output / record path that is a file
once, in the launcher: exit code 2, one ``prism: invalid input:`` line naming the flag, no traceback, no
output directory, no real process started (no ``PRISM_SUMMARY``). Before, each real process failed with a
traceback (``--record <file>`` even exited 0 with nothing recorded). The recording case is end to end: a
real ``--record`` run at N=2, replayed at N=2 (accepted) and at N=8 (refused).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_plugin.graph import SyntheticJob, build_1f1b_graph

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print("SUM", t[0].item(), flush=True)
dist.destroy_process_group()
"""
MEGATRON_ARGS = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads",
                 "2", "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("launcher_errors")
    (d / "train.py").write_text(PROGRAM)
    (d / "notes.txt").write_text("a file\n")
    build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=2, num_microbatches=2, fwd_us=100, bwd_us=200, activation_bytes=64,
                                  grad_bytes=64)).save(d / "n4.graph")
    rc, out, err = _run(d, ["run", "--world-size", "2", "--real-ranks", "0,1", "--record", "rec2", "--", "train.py"])
    assert rc == 0 and sorted(p.name for p in (d / "rec2").iterdir()) == ["rank0.pt", "rank1.pt"], err
    return d


def _run(cwd: Path, argv: list[str], *, module: str = "prism_plugin.cli.main") -> tuple[int, str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRISM_CONFIG", "PRISM_STORE_FILE", "PRISM_PROCESS_INDEX"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


CASES = [
    # (module, argv; "OUT" is the output directory that must not appear, words of the one message)
    ("prism_plugin.cli.main", ["run", "--world-size", "4", "--real-ranks", "0,1", "--output", "OUT", "--",
                               "missing.py"], "script 'missing.py' does not exist"),
    ("prism_plugin.cli.main", ["run", "--world-size", "4", "--real-ranks", "0", "--output", "OUT", "-m",
                               "no_such_module_x"], "-m no_such_module_x: no module named 'no_such_module_x'"),
    ("prism_plugin.cli.main", ["run", "--world-size", "8", "--real-ranks", "0,1", "--output", "OUT", "--graph",
                               "n4.graph", "--", "train.py"],
     "--graph 'n4.graph' describes 4 ranks but --world-size is 8"),
    ("prism_plugin.cli.main", ["run", "--world-size", "8", "--real-ranks", "0,1", "--output", "OUT", "--replay", "rec2",
                               "--", "train.py"], "--replay 'rec2': rank0.pt was recorded at world size 2 but "
                                                  "--world-size is 8"),
    ("prism_plugin.cli.main", ["run", "--world-size", "2", "--real-ranks", "0", "--output", "notes.txt", "--",
                               "train.py"], "--output 'notes.txt' is a file, not a directory"),
    ("prism_plugin.cli.main", ["run", "--world-size", "2", "--real-ranks", "0,1", "--output", "OUT", "--record",
                               "notes.txt", "--", "train.py"], "--record 'notes.txt' is a file, not a directory"),
    ("prism_plugin.cli.main", ["megatron", "missing.py", *MEGATRON_ARGS, "--prism-world-size", "4",
                               "--prism-real-ranks", "0,1", "--prism-output", "OUT"],
     "script 'missing.py' does not exist"),
    ("prism_plugin.cli.main", ["megatron", "train.py", *MEGATRON_ARGS, "--prism-world-size", "8",
                               "--prism-real-ranks", "0,1", "--prism-graph", "n4.graph", "--prism-output", "OUT"],
     "--prism-graph 'n4.graph' describes 4 ranks but --prism-world-size is 8"),
    ("prism_plugin.megatron", ["train.py", *MEGATRON_ARGS, "--prism-world-size", "8", "--prism-real-ranks", "0",
                               "--prism-replay", "rec2", "--prism-output", "OUT"],
     "--prism-replay 'rec2': rank0.pt was recorded at world size 2 but --prism-world-size is 8"),
    ("prism_plugin.megatron", ["train.py", *MEGATRON_ARGS, "--prism-world-size", "2", "--prism-real-ranks", "0,1",
                               "--prism-record", "notes.txt", "--prism-output", "OUT"],
     "--prism-record 'notes.txt' is a file, not a directory"),
]


@pytest.mark.parametrize("module,argv,words", CASES, ids=[f"{c[1][0]}: {c[2][:36]}" for c in CASES])
def test_the_launcher_refuses_once_before_any_process(work: Path, module: str, argv: list[str], words: str) -> None:
    out = work / "out-refused"
    rc, stdout, stderr = _run(work, [str(out) if a == "OUT" else a for a in argv], module=module)
    assert rc == 2, stderr
    assert "Traceback" not in stderr + stdout and "PRISM_SUMMARY" not in stdout  # no real process ran
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("prism: invalid input: ") and words in lines[0], stderr
    assert not out.exists()
    assert (work / "notes.txt").read_text() == "a file\n"


def test_a_recording_of_this_n_is_accepted(work: Path) -> None:
    rc, stdout, stderr = _run(work, ["run", "--world-size", "2", "--real-ranks", "1", "--replay", "rec2", "--no-timing",
                                     "--output", str(work / "out-replay"), "--", "train.py"])
    assert rc == 0, stderr
    assert "SUM 3.0" in stdout  # rank 1 replays what the real 2-rank run received: 1 + 2
    assert (work / "out-replay" / "rank1.summary.json").is_file()
