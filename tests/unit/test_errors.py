"""One error contract: every user-input error is a `ConfigError`, named files, the shared validators, one enum."""

from __future__ import annotations

import dataclasses
import json
from enum import StrEnum
from pathlib import Path

import pytest

import prism_plugin.graph as graph_pkg
from prism_plugin.cli.main import main
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.errors import (
    ConfigError,
    coerce_enum,
    int_at_least,
    parse_rank_list,
    positive_int,
    rank_in_range,
)
from prism_plugin.config.kinds import DataPolicy, Framework
from prism_plugin.cost.profiles import ProfileError, load_profile
from prism_plugin.graph import (
    ExecutionGraph,
    GraphError,
    ReplayDeadlock,
    ReplayMismatch,
    SyntheticJob,
    build_1f1b_graph,
)
from prism_plugin.graph.rank_trace import RankTrace
from prism_plugin.graph.slicing import JobLayout, SlicingPlan, make_plan, parse_layout
from prism_plugin.recipes import schema as recipe_schema
from prism_plugin.recipes.schema import RecipeError

# -- the classes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ProfileError, RecipeError, GraphError, ReplayMismatch])
def test_every_user_input_error_is_a_config_error(cls: type[Exception]) -> None:
    assert issubclass(cls, ConfigError) and issubclass(cls, ValueError)


def test_a_deadlock_is_the_outcome_of_a_replay_not_bad_input() -> None:
    assert issubclass(ReplayDeadlock, RuntimeError) and not issubclass(ReplayDeadlock, ConfigError)


def test_each_layer_raises_its_own_subclass() -> None:
    with pytest.raises(ProfileError, match="unknown profile 'dgx-z900'"):
        load_profile("dgx-z900")
    with pytest.raises(GraphError, match="--layout tp=0 must be a positive int"):
        parse_layout("tp=0,dp=1")
    with pytest.raises(GraphError, match="num_microbatches=0"):
        SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=0, fwd_us=1.0, bwd_us=2.0, activation_bytes=0,
                     grad_bytes=0)
    with pytest.raises(RecipeError, match="layout.tp must be an integer >= 1, got 0"):
        recipe_schema.Layout(tp=0)


# -- files are named -----------------------------------------------------------------------------------------


def _graph(path: Path) -> Path:
    job = SyntheticJob(tp=1, pp=2, dp=1, num_microbatches=2, fwd_us=10.0, bwd_us=20.0, activation_bytes=64,
                       grad_bytes=0)
    return build_1f1b_graph(job).save(path)


@pytest.mark.parametrize(("content", "words"), [
    (None, "cannot be read"),
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON object is expected"),
    ('{"format": "something-else"}', "not an execution graph"),
])
def test_a_bad_graph_file_error_names_the_file(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "job.graph"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GraphError, match=words) as info:
        ExecutionGraph.load(path)
    assert str(info.value).startswith(f"graph file {path}: ")


def test_a_graph_file_with_a_bad_node_or_layout_names_the_file_and_the_field(tmp_path: Path) -> None:
    data = json.loads(_graph(tmp_path / "good.graph").read_text())
    data["classes"]["pp=0"]["nodes"][0]["duration_us"] = -1.0
    (tmp_path / "node.graph").write_text(json.dumps(data))
    with pytest.raises(GraphError, match=r"graph file .*node.graph: compute node .*duration_us=-1.0"):
        ExecutionGraph.load(tmp_path / "node.graph")
    data = json.loads((tmp_path / "good.graph").read_text())
    data["layout"]["tp"] = 3  # 3 does not divide world_size 2
    (tmp_path / "layout.graph").write_text(json.dumps(data))
    with pytest.raises(GraphError, match=r"graph file .*layout.graph: execution graph layout: world_size=2"):
        ExecutionGraph.load(tmp_path / "layout.graph")
    data = json.loads((tmp_path / "good.graph").read_text())
    data["classes"]["pp=1"]["nodes"][1]["op"] = "all_reduse"
    (tmp_path / "op.graph").write_text(json.dumps(data))
    with pytest.raises(GraphError, match=r"op.graph: .*op='all_reduse' is not one of all_reduce"):
        ExecutionGraph.load(tmp_path / "op.graph")


def test_rank_trace_and_plan_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "rank0.trace.json").write_text('{"format": "prism-rank-trace", "version": 1, "rank": 4, '
                                               '"world_size": 4, "groups": [], "iterations": []}')
    with pytest.raises(GraphError, match=r"rank trace file .*rank0.trace.json: rank=4 is out of range"):
        RankTrace.load(tmp_path / "rank0.trace.json")
    with pytest.raises(GraphError, match=r"rank trace file .*missing.trace.json: cannot be read"):
        RankTrace.load(tmp_path / "missing.trace.json")
    plan = json.loads(make_plan(parse_layout("pp=2,dp=1"), 2).save(tmp_path / "plan.json").read_text())
    (tmp_path / "torch.json").write_text(json.dumps({**plan, "framework": "torch"}))
    with pytest.raises(GraphError, match=r"plan file .*torch.json: framework 'torch' cannot be sliced"):
        SlicingPlan.load(tmp_path / "torch.json")
    with pytest.raises(GraphError, match=r"plan file .*nothing.json: cannot be read"):
        SlicingPlan.load(tmp_path / "nothing.json")


