"""Training programs the DeepSpeed integration tests run as jobs in the shared workers (`Cluster.run_jobs`).

Each job brings up its own world through `prism_plugin.deepspeed.init_distributed` (the drop-in the
adapter documents), trains a tiny model for a few steps with plain DeepSpeed calls, and returns what
the tests compare: the losses (exact floats), the peak and live tensor-storage bytes over the
training (`prism_plugin.device.memory.StorageTracker`, the project's deterministic CPU tracker; Python's
cyclic GC is off during the measured region so no storage is freed at a collector-dependent moment),
and the emulator's summary.

The recorder's copies of received payloads are emulator state, not the program's: the tracker is
paused while the recorder copies.
"""

from __future__ import annotations

import functools
import gc
import logging
from typing import Any

import torch
import torch.distributed as dist

D_IN, D_HIDDEN, D_OUT = 16, 24, 8
"""Model sizes: P = 16*24 + 24 + 24*8 + 8 = 608 parameters for the ZeRO model."""
MICRO_BATCH = 2


def ds_config(*, stage: int, world_size: int, real_ranks: list[int], dp: int, gas: int = 1,
              policy: str = "mirror", record_dir: str | None = None, replay_dir: str | None = None,
              extra_prism: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ds_config with a "prism" section; small buckets so the tiny model spans several."""
    prism: dict[str, Any] = {"world_size": world_size, "real_ranks": real_ranks, "timing": False,
                             "data_policy": policy}
    if record_dir is not None:
        prism["record_dir"] = record_dir
    if replay_dir is not None:
        prism["replay_dir"] = replay_dir
    prism.update(extra_prism or {})
    return {
        "train_batch_size": MICRO_BATCH * gas * dp,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 256, "allgather_bucket_size": 256,
                              "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 64},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
        "prism": prism,
    }


def _quiet() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)


class _PlainGloo:
    """A plain gloo world of N real processes (no prism): the reference DeepSpeed run."""

    session = None

    def __init__(self, config: dict[str, Any], process_index: int, store_path: str) -> None:
        import os
        from datetime import timedelta

        from deepspeed.comm import comm as ds_comm

        from prism_plugin.adapters.deepspeed import runtime

        n = config["prism"]["world_size"]
        self.env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        os.environ.update(RANK=str(process_index), WORLD_SIZE=str(n), LOCAL_RANK=str(process_index))
        dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=process_index, world_size=n,
                                timeout=timedelta(seconds=60))
        ds_comm.cdb = runtime._torch_backend(60.0)  # DeepSpeed's TorchBackend without its shm op build

    def close(self) -> None:
        import os

        from deepspeed.comm import comm as ds_comm

        from prism_plugin.adapters.deepspeed import runtime

        dist.destroy_process_group()
        ds_comm.cdb = None
        runtime._reset_deepspeed_globals()
        for key, value in self.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _init(config: dict[str, Any], process_index: int, store_path: str | None, plain_gloo: bool = False) -> Any:
    import prism_plugin.deepspeed as prism_ds

    if plain_gloo:
        return _PlainGloo(config, process_index, store_path or "")
    num_real = len(config["prism"]["real_ranks"])
    store = dist.FileStore(store_path, num_real) if num_real > 1 else None
    return prism_ds.init_distributed(config, store=store, process_index=process_index)


def _shutdown(emulation: Any) -> dict[str, Any] | None:
    import prism_plugin.deepspeed as prism_ds

    if isinstance(emulation, _PlainGloo):
        emulation.close()
        return None
    return prism_ds.shutdown()


def _pause_recorder(emulation: Any, tracker: Any) -> None:
    if emulation.session is None:
        return
    recorder = emulation.session.recorder
    if recorder is None:
        return
    record = recorder.record

    @functools.wraps(record)
    def paused_record(*args: Any, **kwargs: Any) -> None:
        with tracker.paused():
            record(*args, **kwargs)

    recorder.record = paused_record


def _batch(rank: int, step: int, micro: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(MICRO_BATCH, d_in, generator=g), torch.randn(MICRO_BATCH, d_out, generator=g)


def _measured(body: Any, emulation: Any) -> dict[str, Any]:
    from prism_plugin.device.memory import StorageTracker

    gc.collect()
    gc.disable()
    try:
        with StorageTracker() as tracker:
            _pause_recorder(emulation, tracker)
            out = body(tracker)
            out.update(peak_bytes=tracker.peak_bytes, live_bytes=tracker.current_bytes)
    finally:
        gc.enable()
    return out


def zero_job(*, config: dict[str, Any], process_index: int, store_path: str | None, steps: int = 3,
             gas: int = 1, plain_gloo: bool = False, zero_init: bool = False) -> dict[str, Any]:
    """A two-layer MLP under ZeRO stage ``config["zero_optimization"]["stage"]``: losses and memory.

    `zero_init`: build the model inside ``deepspeed.zero.Init`` (ZeRO-3 partitioned construction).
    """
    import deepspeed
    import torch._dynamo  # noqa: F401  (imported inside zero.Init, it trips over Init's Tensor.__new__ patch)

    _quiet()
    emulation = _init(config, process_index, store_path, plain_gloo)
    rank = dist.get_rank()
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32

    def body(tracker: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config, enabled=zero_init):
            model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.ReLU(),
                                        torch.nn.Linear(D_HIDDEN, D_OUT))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        after_init = tracker.current_bytes
        losses = []
        for step in range(steps):
            for micro in range(gas):
                x, y = _batch(rank, step, micro, D_IN, D_OUT)
                x, y = x.to(dtype), y.to(dtype)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                del loss, x, y
        return {"losses": losses, "after_init_bytes": after_init, "dp": engine.dp_world_size}

    try:
        out = _measured(body, emulation)
    finally:
        summary = _shutdown(emulation)
    out.update(rank=rank, op_counts=summary["op_counts"] if summary else None)
    return out


class _Layer(torch.nn.Linear):
    """A square linear layer with tanh (its `weight` is what TiedLayerSpec ties)."""

    def __init__(self, d: int) -> None:
        super().__init__(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


def pipe_job(*, config: dict[str, Any], process_index: int, store_path: str | None, stages: int,
             steps: int = 3, tied: bool = True, plain_gloo: bool = False) -> dict[str, Any]:
    """A PipelineModule of `stages` stages (first and last layer tied), 1F1B `train_batch` steps."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    _quiet()
    emulation = _init(config, process_index, store_path, plain_gloo)
    rank = dist.get_rank()
    gas = config["gradient_accumulation_steps"]

    def body(tracker: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        end = TiedLayerSpec("io", _Layer, D_IN) if tied else LayerSpec(_Layer, D_IN)
        layers = [end, *[LayerSpec(_Layer, D_IN) for _ in range(2 * stages - 2)], end]
        net = PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        dp_id = engine.grid.data_parallel_id
        losses = []
        for step in range(steps):
            batches = iter([_batch(dp_id, step, m, D_IN, D_IN) for m in range(gas)])
            losses.append(engine.train_batch(data_iter=batches).item())
        return {"losses": losses, "stage": engine.stage_id, "dp": engine.dp_world_size}

    try:
        out = _measured(body, emulation)
    finally:
        summary = _shutdown(emulation)
    out.update(rank=rank, op_counts=summary["op_counts"] if summary else None)
    return out
