"""Fixtures of the DeepSpeed integration tests: ONE pool of at most 4 reusable workers per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_pool import Pool  # noqa: E402


@pytest.fixture(scope="session")
def ds_pool(tmp_path_factory: pytest.TempPathFactory):
    pool = Pool(tmp_path_factory.mktemp("ds_pool"), max_workers=4)
    yield pool
    codes = pool.close()
    assert all(code == 0 for code in codes), f"DeepSpeed workers did not exit cleanly: exit codes {codes}"
