"""Issue 11, items 2 and 5, without processes: nothing accepted silently, outputs belong to their run.

Before any process group: a link fault naming a node the job lacks, ranks per node not dividing N, N too large for
this machine's memory, a malformed graph-mismatch override and a duplicated recipe key are `ConfigError`s naming
the field and the fix. At exit: the graph verdict (`check_graph_match`) and its refusal through `EmulatedRun`; each
summary carries its run id and the `prism run` table shows only that run's summaries.
"""

from __future__ import annotations

import io
import json
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from prism_plugin.cli.main import _summaries_table, main
from prism_plugin.config.emulation import (
    BASE_PROCESS_BYTES,
    BYTES_PER_VIRTUAL_RANK,
    ConfigError,
    EmulationConfig,
    VirtualWorld,
)
from prism_plugin.recipes.load import recipe_from_mapping, recipe_from_yaml
from prism_plugin.recipes.schema import RecipeError
from prism_plugin.runtime import lifecycle
from prism_plugin.runtime.arrivals import (
    DEFAULT_MAX_OUTSIDE_FRACTION,
    GraphMismatchError,
    check_graph_match,
    max_outside_fraction,
)
from prism_plugin.runtime.lifecycle import EmulatedRun, check_memory, write_summary


# -- link faults name existing nodes; ranks per node divide N ------------------------------------------------------
@pytest.mark.parametrize(("world_size", "gpus_per_node", "fault", "error"), [
    (8, 8, "link:nodes=0/5,bandwidth=0.5", r"nodes \[5\] do not exist: the job has 1 node\(s\) \(world_size=8 / "
                                           r"gpus_per_node=8\), numbered 0..0"),
    (16, 8, "link:nodes=0/2,bandwidth=0.5", r"nodes \[2\] do not exist: the job has 2 node"),
    (16, 8, "link:nodes=0/1,bandwidth=0.5", None),
    (8, 8, "link:ranks=0/5,bandwidth=0.5", None),  # ranks, not nodes
    (8, 8, "link:ranks=0/9,bandwidth=0.5", r"ranks \[9\] are outside the job's 0..7"),  # as before
])
def test_link_fault_nodes_are_checked(world_size: int, gpus_per_node: int, fault: str, error: str | None) -> None:
    world = VirtualWorld(world_size=world_size, real_ranks=(0,), gpus_per_node=gpus_per_node)
    if error is None:
        assert EmulationConfig(world=world, faults=(fault,)).faults[0].to_text() == fault
        return
    with pytest.raises(ConfigError, match=error):
        EmulationConfig(world=world, faults=(fault,))


@pytest.mark.parametrize(("world_size", "gpus_per_node", "nodes"), [
    (16, 8, 2), (8, 8, 1), (2, 8, 1), (1, 8, 1), (8192, 8, 1024), (7, 1, 7),
])
def test_ranks_per_node_that_fit_n(world_size: int, gpus_per_node: int, nodes: int) -> None:
    # a job smaller than one node runs on part of it (torchrun --nproc-per-node 2 on an 8-GPU node)
    assert VirtualWorld(world_size=world_size, real_ranks=(0,), gpus_per_node=gpus_per_node).num_nodes == nodes


@pytest.mark.parametrize(("world_size", "gpus_per_node"), [(12, 8), (9, 8), (8194, 8), (10, 4)])
def test_ranks_per_node_not_dividing_n_is_refused(world_size: int, gpus_per_node: int) -> None:
    with pytest.raises(ConfigError, match=rf"^gpus_per_node={gpus_per_node} does not divide world_size={world_size}: "
                                          r".*partial node.*--gpus-per-node"):
        VirtualWorld(world_size=world_size, real_ranks=(0,), gpus_per_node=gpus_per_node)


# -- N too large: an estimate with both figures, before any process group ---------------------------------------------
def test_memory_estimate_is_the_measured_per_rank_cost() -> None:
    world = VirtualWorld(world_size=10**9, real_ranks=(0,))
    assert world.estimated_bytes_per_process == BASE_PROCESS_BYTES + BYTES_PER_VIRTUAL_RANK * 10**9
    assert world.estimated_bytes_per_process == 176_268_435_456
    with pytest.raises(ConfigError, match=r"^world_size=1000000000 needs about 176,268,435,456 bytes \(176.3 GB: 1 "
                                          r"real process\(es\).* but 23,000,000,000 bytes \(23.0 GB\) are available; "
                                          r"emulate fewer ranks"):
        check_memory(world, available_bytes=23 * 10**9)


