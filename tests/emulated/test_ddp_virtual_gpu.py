"""torch DDP (``torch.nn.parallel.DistributedDataParallel``) on virtual GPUs, unmodified: its parameter-shape
check, the broadcast of the module states, the bucketed reducer and its gradient hooks
(`prism_plugin.runtime.virtual_ddp`).

The kernel model is the fixed one of ``test_virtual_time.py`` (every ``mm`` takes ``MS`` = 2**-10 s, nothing else is
a kernel): four bias-free 1024x1024 fp32 layers take 4 MS of forward and 7 MS of backward (the first layer computes
no input gradient), so each expected step is exact.
"""

from __future__ import annotations

from pathlib import Path

from children import EPILOGUE, program, run_child
from test_virtual_time_multi import MS, cost_s, ps, run_pair

from prism_plugin.config.kinds import OpKind

PRELUDE = f"""
import json, sys
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
import torch.distributed as dist
import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
MS = {MS!r}
def model(func, args, kwargs, out):
    return MS if func is torch.ops.aten.mm.default else None
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8, device=3).start()
    clock = vg.start_time(model, 2.0**-17)
    P.activate(EmulationConfig(world=VirtualWorld(world_size=64, real_ranks=(3,), gpus_per_node=8),
                               profile="dgx-h100", device="virtual-gpu"), backend="nccl")
    index = 3
"""

DDP = """
    torch.cuda.set_device(index)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[index], bucket_cap_mb=4)  # 1 layer a bucket
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(1024, 1024, device="cuda")
    spans = []
    clock.record = lambda row, name, start, end: spans.append((row, name, start, end))
    for step in range(3):
        P.mark_iteration(step)
        loss = ddp(x).sum()
        loss.backward()
        opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
    P.mark_iteration(3)
    summary = P.deactivate()
    out["marks"] = [t for _, t in clock.marks]
    out["steps"] = clock.step_times_s()
    out["comm"] = [s for s in spans if s[0].startswith("comm")]
    out["op_counts"] = summary["op_counts"]
    out["peer_wait_s"] = clock.peer_wait_s
"""


def test_ddp_runs_as_rank_3_of_64_with_bucket_reduces_hidden_behind_backward_but_the_last(library: None) -> None:
    out = run_child(program(PRELUDE, DDP, EPILOGUE))
    ar4, ar16 = cost_s(OpKind.ALL_REDUCE, 4 << 20, range(64)), cost_s(OpKind.ALL_REDUCE, 16 << 20, range(64))
    marks, steps, comm = out["marks"], out["steps"], out["comm"]
    # step 0: DDP's first iteration reduces all gradients in one bucket after the whole backward
    assert ps([steps[0]]) == ps([11 * MS + ar16])
    # step 1: DDP rebuilds its buckets (one layer each) at the first forward after, broadcasting the order
    rebuild = [s for s in comm if marks[1] <= s[2] < marks[2] and s[1] == "broadcast"]
    assert len(rebuild) == 2
    # (to 0.1 ps: the emulator adds each kernel to the stream's end, the sum here adds in another order)
    assert abs(steps[1] - (11 * MS + sum(end - start for *_, start, end in rebuild) + ar4)) < 1e-13
    # step 2: each layer's bucket is reduced when its backward ends (6, 8, 10, 11 MS into the step) and hides
    # behind the next layer's 2 MS of backward, but for the last: the step is 11 MS + one 4 MiB all-reduce
    reduces = [s for s in comm if marks[2] <= s[2] < marks[3]]
    assert [s[1] for s in reduces] == ["all_reduce"] * 4
    assert ps([s[2] - marks[2] for s in reduces]) == ps([6 * MS, 8 * MS, 10 * MS, 11 * MS])
    assert ps([s[3] - s[2] for s in reduces]) == ps([ar4] * 4)
    assert ps([steps[2]]) == ps([11 * MS + ar4])
    # construction: the shape check's metadata and the module states (16 MiB) broadcast; the rebuild's two
    assert out["op_counts"] == {"broadcast": 4, "all_reduce": 1 + 4 + 4}


def test_ddp_with_two_real_ranks_agrees_on_both_to_the_bit(tmp_path: Path, library: None) -> None:
    fast, slow = run_pair(DDP, tmp_path)
    ar4 = cost_s(OpKind.ALL_REDUCE, 4 << 20, range(8))
    assert fast["steps"] == slow["steps"] and fast["comm"] == slow["comm"]
    assert ps([fast["steps"][2]]) == ps([11 * MS + ar4])
    assert fast["peer_wait_s"] == slow["peer_wait_s"] == 0.0  # the same program: they arrive together


MISMATCH = """
    width = 1024 if index == 0 else 2048                        # rank 1 builds another model
    net = torch.nn.Linear(1024, width, bias=False).cuda()
    try:
        torch.nn.parallel.DistributedDataParallel(net, device_ids=[index])
        out["built"] = True
    except RuntimeError as exc:
        out["refused"] = str(exc)
"""


def test_ddp_shape_check_compares_the_real_ranks_parameters(tmp_path: Path, library: None) -> None:
    _, other = run_pair(MISMATCH, tmp_path)  # (group rank 0, the source, passes; it then loses its peer)
    assert other["refused"].startswith("DDP expects same model across all ranks, but parameter 0 has sizes and "
                                       "strides [2048, 1024, 1024, 1] here and [1024, 1024, 1024, 1] on group rank 0")


def test_ddp_options_fake_tensors_cannot_run_are_refused_naming_the_flag(library: None) -> None:
    out = run_child(program(PRELUDE, """
        net = torch.nn.Linear(64, 64).cuda()
        for flag in ("find_unused_parameters", "static_graph"):
            try:
                torch.nn.parallel.DistributedDataParallel(net, device_ids=[index], **{flag: True})
                out[flag] = "built"
            except NotImplementedError as exc:
                out[flag] = str(exc)
        ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[index])  # without them it builds
        try:
            ddp._set_static_graph()
        except NotImplementedError as exc:
            out["_set_static_graph"] = str(exc)
        P.deactivate()
    """, EPILOGUE))
    for flag in ("find_unused_parameters", "static_graph"):
        assert out[flag].startswith(f"prism virtual GPU: DistributedDataParallel({flag}=True) keeps a pinned host map")
        assert f"Drop {flag}=True" in out[flag]
    assert "DistributedDataParallel(static_graph=True)" in out["_set_static_graph"]
