"""How a virtual-GPU process keeps time: the virtual-time settings, parsed and checked (pure).

They reach each rank as environment variables (``PRISM_VIRTUAL_TIME``, ``PRISM_KERNEL_MODEL``, ``PRISM_KERNEL_TABLE``,
``PRISM_KERNEL_FIT``, ``PRISM_PROGRAM_TIME``; `prism run` and `prism emulate` set them from their flags), and a
launcher checks them with `VirtualTimeOptions.from_env` before any process starts, naming each as its entry point
spells it. The rank process starts its virtual time from the same options
(`prism_plugin.runtime.device_session.start_virtual_time`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TIME_VARIABLES", "VirtualTimeOptions"]

TIME_VARIABLES = ("PRISM_VIRTUAL_TIME", "PRISM_KERNEL_MODEL", "PRISM_KERNEL_TABLE", "PRISM_KERNEL_FIT",
                  "PRISM_PROGRAM_TIME", "PRISM_FAST_FORWARD")
"""The variables `VirtualTimeOptions.from_env` reads (besides CUDA's own ``CUDA_LAUNCH_BLOCKING``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VirtualTimeOptions:
    """How a virtual-GPU process keeps time, from its environment (`from_env`; the CLI sets these variables).

    ``PRISM_VIRTUAL_TIME``: ``on`` (the default: modelled kernel and communication time on emulated streams) or
    ``off`` (memory only: nothing takes time, step time is not modelled); ``PRISM_KERNEL_MODEL``: ``roofline``
    (the default), ``table`` with ``PRISM_KERNEL_TABLE`` (a table `prism kernels record` wrote) or ``fit`` with
    ``PRISM_KERNEL_FIT`` (an overlay `prism kernels fit` wrote);
    ``PRISM_PROGRAM_TIME``: ``wall`` (the default) or ``emulated`` (the program's ``time.time`` /
    ``perf_counter`` / ``monotonic`` read the emulated host clock, so its own logs print emulated figures);
    ``CUDA_LAUNCH_BLOCKING=1`` (CUDA's own meaning): each launch, kernel or collective, returns to the host only
    when its work has ended, as every op does on a CPU (the clock of `prism kernels record`'s CPU check).
    """

    enabled: bool = True
    kernel_model: str = "roofline"
    kernel_table: Path | None = None
    kernel_fit: Path | None = None
    program_time: bool = False
    launch_blocking: bool = False
    fast_forward: bool = True
    """``PRISM_FAST_FORWARD``: ``on`` (the default) or ``off``: a framework adapter fast-forwards proven repeated work
    (`prism_plugin.device.fast_forward`)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VirtualTimeOptions:
        """The options of `environ` (default ``os.environ``), read by the settings table's parsers and checked
        together by its one validator (`prism_plugin.config.resolve`): a `ConfigError` naming the variable and
        saying the fix."""
        from prism_plugin.config.resolve import resolve
        from prism_plugin.config.settings import Entry

        env = os.environ if environ is None else environ
        time = resolve({"world_size": 1, "real_ranks": [0], "gpus_per_node": 1}, Entry.ENVIRONMENT,
                       environ={name: env[name] for name in TIME_VARIABLES if name in env}).time
        return cls(enabled=time.virtual_time, kernel_model=time.kernel_model, kernel_table=time.kernel_table,
                   kernel_fit=time.kernel_fit, program_time=time.program_time == "emulated",
                   launch_blocking=env.get("CUDA_LAUNCH_BLOCKING", "0") == "1", fast_forward=time.fast_forward)
