"""`prism kernels record` (issue 13, 1b): the recorder's table (keys, medians, warm-up skipping) and the CLI's
bad-input errors. In-process, CPU only, no timing assertions (durations are only checked to be > 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from prism_plugin.cli.main import main
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernel_table import TableModel
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel
from prism_plugin.runtime.kernel_recorder import KernelRecorder, KeySamples, run_program, table_data

ENTRY_KEYS = {"op", "kernel_class", "shape", "dtype", "device", "flops", "bytes", "duration_us", "count"}
METADATA_KEYS = {"torch_version", "threads", "host", "machine", "processor", "program", "device_type", "device",
                 "clock", "statistic", "kernel_time_per_step_mean_s", "comm_time_per_step_mean_s",
                 "warmup_steps", "recorded_steps", "plain_steps", "step_source", "optimizer_steps_seen",
                 "kernels_per_step", "collectives_per_step", "step_time_median_s", "step_time_mean_s",
                 "timed_step_time_median_s", "kernel_time_per_step_median_s",
                 "comm_time_per_step_median_s", "recorder_overhead_per_step_median_s", "host_overhead_us_per_launch",
                 "host_overhead_raw_us_per_launch",
                 "recorded_at", "note"}


def _train(steps: int) -> None:
    """A linear model, SGD: per step mm (forward), mm (weight grad), sum, ones_like/expand (grad), add_ (SGD)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(4, 16)
    for _ in range(steps):
        (x @ w).sum().backward()
        opt.step()
        opt.zero_grad()


def _recorded(warmup: int, steps: int | None, total: int) -> KernelRecorder:
    recorder = KernelRecorder("cpu", warmup=warmup, steps=steps)
    with recorder.record():
        _train(total)
    return recorder


def test_the_table_has_one_entry_per_key_with_exactly_the_format_fields() -> None:
    table = table_data(_recorded(warmup=2, steps=3, total=7), program=["train.py"])
    assert table["format"] == "prism-kernel-table" and table["version"] == 1
    assert set(table) == {"format", "version", "metadata", "entries"}
    assert set(table["metadata"]) == METADATA_KEYS
    entries = table["entries"]
    assert all(set(e) == ENTRY_KEYS for e in entries)
    assert all(e["device"] == "cpu" and e["dtype"] == "float32" and e["duration_us"] > 0 for e in entries)
    keys = [(e["op"], e["dtype"], tuple(e["shape"])) for e in entries]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    mm = {tuple(e["shape"]): e for e in entries if e["op"] == "aten.mm.default"}
    # forward x @ w: (m, n, k) = (4, 8, 16); weight gradient x^T @ grad: (16, 8, 4); each once per step
    assert set(mm) == {(4, 8, 16), (16, 8, 4)} and {e["count"] for e in mm.values()} == {3}
    assert mm[(4, 8, 16)]["flops"] == 2 * 4 * 8 * 16 and mm[(4, 8, 16)]["kernel_class"] == "gemm"
    sgd = [e for e in entries if e["op"] == "aten.add_.Tensor" and e["shape"] == [16, 8]]
    assert len(sgd) == 1 and sgd[0]["count"] == 3  # SGD's p.add_(grad, alpha=-lr), once per recorded step


def test_warm_up_steps_are_skipped_and_steps_bound_the_window() -> None:
    recorder = _recorded(warmup=2, steps=3, total=7)
    assert recorder.optimizer_steps == 7 and recorder.recorded_steps == 3
    assert recorder.kernels_per_step == [recorder.kernels_per_step[0]] * 3
    mm = [len(e.durations_ns) for e in recorder.samples.values() if e.cost.op == "aten.mm.default"]
    assert mm == [3, 3]  # two GEMMs per step, three steps: none of the warm-up's
    meta = table_data(recorder, program=["train.py"])["metadata"]
    assert (meta["warmup_steps"], meta["recorded_steps"], meta["optimizer_steps_seen"]) == (2, 3, 7)
    assert meta["threads"] == torch.get_num_threads() and meta["collectives_per_step"] == 0
    assert meta["host_overhead_us_per_launch"] > 0 and meta["program"] == ["train.py"]
    assert (meta["plain_steps"], meta["step_source"]) == (2, "plain")  # timed, plain, timed, plain, timed
    rest = _recorded(warmup=0, steps=None, total=5)  # warm-up 0, no bound: every other step to the end
    assert (rest.recorded_steps, len(rest.plain_step_ns)) == (3, 2)


