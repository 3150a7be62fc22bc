"""A DeepSpeed-Ulysses training script for GPUs, with the one documented change (`prism_ds.init_distributed`).

    python ds_ulysses_train.py CONFIG.json --hidden 1024 --heads 16 --seq 4096 --steps 2

One attention block whose attention is DeepSpeed's ``DistributedAttention`` (Ulysses: an all-to-all over the
sequence-parallel group turns a sequence shard of all heads into the whole sequence of a head shard, and back)
around torch's scaled-dot-product attention, as DeepSpeed's own Ulysses test builds it. The sequence-parallel group
comes from a device mesh of (data_parallel_size, sequence_parallel_size) from the config, the same mesh
``deepspeed.initialize(mesh_param=...)`` builds. Each rank holds ``seq / sp`` tokens. Prints the group's size,
and ``MEM step<i> <allocated bytes>`` after each step.
"""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.sequence.layer import DistributedAttention

import prism_plugin.deepspeed as prism_ds


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Causal attention of [s, b, heads, d] tensors (the whole sequence, this rank's heads)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True)
    return out.permute(2, 0, 1, 3)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, sp_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.attn = DistributedAttention(local_attention, sp_group, scatter_idx=2, gather_idx=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s / sp, b, hidden]
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, h // self.heads).unbind(2)
        return self.out(self.attn(q, k, v, 1).reshape(s, b, h))  # batch dimension 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=None)
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    dp, sp = config["data_parallel_size"], config["sequence_parallel_size"]
    mesh = dist.init_device_mesh("cuda", (dp, sp), mesh_dim_names=("data_parallel", "sequence_parallel"))
    sp_group = mesh.get_group("sequence_parallel")
    print(f"SP_GROUP {dist.get_world_size(sp_group)}", flush=True)
    with torch.device(get_accelerator().current_device_name()):
        model = Block(args.hidden, args.heads, sp_group)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           mesh_param=(dp, sp))
    for step in range(args.steps):
        x = torch.randn(args.seq // sp, 1, args.hidden, device=engine.device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        print(f"MEM step{step} {get_accelerator().memory_allocated()}", flush=True)


if __name__ == "__main__":
    main()
