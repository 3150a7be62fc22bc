"""The "prism" section of a DeepSpeed config: parsing, and clear errors before any process group exists.

Pure: these tests do not import DeepSpeed (a bad section fails before the adapter touches it) and
check that torch.distributed is still uninitialised after every error.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from prism_plugin.adapters.deepspeed.section import ALLOWED_KEYS, TensorSpec, parse_section
from prism_plugin.config.emulation import ConfigError
from prism_plugin.config.kinds import DataPolicy


def _cfg(**prism):
    base = {"world_size": 16, "real_ranks": [0, 5]}
    base.update(prism)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "prism": base}


def test_minimal_section():
    s = parse_section(_cfg())
    assert s.world_size == 16 and s.real_ranks == (0, 5)
    assert s.emulation.profile == "local-cpu-gloo" and s.emulation.data_policy is DataPolicy.MIRROR
    assert s.emulation.world.gpus_per_node == 8 and s.topology is None and s.pipe_activations is None


def test_full_section_and_file(tmp_path):
    out = tmp_path / "out"
    cfg = _cfg(real_ranks="0,8-9", profile="dgx-h100", output=str(out), gpus_per_node=4, timing=False,
               topology={"pipe": 4, "data": 4}, pipe_activations=[{"shape": [2, 8]}, {"shape": [2], "dtype": "int64"}])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    s = parse_section(path)
    assert s.real_ranks == (0, 8, 9) and s.emulation.output_dir == out and s.emulation.timing is False
    assert s.topology == {"pipe": 4, "data": 4, "model": 1}
    assert s.pipe_activations == (TensorSpec(shape=(2, 8)), TensorSpec(shape=(2,), dtype="int64"))
    assert s.ds_config["train_micro_batch_size_per_gpu"] == 2


def test_absent_section():
    assert parse_section({"train_batch_size": 8}, required=False) is None
    with pytest.raises(ConfigError, match='no "prism" section'):
        parse_section({"train_batch_size": 8})


BAD = [
    ({"wrold_size": 16}, r"unknown keys \['wrold_size'\]"),
    ({"world_size": None}, "world_size.*required"),
    ({"world_size": 0}, "world_size.*integer >= 1"),
    ({"real_ranks": None}, "real_ranks.*required"),
    ({"real_ranks": [0, 16]}, r"real_ranks \[16\] out of range for world_size=16"),
    ({"real_ranks": [3, 3]}, "more than once"),
    ({"real_ranks": "0,x"}, "not a rank"),
    ({"real_ranks": [0.5]}, "give a list of ranks"),
    ({"topology": {"pipe": 3, "data": 4}}, r"spans 12 ranks but \"prism.world_size\" is 16"),
    ({"topology": {"pipe": 4, "tensor": 4}}, "must map some of"),
    ({"topology": {"pipe": 2.5, "data": 4}}, "positive integer"),
    ({"data_policy": "random"}, "data_policy.*use one of mirror, recorded, zeros"),
    ({"data_policy": "recorded"}, 'needs "prism.replay"'),
    ({"timing": "maybe"}, "on or off"),
    ({"kernel_model": "table", "device": "virtual-gpu"}, "needs \"prism.kernel_table\""),
    ({"memory_snapshot": "snap.pickle", "real_ranks": [0, 1]}, r"put \{rank\} in the name"),
    ({"record": "a", "record_dir": "b"}, "gives record twice"),
    ({"pipe_activations": {"shape": [2, -1]}}, "non-negative"),
    ({"pipe_activations": {"shape": [2], "dtype": "float8"}}, "dtype.*unknown"),
    ({"graph": "/nonexistent/job.graph"}, "does not exist"),
]


@pytest.mark.parametrize("prism,message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_section_errors(prism, message):
    with pytest.raises(ConfigError, match=message):
        parse_section(_cfg(**prism))


def test_batch_arithmetic_must_fit_world():
    cfg = _cfg()
    cfg.update(train_batch_size=2 * 1 * 3)  # data-parallel 3 does not divide 16
    with pytest.raises(ConfigError, match="data-parallel size 3.*does not divide prism.world_size=16"):
        parse_section(cfg)
    cfg.update(train_batch_size=2 * 4)  # dp 4 but the declared topology says data=8
    cfg["prism"]["topology"] = {"pipe": 2, "data": 8}
    with pytest.raises(ConfigError, match="data-parallel size 4 but prism.topology has data=8"):
        parse_section(cfg)
    cfg.update(train_batch_size=2 * 8)
    assert parse_section(cfg).topology == {"pipe": 2, "data": 8, "model": 1}


def test_auto_batch_sizes_are_left_to_the_trainer_that_fills_them():
    """The Hugging Face Trainer's ds_config says "auto" and fills the figures in from its own arguments and the
    world size it sees (the emulated one): "auto" is not refused, and not checked against the world here."""
    cfg = _cfg()
    cfg.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    assert parse_section(cfg).emulation.world.world_size == 16
    cfg.update(train_micro_batch_size_per_gpu="automatic")
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu='automatic' must be a positive integer"):
        parse_section(cfg)


def test_allowed_keys_documented():
    from prism_plugin.config.reference import markdown

    reference = markdown()  # docs/configuration.md: every key of the section, older spellings included
    for key in ALLOWED_KEYS:
        assert f'`"{key}"`' in reference


INIT_BAD = [
    (_cfg(world_size=8, real_ranks=[9]), ConfigError, "out of range"),
    (_cfg(bogus=1), ConfigError, "unknown keys"),
    (_cfg(topology={"pipe": 3}), ConfigError, "spans 3 ranks"),
]


@pytest.mark.parametrize("config,exc,message", INIT_BAD, ids=["range", "unknown", "topology"])
def test_init_distributed_fails_before_any_group(config, exc, message):
    import prism_plugin.deepspeed as prism_ds

    with pytest.raises(exc, match=message):
        prism_ds.init_distributed(config)
    assert not dist.is_initialized() and prism_ds.active() is None


def test_init_distributed_refuses_bad_graph_and_process_mismatch(tmp_path, monkeypatch):
    import prism_plugin.deepspeed as prism_ds

    graph = tmp_path / "job.graph"
    graph.write_text("{}")
    with pytest.raises(ConfigError, match="cannot be read"):
        prism_ds.init_distributed(_cfg(graph=str(graph)))
    assert not dist.is_initialized() and prism_ds.active() is None
    with pytest.raises(ConfigError, match="prism.*trace_iterations|trace_max_iterations"):
        prism_ds.init_distributed(_cfg(trace=str(tmp_path / "t"), trace_iterations=0))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun started 3 processes, the section lists 2 real ranks
    with pytest.raises(ConfigError, match="lists 2 ranks but the launcher started 3 processes"):
        prism_ds.init_distributed(_cfg())
    assert not dist.is_initialized() and prism_ds.active() is None
