"""Per-call cost of ops through the prism backend vs a real gloo group of the same size.

One process plays rank 5 of an 8192-rank world; ops go to its 8-rank group (4 KiB fp32), with the
emulated delay switched off (timing=False) so the figure is the interception overhead alone. The
gloo baseline runs 8 real processes (FileStore rendezvous) all-reducing the same tensor.

Prints one JSON object: allreduce_us, allgather_us, send_us, gloo_allreduce_us (medians of
--repeats runs of --iters calls each), plus allreduce_timed_us (dgx-h100 profile, delay on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")


def _per_call_us(fn, iters: int, repeats: int) -> float:
    for _ in range(min(200, iters)):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


def _prism(iters: int, repeats: int) -> dict[str, float]:
    import prism_plugin as P

    out: dict[str, float] = {}
    for timing in (False, True):
        P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=8192, real_ranks=(5,)),
                                     profile="dgx-h100", timing=timing))
        g = dist.new_group(list(range(8)))
        t = torch.ones(1024)
        o = torch.empty(8 * 1024)
        if timing:
            out["allreduce_timed_us"] = _per_call_us(lambda: dist.all_reduce(t, group=g), iters, repeats)
        else:
            out["allreduce_us"] = _per_call_us(lambda: dist.all_reduce(t, group=g), iters, repeats)
            out["allgather_us"] = _per_call_us(lambda: dist.all_gather_into_tensor(o, t, group=g), iters, repeats)
            out["send_us"] = _per_call_us(lambda: dist.send(t, dst=6), iters, repeats)
        P.deactivate()
    return out


def _gloo_worker(rank: int, size: int, path: str, iters: int, repeats: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, store=dist.FileStore(path, size))
    t = torch.ones(1024)
    us = _per_call_us(lambda: dist.all_reduce(t), iters, repeats)
    if rank == 0:
        q.put(us)
    dist.destroy_process_group()


def _gloo(size: int, iters: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_gloo_worker, args=(r, size, os.path.join(d, "store"), iters, repeats, q))
                 for r in range(size)]
        for p in procs:
            p.start()
        us = q.get(timeout=600)
        for p in procs:
            p.join()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gloo-size", type=int, default=8)
    ap.add_argument("--gloo-iters", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = _prism(args.iters, args.repeats)
    result["gloo_allreduce_us"] = _gloo(args.gloo_size, args.gloo_iters, args.repeats)
    result.update({"group_size": 8, "tensor_bytes": 4096, "torch": torch.__version__})
    json.dump({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
