"""Python packages that Megatron's GPU jobs import and this host's Python cannot take into site-packages.

``emerging-optimizers`` (NVIDIA's, the package behind megatron-core's ``--optimizer muon`` / ``dist_muon`` and its
other emerging optimizers) is pure Python but declares Python >= 3.12, and its modules import ``typing.override``
(new in 3.12). Installed into this 3.11 environment's site-packages, it would break every import of
``megatron.core.optimizer`` (megatron-core probes it by its installed version and then imports it, catching no
error). So ``scripts/setup_env.sh`` installs it into a private folder (`packages_path`), and a virtual-GPU process
puts that folder on ``sys.path`` (`install`, beside TE's), with ``typing.override`` given on Python 3.11 as
``typing_extensions`` gives it (the decorator sets ``__override__`` and returns its argument, as 3.12's does). A
CPU run of the same job (a paired real run on gloo) does not see the folder: there Megatron says what it says on
any host without the package.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

__all__ = ["EMERGING_OPTIMIZERS_VERSION", "install", "packages_path"]

EMERGING_OPTIMIZERS_VERSION = "0.3.0"
"""The emerging-optimizers release virtual GPUs run (megatron-core 0.19 needs >= 0.2)."""

_ENV = "PRISM_GPU_PACKAGES_PATH"


def packages_path() -> Path:
    """``$PRISM_GPU_PACKAGES_PATH``, else ``<sys.prefix>/share/prism_plugin/gpu-packages`` (where
    ``scripts/setup_env.sh`` installs them)."""
    named = os.environ.get(_ENV)
    return Path(named) if named else Path(sys.prefix) / "share" / "prism_plugin" / "gpu-packages"


def install() -> bool:
    """Put `packages_path` on ``sys.path`` when it holds a package (True), with ``typing.override`` on Python 3.11.
    Call before the program imports Megatron; idempotent."""
    folder = packages_path()
    if not any(folder.glob("*.dist-info")):
        return False
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return True
