"""Errors early and plain (issue 11, item 4): what used to fail in each real process is refused once, first.

In process, no real process is started: `prism run` (through `prism_plugin.cli.main.main`), ``prism megatron``'s
flag pre-checks, the DeepSpeed section and the graph commands. Each launcher case: exit code 2, one line
``prism: invalid input: <message naming the flag>``, no traceback, no output directory created.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prism_plugin.adapters.deepspeed.section import parse_section
from prism_plugin.cli.main import main
from prism_plugin.comm.recording import FORMAT_VERSION
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.errors import ConfigError
from prism_plugin.graph import GraphError, SyntheticJob, build_1f1b_graph
from prism_plugin.launch import preflight


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory: a script, a file, a 4-rank graph, a bad graph, recordings made at N=2, two packages."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    (tmp_path / "notes.txt").write_text("a file\n")
    build_1f1b_graph(SyntheticJob(tp=1, pp=2, dp=2, num_microbatches=2, fwd_us=100, bwd_us=200, activation_bytes=64,
                                  grad_bytes=64)).save(tmp_path / "n4.graph")
    (tmp_path / "bad.graph").write_text('{"format": "prism-execution-graph", "layout": 3')
    for name, ranks in (("rec2", (0, 1)), ("rec0", (0,))):  # recorded at N=2: both ranks, rank 0 only
        (tmp_path / name).mkdir()
        for rank in ranks:
            torch.save({"format": FORMAT_VERSION, "world_size": 2, "payloads": {}}, tmp_path / name / f"rank{rank}.pt")
    for name, init in (("pkg", "raise RuntimeError('the launcher must not import me')\n"), ("plain", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(init)
        (tmp_path / name / "train.py").write_text("")
    return tmp_path


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prism: invalid input: "), err
    return lines[0]


# -- prism run: the launcher's pre-checks ---------------------------------------------------------------------
RUN_CASES = [
    # (flags before the program, program, the words the one message must hold)
    (["--world-size", "2", "--real-ranks", "0,1"], ["--", "missing.py"], "script 'missing.py' does not exist"),
    (["--world-size", "2", "--real-ranks", "0"], ["-m", "no_such_module_x"], "-m no_such_module_x: no module named"),
    (["--world-size", "2", "--real-ranks", "0"], ["-m", "plain.nope"], "-m plain.nope: no module named"),
    (["--world-size", "2", "--real-ranks", "0"], ["-m", "plain"], "'plain' is a package without a __main__ module"),
    (["--world-size", "8", "--real-ranks", "0", "--graph", "n4.graph"], ["--", "train.py"],
     "--graph 'n4.graph' describes 4 ranks but --world-size is 8"),
    (["--world-size", "4", "--real-ranks", "0", "--graph", "bad.graph"], ["--", "train.py"],
     "--graph 'bad.graph' cannot be read: not JSON"),
    (["--world-size", "8", "--real-ranks", "0", "--replay", "rec2"], ["--", "train.py"],
     "--replay 'rec2': rank0.pt was recorded at world size 2 but --world-size is 8"),
    (["--world-size", "2", "--real-ranks", "0,1", "--replay", "rec0"], ["--", "train.py"],
     "--replay 'rec0' has no recording of real rank 1 (rank1.pt)"),
    (["--world-size", "2", "--real-ranks", "0", "--record", "notes.txt"], ["--", "train.py"],
     "--record 'notes.txt' is a file, not a directory"),
    (["--world-size", "2", "--real-ranks", "0", "--trace", "notes.txt/t"], ["--", "train.py"],
     "--trace 'notes.txt/t': its parent 'notes.txt' is a file"),
]


@pytest.mark.parametrize("flags,program,words", RUN_CASES, ids=[c[2][:40] for c in RUN_CASES])
def test_prism_run_refuses_in_the_launcher(job: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                           program: list[str], words: str) -> None:
    out = job / "out"
    assert main(["run", *flags, "--output", str(out), *program]) == 2
    assert words in _one_error_line(capsys)
    assert not out.exists()  # refused before the launcher made its output directory


def test_prism_run_output_that_is_a_file(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--world-size", "2", "--real-ranks", "0", "--output", "notes.txt", "--", "train.py"]) == 2
    assert "--output 'notes.txt' is a file, not a directory" in _one_error_line(capsys)
    assert (job / "notes.txt").read_text() == "a file\n"


def test_a_long_message_stays_on_one_line_and_keeps_its_brackets(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--world-size", "2", "--real-ranks", "0,2", "--", "train.py"]) == 2
    assert "real_ranks [2] out of range for world_size=2" in _one_error_line(capsys)


def test_the_checks_pass_for_a_good_launch(job: Path) -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0, 1)), output_dir=job / "new" / "out",
                             record_dir=job / "rec", graph=job / "n4.graph")
    preflight.check_launch(config, ["train.py", "--lr", "1"])
    preflight.check_launch(config, ["-m", "prism_plugin.programs.toy_train"])
    replay = EmulationConfig(world=VirtualWorld(world_size=2, real_ranks=(1,)), replay_dir=job / "rec2",
                             data_policy="recorded")
    preflight.check_launch(replay, ["train.py"])
    assert not (job / "new").exists()  # checking creates nothing


def test_module_lookup_runs_no_code_of_the_program(job: Path) -> None:
    preflight.check_program(["-m", "pkg.train"])  # pkg/__init__.py raises if imported
    preflight.check_program(["-m", "pkg.other"])  # asked in a child, whose import of pkg fails: the real process
    assert "pkg" not in __import__("sys").modules  # will say why; the launcher imported nothing
    with pytest.raises(ConfigError, match="no module named 'plain.other'"):
        preflight.check_program(["-m", "plain.other"])


@pytest.mark.parametrize("content,words", [
    ("not a pickle", "rank0.pt is not a prism recording"),
    ({"format": 99, "world_size": 2, "payloads": {}}, "recording format 99, this prism reads format"),
])
def test_a_bad_recording_is_named(job: Path, content: object, words: str) -> None:
    path = job / "rec2" / "rank0.pt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        torch.save(content, path)
    config = EmulationConfig(world=VirtualWorld(world_size=2, real_ranks=(0,)), replay_dir=job / "rec2",
                             data_policy="recorded")
    with pytest.raises(ConfigError, match=words):
        preflight.check_recording(config)


def test_graph_errors_are_graph_errors_naming_flag_and_file(job: Path) -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,)), graph=job / "n4.graph")
    with pytest.raises(GraphError, match=r"--prism-graph '.*n4.graph' describes 4 ranks but --prism-world-size is 8"):
        preflight.check_graph(config, {"graph": "--prism-graph", "world_size": "--prism-world-size"})


# -- prism megatron / python -m prism_plugin.megatron: the wrapper's pre-checks --------------------------------
MEGATRON_CASES = [
    (["missing.py", "--prism-world-size", "4", "--prism-real-ranks", "0,1"], "script 'missing.py' does not exist"),
    (["missing.py", "--prism-world-size", "4", "--prism-real-ranks", "0"], "script 'missing.py' does not exist"),
    (["--num-layers", "2", "--prism-world-size", "4", "--prism-real-ranks", "0,1"], "name the training script first"),
    (["train.py", "--prism-world-size", "8", "--prism-real-ranks", "0,1", "--prism-graph", "n4.graph"],
     "--prism-graph 'n4.graph' describes 4 ranks but --prism-world-size is 8"),
    (["train.py", "--prism-world-size", "8", "--prism-real-ranks", "0,1", "--prism-replay", "rec2"],
     "--prism-replay 'rec2': rank0.pt was recorded at world size 2 but --prism-world-size is 8"),
    (["train.py", "--prism-world-size", "2", "--prism-real-ranks", "0,1", "--prism-record", "notes.txt"],
     "--prism-record 'notes.txt' is a file"),
    (["train.py", "--prism-world-size", "2", "--prism-real-ranks", "0", "--prism-output", "notes.txt"],
     "--prism-output 'notes.txt' is a file"),
    (["train.py", "--prism-world-size", "2", "--prism-real-ranks", "0", "--prism-stop-at-iteration", "1"],
     "--prism-stop-at-iteration 1: give an integer >= 2"),
    (["train.py", "--prism-world-size", "2", "--prism-real-ranks", "0", "--prism-stop-at-iteration", "3"],
     "--prism-stop-at-iteration 3 needs --prism-device virtual-gpu"),
]


@pytest.mark.parametrize("argv,words", MEGATRON_CASES, ids=[c[1][:40] for c in MEGATRON_CASES])
def test_megatron_wrapper_refuses_before_any_process(job: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                     words: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # not under torchrun: 2 real ranks would self-launch
        monkeypatch.delenv(key, raising=False)
    out = job / "out"
    assert main(["megatron", *argv, *([] if "--prism-output" in argv else ["--prism-output", str(out)])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("prism: invalid input:") == 1 and words in err, err
    assert not out.exists() and not dist.is_initialized()


# -- the DeepSpeed section ------------------------------------------------------------------------------------
def _ds(batch: dict[str, object] | None = None, **prism: object) -> dict[str, object]:
    section: dict[str, object] = {"world_size": 16, "real_ranks": [0, 5]}
    section.update(prism)
    return {**({"train_micro_batch_size_per_gpu": 2} if batch is None else batch), "prism": section}


DS_CASES = [
    (_ds(output=5), r'"prism.output": 5: give a path \(a string\)'),
    (_ds(record_dir=["a"]), r'"prism.record": \[\'a\'\]: give a path'),  # the older key, named as now
    (_ds(trace=True), '"prism.trace": True: give a path'),
    (_ds(graph=3), '"prism.graph": 3: give a path'),
    (_ds(faults=5), '"prism.faults": 5: give fault specs'),
    (_ds(trace_iterations="x"), '"prism.trace_iterations": "x": give an integer >= 1'),
    (_ds(output="notes.txt"), "\"prism.output\" 'notes.txt' is a file, not a directory"),
    (_ds(record="notes.txt/r"), "\"prism.record\" 'notes.txt/r': its parent 'notes.txt' is a file"),
    (_ds(world_size=8, data_policy="recorded", replay="rec2"),
     "\"prism.replay\" 'rec2': rank0.pt was recorded at world size 2 but \"prism.world_size\" is 8"),
    (_ds(graph="bad.graph"), "\"prism.graph\" 'bad.graph' cannot be read: not JSON"),
    (_ds(graph="n4.graph"), "\"prism.graph\" 'n4.graph' describes 4 ranks but \"prism.world_size\" is 16"),
]


@pytest.mark.parametrize("config,words", DS_CASES, ids=[c[1][:32] for c in DS_CASES])
def test_deepspeed_section_names_the_key(job: Path, config: dict[str, object], words: str) -> None:
    import prism_plugin.deepspeed as prism_ds

    with pytest.raises(ConfigError, match=words):
        parse_section(config)
    with pytest.raises(ConfigError, match=words):  # the drop-in refuses it before any process group
        prism_ds.init_distributed(config)
    assert not dist.is_initialized() and prism_ds.active() is None


TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_BAD = [
    # no topology: the sizes must fit SOME data-parallel size dividing N=16
    ({TBS: 3, MBS: 2}, None, r"train_batch_size=3, train_micro_batch_size_per_gpu=2 fit no data-parallel size that "
                             r"divides prism.world_size=16 .*3 != 2 \* 0 \* 16"),
    ({TBS: 6, MBS: 2, GAS: 1}, None, "data-parallel size 3 .*which does not divide prism.world_size=16"),
    ({TBS: 7, MBS: 2, GAS: 1}, None, "train_batch_size=7 is not train_micro_batch_size_per_gpu=2"),
    ({TBS: "8", MBS: 2}, None, "train_batch_size='8' must be a positive integer"),
    ({MBS: 0}, None, "train_micro_batch_size_per_gpu=0 must be a positive integer"),
    ({GAS: 2}, None, "gradient_accumulation_steps is given without train_batch_size"),
    # topology pipe 2 * data 8: dp = 16 / (2 * 1) = 8 exactly, DeepSpeed's derivation of the missing sizes
    ({TBS: 8, MBS: 2, GAS: 1}, {"pipe": 2, "data": 8},
     r"imply data-parallel size 4 but prism.topology has data=8 .*\(8 != 2 \* 1 \* 8\)"),
    ({TBS: 12}, {"pipe": 2, "data": 8},  # micro = 12 // 8 = 1, accumulation 1: 12 != 1 * 1 * 8
     r"train_micro_batch_size_per_gpu=1 \(derived\), gradient_accumulation_steps=1 \(derived\).*12 != 1 \* 1 \* 8"),
    ({TBS: 24, MBS: 2}, {"pipe": 2, "data": 8},  # accumulation = 24 // 2 // 8 = 1: 24 != 2 * 1 * 8
     r"gradient_accumulation_steps=1 \(derived\).*24 != 2 \* 1 \* 8"),
    ({TBS: 32, GAS: 3}, {"pipe": 2, "data": 8}, r"train_micro_batch_size_per_gpu=1 \(derived\).*32 != 1 \* 3 \* 8"),
]
BATCH_GOOD = [
    ({MBS: 2, GAS: 4}, None),  # DeepSpeed derives train_batch_size: always consistent
    ({TBS: 4, MBS: 2, GAS: 1}, None),  # dp 2 divides 16 (a job with pipe * model = 8)
    ({TBS: 32}, None),
    ({TBS: 32, MBS: 2}, {"pipe": 2, "data": 8}),  # accumulation 32 // 2 // 8 = 2
    ({TBS: 48, GAS: 3}, {"pipe": 2, "data": 8}),  # micro 48 // 8 // 3 = 2
    ({TBS: 16, MBS: 2, GAS: 1}, {"pipe": 2, "data": 8}),
    ({}, None),  # a config used only to initialise: DeepSpeed checks it if it is ever given to initialize
]


@pytest.mark.parametrize("batch,topology,words", BATCH_BAD, ids=[str(b) + str(t) for b, t, _ in BATCH_BAD])
def test_deepspeed_batch_arithmetic_against_the_emulated_world(batch: dict[str, object], topology: object,
                                                               words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_section(_ds(batch, **({"topology": topology} if topology else {})))


@pytest.mark.parametrize("batch,topology", BATCH_GOOD, ids=[str(b) + str(t) for b, t in BATCH_GOOD])
def test_deepspeed_batch_sizes_that_fit(batch: dict[str, object], topology: object) -> None:
    assert parse_section(_ds(batch, **({"topology": topology} if topology else {}))).world_size == 16


# -- prism slice / profile / graph / replay -------------------------------------------------------------------
GRAPH_CASES = [
    (["slice", "--layout", "pp=2", "--world-size", "4", "--devices", "2", "--out", "nodir/plan.json"],
     "--output 'nodir/plan.json': directory 'nodir' does not exist"),
    (["slice", "--layout", "pp=2", "--world-size", "4", "--devices", "2", "--out", "notes.txt/plan.json"],
     "--output 'notes.txt/plan.json': 'notes.txt' is a file"),
    (["slice", "--layout", "pp=2", "--world-size", "4", "--devices", "2", "--out", "rec2"],
     "--output 'rec2' is a directory; give a file path"),
    (["profile", "--plan", "missing.json", "--out", "prof", "--", "train.py"],
     "plan file missing.json: cannot be read"),
    (["profile", "--plan", "plan.json", "--out", "prof", "--", "missing.py"], "script 'missing.py' does not exist"),
    (["profile", "--plan", "plan.json", "--out", "notes.txt", "--", "train.py"], "--output 'notes.txt' is a file"),
    (["graph", "build", "rec2", "--layout", "pp=2", "-o", "nodir/job.graph"], "--output 'nodir/job.graph': directory"),
    (["graph", "show", "bad.graph"], "graph file bad.graph: not JSON"),
    (["replay", "bad.graph"], "graph file bad.graph: not JSON"),
    (["replay", "n4.graph", "--chrome-trace", "nodir/t.json"], "--chrome-trace 'nodir/t.json': directory 'nodir'"),
    (["replay", "n4.graph", "--blame-plot", "rec2"], "--blame-plot 'rec2' is a directory"),
]


@pytest.mark.parametrize("argv,words", GRAPH_CASES, ids=[c[1][:40] for c in GRAPH_CASES])
def test_graph_commands_refuse_missing_paths(job: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                             words: str) -> None:
    assert main(["slice", "--layout", "pp=2", "--world-size", "4", "--devices", "2", "--out", "plan.json",
                 "--json"]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    assert words in _one_error_line(capsys)
    assert not (job / "prof").exists() and not (job / "nodir").exists()
    assert sorted(os.listdir(job)) == sorted(["train.py", "notes.txt", "n4.graph", "bad.graph", "rec2", "rec0", "pkg",
                                              "plain", "plan.json"])
