"""Set-up cost at scale: init + every Megatron-layout group, as one real rank of N.

Modes (each in a fresh subprocess, so RSS is per mode):
- prism: `prism_plugin.activate` as rank 5 of N, then `new_group` for every group of a
  Megatron layout (tp=8, pp=4, cp=1, dp=N/32; tokens tp, pp, dp, cp, tp-pp, tp-cp, dp-cp,
  tp-dp-cp, tp-dp, tp-cp-pp and the expert tokens), in the order every rank must create them.
- megatron_prism: megatron-core's own `initialize_model_parallel(tp=8, pp=4)` on the prism backend.
- megatron_fake: the same on torch's built-in C++ `fake` backend: megatron-core's own
  group-construction time with no Python backend at all (the baseline of the 2x target).

Prints one JSON object: init_s and rss_mb (mode prism), megatron_prism_s, megatron_fake_s,
ratio_vs_megatron (init_s / megatron_fake_s), new_group_calls.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")

TOKENS = ("tp", "pp", "dp", "cp", "tp-pp", "tp-cp", "dp-cp", "tp-dp-cp", "tp-dp", "tp-cp-pp")
EXPERT_TOKENS = ("ep", "tp", "tp-ep", "dp", "tp-ep-pp")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mode_prism(world: int) -> dict:
    import torch.distributed as dist

    import prism_plugin as P
    from prism_plugin.topology import MegatronLayout

    layout = MegatronLayout(world_size=world, tp=8, pp=4)
    t0 = time.perf_counter()
    P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=world, real_ranks=(5,)), timing=False))
    calls = 0
    for token in TOKENS:
        for ranks in layout.groups(token):
            dist.new_group(ranks)
            calls += 1
    for token in EXPERT_TOKENS:
        for ranks in layout.expert_groups(token):
            dist.new_group(ranks)
            calls += 1
    return {"init_s": time.perf_counter() - t0, "rss_mb": _rss_mb(), "new_group_calls": calls}


def _mode_megatron(world: int, backend: str) -> dict:
    import torch.distributed as dist

    t0 = time.perf_counter()
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=5, world_size=world, store=FakeStore())
    else:
        import prism_plugin as P

        P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=world, real_ranks=(5,)), timing=False))
    import_s = time.perf_counter()
    from megatron.core import parallel_state as ps

    import_s = time.perf_counter() - import_s
    ps.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                                 create_gloo_process_groups=False)
    return {"s": time.perf_counter() - t0 - import_s, "rss_mb": _rss_mb()}


def _run(mode: str, world: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--world-size", str(world), "--mode", mode],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-size", type=int, default=8192)
    ap.add_argument("--mode", choices=["all", "prism", "megatron_prism", "megatron_fake"], default="all")
    args = ap.parse_args()
    world = args.world_size
    if args.mode == "prism":
        result = _mode_prism(world)
    elif args.mode == "megatron_prism":
        result = _mode_megatron(world, "prism")
    elif args.mode == "megatron_fake":
        result = _mode_megatron(world, "fake")
    else:
        result = {"world_size": world, **_run("prism", world)}
        result["megatron_prism_s"] = _run("megatron_prism", world)["s"]
        result["megatron_fake_s"] = _run("megatron_fake", world)["s"]
        result["ratio_vs_megatron"] = result["init_s"] / result["megatron_fake_s"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