def test_plain_steps_run_without_the_mode_and_the_stack_is_restored_around_other_modes() -> None:
    """Between timed steps the mode is off the dispatch stack (no op seen); a mode pushed above it by the program
    stays above it, and the stack is as before at the end."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    recorder = KernelRecorder("cpu", warmup=1, steps=2)
    seen = []
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = torch.optim.SGD([w], lr=0.1)
    with recorder.record(), Counting() as counting:
        for _ in range(6):
            before = recorder._kernels
            (torch.randn(4, 16) @ w).sum().backward()
            seen.append((recorder._kernels - before, _get_current_dispatch_mode_stack()[-1] is counting))
            opt.step()
            opt.zero_grad()
    assert _get_current_dispatch_mode_stack() == []
    # steps 1 (warm-up) and 2 timed... : warm-up, timed, plain, timed, plain (the window closed), then off
    assert [n > 0 for n, _ in seen] == [False, True, False, True, False, False]
    assert all(top for _, top in seen) and Counting.ops > 0  # the program's mode stayed the top one throughout
    assert recorder.recorded_steps == 2 and len(recorder.plain_step_ns) == 2


def test_each_entry_holds_the_median_of_its_samples() -> None:
    assert KeySamples(_cost(), [3000, 1000, 2000]).median_us == 2.0
    assert KeySamples(_cost(), [1000, 4000]).median_us == 2.5
    recorder = KernelRecorder("cpu", warmup=0)
    recorder.samples[("aten.mm.default", (4, 8, 16), "float32")] = KeySamples(_cost(), [5000, 1000, 2000, 9000])
    recorder.timed_step_ns, recorder.kernels_per_step, recorder.collectives_per_step = [20_000], [4], [0]
    recorder.kernel_ns_per_step, recorder.bookkeeping_ns_per_step = [16_000], [1_000]
    recorder.comm_ns_per_step = [1_000]
    table = table_data(recorder, program=["p.py"], device="cpu")
    (entry,) = table["entries"]
    assert entry["duration_us"] == 3.5 and entry["count"] == 4
    # no plain step: (20 us timed - 1 us bookkeeping - 16 us kernels - 1 us comm) / 4 launches = 0.5 us
    assert table["metadata"]["host_overhead_us_per_launch"] == 0.5 and table["metadata"]["step_source"] == "timed"
    assert table["metadata"]["comm_time_per_step_median_s"] == 1e-6
    assert table["metadata"]["step_time_median_s"] == 19e-6
    recorder.plain_step_ns, recorder.plain_comm_ns = [18_000, 19_000], [500, 1_500]
    meta = table_data(recorder, program=["p.py"], device="cpu")["metadata"]
    # plain steps: (18.5 us mean step - 1 us mean comm - 16 us kernels) / 4 launches = 0.375 us
    assert meta["host_overhead_us_per_launch"] == 0.375 and meta["step_source"] == "plain"
    assert (meta["step_time_median_s"], meta["comm_time_per_step_mean_s"], meta["timed_step_time_median_s"]) == (
        18.5e-6, 1e-6, 19e-6)
    recorder.plain_step_ns = [16_000, 17_000]  # (16.5 - 1 - 16) / 4 = -0.125 us: no launch costs less than nothing
    meta = table_data(recorder, program=["p.py"], device="cpu")["metadata"]
    assert (meta["host_overhead_us_per_launch"], meta["host_overhead_raw_us_per_launch"]) == (0.0, -0.125)
    (entry,) = table_data(recorder, program=["p.py"], device="cpu", statistic="mean")["entries"]
    assert entry["duration_us"] == 4.25  # (5 + 1 + 2 + 9) / 4 us
    with pytest.raises(ValueError, match="statistic='max': use median or mean"):
        table_data(recorder, program=["p.py"], statistic="max")


def test_a_written_table_loads_in_the_table_model_and_answers_its_medians(tmp_path: Path) -> None:
    recorder = _recorded(warmup=1, steps=2, total=4)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table_data(recorder, program=["train.py"])))
    model = TableModel.from_json(path, RooflineModel(gpu_spec("h100-sxm")))
    sample = recorder.samples[("aten.mm.default", (4, 8, 16), "float32")]
    assert model.device == "cpu"
    assert model.duration_s(sample.cost) == pytest.approx(round(sample.median_us, 3) / 1e6)
    assert model.hits() == {"aten.mm.default": 1} and model.misses() == {}


def test_a_program_without_optimizer_steps_records_nothing_and_is_refused() -> None:
    recorder = KernelRecorder("cpu", warmup=1)
    with recorder.record():
        torch.randn(4, 4) @ torch.randn(4, 4)
    with pytest.raises(ValueError, match="no step recorded: the program made 0 optimizer step"):
        table_data(recorder, program=["p.py"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device_type": "mps"}, "record on cpu or cuda"), ({"warmup": -1}, "warmup=-1"), ({"steps": 0}, "steps=0")])
def test_recorder_arguments_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KernelRecorder(**kwargs)


def test_run_program_runs_as_main_with_its_argv_as_rank_0_of_1(tmp_path: Path) -> None:
    script = tmp_path / "p.py"
    script.write_text("import os, sys\nassert __name__ == '__main__'\nprint(sys.argv[1:], os.environ['WORLD_SIZE'])\n"
                      "sys.exit(int(sys.argv[1]))\n")
    before = dict(os.environ)
    assert run_program([str(script), "0"]) == 0 and run_program([str(script), "3"]) == 3
    assert dict(os.environ) == before  # the rendezvous variables it set are gone


# -- the CLI ------------------------------------------------------------------------------------------------


def test_cli_records_a_script_into_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nw = torch.nn.Parameter(torch.ones(8, 8))\nopt = torch.optim.SGD([w], lr=0.1)\n"
                      "for _ in range(4):\n    (w @ w).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    out = tmp_path / "tables" / "t.json"
    threads = torch.get_num_threads()
    try:
        argv = ["kernels", "record", "--output", str(out), "--warmup", "1", "--steps", "2", "--", str(script)]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    table = json.loads(out.read_text())
    assert table["metadata"]["recorded_steps"] == 2 and table["metadata"]["threads"] == 1
    assert table["metadata"]["program"] == [str(script)]
    assert "2 steps (+1 plain) on cpu (1 thread(s), wall clock)" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["kernels", "record"], "name the program to record"),
    (["kernels", "record", "--"], "name the program to record"),
    (["kernels", "record", "--", "no/such/script.py"], "is not a file"),
])
def test_cli_bad_program_exits_2_naming_the_fix(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--steps", "0", "--steps must be an integer >= 1, got 0"), ("--steps", "two", "--steps must be an integer"),
    ("--warmup", "-1", "--warmup must be an integer >= 0"), ("--threads", "0", "--threads must be an integer >= 1")])
def test_cli_bad_numbers_exit_2(flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["kernels", "record", flag, value, "--", "p.py"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_refuses_a_program_that_steps_no_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "p.py"
    script.write_text("import torch\ntorch.ones(2) + 1\n")
    threads = torch.get_num_threads()
    try:
        assert main(["kernels", "record", "--output", str(tmp_path / "t.json"), "--", str(script)]) == 2
    finally:
        torch.set_num_threads(threads)
    assert "no step recorded" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_cuda_launch_blocking_makes_host_and_device_run_one_after_the_other() -> None:
    """The clock of the CPU check: each launch returns at its kernel's end, then the host pays the overhead."""
    from prism_plugin.device.clock import VirtualTime
    from prism_plugin.runtime.device_session import VirtualTimeOptions, _block_each_launch

    assert VirtualTimeOptions.from_env({"CUDA_LAUNCH_BLOCKING": "1"}).launch_blocking
    assert not VirtualTimeOptions.from_env({}).launch_blocking
    overlapped, blocking = (VirtualTime(launch_overhead_s=1e-6, current_stream=lambda: (0, 0)) for _ in range(2))
    _block_each_launch(blocking)
    for clock in (overlapped, blocking):
        for _ in range(3):
            clock.kernel((0, 0), 10e-6)
    # asynchronous: the host runs ahead (3 x 1 us), the stream ends at 3 x 10 us
    assert overlapped.host_s == pytest.approx(3e-6) and overlapped.ends[(0, 0)] == pytest.approx(30e-6)
    # blocking: 3 x (10 us kernel + 1 us overhead), each kernel starting when the host has launched it
    assert blocking.host_s == pytest.approx(33e-6) and blocking.ends[(0, 0)] == pytest.approx(32e-6)


