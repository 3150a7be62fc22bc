"""Rank N-1's logs when rank N-1 is virtual: redirected to the lowest real rank, and said so.

Megatron keeps its training log line, ``print_rank_last`` output, TensorBoard / W&B /
one-logger writers and timer reports on the last rank (``is_last_rank()``,
``args.rank == args.world_size - 1``, ``Timers.log(rank=None)``). When that rank is virtual the
job would print nothing, so the lowest real rank takes its place for those outputs only (it keeps
its own rank everywhere else). ``print_rank_0`` output is likewise printed by the lowest real rank
when rank 0 is virtual. Nothing changes when rank N-1 (resp. 0) is real.

Limitation: the redirected rank prints what *it* computed: the loss in Megatron's log line is only
known on the last pipeline stage, so a redirected rank on another stage logs no loss value.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

from prism_plugin.device.undo import Patches

__all__ = ["install", "log_rank_for"]


def log_rank_for(world_size: int, real_ranks: tuple[int, ...], target: int) -> int | None:
    """The real rank that stands in for `target` (None when `target` is itself real).

    >>> log_rank_for(8192, (5, 4100), 8191)
    5
    >>> log_rank_for(8192, (0, 8191), 8191) is None
    True
    """
    return None if target in real_ranks else min(real_ranks)


def install(session: Any, patches: Patches) -> int | None:
    """Install the redirections for `session`; returns the stand-in for rank N-1 (or None)."""
    from prism_plugin.adapters.megatron.adapter import rebind_everywhere

    world = session.config.world
    n = world.world_size
    last_by = log_rank_for(n, world.real_ranks, n - 1)
    first_by = log_rank_for(n, world.real_ranks, 0)
    me = session.rank
    if last_by is not None and me == last_by:
        print(f"prism: rank {n - 1} (the last rank, where Megatron logs) is virtual; its logs, timers and "
              f"TensorBoard/W&B writers are produced by rank {me}, the lowest real rank", flush=True)
    if first_by is not None and me == first_by:
        print(f"prism: rank 0 is virtual; print_rank_0 output is printed by rank {me}, the lowest real rank",
              flush=True)
    _redirect_core_timers(n, last_by, me, patches)
    if "megatron.training.utils.common_utils" in sys.modules:
        _redirect_training(n, last_by, first_by, me, patches, rebind_everywhere)
    return last_by


def _redirect_core_timers(n: int, last_by: int | None, me: int, patches: Patches) -> None:
    if last_by is None:
        return
    from megatron.core.timers import Timers

    original = Timers.log

    @functools.wraps(original)
    def log(self: Any, names: Any, rank: int | None = None, *args: Any, **kwargs: Any) -> Any:
        return original(self, names, last_by if rank is None else rank, *args, **kwargs)

    patches.setattr(Timers, "log", log)


def _redirect_training(n: int, last_by: int | None, first_by: int | None, me: int,
                       patches: Patches, rebind: Callable[..., int]) -> None:
    import megatron.training.global_vars as global_vars
    import megatron.training.utils.common_utils as common

    if last_by is not None:
        original_is_last = common.is_last_rank
        is_stand_in = me == last_by

        @functools.wraps(original_is_last)
        def is_last_rank() -> bool:
            return is_stand_in

        rebind(original_is_last, is_last_rank, patches)  # also common's own global, read by print_rank_last
        for name in ("_set_tensorboard_writer", "_set_wandb_writer", "_set_one_logger"):
            original = getattr(global_vars, name)

            def as_last(args: Any, _original: Any = original) -> Any:
                if is_stand_in and getattr(args, "rank", None) == me:
                    args = argparse.Namespace(**vars(args))
                    args.rank = args.world_size - 1
                return _original(args)

            functools.update_wrapper(as_last, original)
            patches.setattr(global_vars, name, as_last)
    if first_by is not None and me == first_by:
        original_print0 = common.print_rank_0

        @functools.wraps(original_print0)
        def print_rank_0(message: Any, rank: int | None = None) -> None:
            if rank is None or rank == 0:
                print(message, flush=True)

        rebind(original_print0, print_rank_0, patches)
