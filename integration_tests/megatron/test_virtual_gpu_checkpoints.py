"""Megatron's checkpointing and logging options through the drop-in on virtual GPUs, and its policy defaults.

The repo's ``pretrain_gpt.py`` trains a small GPT (2 layers, hidden 256, FFN 1024, 4 heads, seq 128, vocab 1000,
TP2, bf16, distributed optimizer, mock data) as rank 1 of 8: TP rank 1, data-parallel rank 0 of 4 (DP group
[1, 3, 5, 7]). ``--save`` writes nothing and the summary's ``megatron.checkpoints`` reports each save: its bytes
(counted from Megatron's own state dict, fake tensors' shapes), what this rank writes, the modelled write time
(the profile's ``storage.write_bandwidth_gbytes_per_s``: dgx-h100 sets none, so the policy default of
``cost/storage.py``, 2e12 / 16,384 B/s per GPU) and the host memory of its staged copies. ``--load`` of a
checkpoint made of metadata only (no tensor data file exists) resumes at its iteration. Figures: bytes exact from
the architecture; times modelled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "prism_plugin" / "programs" / "pretrain_gpt.py"
H, FFN, HEADS, LAYERS, SEQ, VOCAB, TP, DP = 256, 1024, 4, 2, 128, 1000, 2, 4
ARGS = ["--transformer-impl", "local", "--tensor-model-parallel-size", str(TP), "--num-layers", str(LAYERS),
        "--hidden-size", str(H), "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters",
        "0", "--eval-interval", "1000", "--disable-gloo-process-groups"]
WRITE_BYTES_PER_S = 2e12 / 16384  # cost/storage.py's policy default: Llama 3's 2 TB/s over 16,384 GPUs
READ_BYTES_PER_S = 7e12 / 16384  # and its 7 TB/s peak
ITERATION_S = 0.0265496  # Megatron's interval timer over iteration 2 on the emulated clock (modelled)

PADDED_VOCAB = -(-VOCAB // (128 * TP)) * 128 * TP  # 1024: Megatron pads to --make-vocab-size-divisible-by 128 x TP
SHARDED = {  # this TP rank's tensors split over TP (bf16 elements): written by one member of the DP group each
    "embedding.word_embeddings.weight": PADDED_VOCAB // TP * H,  # 512 x 256
    **{f"layer{i}.{name}": n for i in range(LAYERS) for name, n in (
        ("linear_qkv.weight", 3 * H // TP * H), ("linear_qkv.bias", 3 * H // TP),  # 384 x 256, 384
        ("linear_proj.weight", H * H // TP),  # 256 x 128 (its bias is replicated over TP)
        ("linear_fc1.weight", FFN // TP * H), ("linear_fc1.bias", FFN // TP),  # 512 x 256, 512
        ("linear_fc2.weight", H * FFN // TP))},  # 256 x 512 (its bias is replicated over TP)
}
REPLICATED = (SEQ * H  # learned position embeddings, replicated over TP
              + LAYERS * (4 * H + H + H)  # per layer: 2 LayerNorms (weight, bias), the proj and fc2 biases
              + 2 * H)  # the final LayerNorm
PARAMS = sum(SHARDED.values()) + REPLICATED  # this rank's parameters (the output layer is tied to the embedding)


def _run(out: Path, *extra: str, profile: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *ARGS, *extra,
                           "--prism-world-size", "8", "--prism-real-ranks", "1", *profile, "--prism-device",
                           "virtual-gpu", "--prism-output", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def _summary(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "rank1.summary.json").read_text())
    assert summary["device_mode"] == "virtual-gpu" and summary["exit_code"] == 0
    return summary


def _iterations(log: str) -> list[str]:
    return re.findall(r"iteration\s+(\d+)/\s+\d+ \|", log)


def test_parameters_of_this_rank() -> None:
    assert PADDED_VOCAB == 1024 and PARAMS == 955_648
    assert PARAMS % DP == 0  # the distributed optimizer's buffer splits evenly: 238,912 elements per DP rank


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """No --prism-profile: the default. Saves at iterations 1 and 2 (sync, torch_dist), --load of a path that does
    not exist (Megatron starts from scratch), and the logging flags of Megatron's functional tests."""
    tmp = tmp_path_factory.mktemp("saved")
    proc = _run(tmp / "out", "--train-iters", "2", "--save", str(tmp / "ckpt"), "--save-interval", "1", "--load",
                str(tmp / "no-such-checkpoint"), "--log-num-zeros-in-grad", "--log-params-norm", "--log-throughput",
                "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--tensorboard-dir", str(tmp / "tb"),
                "--timing-log-level", "2",
                "--check-weight-hash-across-dp-replicas-interval", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc, tmp


def test_a_virtual_gpu_without_a_profile_runs_on_dgx_h100_and_says_so(saved: Any) -> None:
    proc, tmp = saved
    summary = _summary(tmp / "out")
    lines = [line for line in proc.stderr.splitlines() if "without --prism-profile or --prism-gpu" in line]
    assert lines == ["prism: --prism-device virtual-gpu without --prism-profile or --prism-gpu: running on profile "
                     "dgx-h100 (8 H100 SXM per node, its links and kernel figures); name another with "
                     "--prism-profile <name>"]
    assert summary["profile"] == "dgx-h100"
    assert summary["virtual_gpu"]["gpu"] == "NVIDIA H100 80GB HBM3"
    defaults = {d["setting"]: d["value"] for d in summary["megatron"]["policy_defaults"]}
    assert defaults == {"--prism-profile": "dgx-h100", "storage.write_bandwidth_gbytes_per_s": 2000 / 16384}


def test_each_save_reports_its_bytes_time_and_memory_and_writes_nothing(saved: Any) -> None:
    proc, tmp = saved
    assert not (tmp / "ckpt").exists()
    assert _iterations(proc.stdout) == ["1", "2"]  # --load of a missing path: from scratch, as Megatron does
    assert "will not load any checkpoints and will start from random" in proc.stdout
    checkpoints = _summary(tmp / "out")["megatron"]["checkpoints"]
    assert checkpoints["loads"] == []
    model = PARAMS * 2  # bf16
    optimizer = PARAMS // DP * 3 * 4  # this DP rank's fp32 main params, exp_avg and exp_avg_sq
    assert (model, optimizer) == (1_911_296, 2_866_944)
    # Fully parallel save over the DP group (Megatron's default): each member writes its own optimizer range, and
    # the TP-sharded tensors every member holds (the TP-replicated ones are written by TP rank 0's group) are spread
    # largest first to the least-loaded member, ties to the lowest: fc1.weight of layers 0 and 1 and fc2.weight of
    # layers 0 and 1 (262,144 B each) to members 0-3, the word embeddings (262,144 B) to member 0, then the smaller
    # ones to members 1-3. This rank, member 0, writes its range, two 262,144 B shards and nothing else.
    written = optimizer + 2 * 2 * SHARDED["embedding.word_embeddings.weight"]
    assert written == 3_391_232
    saves = checkpoints["saves"]
    assert [s["iteration"] for s in saves] == [1, 2]
    for save in saves:
        assert save["format"] == "torch_dist" and not save["async"] and save["directory"] == str(tmp / "ckpt")
        assert (save["model_bytes"], save["optimizer_bytes"]) == (model, optimizer)
        assert save["other_bytes"] > 0  # RNG states (counted, not written: objects)
        assert save["written_bytes"] == save["host_bytes"] == written  # every written tensor staged on the host
        assert save["write_s"] == save["blocking_s"] == written / WRITE_BYTES_PER_S == 0.027780972544
        assert save["device_bytes"] == 0  # the state dict views the model and optimizer: nothing allocated
    assert checkpoints["storage"]["defaults_used"] == ["storage.write_bandwidth_gbytes_per_s",
                                                       "storage.read_bandwidth_gbytes_per_s"]
    said = [line for line in proc.stdout.splitlines() if "not written to" in line]
    assert len(said) == 2 and "would write 3,391,232 bytes in 0.028 s (modelled)" in said[0]


def test_logging_flags_of_megatrons_functional_tests_run(saved: Any) -> None:
    proc, tmp = saved
    logged = re.findall(r"num zeros: ([0-9.]+) \| params norm: ([0-9.]+) \|", proc.stdout)
    assert logged == [("0.0", "1.000")] * 2  # the value policy's stated and float answers
    assert "throughput per GPU (TFLOP/s/GPU)" in proc.stdout
    values = _summary(tmp / "out")["virtual_gpu"]["values"]
    zeros = [b for b in values["by_site"] if b["site"].endswith("clip_grads.py:275 (count_zeros_fp32)")]
    assert zeros == [{"site": zeros[0]["site"], "value": "0", "count": 2}]  # one read per iteration
    assert [s["function"] for s in values["stated"]] == ["megatron/core/optimizer/clip_grads.py:count_zeros_fp32",
                                                         "megatron/core/transformer/moe/moe_utils.py:sinkhorn",
                                                         "megatron_fsdp/uneven_dtensor.py:validate_uneven_dtensor"]
    norms = [b for b in values["by_site"] if "(calc_params_l2_norm)" in b["site"]]
    assert [b["count"] for b in norms] == [2] and norms[0]["value"] == "1.0"
    # --check-weight-hash-across-dp-replicas-interval 1: the replicas' hashes match (mirrored): Megatron checks once
    # before the first iteration, then after each iteration
    hashes = [b for b in values["by_site"] if b["site"].endswith("check_param_hashes_across_dp_replicas")]
    assert [(b["value"], b["count"]) for b in hashes] == [(
        "True (--check-weight-hash-across-dp-replicas-interval: every virtual replica mirrors this rank's "
        "parameters)", 3)]
    if importlib.util.find_spec("tensorboard") is None:  # Megatron warns and writes nothing; prism says why
        assert "the tensorboard package is not installed on this host" in proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp / "tb").exists()


