"""ZeRO on virtual GPUs: what the device holds after ``deepspeed.initialize``, by allocation site (for
test_memory_validation_deepspeed.py). Written for the test.

    python ds_model_states.py CONFIG.json --hidden 4096 --layers 8

The MLP of ds_virtual_gpu_train.py (Linear(h, 4h), GELU, Linear(4h, h) blocks; under ``deepspeed.zero.Init`` for
ZeRO-3). The memory history is recorded from after ``init_distributed`` (which re-executes the process); after
``initialize`` and after one training step (its batch and loss dropped) one ``STATES {json}`` line each gives
the parameter numels, the allocated bytes and every live block grouped by the innermost DeepSpeed frame that
allocated it (``file:line function``: count, block bytes, requested bytes), from ``torch.cuda.memory._snapshot()``
of the virtual GPU's allocator model.
"""

import argparse
import json
from collections import defaultdict

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import prism_plugin.deepspeed as prism_ds


def build(hidden: int, layers: int) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks)


def _site(frames: list) -> str:
    for f in frames:  # innermost first
        name = f["filename"]
        if "/deepspeed/" in name:
            return f"{name.split('/deepspeed/', 1)[1]}:{f['line']} {f['name']}"
    return "(no DeepSpeed frame)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--local_rank", type=int, default=None)
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    prism_ds.init_distributed(config)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    accel = get_accelerator()
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build(args.hidden, args.layers)
    else:
        with torch.device(accel.current_device_name()):
            model = build(args.hidden, args.layers)
    numels = [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print("STATES " + json.dumps({"at": "init", "numels": numels, "allocated": accel.memory_allocated(),
                                  "sites": _sites()}), flush=True)
    x = torch.randn(1, args.seq, args.hidden, device=engine.device, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    del x, loss  # the step's batch and loss: the program's, not the model states
    print("STATES " + json.dumps({"at": "step", "numels": numels, "allocated": accel.memory_allocated(),
                                  "sites": _sites()}), flush=True)
    del engine


def _sites() -> dict:
    sites: dict = defaultdict(lambda: [0, 0, 0])
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                entry = sites[_site(block.get("frames", []))]
                entry[0] += 1
                entry[1] += block["size"]
                entry[2] += block["requested_size"]
    return dict(sorted(sites.items()))


if __name__ == "__main__":
    main()
