"""The startup hook: stock DeepSpeed honours a ds_config's ``"prism"`` section, with no edit to the script.

``scripts/setup_env.sh`` installs ``prism_plugin_startup.pth`` into the environment's site-packages; Python runs
its one line, ``import prism_plugin.startup``, when any interpreter of the environment starts. This module
imports nothing but the standard library: it registers an import hook that acts only when ``deepspeed`` (or
``transformers``) is imported. Then the DeepSpeed adapter (`prism_plugin.adapters.deepspeed.startup`) wraps
DeepSpeed's entry points so that they call `prism_plugin.deepspeed.maybe_init_distributed` before DeepSpeed starts
communication, as ``patches/deepspeed-0.19.8`` does inside DeepSpeed:

- ``deepspeed.initialize(args=..., config=... | config_params=...)``: the config it is given (or
  ``args.deepspeed_config``);
- ``deepspeed.init_distributed(config=None, ...)`` (also ``deepspeed.comm.init_distributed``, which
  ``initialize`` calls): its config, else the file ``PRISM_DEEPSPEED_CONFIG`` names, else a JSON file given on the
  command line after ``--deepspeed`` (Hugging Face Trainer / Accelerate), ``--deepspeed_config``,
  ``--deepspeed-config``, ``--ds_config``, ``--ds-config`` or ``--config``, if it holds a ``"prism"`` section.
  That is how a launcher's script that sets up communication before ``initialize`` (Accelerate, a
  ``PipelineModule``) gets the section.

A launched script (``RANK`` set) whose command-line ds_config asks for ``"device": "virtual-gpu"`` starts on the
virtual GPU as soon as it imports ``transformers`` (the Hugging Face Trainer checks the host's devices, ``--bf16``,
before Accelerate calls ``init_distributed``).

Without a section, or with the emulation already active (the script called ``prism_plugin.deepspeed.
init_distributed`` itself), DeepSpeed runs as released. A DeepSpeed carrying the native patch (its
``deepspeed.comm.comm._prism_hook``) is left alone. So ``deepspeed train.py --deepspeed_config ds.json`` and
``python train.py --deepspeed ds.json`` emulate from the section alone.

Limitation: only interpreters of the environment setup installed the ``.pth`` into; a script started by another
Python needs the one-line drop-in or the patch.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["install"]


def _patch(deepspeed: ModuleType) -> None:
    """DeepSpeed was just imported: its entry points read the section (the adapter's half)."""
    from prism_plugin.adapters.deepspeed.startup import patch

    patch(deepspeed)


def _early(transformers: ModuleType) -> None:
    """``transformers`` was just imported: a launched Trainer script asking for virtual GPUs starts on one now,
    before ``TrainingArguments`` checks this host's devices (the adapter's half)."""
    from prism_plugin.adapters.deepspeed.startup import start_virtual_gpu_early

    start_virtual_gpu_early()


_AFTER_IMPORT = {"deepspeed": _patch, "transformers": _early}
"""What runs when each of these modules has just been imported."""


class _Loader:
    """Runs a module's own loader, then its `_AFTER_IMPORT` call (the loader protocol, without importing
    ``importlib.abc``: this module loads in every interpreter of the environment, so it imports little)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _AFTER_IMPORT[module.__name__](module)


class _Finder:
    """Finds `_AFTER_IMPORT`'s modules through the other finders and gives their specs `_Loader` (a meta path
    finder)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register the hook (once); a ``deepspeed`` imported already is patched now."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        _patch(sys.modules["deepspeed"])
        return
    sys.meta_path.insert(0, _Finder())


install()