def test_megatrons_logs_and_tensorboard_show_emulated_time_and_modelled_memory(saved: Any) -> None:
    """Megatron's timers read the emulated clock (modelled seconds, exact), so its iteration time, TFLOP/s/GPU and
    TensorBoard's time scalars are the emulated job's, not this host's ~0.5 s of fake dispatch per iteration; its
    memory scalars are the allocator model's. Read back with the tensorboard package."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, tmp = saved
    summary = _summary(tmp / "out")
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    scalar = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    (step, seconds), = scalar["iteration-time"]  # Megatron writes it from the second iteration on
    assert step == 2 and seconds == pytest.approx(ITERATION_S, rel=1e-6)  # float32 in the event file
    logged = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+) \|", proc.stdout)
    assert logged[1] == f"{1000 * ITERATION_S:.1f}"
    flops = summary["megatron"]["model_flops_per_iteration"]
    assert scalar["throughput"][1][1] == pytest.approx(flops / (ITERATION_S * 1e12 * 8), rel=1e-6)
    device = summary["virtual_gpu"]["devices"][0]
    assert scalar["mem-max-allocated-bytes"][-1][1] == device["peak_allocated_bytes"]  # modelled, exact
    assert summary["megatron"]["timers"] == {
        "clock": "emulated", "across_ranks": "every rank's row is this rank's (symmetric arrivals)",
        "mirrored_reports": 10}  # each report Megatron made: set-up, per iteration its log, TensorBoard, saves
    assert {"forward-backward-time", "optimizer-time"} <= set(scalar)  # --timing-log-level 2
    pairs = re.findall(r"forward-backward \.+: \(([0-9.]+), ([0-9.]+)\)", proc.stdout)
    assert len(pairs) == 2 and all(low == high for low, high in pairs)  # (min, max) across ranks: mirrored


def _metadata_checkpoint(root: Path, iteration: int) -> int:
    """A torch_dist checkpoint of this model made of its metadata only: the tracker, metadata.json, common.pt
    (args, iteration, FLOPs) and torch.distributed.checkpoint's .metadata with each tensor's global shape. No tensor
    data file exists, so a load that read values would fail. Returns the number of model tensors."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    shapes = {"embedding.word_embeddings.weight": (PADDED_VOCAB, H), "embedding.position_embeddings.weight": (SEQ, H),
              "decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,)}
    for name, shape in (("self_attention.linear_qkv.layer_norm_weight", (H,)),
                        ("self_attention.linear_qkv.layer_norm_bias", (H,)),
                        ("self_attention.linear_qkv.weight", (3 * H, H)), ("self_attention.linear_qkv.bias", (3 * H,)),
                        ("self_attention.linear_proj.weight", (H, H)), ("self_attention.linear_proj.bias", (H,)),
                        ("mlp.linear_fc1.layer_norm_weight", (H,)), ("mlp.linear_fc1.layer_norm_bias", (H,)),
                        ("mlp.linear_fc1.weight", (FFN, H)), ("mlp.linear_fc1.bias", (FFN,)),
                        ("mlp.linear_fc2.weight", (H, FFN)), ("mlp.linear_fc2.bias", (H,))):
        shapes[f"decoder.layers.{name}"] = (LAYERS, *shape)  # the layers stacked, as Megatron's dist-ckpt keys them
    root.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir()
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    args = Namespace(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, add_position_embedding=True,
                     consumed_train_samples=iteration * 4, skipped_train_samples=0, consumed_valid_samples=0)
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0,
                "num_floating_point_operations_so_far": 123_456_789}, directory / "common.pt")
    metadata = Metadata(state_dict_metadata={
        key: TensorStorageMetadata(properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size(shape),
                                   chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                                                sizes=torch.Size(shape))])
        for key, shape in shapes.items()})
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return len(shapes)


