"""A plain ZeRO-3 script that builds its model inside ``deepspeed.zero.Init`` (used by test_zero_init.py).

``python zero_init_train.py --config ds.json [--dropin | --gloo FILE]``:

- ``--dropin``: the one documented change, ``prism_plugin.deepspeed.init_distributed(config)``, first;
- neither: unmodified; ``zero.Init`` itself initialises communication (``deepspeed.init_distributed()``,
  which the patched DeepSpeed resolves through PRISM_DEEPSPEED_CONFIG);
- ``--gloo FILE``: plain DeepSpeed, one process over gloo with a FileStore (no prism at all).

Each block's constructor wraps its activation in ``torch.compiler.disable`` (as DeepSpeed's own ZeRO-3
hooks and model libraries do): the first such call imports ``torch._dynamo``, here inside the Init
context. Prints ``ZI_RESULT {"rank", "world_size", "backend", "dynamo_before_init", "losses"}``.
"""

import argparse
import json
import os
import sys

import torch

torch.set_num_threads(1)
import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--dropin", action="store_true")
parser.add_argument("--gloo", default=None, help="plain DeepSpeed over gloo, FileStore at this path")
parser.add_argument("--local_rank", type=int, default=None)
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.act = torch.compiler.disable(torch.nn.functional.gelu)  # keep it out of any compiled graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


if args.dropin:
    import prism_plugin.deepspeed as prism_ds

    prism_ds.init_distributed(args.config)
elif args.gloo:  # DeepSpeed tries MPI discovery unless the launcher variables are set (unused: file store)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{args.gloo}", rank=0, world_size=1)
torch.manual_seed(0)
dynamo_before_init = "torch._dynamo" in sys.modules
with deepspeed.zero.Init(config_dict_or_path=args.config):
    model = torch.nn.Sequential(Block(16), Block(16))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)
g = torch.Generator().manual_seed(0)
losses = []
for _ in range(2):
    x = torch.randn(2, 16, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), x)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print("ZI_RESULT " + json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                                 "backend": dist.get_backend(), "dynamo_before_init": dynamo_before_init,
                                 "losses": losses}), flush=True)
