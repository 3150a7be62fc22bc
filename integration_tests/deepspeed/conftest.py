"""The DeepSpeed integration tests: their jobs run in the session's shared `cluster` (integration_tests/conftest.py).

Each job brings up its own world (`Cluster.run_jobs`, a BARE setup of the same worker processes);
this folder goes on sys.path so that the tests and the workers import ds_programs / ds_grid_programs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("deepspeed", reason="deepspeed is not installed (extra: deepspeed)")
