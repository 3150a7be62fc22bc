"""Several real ranks on virtual GPUs, coupled in emulated time only: each op's arrival travels with it through
the inner gloo group (`prism_plugin.device.clock`).

Each case runs two real processes (a FileStore rendezvous) of one 8-rank job on virtual GPUs; each prints one
JSON line. The kernel model is the fixed one of ``test_virtual_time.py`` (every ``mm`` takes ``MS`` = 2**-10 s,
nothing else is a kernel; launch overhead 2**-17 s): binary fractions, so every expected figure is exact in
floating point and asserted with ``==``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.model import GroupPlacement

MS = 2.0**-10
LAUNCH = 2.0**-17

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
MS, LAUNCH = {MS!r}, {LAUNCH!r}
def model(func, args, kwargs, out):
    return MS if func is torch.ops.aten.mm.default else None
index, store_path = int(sys.argv[1]), sys.argv[2]
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8, device=index).start()
    clock = vg.start_time(model, LAUNCH)
    P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0, 1), gpus_per_node=8),
                               profile="dgx-h100", device="virtual-gpu", timeout_s=TIMEOUT_S),
               process_index=index, real_store=dist.FileStore(store_path, 2), backend="nccl")
"""
EPILOGUE = """
except BaseException as exc:
    import traceback; traceback.print_exc()
    out["error"] = f"{type(exc).__name__}: {exc}"
    code = 1
print("RESULT " + json.dumps(out))
cuda_runtime.exit_now(code)
"""


