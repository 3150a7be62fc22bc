"""DeepSpeed set-up and first step at scale, as one real rank of N (the DeepSpeed adapter).

``python benchmarks/deepspeed_scale.py --world-size 65536 --mode zero1|zero3|pipe [--rank R]
[--stages 4] [--stock-grid]`` prints one JSON object:

- init_s: ``prism_plugin.deepspeed.init_distributed`` + model construction (``PipelineModule`` for
  pipe) + ``deepspeed.initialize``;
- first_step_s: the first training step (forward, backward, optimizer step; ``train_batch`` for pipe);
- rss_mb: the process's peak resident set size;
- init_cpu_s, first_step_cpu_s: the same intervals in process CPU time (the figures to compare when
  other jobs share the machine's cores; wall time on an idle machine is close to them).

The model is tiny (two 16x16 linear layers per stage) so the figures are DeepSpeed's and the
emulator's own costs at N. ``--stock-grid`` measures DeepSpeed's quadratic topology code instead of
the adapter's closed forms (for comparison; slow at 65536). Timing is off (``"timing": false``):
emulated communication time would only add modelled waits.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import warnings

warnings.filterwarnings("ignore")


def _config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2 * args.stages if args.mode == "pipe" else 1,
        "zero_optimization": {"stage": 3 if args.mode == "zero3" else 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
        "prism": {"world_size": args.world_size, "real_ranks": [args.rank], "timing": False,
                  "pipe_activations": {"shape": [2, 16], "dtype": "float32"}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--mode", choices=("zero1", "zero3", "pipe"), required=True)
    parser.add_argument("--rank", type=int, default=5, help="the virtual rank this process plays (default 5)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages for --mode pipe (default 4)")
    parser.add_argument("--stock-grid", action="store_true", help="keep DeepSpeed's own topology code")
    args = parser.parse_args()

    import logging

    import torch

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)

    import prism_plugin.deepspeed as prism_ds
    from prism_plugin.adapters.deepspeed import grid

    if args.stock_grid:
        grid.install = lambda emulation: None  # measure DeepSpeed's own PipelineParallelGrid
    config = _config(args)
    torch.manual_seed(0)
    t0, c0 = time.perf_counter(), time.process_time()
    prism_ds.init_distributed(config)
    if args.mode == "pipe":
        from deepspeed.pipe import LayerSpec, PipelineModule

        model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 16, 16) for _ in range(2 * args.stages)],
                               num_stages=args.stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_s, init_cpu_s = time.perf_counter() - t0, time.process_time() - c0

    t0, c0 = time.perf_counter(), time.process_time()
    if args.mode == "pipe":
        def batches():
            while True:
                yield torch.randn(2, 16), torch.randn(2, 16)

        engine.train_batch(data_iter=batches())
    else:
        x = torch.randn(2, 16)
        loss = torch.nn.functional.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
    first_step_s, first_step_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    prism_ds.shutdown()
    print(json.dumps({"world_size": args.world_size, "mode": args.mode, "rank": args.rank,
                      "init_s": round(init_s, 3), "first_step_s": round(first_step_s, 3),
                      "rss_mb": round(rss_mb, 1), "init_cpu_s": round(init_cpu_s, 3),
                      "first_step_cpu_s": round(first_step_cpu_s, 3), "stock_grid": args.stock_grid}))


if __name__ == "__main__":
    main()
