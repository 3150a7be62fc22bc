"""How a virtual-GPU process keeps time: the virtual-time settings, parsed and checked (pure).

They reach each rank as environment variables (``PRISM_VIRTUAL_TIME``, ``PRISM_KERNEL_MODEL``, ``PRISM_KERNEL_TABLE``,
``PRISM_KERNEL_FIT``, ``PRISM_PROGRAM_TIME``; `prism run` and `prism emulate` set them from their flags), and a
launcher checks them with `VirtualTimeOptions.from_env` before any process starts, naming each as its entry point
spells it. The rank process starts its virtual time from the same options
(`prism_plugin.runtime.virtual_gpu.session.start_virtual_time`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prism_plugin.config.errors import ConfigError

__all__ = ["TIME_VARIABLES", "VirtualTimeOptions"]

TIME_VARIABLES = ("PRISM_VIRTUAL_TIME", "PRISM_KERNEL_MODEL", "PRISM_KERNEL_TABLE", "PRISM_KERNEL_FIT",
                  "PRISM_PROGRAM_TIME")
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 names: Mapping[str, str] | None = None) -> VirtualTimeOptions:
        """The options of `environ` (default ``os.environ``); a `ConfigError` naming each setting as `names` spells
        it (variable -> the entry point's flag, e.g. ``{"PRISM_KERNEL_MODEL": "--kernel-model"}``; the variable
        itself otherwise) and saying the fix."""
        env = os.environ if environ is None else environ

        def said(var: str, value: str | None = None) -> str:
            name = (names or {}).get(var, var)
            if value is None:
                return name
            return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"

        values = {name: env.get(name, default) for name, default in
                  (("PRISM_VIRTUAL_TIME", "on"), ("PRISM_KERNEL_MODEL", "roofline"), ("PRISM_PROGRAM_TIME", "wall"))}
        for name, allowed in (("PRISM_VIRTUAL_TIME", ("on", "off")),
                              ("PRISM_KERNEL_MODEL", ("roofline", "table", "fit")),
                              ("PRISM_PROGRAM_TIME", ("wall", "emulated"))):
            if values[name] not in allowed:
                raise ConfigError(f"{said(name, values[name])}: use one of {', '.join(allowed)}")
        model = values["PRISM_KERNEL_MODEL"]
        for var, wanted, source in (("PRISM_KERNEL_TABLE", "table", "`prism kernels record`"),
                                    ("PRISM_KERNEL_FIT", "fit", "`prism kernels fit`")):
            path = env.get(var) or None
            if path is not None and model != wanted:
                raise ConfigError(f"{said(var, path)} is read by the {wanted} kernel model, not by "
                                  f"{said('PRISM_KERNEL_MODEL', model)}: add {said('PRISM_KERNEL_MODEL', wanted)} "
                                  f"or drop {said(var)}")
            if path is None and model == wanted:
                raise ConfigError(f"{said('PRISM_KERNEL_MODEL', wanted)} needs {said(var, '<file>')} (a file "
                                  f"from {source})")
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{said(var, path)} is not a file; write one with {source}")
        if values["PRISM_VIRTUAL_TIME"] == "off":
            timed = [said(var, env[var]) for var in ("PRISM_KERNEL_MODEL", "PRISM_KERNEL_TABLE", "PRISM_KERNEL_FIT")
                     if env.get(var)]
            timed += [said("PRISM_PROGRAM_TIME", "emulated")] if values["PRISM_PROGRAM_TIME"] == "emulated" else []
            if timed:
                raise ConfigError(f"{said('PRISM_VIRTUAL_TIME', 'off')} keeps no time, so {' and '.join(timed)} "
                                  f"would do nothing: drop {said('PRISM_VIRTUAL_TIME', 'off')} or the time settings")
        table, fit = env.get("PRISM_KERNEL_TABLE") or None, env.get("PRISM_KERNEL_FIT") or None
        return cls(enabled=values["PRISM_VIRTUAL_TIME"] == "on", kernel_model=model,
                   kernel_table=Path(table) if table else None, kernel_fit=Path(fit) if fit else None,
                   program_time=values["PRISM_PROGRAM_TIME"] == "emulated",
                   launch_blocking=env.get("CUDA_LAUNCH_BLOCKING", "0") == "1")
