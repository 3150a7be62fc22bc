"""prism_plugin/programs/pretrain_gpt.py as is, then one ``MODEL_STATE {json}`` line: what this rank holds of the
model state (for test_memory_validation_megatron.py) and Megatron's own theoretical figure for it.

It captures ``setup_model_and_optimizer``'s result (Megatron's DDP chunks and its optimizer), runs the program's
``__main__`` and, after ``pretrain`` returns, measures on the rank's tensors (fake ``cuda`` tensors on a virtual
GPU): the bf16 parameter and fp32 gradient buffers of DDP (their padded sizes, and the padding itemised from the
buffers' own index maps: 64-element param starts, bucket ends padded to lcm(dp, 128)), and the distributed
optimizer's fp32 main-parameter shard and Adam moments of this DP rank; and calls
``megatron.training.theoretical_memory_usage.compute_weight_and_optimizer_memory`` on the job's arguments (with and
without the distributed optimizer: 18 B per parameter gives Megatron's parameter count). Written for the test.
"""

import json
import math
import runpy
import sys
import typing
from pathlib import Path

if not hasattr(typing, "override"):  # megatron.training 0.19 on Python 3.11
    import typing_extensions

    typing.override = typing_extensions.override

import megatron.training.training as training  # noqa: E402

PROGRAM = Path(__file__).resolve().parents[3] / "prism_plugin" / "programs" / "pretrain_gpt.py"
captured: dict = {}
_setup = training.setup_model_and_optimizer


def setup_model_and_optimizer(*args, **kwargs):
    out = _setup(*args, **kwargs)
    captured["model"], captured["optimizer"] = out[0], out[1]
    return out


training.setup_model_and_optimizer = setup_model_and_optimizer


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _buffers(model) -> dict:
    params = param_bytes = grad_bytes = start_pad = bucket_pad = 0
    buckets = []
    for chunk in model:
        for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            param_bytes += _nbytes(buf.param_data)
            grad_bytes += _nbytes(buf.grad_data)
            spans = sorted((start, end, bucket) for start, end, bucket in buf.param_index_map.values())
            params += sum(end - start for start, end, _ in spans)
            for b, (b_start, b_end) in enumerate(buf.bucket_indices):
                inside = [(s, e) for s, e, bucket in spans if bucket == b]
                cursor = b_start
                for s, e in inside:
                    assert s % 64 == 0 and s >= cursor, (s, cursor)
                    start_pad += s - cursor
                    cursor = e
                bucket_pad += b_end - cursor
                buckets.append([b_start, b_end, cursor])
            assert buf.param_data.numel() == buf.grad_data.numel() == buf.bucket_indices[-1][1]
    return {"params": params, "param_buffer_bytes": param_bytes, "grad_buffer_bytes": grad_bytes,
            "start_pad_elements": start_pad, "bucket_pad_elements": bucket_pad, "buckets": buckets}


def _optimizer(optimizer) -> dict:
    main = moments = steps = shard = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.shard_fp32_from_float16_groups:
            for t in group:
                main += _nbytes(t)
                shard += t.numel()
                state = opt.optimizer.state.get(t, {})
                moments += sum(_nbytes(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state)
                step = state.get("step")
                steps += _nbytes(step) if hasattr(step, "numel") and step.device.type == "cuda" else 0
    return {"main_param_bytes": main, "moment_bytes": moments, "cuda_step_bytes": steps, "shard_elements": shard}


def _theory(args) -> dict:
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    distributed = compute_weight_and_optimizer_memory(args)
    saved = args.use_distributed_optimizer
    args.use_distributed_optimizer = False
    try:
        plain = compute_weight_and_optimizer_memory(args)
    finally:
        args.use_distributed_optimizer = saved
    return {"weight_and_optimizer_bytes": distributed, "parameters": plain / 18,
            "data_parallel_size": args.data_parallel_size, "bucket_divisor": math.lcm(args.data_parallel_size, 128)}


sys.argv = [str(PROGRAM), *sys.argv[1:]]
runpy.run_path(str(PROGRAM), run_name="__main__")
from megatron.training import get_args  # noqa: E402

print("MODEL_STATE " + json.dumps({**_buffers(captured["model"]), **_optimizer(captured["optimizer"]),
                                   "theory": _theory(get_args())}), flush=True)
