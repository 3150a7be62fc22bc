"""ZeRO-Offload on virtual GPUs, the pure parts: the host section, host copies over PCIe, the host clock's work,
the answered CPU Adam op and which offload configurations a virtual GPU refuses."""

from __future__ import annotations

import pytest
import torch

from prism_plugin.adapters.deepspeed.offload import FakeCpuAdamOp, offloads_optimizer, offloads_params
from prism_plugin.adapters.deepspeed.virtual_gpu import check_config
from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.host import HostSpec
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel
from prism_plugin.cost.profiles import ProfileError, load_profile, override_profile
from prism_plugin.device.clock import VirtualTime
from prism_plugin.device.kernel_timer import KernelTimer
from prism_plugin.device.kernels import kernel_cost

aten = torch.ops.aten


def test_host_section_default_is_the_dgx_h100_ddr5_share_and_is_listed() -> None:
    spec = load_profile("dgx-h100").host
    assert spec.defaults_used == ("host.cpu_memory_bandwidth_gbytes_per_s",)
    assert spec.bandwidth_bytes_per_s("cpu_memory_bandwidth_gbytes_per_s") == 2 * 8 * 4800e6 * 8 / 8
    assert HostSpec().stream_s(76_800_000_000) == 1.0
    set_ = override_profile(load_profile("dgx-h100"), {"host.cpu_memory_bandwidth_gbytes_per_s": 50})
    assert set_.host.defaults_used == () and set_.host.stream_s(50_000_000_000) == 1.0


@pytest.mark.parametrize("value", [0, -1, "fast", True])
def test_bad_host_figure_names_the_field(value: object) -> None:
    with pytest.raises(ProfileError, match=r"`host.cpu_memory_bandwidth_gbytes_per_s` must be a positive number"):
        override_profile(load_profile("dgx-h100"), {"host.cpu_memory_bandwidth_gbytes_per_s": value})
    with pytest.raises(ProfileError, match=r"unknown field `host.bandwidth`; known fields: cpu_memory"):
        override_profile(load_profile("dgx-h100"), {"host.bandwidth": 1.0})


def test_each_gpu_has_its_host_link_and_a_host_copy_runs_over_it() -> None:
    assert gpu_spec("h100").pcie_bytes_per_s == gpu_spec("h200").pcie_bytes_per_s == 64e9
    assert gpu_spec("b200").pcie_bytes_per_s == 64e9 and gpu_spec("a100").pcie_bytes_per_s == 32e9
    model = RooflineModel(gpu_spec("h100"), load_profile("dgx-h100").kernels)
    cost = KernelCost(op="aten.copy_.default", kernel_class=KernelClass.HOST_COPY, flops=0, bytes=512 << 20,
                      dtype="float32", shape=(128 << 20,))
    assert model.duration_s(cost) == (512 << 20) / (64e9 * 0.8)  # the profile's host_copy efficiency
    device_copy = KernelCost(op="aten.copy_.default", kernel_class=KernelClass.MEMCPY, flops=0, bytes=512 << 20,
                             dtype="float32", shape=(128 << 20,))
    assert model.duration_s(device_copy) == (512 << 20) / (3.35e12 * 0.85)


def test_a_copy_between_host_and_device_is_one_host_copy_of_the_destination_bytes() -> None:
    device = torch.empty(1024, dtype=torch.bfloat16, device="meta")  # "meta" plays the GPU here
    host = torch.empty(1024, dtype=torch.float32)
    for dst, src in ((device, host), (host, device)):
        cost = kernel_cost(aten.copy_.default, (dst, src), {}, dst, device_types=("meta",))
        assert cost is not None and cost.kernel_class is KernelClass.HOST_COPY
        assert cost.bytes == dst.numel() * dst.element_size() and cost.dtype == str(dst.dtype)[6:]
    same = kernel_cost(aten.copy_.default, (device, device.clone()), {}, device, device_types=("meta",))
    assert same is not None and same.kernel_class is KernelClass.MEMCPY and same.bytes == 2 * 2048


