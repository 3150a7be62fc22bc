"""Child programs on virtual GPUs: the device library must load before torch, so each case runs in a fresh
interpreter that prints its figures as one ``RESULT {json}`` line (and ``"error"`` when it raised)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping

__all__ = ["program", "run_child"]


def program(prelude: str, body: str, epilogue: str) -> str:
    """`body` indented into the ``try:`` that `prelude` opens and `epilogue` closes."""
    return prelude + textwrap.indent(textwrap.dedent(body), "    ") + epilogue


def run_child(source: str, *, env: Mapping[str, str] | None = None, allow_error: bool = False) -> dict:
    """Run `source` with this interpreter; the last ``RESULT`` line's JSON. Fails the test with the child's output
    when it printed none, or when it reported an error and `allow_error` is false."""
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300,
                          env=None if env is None else dict(env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert allow_error or "error" not in result, proc.stderr[-4000:]
    return result
