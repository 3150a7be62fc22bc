"""Which model computed a row: prism's version and commit, and a fingerprint of the kernel and cost models.

The fingerprint is a hash of the files that turn a program into predicted time and memory (`MODEL_FILES`): the
cost layer (kernel, collective, allocator and storage models, GPU specs, hardware profiles), the virtual GPU's
kernel accounting (what each op costs, fusion, CUDA graphs, the emulated clocks and TransformerEngine's fake
kernels) and comm (what each collective costs and writes). Any edit
to one of them changes it, and every row computed before is stale until it runs again. Files outside it
(adapters, the graph, the CLI) can move a prediction too; the commit names them.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

__all__ = ["MODEL_FILES", "ROOT", "model_fingerprint", "model_files", "prism_commit", "prism_version"]

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILES = ("prism_plugin/cost/*.py", "prism_plugin/cost/profiles/*.yaml", "prism_plugin/device/kernels.py",
               "prism_plugin/device/fusion.py", "prism_plugin/device/clock.py", "prism_plugin/device/op_clock.py",
               "prism_plugin/device/kernel_timer.py", "prism_plugin/device/step_kernels.py",
               "prism_plugin/device/calls.py", "prism_plugin/device/graphs.py", "prism_plugin/device/te/*.py",
               "prism_plugin/comm/*.py")
"""Globs, relative to the repository root, of the files the fingerprint covers."""


def model_files(root: Path = ROOT) -> list[Path]:
    """The files `MODEL_FILES` names under ``root``, sorted by path."""
    return sorted({p for pattern in MODEL_FILES for p in root.glob(pattern) if p.is_file()})


def model_fingerprint(root: Path = ROOT) -> str:
    """12 hex digits of SHA-256 over each model file's path and bytes."""
    digest = hashlib.sha256()
    for path in model_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def prism_version() -> str:
    from prism_plugin import __version__

    return __version__


def prism_commit(root: Path = ROOT) -> str:
    """The checkout's commit (12 digits, ``+dirty`` when the model files have uncommitted edits), or ``unknown``."""
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *MODEL_FILES],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")
