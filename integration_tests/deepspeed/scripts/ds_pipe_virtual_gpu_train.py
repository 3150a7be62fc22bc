"""A plain DeepSpeed pipeline script for GPUs, with the one documented change (`prism_ds.init_distributed`).

    python ds_pipe_virtual_gpu_train.py CONFIG.json --hidden 4096 --blocks 4 --seq 2048 --steps 2

A `PipelineModule` of `blocks` transformer-MLP blocks given as layer specs (``LayerSpec(Linear, h, 4h)``,
``LayerSpec(GELU)``, ``LayerSpec(Linear, 4h, h)``), 2 stages (``partition_method="uniform"``: the same number of
layers per stage), built on the accelerator's device, trained with ``train_batch`` on random bf16 batches of
``micro x seq x hidden`` made on the device one at a time (on the host with ``--host-data``; MSE to a target of
the same shape). It prints, for the
test, one ``MEM <where> <allocated bytes>`` line after initialize and after each step, and ``LOSS <step> <value>``.
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule

import prism_plugin.deepspeed as prism_ds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", help="the ds_config (or --deepspeed_config)")
    ap.add_argument("--deepspeed_config", default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=None)
    ap.add_argument("--host-data", action="store_true", help="batches made on the host, as a DataLoader makes them")
    args = ap.parse_args()
    with open(args.deepspeed_config or args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    accel = get_accelerator()
    device = torch.device(accel.current_device_name())
    h = args.hidden
    specs = []
    for _ in range(args.blocks):
        specs += [LayerSpec(torch.nn.Linear, h, 4 * h), LayerSpec(torch.nn.GELU), LayerSpec(torch.nn.Linear, 4 * h, h)]
    with device:
        model = PipelineModule(layers=specs, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"MEM init {accel.memory_allocated()}", flush=True)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(args.steps):
        where = "cpu" if args.host_data else device
        batches = ((torch.randn(micro, args.seq, h, device=where, dtype=torch.bfloat16),
                    torch.randn(micro, args.seq, h, device=where, dtype=torch.bfloat16)) for _ in range(gas))
        loss = engine.train_batch(data_iter=batches)  # made one at a time: none outlives its micro-batch
        print(f"LOSS {step} {float(loss)}", flush=True)
        print(f"MEM step{step} {accel.memory_allocated()}", flush=True)


if __name__ == "__main__":
    main()
