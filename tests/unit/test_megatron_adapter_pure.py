"""Pure parts of the Megatron adapter (no Megatron import, no process group).

The flag splitter and config of the drop-in wrapper, the refusal rules, the log stand-in rule, and
the in-place value fills for virtual data sources.
"""

from __future__ import annotations

import pytest
import torch

from prism_plugin.adapters.megatron.data import fill_valid_batch
from prism_plugin.adapters.megatron.logs import log_rank_for
from prism_plugin.adapters.megatron.pipeline import fill_if_degenerate
from prism_plugin.adapters.megatron.refusals import Refusal, check_args, refusals_for
from prism_plugin.adapters.megatron.wrapper import split_prism_flags
from prism_plugin.config.emulation import ConfigError
from prism_plugin.config.kinds import DataPolicy


# -- drop-in flags ---------------------------------------------------------------------------------
def test_prism_flags_are_stripped_anywhere_in_both_forms() -> None:
    argv = ["pretrain_gpt.py", "--num-layers", "4", "--prism-world-size", "8192", "--lr", "1e-4",
            "--prism-real-ranks=0,8191", "--prism-profile", "dgx-h100", "--prism-no-timing", "--mock-data"]
    rest, flags = split_prism_flags(argv)
    assert rest == ["pretrain_gpt.py", "--num-layers", "4", "--lr", "1e-4", "--mock-data"]
    config = flags.to_config()
    assert config.world.world_size == 8192 and config.world.real_ranks == (0, 8191)
    assert config.profile == "dgx-h100" and config.timing is False and config.data_policy is DataPolicy.MIRROR


def test_replay_flag_selects_recorded_policy(tmp_path) -> None:
    _, flags = split_prism_flags(["--prism-world-size", "4", "--prism-real-ranks", "1",
                                  "--prism-replay", str(tmp_path), "--prism-output", str(tmp_path / "out")])
    config = flags.to_config()
    assert config.data_policy is DataPolicy.RECORDED and config.replay_dir == tmp_path
    assert config.output_dir == tmp_path / "out"


@pytest.mark.parametrize("argv,fragment", [
    (["--prism-world-size", "8"], "--prism-real-ranks is required"),
    (["--prism-real-ranks", "0"], "--prism-world-size is required"),
    (["--prism-world-size", "eight", "--prism-real-ranks", "0"], "--prism-world-size eight: give an integer >= 1"),
    (["--prism-world-size", "8", "--prism-real-ranks", "9"], "out of range"),
])
def test_bad_flags_name_the_flag(argv: list[str], fragment: str) -> None:
    _, flags = split_prism_flags(argv)
    with pytest.raises(ConfigError, match=fragment):
        flags.to_config()


def test_unknown_or_valueless_prism_flag() -> None:
    with pytest.raises(ConfigError, match="unknown flag --prism-worldsize"):
        split_prism_flags(["--prism-worldsize", "8"])
    with pytest.raises(ConfigError, match="needs a value"):
        split_prism_flags(["--prism-world-size"])
    with pytest.raises(ConfigError, match="takes no value"):
        split_prism_flags(["--prism-no-timing=1"])


# -- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,flag", [
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type flex"),
    ({"moe_enable_deepep": True}, "--moe-token-dispatcher-type flex"),
    ({"nccl_ub": True}, "--use-nccl-ub"),
    ({"symmetric_ar_type": "two_shot"}, "--symmetric-ar-type"),
    ({"pipeline_model_parallel_comm_backend": "ucc"}, "--pipeline-model-parallel-comm-backend ucc"),
    ({"fake_process_group": True}, "--fake-process-group"),
])
def test_unemulable_features_are_refused(options: dict, flag: str) -> None:
    base = {"transformer_impl": "local"}
    with pytest.raises(Refusal, match=flag.replace("-", r"\-")):
        check_args({**base, **options}, cpu_mode=False)


def test_cpu_mode_refuses_cuda_only_features_only_in_cpu_mode() -> None:
    gpu_job = {"transformer_impl": "transformer_engine", "cuda_graph_impl": "transformer_engine"}
    assert refusals_for(gpu_job, cpu_mode=False) == []
    assert refusals_for(gpu_job, cpu_mode=False, virtual_gpu=True) == []  # TE's make_graphed_callables runs
    messages = refusals_for(gpu_job, cpu_mode=True)
    assert len(messages) == 2 and "--transformer-impl local" in messages[0] and "CUDA graphs" in messages[1]


@pytest.mark.parametrize("options", [{"cuda_graph_impl": "local"}, {"cuda_graph_impl": "full_iteration"},
                                     {"enable_cuda_graph": True}])
def test_virtual_gpus_refuse_megatron_s_own_graph_managers(options: dict) -> None:
    messages = refusals_for({"transformer_impl": "transformer_engine", **options}, cpu_mode=False, virtual_gpu=True)
    assert len(messages) == 1 and "pass --cuda-graph-impl transformer_engine" in messages[0]


def test_plain_job_and_gloo_twins_are_accepted() -> None:
    assert refusals_for({"transformer_impl": "local", "use_gloo_process_groups": True,
                         "moe_token_dispatcher_type": "alltoall", "distributed_backend": "gloo"}, cpu_mode=True) == []


# -- logs, fills -----------------------------------------------------------------------------------------
def test_log_stand_in_is_the_lowest_real_rank() -> None:
    assert log_rank_for(8192, (4100, 5), 8191) == 5
    assert log_rank_for(8192, (0, 8191), 8191) is None
    assert log_rank_for(16, (13,), 0) == 13


def test_valid_batch_is_written_in_place() -> None:
    batch = {"tokens": torch.full((2, 8), -7), "labels": torch.full((2, 8), 10**9),
             "loss_mask": torch.full((2, 8), float("nan")), "position_ids": torch.full((2, 8), -1),
             "attention_mask": torch.zeros(2, 1, 8, 8, dtype=torch.bool)}
    ptrs = {k: v.data_ptr() for k, v in batch.items()}
    fill_valid_batch(batch, vocab_size=5)
    assert {k: v.data_ptr() for k, v in batch.items()} == ptrs
    assert batch["tokens"].tolist()[1] == [(8 + s) % 5 for s in range(8)]
    assert batch["labels"].view(-1).tolist() == [(i + 1) % 5 for i in range(16)]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    assert batch["loss_mask"].eq(1).all()
    assert torch.equal(batch["attention_mask"][0, 0], torch.ones(8, 8, dtype=torch.bool).triu(1))


def test_degenerate_receive_is_filled_deterministically() -> None:
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    assert fill_if_degenerate(a, gen_a, gradient=False) and fill_if_degenerate(b, gen_b, gradient=False)
    assert torch.equal(a, b) and a.isfinite().all() and 0.5 < a.std() < 1.5
    g = torch.zeros(16, 2, 8)
    assert fill_if_degenerate(g, gen_a, gradient=True) and g.std() < 0.2
    kept = torch.ones(3)
    assert not fill_if_degenerate(kept, gen_a, gradient=False) and kept.eq(1).all()
