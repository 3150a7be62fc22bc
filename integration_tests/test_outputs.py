"""Issue 11, items 2 and 5, with real `prism run` processes (tier c, FileStore, bounded waits).

Outputs belong to their run: two concurrent runs into one ``--output`` each print only their own summaries, a
failed run prints no older run's table, and the store files and temporary directories are gone at exit. At exit
nothing is accepted silently: a script that never calls ``init_process_group`` is reported, and a hybrid run whose
ops are not its graph's fails (exit 3) unless ``PRISM_GRAPH_MAX_OUTSIDE`` relaxes it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema
from prism_plugin.config.kinds import OpKind
from prism_plugin.graph import ExecutionGraph, TraceBuilder, WorldLayout
from prism_plugin.runtime.lifecycle import GRAPH_MISMATCH_EXIT_CODE
from prism_plugin.topology import MegatronLayout

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 120.0  # one torch start-up on a loaded 2-core machine takes 3-20 s
COLLECTIVES = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
dist.barrier()
time.sleep(float(os.environ.get("HOLD_S", "0")))  # concurrent runs overlap
if os.environ.get("DIE"):
    os.kill(os.getpid(), 9)  # a failed run: no summary
"""


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "prism_plugin.cli.main", "run", *args], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _prism(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`prism run ARGS` to the end: (exit code, stdout, stderr)."""
    proc = _start(*args, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"prism run {args} did not end within {RUN_S} s: {proc.communicate()}") from None
    return proc.returncode, stdout, stderr


def _rows(stderr: str) -> list[tuple[int, int]]:
    """(rank, N) of each row of the summaries table."""
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"^│\s+(\d+)\s+│\s+(\d+)\s+│", stderr, re.MULTILINE)]


def test_concurrent_runs_into_one_output_print_only_their_own(tmp_path: Path) -> None:
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    out = tmp_path / "out"
    runs = {rank: _start("--world-size", "4", "--real-ranks", str(rank), "--no-timing", "--output", str(out),
                         "--", str(script), env={"HOLD_S": "3"}) for rank in (0, 1)}
    results = {rank: p.communicate(timeout=RUN_S) for rank, p in runs.items()}
    for rank, (_stdout, stderr) in results.items():
        assert runs[rank].returncode == 0, stderr
        assert _rows(stderr) == [(rank, 4)], stderr  # its own rank only, never the concurrent run's
    ids = {json.loads((out / f"rank{r}.summary.json").read_text())["run_id"] for r in (0, 1)}
    assert len(ids) == 2 and all(ids)
    assert not list(out.glob("store-*")), "each launcher removes its store file"
    # a failed run into the same folder prints no older run's table
    rc, _stdout, stderr = _prism("--world-size", "4", "--real-ranks", "0", "--no-timing", "--output", str(out), "--",
                                 str(script), env={"DIE": "1"})
    assert rc == 137, stderr
    assert _rows(stderr) == [] and "no real rank of this run wrote a summary into" in stderr, stderr


def test_a_script_that_never_initializes_is_reported_and_temporary_stores_are_removed(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('no distributed here')\n")
    out = tmp_path / "out"
    rc, stdout, stderr = _prism("--world-size", "8", "--real-ranks", "3", "--output", str(out), "--", str(script))
    assert rc == 0, stderr  # nothing distributed ran: reported, not an error
    assert "prism: rank 3: the program never called torch.distributed.init_process_group" in stderr
    summary = json.loads((out / "rank3.summary.json").read_text())
    assert_published_schema(summary)
    assert summary["emulated"] is False and summary["exit_code"] == 0 and summary["run_id"]
    assert _rows(stderr) == [(3, 8)] and "PRISM_SUMMARY" in stdout
    # no --output: the store lives in a temporary directory, removed at exit (two real ranks use the FileStore)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script2 = tmp_path / "collectives.py"
    script2.write_text(COLLECTIVES)
    rc, _stdout, stderr = _prism("--world-size", "4", "--real-ranks", "0,1", "--no-timing", "--", str(script2),
                                 env={"TMPDIR": str(tmp)})
    assert rc == 0, stderr
    assert not list(tmp.iterdir()), f"left behind: {list(tmp.iterdir())}"


def _two_stage_graph(path: Path) -> None:
    """Stage 0 sends once and all-reduces over pp; stage 1 receives and all-reduces (10 us of compute each)."""
    a = TraceBuilder(axis_sizes={"pp": 2})
    a.send("pp", 1, 64)
    a.collective(OpKind.ALL_REDUCE, "pp", 64)
    b = TraceBuilder(axis_sizes={"pp": 2})
    b.compute(10.0)
    b.recv("pp", -1, 64)
    b.collective(OpKind.ALL_REDUCE, "pp", 64)
    ExecutionGraph(layout=WorldLayout(MegatronLayout(world_size=2, pp=2)), class_axes=("pp",),
                   classes={"pp=0": a.build(), "pp=1": b.build()}).save(path)


@pytest.mark.parametrize(("env", "code", "verdict"), [({}, GRAPH_MISMATCH_EXIT_CODE, "refused"),
                                                      ({"PRISM_GRAPH_MAX_OUTSIDE": "1"}, 0, "ok")])
def test_a_program_that_does_not_follow_its_graph_fails(tmp_path: Path, env: dict[str, str], code: int,
                                                        verdict: str) -> None:
    graph = tmp_path / "job.graph"
    _two_stage_graph(graph)
    script = tmp_path / "sends.py"
    script.write_text("import torch, torch.distributed as dist\nimport prism_plugin\n"
                      "dist.init_process_group('gloo')\nt = torch.ones(16)\n"
                      "for _ in range(2):\n    prism_plugin.mark_iteration()\n"
                      "    for _ in range(4):\n        dist.send(t, 1)\n")  # the graph's iteration has one send
    out = tmp_path / "out"
    rc, _stdout, stderr = _prism("--world-size", "2", "--real-ranks", "0", "--graph", str(graph), "--iteration-marker",
                                 "explicit", "--output", str(out), "--", str(script), env=env)
    assert rc == code, stderr
    summary = json.loads((out / "rank0.summary.json").read_text())
    g, check = summary["graph"], summary["graph_check"]
    assert (g["ops_replayed"], g["ops_not_in_graph"], g["ops_kind_mismatch"], g["ops_outside_graph"]) == (2, 6, 0, 6)
    assert check["verdict"] == verdict and check["ops_after_first_mark"] == 8 and check["outside_fraction"] == 0.75
    text = " ".join(stderr.split())
    assert "rank 0: graph: 2 ops replayed, 6 outside the graph (6 not in it, 0 of another kind)" in text
    if verdict == "refused":
        assert "6 of the 8 ops after the first iteration mark were outside the graph" in text
        assert summary["error"].startswith("GraphMismatchError: ") and summary["exit_code"] == 0
        assert "prism run: real rank 0 (process 0) ended with exit code 3" in stderr
    else:
        assert "error" not in summary
