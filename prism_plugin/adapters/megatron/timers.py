"""Megatron's timers on virtual GPUs: they read the emulated clock, and their report across ranks is this rank's.

Megatron's ``Timer`` (``megatron/core/timers.py``) times a region as ``torch.cuda.synchronize()`` then
``time.time()`` at its start and stop. On a virtual GPU the synchronize brings the emulated host clock to the
device's end, so the timers here read that clock (the module's ``time``; the rest of the program keeps the host's
clock unless ``--prism-program-time emulated``): Megatron's ``elapsed time per iteration``, its
``throughput per GPU (TFLOP/s/GPU)`` (``--log-throughput``), the ``--timing-log-level`` reports and the
``iteration-time`` and ``*-time`` TensorBoard scalars (``--log-timers-to-tensorboard``) are the emulated job's
figures (modelled), not this host's seconds of fake dispatch.

Across ranks, ``Timers._get_elapsed_time_all_ranks`` fills a ``[world, names]`` device tensor with this rank's
times, all-gathers it and reads it on the host. The all-gather still runs (its time and its count are the job's);
a fake tensor holds no values, so the table is built on the host with every rank's row equal to this rank's
(virtual participants take the time this rank takes: the symmetric-arrivals assumption), and each report is
counted (`TimerSeams.mirrored_reports`). The (min, max) pairs Megatron prints are therefore equal.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from prism_plugin.device.undo import Patches

__all__ = ["TimerSeams", "install"]


class TimerSeams:
    """What the timer seams did, for the summary."""

    def __init__(self) -> None:
        self.mirrored_reports = 0
        """Reports across ranks answered with this rank's times in every row."""
        self._reading: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        return {"clock": "emulated", "across_ranks": "every rank's row is this rank's (symmetric arrivals)",
                "mirrored_reports": self.mirrored_reports}


def install(patches: Patches, clock: Any) -> TimerSeams:
    """Point Megatron's timers at `clock` (`prism_plugin.device.clock.VirtualTime`) and mirror their reports."""
    import megatron.core.timers as timers

    seams = TimerSeams()
    emulated = types.SimpleNamespace(time=lambda: clock.host_s)  # Timer keeps differences only: exact seconds
    patches.setattr(timers, "time", emulated)

    original_elapsed = timers.Timer.elapsed

    @functools.wraps(original_elapsed)
    def elapsed(self: Any, *args: Any, **kwargs: Any) -> float:
        value = original_elapsed(self, *args, **kwargs)
        if seams._reading is not None:
            seams._reading[self.name] = value
        return value

    patches.setattr(timers.Timer, "elapsed", elapsed)
    original_all_ranks = timers.Timers._get_elapsed_time_all_ranks

    @functools.wraps(original_all_ranks)
    def all_ranks(self: Any, names: Any, reset: bool, barrier: bool) -> Any:
        seams._reading = {}
        try:
            gathered = original_all_ranks(self, names, reset, barrier)  # the barrier, the reads, the all-gather
            mine = [seams._reading.get(name, 0.0) for name in names]
        finally:
            seams._reading = None
        if gathered is None:
            return None
        seams.mirrored_reports += 1
        return torch.tensor([mine] * torch.distributed.get_world_size(), dtype=torch.float, device="cpu")

    patches.setattr(timers.Timers, "_get_elapsed_time_all_ranks", all_ranks)
    return seams
