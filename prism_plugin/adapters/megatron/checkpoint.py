"""Megatron checkpointing on virtual GPUs: ``--save`` / ``--load`` accepted, nothing written, values never read.

A virtual GPU's tensors are fakes (shapes, no values), so a save has nothing to write and a load nothing to read
into. What a save costs still matters at scale (seconds of stalled training, host memory for the copies), so the
seams of ``megatron.training.checkpointing`` are replaced (`install`, wherever they are bound; undone with the
adapter's patches):

- ``save_checkpoint``: runs Megatron's own gathering (``get_rng_state`` with its data-parallel object gather,
  the rerun state, ``generate_state_dict`` with ``_build_sharded_state_dict_metadata``), counts the state dict
  (`checkpoint_bytes`), issues the save's barriers, and records a `SaveRecord`: its bytes, what this rank
  writes, the modelled write time (the profile's ``storage.write_bandwidth_gbytes_per_s``, `cost.storage`), the
  host memory of the device-to-host copies (``torch_dist``: every tensor the rank writes, staged on the host
  before writing, held until the write ends, in the background with ``--async-save``; ``torch``: one storage at
  a time) and the device memory the state dict holds (allocated while it was built, measured on the allocator
  model). Nothing is written: no directory, no tracker file. Megatron's own checks stay (async save of a legacy
  checkpoint raises its ``NotImplementedError``);
- ``load_checkpoint``: a ``--load`` directory without ``latest_checkpointed_iteration.txt`` (or no directory) goes
  to Megatron's own code, which starts from scratch as it does on a GPU. A real checkpoint is read for its
  metadata only: the iteration (the tracker file; ``--ckpt-step``), the common state (``args``, iteration,
  FLOPs so far, the LR scheduler's numbers: ``torch_dist``'s ``common.pt`` / metadata, a legacy file memory-mapped
  onto the meta device) and the tensors' shapes, checked against this job's model (a missing tensor or another
  shape is refused, as Megatron's load would fail). No tensor value is read: the model keeps its initial fakes;
- ``init_persistent_async_worker`` (``--async-save --use-persistent-ckpt-worker``): no worker process is started
  (it would only write).

Limitations: the save's own exchanges (sharding validation, torch.distributed.checkpoint's planning gathers) and
the load's (the iteration all-reduce, the fully parallel load's exchanges) are not issued; a save's time is
reported, not put on the emulated clock; the device-to-host copy time is not modelled. Refused up front
(`refusals.virtual_gpu_refusals`): ``torch_dcp`` / ``fsdp_dtensor`` formats, non-persistent ``local`` /
``in_memory`` checkpoints, a legacy save of the distributed optimizer.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prism_plugin.adapters.megatron import checkpoint_bytes as cb
from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.storage import StorageSpec
from prism_plugin.device.undo import Patches

__all__ = ["CheckpointSeams", "LoadRecord", "SaveRecord", "install"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveRecord:
    """One save on this rank (module docstring)."""

    iteration: int
    ckpt_format: str
    """``torch_dist`` or ``torch`` (legacy)."""
    async_save: bool
    directory: str
    """Where Megatron would have written (nothing is)."""
    state_dict: cb.SectionBytes
    """Every tensor of this rank's state dict, by section."""
    written_bytes: int
    """What this rank writes (`checkpoint_bytes`); 0 on a rank that writes nothing (legacy: data-parallel rank > 0)."""
    write_s: float
    """written_bytes at the profile's per-GPU write bandwidth (modelled)."""
    blocking_s: float
    """How long training waits for storage: write_s, or 0.0 with ``--async-save`` (written in the background)."""
    host_bytes: int
    """Host memory the save path holds: the staged device-to-host copies."""
    device_bytes: int
    """Device memory the state dict holds while the save runs (allocator model, measured)."""

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "format": self.ckpt_format, "async": self.async_save,
                "directory": self.directory, "state_dict_bytes": self.state_dict.total_bytes,
                "model_bytes": self.state_dict.model_bytes, "optimizer_bytes": self.state_dict.optimizer_bytes,
                "other_bytes": self.state_dict.other_bytes, "written_bytes": self.written_bytes,
                "write_s": self.write_s, "blocking_s": self.blocking_s, "host_bytes": self.host_bytes,
                "device_bytes": self.device_bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadRecord:
    """A load of a real checkpoint on this rank: its metadata, checked (module docstring)."""

    directory: str
    ckpt_format: str
    iteration: int
    tensors_checked: int
    """This job's model tensors found in the checkpoint with their shape."""
    read_bytes: int
    """What this rank would read (its state dict's model and optimizer tensors); none is read."""
    read_s: float
    """read_bytes at the profile's per-GPU read bandwidth (modelled)."""

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "format": self.ckpt_format, "iteration": self.iteration,
                "tensors_checked": self.tensors_checked, "read_bytes": self.read_bytes, "read_s": self.read_s,
                "values_read": False}