def test_load_reads_the_metadata_resumes_there_and_async_saves_hold_host_memory(tmp_path: Path) -> None:
    """--load of a metadata-only checkpoint at iteration 5, --train-iters 7: iterations 6 and 7 run with the
    checkpoint's consumed samples; --async-save --use-persistent-ckpt-worker saves at 6 and 7 in the background,
    without a fully parallel save (each rank writes its main replicas)."""
    ckpt = tmp_path / "ckpt"
    tensors = _metadata_checkpoint(ckpt, 5)
    files = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    proc = _run(tmp_path / "out", "--train-iters", "7", "--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                "2", "--async-save", "--use-persistent-ckpt-worker", "--no-ckpt-fully-parallel-save",
                profile=("--prism-profile", "dgx-h100"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == files  # nothing written
    assert _iterations(proc.stdout) == ["6", "7"]
    assert re.findall(r"consumed samples:\s+(\d+)", proc.stdout) == ["24", "28"]  # 5 x 4 from the checkpoint, on
    summary = _summary(tmp_path / "out")
    checkpoints = summary["megatron"]["checkpoints"]
    read = PARAMS * 2 + PARAMS // DP * 3 * 4  # the model and the optimizer state a load fills (none is read)
    assert checkpoints["loads"] == [{"directory": str(ckpt), "format": "torch_dist", "iteration": 5,
                                     "tensors_checked": tensors, "read_bytes": read,
                                     "read_s": read / READ_BYTES_PER_S, "values_read": False}]
    assert tensors == 16 and read == 4_778_240
    saves = checkpoints["saves"]
    assert [(s["iteration"], s["async"], s["blocking_s"]) for s in saves] == [(6, True, 0.0), (7, True, 0.0)]
    # main replicas: this rank's optimizer range and every TP-sharded tensor (this rank is DP rank 0); the
    # TP-replicated ones are TP rank 0's to write
    written = PARAMS // DP * 3 * 4 + sum(SHARDED.values()) * 2
    assert written == 2_866_944 + 1_838_592
    assert all(s["written_bytes"] == s["host_bytes"] == written for s in saves)  # held until the write ends
    assert all(s["write_s"] == written / WRITE_BYTES_PER_S for s in saves)
    assert checkpoints["persistent_worker_started"] is False
    assert "no checkpoint worker process started" in proc.stdout
    assert {d["setting"] for d in summary["megatron"]["policy_defaults"]} == {
        "storage.write_bandwidth_gbytes_per_s", "storage.read_bandwidth_gbytes_per_s"}


def test_messages_name_the_drop_in_flags(tmp_path: Path) -> None:
    """A profile without a GPU model: refused before any process starts, naming --prism-profile / --prism-gpu."""
    proc = _run(tmp_path / "out", "--train-iters", "1", profile=("--prism-profile", "local-cpu-gloo"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "prism: invalid input: --prism-device virtual-gpu needs a GPU model: profile 'local-cpu-gloo' names none; "
        "use a GPU profile (--prism-profile dgx-h100) or name the model (--prism-gpu h100-sxm)")
    if importlib.util.find_spec("wandb") is None:  # W&B without its package: refused up front, not at start-up
        proc = _run(tmp_path / "w", "--train-iters", "1", "--wandb-project", "p", "--wandb-exp-name", "e")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("prism: invalid input: --wandb-project p: the wandb package is not installed on this host (Megatron's "
                "last rank imports it at start-up); pip install wandb, or leave out --wandb-project"
                ) in proc.stderr.splitlines() and "Traceback" not in proc.stderr


def test_a_legacy_save_writes_each_storage_of_the_model_and_optimizer_state(tmp_path: Path) -> None:
    """--ckpt-format torch with Megatron's non-distributed optimizer: data-parallel rank 0 (this rank) torch.saves its
    whole state dict: bf16 parameters, fp32 main parameters and both Adam moments, RNG states."""
    argv = [a for a in ARGS if a != "--use-distributed-optimizer"]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.megatron", str(SCRIPT), *argv, "--train-iters", "1",
                           "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--ckpt-format", "torch",
                           "--prism-world-size", "8", "--prism-real-ranks", "1", "--prism-profile", "dgx-h100",
                           "--prism-device", "virtual-gpu", "--prism-output", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert not (tmp_path / "ckpt").exists()
    (save,) = _summary(out)["megatron"]["checkpoints"]["saves"]
    assert save["format"] == "torch" and (save["model_bytes"], save["optimizer_bytes"]) == (PARAMS * 2, PARAMS * 12)
    # torch.save writes every storage once: here each tensor has its own
    assert save["written_bytes"] == save["model_bytes"] + save["optimizer_bytes"] + save["other_bytes"]
    assert save["write_s"] == save["written_bytes"] / WRITE_BYTES_PER_S
    # host memory: torch.save copies one storage at a time; the largest is a 131,072-element fp32 main parameter
    assert save["host_bytes"] == SHARDED["layer0.linear_fc1.weight"] * 4 == 524_288
