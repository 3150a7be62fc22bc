"""What one rank's Megatron checkpoint holds and writes: bytes counted from the state dict Megatron builds.

The state dict is Megatron's own (``generate_state_dict``: the model's ``sharded_state_dict`` or
``state_dict_for_save_checkpoint``, the optimizer's, RNG and rerun states); on a virtual GPU its tensors are fakes,
whose shapes and dtypes are all that is counted. Three figures per save, each exact for what it counts:

- `SectionBytes`: every tensor the state dict holds, by top-level section (``model*``, ``optimizer*``, the rest:
  RNG and rerun states), each tensor counted at its own size (a view at the view's size);
- written bytes, ``torch_dist`` format (`sharded_written_bytes`): the ``ShardedTensor`` data this rank writes.
  Without a fully parallel save, the main replicas (``replica_id`` all zeros, Megatron's ``is_main_replica``).
  With it (Megatron's default), Megatron spreads the shards several members of the data-parallel group hold over
  those members (`fully_parallel_share`). The group's other members are taken to hold what this rank holds (the
  symmetric assumption): the distributed optimizer's buckets (keys ``optimizer.distributed.*``) one range per
  member, every other shard a copy on each member. Members differ in the ``replica_id``'s last (data-parallel)
  component only, so a shard another component marks as a replica is written by another group. Objects (RNG
  states, the common state: a few KB) are not counted;
- written bytes, ``torch`` (legacy) format (`storage_bytes`): ``torch.save`` writes each storage a tensor views
  once, whole, so the state dict's distinct storages.

Limitation: expert-parallel shards are held by part of the data-parallel group only (the expert-data-parallel
peers); the fully parallel share treats them as held by the whole group.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SectionBytes", "fully_parallel_share", "section_bytes", "sharded_written_bytes", "storage_bytes",
           "tensor_bytes", "largest_storage_bytes"]

PARTITIONED_PREFIX = "optimizer.distributed."
"""Keys of the distributed optimizer's ``dp_reshardable`` buckets: one range per data-parallel member."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SectionBytes:
    """A state dict's tensor bytes by top-level section."""

    model_bytes: int
    """``model`` / ``model<i>`` (one per virtual-pipeline chunk)."""
    optimizer_bytes: int
    """``optimizer``: main parameters and moments (and their buckets' metadata tensors)."""
    other_bytes: int
    """Everything else: RNG states, the rerun state machine's state."""

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.optimizer_bytes + self.other_bytes


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s elements (its own size; a view counts its view)."""
    return t.numel() * t.element_size()


def _tensors(node: Any) -> Iterator[torch.Tensor]:
    """Every tensor `node` holds: through dicts, lists, tuples, Megatron's sharded wrappers (their ``data``)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, LocalNonpersistentObject):
            continue  # kept on the rank, never saved
        elif hasattr(x, "data") and hasattr(x, "key"):  # ShardedTensor, ShardedObject, ShardedTensorFactory
            stack.append(x.data)


def section_bytes(state_dict: dict[str, Any]) -> SectionBytes:
    """`state_dict`'s tensor bytes by section (module docstring)."""
    sizes = {"model": 0, "optimizer": 0, "other": 0}
    for key, value in state_dict.items():
        section = "model" if key.startswith("model") else "optimizer" if key.startswith("optimizer") else "other"
        sizes[section] += sum(tensor_bytes(t) for t in _tensors(value))
    return SectionBytes(model_bytes=sizes["model"], optimizer_bytes=sizes["optimizer"], other_bytes=sizes["other"])


def _storages(state_dict: dict[str, Any]) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _tensors(state_dict)}


def storage_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes ``torch.save(state_dict)`` writes for its tensors: each distinct storage once, whole."""
    return sum(_storages(state_dict).values())


def largest_storage_bytes(state_dict: dict[str, Any]) -> int:
    """The largest storage of `state_dict`: ``torch.save`` copies device storages to the host one at a time."""
    return max(_storages(state_dict).values(), default=0)


def sharded_written_bytes(state_dict: dict[str, Any], *, fully_parallel: bool, group_size: int,
                          group_index: int) -> int:
    """Bytes of ``ShardedTensor`` data this rank writes in a ``torch_dist`` save (module docstring); factories are
    built first, as Megatron's save does (in place: pass a state dict of this call's own)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    apply_factories(state_dict)
    shards = [x for x in nested_values(state_dict) if isinstance(x, ShardedTensor)]
    if not fully_parallel or group_size <= 1:
        return sum(_shard_bytes(s) for s in shards if is_main_replica(s.replica_id))
    own = sum(_shard_bytes(s) for s in shards
              if s.key.startswith(PARTITIONED_PREFIX) and is_main_replica(s.replica_id))
    shared: dict[Any, int] = {}
    for s in shards:
        if not s.key.startswith(PARTITIONED_PREFIX) and _main_in_group(s.replica_id):
            shared[_sharded_tensor_shard_id(s)] = _shard_bytes(s)
    return fully_parallel_share(group_index, group_size, own, sorted(shared.items(), key=lambda kv: kv[0]))


def _main_in_group(replica_id: Any) -> bool:
    """Whether some member of this rank's data-parallel group holds the main replica of a shard this rank holds
    with `replica_id`: the members differ in the last (data-parallel) component only, so every other component
    must be 0 (a shard replicated over tensor-parallel ranks is written by the group of tensor-parallel rank 0)."""
    if isinstance(replica_id, int):
        return True
    return all(c == 0 for c in tuple(replica_id)[:-1])


def _shard_bytes(shard: Any) -> int:
    numel = 1
    for d in shard.local_shape:
        numel *= int(d)
    return numel * torch._utils._element_size(shard.dtype)


def fully_parallel_share(index: int, group_size: int, own_bytes: int, shared: Sequence[tuple[Any, int]]) -> int:
    """Bytes member `index` of a group of `group_size` writes when each member holds `own_bytes` of shards no other
    member has and every member holds each of `shared` ((shard id, bytes), ids sortable).

    Megatron's ``distribute_shards_to_ranks`` on that picture: shards held by one member go to it; then the
    shared ones, largest first (ties: smaller id first), each to the least-loaded member (ties: lowest index).
    A heap keeps it O(shards x log members) for groups of thousands.

    Example: 4 members, own 10 each, shared a..e of 8, 8, 4, 4, 4 bytes: a -> 0, b -> 1 (loads 18, 18, 10, 10),
    c -> 2, d -> 3 (18, 18, 14, 14), e -> 2 (18, 18, 18, 14); member 2 writes 10 + 4 + 4 = 18.
    """
    if not 0 <= index < group_size:
        raise ValueError(f"member index {index} is outside a group of {group_size}")
    loads = [(own_bytes, member) for member in range(group_size)]  # already a heap: equal loads, indices ascending
    mine = own_bytes
    for _shard_id, size in sorted(shared, key=lambda kv: (-kv[1], kv[0])):
        load, member = heapq.heappop(loads)
        if member == index:
            mine += size
        heapq.heappush(loads, (load + size, member))
    return mine