def _cost() -> KernelCost:
    return KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=1024, bytes=896, dtype="float32",
                      shape=(4, 8, 16))


def test_collective_calls_are_timed_as_communication_not_host_time(tmp_path: Path) -> None:
    """A gloo all_reduce per step (rank 0 of 1): counted as a collective launch, its call timed as comm."""
    import torch.distributed as dist

    script = tmp_path / "comm.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "w = torch.nn.Parameter(torch.ones(64, 64)); opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(4):\n"
        "    (w * 2).sum().backward(); dist.all_reduce(w.grad); opt.step(); opt.zero_grad()\n")
    recorder = KernelRecorder("cpu", warmup=1, steps=2)
    original = dist.all_reduce
    with recorder.record():
        assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
        assert run_program([str(script)]) == 0
    assert dist.all_reduce is original  # restored
    assert recorder.recorded_steps == 2 and recorder.collectives_per_step == [1, 1]
    assert all(ns > 0 for ns in recorder.comm_ns_per_step)
    meta = table_data(recorder, program=[str(script)])["metadata"]
    assert meta["comm_time_per_step_median_s"] > 0 and meta["collectives_per_step"] == 1


def test_cli_refuses_a_directory_as_the_table_before_running(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "p.py"
    script.write_text("raise SystemExit('the program must not run')\n")
    assert main(["kernels", "record", "--output", str(tmp_path), "--", str(script)]) == 2
    assert f"--output {str(tmp_path)!r} is a directory; give the table's file name" in capsys.readouterr().err
