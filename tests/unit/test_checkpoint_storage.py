"""Checkpoint storage figures (cost/storage.py, the profiles' ``storage:`` section) and the Megatron checkpoint
accounting that needs no process: Megatron's fully parallel save distribution, the shape check of a load, the
checkpoint kinds virtual GPUs refuse."""

from __future__ import annotations

import random
from argparse import Namespace

import pytest

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.profiles import ProfileError, load_profile, override_profile, profile_from_yaml, profile_to_yaml
from prism_plugin.cost.storage import DEFAULTS_GBYTES_PER_S, StorageSpec


def test_the_policy_defaults_are_the_per_gpu_share_of_llama3_storage_and_are_listed() -> None:
    spec = StorageSpec()
    assert DEFAULTS_GBYTES_PER_S == {"write_bandwidth_gbytes_per_s": 0.1220703125,  # 2 TB/s / 16,384 GPUs
                                     "read_bandwidth_gbytes_per_s": 0.42724609375}  # 7 TB/s / 16,384 GPUs
    assert spec.defaults_used == ("storage.write_bandwidth_gbytes_per_s", "storage.read_bandwidth_gbytes_per_s")
    assert spec.write_s(122_070_312) == pytest.approx(1.0, abs=1e-8)
    assert spec.write_s(1 << 30) == (1 << 30) * 16384 / 2e12  # 8.796093022208 s for a GiB
    assert spec.read_s(7 * 10**9) == 7e9 / (7e12 / 16384) == 16.384


def test_a_profile_sets_its_storage_figures_and_only_the_rest_are_defaults() -> None:
    profile = load_profile("dgx-h100")
    assert profile.storage == StorageSpec()  # the built-in profiles leave storage to the policy defaults
    faster = override_profile(profile, {"storage.write_bandwidth_gbytes_per_s": 2.0})
    assert faster.storage.write_s(4 * 10**9) == 2.0
    assert faster.storage.defaults_used == ("storage.read_bandwidth_gbytes_per_s",)
    assert profile_from_yaml(profile_to_yaml(faster)) == faster
    assert "storage" not in profile_to_yaml(profile)


@pytest.mark.parametrize(("storage", "message"), [
    ("write_bandwidth_gbytes_per_s: 0", "must be a positive number of 1e9 bytes/s per GPU"),
    ("write_bandwidth: 2.0", "unknown field `storage.write_bandwidth`"),
    ("[2.0]", "`storage` must be a mapping"),
])
def test_bad_storage_figures_are_refused_naming_the_field(storage: str, message: str) -> None:
    text = profile_to_yaml(load_profile("dgx-h100")) + f"storage: {storage}\n" if storage.startswith("[") else \
        profile_to_yaml(load_profile("dgx-h100")) + f"storage:\n  {storage}\n"
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace("[", r"\[")):
        profile_from_yaml(text, source="cluster.yaml")


def test_fully_parallel_share_worked_example() -> None:
    from prism_plugin.adapters.megatron.checkpoint_bytes import fully_parallel_share

    shared = [("a", 8), ("b", 8), ("c", 4), ("d", 4), ("e", 4)]
    # a -> 0, b -> 1 (18, 18, 10, 10), c -> 2, d -> 3 (18, 18, 14, 14), e -> 2 (18, 18, 18, 14)
    assert [fully_parallel_share(i, 4, 10, shared) for i in range(4)] == [18, 18, 18, 14]
    assert fully_parallel_share(0, 1, 10, shared) == 10 + 28  # alone: everything
    with pytest.raises(ValueError, match="outside a group of 4"):
        fully_parallel_share(4, 4, 0, shared)


def test_fully_parallel_share_is_megatrons_distribution_of_the_symmetric_picture() -> None:
    """Megatron's own ``distribute_shards_to_ranks`` on G members that each hold one own shard and every shared
    one gives each member the bytes `fully_parallel_share` computes (random sizes with ties)."""
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    from prism_plugin.adapters.megatron.checkpoint_bytes import fully_parallel_share

    rng = random.Random(7)
    for group in (2, 3, 8):
        own = rng.choice([0, 64, 1000])
        shared = [((f"k{i}", (i,)), rng.choice([4, 8, 8, 96, 1000])) for i in range(rng.randint(1, 40))]
        to_ranks = {sid: list(range(group)) for sid, _ in shared}
        sizes = dict(shared)
        for member in range(group):  # each member's own shard, held by it alone
            to_ranks[(f"own{member}", ())] = [member]
            sizes[(f"own{member}", ())] = own
        assignment = distribute_shards_to_ranks(to_ranks, sizes, group, set())
        for member in range(group):
            theirs = sum(sizes[sid] for sid, m in assignment.items() if m == member)
            assert fully_parallel_share(member, group, own, shared) == theirs


def test_a_load_refuses_a_checkpoint_of_another_shape_naming_the_tensor() -> None:
    from prism_plugin.adapters.megatron.checkpoint import _check_shapes

    expected = {"embedding.word_embeddings.weight": (1024, 256), "decoder.final_layernorm.weight": (256,)}
    assert _check_shapes(expected, {**expected, "optimizer.extra": (3,)}, "/ckpt") == 2
    message = (r"1 tensor\(s\) missing, 1 of another shape: decoder.final_layernorm.weight missing; "
               r"embedding.word_embeddings.weight: \(2048, 256\) in the checkpoint, \(1024, 256\) in this job")
    with pytest.raises(ConfigError, match=message):
        _check_shapes(expected, {"embedding.word_embeddings.weight": (2048, 256)}, "/ckpt")


def test_the_tracker_file_gives_the_iteration(tmp_path) -> None:
    from prism_plugin.adapters.megatron.checkpoint import _read_tracker

    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("1200\n")
    assert _read_tracker(str(tracker)) == (1200, False)
    tracker.write_text("release")
    assert _read_tracker(str(tracker)) == (0, True)
    tracker.write_text("latest")
    with pytest.raises(ConfigError, match="neither an iteration nor 'release'"):
        _read_tracker(str(tracker))


@pytest.mark.parametrize(("options", "refused"), [
    ({"save": "/c"}, None),
    ({"load": "/c", "ckpt_format": "torch"}, None),
    ({"save": "/c", "ckpt_format": "torch", "use_distributed_optimizer": False}, None),
    ({"save": "/c", "ckpt_format": "torch_dcp"}, "--ckpt-format torch_dcp"),
    ({"load": "/c", "ckpt_format": "fsdp_dtensor"}, "--ckpt-format fsdp_dtensor"),
    ({"save": "/c", "non_persistent_ckpt_type": "local", "non_persistent_save_interval": 10},
     "--non-persistent-ckpt-type local"),
    ({"save": "/c", "ckpt_format": "torch", "use_distributed_optimizer": True},
     "--ckpt-format torch with --use-distributed-optimizer"),
    ({"ckpt_format": "torch_dcp"}, None),  # no checkpoint: nothing to refuse
])
def test_virtual_gpus_accept_save_and_load_and_refuse_unmodelled_kinds(options: dict, refused: str | None) -> None:
    pytest.importorskip("megatron.core")
    from prism_plugin.adapters.megatron.refusals import checkpoint_refusals, virtual_gpu_refusals

    messages = checkpoint_refusals(Namespace(**options))
    assert [m.split(":")[0] for m in messages] == ([] if refused is None else [refused])
    assert not [m for m in virtual_gpu_refusals({**options, "transformer_impl": "local"}) if "--save" in m]
