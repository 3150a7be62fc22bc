"""GPU models of the hardware profiles: what a virtual GPU reports and what a job's device total adds.

A `GpuSpec` is the device a virtual-GPU rank believes it runs on: its name, memory, compute capability and
SM count (what `torch.cuda.get_device_properties` answers), and the device memory outside the caching
allocator (CUDA context) and the size of torch's cuBLAS workspaces (which the allocator serves), and the two roofline
figures the virtual-time kernel model (`prism_plugin.cost.kernels`) divides by: dense peak FLOP/s per dtype and
HBM bandwidth. Figures are datasheet and torch-default values, named per field; a profile may override them.
Non-goal: achieved kernel speed (the kernel model's efficiencies, in the profile's ``kernels:`` section).
Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prism_plugin.config.errors import ConfigError, positive_int

__all__ = ["GPUS", "GPU_ALIASES", "PEAK_DTYPES", "DeviceTotal", "GpuSpec",
           "cublas_workspace_bytes", "gpu_name", "gpu_spec"]

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10

PEAK_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8", "mxfp8", "fp4")
"""Keys of `GpuSpec.peak_flops_per_s`: float32 is the CUDA-core (non-tensor) rate, the others tensor-core rates.
float8 is per-tensor-scaled FP8 (E4M3 and E5M2 operands, one rate); mxfp8 is block-scaled FP8 (MXFP8: 32-element
blocks with E8M0 scales) and fp4 block-scaled FP4 (NVFP4 and MXFP4, one rate), both Blackwell tensor-core formats.
`prism_plugin.cost.kernels.peak_dtype` maps a kernel's dtype name to one of these."""


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """torch's cuBLAS workspace per (handle, stream) (``parseChosenWorkspaceSize`` in CublasHandlePool.cpp):
    ``config`` is ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, SIZE in KiB, summed); unset (None), the
    default is ``:4096:8`` (8 x 4096 KiB = 32 MiB) on Hopper and Blackwell, compute capability major 9, 10 or 12
    (H100/H200 sm90, B200 sm100, sm120; torch 2.13 tests ``major == 9 || major == 10 || major == 12``), and
    ``:4096:2:16:8`` (2 x 4096 + 8 x 16 KiB) otherwise (A100 sm80); a config with no ``:SIZE:COUNT`` pair falls
    back to the default, as torch does (with a warning).

    >>> cublas_workspace_bytes((9, 0)) // MiB, cublas_workspace_bytes((10, 0)) // MiB, cublas_workspace_bytes((8, 0))
    (32, 32, 8519680)
    >>> cublas_workspace_bytes((9, 0), ":4096:2:16:8") == cublas_workspace_bytes((8, 0))
    True
    """
    default = 4096 * 8 * KiB if capability[0] in (9, 10, 12) else (4096 * 2 + 16 * 8) * KiB
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceTotal:
    """What a job needs of one GPU, itemised: the allocator's peak reserved bytes (torch's cuBLAS workspaces among
    them: the allocator serves them, `cublas_workspace_bytes`), the NCCL communicator buffers, TransformerEngine's
    userbuffers and the CUDA context, which are outside the allocator."""

    peak_reserved_bytes: int
    nccl_buffer_bytes: int
    """`prism_plugin.cost.comm_memory.NcclBufferModel` over the groups the rank used."""
    context_bytes: int
    userbuffer_bytes: int = 0
    """TransformerEngine's userbuffers (TP-communication overlap): registered device memory outside the allocator."""

    @property
    def total_bytes(self) -> int:
        return self.peak_reserved_bytes + self.nccl_buffer_bytes + self.context_bytes + self.userbuffer_bytes

    def as_dict(self) -> dict[str, int]:
        return {"peak_reserved_bytes": self.peak_reserved_bytes, "nccl_buffer_bytes": self.nccl_buffer_bytes,
                "context_bytes": self.context_bytes,
                **({"userbuffer_bytes": self.userbuffer_bytes} if self.userbuffer_bytes else {}),
                "total_bytes": self.total_bytes}


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

    peak_flops_per_s: dict[str, float] = field(default_factory=dict)
    """Dense (no 2:4 sparsity) peak FLOP/s per dtype name of `PEAK_DTYPES` (datasheet figures; a dtype the GPU
    has no rate for is absent, e.g. float8 on an A100). Empty: unknown, and the roofline kernel model refuses
    the GPU."""
    hbm_bytes_per_s: float = 0.0
    """Peak HBM bandwidth in bytes/s (datasheet). 0: unknown, and the roofline kernel model refuses the GPU."""
    pcie_bytes_per_s: float = 0.0
    """Peak host-link bandwidth in bytes/s, one direction (datasheet: the PCIe generation's x16 rate, half the
    bidirectional figure datasheets print): what a copy between host memory and this GPU streams at before the
    kernel model's efficiency. 0: unknown, and such a copy is refused by the roofline kernel model."""

    def __post_init__(self) -> None:
        positive_int("total_memory_bytes", self.total_memory_bytes)
        positive_int("multi_processor_count", self.multi_processor_count)
        if self.context_bytes < 0 or self.context_bytes >= self.total_memory_bytes:
            raise ConfigError(f"context_bytes={self.context_bytes!r} must be in [0, total_memory_bytes)")
        for dtype, rate in self.peak_flops_per_s.items():
            if dtype not in PEAK_DTYPES:
                raise ConfigError(f"peak_flops_per_s: unknown dtype {dtype!r}; use one of {', '.join(PEAK_DTYPES)}")
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
                raise ConfigError(f"peak_flops_per_s.{dtype}={rate!r} must be a number of FLOP/s > 0, e.g. 989.4e12")
        if isinstance(self.hbm_bytes_per_s, bool) or not self.hbm_bytes_per_s >= 0:
            raise ConfigError(f"hbm_bytes_per_s={self.hbm_bytes_per_s!r} must be >= 0 bytes/s, e.g. 3.35e12")
        if isinstance(self.pcie_bytes_per_s, bool) or not self.pcie_bytes_per_s >= 0:
            raise ConfigError(f"pcie_bytes_per_s={self.pcie_bytes_per_s!r} must be >= 0 bytes/s, e.g. 64e9")

    def __hash__(self) -> int:  # the peak dict is not hashable; a spec is identified by its name and sizes
        return hash((self.name, self.total_memory_bytes, self.capability, self.multi_processor_count))

    @property
    def cublas_workspace_bytes(self) -> int:
        """One cuBLAS workspace on this GPU under this process's ``CUBLAS_WORKSPACE_CONFIG`` (torch's default unset)."""
        import os

        return cublas_workspace_bytes(self.capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


# NVIDIA H100 Tensor Core GPU datasheet, SXM column (dense = half the "with sparsity" figures): FP64 Tensor
# Core 67 TF, FP32 67 TF (66.9), TF32 989 TF sparse -> 494.7 dense, BF16/FP16 1979 sparse -> 989.4 dense,
# FP8 3958 sparse -> 1978.9 dense (one row for E4M3 and E5M2: Hopper runs both at this rate), HBM3 3.35 TB/s.
# No MXFP8 or FP4: Hopper's tensor cores have no block-scaled formats.
_H100_PEAKS = {"float64": 66.9e12, "float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12,
               "float16": 989.4e12, "float8": 1978.9e12}
# NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB column (dense): FP64 Tensor Core 19.5 TF, FP32 19.5 TF,
# TF32 156 TF, BF16/FP16 312 TF; no FP8; HBM2e 2,039 GB/s.
_A100_PEAKS = {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}
# NVIDIA HGX B200 datasheet, per 8-GPU board, tensor figures "with sparsity" (dense = half), divided by 8 GPUs:
# FP4 144 PF -> 18 sparse -> 9 PF dense; FP8/FP6 72 PF -> 9 sparse -> 4.5 PF dense; FP16/BF16 36 PF -> 4.5
# sparse -> 2.25 PF dense; TF32 18 PF -> 2.25 sparse -> 1.125 PF dense (the GB200 NVL72 datasheet's HGX B200
# column rounds it to 2.2 sparse); FP32 600 TF -> 75 TF; FP64/FP64 Tensor Core 296 TF -> 37 TF. MXFP8 runs at the
# FP8 rate on Blackwell; FP4 covers NVFP4 and MXFP4.
# Host links (one direction): the H100 and H200 SXM datasheets' "PCIe Gen5: 128 GB/s" and the A100 80GB
# datasheet's "PCIe Gen4: 64 GB/s" are both directions together; the DGX B200 links its GPUs to the host
# over PCIe Gen5 x16 too (64 GB/s each way).
_PCIE_GEN5_X16, _PCIE_GEN4_X16 = 64e9, 32e9
_B200_PEAKS = {"float64": 37e12, "float32": 75e12, "tf32": 1.125e15, "bfloat16": 2.25e15, "float16": 2.25e15,
               "float8": 4.5e15, "mxfp8": 4.5e15, "fp4": 9e15}

GPUS = {
    # torch.cuda.get_device_properties on an H100 SXM5: total_memory=85520809984 (81559 MiB), 132 SMs
    "h100-sxm": GpuSpec(name="NVIDIA H100 80GB HBM3", total_memory_bytes=81559 * MiB, capability=(9, 0),
                        multi_processor_count=132, context_bytes=512 * MiB,
                        peak_flops_per_s=_H100_PEAKS, hbm_bytes_per_s=3.35e12,
                        pcie_bytes_per_s=_PCIE_GEN5_X16),
    # a published device-properties printout of an H200 SXM: total_memory=143156MB, multi_processor_count=132;
    # NVIDIA H200 datasheet, SXM: the H100's compute figures, HBM3e 4.8 TB/s
    "h200-sxm": GpuSpec(name="NVIDIA H200", total_memory_bytes=143156 * MiB, capability=(9, 0),
                        multi_processor_count=132, context_bytes=512 * MiB,
                        peak_flops_per_s=dict(_H100_PEAKS), hbm_bytes_per_s=4.8e12,
                        pcie_bytes_per_s=_PCIE_GEN5_X16),
    # a published device-properties printout of an A100 SXM4 80 GB: total_memory=81920MB, 108 SMs (check on a device)
    "a100-sxm-80gb": GpuSpec(name="NVIDIA A100-SXM4-80GB", total_memory_bytes=81920 * MiB, capability=(8, 0),
                             multi_processor_count=108, context_bytes=512 * MiB,
                             peak_flops_per_s=_A100_PEAKS, hbm_bytes_per_s=2.039e12,
                             pcie_bytes_per_s=_PCIE_GEN4_X16),
    # a published device-properties printout of a B200 (the one the H200's figures come from): name='NVIDIA B200',
    # major=10, minor=0, total_memory=182642MB, multi_processor_count=148 (another, under torch 2.8: 182631MB);
    # the datasheets' 180 GB HBM3e. Bandwidth: DGX B200 datasheet, 64 TB/s per 8 GPUs = 8 TB/s (the GB200 NVL72
    # datasheet's HGX B200 column gives 7.7 TB/s)
    "b200-sxm": GpuSpec(name="NVIDIA B200", total_memory_bytes=182642 * MiB, capability=(10, 0),
                        multi_processor_count=148, context_bytes=512 * MiB,
                        peak_flops_per_s=_B200_PEAKS, hbm_bytes_per_s=8e12,
                        pcie_bytes_per_s=_PCIE_GEN5_X16),
}
"""Built-in GPU models, by the name a hardware profile's ``gpu:`` field gives."""

GPU_ALIASES = {"h100": "h100-sxm", "h200": "h200-sxm", "a100": "a100-sxm-80gb", "b200": "b200-sxm"}
"""Short names of the built-in GPU models (``--gpu b200``), as the profiles' aliases (``--profile b200``)."""


def gpu_name(name: str) -> str:
    """The `GPUS` key `name` stands for: a key itself or a `GPU_ALIASES` name, case-insensitive (a `ConfigError`
    listing the names otherwise).

    >>> gpu_name("B200"), gpu_name("h200"), gpu_name("h100-sxm")
    ('b200-sxm', 'h200-sxm', 'h100-sxm')
    """
    key = name.lower() if isinstance(name, str) else name
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        aliases = ", ".join(f"{alias} -> {target}" for alias, target in GPU_ALIASES.items())
        raise ConfigError(f"gpu={name!r} is not a known GPU model; use one of {sorted(GPUS)} (aliases: {aliases})")
    return key


def gpu_spec(name: str) -> GpuSpec:
    """The built-in GPU model `name` (a `GPUS` key or a `GPU_ALIASES` name, case-insensitive; a `ConfigError`
    listing the names otherwise)."""
    return GPUS[gpu_name(name)]
