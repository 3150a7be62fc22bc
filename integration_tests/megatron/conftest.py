"""Fixtures of the Megatron-core integration tests: their own pool of at most 4 worker processes.

The Megatron adapter installs process-wide seams (the CPU shim's TorchFunctionMode, patched
``torch.cuda`` functions, Megatron's parallel state) in the workers; each case undoes them, but
this pool is kept apart from the backend suite's pool anyway, so a failing Megatron case can never
leak into a conformance test. Workers import megatron.core once (~6 s each) and are reused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Cluster  # noqa: E402

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")


@pytest.fixture(scope="session")
def mcluster(tmp_path_factory: pytest.TempPathFactory):
    pool = Cluster(tmp_path_factory.mktemp("mcluster"), max_workers=4, timeout_s=240.0, spawn_timeout_s=240.0)
    yield pool
    codes = pool.close()
    assert all(code == 0 for code in codes), f"workers did not exit cleanly: exit codes {codes}"
