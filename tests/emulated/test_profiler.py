"""torch.profiler integration and the virtual-GPU Kineto trace (issue 14, part 2), read by their real consumers.

(a) In-process CPU emulation (tier b): inside ``torch.profiler.profile(activities=[CPU])`` every emulated
collective opens the real backend's ranges (``c10d::allreduce_`` around ``gloo:all_reduce``, with the
``record_param_comms`` metadata as args when ``record_shapes=True``); the exported trace (completed at export by
`prism_plugin.runtime.profiler.augment_trace`) carries one ``record_param_comms`` range per op with the
metadata, and an ``ncclDevKernel_*`` GPU kernel that HTA classifies as communication.

(b) Virtual GPU with virtual time (a fresh process, as in ``test_virtual_time.py``): ``PRISM_KINETO=<dir>``
writes ``rank0.kineto.json``; HTA's ``TraceAnalysis`` loads it and its temporal breakdown, communication /
computation overlap and kernel breakdown equal the emulator's figures. The kernel model is fixed (every ``mm``
takes ``MS`` = 1 ms, every out-of-place ``add`` ``SMALL`` = 2 us, nothing else is a kernel; launch overhead
``LAUNCH`` = 8 us), so each figure follows from the program by arithmetic (derived in the test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from children import run_child
from torch.profiler import ProfilerActivity, profile

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost import CostModel, load_profile
from prism_plugin.cost.model import GroupPlacement
from prism_plugin.runtime.timeline import chrome_trace_problems

hta = pytest.importorskip("hta", reason="HolisticTraceAnalysis (the 'trace' extra) reads the traces")

MS, SMALL, LAUNCH = 1e-3, 2e-6, 8e-6
ITERATIONS = 3  # HTA drops the last profiler step's kernels: iterations 0 and 1 are analysed
ADDS = 4  # per iteration, after the synchronize: each shorter than a launch, so the device idles between them
NBYTES = 512 << 20  # the all-reduce's bucket, 128 Mi fp32: it outlasts the 2 mm it overlaps (part exposed)


@pytest.fixture
def emulate():
    """Rank 0 of 8 on CPU; ops take their modelled time (the wall clock sleeps: microseconds here), so each
    NCCL kernel added to the trace has a duration."""
    session = P.activate(EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,))))
    yield session
    P.deactivate()


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


@pytest.mark.parametrize("record_shapes", [False, True])
def test_cpu_profile_shows_the_backend_ranges_with_the_collective_metadata(
        emulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_shapes: bool) -> None:
    x = torch.ones(1000)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        dist.all_reduce(x)
        dist.all_gather([torch.empty(1000) for _ in range(8)], x)
        tp = dist.new_group([0, 1], group_desc="tp")
        dist.all_reduce(torch.ones(10, dtype=torch.bfloat16), group=tp)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in _events(path) if e.get("ph") == "X"]
    names = [e["name"] for e in events]
    # the real backend's ranges, one per op (c10d::<op> around gloo:<kind>)
    assert names.count("c10d::allreduce_") == 2 and names.count("c10d::allgather_") == 1
    assert names.count("gloo:all_reduce") == 2 and names.count("gloo:all_gather") == 1
    comms = [e for e in events if e["name"] == "record_param_comms"]
    assert [c["args"]["Collective name"] for c in comms] == ["allreduce", "allgather", "allreduce"]
    ar, ag, tp_ar = (c["args"] for c in comms)
    assert (ar["Group size"], ar["In msg nelems"], ar["Out msg nelems"], ar["dtype"]) == (8, 1000, 1000, "Float")
    assert (ag["Group size"], ag["In msg nelems"], ag["Out msg nelems"]) == (8, 1000, 8000)
    assert ar["Process Group Ranks"] == "[0, 1, 2, 3, 4, 5, 6, 7]" and ar["Process Group Description"] == "default_pg"
    assert (ar["Seq"], ag["Seq"], ar["Rank"]) == (1, 2, 0)
    assert (tp_ar["Group size"], tp_ar["Process Group Ranks"], tp_ar["dtype"], tp_ar["Seq"]) == (2, "[0, 1]",
                                                                                                   "BFloat16", 1)
    assert tp_ar["Process Group Description"] == "tp" and tp_ar["Process Group Name"] != ar["Process Group Name"]
    inner = [e for e in events if e["name"] == "gloo:all_gather"][0]
    assert inner["args"]["Out msg nelems"] == 8000  # live (record_shapes) or added at export
    # each record_param_comms lies inside its c10d range, and launches one NCCL kernel (correlated)
    kernels = {e["args"]["correlation"]: e for e in events if e.get("cat") == "kernel"}
    launches = [e for e in events if e["name"] == "cudaLaunchKernel"]
    assert len(kernels) == len(launches) == 3
    assert [kernels[e["args"]["correlation"]]["name"].split("(")[0] for e in launches] == [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_AllGather_RING_LL",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert json.loads(path.read_text())["prism"]["ops"] == 3
    # each kernel lasts its op's emulated duration (the cost model's: timing on)
    costs_us = [1e6 * r.cost_s for r in emulate.profiler_ranges.records]
    assert all(c > 0 for c in costs_us)
    assert [kernels[e["args"]["correlation"]]["dur"] for e in launches] == pytest.approx(costs_us, abs=2e-3)
    # HTA: the collectives are communication kernels, of the emulated durations
    from hta.trace_analysis import TraceAnalysis

    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    analysis = TraceAnalysis(trace_files={0: str(path)}, trace_dir=str(tmp_path))
    by_type, _ = analysis.get_gpu_kernel_breakdown(visualize=False)
    assert list(by_type["kernel_type"]) == ["COMMUNICATION"]
    assert by_type["sum"].iloc[0] == pytest.approx(sum(costs_us), abs=len(costs_us))  # HTA sums whole us


def test_metadata_of_reduce_scatter_and_point_to_point(emulate, tmp_path: Path) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.reduce_scatter_tensor(torch.empty(16), torch.ones(128))
        dist.send(torch.ones(6, dtype=torch.float16), dst=3)
        dist.recv(torch.empty(5), src=6)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    comms = [e["args"] for e in _events(path) if e.get("name") == "record_param_comms"]
    assert [(c["Collective name"], c["In msg nelems"], c["Out msg nelems"], c["dtype"]) for c in comms] == [
        ("reduce_scatter", 128, 16, "Float"), ("send", 12, 0, "Byte"), ("recv", 5, 5, "Float")]
    assert (comms[1]["Dst Rank"], comms[2]["Src Rank"]) == (3, 6)  # a send's dtype is not seen: its bytes
    kernels = [e["name"].split("(")[0] for e in _events(path) if e.get("cat") == "kernel"]
    assert kernels == ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ncclDevKernel_SendRecv",
                       "ncclDevKernel_SendRecv"]


def test_augment_is_idempotent_and_a_profile_outside_an_op_records_nothing(emulate, tmp_path: Path) -> None:
    dist.all_reduce(torch.ones(4))  # not profiled: no record
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.barrier()
    path = tmp_path / "trace.json.gz"
    prof.export_chrome_trace(str(path))
    assert len(emulate.profiler_ranges.records) == 1
    assert emulate.profiler_ranges.augment(path) == 0  # already augmented at export


# -- (b) virtual GPU, virtual time, HTA --------------------------------------------------------------------------
PROGRAM = f"""
import json, os
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
import torch.distributed as dist
import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device.device import VirtualGpu
MS, SMALL, LAUNCH = {MS!r}, {SMALL!r}, {LAUNCH!r}
def model(func, args, kwargs, out):
    if func is torch.ops.aten.mm.default:
        return MS
    return SMALL if func is torch.ops.aten.add.Tensor else None
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm"), num_devices=8).start()
    clock = vg.start_time(model, LAUNCH)
    P.activate(EmulationConfig(world=VirtualWorld(world_size=64, real_ranks=(0,), gpus_per_node=8),
                               profile="dgx-h100", device="virtual-gpu"), backend="nccl")
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.zeros(16, device="cuda")
    g = torch.empty({NBYTES // 4}, device="cuda")
    starts = []
    for i in range({ITERATIONS}):
        P.mark_iteration(i)
        starts.append(clock.host_s)
        x = a @ a
        y = x @ a
        work = dist.all_reduce(g, async_op=True)   # on the comm stream, from the end of the 2nd mm
        z = (y @ a) @ a
        work.wait()
        torch.cuda.synchronize()
        for _ in range({ADDS}):
            b = b + 1
    P.mark_iteration({ITERATIONS})
    summary = P.deactivate()
    out.update(starts=starts, steps=clock.step_times_s(), kernels=clock.kernels, comm_ops=clock.comm_ops,
               modelled_comm_s=summary["modelled_comm_s"], kineto=summary["kineto"],
               timeline=summary["timeline"]["path"])
except BaseException as exc:
    import traceback; traceback.print_exc()
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"
    code = 1
print("RESULT " + json.dumps(out))
cuda_runtime.exit_now(code)
"""


@pytest.fixture(scope="module")
def kineto_run(library: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("kineto")
    # the timeline too: both record the clock's kernels (the Kineto trace's callback is chained after the timeline's)
    env = {**os.environ, "PRISM_KINETO": str(out_dir), "PRISM_TIMELINE": str(tmp_path_factory.mktemp("timeline"))}
    result = run_child(PROGRAM, env=env)
    return out_dir, result


def _all_reduce_s() -> float:
    """The cost model's all-reduce of the bucket over 64 ranks on dgx-h100 (what the session charges)."""
    placement = GroupPlacement.from_ranks(range(64), 8)
    return CostModel(load_profile("dgx-h100")).collective_us_placed(OpKind.ALL_REDUCE, NBYTES, placement) * 1e-6


def _expected_us(comm_s: float) -> dict[str, float]:
    """HTA's figures for iterations 0 and 1, from the program and the fixed model.

    Per iteration (starting at host time T): mm1 [T, T+MS], mm2 [T+MS, T+2MS]; the all-reduce [T+2MS, T+2MS+c];
    mm3, mm4 [T+2MS, T+4MS]; synchronize at E = T + max(4MS, 2MS+c); add i launched at E + i*LAUNCH runs for SMALL;
    the next iteration starts at E + ADDS*LAUNCH. Busy: [T, E] and the adds; idle: LAUNCH - SMALL after each add
    but the last analysed one (its gap ends the trace's kernel span).
    """
    compute = 2 * (4 * MS + ADDS * SMALL)
    comm_only = 2 * max(0.0, comm_s - 2 * MS)
    idle = (2 * ADDS - 1) * (LAUNCH - SMALL)
    return {"idle": 1e6 * idle, "compute": 1e6 * compute, "non_compute": 1e6 * comm_only,
            "kernel": 1e6 * (idle + compute + comm_only),
            "overlap": min(comm_s, 2 * MS) / comm_s}


def test_virtual_gpu_kineto_trace_structure(kineto_run: tuple[Path, dict]) -> None:
    out_dir, result = kineto_run
    path = out_dir / "rank0.kineto.json"
    assert result["kineto"]["path"] == str(path) and sorted(p.name for p in out_dir.iterdir()) == [path.name]
    timeline = json.loads(Path(result["timeline"]).read_text())["traceEvents"]
    assert sum(e["name"] == "aten.mm.default" for e in timeline) == 4 * ITERATIONS  # the chained recorder
    trace = json.loads(path.read_text())
    assert chrome_trace_problems(trace) == []  # the trace event format's rules (proper nesting per thread, names)
    assert trace["distributedInfo"] == {"backend": "nccl", "rank": 0, "world_size": 64}
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime"}
    # every kernel the clock timed, every comm op, each launched by one correlated cudaLaunchKernel
    assert len(kernels) == result["kernels"] + result["comm_ops"] == ITERATIONS * (4 + ADDS + 1)
    assert all(launches[k["args"]["correlation"]]["ts"] < k["ts"] + 1e-9 for k in kernels)
    nccl = [k for k in kernels if k["name"].startswith("ncclDevKernel_AllReduce_Sum_f32")]
    assert len(nccl) == ITERATIONS and {k["args"]["stream"] for k in nccl} == {1000}
    assert {k["args"]["stream"] for k in kernels if k["name"] == "aten::mm"} == {7}
    assert nccl[0]["args"]["Group size"] == 64 and nccl[0]["args"]["In msg nelems"] == NBYTES // 4
    flows = [e for e in events if e.get("cat") == "ac2g"]
    assert len(flows) == 2 * len(kernels)
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    assert [s["name"] for s in steps] == [f"ProfilerStep#{i}" for i in range(ITERATIONS)]
    # the emulator's own step time: max(4MS, 2MS + c) + ADDS launches
    c = _all_reduce_s()
    assert result["modelled_comm_s"] == pytest.approx(ITERATIONS * c, abs=1e-9)
    step = max(4 * MS, 2 * MS + c) + ADDS * LAUNCH
    assert result["steps"] == pytest.approx([step] * ITERATIONS, abs=1e-12)
    assert [s["dur"] for s in steps] == pytest.approx([1e6 * step] * ITERATIONS, abs=2e-3)


@pytest.mark.parametrize("ns_rounding", [False, True], ids=["exact", "hta-rounds-to-us"])
def test_hta_breakdowns_equal_the_emulator_figures(kineto_run: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch,
                                                   ns_rounding: bool) -> None:
    from hta.trace_analysis import TraceAnalysis

    out_dir, _ = kineto_run
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "0" if ns_rounding else "1")
    analysis = TraceAnalysis(trace_dir=str(out_dir))
    assert analysis.t.get_iterations(0) == list(range(ITERATIONS - 1))  # the last step is dropped
    temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
    overlap = analysis.get_comm_comp_overlap(visualize=False).iloc[0]
    by_type, _ = analysis.get_gpu_kernel_breakdown(visualize=False)
    c = _all_reduce_s()
    want = _expected_us(c)
    # exact: to the trace's nanosecond (a few events' rounding); HTA's default rounding moves each event's start
    # up and end down to whole microseconds: up to 2 us per kernel (2 iterations of 9 kernels)
    tol = 0.01 if not ns_rounding else 2.0 * 2 * (4 + ADDS + 1)
    assert temporal["compute_time(us)"] == pytest.approx(want["compute"], abs=tol)
    assert temporal["non_compute_time(us)"] == pytest.approx(want["non_compute"], abs=tol)
    assert temporal["idle_time(us)"] == pytest.approx(want["idle"], abs=tol)
    assert temporal["kernel_time(us)"] == pytest.approx(want["kernel"], abs=tol)
    assert overlap["comp_comm_overlap_pctg"] == pytest.approx(100 * want["overlap"], abs=0.01 if not ns_rounding
                                                              else 100 * 2.0 / (1e6 * c))
    # the kernel breakdown splits the busy time by what runs (each segment's duration truncated to whole us by
    # HTA: 8 segments per iteration here): compute alone, compute overlapping communication, communication alone
    types = dict(zip(by_type["kernel_type"], by_type["sum"], strict=True))
    overlapped = want["overlap"] * 2 * 1e6 * c
    seg_tol = 8 * 2 + (tol if ns_rounding else 0)
    assert set(types) <= {"COMPUTATION", "COMPUTATION overlapping COMMUNICATION", "COMMUNICATION"}
    assert types.get("COMMUNICATION", 0) == pytest.approx(want["non_compute"], abs=seg_tol)
    assert types["COMPUTATION overlapping COMMUNICATION"] == pytest.approx(overlapped, abs=seg_tol)
    assert types["COMPUTATION"] == pytest.approx(want["compute"] - overlapped, abs=seg_tol)
    print(json.dumps({"rounding": ns_rounding, "hta": {k: float(temporal[k]) for k in (
        "idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)")},
        "hta_overlap_pctg": float(overlap["comp_comm_overlap_pctg"]), "hta_kernel_types_us": {
            k: float(v) for k, v in types.items()}, "emulator_us": want, "all_reduce_us": 1e6 * c}))
