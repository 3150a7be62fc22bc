"""ZeRO-Offload on a virtual GPU: host memory reported, host copies and the CPU optimizer's step timed.

With ``"zero_optimization": {"offload_optimizer": {"device": "cpu"}}`` DeepSpeed keeps each rank's fp32 master
partition, its gradient and Adam's two moments in host memory, copies the gradients there over PCIe after the
backward pass, steps them with ``DeepSpeedCPUAdam`` and copies the updated partition back. On a virtual GPU
(`install`):

- every host tensor ZeRO's optimizer makes is fake (`prism_plugin.device.device.VirtualGpu.fake_host` around
  its methods): the partitions (fake already, as moves of device tensors) and the staging buffers it makes with
  ``torch.zeros(..., device="cpu")``, which would otherwise be real host memory of a partition's size; the
  summary's ``host_memory`` counts them, the bytes a real rank holds on the host;
- the copies between host and device are ``host_copy`` kernels on the GPU's streams, over PCIe
  (`prism_plugin.device.kernels`);
- ZeRO's own host-side work on those tensors (the gradient norm and clipping of the host partition, the fp32 to
  bf16 conversion before the copy back) is host time: the bytes each op reads and writes, streamed at the
  profile's ``host.cpu_memory_bandwidth_gbytes_per_s`` (`host_op_time`);
- the optimizer's step is `FakeCpuAdamOp`: ``CPUAdamBuilder().load()`` in ``DeepSpeedCPUAdam`` returns it instead
  of compiling DeepSpeed's C++/AVX extension (which a virtual GPU's host would build against a CUDA it lacks,
  and whose kernels would read values fake tensors do not hold);
- its ``adam_update`` / ``adam_rollback`` change no value (there are none) and advance the emulated host clock
  by the bytes the real kernel streams through host memory: the parameter read and written, the gradient read,
  each moment read and written (``2 p + g + 2 m + 2 v`` bytes: 28 B per element with fp32 states), at the
  profile's ``host.cpu_memory_bandwidth_gbytes_per_s`` (`prism_plugin.cost.host.HostSpec`; its policy default is
  counted in the summary);
- ``create_adam`` / ``destroy_adam`` keep DeepSpeed's optimizer ids, as the C++ registry does.

The step happens where DeepSpeed calls it (after the gradients reached the host; ``engine.step``), so the host
clock, and every launch after it, moves by the step's time, as a real rank's does.

Limitations: the CPU step's time is memory-bound streaming at one figure (no AVX width, thread count or NUMA
effects); DeepSpeed's ``cpu_adagrad`` / ``cpu_lion`` ops and ZenFlow's overlapped step are not answered (their
builders still fail, loudly, as on a host that cannot build them).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from prism_plugin.cost.host import HostSpec

__all__ = ["FakeCpuAdamOp", "host_op_time", "install", "install_param_offload", "offload_device", "offloads_optimizer",
           "offloads_params"]


class FakeCpuAdamOp:
    """The ``cpu_adam`` module DeepSpeed's builder would load: the calls ``DeepSpeedCPUAdam`` makes."""

    def __init__(self, clock: Any, host: HostSpec) -> None:
        self.clock = clock
        """The virtual GPU's emulated clock (None: no virtual time, the step takes no modelled time)."""
        self.host = host
        self.optimizers: dict[int, tuple[Any, ...]] = {}
        self.steps = 0
        self.bytes_streamed = 0
        self.step_s = 0.0

    def create_adam(self, optimizer_id: int, *args: Any) -> int:
        self.optimizers[optimizer_id] = args
        return 0

    def destroy_adam(self, optimizer_id: int) -> int:
        self.optimizers.pop(optimizer_id, None)
        return 0

    def adam_update(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """One Adam step of one host partition: no values change; the host streams its bytes."""
        if optimizer_id not in self.optimizers:
            raise RuntimeError(f"cpu_adam: optimizer {optimizer_id} was never created (create_adam)")
        nbytes = 2 * _nbytes(params) + _nbytes(grads) + 2 * _nbytes(exp_avg) + 2 * _nbytes(exp_avg_sq)
        self.steps += 1
        self.bytes_streamed += nbytes
        duration = self.host.stream_s(nbytes)
        self.step_s += duration
        if self.clock is not None:
            self.clock.host_work(duration, "DeepSpeedCPUAdam.step")
        return 0

    adam_rollback = adam_update  # the same bytes streamed back

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "bytes_streamed": self.bytes_streamed, "modelled_s": round(self.step_s, 9),
                "cpu_memory_bandwidth_bytes_per_s": self.host.bandwidth_bytes_per_s(
                    "cpu_memory_bandwidth_gbytes_per_s"),
                "defaults_used": list(self.host.defaults_used)}


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def host_op_time(host: HostSpec) -> Any:
    """An op on host tensors only, as host seconds: the bytes it reads and writes (its kernel cost on the host,
    `prism_plugin.device.kernels.kernel_cost`) streamed at the host's memory bandwidth; None: no bytes move."""
    from prism_plugin.device.kernels import kernel_cost

    def seconds(func: Any, args: tuple, kwargs: dict, out: Any) -> float | None:
        cost = kernel_cost(func, args, kwargs, out, device_types=("cpu",))
        return None if cost is None else host.stream_s(cost.bytes)

    return seconds


