"""Shared by the emulated tests: the device library that virtual-GPU child programs preload (`library`), and
`children.run_child`, which runs one such program and returns the JSON it printed after ``RESULT ``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def library() -> None:
    """Build (or find cached) the fake CUDA runtime library once per session."""
    subprocess.run([sys.executable, "-m", "prism_plugin.device.cuda_runtime"], check=True,
                   capture_output=True, timeout=600)
