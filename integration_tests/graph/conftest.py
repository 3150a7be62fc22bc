"""The graph validation tests: this folder on sys.path, so both test modules import `graph_checks`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
