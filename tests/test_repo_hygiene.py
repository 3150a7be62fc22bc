"""Repository rules the test collection depends on."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    """tests/ and integration_tests/ have no __init__.py: pytest imports each test module by its basename,
    so two files with one name in different folders stop the whole collection ("import file mismatch")."""
    names = Counter(p.name for d in ("tests", "integration_tests") for p in (ROOT / d).rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]
