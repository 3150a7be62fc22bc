"""`prism emulate` of a DeepSpeed job, and its hybrid phase: a ZeRO-2 language model as 64 virtual H100s.

The job (`prism_plugin.programs.deepspeed_lm`): 2 blocks of width 1024 (16 heads, MLP 4096), vocab 32000, seq 1024,
bf16, ZeRO-2 with torch's AdamW, micro-batch 2 x 2 accumulation steps x dp 64 = train_batch_size 256. Its config has
no "prism" section: `prism emulate` detects DeepSpeed from the config argument, takes dp = 64 from the world size,
runs the one class (every ZeRO rank owns an equal partition) on a virtual GPU, builds the graph and replays it.
Then ``--hybrid 5,63`` runs ranks 5 and 63 again as real processes against the graph: their virtual peers arrive on
their emulated clocks when the replay says, and their steady step (the last one) equals the replay's but for the
rounding of times to 1 ns in the trace and the summary (within 2 ns; measured 1 ns): the same kernel model, the same
cost model and the same arrivals.

Every figure is modelled and deterministic, so the step is pinned to the microsecond; tokens/s/GPU, TFLOP/s/GPU
and MFU follow from it by their definitions (model FLOPs given on the command line: DeepSpeed defines none). About
60 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prism_plugin.cli.emulate_deepspeed import DeepSpeedJob, detect_framework
from prism_plugin.config.errors import ConfigError
from prism_plugin.programs.deepspeed_lm import model_flops_per_iteration

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "deepspeed_lm.py"
N, SEQ, HIDDEN, LAYERS, VOCAB = 64, 1024, 1024, 2, 32000
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 2 * 2 * N,
          "bf16": {"enabled": True}, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2}}


def job(tmp_path: Path, config: dict | None = None) -> list[str]:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG if config is None else config))
    return [str(SCRIPT), "--deepspeed_config", str(path), "--seq-length", str(SEQ), "--hidden", str(HIDDEN),
            "--layers", str(LAYERS), "--vocab", str(VOCAB), "--steps", "3"]


def test_the_framework_and_layout_come_from_the_deepspeed_config(tmp_path: Path) -> None:
    argv = job(tmp_path)
    assert detect_framework(argv) == "deepspeed"
    assert detect_framework([str(SCRIPT), "--num-layers", "2"]) == "deepspeed"  # the script calls deepspeed.initialize
    megatron = Path(__file__).resolve().parents[1] / "prism_plugin" / "programs" / "pretrain_gpt.py"
    assert detect_framework([str(megatron), "--num-layers", "2"]) == "megatron"
    ds = DeepSpeedJob.from_argv(argv, N)
    assert (ds.layout, ds.zero_stage, ds.global_batch, ds.seq_length) == ("pipe=1,model=1,data=64", 2, 256, SEQ)
    run = ds.run_config(5, tmp_path / "r", profile="dgx-h100", gpus_per_node=8)
    assert run["prism"] == {"world_size": N, "real_ranks": [5], "profile": "dgx-h100", "gpus_per_node": 8,
                            "device": "virtual-gpu", "output": str(tmp_path / "r"),
                            "topology": {"pipe": 1, "data": 64, "model": 1}, "trace": str(tmp_path / "r" / "trace")}
    figures = DeepSpeedJob.from_argv(argv[:3], N).figures(None)  # no --seq-length, no model FLOPs
    assert set(figures["unavailable"]) == {"tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "mfu"}


@pytest.mark.parametrize(("change", "match"), [
    ({"prism": {"topology": {"pipe": 2, "data": 32, "model": 1}}}, "pipe=2: a stage after the first receives"),
    ({"prism": {"topology": {"pipe": 3, "data": 21, "model": 1}}}, "not a multiple of pipe x model = 3 x 1"),
    ({"prism": {"faults": ["straggler:ranks=1,factor=2"]}}, "does not run its keys faults"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}, "FusedAdam"),
])
def test_what_emulate_cannot_run_is_refused_before_any_process(tmp_path: Path, change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DeepSpeedJob.from_argv(job(tmp_path, {**CONFIG, **change}), N)
    with pytest.raises(ConfigError, match="name the DeepSpeed config"):
        DeepSpeedJob.from_argv([str(SCRIPT), "--seq-length", "8"], N)


@pytest.mark.heavy  # about 50 s; test_emulate_deepspeed_hybrid runs emulate on DeepSpeed in CI
def test_prism_emulate_predicts_a_zero2_job_and_its_hybrid_ranks_agree_with_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "em"
    flops = model_flops_per_iteration(global_batch=256, seq=SEQ, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB)
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", str(N), "--out",
                           str(out), "--json", "--hybrid", "5,63", "--model-flops-per-iteration", str(flops), "--",
                           *job(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((out / "emulate.json").read_text())
    assert (report["framework"], report["layout"], report["zero_stage"]) == ("deepspeed", "pipe=1,model=1,data=64", 2)
    assert (report["classes_of_ranks"], report["profiling_runs"], report["kernel_model"]) == (1, 1, "roofline")
    (cls,) = report["classes"]
    assert (cls["rank"], cls["ranks_like_it"], cls["fits"], cls["bubble_ms"]) == (0, N, True, 0.0)
    assert cls["compute_ms"] + cls["exposed_comm_ms"] == pytest.approx(cls["step_ms"], abs=2e-3)
    step_s = report["replay"]["step_us"] / 1e6
    assert report["tokens_per_s_per_gpu"] == round(256 * SEQ / step_s / N, 1)
    tflops = flops / step_s / N / 1e12
    assert report["model_tflops_per_s_per_gpu"] == round(tflops, 1)
    assert report["mfu"] == round(tflops * 1e12 / 989.4e12, 4)
    assert report["unavailable"] == {}
    assert report["step_ms"] == pytest.approx(PINNED_STEP_MS, abs=1e-3)  # modelled, deterministic
    hybrid = {h["rank"]: h for h in report["hybrid"]}
    assert set(hybrid) == {5, 63}
    for h in hybrid.values():
        assert h["class"] == "pp=0" and len(h["steps_ms"]) == 2
        assert h["replay_step_ms"] == round(report["replay"]["step_us"] / 1e3, 6)
        # equal but for rounding: the trace keeps each op's time to 1 ns (the graph's spans are differences of
        # those) and the summary each step to 1 ns; measured -0.001 us
        assert abs(h["difference_us"]) <= 0.002
        g = h["graph"]
        assert g["ops_replayed"] > 0 and g["ops_outside_graph"] == 0
        assert h["kernels"] == h["representative"]["kernels"]  # like rank 0 (at dp 4 rank 1 is not: see _hybrid)


PINNED_STEP_MS = 9.517  # measured 2026-12-01 (modelled): the same every run
