"""`prism sweep`'s pure parts: points at a fixed global batch, figures from a canned summary and timeline, the
table, and bad input that names the field and the fix (`prism_plugin.recipes.sweep`, `.sweep_report`)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from prism_plugin.cli.main import main
from prism_plugin.recipes import sweep
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.plans import llama_args, virtual_gpu_plan
from prism_plugin.recipes.schema import Layout
from prism_plugin.recipes.sweep import (
    PointResult,
    SweepError,
    SweepInterrupted,
    SweepSpec,
    derive_points,
    parse_layouts,
    parse_world_sizes,
    point_figures,
    run_points,
    step_breakdown,
    sweep_document,
)
from prism_plugin.recipes.sweep_report import COLUMNS, markdown_table, short_error, table_rows, write_markdown

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA_1B = RECIPES / "virtual-gpu-llama-1b.yaml"


def _spec(**kw: Any) -> SweepSpec:
    return SweepSpec(recipe=load_recipe(LLAMA_1B), **{"world_sizes": (512, 2048), **kw})


def test_points_at_a_fixed_global_batch_change_the_accumulation_with_dp(tmp_path: Path) -> None:
    n512, n2048 = derive_points(_spec(global_batch=2048))
    # 2048 sequences = micro 1 x accumulation 4 x dp 512 = micro 1 x accumulation 1 x dp 2048
    assert (n512.name, n512.dp, n512.micro_batch, n512.accumulation, n512.global_batch) == ("n512", 512, 1, 4, 2048)
    assert (n2048.name, n2048.dp, n2048.accumulation, n2048.global_batch) == ("n2048", 2048, 1, 2048)
    assert n512.tokens_per_step == n2048.tokens_per_step == 2048 * 4096
    (emu,) = n512.recipe.emulated
    assert (emu.name, emu.world_size, emu.runs, emu.profile) == ("n512", 512, ((5,),), "dgx-h100")
    assert n512.recipe.model.microbatches_per_step == 4 and n512.recipe.model.hidden_size == 2048
    target = list(virtual_gpu_plan(n512.recipe, emu, 0, tmp_path).processes[0].argv)
    assert target[target.index("--accumulation") + 1] == "4" and target[target.index("--world-size") + 1] == "512"
    assert "--accumulation" not in llama_args(n2048.recipe)  # K = 1: the program's argv as before sweeps existed


def test_without_a_global_batch_each_replica_keeps_the_recipes_batch() -> None:
    points = derive_points(_spec(world_sizes=(8, 64, 512), rank=3))
    assert [(p.dp, p.accumulation, p.global_batch, p.rank) for p in points] == [(8, 1, 8, 3), (64, 1, 64, 3),
                                                                                (512, 1, 512, 3)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"global_batch": 1000}, r"point n512: --global-batch 1000 is not a multiple of model.micro_batch_size x dp = "
                             r"1 x 512 = 512 .*use a multiple of 512, or lower model.micro_batch_size"),
    ({"global_batch": 512}, r"point n2048: --global-batch 512 is not a multiple of .* 1 x 2048"),
    ({"world_sizes": (12,), "layouts": (Layout(tp=8),)}, r"world size 12 is not a multiple of tp x pp x cp = 8; "
                                                         r"use multiples in --world-sizes or change --layouts"),
    ({"layouts": (Layout(tp=2),)}, r"point n512_tp2: .*program: llama is data parallel only"),
    ({"world_sizes": (4,)}, r"--rank 5 is outside 0..3; pass a --rank below the smallest world size"),
    ({"world_sizes": (12,)}, r"point n12: .*gpus_per_node"),
    ({"emulation": "n64"}, r"--emulation 'n64': recipe virtual-gpu-llama-1b has n8192"),
])
def test_bad_points_name_the_option_and_the_fix(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(SweepError, match=match):
        derive_points(_spec(**kw))


def test_spec_and_option_parsing_errors() -> None:
    assert parse_world_sizes("512, 2048,8_192") == (512, 2048, 8192)
    for text, match in (("512,x", r"'x' is not a positive integer"), ("8,8", "lists a size twice"),
                        ("0", "'0' is not a positive")):
        with pytest.raises(SweepError, match=match):
            parse_world_sizes(text)
    assert parse_layouts("tp=1;tp=2,pp=2", Layout()) == (Layout(), Layout(tp=2, pp=2))
    with pytest.raises(SweepError, match=r"'dp=2' in 'dp=2' is not KEY=INT with KEY one of tp, pp, cp, ep, vpp"):
        parse_layouts("dp=2", Layout())
    with pytest.raises(SweepError, match="layout.vpp .* needs layout.pp >= 2"):
        parse_layouts("vpp=2", Layout())
    with pytest.raises(SweepError, match="empty item"):
        parse_layouts("tp=2;", Layout())
    with pytest.raises(SweepError, match="--global-batch must be a positive"):
        _spec(global_batch=0)
    with pytest.raises(SweepError, match="device: real; a sweep runs virtual-GPU emulations"):
        derive_points(SweepSpec(recipe=load_recipe(RECIPES / "toy-tp2.yaml"), world_sizes=(8,)))


def _timeline(rank: int = 5) -> dict[str, Any]:
    """Iterations 1 and 2 of 10 ms (us); compute 7 ms each, comm 4 ms of which 1 ms under a kernel."""
    meta = [{"ph": "M", "name": "thread_name", "pid": rank, "tid": t, "args": {"name": n}}
            for t, n in ((0, "host"), (3, "cuda:0 stream 0"), (4, "comm stream 0"), (5, "comm stream 1"))]
    spans = []
    for i, t0 in ((1, 10_000.0), (2, 20_000.0)):
        spans.append({"ph": "X", "cat": "iteration", "name": f"iteration {i}", "ts": t0, "dur": 10_000.0,
                      "pid": rank, "tid": 0, "args": {"iteration": i, "open": False}})
        spans += [{"ph": "X", "name": "k", "ts": t0 + a, "dur": d, "pid": rank, "tid": 3, "args": {}}
                  for a, d in ((0.0, 5_000.0), (5_000.0, 2_000.0))]  # 7 ms of kernels back to back
        spans.append({"ph": "X", "name": "all_reduce", "ts": t0 + 6_000.0, "dur": 3_000.0, "pid": rank, "tid": 4})
        spans.append({"ph": "X", "name": "all_reduce", "ts": t0 + 8_000.0, "dur": 2_000.0, "pid": rank, "tid": 5})
    spans.append({"ph": "X", "cat": "iteration", "name": "iteration 3", "ts": 30_000.0, "dur": 5.0, "pid": rank,
                  "tid": 0, "args": {"iteration": 3, "open": True}})
    return {"traceEvents": meta + spans, "otherData": {"rank": rank, "iterations_kept": [0, 1, 2, 3],
                                                       "dropped": {"spans": 0}}}


def test_step_breakdown_counts_exposed_comm_only_where_no_kernel_runs() -> None:
    bd = step_breakdown(_timeline())
    assert bd is not None and bd.steps == 2
    # comm busy 6-10 ms of each step (two overlapping streams: union), kernels 0-7 ms: exposed 7-10 ms
    assert (bd.step_s, bd.compute_s, bd.exposed_comm_s) == pytest.approx((0.010, 0.007, 0.003))
    assert bd.other_s == pytest.approx(0.0, abs=1e-12) and bd.comm_s == pytest.approx(0.004)
    trimmed = _timeline()
    trimmed["otherData"]["iterations_kept"] = [1, 2, 3]  # iteration 0 dropped: step 1 lost its predecessor
    assert step_breakdown(trimmed).steps == 1  # type: ignore[union-attr]
    trimmed["otherData"]["iterations_kept"] = [3]
    assert step_breakdown(trimmed) is None


def _summary(step_s: float = 0.010, flops_per_step: int = 2 * 10**12) -> dict[str, Any]:
    """The fields of a virtual-GPU rank summary a sweep reads (as in a real one: 3 steps, 2 measured)."""
    devices = [{"device": i, "peak_allocated_bytes": 70_034_863_616 if i == 0 else 0,
                "peak_reserved_bytes": 73_637_298_176 if i == 0 else 0,
                "device_total_bytes": 74_174_169_088 if i == 0 else 536_870_912, "fits": True, "ooms": []}
               for i in range(8)]
    return {"rank": 5, "world_size": 512, "modelled_comm_s": 0.0045, "virtual_gpu": {
        "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 85_520_809_984,
        "virtual_time": {"step_times_s": [step_s, step_s]}, "kernels": {"flops": 3 * flops_per_step},
        "devices": devices}}


def test_figures_from_a_canned_summary_and_timeline() -> None:
    (p,) = derive_points(_spec(world_sizes=(512,), global_batch=1024))  # accumulation 2
    f = point_figures(_summary(), p, peak_bf16_flops_per_s=989.4e12, timeline=_timeline())
    assert f.step_time_s == 0.010 and f.flops_per_step == 2 * 10**12
    assert f.tokens_per_s_per_gpu == pytest.approx(1024 * 4096 / 0.010 / 512)  # 819,200
    assert f.mfu == pytest.approx(2e12 / 0.010 / 989.4e12)  # 20.2%
    assert (f.compute_s, f.exposed_comm_s, f.bubble_s) == pytest.approx((0.007, 0.003, 0.0))
    assert f.modelled_comm_s == pytest.approx(0.004) and f.ooms == 0 and f.fits  # the timeline's comm busy time
    assert (f.peak_allocated_bytes, f.peak_reserved_bytes, f.device_total_bytes) == (70_034_863_616, 73_637_298_176,
                                                                                     74_174_169_088)
    bare = point_figures(_summary(), p, peak_bf16_flops_per_s=None)
    assert bare.compute_s is None and bare.mfu is None and bare.breakdown_note.startswith("no timeline")
    assert bare.modelled_comm_s == pytest.approx(0.0015)  # the summary's 4.5 ms over 3 steps
    assert sweep.peak_bf16(p) == 989.4e12


def _results() -> list[PointResult]:
    ok, bad = derive_points(_spec(global_batch=2048))
    figures = point_figures(_summary(), ok, peak_bf16_flops_per_s=989.4e12, timeline=_timeline())
    oom = ("CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacity of 79.65 GiB of which "
           "1.82 GiB is free.")
    return [PointResult(point=ok, figures=figures, error=None, wall_s=1.0, folder="/x/n512"),
            PointResult(point=bad, figures=None, error=oom, wall_s=2.0, folder="/x/n2048")]


def test_table_markdown_and_json_document(tmp_path: Path) -> None:
    results = _results()
    rows = table_rows(results)
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[0][:8] == ("n512", "512", "512", "1 x 4", "10.00", "1,638,400", "20.2%", "7.00")  # 2048 x 4096 tokens
    assert rows[1][-1] == "ERROR: CUDA out of memory. Tried to allocate 32.00 GiB."
    assert short_error("boom") == "boom"
    md = markdown_table(results)
    assert md.splitlines()[0].startswith("| point | N | dp |") and "| n2048 | 2048 |" in md
    doc = sweep_document(_spec(global_batch=2048), results, engine="local (2 at a time)")
    doc = json.loads(json.dumps(doc))  # plain JSON all the way down
    assert doc["schema"] == "prism-sweep/1" and doc["recipe"] == "virtual-gpu-llama-1b"
    assert doc["spec"]["global_batch"] == 2048 and [p["ok"] for p in doc["points"]] == [True, False]
    assert doc["points"][0]["point"]["accumulation"] == 4 and doc["points"][1]["figures"] is None
    text = write_markdown(doc, results, tmp_path, []).read_text()
    assert text.startswith("# prism sweep virtual-gpu-llama-1b (n8192, rank 5, dgx-h100, global batch 2048")


def test_run_points_keeps_point_order_and_reports_each(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    by_name = {r.point.name: r for r in _results()}
    monkeypatch.setattr(sweep, "run_point", lambda p, out, timeout_s: by_name[p.name])
    seen: list[str] = []
    out = run_points([r.point for r in _results()], tmp_path, jobs=2, on_done=lambda r: seen.append(r.point.name))
    assert [r.point.name for r in out] == ["n512", "n2048"] and sorted(seen) == ["n2048", "n512"]
    with pytest.raises(SweepError, match="--jobs must be >= 1"):
        run_points([], tmp_path, jobs=0)


def test_ray_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(SweepError, match=r"pip install prism_plugin\[cluster\]"):
        run_points([r.point for r in _results()], tmp_path, ray_address="local")


def test_the_cli_refuses_bad_input_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["sweep", str(LLAMA_1B), "--world-sizes", "512,2048", "--global-batch", "1000",
                 "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "prism: invalid input:" in err and "--global-batch 1000 is not a multiple" in err
    assert not any(tmp_path.iterdir())  # nothing ran


def test_profiles_are_a_what_if_axis(tmp_path: Path) -> None:
    points = derive_points(_spec(world_sizes=(512,), profiles=("dgx-h100", "dgx-a100")))
    assert [p.name for p in points] == ["n512_dgx_h100", "n512_dgx_a100"]
    assert [p.recipe.emulated[0].profile for p in points] == ["dgx-h100", "dgx-a100"]
    assert [sweep.peak_bf16(p) for p in points] == [989.4e12, 312e12]  # MFU against each point's own GPU
    argv = list(virtual_gpu_plan(points[1].recipe, points[1].recipe.emulated[0], 0, tmp_path).processes[0].argv)
    assert argv[argv.index("--profile") + 1] == "dgx-a100"
    with pytest.raises(SweepError, match=r"--profiles 'local-cpu-gloo' names no GPU model .* such as dgx-h100"):
        derive_points(_spec(profiles=("local-cpu-gloo",)))
    with pytest.raises(SweepError, match=r"--profiles 'dgx-b900': "):
        derive_points(_spec(profiles=("dgx-b900",)))


def test_an_interrupt_starts_no_more_points_and_stops_the_running_one(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """Ctrl-C used to leave the pool launching every queued point; now the running points stop (the runner's STOP)
    and the queued ones never start; the points that had finished come back with the interrupt."""
    import threading

    from prism_plugin.recipes import runner

    points = derive_points(_spec(world_sizes=(512, 1024, 2048, 4096)))
    by_name = {r.point.name: r for r in _results()}
    started: list[str] = []
    stopped = threading.Event()

    def fake_run_point(p: Any, out: Any, timeout_s: float) -> Any:
        started.append(p.name)
        if p.name == "n512":
            return by_name["n512"]
        assert runner.STOP.wait(timeout=30), "the interrupt did not reach the running point"
        stopped.set()
        return dataclasses.replace(by_name["n512"], point=p, error="stopped")

    def interrupt(_result: Any) -> None:
        raise KeyboardInterrupt  # what Ctrl-C raises in the main thread while it waits for the points

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    with pytest.raises(SweepInterrupted) as exc:
        run_points(points, tmp_path, jobs=2, on_done=interrupt)
    assert [r.point.name for r in exc.value.finished] == ["n512"] and stopped.is_set()
    # at most the two running when it came (n1024, and n2048 if n512's thread took it first) ran; n4096 never
    assert set(started[:2]) == {"n512", "n1024"} and "n4096" not in started
    assert not runner.STOP.is_set()  # cleared for the next sweep
    runner.STOP.set()
    try:
        with pytest.raises(runner.RunFailed, match="not started"):
            runner.execute([], steps_total=1, timeout_s=1.0)
    finally:
        runner.STOP.clear()


def test_sigterm_stops_a_sweep_as_ctrl_c_does() -> None:
    import os
    import signal
    import time

    from prism_plugin.cli.sweep import _sigterm_as_interrupt

    with pytest.raises(SweepInterrupted) as exc, _sigterm_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt as interrupt:
            raise SweepInterrupted([]) from interrupt
    assert (exc.value.signal_name, exc.value.signal_number) == ("SIGTERM", 15)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_a_dead_ray_address_is_refused_before_any_point(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["sweep", str(LLAMA_1B), "--world-sizes", "512", "--ray", "127.0.0.1:1",
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--ray '127.0.0.1:1': no Ray cluster answers there" in err and "--ray local" in err
    assert not (tmp_path / "out").exists()
    assert main(["sweep", str(LLAMA_1B), "--world-sizes", "512", "--ray", "nowhere", "--output", str(tmp_path)]) == 2
    assert "give HOST:PORT" in capsys.readouterr().err
