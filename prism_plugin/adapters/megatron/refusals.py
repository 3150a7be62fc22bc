"""Megatron features the emulation cannot honour, refused up front with the flag to change.

Checked on the job's Megatron arguments before any process group exists (the wrapper parses the
argv with Megatron's own parser; the native patch checks the parsed namespace). Each refusal
names the feature, why no torch backend can see it, and the flag to change.

Always refused (no torch.distributed backend sees this traffic):
- ``--tp-comm-overlap`` (except on virtual GPUs with TransformerEngine, whose userbuffers are emulated there:
  `prism_plugin.device.te.userbuffers`): TE userbuffers move TP data over CUDA IPC / NVSHMEM.
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
- GPU-only kernels the job asks for explicitly: ``--moe-permute-fusion`` and ``--moe-router-fusion``
  (TransformerEngine kernels), ``--moe-grouped-gemm`` (grouped-GEMM CUDA kernels). The user chose
  them, so they are refused (the flag to drop named) rather than silently replaced.

Switched off in CPU mode (`switch_offs`; Megatron's *defaults*, which select a CUDA kernel on a
CPU host and fail deep in Megatron, one at a time): the adapter sets them off on the parsed
arguments before Megatron builds anything, prints one line each and lists them in the summary
(``megatron.switched_off``: the memory figures are those of the unfused path):
- gradient-accumulation fusion (default on): the weight gradient is accumulated into ``main_grad``
  by apex's ``fused_weight_gradient_mlp_cuda`` (``RuntimeError`` in ``ColumnParallelLinear``);
  as ``--no-gradient-accumulation-fusion``.
- masked-softmax fusion (default on) with ``--bf16`` / ``--fp16``: ``scaled_masked_softmax_cuda``
  (``ModuleNotFoundError``); as ``--no-masked-softmax-fusion``. In fp32 Megatron never selects the
  kernel, so nothing is switched.
- RoPE fusion (default on) with ``--position-embedding-type rope``: TransformerEngine's fused RoPE
  (``ValueError: apply_rope_fusion is not available``); as ``--no-rope-fusion``.
Device mode virtual-gpu (`virtual_gpu_refusals`): the GPU is fake tensors. TransformerEngine runs there (its
own Python layer over fake kernels: `prism_plugin.device.te`; refused only when TE's Python package
is not installed, naming the set-up command), and with it ``--moe-grouped-gemm`` (TEGroupedLinear) and
``--moe-permute-fusion`` (TE's Triton permutation kernels: `triton_kernels`), ``--moe-router-fusion`` (TE's fused
router kernels: `prism_plugin.device.te.router`), and ``--attention-backend flash``
(flash-attn's Python layer beside TE's: `prism_plugin.device.te.flash`; refused only when it is not installed);
CUDA graphs run with ``--cuda-graph-impl transformer_engine`` (`prism_plugin.device.graphs`: a capture recorded
once, each replay one launch, the captures' private memory pool); refused are Megatron's own graph managers
(``--cuda-graph-impl local`` / ``full_iteration``, ``--enable-cuda-graph``) and the other GPU-only opt-ins above
(``--save`` / ``--load`` run: nothing is written and no tensor value read, `checkpoint`; refused are the
checkpoint kinds that path does not model, `checkpoint_refusals`).
Of the defaults CPU mode switches off, only RoPE fusion with the local spec is switched off there
(`switch_offs`; with TE, TE's fused RoPE is a fake kernel), and the data loader's worker processes are
(``--num-workers`` 0: host processes the emulation never times);
gradient-accumulation fusion and masked-softmax fusion stay on (apex's ``fused_weight_gradient_mlp_cuda``
and the softmax extensions are fake kernels there, one kernel each: `fused_kernels`), and so does the
persistent layer norm (the local spec's torch norm accepts ``persist_layer_norm``: cpu_shim patch 10).
The other fusions run on CPU as they are: bias-GeLU / bias-SwiGLU / bias-dropout (Megatron's
``jit_fuser`` functions, eager in CPU mode, one fused kernel each on virtual GPUs: `fused_kernels`),
``--use-fused-weighted-squared-relu``,
``--cross-entropy-loss-fusion`` with the native implementation, and the persistent layer norm
(cpu_shim patch 10); the TransformerEngine-only ``--fused-residual-rmsnorm`` and
``--use-te-activation-func`` have no effect with the local implementation.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.device.te import FLASH_ATTN_VERSION, flash_available, te_path
from prism_plugin.device.te import available as te_available
from prism_plugin.device.te import missing_message as te_missing_message

__all__ = ["Refusal", "SwitchOff", "refusals_for", "virtual_gpu_refusals", "checkpoint_refusals", "switch_offs",
           "check_args",
           "parse_megatron_argv"]


class Refusal(ConfigError, NotImplementedError):
    """A Megatron feature the emulation cannot honour; the message names the flag to change. A `ConfigError`
    (user input: the CLI prints it and exits 2) and a `NotImplementedError` (what the emulation cannot do)."""


def _get(options: Mapping[str, Any] | argparse.Namespace, name: str, default: Any = None) -> Any:
    if isinstance(options, argparse.Namespace):
        return getattr(options, name, default)
    return options.get(name, default)


def refusals_for(options: Mapping[str, Any] | argparse.Namespace, *, cpu_mode: bool,
                 virtual_gpu: bool = False) -> list[str]:
    """Messages for every refused feature `options` (Megatron arg dests -> values) turns on (`virtual_gpu`:
    device mode virtual-gpu, where the GPU is fake tensors: the CPU-mode refusals apply too, see
    `virtual_gpu_refusals`)."""
    out: list[str] = []
    te_userbuffers = virtual_gpu and _get(options, "transformer_impl", "transformer_engine") == "transformer_engine"
    if _get(options, "tp_comm_overlap") and not te_userbuffers:  # virtual GPUs emulate TE's userbuffers
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
    if virtual_gpu:
        out.extend(virtual_gpu_refusals(options))
    elif cpu_mode:
        if _get(options, "transformer_impl", "transformer_engine") == "transformer_engine":
            out.append("--transformer-impl transformer_engine (Megatron's default): TransformerEngine needs CUDA "
                       "and this host has none; pass --transformer-impl local for CPU mode")
        if _get(options, "cuda_graph_impl", "none") not in (None, "none") or _get(options, "enable_cuda_graph"):
            out.append("--cuda-graph-impl / --enable-cuda-graph: CUDA graphs need a GPU; pass "
                       "--cuda-graph-impl none for CPU mode")
        for dest, flag, kernel in _GPU_ONLY_OPT_INS:
            if _get(options, dest):
                out.append(f"{flag}: {kernel} and this host has no GPU; drop {flag} for CPU mode")
    return out


def virtual_gpu_refusals(options: Mapping[str, Any] | argparse.Namespace) -> list[str]:
    """What device mode virtual-gpu refuses: code that needs real CUDA kernels or real values.

    TransformerEngine (Megatron's default ``--transformer-impl``) when its Python layer is not installed; the
    GPU-only kernels a job opts into, CUDA extensions that fake tensors cannot run; Megatron's own CUDA graph
    managers (``--cuda-graph-impl local`` / ``full_iteration``: ``transformer_engine`` runs,
    `prism_plugin.device.graphs`); and the checkpoint kinds the virtual-GPU checkpoint path does not model
    (`checkpoint_refusals`).
    """
    out: list[str] = []
    if _get(options, "transformer_impl", "transformer_engine") == "transformer_engine" and not te_available():
        out.append(f"--transformer-impl transformer_engine (Megatron's default): {te_missing_message()}; or pass "
                   "--transformer-impl local")
    backend = _get(options, "attention_backend")
    if getattr(backend, "name", backend) == "flash" and _get(options, "transformer_impl") != "local" \
            and te_available() and not flash_available():
        out.append(f"--attention-backend flash: flash-attn {FLASH_ATTN_VERSION}'s Python layer is not installed "
                   f"beside TransformerEngine's ({te_path()}); run `bash scripts/setup_env.sh`, or pass "
                   "--attention-backend fused (cuDNN fused attention, what TE picks on an H100 with auto)")
    graphs = _get(options, "cuda_graph_impl", "none")
    if graphs in ("local", "full_iteration") or _get(options, "enable_cuda_graph"):
        out.append(f"--cuda-graph-impl {graphs if graphs not in (None, 'none') else 'local'} (or "
                   "--enable-cuda-graph): Megatron's own graph managers accept only arguments typed torch.Tensor and "
                   "match static buffers by data pointer, which a virtual GPU's fake tensors lack; pass "
                   "--cuda-graph-impl transformer_engine (TransformerEngine's make_graphed_callables, which runs "
                   "here) or none")
    te_runs = _get(options, "transformer_impl", "transformer_engine") == "transformer_engine"
    for dest, flag, kernel in _GPU_ONLY_OPT_INS:
        if dest in ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion") and te_runs:
            continue  # TEGroupedLinear's grouped GEMM and TE's fused router are fake kernels (device/te); TE's Triton
            # permutation kernels are launchers of their reads and writes (triton_kernels)
        if _get(options, dest):
            out.append(f"{flag}: {kernel}, which virtual GPUs (fake tensors) cannot run; drop {flag}")
    out.extend(checkpoint_refusals(options))
    return out


def checkpoint_refusals(options: Mapping[str, Any] | argparse.Namespace) -> list[str]:
    """Checkpoint kinds virtual GPUs do not model (`checkpoint`: ``torch_dist`` and legacy ``torch`` saves and
    loads of Megatron's own trainer run; nothing is written): the FSDP formats (``torch_dcp``, ``fsdp_dtensor``),
    non-persistent ``local`` / ``in_memory`` checkpoints (nvidia-resiliency-ext's managers), and a legacy save of
    the distributed optimizer (its parameter state is gathered to data-parallel rank 0 over gloo)."""
    if not (_get(options, "save") or _get(options, "load")):
        return []
    out: list[str] = []
    fmt = _get(options, "ckpt_format", "torch_dist")
    if fmt in ("torch_dcp", "fsdp_dtensor"):
        out.append(f"--ckpt-format {fmt}: virtual GPUs model torch_dist and torch checkpoints only; pass "
                   "--ckpt-format torch_dist (Megatron's default)")
    kind = _get(options, "non_persistent_ckpt_type")
    if kind in ("local", "in_memory") and (_get(options, "non_persistent_save_interval") or _get(options, "load")):
        out.append(f"--non-persistent-ckpt-type {kind}: checkpoints of nvidia-resiliency-ext's managers are not "
                   "modelled on virtual GPUs; pass --non-persistent-ckpt-type global or drop the flag")
    if _get(options, "save") and fmt == "torch" and _get(options, "use_distributed_optimizer"):
        out.append("--ckpt-format torch with --use-distributed-optimizer: the legacy save gathers the optimizer "
                   "state to data-parallel rank 0, which virtual GPUs do not model; pass --ckpt-format torch_dist "
                   "(Megatron's default)")
    return out


_GPU_ONLY_OPT_INS = (
    ("moe_permute_fusion", "--moe-permute-fusion", "the fused MoE permutation is a TransformerEngine kernel"),
    ("moe_router_fusion", "--moe-router-fusion", "the fused MoE router top-k is a TransformerEngine kernel"),
    ("moe_grouped_gemm", "--moe-grouped-gemm", "grouped GEMM needs CUDA kernels (compute capability >= 8.0)"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SwitchOff:
    """A Megatron setting switched off on a host without the GPU it selects (see the module docstring)."""

    dest: str
    """The argument's dest in Megatron's namespace (set to `value`)."""
    flag: str
    """The flag that switches it off on Megatron's command line (what the summary lists)."""
    reason: str
    """Which kernel the default selects, or (`said`) the whole reason."""
    value: Any = False
    """What `dest` is set to (True for a ``--no-...`` flag's own dest, 0 for a count)."""
    said: bool = False
    """`reason` is the whole line after the mode (not a fused kernel's, whose memory figures it names)."""

    def line(self, mode: str = "CPU mode") -> str:
        """The one line printed when it is switched off (`mode`: "CPU mode" or "virtual GPU")."""
        if self.said:
            return f"prism: {mode}: {self.reason}"
        return (f"prism: {mode}: {self.reason}; switched off (as {self.flag}), so the memory figures are "
                "those of the unfused path")


_NO_WORKERS = ("--num-workers {workers} -> 0: the batches load in the main process. Data-loader workers are host "
               "processes the emulation never times (the batch's values and its copy to the device are the same "
               "either way), and each forked worker grows towards a copy of the job's host memory: a "
               "virtual-pipeline job forks 2 per model chunk and split (72 for Nemotron-4 340B's 12 chunks)")


def switch_offs(options: Mapping[str, Any] | argparse.Namespace, *, virtual_gpu: bool = False) -> list[SwitchOff]:
    """The switch-offs of CPU mode (or, `virtual_gpu`, of virtual GPUs) that apply to `options` (Megatron arg
    dests -> values); empty when none. Virtual GPUs keep gradient-accumulation and masked-softmax fusion (fake
    kernels of apex's extensions, `fused_kernels`) and switch off the data loader's worker processes."""
    out: list[SwitchOff] = []
    if not virtual_gpu and _get(options, "gradient_accumulation_fusion", True):
        out.append(SwitchOff(dest="gradient_accumulation_fusion", flag="--no-gradient-accumulation-fusion",
                             reason="gradient-accumulation fusion needs the CUDA extension "
                                    "fused_weight_gradient_mlp_cuda (apex)"))
    half = _get(options, "bf16") or _get(options, "fp16")
    if half and not virtual_gpu and _get(options, "masked_softmax_fusion", True):
        out.append(SwitchOff(dest="masked_softmax_fusion", flag="--no-masked-softmax-fusion",
                             reason="masked-softmax fusion with --bf16/--fp16 needs the CUDA extension "
                                    "scaled_masked_softmax_cuda"))
    rope = _get(options, "position_embedding_type") == "rope" or _get(options, "use_rotary_position_embeddings")
    te_runs = virtual_gpu and _get(options, "transformer_impl", "transformer_engine") == "transformer_engine"
    if rope and _get(options, "apply_rope_fusion", True) and not te_runs:  # TE's fused RoPE is a fake kernel there
        out.append(SwitchOff(dest="apply_rope_fusion", flag="--no-rope-fusion",
                             reason="RoPE fusion needs TransformerEngine's fused rotary kernel"))
    workers = _get(options, "num_workers", 0) or 0
    if virtual_gpu and workers > 0:
        out.append(SwitchOff(dest="num_workers", flag="--num-workers 0", value=0, said=True,
                             reason=_NO_WORKERS.format(workers=workers)))
    return out


def check_args(options: Mapping[str, Any] | argparse.Namespace, *, cpu_mode: bool, virtual_gpu: bool = False) -> None:
    """Raise `Refusal` listing every refused feature (nothing is created before this runs)."""
    messages = refusals_for(options, cpu_mode=cpu_mode, virtual_gpu=virtual_gpu)
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
