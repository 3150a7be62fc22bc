"""The worker pool itself: reuse, fast failure instead of hangs, recovery, clean exit.

(The clean exit of the session's pool is asserted by the `cluster` fixture at the end of the
session: every worker must exit with code 0.)
"""

from __future__ import annotations

import time

import programs as prog
import pytest
from harness import Cluster, Mode, Setup, WorkerError, WorkerTimeout

pytestmark = pytest.mark.slow


def test_setups_reuse_processes(cluster) -> None:
    before = cluster.spawned
    info = cluster.run(Setup(mode=Mode.GLOO, world_size=2), prog.session_info)
    assert {r: (i["rank"], i["world_size"], i["backend"]) for r, i in info.items()} == {
        0: (0, 2, "gloo"), 1: (1, 2, "gloo")}
    info = cluster.run(Setup(mode=Mode.PRISM, world_size=16, real_ranks=(5, 11)), prog.session_info)
    assert {r: (i["rank"], i["world_size"], i["backend"]) for r, i in info.items()} == {
        5: (5, 16, "gloo"), 11: (11, 16, "gloo")}  # prism emulates gloo, the backend asked for
    assert cluster.spawned - before <= 2  # at most the workers not started yet


def test_worker_error_fails_fast_with_traceback(cluster) -> None:
    # rank 1 raises; rank 0 waits in a barrier rank 1 never joins (it would hang until the gloo
    # timeout of 30 s): the pool reports rank 1's traceback after its 5 s grace instead
    start = time.monotonic()
    with pytest.raises(WorkerError, match="deliberate failure on rank 1"):
        cluster.run(Setup(mode=Mode.GLOO, world_size=2), prog.fail_on_rank, rank=1)
    assert time.monotonic() - start < cluster.error_grace_s + 10
    assert cluster.current is None  # the workers were killed; the next use respawns them


def test_hang_times_out(cluster) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeout):
        cluster.run(Setup(mode=Mode.PRISM, real_ranks=(0,)), prog.sleep_then, case_timeout_s=1.0, seconds=30.0)
    assert time.monotonic() - start < 10


def test_recovers_after_failures(cluster) -> None:
    spawned = cluster.spawned
    per_rank = cluster.run(Setup(mode=Mode.PRISM, real_ranks=(0, 3), groups=prog.standard_groups()),
                           prog.collective, op="all_reduce.SUM", family="world")
    assert per_rank[0]["member"] and per_rank[3]["member"]
    assert cluster.spawned - spawned <= 2


def test_close_reports_clean_exit(tmp_path) -> None:
    pool = Cluster(tmp_path, max_workers=1)
    assert pool.run(Setup(mode=Mode.PRISM, real_ranks=(2,)), prog.session_info)[2]["rank"] == 2
    assert pool.close() == [0]
