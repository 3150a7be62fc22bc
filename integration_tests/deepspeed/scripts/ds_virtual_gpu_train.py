"""A plain DeepSpeed training script for GPUs, with the one documented change (`prism_ds.init_distributed`).

    python ds_virtual_gpu_train.py CONFIG.json --hidden 4096 --layers 8 --steps 2

An MLP of `layers` blocks (Linear(h, 4h), GELU, Linear(4h, h)) built on the accelerator's device (under
``deepspeed.zero.Init`` for ZeRO-3), trained on random bf16 batches. It prints, for the test, one ``MEM <where>
<allocated bytes>`` line after initialize and after each step, ``LOSS <step> <value>``, and the parameter count.
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import see_memory_usage

import prism_plugin.deepspeed as prism_ds


def build(hidden: int, layers: int) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--local_rank", type=int, default=None)
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    accel = get_accelerator()
    print(f"ACCELERATOR {accel.device_name()} {type(accel).__name__} {accel.device_count()}", flush=True)
    device = torch.device(accel.current_device_name())
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build(args.hidden, args.layers)
    else:
        with device:
            model = build(args.hidden, args.layers)
    numels = [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()]
    print(f"NUMELS {json.dumps(numels)}", flush=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    see_memory_usage("after initialize", force=True)
    print(f"MEM init {accel.memory_allocated()}", flush=True)
    micro = config["train_micro_batch_size_per_gpu"]
    for step in range(args.steps):
        x = torch.randn(micro, args.seq, args.hidden, device=engine.device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        see_memory_usage(f"after step {step}", force=True)
        print(f"LOSS {step} {loss.item()}", flush=True)
        print(f"MEM step{step} {accel.memory_allocated()}", flush=True)


if __name__ == "__main__":
    main()
