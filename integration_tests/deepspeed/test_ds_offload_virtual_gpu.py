"""ZeRO-Offload on a virtual GPU: the optimizer offloaded to the CPU, as rank 5 of 64 on a virtual H100.

The same plain script as `test_ds_virtual_gpu` (scripts/ds_virtual_gpu_train.py: an MLP of 2 blocks of
Linear(1024, 4096), GELU, Linear(4096, 1024), bf16, ZeRO-2), with the ds_config a ZeRO-Offload user writes:
``"offload_optimizer": {"device": "cpu", "pin_memory": true}`` and AdamW without ``torch_adam`` (DeepSpeed then
steps with ``DeepSpeedCPUAdam``, answered by `prism_plugin.adapters.deepspeed.offload`).

Per rank, with flat = 16,787,456 parameters (divisible by 2 * dp: no padding) and part = flat / 64 = 262,304:
- device, after each step: the bf16 parameters (2 flat), ZeRO-Offload's device staging buffer of the largest
  parameter (4,194,304 bf16 elements), the step's input and loss, torch's two cuBLAS workspaces; no fp32
  master, no moments and no gradient norm on the device (all on the host);
- host (fake host tensors, counted, never allocated): the fp32 partition, its fp32 gradient, the two moments
  (4 x 4 part), the pinned gradient staging buffer of the largest parameter (bf16) and the bf16 copy of the
  partition; plus the host-side norms (fp32 scalars);
- time: CPU Adam streams 28 bytes per element of the partition per step at the host's memory bandwidth (the
  profile's policy default, 76.8 GB/s: listed), each step copies the fp32 gradient partition to the host and the
  bf16 partition back over PCIe (``host_copy`` kernels).

ZeRO-3 runs both with the optimizer offloaded and with the parameters offloaded too (``offload_param``: the bf16
partitions in host memory, fetched to the GPU over PCIe for each all-gather).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from integration_tests.at_once import outcomes
from integration_tests.summary_schema import assert_published_schema
from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_virtual_gpu_train.py"
HIDDEN, LAYERS, DP, SEQ, STEPS = 1024, 2, 64, 256, 2


def run(tmp_path: Path, stage: int, params: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    """The script with ZeRO `stage` and the optimizer offloaded to the CPU (`params`: the parameters too), as rank 5
    of 64; its summary."""
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": DP,
              "bf16": {"enabled": True}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": zero,
              "prism": {"world_size": DP, "real_ranks": [5], "profile": "dgx-h100", "device": "virtual-gpu",
                        "output": str(tmp_path / "out")}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "ds_config.json"), "--hidden", str(HIDDEN),
                           "--layers", str(LAYERS), "--steps", str(STEPS), "--seq", str(SEQ)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "rank5.summary.json").read_text())
    assert_published_schema(summary)
    return proc, summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[tuple[subprocess.CompletedProcess, dict]]]:
    """ZeRO-2's run, ZeRO-3's and ZeRO-3's with the parameters offloaded too, started together (every figure
    checked is counted or modelled)."""
    zero2, zero3, params = (tmp_path_factory.mktemp(name) for name in ("zero2", "zero3", "zero3_params"))
    return outcomes(zero2=lambda: run(zero2, 2), zero3=lambda: run(zero3, 3),
                    zero3_params=lambda: run(params, 3, params=True))


def test_zero2_with_the_optimizer_offloaded_to_the_cpu(runs: dict) -> None:
    proc, summary = runs["zero2"].result()
    mem = {line.split()[1]: int(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("MEM ")}
    flat = LAYERS * (2 * HIDDEN * 4 * HIDDEN + 5 * HIDDEN)
    part, largest = flat // DP, 4 * HIDDEN * HIDDEN
    assert flat % (2 * DP) == 0 and part == 262_304
    assert mem["init"] == round_size(2 * flat) + round_size(2 * largest)
    for step in range(STEPS):  # + input, loss, the two cuBLAS workspaces; no optimizer state, no norm
        assert mem[f"step{step}"] == mem["init"] + round_size(2 * SEQ * HIDDEN) + round_size(4) + 2 * 32 * 2**20

    vgpu = summary["virtual_gpu"]
    itemised = 4 * (4 * part) + 2 * largest + 2 * part  # fp32 partition, grad, 2 moments; two bf16 buffers
    assert vgpu["host_memory"]["current_bytes"] == itemised + 4  # + one fp32 scalar (the host's gradient norm)
    assert vgpu["host_memory"]["peak_bytes"] == itemised + 28  # + the norm's intermediate scalars

    adam = vgpu["cpu_adam"]
    assert adam["steps"] == STEPS and adam["bytes_streamed"] == STEPS * 28 * part
    assert adam["modelled_s"] == round(STEPS * 28 * part / 76.8e9, 9)
    assert adam["defaults_used"] == ["host.cpu_memory_bandwidth_gbytes_per_s"]
    copies = [t for t in vgpu["kernels"]["top"] if t["class"] == "host_copy"]
    assert [(t["op"], t["count"], t["bytes"]) for t in copies] == [
        ("aten.copy_.default", 2 * STEPS, STEPS * (4 * part + 2 * part))]  # gradients out, parameters back
    assert copies[0]["total_s"] == pytest.approx(STEPS * (4 * part + 2 * part) / (64e9 * 0.8), rel=1e-9)
    # emulated time, exact: CPU Adam and ZeRO's host-side partition work on the host clock
    assert vgpu["virtual_time"]["host_work_s"] == 0.000471265
    assert vgpu["virtual_time"]["step_times_s"] == [0.005894532]


def test_zero3_with_the_optimizer_offloaded_steps_every_time(runs: dict) -> None:
    """ZeRO-3 partitions each parameter (ceil(numel / dp) elements: the same 262,304 here, every numel divides by
    64); its host holds the fp32 partition, gradient and moments (16 B per element) and the bf16 partition (2 B), plus
    133 B of host scalars (norms and flags). Every step is taken: before the value fix, the first step was skipped in
    6 of 10 runs (an "invalid" gradient norm read from uninitialised memory; `tests/emulated/test_virtual_gpu.py`)."""
    _, summary = runs["zero3"].result()
    vgpu = summary["virtual_gpu"]
    part = 2 * (4 * HIDDEN * HIDDEN // DP + 4 * HIDDEN // DP + 4 * HIDDEN * HIDDEN // DP + HIDDEN // DP)
    assert part == 262_304
    assert summary["iterations_marked"] == STEPS
    assert vgpu["cpu_adam"]["steps"] == STEPS and vgpu["cpu_adam"]["bytes_streamed"] == STEPS * 28 * part
    assert vgpu["host_memory"]["peak_bytes"] == 16 * part + 2 * part + 133
    # modelled, exact (0.001679264 before the H2D moves of host tensors were timed: ZeRO-3 moves each step's gradient
    # partition back to the GPU from its host buffer with .to(), `prism_plugin.device.calls`)
    assert vgpu["virtual_time"]["step_times_s"] == [0.013139157]


def test_zero3_with_the_parameters_offloaded_keeps_their_partition_on_the_host(runs: dict) -> None:
    """``"offload_param": {"device": "cpu"}`` (ZeRO-3's parameter offload): the bf16 partition (2 part bytes, one
    flat buffer) leaves the device for the host; each fetch moves a partition to the GPU before the all-gather (an
    H2D ``host_copy``) and the updated partition stays on the host (no copy back). DeepSpeed's own copies, every one
    a ``host_copy`` over PCIe (traced once, 2 steps): D2H the initial partitioning (2 part), each step's bf16
    gradient partition (2 part) and its fp32 one for CPU Adam (4 part); H2D each step's gradient partition back
    (DeepSpeed's round trip through its host buffer, 2 part) and the fetches (3 bf16 partitions in 2 steps, + 320 B
    of persistent biases: forward fetches, and a backward one where the reuse window released)."""
    zero3_proc, zero3 = runs["zero3"].result()
    proc, summary = runs["zero3_params"].result()
    mem = {line.split()[1]: int(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("MEM ")}
    mem3 = {line.split()[1]: int(line.split()[2]) for line in zero3_proc.stdout.splitlines()
            if line.startswith("MEM ")}
    part = 262_304
    assert {k: mem3[k] - v for k, v in mem.items()} == {k: round_size(2 * part) for k in mem}
    vgpu = summary["virtual_gpu"]
    assert vgpu["host_memory"]["peak_bytes"] == zero3["virtual_gpu"]["host_memory"]["peak_bytes"] + 2 * part
    copies = [(t["count"], t["bytes"]) for t in vgpu["kernels"]["top"] if t["class"] == "host_copy"]
    d2h = 2 * part + STEPS * (2 * part + 4 * part)
    h2d = STEPS * 2 * part + 3 * 2 * part + 320
    assert copies == [(84, d2h + h2d)] and d2h + h2d == 6_295_616
    assert vgpu["cpu_adam"]["steps"] == STEPS
    assert vgpu["virtual_time"]["step_times_s"] == [0.01376305]  # modelled, exact
