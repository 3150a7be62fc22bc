"""Virtual-GPU memory of a recipe's runs: one row per rank and device, and the checks of `Expect`'s figures.

From each real rank's prism summary (``virtual_gpu.devices``, `prism_plugin.device`): the
devices the rank used (peak reserved > 0) and always its own device (``LOCAL_RANK`` = its index in its
real-rank set, modulo the devices per process). The stated figures (``peak_allocated_bytes``,
``peak_reserved_bytes``, ``fits``, ``ooms``) are checked exactly on the rank's own device. Pure: stdlib only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prism_plugin.config.kinds import DeviceMode
from prism_plugin.recipes.expect import ExpectCheck
from prism_plugin.recipes.schema import Emulation, Recipe

__all__ = ["MemoryRow", "check_memory", "gib", "memory_rows"]


def gib(x: int) -> str:
    return f"{x / 2**30:.2f}"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRow:
    emulation: str
    rank: int
    device: int
    own_device: bool
    """The device the rank's process uses (``torch.cuda.set_device(LOCAL_RANK)``): the one its expect checks."""
    gpu: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fragmentation_at_peak: float
    device_total_bytes: int
    """Peak reserved + cuBLAS workspaces + NCCL buffers + the CUDA context: what the job needs of the GPU."""
    gpu_memory_bytes: int
    fits: bool
    ooms: int
    emulated_step_s: float | None = None
    """Virtual time's step of the rank (median of its marked iterations; None without virtual time)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _own_device(emu: Emulation, rank: int, num_devices: int) -> int:
    for run in emu.runs:
        if rank in run:
            return run.index(rank) % max(1, num_devices)
    raise KeyError(rank)


def memory_rows(recipe: Recipe, summaries: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]]) -> list[MemoryRow]:
    """Rows of every virtual-GPU emulation's ranks (the last summary of each rank: runs are deterministic)."""
    rows = []
    for emu in recipe.emulated:
        if emu.device is not DeviceMode.VIRTUAL_GPU:
            continue
        for rank, docs in sorted(summaries.get(emu.name, {}).items()):
            vgpu = docs[-1].get("virtual_gpu") if docs else None
            if not vgpu:
                continue
            own = _own_device(emu, rank, len(vgpu["devices"]) + len(vgpu.get("untouched_devices", ())))
            steps = (vgpu.get("virtual_time") or {}).get("step_times_s") or []
            step = round(statistics.median(steps), 9) if steps else None
            for d in vgpu["devices"]:
                if d["device"] != own and not d["peak_reserved_bytes"]:
                    continue
                rows.append(MemoryRow(
                    emulation=emu.name, rank=rank, device=d["device"], own_device=d["device"] == own, gpu=vgpu["gpu"],
                    peak_allocated_bytes=d["peak_allocated_bytes"], peak_reserved_bytes=d["peak_reserved_bytes"],
                    fragmentation_at_peak=d["fragmentation_at_peak"], device_total_bytes=d["device_total_bytes"],
                    gpu_memory_bytes=vgpu["gpu_memory_bytes"], fits=d["fits"], ooms=len(d["ooms"]),
                    emulated_step_s=step))
    return rows


def _figure(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name.endswith("bytes"):
        return f"{value:,} B"
    return f"{value:.9f} s" if name.endswith("_s") else str(value)


def check_memory(recipe: Recipe, emu: Emulation, rows: Sequence[MemoryRow]) -> list[ExpectCheck]:
    """One check per stated figure and real rank of `emu` (a rank without a summary fails each)."""
    exp = emu.expect
    if exp is None or not exp.states_memory:
        return []
    checks = []
    for rank in emu.real_ranks:
        row = next((r for r in rows if r.emulation == emu.name and r.rank == rank and r.own_device), None)
        for name in ("peak_allocated_bytes", "peak_reserved_bytes", "fits", "ooms", "emulated_step_s"):
            want = getattr(exp, name)
            if want is None:
                continue
            got = None if row is None else getattr(row, name)
            text = "no virtual_gpu summary" if row is None else _figure(name, got)
            expected = _figure(name, want)
            checks.append(ExpectCheck(emulation=emu.name, rank=rank, check=name, expected=expected, measured=text,
                                      passed=row is not None and got == want,
                                      values={} if row is None else row.to_dict()))
    return checks
