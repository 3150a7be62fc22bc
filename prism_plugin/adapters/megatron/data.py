"""Valid batches on real ranks whose tensor-parallel rank 0 is virtual (mirror policy).

Megatron reads data on TP rank 0 only and broadcasts each batch tensor to the other TP ranks
(``megatron.core.utils.get_batch_on_this_tp_rank``), which receive into ``torch.empty``
buffers. When TP rank 0 is virtual, the backend's mirror rule for a broadcast from a virtual root
(keep the receiver's own values: right for parameters, which a structurally identical root holds
too) would hand back uninitialised memory: token ids out of range, NaN masks. So, after the
original function returns on such a rank, this module writes a deterministic, valid batch into
those same buffers, in place (no allocation, so memory figures are unchanged; on a virtual GPU no launch either:
the broadcasts' own kernels write a batch, `prism_plugin.comm.context.data_steps`):

- ``tokens[b, s] = (b * seq + s) mod vocab`` and ``labels`` the next token id,
- ``position_ids[b, s] = s``, ``loss_mask`` ones, ``attention_mask`` causal (True above the
  diagonal, Megatron's "masked" convention).

``vocab`` is Megatron's ``padded_vocab_size`` when megatron.training's arguments are set, else
the sequence length (ids then stay below any vocabulary at least as long as a sequence).

Likewise for the run flags Megatron broadcasts from rank 0
(``build_train_valid_test_data_loaders``: do_train / do_valid / do_test): when rank 0 is virtual,
each real rank sets them as rank 0 would (``do_train = not skip_train and train_iters > 0``,
``do_valid = do_test = full_validation or eval_iters > 0``; a rank-0 dataset that is empty for a
split is not foreseen), instead of keeping its own "no data loader here" zeros.

Not applied with the RECORDED policy (the recorded payloads are the real batch) nor ZEROS (an
explicit choice), nor on TP rank 0, nor when TP rank 0 is real.

Rank 0's dataset build: Megatron builds each dataset on rank 0 first, which writes its index files to
``--data-cache-path``; after a barrier the other ranks build theirs by reading those files
(``BlendedMegatronDatasetBuilder.build_generic_dataset``). When rank 0 is virtual nobody writes them, and a real
rank stopped on the missing files (Megatron-LM's Llama 3 8B example, rank 7 of 8). So the lowest real rank builds as
rank 0 (``get_rank`` answers 0 inside that function), then meets the others at the barrier, whatever the data policy.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from prism_plugin.comm.context import data_steps
from prism_plugin.config.kinds import DataPolicy
from prism_plugin.device.undo import Patches

__all__ = ["install", "fill_valid_batch"]


def _vocab_size(seq_length: int) -> int:
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None
    vocab = getattr(args, "padded_vocab_size", None)
    return int(vocab) if vocab else max(1, seq_length)


@torch.no_grad()
def fill_valid_batch(batch: dict[str, Any], vocab_size: int) -> None:
    """Write the synthetic valid batch (see the module docstring) into `batch`'s tensors in place."""
    tokens = batch.get("tokens")
    labels = batch.get("labels")
    for ids, shift in ((tokens, 0), (labels, 1)):
        if isinstance(ids, torch.Tensor) and ids.numel():
            flat = ids.view(-1)
            torch.arange(shift, flat.numel() + shift, out=flat)
            flat.remainder_(vocab_size)
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.numel():
        seq = positions.shape[-1]
        flat = positions.view(-1)
        torch.arange(flat.numel(), out=flat)
        flat.remainder_(seq)
    loss_mask = batch.get("loss_mask")
    if isinstance(loss_mask, torch.Tensor):
        loss_mask.fill_(1)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        mask.fill_(True)
        mask.triu_(1)


def install(session: Any, patches: Patches) -> list[int]:
    """Wrap ``get_batch_on_this_tp_rank`` wherever it is bound: Megatron's modules and the program's own
    (a launch script's module-level import included); returns the live count of batches filled."""
    import megatron.core.utils as mutils

    from prism_plugin.adapters.megatron.adapter import rebind_everywhere

    filled = [0]
    world = session.config.world
    if not world.is_real(0) and min(world.real_ranks) == session.rank:
        _install_rank0_dataset_build(patches)
    if session.config.data_policy is not DataPolicy.MIRROR:
        return filled
    original = mutils.get_batch_on_this_tp_rank
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        tp_rank, src = bound.get("tp_rank"), bound.get("broadcast_src_rank")
        if tp_rank not in (None, 0) and src is not None and not world.is_real(src) and isinstance(result, dict):
            with data_steps(session.op_clock):  # the broadcasts' data: their kernels wrote it, no launch of its own
                fill_valid_batch(result, _vocab_size(int(bound.get("seq_length") or 1)))
            filled[0] += 1
        return result

    rebind_everywhere(original, get_batch_on_this_tp_rank, patches)
    if not world.is_real(0) and "megatron.training.training" in sys.modules:
        _install_run_flags(patches)
    return filled


def _install_run_flags(patches: Patches) -> None:
    import megatron.training.training as training

    from prism_plugin.adapters.megatron.adapter import rebind_everywhere

    original = training.build_train_valid_test_data_loaders

    @functools.wraps(original)
    def build_train_valid_test_data_loaders(*args: Any, **kwargs: Any) -> Any:
        loaders = original(*args, **kwargs)
        margs = training.get_args()
        evaluates = bool(margs.full_validation) or (margs.eval_iters or 0) > 0
        margs.do_train = bool(margs.do_train) or (not margs.skip_train and (margs.train_iters or 0) > 0)
        margs.do_valid = bool(margs.do_valid) or evaluates
        margs.do_test = bool(margs.do_test) or evaluates
        return loaders

    rebind_everywhere(original, build_train_valid_test_data_loaders, patches)


def _install_rank0_dataset_build(patches: Patches) -> None:
    """The lowest real rank builds the datasets as rank 0 does when rank 0 is virtual (module docstring)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    original = BlendedMegatronDatasetBuilder.build_generic_dataset

    @functools.wraps(original)
    def build_generic_dataset(*args: Any, **kwargs: Any) -> Any:
        get_rank = torch.distributed.get_rank
        torch.distributed.get_rank = lambda group=None: 0 if group is None else get_rank(group)
        try:
            return original(*args, **kwargs)
        finally:
            torch.distributed.get_rank = get_rank

    patches.setattr(BlendedMegatronDatasetBuilder, "build_generic_dataset", staticmethod(build_generic_dataset))
