"""Python packages that Megatron's GPU jobs import and this host's Python cannot take into site-packages.

``emerging-optimizers`` (NVIDIA's, the package behind megatron-core's ``--optimizer muon`` / ``dist_muon`` and its
other emerging optimizers) is pure Python but declares Python >= 3.12, and its modules import ``typing.override``
(new in 3.12). Installed into this 3.11 environment's site-packages, it would break every import of
``megatron.core.optimizer`` (megatron-core probes it by its installed version and then imports it, catching no
error). So ``scripts/setup_env.sh`` installs it into a private folder (`packages_path`), and a virtual-GPU process
puts that folder on ``sys.path`` when the job asks for one of its optimizers (`install`, beside TE's), with
``typing.override`` given on Python 3.11 as ``typing_extensions`` gives it (the decorator sets ``__override__``
and returns its argument, as 3.12's does). A CPU run of the same job (a paired real run on gloo) does not see the
folder: there Megatron says what it says on any host without the package.
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

__all__ = ["EMERGING_OPTIMIZERS", "EMERGING_OPTIMIZERS_VERSION", "install", "packages_path", "wanted"]

EMERGING_OPTIMIZERS_VERSION = "0.3.0"
"""The emerging-optimizers release virtual GPUs run (megatron-core 0.19 needs >= 0.2)."""

_ENV = "PRISM_GPU_PACKAGES_PATH"


def packages_path() -> Path:
    """``$PRISM_GPU_PACKAGES_PATH``, else ``<sys.prefix>/share/prism_plugin/gpu-packages`` (where
    ``scripts/setup_env.sh`` installs them)."""
    named = os.environ.get(_ENV)
    return Path(named) if named else Path(sys.prefix) / "share" / "prism_plugin" / "gpu-packages"


EMERGING_OPTIMIZERS = frozenset({"muon", "dist_muon", "lion", "soap", "adaptive_muon"})
"""Megatron's ``--optimizer`` choices that come from emerging-optimizers (its own are adam and sgd)."""


def wanted(argv: Sequence[str]) -> bool:
    """Whether the program's arguments ask for an optimizer of emerging-optimizers (``--optimizer muon``, or
    ``--optimizer=muon``).

    >>> wanted(["pretrain_gpt.py", "--optimizer", "muon"]), wanted(["x", "--optimizer=adam"]), wanted(["x"])
    (True, False, False)
    """
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--optimizer=") else (
            argv[i + 1] if arg == "--optimizer" and i + 1 < len(argv) else None)
        if value in EMERGING_OPTIMIZERS:
            return True
    return False


def install(argv: Sequence[str] | None = None) -> bool:
    """Put `packages_path` on ``sys.path`` (True), with ``typing.override`` on Python 3.11, when it holds a package
    and the program asks for one of its optimizers (`wanted`; `argv`: ``sys.argv``). Call before the program imports
    Megatron; idempotent.

    Only then: a megatron-core that finds emerging-optimizers imports it with ``megatron.core``, and its registry's
    first ``absl.logging.debug`` call configures the root logger (``logging.basicConfig()``, stderr at WARNING)
    before Megatron's training module configures its own (INFO, stdout): Megatron's INFO logs (its timers) then go
    unprinted, on a GPU host with the package as here. A job that does not use the package keeps Megatron's
    logging as on a host without it."""
    folder = packages_path()
    if not any(folder.glob("*.dist-info")) or not wanted(sys.argv if argv is None else argv):
        return False
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return True
