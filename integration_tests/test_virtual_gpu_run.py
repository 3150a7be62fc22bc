"""`prism run --device virtual-gpu`: an unmodified data-parallel CUDA script as rank 5 of 8192 on this CPU host.

The script is written for GPUs (``init_process_group("nccl")``, ``torch.cuda.set_device(LOCAL_RANK)``, cuda
tensors, ``loss.item()``); under the emulation its tensors are fake cuda tensors on a virtual H100 and its
collectives go to the prism backend. Memory figures are exact: they follow from the tensor sizes and the
caching allocator's rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema
from prism_plugin.cost.allocator_config import round_size

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    for step in range(2):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # data-parallel gradient sum over 8192 ranks
            p.grad.div_(world)
        opt.step()
        opt.zero_grad()
        print(f"STEP {step} {loss.item()} {torch.cuda.memory_allocated()} {torch.cuda.get_device_name()}", flush=True)
    shard = torch.empty(4096 * 4096 // world, device="cuda", dtype=torch.bfloat16)
    full = torch.empty(4096 * 4096, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(full, shard)
    dist.barrier()
""")


def test_a_cuda_data_parallel_script_runs_as_rank_5_of_8192_on_a_virtual_h100(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "8192",
                           "--real-ranks", "5", "--profile", "dgx-h100", "--device", "virtual-gpu", "--output",
                           str(out), "--", str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line.split() for line in proc.stdout.splitlines() if line.startswith("STEP ")]
    weight, bias = 4096 * 4096 * 2, 4096 * 2
    params = round_size(weight) + round_size(bias)
    # after each step: parameters and AdamW's two moments (bf16 like the parameters), x, the float loss, and torch's
    # cuBLAS workspaces of the forward's and the autograd thread's handles (32 MiB each on sm90)
    expected = 3 * params + round_size(16 * 4096 * 2) + round_size(4) + 2 * 32 * 2**20
    assert [(s[1], s[2], int(s[3])) for s in steps] == [("0", "1.0", expected), ("1", "1.0", expected)]
    assert all(" ".join(s[4:]) == "NVIDIA H100 80GB HBM3" for s in steps)
    summary = json.loads((out / "rank5.summary.json").read_text())
    assert_published_schema(summary)
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    assert summary["op_counts"] == {"all_reduce": 4, "all_gather": 1, "barrier": 1}
    assert summary["op_bytes"]["all_reduce"] == 2 * (weight + bias)
    # virtual time (the default): ops take their modelled time on emulated streams, nothing sleeps
    assert summary["clock"] == "emulated" and summary["emulated_waits"]["waits_slept"] == 0
    assert summary["modelled_comm_s"] > 0
    vgpu = summary["virtual_gpu"]
    assert vgpu["virtual_time"]["comm_ops"] == 6 and vgpu["kernels"]["model"] == "roofline"
    assert len(vgpu["virtual_time"]["step_times_s"]) == 1  # two optimizer steps mark one whole iteration
    device0 = vgpu["devices"][0]
    # all freed when the script ended but torch's two cuBLAS workspaces (held for the process's life)
    # only the device the rank touched is listed; the node's 7 others by index (no context counted for them)
    assert [d["device"] for d in vgpu["devices"]] == [0] and vgpu["untouched_devices"] == [1, 2, 3, 4, 5, 6, 7]
    assert device0["allocated_bytes"] == device0["cublas_workspace_bytes"] == 64 * 2**20
    # the peak holds at least the parameters, their gradients, both moments and the gathered tensor
    assert device0["peak_allocated_bytes"] >= 4 * params + round_size(4096 * 4096 * 2)
    # the device total: peak reserved (the cuBLAS workspaces among it) + the NCCL buffers of the one group used (the
    # world: 1,024 nodes, ring + tree: 16 channels x 4 connections x 9,633,792 B) + the context
    assert summary["communicator_memory"]["modelled_bytes"] == 16 * 4 * 9_633_792 == 616_562_688
    assert device0["device_total_bytes"] == (device0["peak_reserved_bytes"] + 616_562_688
                                             + vgpu["context_bytes"])
    # value reads answered by the policy, per line of the script: loss.item() (line 17) only; AdamW's step
    # counters live on the host, which runs for real (only the GPU is virtual): their reads are real values
    reads = {(s["site"].split(":")[1], s["value"], s["count"]) for s in vgpu["values"]["by_site"]}
    assert reads == {("17 (<module>)", "1.0", 2)} and vgpu["values"]["reads"] == 2
