"""A GPT launch script laid out like upstream Megatron-LM's ``pretrain_gpt.py`` (megatron-core 0.19), for
test_upstream_script.py. Written for this test; no upstream file is copied.

What matters here is upstream's shape, which prism must handle without edits:

- ``get_batch_on_this_tp_rank`` (and the other helpers) bound at *module level* of ``__main__``, before
  Megatron parses its arguments (where the native patch activates the emulation);
- ``get_batch(data_iterator, vp_stage=None)`` reading on TP rank 0 and broadcasting to the others;
- a loss function that, like upstream's, hands the local loss to the rerun state machine, which stops
  the job on a NaN or Inf local loss (``--check-for-nan-in-loss-and-grad``, Megatron's default);
- ``pretrain(...)`` from megatron.training with Megatron's mock GPT data.

Python 3.11 needs ``typing.override`` for megatron.training 0.19 (3.12+): the first lines add it.
"""

import typing

if not hasattr(typing, "override"):  # megatron.training 0.19 on Python 3.11
    import typing_extensions

    typing.override = typing_extensions.override

from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """Generate a batch: read on TP rank 0, broadcast to the other TP ranks, slice for CP."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=parallel_state.get_context_parallel_group())
    return tuple(batch.get(key) for key in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Token-summed loss; like upstream, a NaN or Inf local loss stops the job (the rerun state machine)."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation", tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split, num_dataset_builder_threads=1, path_to_cache=args.data_cache_path,
        mmap_bin_files=False, tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