def test_the_kernel_report_keeps_host_and_device_copies_apart() -> None:
    timer = KernelTimer(RooflineModel(gpu_spec("h100"), load_profile("dgx-h100").kernels), device_types=("meta",))
    device = torch.empty(1 << 20, device="meta")
    host = torch.empty(1 << 20)
    timer.duration_s(aten.copy_.default, (device, host), {}, device)
    timer.duration_s(aten.copy_.default, (device, device.clone()), {}, device)
    top = {(t.op, t.kernel_class): t.count for t in timer.summary().top}
    assert top == {("aten.copy_.default", KernelClass.HOST_COPY): 1, ("aten.copy_.default", KernelClass.MEMCPY): 1}


def test_host_work_holds_the_host_and_later_launches() -> None:
    clock = VirtualTime(launch_overhead_s=5e-6, current_stream=lambda: (0, 0))
    clock.kernel((0, 0), 1e-3, "k")
    assert clock.host_work(2e-3, "DeepSpeedCPUAdam.step") == 5e-6 + 2e-3
    end = clock.kernel((0, 0), 1e-3, "after")
    assert end == 5e-6 + 2e-3 + 1e-3  # starts when the host launches it, after the CPU work
    summary = clock.summary()
    assert summary["host_work_s"] == 0.002 and summary["host_s"] == round(2e-3 + 10e-6, 9)
    assert "host_work_s" not in VirtualTime(launch_overhead_s=0.0, current_stream=lambda: (0, 0)).summary()


def test_cpu_adam_streams_its_partition_through_host_memory() -> None:
    clock = VirtualTime(launch_overhead_s=0.0, current_stream=lambda: (0, 0))
    op = FakeCpuAdamOp(clock, HostSpec(cpu_memory_bandwidth_gbytes_per_s=28.0))
    op.create_adam(3, 1e-4, 0.9, 0.999, 1e-8, 0.0, True, False)
    n = 1_000_000
    fp32 = [torch.empty(n, device="meta") for _ in range(4)]
    op.adam_update(3, 1, 1e-4, 0.9, 0.999, 1e-8, 0.0, True, *fp32)
    assert op.bytes_streamed == 28 * n and clock.host_s == 28 * n / 28e9  # 2p + g + 2m + 2v, fp32 states
    bf16_states = [torch.empty(n, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    op.adam_update(3, 2, 1e-4, 0.9, 0.999, 1e-8, 0.0, True, fp32[0], fp32[1], *bf16_states)
    assert op.bytes_streamed == 28 * n + 20 * n
    assert op.summary()["steps"] == 2 and op.summary()["defaults_used"] == []
    op.destroy_adam(3)
    with pytest.raises(RuntimeError, match="optimizer 3 was never created"):
        op.adam_update(3, 3, 1e-4, 0.9, 0.999, 1e-8, 0.0, True, *fp32)


def _config(offload: str | None = "cpu", torch_adam: bool | None = None, **zero: object) -> dict:
    params: dict = {"lr": 1e-4}
    if torch_adam is not None:
        params["torch_adam"] = torch_adam
    zero_section: dict = {"stage": 2, **zero}
    if offload is not None:
        zero_section["offload_optimizer"] = {"device": offload}
    return {"optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero_section}


def test_virtual_gpu_takes_cpu_optimizer_offload_and_refuses_what_it_cannot_emulate() -> None:
    check_config(_config("cpu"))  # DeepSpeedCPUAdam: answered
    check_config(_config(None, torch_adam=True))
    assert offloads_optimizer(_config("cpu")) and not offloads_optimizer(_config(None))
    with pytest.raises(ConfigError, match=r'offload_optimizer.device": \'nvme\'.*use "device": "cpu"'):
        check_config(_config("nvme"))
    check_config(_config("cpu", stage=3, offload_param={"device": "cpu"}))  # ZeRO-3 parameter offload: runs
    assert offloads_params(_config("cpu", offload_param={"device": "cpu"})) and not offloads_params(_config("cpu"))
    with pytest.raises(ConfigError, match=r'offload_param.device": \'nvme\'.*async I/O.*use "device": "cpu"'):
        check_config(_config("cpu", stage=3, offload_param={"device": "nvme"}))
    check_config(_config("cpu", stage=3))
    with pytest.raises(ConfigError, match=r'torch_adam": true: torch.optim.AdamW would step on the host'):
        check_config(_config("cpu", torch_adam=True))
    with pytest.raises(ConfigError, match="FusedAdam"):
        check_config(_config(None))
