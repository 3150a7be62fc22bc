"""A plain DeepSpeed training script (ZeRO MLP or 2-stage PipelineModule) used by the launch tests.

``python ds_train.py --config ds.json --mode zero|pipe [--dropin]``. Without ``--dropin`` it is an
unmodified DeepSpeed script (emulation then comes from the patched DeepSpeed reading the config's
"prism" section, or from PRISM_DEEPSPEED_CONFIG for ``deepspeed.init_distributed()``); with it, the
one documented change: ``prism_plugin.deepspeed.init_distributed(config)``. Prints one JSON line per
process: ``DS_RESULT {"rank", "world_size", "backend", "local_rank", "losses"}`` (and, with ``--out DIR``,
writes it to ``DIR/result<rank>.json``).
"""

import argparse
import json
import os

import torch

torch.set_num_threads(1)
import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--mode", choices=("zero", "pipe"), default="zero")
parser.add_argument("--dropin", action="store_true")
parser.add_argument("--out", default=None, help="also write the result to OUT/result<rank>.json")
parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
args = parser.parse_args()

if args.dropin:
    import prism_plugin.deepspeed as prism_ds

    prism_ds.init_distributed(args.config)
torch.manual_seed(0)
if args.mode == "pipe":
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed()
    model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 16, 16) for _ in range(4)], num_stages=2,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
else:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)
g = torch.Generator().manual_seed(dist.get_rank())
losses = []
for _ in range(2):
    if args.mode == "pipe":
        batches = iter([(torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)) for _ in range(2)])
        losses.append(engine.train_batch(data_iter=batches).item())
    else:
        x = torch.randn(2, 16, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
result = json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
                     "local_rank": int(os.environ["LOCAL_RANK"]), "losses": losses})
print("DS_RESULT " + result, flush=True)
if args.out:  # launchers merge their processes' stdout: a file per rank cannot interleave
    with open(os.path.join(args.out, f"result{dist.get_rank()}.json"), "w") as fh:
        fh.write(result)
