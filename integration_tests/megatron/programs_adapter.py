"""Worker cases for the adapter's seams: CPU-shim ablation probes, log redirection, TP data, refusals."""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import programs_megatron as pm
import torch
from harness import Ctx


def _probe_seed() -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)


def _probe_buffer() -> None:
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")


def _probe_train(tp: int, pp: int, sp: bool = False) -> None:
    _probe_seed()
    _cfg, chunks, optimizer = pm.build(tp, pp, sp=sp, layers=2)
    pm.train(chunks, optimizer, steps=1, microbatches=2)


def _probe_initialize_megatron() -> None:
    from megatron.training.initialize import initialize_megatron

    try:
        initialize_megatron()
    except AssertionError as exc:
        if "Megatron requires CUDA" in str(exc):
            raise
    except Exception:  # past the CUDA check: fails later on purpose (no Megatron args in this probe)
        pass


def _probe_report_memory() -> None:
    import argparse

    import megatron.training.global_vars as global_vars
    from megatron.training.utils import get_device_arch_version, report_memory

    get_device_arch_version()  # arguments.py asks it (FSDP / fp8 checks)
    global_vars.set_args(argparse.Namespace(log_device_memory_used=False))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            report_memory("probe")
    finally:
        global_vars._GLOBAL_ARGS = None


def _probe_compile() -> None:
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    start = time.perf_counter()
    x = torch.randn(4, 8, requires_grad=True)
    bias_gelu_impl(x, torch.zeros(8)).sum().backward()
    if not torch._dynamo.config.disable or time.perf_counter() - start > 5.0:
        raise RuntimeError("torch.compile was not made eager")


def _probe_sp_norm() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = pm._config(2, 1, None, True, 1, None)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    if not getattr(layer.input_layernorm.weight, "sequence_parallel", False):
        raise RuntimeError("layer norm weight not marked sequence_parallel")


# patch number -> (probe, its layout (tp, pp))
PROBES: dict[int, tuple[Any, tuple[int, int]]] = {
    1: (_probe_seed, (2, 1)),
    2: (_probe_buffer, (1, 1)),
    3: (lambda: _probe_train(1, 2), (1, 2)),
    4: (lambda: _probe_train(1, 2), (1, 2)),
    5: (lambda: _probe_train(1, 1), (1, 1)),
    6: (lambda: _probe_train(1, 1), (1, 1)),
    7: (_probe_initialize_megatron, (1, 1)),
    8: (_probe_report_memory, (1, 1)),
    9: (_probe_compile, (1, 1)),
    10: (lambda: _probe_sp_norm(), (2, 1)),
}


def shim_probe(ctx: Ctx, *, number: int, skip: bool) -> str | None:
    """Run patch `number`'s probe with the full shim (skip=False) or all patches but it; the error or None."""
    from megatron.core import parallel_state as ps

    from prism_plugin.adapters.megatron.adapter import MegatronAdapter
    from prism_plugin.adapters.megatron.compat import import_megatron_training
    from prism_plugin.adapters.megatron.cpu_shim import CpuShim

    if number in (7, 8):
        import_megatron_training()
    probe, (tp, pp) = PROBES[number]
    adapter = MegatronAdapter(ctx.session, cpu_mode=False, redirect_logs=False).install()
    shim = CpuShim(skip={number} if skip else ()).install()
    try:
        ps.initialize_model_parallel(tp, pp)
        probe()
        return None
    except Exception as exc:  # the failure the patch fixes
        return f"{type(exc).__name__}: {exc}"
    finally:
        ps.destroy_model_parallel()
        shim.uninstall()
        adapter.uninstall()


def shim_restores(ctx: Ctx) -> dict[str, Any]:
    """Install then uninstall the full shim: every patched attribute is back, no mode is left."""
    from torch.overrides import _get_current_function_mode_stack

    from prism_plugin.adapters.megatron.cpu_shim import CpuShim

    names = ("current_device", "is_available", "device_count", "synchronize", "Stream", "Event",
             "get_rng_state", "memory_stats", "empty_cache")
    before = {n: getattr(torch.cuda, n) for n in names}
    shim = CpuShim().install()
    inside = {"is_available": torch.cuda.is_available(), "device": torch.zeros(1, device="cuda").device.type,
              "type": torch.ones(1).type(), "applied": sorted(shim.applied)}
    shim.uninstall()
    after = {n: getattr(torch.cuda, n) for n in names}
    return {"inside": inside, "restored": all(before[n] is after[n] for n in names),
            "modes_left": len(_get_current_function_mode_stack()), "available_after": torch.cuda.is_available()}


def log_case(ctx: Ctx) -> dict[str, Any]:
    """What Megatron's last-rank and rank-0 helpers do on this rank with the adapter installed."""
    from prism_plugin.adapters.megatron.adapter import MegatronAdapter
    from prism_plugin.adapters.megatron.compat import import_megatron_training

    import_megatron_training()
    import megatron.training.training as training
    import megatron.training.utils as tutils
    from megatron.core.timers import Timers

    original = tutils.is_last_rank
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        adapter = MegatronAdapter(ctx.session, import_training=True).install()
        try:
            result = {"is_last_rank": tutils.is_last_rank(), "training_is_last_rank": training.is_last_rank(),
                      "log_rank": adapter.log_rank}
            tutils.print_rank_last("LAST-RANK-LINE")
            tutils.print_rank_0("RANK-0-LINE")
            timers = Timers(log_level=0, log_option="minmax")
            calls: list[Any] = []
            original_info = __import__("megatron.core.timers", fromlist=["logger"]).logger.info
            __import__("megatron.core.timers", fromlist=["logger"]).logger.info = calls.append
            try:
                timers("probe", log_level=0).start()
                timers("probe").stop()
                timers.log(["probe"])
            finally:
                __import__("megatron.core.timers", fromlist=["logger"]).logger.info = original_info
            result["timer_logged_here"] = bool(calls)
        finally:
            adapter.uninstall()
    result["stdout"] = out.getvalue()
    result["restored"] = tutils.is_last_rank is original
    return result


def tp_batch_case(ctx: Ctx) -> dict[str, Any]:
    """Megatron's TP-rank-0 batch broadcast as seen by this rank (TP=2)."""
    import torch.distributed as dist

    with pm.megatron_world(ctx, tp=2):
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_batch_on_this_tp_rank

        tp_rank = ps.get_tensor_model_parallel_rank()
        batch = {}
        if tp_rank == 0:
            tokens, positions, mask, labels = pm._batch(0, 0, 0)
            batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(pm.MICRO, pm.SEQ),
                     "position_ids": positions,
                     "attention_mask": mask.expand(pm.MICRO, 1, pm.SEQ, pm.SEQ).contiguous()}
        got = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=True,
            broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
            broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
            micro_batch_size=pm.MICRO, seq_length=pm.SEQ, mtp_on_this_rank=False)
        dist.barrier()
    return {k: v.clone() for k, v in got.items() if isinstance(v, torch.Tensor)}


def refusal_case(ctx: Ctx, *, argv: list[str], cpu_mode: bool) -> str | None:
    """Megatron's own parser on `argv`, then the adapter's refusals: the message, or None if accepted."""
    from prism_plugin.adapters.megatron.refusals import Refusal, check_args, parse_megatron_argv

    try:
        check_args(parse_megatron_argv(argv), cpu_mode=cpu_mode)
        return None
    except Refusal as exc:
        return str(exc)
