"""Which kernel model a run uses, by name: the factory over `prism_plugin.cost.kernels` (roofline, table) and
`prism_plugin.cost.kernel_fit` (fit), kept apart from both so neither imports the other's layer back. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import GpuSpec
from prism_plugin.cost.kernel_fit import FitModel
from prism_plugin.cost.kernel_table import TableModel
from prism_plugin.cost.kernels import KernelEfficiency, KernelModel, RooflineModel

__all__ = ["KERNEL_MODELS", "kernel_model"]

KERNEL_MODELS = ("roofline", "table", "fit")
"""Names `kernel_model` builds (``fit``: `prism_plugin.cost.kernel_fit`, efficiencies fitted to measured steps)."""


def kernel_model(name: str, gpu: GpuSpec, profile_section: KernelEfficiency | Mapping[str, Any] | None,
                 table_path: str | Path | None = None, *, table_device: str | None = None,
                 fit_path: str | Path | None = None) -> KernelModel:
    """The kernel model `name` (``roofline`` or ``table``) on `gpu` with the profile's ``kernels:`` section.

    `profile_section`: a `KernelEfficiency` (``HardwareProfile.kernels``), its YAML mapping, or None (all policy
    defaults). ``table`` needs `table_path` (a file from ``prism kernels record``) and falls back to the roofline
    on a miss; `table_device` picks the device of a table holding several. ``fit`` needs `fit_path` (an overlay
    from ``prism kernels fit``): the roofline with the fitted efficiencies over the profile's
    (`prism_plugin.cost.kernel_fit.FitModel`, which names the runs it was fitted on).

    Example: ``kernel_model("roofline", gpu_spec("h100-sxm"), load_profile("H100").kernels).name == "roofline"``.
    """
    efficiency = (profile_section if isinstance(profile_section, KernelEfficiency)
                  else KernelEfficiency.from_mapping(profile_section, where="kernels section"))
    if name not in KERNEL_MODELS:
        raise ConfigError(f"kernel_model={name!r} is not one of {', '.join(KERNEL_MODELS)}")
    if (name == "fit") != (fit_path is not None):
        raise ConfigError("kernel_model=fit goes with a fit overlay (write one with `prism kernels fit`), and an "
                          "overlay only with kernel_model=fit")
    if fit_path is not None:  # name == "fit" (checked above)
        if table_path is not None:
            raise ConfigError("kernel_model=fit reads no kernel table; drop the table or choose kernel_model=table")
        return FitModel(gpu, efficiency, fit_path)
    roofline = RooflineModel(gpu, efficiency)
    if name == "roofline":
        if table_path is not None:
            raise ConfigError(f"kernel_model=roofline reads no table, but a kernel table {str(table_path)!r} was "
                              "given; choose kernel_model=table to use it, or drop the table")
        return roofline
    if table_path is None:
        raise ConfigError("kernel_model=table needs a kernel table file (record one with `prism kernels record -- "
                          "<program>` and pass its path), or choose kernel_model=roofline")
    return TableModel.from_json(table_path, roofline, device=table_device, target_device=gpu.name)
