"""`prism plan` past enumeration: the guessed order (`prism_plugin.cost.plan_estimate`), each candidate's command
line and runs (`prism_plugin.cli.plan_runs`: memory run, emulation, cache), the ranking and the CLI's bad input.

The runs are replaced here by recorded stand-ins of `run_one` and `emulate` (their real runs are
integration_tests/test_plan.py): what is tested is the flow between them, exactly."""

from __future__ import annotations

import dataclasses
import doctest
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from prism_plugin.cli import plan as plan_cli
from prism_plugin.cli import plan_runs
from prism_plugin.cli.emulate_runs import RunFailed
from prism_plugin.cli.plan import parse_mark, parse_space, plan_document
from prism_plugin.cli.plan_runs import LAYOUT_FLAGS, PlanJob, run_candidate, strip_flags
from prism_plugin.config.errors import ConfigError
from prism_plugin.config.models import PRESETS, megatron_args, model_of_megatron_args, parameters, preset
from prism_plugin.cost import plan_estimate
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.plan_estimate import guess, order
from prism_plugin.topology.plan_space import Candidate, Recompute, Space, enumerate_layouts

H100 = gpu_spec("h100-sxm")
C = Candidate(tp=2, pp=2, vp=None, cp=1, ep=1, etp=2, dp=2, micro_batch=1, recompute=Recompute.NONE,
              distributed_optimizer=True, fp8=False)


def test_doctests() -> None:
    for module in (plan_estimate, plan_runs, plan_cli):
        assert doctest.testmod(module).failed == 0, module.__name__


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_presets_arguments_read_back_as_the_same_model(name: str) -> None:
    p = preset(name)
    back = model_of_megatron_args(megatron_args(p))
    assert parameters(back) == parameters(p)
    fields = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "seq_length", "normalization", "activation", "position_embedding", "untied_embeddings",
              "bias", "num_experts", "moe_router_topk")
    assert {f: getattr(back, f) for f in fields} == {f: getattr(p, f) for f in fields}


def test_the_guess_orders_fitting_layouts_first_and_never_drops_one() -> None:
    model = preset("llama3-70b")
    found = enumerate_layouts(model, 64, 128, 8192, Space())
    ordered = order(model, found.candidates, H100, 128, 8192)
    assert sorted(c.label() for c, _ in ordered) == sorted(c.label() for c in found.candidates)
    fits = [g.fits(H100) for _, g in ordered]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    speeds = [g.tokens_per_s_per_gpu for _, g in ordered if g.fits(H100)]
    assert speeds == sorted(speeds, reverse=True)
    # NVIDIA's layout for this job (TP4 PP4 CP2 VP5, NeMo 24.12) is guessed to fit an 80 GB H100
    published = Candidate(tp=4, pp=4, vp=5, cp=2, ep=1, etp=4, dp=2, micro_batch=1, recompute=Recompute.NONE,
                          distributed_optimizer=True, fp8=False)
    assert guess(model, published, H100, 128, 8192).fits(H100)


def test_the_guess_moves_the_way_the_mechanisms_do() -> None:
    model = preset("llama3-8b")
    base = guess(model, C, H100, 64, 8192)
    full = guess(model, dataclasses.replace(C, recompute=Recompute.FULL), H100, 64, 8192)
    assert full.memory_bytes < base.memory_bytes and full.step_s > base.step_s  # recompute: memory for time
    selective = guess(model, dataclasses.replace(C, recompute=Recompute.SELECTIVE), H100, 64, 8192)
    assert selective.memory_bytes == base.memory_bytes and selective.step_s > base.step_s  # fused: nothing saved
    plain = guess(model, dataclasses.replace(C, distributed_optimizer=False), H100, 64, 8192)
    assert plain.memory_bytes > base.memory_bytes and plain.step_s == base.step_s
    fp8 = guess(model, dataclasses.replace(C, fp8=True), H100, 64, 8192)
    assert fp8.step_s < base.step_s and fp8.memory_bytes == base.memory_bytes
    unfused = guess(model, C, H100, 64, 8192, fused_attention=False)
    assert unfused.memory_bytes > base.memory_bytes  # the local spec stores the softmax