def test_the_cli_reports_a_bad_graph_file_as_invalid_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(tmp_path / "missing.graph")]) == 2
    assert f"graph file {tmp_path / 'missing.graph'}: cannot be read" in " ".join(capsys.readouterr().err.split())
    assert main(["slice", "--layout", "tp=3,pp=2", "--world-size", "8", "--devices", "2"]) == 2
    assert "world size 8 is not divisible by tp*cp*pp=6" in " ".join(capsys.readouterr().err.split())


# -- the shared validators -----------------------------------------------------------------------------------


def test_positive_int() -> None:
    assert positive_int("tp", 8) == 8
    for bad in (0, -2, 1.5, True, "8", None):
        with pytest.raises(ConfigError, match=r"^tp=.* must be a positive int: pass an integer >= 1$"):
            positive_int("tp", bad)
    with pytest.raises(GraphError, match=r"^--devices=0 must be a positive int: devices per run$"):
        positive_int("--devices", 0, hint="devices per run", error=GraphError)


def test_int_at_least() -> None:
    assert int_at_least("steps.warmup", 0, 0) == 0
    with pytest.raises(ConfigError, match=r"^steps.warmup must be an integer >= 1, got 0$"):
        int_at_least("steps.warmup", 0, 1)
    with pytest.raises(RecipeError, match=r"^hang: step must be an integer >= 0, got -1 \(a step number\)$"):
        int_at_least("hang: step", -1, 0, hint="a step number", error=RecipeError)
    with pytest.raises(ConfigError, match="got False"):
        int_at_least("seed", False, 0)


def test_rank_in_range() -> None:
    assert rank_in_range(15, 16) == 15
    with pytest.raises(ConfigError, match=r"^rank=16 is out of range for world_size=16: pass an int with "
                                          r"0 <= rank < 16$"):
        rank_in_range(16, 16)
    with pytest.raises(GraphError, match=r"^peer=-1 is out of range for world_size=4: .* \(a global rank\)$"):
        rank_in_range(-1, 4, "peer", hint="a global rank", error=GraphError)
    with pytest.raises(ConfigError, match="rank=True"):
        rank_in_range(True, 4)


def test_parse_rank_list() -> None:
    assert parse_rank_list("0,5,8-11") == (0, 5, 8, 9, 10, 11)
    assert parse_rank_list(" 3 , ,4") == (3, 4)
    assert parse_rank_list("-1") == (-1,)  # the caller checks the range against its world size
    with pytest.raises(ConfigError, match=r"^real_ranks: 'x' is not a rank; give comma-separated integers"):
        parse_rank_list("0,x")
    with pytest.raises(ConfigError, match=r"^--ranks: range '7-4' is empty; write it low-high, e.g. 4-7$"):
        parse_rank_list("7-4", field_name="--ranks")
    with pytest.raises(RecipeError, match=r"^real_ranks: no ranks given; name at least one real rank"):
        parse_rank_list(" , ", error=RecipeError)


def test_coerce_enum() -> None:
    assert coerce_enum(DataPolicy, "zeros", "data_policy") is DataPolicy.ZEROS
    assert coerce_enum(DataPolicy, DataPolicy.MIRROR, "data_policy") is DataPolicy.MIRROR
    with pytest.raises(ConfigError, match=r"^data_policy='random' is not one of mirror, recorded, zeros$"):
        coerce_enum(DataPolicy, "random", "data_policy")
    with pytest.raises(RecipeError, match=r"^framework='jax' is not one of torch, megatron, deepspeed; pick one$"):
        coerce_enum(Framework, "jax", "framework", hint="pick one", error=RecipeError)


def test_config_layers_use_the_validators_wording() -> None:
    with pytest.raises(ConfigError, match="world_size=0 must be a positive int: give the job's total rank count"):
        VirtualWorld(world_size=0, real_ranks=(0,))
    world = VirtualWorld(world_size=8, real_ranks=(0,))
    with pytest.raises(ConfigError, match="iteration_marker='sometimes' is not one of explicit, optimizer-step"):
        EmulationConfig(world=world, iteration_marker="sometimes")
    with pytest.raises(ConfigError, match=r"straggler: from_step must be an integer >= 0, got -1 \(a step number"):
        EmulationConfig(world=world, faults=("straggler:ranks=1,factor=2,from_step=-1",))


def test_emulation_config_has_no_extra_field() -> None:
    assert "extra" not in {f.name for f in dataclasses.fields(EmulationConfig)}


# -- one Framework -------------------------------------------------------------------------------------------


def test_one_framework_enum() -> None:
    assert graph_pkg.Framework is recipe_schema.Framework is Framework
    assert issubclass(Framework, StrEnum)
    assert [(m.name, m.value) for m in Framework] == [("TORCH", "torch"), ("MEGATRON", "megatron"),
                                                      ("DEEPSPEED", "deepspeed")]


def test_the_slicer_refuses_torch_jobs() -> None:
    with pytest.raises(ConfigError, match="framework 'torch' cannot be sliced.*use megatron or deepspeed"):
        parse_layout("tp=2,dp=2", Framework.TORCH)
    world = parse_layout("pp=2,dp=1").world
    with pytest.raises(GraphError, match="cannot be sliced"):
        JobLayout(framework=Framework.TORCH, world=world)
    with pytest.raises(GraphError, match="framework='jax' is not one of torch, megatron, deepspeed"):
        parse_layout("tp=2,dp=2", "jax")
