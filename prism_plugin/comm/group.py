"""A virtual group: a process group over virtual ranks, seen from one real process.

It knows its members (global ranks), which of them are real, this process's position, and owns
the inner real group among the real members (created lazily at the first op that needs it: the
real members reach that op in the same order, as torch requires of every collective). Pure
bookkeeping plus the inner group; the data and timing rules live in `collectives`. Everything it needs
from its owner comes through the `OpContext` it is given (`prism_plugin.comm.context`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from prism_plugin.comm.context import OpContext

__all__ = ["VirtualGroup", "carries_data", "host_tensors"]


def carries_data(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` hold values to exchange: fake tensors (virtual GPUs) have shape, dtype and device only,
    so an op on them exchanges no data among the real members (their emulated times still travel)."""
    return not any(isinstance(t, FakeTensor) for t in tensors)


@contextlib.contextmanager
def host_tensors() -> Iterator[None]:
    """Real CPU tensors even under a virtual GPU's fake and dispatch modes (the exchanged time words)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


class VirtualGroup:
    """Membership, inner real group and per-group sequence numbers of one virtual group."""

    def __init__(self, ctx: OpContext, name: str, global_ranks: Sequence[int] | None, desc: str = "") -> None:
        self.ctx = ctx
        self.name = name
        self.desc = desc
        """torch's group description (fault specs select groups by it)."""
        self.is_world = global_ranks is None
        self.global_ranks: Sequence[int] = range(ctx.world_size) if global_ranks is None else tuple(global_ranks)
        self.size = len(self.global_ranks)
        rank = self.group_rank_of(ctx.rank)
        if rank is None:
            raise AssertionError(f"rank {ctx.rank} is not a member of group {name}")
        self.rank: int = rank
        # real members in group order: group rank and physical process index of each
        real_ranks = list(ctx.real_ranks)
        self.real_group_ranks: tuple[int, ...] = tuple(
            sorted(g for g in (self.group_rank_of(r) for r in real_ranks) if g is not None)
        )
        self.real_process_indices: tuple[int, ...] = tuple(
            real_ranks.index(self.global_ranks[g]) for g in self.real_group_ranks
        )
        self.num_real = len(self.real_group_ranks)
        self.my_real_index = self.real_group_ranks.index(self.rank)
        self.all_real = self.num_real == self.size
        self.seq = 0
        self._inner: dict[str, dist.ProcessGroup] = {}
        self.pending_root_payloads: deque[torch.Tensor] = deque()
        self._sent: dict[tuple[tuple[int, ...], torch.dtype, torch.device], weakref.ref[torch.Tensor]] = {}
        self._word_sends: list[tuple[dist.Work, torch.Tensor]] = []

    # -- membership -----------------------------------------------------------------------------
    def group_rank_of(self, global_rank: int) -> int | None:
        if self.is_world:
            return global_rank if 0 <= global_rank < self.size else None
        try:
            return self.global_ranks.index(global_rank)
        except ValueError:
            return None

    def is_real(self, group_rank: int) -> bool:
        return group_rank in self.real_group_ranks

    def real_index(self, group_rank: int) -> int:
        """Index of a real member among the real members (its rank in the inner group)."""
        return self.real_group_ranks.index(group_rank)

    def mirror_source(self, group_rank: int) -> int:
        """The real member whose block fills virtual slot `group_rank` (fixed by position)."""
        return self.real_group_ranks[group_rank % self.num_real]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # -- inner real group -------------------------------------------------------------------------
    def inner(self, device: torch.device) -> dist.ProcessGroup:
        """The real group among the real members (gloo for CPU tensors, NCCL for CUDA)."""
        key = device.type
        pg = self._inner.get(key)
        if pg is None:
            if self.num_real < 2:
                raise AssertionError(f"group {self.name} has no other real member")
            pg = self.ctx.make_inner_group(
                f"prism/{self.name}/{key}", self.my_real_index, self.num_real, key,
                timedelta(seconds=self.ctx.timeout_s),
            )
            self._inner[key] = pg
        return pg

    # -- emulated times of the real members (virtual time: `prism_plugin.device.clock`) ----------
    def exchange_max(self, values: Sequence[float]) -> list[float]:
        """The element-wise max of `values` over the real members: one float64 all-reduce (MAX: exact, the same
        on every member whatever the order) on the inner gloo group; blocks until every real member gave its."""
        with host_tensors():
            words = torch.tensor(list(values), dtype=torch.float64)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
            self._wait_word(self.inner(torch.device("cpu")).allreduce([words], opts), "a collective")
            return words.tolist()

    def send_word(self, dst: int, tag: int, value: float) -> None:
        """Send `value` to real member `dst` (group rank); never blocks (the word's send is kept until done)."""
        with host_tensors():
            self._word_sends = [(w, t) for w, t in self._word_sends if not w.is_completed()]
            word = torch.tensor([value], dtype=torch.float64)
            self._word_sends.append((self.inner(torch.device("cpu")).send([word], self.real_index(dst), tag), word))

    def recv_word(self, src: int, tag: int) -> float:
        """The value real member `src` (group rank) sent with `tag`; blocks until it was sent."""
        with host_tensors():
            word = torch.zeros(1, dtype=torch.float64)
            self._wait_word(self.inner(torch.device("cpu")).recv([word], self.real_index(src), tag),
                            f"a recv from group rank {src} (tag {tag})")
            return float(word[0])

    def _wait_word(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise RuntimeError(
                f"prism: the emulated times of the real members of group {self.name!r} did not arrive for {what} "
                f"(op {self.seq} of the group): a real peer stopped, or the real ranks issue ops of groups they "
                f"share in different orders, or a recv before the send it waits for on both sides (each real rank "
                f"blocks at such an op until its real peers issued it). The inner gloo group said: {exc}") from exc

    # -- mirror memory for receives from virtual peers ---------------------------------------------
    def remember_sent(self, tensor: torch.Tensor) -> None:
        """Remember (weakly: no memory is held) the last tensor sent with this shape and dtype."""
        self._sent[(tuple(tensor.shape), tensor.dtype, tensor.device)] = weakref.ref(tensor)

    def sent_like(self, tensor: torch.Tensor) -> torch.Tensor | None:
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        ref = self._sent.get(key)
        sent = None if ref is None else ref()
        # needed by megatron adapter: Megatron's pipeline schedules "deallocate" a sent output
        # (``out.data = torch.empty((1,))``) while the tensor object lives on; its one element is
        # uninitialised memory, which a later receive mirrored (grad norm inf). Mirror a sent tensor
        # only while it still has the shape it was sent with.
        if sent is not None and (tuple(sent.shape), sent.dtype, sent.device) != key:
            return None
        return sent

    def __repr__(self) -> str:
        return f"VirtualGroup({self.name}, size={self.size}, rank={self.rank}, real={list(self.real_group_ranks)})"