def run_pair(body: str, folder: Path, timeout_s: float = 120.0) -> list[dict]:
    """`body` as both real ranks (``index`` 0 and 1) of one job (inner groups' timeout `timeout_s`); each rank's
    RESULT."""
    program = f"TIMEOUT_S = {timeout_s!r}\n" + PRELUDE + textwrap.indent(textwrap.dedent(body), "    ") + EPILOGUE
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "store"
    procs = [subprocess.Popen([sys.executable, "-c", program, str(i), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"no result (exit {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
        result = json.loads(lines[-1][len("RESULT "):])
        assert "error" not in result, stderr[-4000:]
        results.append(result)
    return results


def ps(times: list[float]) -> list[float]:
    """Times to the picosecond (a step time is a difference of two absolute emulated times)."""
    return [round(t, 12) for t in times]


def cost_s(kind: OpKind, nbytes: int, ranks: range | tuple[int, ...]) -> float:
    """The cost model's time of an op on dgx-h100 over `ranks` (what the session charges)."""
    placement = GroupPlacement.from_ranks(ranks, 8)
    return CostModel(load_profile("dgx-h100")).collective_us_placed(kind, nbytes, placement) * 1e-6


STRAGGLER = """
    a = torch.randn(1024, 1024, device="cuda")
    g = torch.empty(1 << 20, device="cuda")                     # 4 MiB of fp32 gradients
    arrivals = []
    for step in range(3):
        P.mark_iteration(step)
        x = a
        for _ in range(1 if index == 0 else 3):                 # rank 1 computes 3x as long: the straggler
            x = x @ a
        arrivals.append(clock.position(torch.cuda.current_stream().key))
        dist.all_reduce(g)                                      # rank 0 waits for rank 1 at the reduce
        out.setdefault("after_reduce", []).append(clock.position(torch.cuda.current_stream().key))
        torch.cuda.synchronize()
    P.mark_iteration(3)
    summary = P.deactivate()
    out["arrivals"] = arrivals
    out["steps"] = clock.step_times_s()
    out["peer_wait_s"] = clock.peer_wait_s
    out["exchanges"] = clock.exchanges
    out["modelled_comm_s"] = summary["modelled_comm_s"]
"""


def test_a_real_straggler_holds_the_other_real_rank_by_exactly_the_difference(tmp_path: Path,
                                                                             library: None) -> None:
    runs = [run_pair(STRAGGLER, tmp_path / f"run{i}") for i in range(3)]
    fast, slow = runs[0]
    cost = cost_s(OpKind.ALL_REDUCE, 4 << 20, range(8))
    assert fast["arrivals"][0] == MS and slow["arrivals"][0] == 3 * MS
    # rank 0 arrives 2 MS before rank 1: its stream resumes at rank 1's arrival + the reduce, as rank 1's does
    assert fast["peer_wait_s"] == 3 * (2 * MS) and slow["peer_wait_s"] == 0.0
    assert fast["exchanges"] == slow["exchanges"] == 3
    for rank in (fast, slow):
        assert ps(rank["steps"]) == ps([3 * MS + cost] * 3)
        assert rank["modelled_comm_s"] == round(3 * cost, 9)
    assert ps([fast["after_reduce"][0]]) == ps([slow["after_reduce"][0]]) == ps([3 * MS + cost])
    assert runs[1] == runs[0] and runs[2] == runs[0]  # deterministic to the bit, whichever process ran first


PIPELINE = """
    a = torch.randn(1024, 1024, device="cuda")
    act = torch.empty(1024, 1024, device="cuda")                # the activation between the stages: 4 MiB
    starts, sends = [], []
    for step in range(2):
        P.mark_iteration(step)
        if index == 0:                                          # stage 0: 2 MS of forward, then send
            x = a @ a; x = x @ a
            sends.append(clock.position(torch.cuda.current_stream().key))
            dist.send(x, dst=1)
        else:                                                   # stage 1: receive, then 1 MS of forward
            dist.recv(act, src=0)
            starts.append(clock.position(torch.cuda.current_stream().key))
            y = act @ a
        torch.cuda.synchronize()
        dist.barrier()
    P.mark_iteration(2)
    P.deactivate()
    out["sends"], out["starts"] = sends, starts
    out["steps"] = clock.step_times_s()
    out["peer_wait_s"] = clock.peer_wait_s
"""


def test_pipeline_stage_1_starts_exactly_after_stage_0s_send(tmp_path: Path, library: None) -> None:
    runs = [run_pair(PIPELINE, tmp_path / f"run{i}") for i in range(3)]
    stage0, stage1 = runs[0]
    send = cost_s(OpKind.SEND, 4 << 20, (0, 1))
    barrier = cost_s(OpKind.BARRIER, 0, range(8))
    assert send > 0
    step = 3 * MS + send + barrier
    assert ps(stage0["sends"]) == ps([2 * MS, step + 2 * MS])  # stage 0 sends after its 2 MS of forward
    # stage 1 posted its recv at once: it completes at stage 0's send + the transfer, and stage 1's forward starts
    assert ps(stage1["starts"]) == ps([2 * MS + send, step + 2 * MS + send])
    # stage 0 waits for stage 1's 1 MS at each barrier
    assert ps([stage0["peer_wait_s"]]) == ps([2 * MS])
    # each step: stage 0's 2 MS, the transfer, stage 1's 1 MS, then the barrier
    for stage in (stage0, stage1):
        assert ps(stage["steps"]) == ps([step] * 2)
    assert runs[1] == runs[0] and runs[2] == runs[0]


CROSSED_RECVS = """
    t = torch.empty(1024, device="cuda")
    try:
        dist.recv(t, src=1 - index)                             # both ranks receive first: neither sends
        out["received"] = True
    except RuntimeError as exc:
        out["refused"] = str(exc)
"""


def test_crossed_receives_between_real_ranks_fail_naming_the_cause(tmp_path: Path, library: None) -> None:
    for rank in run_pair(CROSSED_RECVS, tmp_path, timeout_s=2.0):
        assert rank["refused"].startswith("prism: the emulated times of the real members of group '0' did not "
                                          "arrive for a recv from group rank ")
        assert "a recv before the send it waits for on both sides" in rank["refused"]


EVERY_KIND = """
    a = torch.randn(1024, 1024, device="cuda")
    t = torch.empty(1 << 20, device="cuda")
    big = torch.empty(8 << 20, device="cuda")
    spans = []
    clock.record = lambda row, name, start, end: spans.append((name, start, end)) if row.startswith("comm") else None
    if index == 1:
        x = a @ a                                               # rank 1 arrives 1 MS late at the first op
    dist.all_reduce(t)
    dist.reduce(t, dst=1)
    dist.broadcast(t, src=1)
    dist.all_gather_into_tensor(big, t)
    dist.reduce_scatter_tensor(t, big)
    dist.all_to_all_single(big, big)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1 - index), dist.P2POp(dist.irecv, a, 1 - index)])
    for r in reqs:
        r.wait()
    dist.barrier()
    torch.cuda.synchronize()
    P.deactivate()
    out["spans"], out["exchanges"], out["peer_wait_s"] = spans, clock.exchanges, clock.peer_wait_s
    out["allocated"] = torch.cuda.memory_allocated()
"""


def test_every_collective_kind_on_fakes_couples_two_real_ranks(tmp_path: Path, library: None) -> None:
    r0, r1 = run_pair(EVERY_KIND, tmp_path)
    kinds = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send", "recv",
             "barrier"]
    assert [s[0] for s in r0["spans"]] == [s[0] for s in r1["spans"]] == kinds
    assert r0["exchanges"] == r1["exchanges"] == len(kinds)
    # every collective starts on both at the same time (rank 1's late arrival, then the comm stream's end)
    collectives = [i for i, k in enumerate(kinds) if k not in ("send", "recv")]
    assert [r0["spans"][i] for i in collectives] == [r1["spans"][i] for i in collectives]
    assert r0["spans"][0][1] == MS  # the first starts at rank 1's arrival
    assert r0["peer_wait_s"] == MS and r1["peer_wait_s"] == 0.0  # rank 0 waited once, for that MS
    # no data moved, memory is each rank's own tensors only: a, t, big (fp32); rank 1 also holds x and the cuBLAS
    # workspace torch allocated at its GEMM (32 MiB on sm90)
    assert r0["allocated"] == 4 * ((1 << 20) + (1 << 20) + (8 << 20))
    assert r1["allocated"] == r0["allocated"] + 4 * (1 << 20) + (32 << 20)
