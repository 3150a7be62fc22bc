"""Shared fixtures of the integration suite: ONE pool of at most 4 worker processes for the session.

Every multi-process test runs its programs through `cluster` (see harness.py): the workers are
spawned once and re-configured between setups (a plain gloo world of 4, or prism with 1-4 real
ranks), so the whole suite starts a handful of processes on this 2-core machine. At the end of the
session the workers are asked to exit; a worker that does not exit cleanly fails the session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    pool = Cluster(tmp_path_factory.mktemp("cluster"), max_workers=4)
    yield pool
    codes = pool.close()
    assert all(code == 0 for code in codes), f"workers did not exit cleanly: exit codes {codes}"
