"""The DeepSpeed recipes' training program: an MLP under ZeRO, or the same layers as a PipelineModule.

    python -m prism_plugin.programs.deepspeed_mlp --config ds_config.json [--pp 2] [--hidden 256] \
        [--layers 4] [--steps 10]

A plain DeepSpeed script with the one documented change for emulation,
``prism_plugin.deepspeed.init_distributed(config)`` instead of ``deepspeed.init_distributed()``: with
a ``"prism"`` section in the config it runs as rank r of N, without one it is an ordinary DeepSpeed
job (the recipes' real run). Batch sizes, ZeRO stage and the optimizer come from the config; each
step is one ``train_batch`` (pipeline) or gradient_accumulation_steps forward/backward passes plus
``engine.step()`` (ZeRO). Data: micro-batch i of step s on data-parallel replica d is drawn from a
generator seeded with (d, s, i), so every run of the same layout sees the same numbers.
"""

from __future__ import annotations

import argparse
import json

import torch

torch.set_num_threads(1)
import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import prism_plugin.deepspeed as prism_ds  # noqa: E402


def _layers(hidden: int, count: int) -> list[torch.nn.Module]:
    out: list[torch.nn.Module] = []
    for _ in range(count):
        out += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (1: ZeRO data parallelism only)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    torch.manual_seed(0)
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    if args.pp > 1:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layers=_layers(args.hidden, args.layers), num_stages=args.pp,
                               loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        dp_rank = model.mpu().get_data_parallel_rank()
    else:
        model = torch.nn.Sequential(*_layers(args.hidden, args.layers))
        dp_rank = dist.get_rank() if dist.is_initialized() else 0
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def batch(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_000 * dp_rank + 1000 * step + i)
        x = torch.randn(micro, args.hidden, generator=g).to(engine.device)  # cpu: the same tensor (no op)
        return x, torch.tanh(x)

    for step in range(args.steps):
        if args.pp > 1:
            loss = engine.train_batch(data_iter=iter([batch(step, i) for i in range(gas)]))
        else:
            for i in range(gas):
                x, y = batch(step, i)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
        print("DS_STEP " + json.dumps({"rank": dist.get_rank(), "step": step, "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
