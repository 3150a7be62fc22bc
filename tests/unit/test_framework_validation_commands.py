"""The command lines of `validation.framework` (no process is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_plugin.adapters.deepspeed.section import parse_section
from prism_plugin.adapters.megatron.wrapper import split_prism_flags
from validation.framework import FrameworkJob, RunSpec, activation_bytes, run_commands


def test_megatron_hybrid_run_is_one_wrapper_launch_with_graph_and_trace(tmp_path: Path) -> None:
    graph = tmp_path / "job.graph"
    graph.write_text("{}")
    job = FrameworkJob(framework="megatron", steps=24)
    [(argv, env)] = run_commands(job, RunSpec(out=tmp_path, real_ranks=(1,), steps=24, graph=graph))
    assert argv[1:3] == ["-m", "prism_plugin.megatron"] and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    rest, flags = split_prism_flags(argv[3:])
    assert flags.values["world-size"] == "2" and flags.values["real-ranks"] == "1"
    assert flags.values["graph"] == str(graph) and flags.values["trace"] == str(tmp_path)
    assert rest[rest.index("--pipeline-model-parallel-size") + 1] == "2"
    assert rest[rest.index("--train-iters") + 1] == "24"
    assert activation_bytes(job) == 4 * 2 * 32 * 64  # micro-batch 2 x seq 32 x hidden 64, float32


def test_deepspeed_real_run_is_two_processes_with_a_prism_section(tmp_path: Path) -> None:
    job = FrameworkJob(framework="deepspeed")
    procs = run_commands(job, RunSpec(out=tmp_path, real_ranks=(0, 1), steps=24))
    assert [env["RANK"] for _, env in procs] == ["0", "1"]
    assert {env["PRISM_STORE_FILE"] for _, env in procs} == {str(tmp_path / "store")}
    argv = procs[0][0]
    config = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
    section = parse_section(config)
    assert section.real_ranks == (0, 1) and section.world_size == 2
    assert section.emulation.trace_dir is not None and section.graph is None
    assert config["prism"]["pipe_activations"]["shape"] == [8, 1024]  # hidden 1024 by default
    assert argv[argv.index("--hidden") + 1] == "1024" and argv[argv.index("--pp") + 1] == "2"
    assert activation_bytes(job) == 4 * 8 * 1024


def test_unknown_framework_is_refused() -> None:
    with pytest.raises(ValueError, match="megatron, deepspeed"):
        FrameworkJob(framework="jax")
