"""Megatron features the emulation cannot honour, refused up front with the flag to change.

Checked on the job's Megatron arguments before any process group exists (the wrapper parses the
argv with Megatron's own parser; the native patch checks the parsed namespace). Each refusal
names the feature, why no torch backend can see it, and the flag to change.

Always refused (no torch.distributed backend sees this traffic):
- ``--tp-comm-overlap``: TransformerEngine userbuffers move TP data over CUDA IPC / NVSHMEM.
- ``--moe-token-dispatcher-type flex`` / ``--moe-enable-deepep``: DeepEP / HybridEP / NCCL-EP
  kernels talk over NVSHMEM / their own communicators.
- ``--use-nccl-ub``: NCCL user-buffer registration (window memory) on NCCL communicators.
- ``--symmetric-ar-type``: torch symmetric-memory all-reduce (CUDA multicast), not a backend op.
- side backends: ``--pipeline-model-parallel-comm-backend ucc`` (a second real backend would
  rendezvous with absent ranks) and ``--fake-process-group`` (it replaces the prism backend).
  Megatron's gloo twins (``--use-gloo-process-groups``, the default) are *not* refused: they are
  prism groups and cost no rendezvous.

Refused in CPU mode only (no CUDA device; see `cpu_shim`):
- ``--transformer-impl transformer_engine`` (Megatron's default): TransformerEngine needs CUDA;
  pass ``--transformer-impl local``.
- ``--cuda-graph-impl`` other than ``none`` / ``--enable-cuda-graph``: CUDA graphs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Refusal", "refusals_for", "check_args", "parse_megatron_argv"]


class Refusal(NotImplementedError):
    """A Megatron feature the emulation cannot honour; the message names the flag to change."""


def _get(options: Mapping[str, Any] | argparse.Namespace, name: str, default: Any = None) -> Any:
    if isinstance(options, argparse.Namespace):
        return getattr(options, name, default)
    return options.get(name, default)


def refusals_for(options: Mapping[str, Any] | argparse.Namespace, *, cpu_mode: bool) -> list[str]:
    """Messages for every refused feature `options` (Megatron arg dests -> values) turns on."""
    out: list[str] = []
    if _get(options, "tp_comm_overlap"):
        out.append("--tp-comm-overlap: TransformerEngine userbuffers exchange tensor-parallel data outside "
                   "torch.distributed, so no backend can emulate it; remove --tp-comm-overlap")
    if _get(options, "moe_token_dispatcher_type") == "flex" or _get(options, "moe_enable_deepep"):
        backend = _get(options, "moe_flex_dispatcher_backend", "deepep")
        out.append(f"--moe-token-dispatcher-type flex (backend {backend}): DeepEP/HybridEP/NCCL-EP kernels "
                   "communicate over NVSHMEM or their own communicators, invisible to torch.distributed; use "
                   "--moe-token-dispatcher-type alltoall (or allgather) and drop --moe-enable-deepep")
    if _get(options, "nccl_ub"):
        out.append("--use-nccl-ub: NCCL user-buffer registration works on NCCL communicators that the "
                   "emulation does not create; remove --use-nccl-ub")
    if _get(options, "symmetric_ar_type") is not None:
        out.append("--symmetric-ar-type: symmetric-memory all-reduce uses CUDA multicast memory, not a "
                   "torch.distributed op; remove --symmetric-ar-type")
    if _get(options, "pipeline_model_parallel_comm_backend") not in (None, "nccl"):
        out.append(f"--pipeline-model-parallel-comm-backend {_get(options, 'pipeline_model_parallel_comm_backend')}: "
                   "a second real backend would rendezvous with the virtual ranks and hang; drop the flag "
                   "(pipeline transfers then go through the prism backend)")
    if _get(options, "fake_process_group"):
        out.append("--fake-process-group: torch's fake backend would replace the prism backend; drop the flag "
                   "(the prism flags already emulate the other ranks)")
    if cpu_mode:
        if _get(options, "transformer_impl", "transformer_engine") == "transformer_engine":
            out.append("--transformer-impl transformer_engine (Megatron's default): TransformerEngine needs CUDA "
                       "and this host has none; pass --transformer-impl local for CPU mode")
        if _get(options, "cuda_graph_impl", "none") not in (None, "none") or _get(options, "enable_cuda_graph"):
            out.append("--cuda-graph-impl / --enable-cuda-graph: CUDA graphs need a GPU; pass "
                       "--cuda-graph-impl none for CPU mode")
    return out


def check_args(options: Mapping[str, Any] | argparse.Namespace, *, cpu_mode: bool) -> None:
    """Raise `Refusal` listing every refused feature (nothing is created before this runs)."""
    messages = refusals_for(options, cpu_mode=cpu_mode)
    if messages:
        raise Refusal("prism cannot emulate this Megatron job as configured:\n  - " + "\n  - ".join(messages))


def parse_megatron_argv(argv: Sequence[str]) -> argparse.Namespace:
    """The job's arguments parsed by Megatron's own parser (unknown script flags are ignored)."""
    from prism_plugin.adapters.megatron.compat import import_megatron_training

    import_megatron_training()
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, add_help=False))
    namespace, _unknown = parser.parse_known_args(list(argv))
    return namespace
