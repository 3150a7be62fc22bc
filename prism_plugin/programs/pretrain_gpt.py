"""GPT pretraining with Megatron's own training loop and mock data: the project's example job.

A `pretrain_gpt.py`-style script built on ``megatron.training.pretrain``: Megatron's argument
parser, its GPT model builder (``--transformer-impl local`` on CPU, TransformerEngine on GPU),
``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder`` (no data files), the TP-rank-0
batch broadcast, and a token-averaged loss. It knows nothing about prism: run it as is with
torchrun, or emulated with the drop-in flags::

    torchrun --nproc-per-node 2 -m prism_plugin.megatron pretrain_gpt.py \\
        --transformer-impl local --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --train-iters 3 \\
        --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 \\
        --prism-world-size 8192 --prism-real-ranks 0,8191

Python 3.11: megatron.training 0.19 imports ``typing.override`` (3.12+); the two lines below add
it from typing_extensions, as ``prism_plugin.adapters.megatron.compat`` does. Pip wheels of
megatron-core ship the dataset helpers prebuilt without their Makefile, so the rank-0
``compile_helpers()`` of Megatron's initialisation is skipped when the prebuilt module imports.
"""

from __future__ import annotations

import typing
from functools import partial

if not hasattr(typing, "override"):  # megatron.training 0.19 on Python 3.11
    import typing_extensions

    typing.override = typing_extensions.override

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402

try:  # megatron-core wheel: helpers prebuilt, no Makefile for compile_helpers() to run
    import megatron.core.datasets.helpers_cpp  # noqa: E402, F401
    import megatron.core.datasets.utils as _dataset_utils  # noqa: E402

    _dataset_utils.compile_helpers = lambda: None
except ImportError:  # a source checkout: Megatron compiles them
    pass

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def _mtp_on_this_rank(vp_stage):
    """Whether this rank (model chunk `vp_stage`) holds multi-token-prediction layers, as upstream asks: they read
    the tokens, wherever they sit."""
    config = core_transformer_config_from_args(get_args())
    return mtp_on_this_rank(config.pipeline_model_parallel_layout, config.mtp_num_layers, ignore_virtual=False,
                            vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: read on TP rank 0, broadcast to the other TP ranks, split over CP.

    Only the model chunks that take one read it, as upstream: the first virtual stage of the first pipeline rank
    (tokens), the last of the last (labels), and a chunk holding multi-token-prediction layers."""
    args = get_args()
    mtp = bool(args.mtp_num_layers) and _mtp_on_this_rank(vp_stage)
    if not (is_first_or_last_pipeline_stage(vp_stage) or mtp):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: (batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None)
                 for key in _BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(key) for key in _BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Sum of per-token losses, the token count, and the (sum, count) pair Megatron averages for logs."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting}


def forward_step(data_iterator, model, return_schedule_plan=False):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, position_ids, attention_mask = get_batch(data_iterator, vp_stage)

    def reduce(output):
        return loss_func(loss_mask, output)

    if return_schedule_plan:  # the combined 1F1B schedule (--overlap-moe-expert-parallel-comm), as upstream's
        return model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels,
                                         loss_mask=loss_mask), reduce
    return model(tokens, position_ids, attention_mask, labels=labels), reduce


def is_dataset_built_on_rank(vp_stage=None):
    """TP rank 0 of the model chunks that read batches (`get_batch`) builds the datasets, as upstream."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or (bool(get_args().mtp_num_layers)
                                                         and _mtp_on_this_rank(vp_stage))


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's mock GPT datasets (random token documents, no files)."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,  # no blend: Megatron switches to mock data
        blend_per_split=None,
        split=args.split,
        num_dataset_builder_threads=1,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=False,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building mock GPT datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()


train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    model_config = gpt_config_from_args(args)
    pretrain(
        pretrain_cfg_container_from_args(args, model_config),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