@dataclass(kw_only=True, slots=True)
class CheckpointSeams:
    """The installed seams' records (what the summary's ``megatron.checkpoints`` shows)."""

    storage: StorageSpec
    announce: bool
    """Whether this process prints the one-line notes (the first real process)."""
    saves: list[SaveRecord] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    worker_skipped: bool = False

    @property
    def used(self) -> bool:
        return bool(self.saves or self.loads)

    def defaults_used(self) -> tuple[str, ...]:
        """The storage figures taken from the policy defaults (only when a save or load used them)."""
        if not self.used:
            return ()
        wanted = ["storage.write_bandwidth_gbytes_per_s"] if self.saves else []
        wanted += ["storage.read_bandwidth_gbytes_per_s"] if self.loads else []
        return tuple(k for k in self.storage.defaults_used if k in wanted)

    def summary(self) -> dict[str, Any]:
        spec = self.storage
        return {"storage": {"write_bandwidth_gbytes_per_s":
                            spec.bandwidth_bytes_per_s("write_bandwidth_gbytes_per_s") / 1e9,
                            "read_bandwidth_gbytes_per_s": spec.bandwidth_bytes_per_s("read_bandwidth_gbytes_per_s")
                            / 1e9, "defaults_used": list(spec.defaults_used)},
                "saves": [s.to_json() for s in self.saves], "loads": [rec.to_json() for rec in self.loads],
                "persistent_worker_started": False if self.worker_skipped else None,
                "written": "nothing: a virtual GPU's tensors hold no values"}

    def say(self, line: str) -> None:
        if self.announce:
            print(f"prism: virtual GPU: {line}", flush=True)

    # -- save --------------------------------------------------------------------------------------------------
    def save(self, original: Any, *args: Any, **kwargs: Any) -> None:
        """Megatron's ``save_checkpoint`` without the writes (module docstring)."""
        from megatron.core import mpu
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.utils import get_pg_rank, get_pg_size
        from megatron.training import checkpointing as ck
        from megatron.training.global_vars import get_args

        a = _bind(original, args, kwargs)
        margs = get_args()
        iteration = int(a["iteration"])
        save_dir, dist = margs.save, bool(margs.use_dist_ckpt)
        if a["non_persistent_ckpt"]:  # 'global' (others are refused up front): a torch_dist save in a subdirectory
            dist = True
            save_dir = margs.non_persistent_global_ckpt_dir or os.path.join(save_dir, ck._NON_PERSISTENT_CKPT_SUBDIR)
        ckpt_format = margs.ckpt_format if dist else "torch"
        if margs.async_save and not dist:
            raise NotImplementedError("Async checkpoint save not implemented for legacy checkpoints")
        model = ck.unwrap_model(a["model"])
        tp_group, pp_group = a["tp_group"], a["pp_group"]
        if tp_group is None and pp_group is None:
            tp_group, pp_group = mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
        rng_state = ck.get_rng_state(margs.ckpt_format, tp_group, pp_group, dp_cp_group=a["dp_cp_group"],
                                     dp_group=a["dp_group"], key_prefix=a["rng_state_key_prefix"])
        rerun_state = get_rerun_state_machine().state_dict(data_iterator=a["train_data_iterator"],
                                                           ckpt_format=margs.ckpt_format)
        dp_rank = get_pg_rank(a["dp_group"]) if a["dp_group"] is not None else mpu.get_data_parallel_rank()
        expt_dp_rank = (get_pg_rank(a["expt_dp_group"]) if a["expt_dp_group"] is not None
                        else mpu.get_expert_data_parallel_rank())
        sections, written, host, device = cb.SectionBytes(model_bytes=0, optimizer_bytes=0, other_bytes=0), 0, 0, 0
        if dist or dp_rank == 0 or expt_dp_rank == 0:
            metadata = ck._build_sharded_state_dict_metadata(margs, dp_cp_group=a["dp_cp_group"]) if dist else None
            before = torch.cuda.memory_allocated()
            state_dict = ck.generate_state_dict(margs, model, a["optimizer"], a["opt_param_scheduler"], rng_state,
                                                iteration=iteration, optim_sd_kwargs=dict(metadata=metadata),
                                                model_sd_kwargs=dict(metadata=metadata), rerun_state=rerun_state)
            device = torch.cuda.memory_allocated() - before
            sections = cb.section_bytes(state_dict)
            if dist:
                group = _parallel_save_group(margs, a, mpu)
                written = cb.sharded_written_bytes(state_dict, fully_parallel=bool(margs.ckpt_fully_parallel_save),
                                                   group_size=get_pg_size(group), group_index=get_pg_rank(group))
                host = written
            else:
                written, host = cb.storage_bytes(state_dict), cb.largest_storage_bytes(state_dict)
            del state_dict
        write_s = self.storage.write_s(written)
        record = SaveRecord(iteration=iteration, ckpt_format=ckpt_format, async_save=bool(margs.async_save),
                            directory=str(save_dir), state_dict=sections, written_bytes=written, write_s=write_s,
                            blocking_s=0.0 if margs.async_save else write_s, host_bytes=host, device_bytes=device)
        self.saves.append(record)
        if not margs.async_save and torch.distributed.is_initialized():
            torch.distributed.barrier()  # Megatron's save waits for every rank, twice
            torch.distributed.barrier()
        self.say(f"checkpoint at iteration {iteration} ({ckpt_format}{', async' if record.async_save else ''}) not "
                 f"written to {save_dir}: this rank would write {written:,} bytes in {write_s:.3f} s (modelled), "
                 f"holding {host:,} bytes of host memory")

    # -- load --------------------------------------------------------------------------------------------------
    def load(self, original: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """Megatron's ``load_checkpoint``: its own code when there is no checkpoint, else metadata only."""
        from megatron.training import checkpointing as ck
        from megatron.training.global_vars import get_args

        a = _bind(original, args, kwargs)
        margs = get_args()
        load_dir = getattr(margs, a["load_arg"])
        pretrained = getattr(margs, "pretrained_checkpoint", None)
        if pretrained is not None and not ck.checkpoint_exists(load_dir):
            load_dir = pretrained
            margs.finetune = True
        if load_dir is None or not ck.checkpoint_exists(load_dir):
            return original(*args, **kwargs)  # Megatron starts from scratch (or exits, --exit-on-missing-checkpoint)
        return self._load_metadata(a, margs, str(load_dir))

    def _load_metadata(self, a: dict[str, Any], margs: Any, load_dir: str) -> tuple[int, int]:
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        from megatron.training import checkpointing as ck

        iteration, release = _read_tracker(ck.get_checkpoint_tracker_filename(load_dir))
        if getattr(margs, "ckpt_step", None):
            iteration = margs.ckpt_step
        ck.set_loaded_iteration(iteration)
        model = ck.unwrap_model(a["ddp_model"])
        common, shapes, ckpt_format = _checkpoint_metadata(load_dir, iteration, release)
        checked = _check_shapes(_expected_shapes(margs, model, ckpt_format), shapes, load_dir)
        ck.set_checkpoint_version(common.get("checkpoint_version", 0))
        if margs.finetune or release:
            iteration = 0
        else:
            iteration = int(common.get("iteration", common.get("total_iters", iteration)))
        flops = common.get("num_floating_point_operations_so_far", 0)
        if "args" in common and not margs.finetune:
            ck.check_checkpoint_args(common["args"])
            margs.consumed_train_samples = getattr(common["args"], "consumed_train_samples", 0)
            margs.skipped_train_samples = getattr(common["args"], "skipped_train_samples", 0)
            update_num_microbatches(consumed_samples=margs.consumed_train_samples, verbose=True)
            margs.consumed_valid_samples = getattr(common["args"], "consumed_valid_samples", 0)
        scheduler = a["opt_param_scheduler"]
        if scheduler is not None and not (release or margs.finetune or margs.no_load_optim):
            state = common.get("opt_param_scheduler", common.get("lr_scheduler"))
            if state is not None:
                scheduler.load_state_dict(state)
        optimizer = None if margs.no_load_optim else a["optimizer"]
        read = _state_dict_bytes(margs, model, optimizer)
        self.loads.append(LoadRecord(directory=load_dir, ckpt_format=ckpt_format, iteration=iteration,
                                     tensors_checked=checked, read_bytes=read, read_s=self.storage.read_s(read)))
        self.say(f"--load {load_dir}: iteration {iteration} and {checked} tensor shapes read from the checkpoint's "
                 "metadata; no tensor value is read (the model keeps its initial values, fakes on a virtual GPU)")
        return iteration, int(flops)


def _bind(function: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _parallel_save_group(margs: Any, a: dict[str, Any], mpu: Any) -> Any:
    """The group Megatron's fully parallel save spreads shards over (``--ckpt-fully-parallel-save-process-group``)."""
    if getattr(margs, "ckpt_fully_parallel_save_process_group", "dp") == "ep_dp":
        return a["expt_dp_group"] if a["expt_dp_group"] is not None else mpu.get_expert_data_parallel_group()
    if a["dp_cp_group"] is not None:
        return a["dp_cp_group"]
    return mpu.get_data_parallel_group(with_context_parallel=True)


def _read_tracker(path: str) -> tuple[int, bool]:
    """(iteration, release) from Megatron's ``latest_checkpointed_iteration.txt``."""
    text = Path(path).read_text().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise ConfigError(f"--load: {path} holds {text!r}, neither an iteration nor 'release'; Megatron would "
                          "exit here too: point --load at a checkpoint directory") from None


def _checkpoint_metadata(load_dir: str, iteration: int, release: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(common state, {tensor key: shape}, format) of the checkpoint, without reading a tensor's values."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing as ck

    directory = ck.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if dist_checkpointing.check_is_distributed_checkpoint(directory):
        common = dist_checkpointing.load_common_state_dict(directory)
        tensors = dist_checkpointing.load_tensors_metadata(directory)
        return common, {key: tuple(t.global_shape) for key, t in tensors.items()}, "torch_dist"
    path = ck.get_checkpoint_name(load_dir, iteration, release)
    if not os.path.isfile(path):
        raise ConfigError(f"--load {load_dir}: iteration {iteration} has neither a torch_dist checkpoint "
                          f"({directory}) nor this rank's legacy file ({path}); point --load at a complete checkpoint")
    state = torch.load(path, map_location="meta", mmap=True, weights_only=False)
    shapes = {f"{section}/{key}": tuple(t.shape) for section, part in state.items()
              if section.startswith("model") and isinstance(part, dict)
              for key, t in part.items() if isinstance(t, torch.Tensor)}
    common = {k: v for k, v in state.items() if not (k.startswith("model") or k.startswith("optimizer"))}
    return common, shapes, "torch"


def _expected_shapes(margs: Any, model: list[Any], ckpt_format: str) -> dict[str, tuple[int, ...]]:
    """This job's model tensors as the checkpoint format names them: global shapes (``torch_dist``) or this rank's
    local shapes under ``model[<i>]/<name>`` (``torch``)."""
    if ckpt_format == "torch":
        out = {}
        for i, chunk in enumerate(model):
            section = "model" if len(model) == 1 else f"model{i}"
            for key, t in chunk.state_dict_for_save_checkpoint().items():
                if isinstance(t, torch.Tensor):
                    out[f"{section}/{key}"] = tuple(t.shape)
        return out
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.training import checkpointing as ck

    metadata = ck._build_sharded_state_dict_metadata(margs)
    state = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(model)}
    apply_factories(state)
    return {s.key: tuple(s.global_shape) for s in nested_values(state) if isinstance(s, ShardedTensor)}


def _check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], load_dir: str) -> int:
    """How many of `expected` the checkpoint holds with that shape; refuses a missing tensor or another shape."""
    missing = sorted(k for k in expected if k not in found)
    wrong = sorted(k for k in expected if k in found and tuple(found[k]) != expected[k])
    if missing or wrong:
        shown = [f"{k} missing" for k in missing[:3]] + [f"{k}: {found[k]} in the checkpoint, {expected[k]} in this "
                                                          "job" for k in wrong[:3]]
        raise ConfigError(f"--load {load_dir} does not fit this job's model ({len(missing)} tensor(s) missing, "
                          f"{len(wrong)} of another shape: {'; '.join(shown)}); Megatron's load would fail too: load "
                          "a checkpoint of this architecture and layout")
    return len(expected)


