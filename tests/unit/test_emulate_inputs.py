"""`prism emulate` refuses out-of-range numbers and mismatched time flags before any profiling run (issue 19).

Each case is a command a user could type: `main` must exit 2 with one line naming the flag as emulate spells it,
start no process and create no output directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_plugin.cli.main import main


@pytest.mark.parametrize(("args", "message"), [
    (["--world-size", "0"], "--world-size=0 must be a positive int"),
    (["--world-size", "8", "--gpus-per-node", "0"], "--gpus-per-node=0 must be a positive int"),
    (["--world-size", "8", "--gpus-per-node", "3"], "--gpus-per-node 3 does not divide --world-size 8"),
    (["--world-size", "4", "--warmup", "-1"], "--warmup must be"),  # 4 of a node's 8 GPUs: not a divisibility error
    (["--world-size", "8", "--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
    (["--world-size", "8", "--timeout", "0"], "--timeout 0.0: give a finite number > 0"),
    (["--world-size", "8", "--timeout", "inf"], "--timeout inf: give a finite number > 0"),
    (["--world-size", "8", "--seq-length", "0"], "--seq-length=0 must be a positive int"),
    (["--world-size", "8", "--model-flops-per-iteration", "-5"], "--model-flops-per-iteration -5.0: give a finite"),
    (["--world-size", "8", "--kernel-model", "roofline", "--kernel-table", "t.json"],
     "--kernel-table t.json is read by the table kernel model, not by --kernel-model roofline"),
    (["--world-size", "8", "--kernel-model", "fit"], "--kernel-model fit needs --kernel-fit <file>"),
])
def test_bad_numbers_and_time_flags_are_refused_before_any_run(args: list[str], message: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("PRISM_KERNEL_MODEL", "PRISM_KERNEL_TABLE", "PRISM_KERNEL_FIT", "PRISM_VIRTUAL_TIME"):
        monkeypatch.delenv(var, raising=False)
    Path("t.json").write_text("{}")
    Path("train.py").write_text("raise SystemExit('the job must not run')\n")
    out = tmp_path / "out"
    assert main(["emulate", *args, "--out", str(out), "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "prism: invalid input:" in err and message in err and "Traceback" not in err
    assert not out.exists()


def test_a_profiling_run_past_its_timeout_is_one_message_naming_the_log(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("import time\ntime.sleep(60)\n")
    assert main(["emulate", "--world-size", "8", "--timeout", "0.5", "--out", "out", "--", "train.py"]) == 1
    err = capsys.readouterr().err
    assert "prism emulate: profiling run 0 (rank 0) ran past --timeout 0.5 s and was stopped; its log: " in err
    assert "out/run0/log.txt" in err and "Traceback" not in err
    # not a terminal: a line per stage, from the start (at N = 10^7 it printed nothing for minutes)
    assert "s]: tp=1,pp=1,cp=1,ep=1,dp=8 on N=8: 1 profiling run(s)" in err
    assert "s]: profiling on virtual NVIDIA H100 80GB HBM3s, 1 run(s) at a time" in err
    assert "s]: profiling run 0 (1/1): rank 0" in err


def test_a_used_out_is_refused_unless_overwrite_replaces_a_previous_emulate(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from prism_plugin.launch.preflight import OUTPUT_MARKER

    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("import time\ntime.sleep(60)\n")
    run = ["emulate", "--world-size", "8", "--timeout", "0.2", "--out", "out"]
    assert main([*run, "--", "train.py"]) == 1  # the first run claims out/ (and its run times out)
    assert (tmp_path / "out" / OUTPUT_MARKER).read_text() == "prism emulate\n"
    (tmp_path / "out" / "run7").mkdir()  # a folder of the previous run this one would not rewrite
    capsys.readouterr()
    assert main([*run, "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--output 'out' holds a previous run (3 entries: .prism-output, run0, run7)" in err and "--overwrite" in err
    assert main([*run, "--overwrite", "--", "train.py"]) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [OUTPUT_MARKER, "run0"]  # run7 went with it
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert main(["emulate", "--world-size", "8", "--out", "mine", "--overwrite", "--", "train.py"]) == 2
    assert "is not an output of `prism emulate`" in capsys.readouterr().err and (other / "notes.txt").exists()


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--tensor-model-parallel-size", "2"], {}, "needs CUDA_DEVICE_MAX_CONNECTIONS=1 on this GPU"),
    (["--context-parallel-size", "2", "--transformer-impl", "local"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
     "--context-parallel-size 2 with --transformer-impl local: Megatron's local attention has no context"),
    (["--tensor-model-parallel-size", "8", "--num-attention-heads", "12"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
     "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8"),
    (["--expert-model-parallel-size", "2"], {}, "--expert-model-parallel-size 2 without --num-experts"),
])
def test_what_every_profiling_run_would_fail_on_is_refused_first(argv: list[str], env: dict[str, str],
                                                                 message: str) -> None:
    from prism_plugin.cli.emulate import check_megatron_job
    from prism_plugin.config.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_megatron_job(argv, (9, 0), env)


def test_jobs_megatron_accepts_pass_the_checks() -> None:
    from prism_plugin.cli.emulate import check_megatron_job

    check_megatron_job(["--tensor-model-parallel-size", "2"], (10, 0), {})  # Blackwell: no such requirement
    check_megatron_job(["--tensor-model-parallel-size", "8", "--num-attention-heads", "32"], (9, 0),
                       {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    check_megatron_job(["--context-parallel-size", "2", "--transformer-impl", "local"], (9, 0),
                       {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PRISM_ATTENTION": "flash"})
    check_megatron_job(["--expert-model-parallel-size", "4", "--num-experts", "8"], (9, 0), {})
    check_megatron_job(["--pipeline-model-parallel-size", "16"], (9, 0), {})  # tied: the embedding group's role
    check_megatron_job(["--pipeline-model-parallel-size", "16", "--untie-embeddings-and-output-weights"], (9, 0), {})


@pytest.mark.parametrize("jobs", [1, 2])
def test_jobs_runs_profiling_runs_at_once_and_one_failure_stops_the_rest(jobs: int, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipelined job has two classes of ranks: two profiling runs. --jobs 2 starts both at once; one at a time,
    the first one's failure (here its --timeout) means the second never starts."""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("import time\ntime.sleep(60)\n")
    argv = ["emulate", "--world-size", "8", "--timeout", "1", "--jobs", str(jobs), "--out", "out", "--",
            "train.py", "--pipeline-model-parallel-size", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "ran past --timeout 1 s and was stopped" in err
    started = sorted(p.parent.name for p in (tmp_path / "out").glob("run*/log.txt"))
    assert started == (["run0", "run1"] if jobs == 2 else ["run0"])
    assert main(["emulate", "--world-size", "8", "--jobs", "0", "--out", "o2", "--", "train.py"]) == 2
    assert "--jobs=0 must be a positive int" in capsys.readouterr().err


def test_a_hybrid_rank_that_is_a_profiled_one_passes_the_checks(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``--hybrid 0,7`` of a PP2 job: rank 0 is also stage 0's profiled rank (the environment check listed it twice
    and refused the command, "real_ranks lists [0] more than once"); the profiling runs are each told to end at the
    mark of the last iteration they state."""
    from prism_plugin.cli import emulate as emulate_mod

    started: list[list[str]] = []

    def no_runs(specs: list[tuple[list[str], Path, int, str]], *args: object, **kwargs: object) -> list[object]:
        started.extend(command for command, *_ in specs)
        raise KeyboardInterrupt  # the checks passed: stop before any run

    monkeypatch.setattr(emulate_mod, "_run_all", no_runs)
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('the job must not run')\n")
    job = [str(tmp_path / "pretrain_gpt.py"), "--pipeline-model-parallel-size", "2",
           "--untie-embeddings-and-output-weights", "--train-iters", "500000"]
    with pytest.raises(KeyboardInterrupt):
        emulate_mod.emulate(job, world_size=8, profile="dgx-h100", out=tmp_path / "em", hybrid="0,7")
    assert [c[c.index("--prism-real-ranks") + 1] for c in started] == ["0", "4"]
    assert all(c[-4:] == ["--prism-iterations", "3", "--prism-stop-at-iteration", "3"] for c in started)


def test_dp_last_mapping_gives_megatron_rank_order() -> None:
    # --use-tp-pp-dp-mapping: Megatron orders ranks tp-cp-ep-pp-dp, so a pipeline's peers are 2 ranks apart here
    from prism_plugin.cli.emulate import layout_of_megatron_args
    from prism_plugin.graph.slicing import parse_layout

    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert layout_of_megatron_args(argv, 8) == "tp=2,pp=2,cp=1,ep=1,dp=2"
    text = layout_of_megatron_args([*argv, "--use-tp-pp-dp-mapping"], 8)
    assert text == "tp=2,pp=2,cp=1,ep=1,dp=2,order=tp-cp-ep-pp-dp"
    world = parse_layout(text, "megatron", 8).world
    assert world.group_of(1, "pp") == (1, 3) and world.group_of(1, "dp") == (1, 5)
    assert parse_layout(text.split(",order")[0], "megatron", 8).world.group_of(1, "pp") == (1, 5)
