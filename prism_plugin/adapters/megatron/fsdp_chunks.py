"""Megatron-FSDP's uneven DTensor shards on virtual GPUs: each chunk's offset from the buffer layout.

Megatron-FSDP (``--use-megatron-fsdp``) keeps each parameter in a flat data-parallel buffer split into equal
shards, one per rank, so a parameter's rows fall unevenly over the ranks. It wraps each rank's rows in a DTensor
(``param_and_grad_buffer.make_fsdp_dtensor``) and finds where they sit in the parameter with
``uneven_dtensor.gather_and_compute_chunk_metadata``: an ``all_gather_object`` of every rank's local shape over the
shard group, this rank's offset being the rows of the ranks before it. On a virtual GPU the peers' objects mirror
this rank's, so the offset was (rank x this rank's rows), past the parameter's end for the last ranks, and
``validate_uneven_dtensor`` failed ("DTensor chunk metadata is invalid. Offsets: (87983, 0) ... Global shape:
[50304, 512]").

The peers' shapes need no peer: the buffer is split into equal shards in rank order, so which rows of a parameter
each rank of the data-parallel group holds follows from the buffer's layout (`peer_rows`). `install` records which
buffer item each DTensor's local tensor came from (``make_fsdp_dtensor(local_tensor=buffer.get_item(item_id,
only_shard=True), ...)``: the last ``get_item`` before the call); when ``gather_and_compute_chunk_metadata`` then
all-gathers the shapes over that buffer's data-parallel group, the collective runs (its time and count stay the
job's) and its answer is the peers' shapes from the layout. The other mesh dimensions (tensor parallelism's even
shards) keep the mirrored answer, which is right for them. Each answer is counted in the values summary; a gather
over another group (hybrid FSDP's outer dimension) keeps the mirrored shapes.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any

__all__ = ["install", "install_rng_sync", "peer_rows"]

_ITEM: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("prism_fsdp_item", default=None)
SITE = ("megatron_fsdp/uneven_dtensor.py:gather_and_compute_chunk_metadata",
        "the data-parallel peers' shard shapes from the FSDP buffer layout")


def peer_rows(buffer: Any, item_id: int, row_numel: int) -> list[int]:
    """The rows of item `item_id` in each data-parallel rank's shard of `buffer`, in rank order.

    >>> from types import SimpleNamespace as NS
    >>> buf = NS(item_index_map={0: NS(global_data_index=100, size=60)}, bucket_index=NS(global_data_index=0),
    ...          shard_bucket_index=NS(size=50), dp_world_size=4)
    >>> peer_rows(buf, 0, 10)  # shards [0, 50) [50, 100) [100, 150) [150, 200); the item is [100, 160)
    [0, 0, 5, 1]
    """
    item, size = buffer.item_index_map[item_id], buffer.shard_bucket_index.size
    begin = buffer.bucket_index.global_data_index - item.global_data_index
    rows = []
    for r in range(buffer.dp_world_size):
        start = min(max(begin + r * size, 0), item.size)
        end = min(max(begin + (r + 1) * size, 0), item.size)
        rows.append((end - start) // row_numel)
    return rows


def install(patches: Any, values: Any) -> None:
    """Patch Megatron-FSDP's modules (imported here) for this process; `values` counts the answers."""
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    last: list[Any] = [None, None]  # the id of get_item's last shard, and (buffer, item id)
    get_item, make, gather = pgb.DataParallelBuffer.get_item, pgb.make_fsdp_dtensor, \
        uneven_dtensor.gather_and_compute_chunk_metadata

    def recorded_get_item(self: Any, item_id: int, only_shard: bool = False) -> Any:
        out = get_item(self, item_id, only_shard=only_shard)
        last[:] = [id(out), (self, item_id)] if only_shard and self.is_data_distributed else [None, None]
        return out

    def make_fsdp_dtensor(local_tensor: Any, *args: Any, **kwargs: Any) -> Any:
        where = last[1] if last[0] == id(local_tensor) else None  # make_fsdp_dtensor(local_tensor=buf.get_item(..))
        last[:] = [None, None]
        token = _ITEM.set(where)
        try:
            dtensor = make(local_tensor, *args, **kwargs)
        finally:
            _ITEM.reset(token)
        if where is not None:  # later calls (a checkpoint's chunk lists) find the item on the DTensor
            dtensor._prism_fsdp_item = where
        return dtensor

    class _LayoutPeers:
        """``torch.distributed`` as ``uneven_dtensor`` sees it during one call: the object all-gather over the
        buffer's data-parallel group answers the peers' shapes from the layout."""

        def __init__(self, buffer: Any, item_id: int) -> None:
            self.buffer, self.item_id = buffer, item_id

        def __getattr__(self, name: str) -> Any:
            return getattr(dist, name)

        def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
            dist.all_gather_object(out, obj, group=group)  # the job's collective, mirrored
            if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(self.buffer.data_parallel_group):
                return
            rows = peer_rows(self.buffer, self.item_id, math.prod(obj[1:]))
            if len(rows) == len(out):
                out[:] = [[r, *obj[1:]] for r in rows]
                values.answers[SITE] += 1

    def gather_and_compute_chunk_metadata(dtensor: Any) -> Any:
        where = _ITEM.get() or getattr(dtensor, "_prism_fsdp_item", None)
        if where is None:
            return gather(dtensor)
        uneven_dtensor.dist = _LayoutPeers(*where)
        try:
            return gather(dtensor)
        finally:
            uneven_dtensor.dist = dist

    patches.setattr(pgb.DataParallelBuffer, "get_item", recorded_get_item)
    patches.setattr(pgb, "make_fsdp_dtensor", make_fsdp_dtensor)
    patches.setattr(uneven_dtensor, "gather_and_compute_chunk_metadata", gather_and_compute_chunk_metadata)


def install_rng_sync(patches: Any, values: Any) -> None:
    """Megatron-FSDP's ``sync_rng_states_across_tp_group`` broadcasts TP rank 0's RNG states to the TP group; the
    other ranks pass ``[None]`` and load what arrives. A virtual rank 0's object mirrors this rank's, which is that
    ``None`` (``_load_rng_state_dict(None)`` fails). Every rank now passes its own states as the placeholder: a real
    root's states still replace them; a virtual root's are this rank's (the mirror). Counted in the values summary."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    site = ("megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:sync_rng_states_across_tp_group",
            "TP rank 0's RNG states: this rank's (mirrored) when rank 0 is virtual")

    def sync_rng_states_across_tp_group(self: Any) -> None:
        import torch

        if self.tp_group.size() <= 1:
            return
        broadcast_list = [adapter._get_rng_state_dict()]
        torch.distributed.broadcast_object_list(broadcast_list, group=self.tp_group, group_src=0)
        adapter._load_rng_state_dict(broadcast_list[0])
        values.answers[site] += 1

    for cls in vars(adapter).values():
        if isinstance(cls, type) and "sync_rng_states_across_tp_group" in vars(cls):
            patches.setattr(cls, "sync_rng_states_across_tp_group", sync_rng_states_across_tp_group)
