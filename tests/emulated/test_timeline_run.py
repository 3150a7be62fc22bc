"""The per-rank timeline (``PRISM_TIMELINE=<dir>``) of emulated runs: in process (tier b) and `prism run` (slow).

Both read the written ``rank<R>.timeline.json`` back and check it against the run's own figures and the
Chrome trace event format's rules (`chrome_trace_problems`; Perfetto's trace processor too when the
`perfetto` package happens to be installed, which the project does not require).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.runtime.timeline import chrome_trace_problems


def _load(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    assert chrome_trace_problems(trace) == []
    if importlib.util.find_spec("perfetto") is not None:  # optional: only when already installed
        from perfetto.trace_processor import TraceProcessor

        tp = TraceProcessor(trace=str(path))
        try:
            n = next(iter(tp.query("select count(*) as n from slice"))).n
            assert n >= sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
        finally:
            tp.close()
    return trace


def _comm(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "communication"]


def test_session_timeline_chains_the_tracer_and_draws_async_ops(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PRISM_TIMELINE", str(tmp_path / "tl"))
    P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(2,), gpus_per_node=4),
                               trace_dir=tmp_path / "trace", iteration_marker="explicit"))
    try:
        tp = dist.new_group([2, 3])
        dp = dist.new_group([0, 2, 4, 6])
        t = torch.ones(256)
        for _ in range(2):
            P.mark_iteration()
            dist.all_reduce(t, group=tp)
            works = [dist.all_reduce(torch.ones(4096), group=dp, async_op=True) for _ in range(3)]
            for w in works:
                w.wait()
    finally:
        summary = P.deactivate()
    entry = summary["timeline"]
    assert entry["path"] == str(tmp_path / "tl" / "rank2.timeline.json")
    assert (entry["iterations"], entry["ops"], entry["time_name"]) == (2, 8, "wall")
    trace = _load(Path(entry["path"]))
    assert entry["events"] == len(trace["traceEvents"])
    comm = _comm(trace)
    assert Counter((e["args"]["group_size"], e["args"]["iteration"]) for e in comm) == {
        (2, 1): 1, (4, 1): 3, (2, 2): 1, (4, 2): 3}
    assert all(e["dur"] > 0 for e in comm)  # modelled cost: each group has virtual members
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 2}
    assert {rows[e["tid"]] for e in comm} >= {"communication", "communication 2"}  # the async ops overlap
    assert sum(1 for e in trace["traceEvents"] if e.get("cat") == "wait") == 8
    assert trace["otherData"]["virtual_peers"] == [3, 0, 4, 6]  # tp's first
    # the tracer's record, chained behind the timeline's, still got its wait points
    traced = json.loads((tmp_path / "trace" / "rank2.trace.json").read_text())
    assert all(op[7] >= 0 and op[8] >= op[7] for it in traced["iterations"] for op in it["ops"])


def test_the_timeline_goes_to_the_output_by_default() -> None:
    from prism_plugin.runtime.timeline import timeline_dir

    assert timeline_dir("out", {}) == Path("out") / "timeline"
    assert timeline_dir("out", {"PRISM_TIMELINE": "tl"}) == Path("tl") and timeline_dir(None, {}) is None
    assert timeline_dir("out", {"PRISM_TIMELINE": "off"}) is None


@pytest.mark.slow
@pytest.mark.parametrize("named", [True, False], ids=["PRISM_TIMELINE", "default"])
def test_prism_run_toy_writes_the_timeline(tmp_path: Path, named: bool) -> None:
    """`prism run` of the toy TP MLP, world 4 (tp 4), one real rank, 3 steps: one file, every op drawn; in the
    directory PRISM_TIMELINE names, else in <output>/timeline, its path printed with the summaries."""
    env = {**os.environ, "PRISM_TIMELINE": str(tmp_path / "tl")} if named else \
        {k: v for k, v in os.environ.items() if k != "PRISM_TIMELINE"}
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "4", "--real-ranks", "0",
           "--output", str(tmp_path / "out"), "-m", "prism_plugin.programs.toy_train", "--tp", "4",
           "--hidden", "16", "--batch", "2", "--steps", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "rank0.summary.json").read_text())
    entry = summary["timeline"]
    path = (tmp_path / "tl" if named else tmp_path / "out" / "timeline") / "rank0.timeline.json"
    assert entry["path"] == str(path) and entry["time_name"] == "wall"
    assert f"\ntimeline: {path}\n" in proc.stderr  # the line under the summaries (stderr: stdout is the job's)
    trace = _load(path)
    assert entry["events"] == len(trace["traceEvents"])
    comm = _comm(trace)
    assert len(comm) == sum(summary["op_counts"].values()) == entry["ops"]
    # tp group (4 ranks): the row-parallel output's all_reduce, 1 per step x 3 (x needs no grad: no backward one);
    # the dp groups (1 rank each) hold the other 9 all_reduces, the world the closing barrier
    assert Counter((e["name"], e["args"]["group_size"]) for e in comm) == {
        ("all_reduce", 4): 3, ("all_reduce", 1): 9, ("barrier", 4): 1}
    world4 = [e for e in comm if e["name"] == "all_reduce" and e["args"]["group_size"] == 4]
    assert len(world4) == 3 and all(e["args"]["members"] == [0, 1, 2, 3] for e in world4)
    assert all(e["dur"] > 0 and e["args"]["waited_on"] == [] for e in world4)
    iterations = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "iteration"]
    assert [e["name"] for e in iterations] == [f"iteration {i}" for i in range(1, summary["iterations_marked"] + 1)]
    assert summary["iterations_marked"] == 3
    other = trace["otherData"]
    assert other["virtual_peers"] == [1, 2, 3] and other["virtual_peers_left_out"] == 0
    assert other["arrivals"] == "symmetric: virtual participants arrive with this rank"
    peers = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 4}
    assert peers == {"rank 1 (virtual)", "rank 2 (virtual)", "rank 3 (virtual)"}
    arrivals = Counter(e["tid"] for e in trace["traceEvents"] if e.get("cat") == "arrival")
    assert arrivals == {p: len(world4) + 1 for p in (1, 2, 3)}  # and the closing world barrier