def test_strip_flags_drops_each_layout_flag_in_both_spellings() -> None:
    argv = ["--num-layers", "4", "--tensor-model-parallel-size=8", "--pipeline-model-parallel-size", "2",
            "--sequence-parallel", "--recompute-granularity", "full", "--use-distributed-optimizer", "--bf16",
            "--global-batch-size", "64", "--train-iters", "500000", "--fp8-format", "hybrid", "--lr", "1e-4"]
    assert strip_flags(argv, LAYOUT_FLAGS) == ["--num-layers", "4", "--bf16", "--lr", "1e-4"]


def test_a_candidates_command_line_sets_each_layout_flag_once(tmp_path: Path) -> None:
    job = PlanJob.from_preset("llama3-8b", gpus=8, global_batch=64, seq=4096, profile="dgx-h100")
    argv = job.argv(C)
    assert argv[0].endswith("programs/pretrain_gpt.py")
    for flag in LAYOUT_FLAGS:
        assert argv.count(flag) <= 1, flag
    assert argv[argv.index("--seq-length") + 1] == "4096" and argv[argv.index("--global-batch-size") + 1] == "64"
    assert argv[argv.index("--train-iters") + 1] == str(plan_runs.ITERATIONS)
    assert argv[argv.index("--max-position-embeddings") + 1] == "8192"  # the preset's, >= seq
    assert argv[-len(C.megatron_args()):] == C.megatron_args()

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    own = [str(script), *megatron_args(preset("llama3-8b")), "--tensor-model-parallel-size", "8",
           "--global-batch-size", "32", "--bf16"]
    job = PlanJob.from_args(own, gpus=8, global_batch=None, seq=None, profile="dgx-h100")
    assert (job.global_batch, job.seq, job.model.num_layers) == (32, 8192, 32)
    assert "--tensor-model-parallel-size" not in job.base_args and "--bf16" in job.base_args
    assert PlanJob.from_args(own, gpus=8, global_batch=128, seq=2048, profile="dgx-h100").argv(C).count("128") == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["train.sh"], "name the job's script"),
    (["SCRIPT", "--num-layers", "2", "--prism-world-size", "8"], "drop them"),
    (["SCRIPT", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "8",
      "--vocab-size", "100"], "no --global-batch-size: pass --global-batch"),
    (["SCRIPT", "--num-layers", "2", "--global-batch-size", "8"], "lack --hidden-size"),
])
def test_a_jobs_command_line_is_refused_with_the_fix(tmp_path: Path, argv: list[str], message: str) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    with pytest.raises(ConfigError, match=message):
        PlanJob.from_args(argv, gpus=8, global_batch=None, seq=None, profile="dgx-h100")


@pytest.mark.parametrize(("text", "message"), [
    ("tq=1", "AXIS one of tp"), ("tp=1;pp", "give AXIS=V1,V2"), ("tp=one", "whole numbers"),
    ("dopt=yes", "give on or off"), ("tp=2,2", "repeats a value"), ("recompute=some", "not one of"),
])
def test_a_bad_space_names_the_axis_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_space(text, fp8_supported=True)


def test_space_and_mark() -> None:
    s = parse_space("tp=8; pp=4,8 ;recompute=none,full;fp8=off", fp8_supported=True)
    assert (s.tp, s.pp, s.recompute, s.fp8) == ((8,), (4, 8), (Recompute.NONE, Recompute.FULL), (False,))
    assert parse_space(None, fp8_supported=False).fp8 == (False,)
    assert parse_mark("tp=8,pp=9,vp=7,cp=2") == {"tp": 8, "pp": 9, "vp": 7, "cp": 2}
    with pytest.raises(ConfigError, match="--mark"):
        parse_mark("tp8")


def _summary(peak: int, fits: bool, ooms: int = 0) -> dict[str, Any]:
    device = {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak + 1, "device_total_bytes": peak + 2,
              "fits": fits, "ooms": [{}] * ooms}
    return {"virtual_gpu": {"devices": [device, dict(device, peak_allocated_bytes=0)]}}


