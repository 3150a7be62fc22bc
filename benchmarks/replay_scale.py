"""Replay cost at scale: the synthetic Megatron job TP8 x PP16 x DP(N/128), 64 micro-batches, on dgx-h100.

Usage::

    .venv/bin/python benchmarks/replay_scale.py --world-size 8192 [--straggler]

Prints one JSON object: ``build_s`` (building the execution graph), ``replay_s`` (the replay itself),
``events`` (engine events), ``graph_mb`` (the graph's JSON file), plus ``load_s`` (reading that file),
``num_actors``, ``iteration_ms`` and the world size. Targets (DESIGN.md section 6): N=8192 replay < 1 s,
N=131072 < 10 s, N=8192 with one straggler < 30 s; the replay's cost grows with the number of classes
and what-if blocks, not with N.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from prism_plugin.cost import CostModel, load_profile
from prism_plugin.graph import ExecutionGraph, SyntheticJob, build_1f1b_graph, replay

TP, PP = 8, 16  # one TP group per 8-GPU node; 16 pipeline stages -> 128 ranks per replica
MICROBATCHES = 64
FWD_US, BWD_US = 1000.0, 2000.0  # per micro-batch and stage; backward ~ 2x forward
ACTIVATION_BYTES = 4096 * 8192 * 2  # seq 4096 x hidden 8192 x bf16 = 64 MiB per micro-batch
GRAD_BYTES = 2**30  # ~537M bf16 parameters per rank (a ~70B model over TP8 x PP16)
STRAGGLER_SLOWDOWN = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True, help="N, a multiple of 128 (= TP8 x PP16)")
    parser.add_argument("--straggler", action="store_true", help=f"one rank {STRAGGLER_SLOWDOWN}x slower")
    parser.add_argument("--profile", default="dgx-h100")
    args = parser.parse_args()
    if args.world_size % (TP * PP):
        parser.error(f"--world-size must be a multiple of {TP * PP}")
    dp = args.world_size // (TP * PP)

    t0 = time.perf_counter()
    graph = build_1f1b_graph(
        SyntheticJob(
            tp=TP,
            pp=PP,
            dp=dp,
            num_microbatches=MICROBATCHES,
            fwd_us=FWD_US,
            bwd_us=BWD_US,
            activation_bytes=ACTIVATION_BYTES,
            grad_bytes=GRAD_BYTES,
        )
    )
    build_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        path = graph.save(Path(tmp) / "job.graph.json")
        graph_mb = path.stat().st_size / 1e6
        t0 = time.perf_counter()
        graph = ExecutionGraph.load(path)
        load_s = time.perf_counter() - t0

    cost = CostModel(load_profile(args.profile))
    # A rank in the middle of the world: stage 8, dp replica dp/2, tp 3.
    stragglers = {args.world_size // 2 + 3: STRAGGLER_SLOWDOWN} if args.straggler else {}
    t0 = time.perf_counter()
    result = replay(graph, cost, stragglers=stragglers)
    replay_s = time.perf_counter() - t0

    print(
        json.dumps(
            {
                "world_size": args.world_size,
                "straggler": sorted(stragglers),
                "build_s": round(build_s, 4),
                "replay_s": round(replay_s, 4),
                "events": result.events,
                "graph_mb": round(graph_mb, 3),
                "load_s": round(load_s, 4),
                "num_actors": result.num_actors,
                "iteration_ms": round(result.iteration_time_us() / 1e3, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
