"""The device total a virtual-GPU job needs: peak reserved (cuBLAS workspaces among it) + NCCL buffers + CUDA context.

Exact figures: every term is a byte count the test derives from its source (torch's CublasHandlePool.cpp
defaults, NCCL's buffer sizes in `NcclBufferModel`, the allocator model's segments, the GPU model's context).
"""

from __future__ import annotations

from typing import Any

import pytest

from prism_plugin.cost.allocator import CachingAllocatorModel
from prism_plugin.cost.comm_memory import CommUse, NcclBufferModel
from prism_plugin.cost.gpu import DeviceTotal, cublas_workspace_bytes, gpu_spec
from prism_plugin.device.device import VirtualGpu

MiB, GiB = 1 << 20, 1 << 30


class _Session:
    """What `VirtualGpu.summary` reads of a session: its modelled NCCL buffers (the real model's report)."""

    def __init__(self, uses: list[CommUse]) -> None:
        self.uses = uses

    def communicator_memory(self) -> dict[str, Any]:
        return NcclBufferModel().report(self.uses)


def test_cublas_workspace_follows_torchs_defaults_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    # parseChosenWorkspaceSize (torch 2.13): ":4096:8" on major 9, 10 and 12 (Hopper, Blackwell), ":4096:2:16:8"
    # on every other capability (sm110 joined the 32 MiB ones after 2.13)
    assert cublas_workspace_bytes((9, 0)) == 8 * 4096 * 1024 == 33_554_432
    assert cublas_workspace_bytes((10, 0)) == cublas_workspace_bytes((12, 0)) == 33_554_432
    assert cublas_workspace_bytes((8, 0)) == (2 * 4096 + 8 * 16) * 1024 == 8_519_680
    assert cublas_workspace_bytes((8, 9)) == cublas_workspace_bytes((11, 0)) == 8_519_680
    assert cublas_workspace_bytes((9, 0), ":16:8") == 131_072 and cublas_workspace_bytes((8, 0), ":4096:1") == 4 * MiB
    assert cublas_workspace_bytes((9, 0), "garbage") == 33_554_432  # unparsable: torch warns and takes the default
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    assert gpu_spec("h100-sxm").cublas_workspace_bytes == 8 * MiB
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert gpu_spec("h100-sxm").cublas_workspace_bytes == gpu_spec("b200-sxm").cublas_workspace_bytes == 32 * MiB
    assert gpu_spec("a100-sxm-80gb").cublas_workspace_bytes == 8_519_680


def test_a_workspace_adds_exactly_its_bytes_to_the_reserved_peak() -> None:
    # the workspace torch requests at the first GEMM (32 MiB, a multiple of the 2 MiB large-segment rounding) gets
    # a segment of its own and is never freed: the rest of the run's segments are the same with or without it
    def run(workspace: bool) -> int:
        m = CachingAllocatorModel(80 * GiB)
        params = [m.malloc(n) for n in (64 * MiB, 3 * MiB, 512, 300 * 1024)]
        if workspace:
            m.malloc(32 * MiB)
        for _ in range(3):  # steps: activations made and freed, a cached segment reused
            acts = [m.malloc(n) for n in (48 * MiB, 12 * MiB, 700 * 1024, 5 * MiB)]
            for b in acts:
                m.free(b)
        assert len(params) == 4
        return m.stat("reserved_bytes", "all", "peak")

    assert run(True) - run(False) == 32 * MiB


def test_summary_itemises_the_device_total_and_fits_against_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    h100 = gpu_spec("h100-sxm")
    vgpu = VirtualGpu(h100, num_devices=8, device=3)
    vgpu.allocators[3].malloc(10 * GiB)  # a 10 GiB request: a 10 GiB segment (2 MiB multiple)
    # the rank used a TP group of 8 on its node, a DP group of 4 over 4 nodes and one pipeline peer
    session = _Session([CommUse(size=8, num_nodes=1, collective=True, p2p_peers=0),
                        CommUse(size=4, num_nodes=4, collective=True, p2p_peers=0),
                        CommUse(size=2, num_nodes=2, collective=False, p2p_peers=1)])
    protocol = 4 * MiB + 4_915_200 + 524_288  # SIMPLE + LL128 + LL buffers of one connection
    nccl = 16 * protocol + 16 * 4 * protocol + 1 * 2 * 2 * 4 * MiB  # ring; ring + tree (3 more); 2 channels x send/recv
    assert nccl == 787_480_576
    summary = vgpu.summary(session)
    assert [d["device"] for d in summary["devices"]] == [3] and summary["untouched_devices"] == [0, 1, 2, 4, 5, 6, 7]
    own = summary["devices"][0]
    assert own["device_total"] == {"peak_reserved_bytes": 10 * GiB, "nccl_buffer_bytes": nccl,
                                   "context_bytes": 512 * MiB, "total_bytes": own["device_total_bytes"]}
    assert own["device_total_bytes"] == 10 * GiB + 787_480_576 + 536_870_912 == 12_061_769_728
    assert own["fits"] is True and own["cublas_workspaces"] == 0  # no GEMM ran: no workspace
    vgpu.allocators[5].malloc(GiB)  # another device the process allocated on: listed, its context but no NCCL
    other = next(d for d in vgpu.summary(session)["devices"] if d["device"] == 5)
    assert other["device_total"]["nccl_buffer_bytes"] == 0
    assert other["device_total_bytes"] == GiB + 512 * MiB and other["fits"] is True
    assert "cuBLAS" in summary["device_total_note"] and "context_bytes" in summary["device_total_note"]
    # no session (none active either): no communicator, 0 B of NCCL buffers
    assert vgpu.summary()["devices"][0]["device_total_bytes"] == 12_061_769_728 - nccl


def test_a_peak_the_allocator_serves_can_still_not_fit_the_gpu() -> None:
    # the allocator's capacity is the GPU's memory less the context; the NCCL buffers come on top, so a reserved
    # peak just under the capacity (81,026 MiB of 81,047 MiB) is no OOM but does not fit
    h100 = gpu_spec("h100-sxm")
    vgpu = VirtualGpu(h100, num_devices=1)
    capacity = h100.total_memory_bytes - h100.context_bytes
    vgpu.allocators[0].malloc(capacity - 21 * MiB)
    device = vgpu.summary(_Session([CommUse(size=8, num_nodes=1, collective=True, p2p_peers=0)]))["devices"][0]
    assert device["ooms"] == [] and device["peak_reserved_bytes"] == capacity - 21 * MiB
    assert device["device_total_bytes"] == h100.total_memory_bytes - 21 * MiB + 154_140_672
    assert device["fits"] is False
    without = DeviceTotal(peak_reserved_bytes=capacity - 21 * MiB, nccl_buffer_bytes=0,
                          context_bytes=h100.context_bytes)
    assert without.total_bytes <= h100.total_memory_bytes  # what the old figure (reserved + context) said: fits
