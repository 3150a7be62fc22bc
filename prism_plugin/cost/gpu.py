"""GPU models of the hardware profiles: what a virtual GPU reports and what a job's device total adds.

A `GpuSpec` is the device a virtual-GPU rank believes it runs on: its name, memory, compute capability and
SM count (what `torch.cuda.get_device_properties` answers), and the device memory outside the caching
allocator (CUDA context) and inside it before the first kernel (cuBLAS workspaces). Figures are datasheet
and torch-default values, named per field; a profile may override them. Non-goal: kernel speed (the
virtual-time kernel model has its own figures). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_plugin.config.errors import ConfigError, positive_int

__all__ = ["GPUS", "GpuSpec", "cublas_workspace_bytes", "gpu_spec"]

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """torch's default cuBLAS workspace per handle (``CUBLAS_WORKSPACE_CONFIG`` unset, CublasHandlePool.cpp):
    ``:4096:8`` (8 x 4096 KiB = 32 MiB) on sm90 and newer, ``:4096:2:16:8`` (2 x 4096 + 8 x 16 KiB) before.

    >>> cublas_workspace_bytes((9, 0)) // MiB, cublas_workspace_bytes((8, 0))
    (32, 8519680)
    """
    if capability >= (9, 0):
        return 8 * 4096 * KiB
    return (2 * 4096 + 8 * 16) * KiB


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """One GPU model as a virtual GPU presents it."""

    name: str
    """What ``torch.cuda.get_device_name`` returns."""
    total_memory_bytes: int
    """``get_device_properties(i).total_memory`` (the usable HBM the driver reports, below the marketing GB)."""
    capability: tuple[int, int]
    """Compute capability (major, minor): sm90 = (9, 0)."""
    multi_processor_count: int
    context_bytes: int
    """Device memory the CUDA context and driver hold outside the caching allocator: a policy default (512 MiB,
    the order of an H100 context with cuBLAS and NCCL loaded), to be measured on a device and set in the profile."""

    def __post_init__(self) -> None:
        positive_int("total_memory_bytes", self.total_memory_bytes)
        positive_int("multi_processor_count", self.multi_processor_count)
        if self.context_bytes < 0 or self.context_bytes >= self.total_memory_bytes:
            raise ConfigError(f"context_bytes={self.context_bytes!r} must be in [0, total_memory_bytes)")

    @property
    def cublas_workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.capability)


GPUS = {
    # torch.cuda.get_device_properties on an H100 SXM5: total_memory=85520809984 (81559 MiB), 132 SMs
    "h100-sxm": GpuSpec(name="NVIDIA H100 80GB HBM3", total_memory_bytes=81559 * MiB, capability=(9, 0),
                        multi_processor_count=132, context_bytes=512 * MiB),
    # a published device-properties printout of an H200 SXM: total_memory=143156MB, multi_processor_count=132
    "h200-sxm": GpuSpec(name="NVIDIA H200", total_memory_bytes=143156 * MiB, capability=(9, 0),
                        multi_processor_count=132, context_bytes=512 * MiB),
    # a published device-properties printout of an A100 SXM4 80 GB: total_memory=81920MB, 108 SMs (check on a device)
    "a100-sxm-80gb": GpuSpec(name="NVIDIA A100-SXM4-80GB", total_memory_bytes=81920 * MiB, capability=(8, 0),
                             multi_processor_count=108, context_bytes=512 * MiB),
}
"""Built-in GPU models, by the name a hardware profile's ``gpu:`` field gives."""


def gpu_spec(name: str) -> GpuSpec:
    """The built-in GPU model `name` (a `ConfigError` listing the names otherwise)."""
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigError(f"gpu={name!r} is not a known GPU model; use one of {sorted(GPUS)}") from None
