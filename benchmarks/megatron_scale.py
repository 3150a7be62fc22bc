"""One real rank of an N-rank Megatron-core GPT job: set-up time, first step, memory.

    python benchmarks/megatron_scale.py --world-size 8192 [--rank R] [--tp 8] [--pp 4] [--profile NAME]

Prints one JSON object:
- ``init_s``: ``prism_plugin.activate`` + the Megatron adapter + megatron-core's own
  ``initialize_model_parallel(tp, pp)`` (gloo twins included), as rank R of N;
- ``initialize_model_parallel_s``: the megatron call alone, inside ``init_s``;
- ``plain_initialize_model_parallel_s``: the same call on torch's built-in C++ ``fake`` backend
  (no Python backend, no gloo twins: torch's fake backend cannot host them), in a fresh process:
  the baseline of Megatron's own group-construction cost;
- ``first_step_s``: the first training step of this rank's shard (a small GPT with the local layer
  spec, DDP + distributed Adam, ``get_forward_backward_func()``, 2 micro-batches), model
  build excluded (``build_s``); ``timing`` off unless ``--profile`` is given, so this is host cost;
- ``rss_mb``: peak resident memory of the process;
- ``groups_created``: prism groups this rank holds.
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


def _plain(world: int, rank: int, tp: int, pp: int) -> float:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from prism_plugin.adapters.megatron.compat import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state as ps

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    start = time.perf_counter()
    ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    return time.perf_counter() - start


SEQ, MICRO, VOCAB = 64, 1, 1024


def _build(tp: int, pp: int) -> tuple:
    """A small GPT shard: 2 layers per stage, hidden 256, 8 heads, DDP + distributed Adam."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2 * pp, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    model = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True),
                                       [model])
    return model, optimizer


def _step(model: object, optimizer: object) -> bool:
    import math

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    gen = torch.Generator().manual_seed(0)
    batches = iter([torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen) for _ in range(2)])

    def forward_step(data, model):
        tokens = next(data)
        out = model(tokens, torch.arange(SEQ).expand(MICRO, SEQ), mask, labels=tokens)
        return out, lambda loss: (loss.float().mean(), {"lm loss": loss.float().mean().detach()})

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=model,
                                         num_microbatches=2, seq_length=SEQ, micro_batch_size=MICRO,
                                         forward_only=False)
    _ok, grad_norm, _ = optimizer.step()
    return math.isfinite(float(grad_norm)) and all(math.isfinite(float(x["lm loss"])) for x in losses)


def _prism(world: int, rank: int, tp: int, pp: int, profile: str | None) -> dict:
    import torch

    torch.set_num_threads(1)
    import prism_plugin as P
    from prism_plugin.adapters.megatron.adapter import MegatronAdapter
    from prism_plugin.adapters.megatron.compat import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state as ps

    start = time.perf_counter()
    session = P.activate(P.EmulationConfig(world=P.VirtualWorld(world_size=world, real_ranks=(rank,)),
                                           profile=profile or "local-cpu-gloo", timing=profile is not None))
    adapter = MegatronAdapter(session, import_training=False).install()
    t_imp = time.perf_counter()
    ps.initialize_model_parallel(tp, pp)
    imp_s = time.perf_counter() - t_imp
    init_s = time.perf_counter() - start

    t_build = time.perf_counter()
    model, optimizer = _build(tp, pp)
    build_s = time.perf_counter() - t_build
    t_step = time.perf_counter()
    finite = _step(model, optimizer)
    first_step_s = time.perf_counter() - t_step
    groups = session.groups_created
    ps.destroy_model_parallel()
    adapter.uninstall()
    P.deactivate()
    return {"init_s": round(init_s, 3), "initialize_model_parallel_s": round(imp_s, 3),
            "build_s": round(build_s, 3), "first_step_s": round(first_step_s, 3),
            "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "groups_created": groups, "finite": finite}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--rank", type=int, default=None, help="the real rank (default: N/2 + 1)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--profile", default=None, help="model communication time with this profile")
    ap.add_argument("--mode", choices=["all", "prism", "plain"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rank = args.world_size // 2 + 1 if args.rank is None else args.rank
    if args.mode == "plain":
        print(json.dumps({"plain_initialize_model_parallel_s": round(_plain(args.world_size, rank, args.tp,
                                                                            args.pp), 3)}))
        return
    out = {"world_size": args.world_size, "rank": rank, "tp": args.tp, "pp": args.pp}
    out.update(_prism(args.world_size, rank, args.tp, args.pp, args.profile))
    if args.mode == "all":
        cmd = [sys.executable, __file__, "--world-size", str(args.world_size), "--rank", str(rank),
               "--tp", str(args.tp), "--pp", str(args.pp), "--mode", "plain"]
        plain = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out.update(json.loads(plain.stdout.strip().splitlines()[-1]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
