"""The DeepSpeed half of the startup hook (`prism_plugin.startup`): DeepSpeed's entry points read the section.

`patch(deepspeed)` runs once ``deepspeed`` is imported in an interpreter of the environment (see
`prism_plugin.startup`, which loads this module only then). It wraps ``deepspeed.initialize`` and
``init_distributed`` (``deepspeed``, ``deepspeed.comm`` and ``deepspeed.comm.comm``'s names) so that each calls
`prism_plugin.adapters.deepspeed.runtime.maybe_init_distributed` first, as ``patches/deepspeed-0.19.8`` does
inside DeepSpeed; the config comes from the call, else ``PRISM_DEEPSPEED_CONFIG``, else the command line
(`argv_config`). A DeepSpeed carrying the native patch is left alone.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["ARGV_CONFIG_FLAGS", "argv_config", "patch", "start_virtual_gpu_early"]

ARGV_CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config", "--ds_config", "--ds-config",
                     "--config")
"""Command-line flags whose value may be the ds_config file (the first holding a "prism" section is taken)."""


def argv_config(argv: Sequence[str]) -> str | None:
    """The first JSON file named after one of `ARGV_CONFIG_FLAGS` in `argv` that has a ``"prism"`` key, or None.

    >>> argv_config(["train.py", "--deepspeed"]) is None  # DeepSpeed's own --deepspeed is a switch
    True
    """
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in ARGV_CONFIG_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(argv):
                continue
            value = argv[i + 1]
        if value.endswith(".json") and os.path.isfile(value) and _has_section(value):
            return value
    return None


def _has_section(path: str) -> bool:
    import json

    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "prism" in data


def _hook(config: Any) -> bool:
    """`maybe_init_distributed` for `config` (None: the environment's file, else the command line's)."""
    if config is None:
        config = os.environ.get("PRISM_DEEPSPEED_CONFIG") or argv_config(sys.argv)
    if config is None:
        return False
    import torch.distributed as dist

    from prism_plugin.adapters.deepspeed.runtime import active, maybe_init_distributed

    if active() is not None:  # the script (or an earlier call) started the emulation: DeepSpeed goes on as usual
        return False
    if dist.is_available() and dist.is_initialized():
        # the job set its process group up itself (a real run of every rank): the section cannot apply any more
        if _names_section(config):
            print('prism: torch.distributed was initialised before DeepSpeed read the "prism" section, so this run '
                  "is not emulated; let DeepSpeed initialise communication (deepspeed.init_distributed / "
                  "initialize), or call prism_plugin.deepspeed.init_distributed(config) first",
                  file=sys.stderr, flush=True)
        return False
    return maybe_init_distributed(config)


def start_virtual_gpu_early() -> None:
    """A launched script (``RANK`` set) whose command line names a ds_config with ``"device": "virtual-gpu"`` in its
    "prism" section starts on the virtual GPU now (`_hook`: it re-executes), not at ``init_distributed``. Called
    when ``transformers`` is imported: the Hugging Face Trainer's ``TrainingArguments`` checks the host's devices
    (``--bf16``: "Your setup doesn't support bf16/gpu") before Accelerate calls ``init_distributed``. Anything else
    is left to DeepSpeed's entry points."""
    from prism_plugin.adapters.deepspeed.virtual_gpu import ENTRY_ENV

    if os.environ.get(ENTRY_ENV) or "RANK" not in os.environ or "PRISM_CONFIG" in os.environ:
        return
    path = os.environ.get("PRISM_DEEPSPEED_CONFIG") or argv_config(sys.argv)
    if path is None:
        return
    import json

    with open(path) as fh:
        section = json.load(fh).get("prism")
    if isinstance(section, dict) and section.get("device") == "virtual-gpu":
        _hook(path)


def _names_section(config: Any) -> bool:
    """Whether `config` (a mapping, a ``DeepSpeedConfig``, or a path) has a "prism" section."""
    param_dict = getattr(config, "_param_dict", None)
    if isinstance(param_dict, dict):
        config = param_dict
    if isinstance(config, dict):
        return "prism" in config
    return isinstance(config, str | os.PathLike) and os.path.isfile(config) and _has_section(str(config))


def _wrap_init_distributed(original: Any) -> Any:
    @functools.wraps(original)
    def init_distributed(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config")
        if _hook(config):  # the emulation set DeepSpeed's communication up (as the patch's hook does)
            if hasattr(config, "comms_config"):
                from deepspeed.comm import comm

                comm.configure(deepspeed_config=config)
            return None
        return original(*args, **kwargs)

    init_distributed.__prism_startup__ = True  # type: ignore[attr-defined]
    return init_distributed


def _wrap_initialize(original: Any) -> Any:
    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config")
        if config is None:
            config = kwargs.get("config_params")
        if config is None:
            config = getattr(kwargs.get("args", args[0] if args else None), "deepspeed_config", None)
        _hook(config)
        return original(*args, **kwargs)

    initialize.__prism_startup__ = True  # type: ignore[attr-defined]
    return initialize


def patch(deepspeed: ModuleType) -> None:
    """Wrap the entry points of an imported ``deepspeed`` (unless it carries the native patch)."""
    from deepspeed import comm
    from deepspeed.comm import comm as comm_module

    if hasattr(comm_module, "_prism_hook") or getattr(deepspeed.initialize, "__prism_startup__", False):
        return
    deepspeed.initialize = _wrap_initialize(deepspeed.initialize)
    wrapped = _wrap_init_distributed(comm_module.init_distributed)
    for owner in (deepspeed, comm, comm_module):
        if hasattr(owner, "init_distributed"):
            owner.init_distributed = wrapped