def _state_dict_bytes(margs: Any, model: list[Any], optimizer: Any) -> int:
    """The model and optimizer tensor bytes this rank's state dict holds (what a load reads into), built for loading
    as Megatron's load builds it: a ``torch_dist`` load allocates the optimizer's states (``is_loading``) if the
    optimizer has not stepped yet."""
    from megatron.training import checkpointing as ck

    metadata = ck._build_sharded_state_dict_metadata(margs) if margs.use_dist_ckpt else None
    loading = {"is_loading": True} if margs.use_dist_ckpt else {}
    state = ck.generate_state_dict(margs, model, optimizer, None, None,
                                   optim_sd_kwargs=dict(metadata=metadata, **loading),
                                   model_sd_kwargs=dict(metadata=metadata))
    sections = cb.section_bytes(state)
    return sections.model_bytes + sections.optimizer_bytes


def install(patches: Patches, storage: StorageSpec, *, announce: bool) -> CheckpointSeams:
    """Replace Megatron's checkpoint seams wherever they are bound (undone when `patches` closes)."""
    from megatron.training import checkpointing as ck

    from prism_plugin.adapters.megatron.adapter import rebind_everywhere

    seams = CheckpointSeams(storage=storage, announce=announce)
    for name, method in (("save_checkpoint", seams.save), ("load_checkpoint", seams.load)):
        original = getattr(ck, name)

        def seam(*args: Any, _original: Any = original, _method: Any = method, **kwargs: Any) -> Any:
            return _method(_original, *args, **kwargs)

        seam.__wrapped__ = original  # type: ignore[attr-defined]
        patches.setattr(ck, name, seam)
        rebind_everywhere(original, seam, patches)
    try:
        from megatron.training import async_utils
    except ImportError:  # a Megatron without the persistent worker
        return seams
    original_worker = async_utils.init_persistent_async_worker

    def no_worker(*args: Any, **kwargs: Any) -> None:
        seams.worker_skipped = True
        seams.say("--use-persistent-ckpt-worker: no checkpoint worker process started (nothing is written)")

    patches.setattr(async_utils, "init_persistent_async_worker", no_worker)
    rebind_everywhere(original_worker, no_worker, patches)
    return seams