def test_memory_check_counts_every_real_process_and_is_cheap() -> None:
    world = VirtualWorld(world_size=2**26, real_ranks=(0, 1), gpus_per_node=8)  # 256 MiB + 176 B x 2^26 = 12.1 GB
    assert check_memory(world, 1, available_bytes=13 * 10**9) == world.estimated_bytes_per_process
    with pytest.raises(ConfigError, match=r"2 real process\(es\)"):
        check_memory(world, 2, available_bytes=13 * 10**9)
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError):
        check_memory(VirtualWorld(world_size=10**12, real_ranks=(0,)))  # this machine's own MemAvailable
    elapsed_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed_s < 0.5 and peak < 1_000_000, (elapsed_s, peak)  # nothing proportional to N
    assert lifecycle.available_memory_bytes() is not None  # Linux: /proc/meminfo


def test_cli_refuses_a_world_too_large_before_any_process(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    t0 = time.perf_counter()
    assert main(["run", "--world-size", str(10**12), "--real-ranks", "0", "--output", str(tmp_path / "out"),
                 "--", str(script)]) == 2
    assert time.perf_counter() - t0 < 5.0
    err = " ".join(capsys.readouterr().err.split())
    assert "world_size=1000000000000 needs about 176,000,268,435,456 bytes" in err and "bytes (" in err
    assert "are available" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "error"), [
    (["--world-size", "8", "--fault", "link:nodes=0/5,bandwidth=0.5"], "nodes [5] do not exist"),
    (["--world-size", "12", "--gpus-per-node", "8"], "gpus_per_node=8 does not divide world_size=12"),
])
def test_cli_refuses_bad_nodes_before_any_process(argv: list[str], error: str, capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    assert main(["run", "--real-ranks", "0", *argv, "--", str(tmp_path / "x.py")]) == 2
    assert error in " ".join(capsys.readouterr().err.split())


# -- recipes: duplicated keys, nodes and ranks per node --------------------------------------------------------------
@pytest.mark.parametrize(("text", "error"), [
    ("name: a\nframework: torch\nname: b\n", r"<recipe>:3:1: `name` is given twice in one mapping \(first on line 1\)"),
    ("name: a\nsteps:\n  total: 3\n  total: 4\n", r"<recipe>:4:3: `total` is given twice .*first on line 3"),
    ("name: a\nemulated:\n  - {name: n4, world_size: 4, name: n5}\n", r"<recipe>:3:31: `name` is given twice"),
])
def test_a_duplicated_recipe_key_is_an_error(text: str, error: str) -> None:
    with pytest.raises(RecipeError, match=error):
        recipe_from_yaml(text)


def _recipe(**emulation: Any) -> dict[str, Any]:
    return {"name": "r", "framework": "torch", "model": {"hidden_size": 64, "micro_batch_size": 4},
            "layout": {"tp": 2}, "steps": {"total": 4, "warmup": 1}, "real": {"world_size": 2},
            "emulated": [{"name": "n", "runs": [[0]], "ranks": [[0, 0]], "profile": "local-cpu-gloo",
                          **emulation}]}


@pytest.mark.parametrize(("emulation", "error"), [
    ({"world_size": 12, "gpus_per_node": 8}, r"emulated\[n\]: gpus_per_node=8 does not divide world_size=12"),
    ({"world_size": 8, "faults": ["link:nodes=0/5,bandwidth=0.5"]}, r"emulated\[n\].faults: .*nodes \[5\] do not"),
])
def test_recipe_emulations_check_nodes(emulation: dict[str, Any], error: str) -> None:
    with pytest.raises(RecipeError, match=error):
        recipe_from_mapping(_recipe(**emulation))
    assert recipe_from_mapping(_recipe(world_size=16, faults=["link:nodes=0/1,bandwidth=0.5"])).emulated[0].faults


# -- the graph verdict ----------------------------------------------------------------------------------------------
def _graph(replayed: int, not_in: int, kind: int, before: int) -> dict[str, Any]:
    return {"path": "job.graph", "ops_replayed": replayed, "ops_not_in_graph": not_in, "ops_kind_mismatch": kind,
            "ops_before_first_mark": before}


@pytest.mark.parametrize(("graph", "limit", "verdict", "reason"), [
    (_graph(2, 6, 2, 1), 0.1, "refused",
     r"^8 of the 10 ops after the first iteration mark were outside the graph \(6 not in it, 2 of another kind\), "
     r"more than 10%.*PRISM_GRAPH_MAX_OUTSIDE=1"),
    (_graph(23 * 16, 1, 0, 16), 0.1, "ok", None),  # integration_tests/graph/test_pipeline_validation.py's figures
    (_graph(9, 1, 0, 0), 0.1, "ok", None),  # exactly 10%: accepted
    (_graph(8, 1, 1, 0), 0.1, "refused", r"^2 of the 10 ops"),
    (_graph(2, 6, 2, 1), 1.0, "ok", None),  # relaxed
    (_graph(0, 0, 0, 7), 1.0, "refused", r"^none of the 7 ops .* came after an iteration mark"),
    (_graph(0, 0, 0, 0), 0.1, "ok", None),  # no op on a group with a virtual member: nothing to judge
])
def test_graph_match_verdict(graph: dict[str, Any], limit: float, verdict: str, reason: str | None) -> None:
    out = check_graph_match(graph, limit)
    assert out["verdict"] == verdict and out["max_outside_fraction"] == limit
    total = graph["ops_replayed"] + graph["ops_not_in_graph"] + graph["ops_kind_mismatch"]
    assert out["ops_after_first_mark"] == total
    assert out["ops_outside_graph"] == graph["ops_not_in_graph"] + graph["ops_kind_mismatch"]
    if reason is None:
        assert "reason" not in out
    else:
        assert re.search(reason, out["reason"]), out["reason"]


@pytest.mark.parametrize(("text", "value"), [(None, DEFAULT_MAX_OUTSIDE_FRACTION), ("", 0.1), ("0.5", 0.5),
                                             ("1", 1.0), ("0", 0.0), ("2", None), ("-0.1", None), ("half", None)])
def test_graph_mismatch_override(text: str | None, value: float | None) -> None:
    env = {} if text is None else {"PRISM_GRAPH_MAX_OUTSIDE": text}
    if value is None:
        with pytest.raises(ConfigError, match=r"^PRISM_GRAPH_MAX_OUTSIDE=.* must be a fraction in \[0, 1\]"):
            max_outside_fraction(env)
    else:
        assert max_outside_fraction(env) == value


@pytest.fixture
def graph_session(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The session replaced by a fake whose summary holds the given `graph` block."""
    from prism_plugin.runtime import session as session_mod

    state: dict[str, Any] = {"graph": _graph(2, 6, 2, 1)}
    monkeypatch.setattr(session_mod, "activate", lambda *a, **k: object())
    monkeypatch.setattr(session_mod, "deactivate", lambda: {"rank": 0, "world_size": 2, "graph": dict(state["graph"])})
    monkeypatch.delenv("PRISM_GRAPH_MAX_OUTSIDE", raising=False)
    return state


def _graph_run(tmp_path: Path) -> EmulatedRun:
    (tmp_path / "job.graph").write_text("{}")
    config = EmulationConfig(world=VirtualWorld(world_size=2, real_ranks=(0,)), graph=tmp_path / "job.graph",
                             output_dir=tmp_path / "out")
    return EmulatedRun(config, 0, None, print_summary=False)


def test_a_run_whose_ops_are_not_the_graphs_is_refused_after_its_summary(graph_session: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    run = _graph_run(tmp_path)
    run.start()
    with pytest.raises(GraphMismatchError, match=r"does not match the program: 8 of the 10 ops"), run:
        pass
    written = json.loads((tmp_path / "out" / "rank0.summary.json").read_text())
    assert written == run.summary and written["exit_code"] == 0
    assert written["graph_check"]["verdict"] == "refused" and written["graph_check"]["ops_outside_graph"] == 8
    assert written["error"].startswith("GraphMismatchError: the execution graph job.graph does not match")


def test_a_failed_program_keeps_its_own_error(graph_session: dict[str, Any], tmp_path: Path) -> None:
    run = _graph_run(tmp_path)
    run.start()
    with pytest.raises(ValueError, match="boom"), run:
        raise ValueError("boom")
    assert run.summary is not None and run.summary["error"] == "ValueError: boom"
    assert run.summary["graph_check"]["verdict"] == "refused"  # still reported


@pytest.mark.parametrize(("env", "graph", "verdict"), [
    ({"PRISM_GRAPH_MAX_OUTSIDE": "1"}, _graph(2, 6, 2, 1), "ok"),
    ({}, _graph(30, 1, 0, 3), "ok"),
])
def test_a_matching_or_relaxed_graph_run_passes(graph_session: dict[str, Any], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                graph: dict[str, Any], verdict: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    graph_session["graph"] = graph
    run = _graph_run(tmp_path)
    run.start()
    with run:
        pass
    assert run.summary is not None and run.summary["graph_check"]["verdict"] == verdict and "error" not in run.summary


def test_a_malformed_override_fails_before_any_process_group(graph_session: dict[str, Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_GRAPH_MAX_OUTSIDE", "lots")
    run = _graph_run(tmp_path)
    with pytest.raises(ConfigError, match="PRISM_GRAPH_MAX_OUTSIDE='lots'"):
        run.start()
    assert run.session is None


# -- outputs belong to their run ------------------------------------------------------------------------------------
def test_summaries_carry_the_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PRISM_RUN_ID", "abc")
    summary = {"rank": 1}
    path = write_summary(summary, tmp_path)
    assert path is not None and json.loads(path.read_text()) == {"rank": 1, "run_id": "abc"}
    assert summary == {"rank": 1}  # the caller's mapping is not changed
    assert json.loads(capsys.readouterr().out.split(" ", 1)[1]) == {"rank": 1, "run_id": "abc"}
    own = write_summary({"rank": 2, "run_id": "own"}, tmp_path, stdout=False)
    assert own is not None and json.loads(own.read_text())["run_id"] == "own"


def _summary(rank: int, run_id: str | None, **extra: Any) -> dict[str, Any]:
    s = {"rank": rank, "world_size": 16, "profile": "dgx-h100", "data_policy": "mirror", "groups_created": 3,
         "op_counts": {"all_reduce": rank + 1}, "op_bytes": {"all_reduce": 64}, "modelled_comm_s": 0.001,
         "arrivals_note": f"note of {run_id}", **extra}
    if run_id is not None:
        s["run_id"] = run_id
    return s


def _render(table: Any) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_the_table_shows_only_this_runs_summaries(tmp_path: Path) -> None:
    for s in (_summary(0, "mine"), _summary(10, "mine", graph=_graph(2, 6, 2, 1),
                                                           graph_check=check_graph_match(_graph(2, 6, 2, 1), 0.1)),
              _summary(5, "other"), _summary(7, None),
              {"rank": 3, "world_size": 16, "real_ranks": [3], "emulated": False, "exit_code": 0, "run_id": "mine",
               "note": "the program never called torch.distributed.init_process_group: nothing was emulated"}):
        (tmp_path / f"rank{s['rank']}.summary.json").write_text(json.dumps(s))
    (tmp_path / "rank9.summary.json").write_text('{"rank": ')  # being written by a concurrent run
    text = _render(_summaries_table(tmp_path, "mine", (0, 3, 10, 12)))
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert rows == ["0", "3", "10"]  # this run's ranks in rank order (not "10" before "3")
    assert "note of mine" in text and "note of other" not in text
    assert "rank 3: the program never called torch.distributed.init_process_group" in text
    assert ("rank 10: graph: 2 ops replayed, 8 outside the graph (6 not in it, 2 of another kind), 1 before the "
            "first iteration mark; REFUSED: 8 of the 10 ops") in " ".join(text.split())
    assert "no summary of this run from real rank(s) [12]" in text
    assert _summaries_table(tmp_path, "a-failed-run", (0,)) is None  # a failed run shows no older run's table
    everything = _render(_summaries_table(tmp_path))
    assert all(f"│ {r:>4} │" in everything for r in (0, 3, 5, 7, 10))
