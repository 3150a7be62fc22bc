"""Shared fixtures of the integration suite: ONE pool of at most 4 worker processes for the session.

Every multi-process test runs its programs through `cluster` (see harness.py): the workers are
spawned once and re-configured between setups (a plain gloo world of 4, or prism with 1-4 real
ranks, or bare workers for DeepSpeed jobs that bring their own world: `Cluster.run_jobs`), so the whole
suite starts a handful of processes on this 2-core machine. At the end of the session the workers are
asked to exit; a worker that does not exit cleanly fails the session, and so does a pool that started
more processes than its kills explain (workers are respawned only after a kill, never per test).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cluster  # noqa: E402

_POOL_STATS = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config):
    pool = Cluster(tmp_path_factory.mktemp("cluster"), max_workers=4)
    yield pool
    pytestconfig.stash[_POOL_STATS] = (f"cluster: {pool.spawned} worker processes started, {pool.setups} setups, "
                                       f"{pool.kills} kills")
    codes = pool.close()
    assert all(code == 0 for code in codes), f"workers did not exit cleanly: exit codes {codes}"
    assert pool.spawned <= pool.max_workers * (1 + pool.kills), (
        f"{pool.spawned} workers started for {pool.kills} kills: processes are not being reused")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """One line on how much the session's pool reused its processes."""
    if _POOL_STATS in config.stash:
        terminalreporter.write_line(config.stash[_POOL_STATS])