def _report(tokens: float, fits: bool = True) -> dict[str, Any]:
    classes = [{"peak_allocated_bytes": 5, "device_total_bytes": 7, "fits": True, "profiling_run_wall_s": 1.0},
               {"peak_allocated_bytes": 6, "device_total_bytes": 8, "fits": fits, "profiling_run_wall_s": 2.0}]
    return {"step_ms": 10.0, "tokens_per_s_per_gpu": tokens, "model_tflops_per_s_per_gpu": 1.0, "mfu": 0.5,
            "classes_of_ranks": 2, "profiling_runs": 2, "classes": classes}


class Stand:
    """Recorded stand-ins for the memory run (`run_one`) and the emulation (`emulate`) of plan_runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, memory: Any, emulation: Any = None) -> None:
        self.calls: list[str] = []
        self.memory, self.emulation = memory, emulation

        def run_one(command: list[str], run_dir: Path, rank: int, what: str, timeout_s: float, stop: Any, env: Any,
                    *, virtual_time: bool) -> dict[str, Any]:
            assert not virtual_time and command[-4:] == ["--prism-oom", "report", "--prism-timeline", "off"]
            assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
            self.calls.append("memory")
            if isinstance(self.memory, BaseException):
                raise self.memory
            return {"wall_s": 1.5, "summary": self.memory}

        def emulate(argv: list[str], **kwargs: Any) -> dict[str, Any]:
            assert kwargs["overwrite"] and kwargs["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
            self.calls.append("emulate")
            if isinstance(self.emulation, BaseException):
                raise self.emulation
            return self.emulation

        monkeypatch.setattr(plan_runs, "run_one", run_one)
        monkeypatch.setattr(plan_runs, "emulate", emulate)


JOB = PlanJob.from_preset("llama3-8b", gpus=8, global_batch=64, seq=4096, profile="dgx-h100")
GUESS = guess(JOB.model, C, H100, 64, 4096)
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_a_candidate_that_fits_is_emulated_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand = Stand(monkeypatch, _summary(100, True), _report(1234.5))
    r = run_candidate(JOB, C, GUESS, 3, tmp_path / "c", timeout_s=60, env=ENV)
    assert (r.status, r.cached, stand.calls) == ("fits", False, ["memory", "emulate"])
    assert r.memory_run == {"rank": 0, "peak_allocated_bytes": 100, "peak_reserved_bytes": 101,
                            "device_total_bytes": 102, "ooms": 0, "fits": True, "wall_s": 1.5}
    assert r.emulation is not None and r.emulation["peak_allocated_bytes"] == 6 and r.emulation["fits"]
    assert r.tokens_per_s_per_gpu == 1234.5 and r.guess_position == 3
    again = run_candidate(JOB, C, GUESS, 3, tmp_path / "c", timeout_s=60, env=ENV)
    assert again.cached and stand.calls == ["memory", "emulate"]  # read, not run
    assert dataclasses.replace(again, cached=False) == r
    other = dataclasses.replace(C, micro_batch=2)  # another command line: the cache does not answer for it
    run_candidate(JOB, other, GUESS, 4, tmp_path / "c", timeout_s=60, env=ENV)
    assert stand.calls == ["memory", "emulate"] * 2


@pytest.mark.parametrize(("memory", "emulation", "status", "calls"), [
    (_summary(100, False), None, "out of memory", ["memory"]),
    (_summary(100, True, ooms=1), None, "out of memory", ["memory"]),
    (_summary(100, True), _report(10.0, fits=False), "out of memory", ["memory", "emulate"]),
    (_summary(100, True), RunFailed("profiling run 1 exited 1 ... torch.OutOfMemoryError: CUDA out of memory"),
     "out of memory", ["memory", "emulate"]),
    (RunFailed("memory run (rank 0) exited 1; its log: x"), None, "failed", ["memory"]),
    (_summary(100, True), ConfigError("--num-attention-heads 6 is not divisible"), "failed", ["memory", "emulate"]),
])
def test_a_candidate_that_does_not_fit_or_fails_ends_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           memory: Any, emulation: Any, status: str,
                                                           calls: list[str]) -> None:
    stand = Stand(monkeypatch, memory, emulation)
    r = run_candidate(JOB, C, GUESS, 0, tmp_path / "c", timeout_s=60, env=ENV)
    assert (r.status, stand.calls) == (status, calls)
    assert json.loads((tmp_path / "c" / "result.json").read_text())["status"] == status  # deterministic: cached


def test_a_stopped_or_timed_out_candidate_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Stand(monkeypatch, RunFailed("memory run (rank 0) ran past --timeout 60 s and was stopped"))
    assert run_candidate(JOB, C, GUESS, 0, tmp_path / "a", timeout_s=60, env=ENV).status == "failed"
    assert not (tmp_path / "a" / "result.json").exists()
    Stand(monkeypatch, RunFailed("memory run (rank 0) stopped"))
    stop = threading.Event()
    stop.set()
    r = run_candidate(JOB, C, GUESS, 0, tmp_path / "b", timeout_s=60, env=ENV, stop=stop)
    assert r.status == "stopped" and not (tmp_path / "b" / "result.json").exists()


def test_the_ranking_holds_the_fitting_candidates_by_modelled_throughput(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    found = enumerate_layouts(JOB.model, 8, 64, 4096, parse_space("tp=1,2,4;pp=1;cp=1;mbs=1;recompute=none;"
                                                                   "dopt=on;fp8=off", fp8_supported=True))
    ordered = order(JOB.model, found.candidates, H100, 64, 4096)
    speed = {1: 300.0, 2: 500.0, 4: 400.0}

    def fake(job: PlanJob, c: Candidate, g: Any, position: int, folder: Path, **kwargs: Any) -> Any:
        status = "out of memory" if c.tp == 4 else "fits"
        # as read from an earlier plan's cache: its own position and marks, which this plan replaces
        return plan_runs.CandidateResult(label=c.label(), argv=job.argv(c), guess_position=99, guess={},
                                         status=status, emulation={"tokens_per_s_per_gpu": speed[c.tp]},
                                         marks=["marked"], cached=True)

    monkeypatch.setattr(plan_cli, "run_candidate", fake)
    seen: list[str] = []
    doc = plan_cli.plan(JOB, found, ordered, tmp_path, max_candidates=3, jobs=2, timeout_s=60, mark={"tp": 2},
                        progress=lambda r: seen.append(r.label))
    assert doc["ranking"] == ["tp2 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16", "tp1 pp1 vp1 cp1 ep1 mbs1 norc dopt bf16"]
    assert [r["rank"] for r in doc["results"] if r["label"].startswith("tp4")] == [None]
    assert sorted(seen) == sorted(r["label"] for r in doc["results"]) and doc["tried"] == 3
    assert {r["label"][:3]: r["marks"] for r in doc["results"]} == {"tp1": [], "tp2": ["marked"], "tp4": []}
    assert sorted(r["guess_position"] for r in doc["results"]) == [0, 1, 2] and doc["cached"] == 3
    assert json.loads((tmp_path / "plan.json").read_text()) == doc
    assert plan_document(JOB, found, ordered, [], 3, None)["ranking"] == []


def _plan(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "plan", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0", "--model", "llama3-8b"], "--gpus"),
    (["--gpus", "8"], "give a model preset"),
    (["--gpus", "8", "--model", "llama3-7b"], "no model preset 'llama3-7b'"),
    (["--gpus", "24", "--model", "llama3-70b", "--space", "tp=8;pp=4;cp=1"], "'tp*pp*cp divides gpus' excluded"),
    (["--gpus", "8", "--model", "llama3-8b", "--space", "tp=3"], "tp divides heads"),
    (["--gpus", "8", "--model", "llama3-8b", "--max-candidates", "0"], "--max-candidates"),
])
def test_bad_input_exits_2_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _plan(*args, "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()