def offload_device(ds_config: Any, section: str) -> str:
    """``zero_optimization.<section>.device`` of `ds_config` (``offload_optimizer`` / ``offload_param``), lower
    case; ``none`` when absent."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    return str((zero.get(section) or {}).get("device", "none")).lower()


def offloads_optimizer(ds_config: Any) -> bool:
    """Whether `ds_config` offloads ZeRO's optimizer to the CPU."""
    return offload_device(ds_config, "offload_optimizer") == "cpu"


def offloads_params(ds_config: Any) -> bool:
    """Whether `ds_config` offloads ZeRO-3's parameter partitions to the CPU."""
    return offload_device(ds_config, "offload_param") == "cpu"


def install_param_offload(patches: Any, vgpu: Any) -> None:
    """ZeRO-3's parameter offload on `vgpu`: each parameter's partition lives in host memory.

    ``partition_parameters.Init`` makes each partition with ``torch.empty(..., device="cpu")`` (pinned): inside
    `VirtualGpu.fake_host` it is a fake host tensor, counted in the summary's ``host_memory`` (a real rank's
    pinned host memory), never allocated here. Each fetch moves the partition to the GPU (``ds_tensor.to(device)``
    before the all-gather): the H2D copy a GPU runs, one ``host_copy`` kernel over the host link
    (`prism_plugin.device.calls`); the updated partition stays on the host (no copy back).
    """
    from deepspeed.runtime.zero import partition_parameters

    for name in ("_partition_param", "_partition_param_sec"):
        member = vars(partition_parameters.Init).get(name)
        if inspect.isfunction(member):
            patches.setattr(partition_parameters.Init, name, vgpu.fake_host(member))


def install(patches: Any, vgpu: Any, host: HostSpec) -> FakeCpuAdamOp:
    """ZeRO-Offload on `vgpu` (held by `patches`: undone with them); returns the CPU Adam op (for the summary).

    ``DeepSpeedCPUAdam``'s ``CPUAdamBuilder().load()`` returns the op: ``deepspeed.ops.adam.cpu_adam`` binds the
    builder by name at import (the class the accelerator hands out; a virtual GPU's CUDA accelerator may have
    none: None), so the name is replaced there. Every method ZeRO's stage 1/2 and 3 optimizers define runs under
    `VirtualGpu.fake_host`, and host-only ops take host time.
    """
    from deepspeed.ops.adam import cpu_adam as ds_cpu_adam
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    op = FakeCpuAdamOp(vgpu.clock, host)

    class Builder:
        def load(self, verbose: bool = True) -> FakeCpuAdamOp:
            return op

    patches.setattr(ds_cpu_adam, "CPUAdamBuilder", Builder)
    for cls in (stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3):
        for name, member in list(vars(cls).items()):
            if inspect.isfunction(member) and (name == "__init__" or not name.startswith("__")):
                patches.setattr(cls, name, vgpu.fake_host(member))
    patches.setattr(vgpu, "host_time", host_op_time(host))
    return op
