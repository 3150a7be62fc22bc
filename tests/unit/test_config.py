"""Bad input is refused with an error naming the field and the fix, before any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import ConfigError, EmulationConfig, VirtualWorld, parse_rank_list
from prism_plugin.cost.profiles import ProfileError
from prism_plugin.topology import MegatronLayout


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0, "real_ranks": (0,)}, "world_size"),
        ({"world_size": -8, "real_ranks": (0,)}, "world_size"),
        ({"world_size": "8", "real_ranks": (0,)}, "world_size"),
        ({"world_size": 8, "real_ranks": (8,)}, "real_ranks"),
        ({"world_size": 8, "real_ranks": (-1,)}, "real_ranks"),
        ({"world_size": 8, "real_ranks": (1, 1)}, "more than once"),
        ({"world_size": 8, "real_ranks": ()}, "real_ranks"),
        ({"world_size": 8, "real_ranks": "0"}, "real_ranks"),
        ({"world_size": 8, "real_ranks": (0,), "gpus_per_node": 0}, "gpus_per_node"),
        ({"world_size": 8, "real_ranks": (0, 1), "devices": (0,)}, "devices"),
    ],
)
def test_virtual_world_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        VirtualWorld(**kwargs)


def test_rank_list_parsing() -> None:
    assert parse_rank_list("0,5,8-11") == (0, 5, 8, 9, 10, 11)
    with pytest.raises(ConfigError, match="real_ranks"):
        parse_rank_list("0,x")
    with pytest.raises(ConfigError, match="low-high"):
        parse_rank_list("7-4")


def test_policy_and_dirs(tmp_path) -> None:
    world = VirtualWorld(world_size=8, real_ranks=(0,))
    with pytest.raises(ConfigError, match="data_policy"):
        EmulationConfig(world=world, data_policy="garbage")
    with pytest.raises(ConfigError, match="replay_dir"):
        EmulationConfig(world=world, data_policy="recorded")
    with pytest.raises(ConfigError, match="does not exist"):
        EmulationConfig(world=world, data_policy="recorded", replay_dir=tmp_path / "missing")
    with pytest.raises(ConfigError, match="timeout_s"):
        EmulationConfig(world=world, timeout_s=0)


def test_layout_not_dividing_world() -> None:
    with pytest.raises(ValueError, match="world_size"):
        MegatronLayout(world_size=10, tp=4)


def _activate_fails(config: EmulationConfig, exc: type[Exception], match: str, **kwargs) -> None:
    with pytest.raises(exc, match=match):
        P.activate(config, **kwargs)
    assert not dist.is_initialized(), "the error must come before any process group exists"
    assert P.current_session() is None


def test_unknown_profile_refused_before_init() -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,)), profile="dgx-z900")
    _activate_fails(config, ProfileError, "dgx-z900")


def test_malformed_profile_yaml_refused_before_init(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_node: [8\n")
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,)), profile=str(bad))
    _activate_fails(config, ProfileError, "bad.yaml")


def test_more_real_ranks_than_processes_refused_before_init() -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0, 3, 5)))
    _activate_fails(config, ConfigError, "3 real ranks but 2 processes", num_processes=2)
    _activate_fails(config, ConfigError, "process index 4", process_index=4)


def test_two_real_ranks_need_a_store() -> None:
    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0, 3)))
    _activate_fails(config, ConfigError, "store")


def test_cli_bad_input_exit_code(capsys) -> None:
    from prism_plugin.cli.main import main

    assert main(["run", "--world-size", "8", "--real-ranks", "0,8", "--", "x.py"]) == 2
    assert main(["run", "--world-size", "8", "--real-ranks", "0", "--profile", "nope", "--", "x.py"]) == 2
