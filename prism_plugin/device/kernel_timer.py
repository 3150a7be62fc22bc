"""The kernel timer of virtual time: each op's modelled duration from a kernel model, and the per-op tallies.

`KernelTimer` applies a `prism_plugin.cost.kernels.KernelModel` to each op's `KernelCost`
(`prism_plugin.device.kernels.kernel_cost`) and to each fusion region's one kernel (`fusion`), and keeps per-op
tallies (`OpTally`) for the summary (`KernelSummary`); the virtual-time clock (`clock.VirtualTime`) puts each
duration on the op's stream. Split from `prism_plugin.device.kernels`, which says what an op costs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from prism_plugin.cost.kernel_table import TableModel
from prism_plugin.cost.kernels import KernelClass, KernelCost, KernelModel
from prism_plugin.device.kernels import _op_info, kernel_cost

__all__ = ["MOSTLY_MISSED", "KernelSummary", "KernelTimer", "OpTally"]


@dataclass(slots=True)
class OpTally:
    """One op's kernels so far: how many, their modelled seconds, FLOPs and bytes."""

    op: str
    kernel_class: KernelClass
    count: int = 0
    total_s: float = 0.0
    flops: int = 0
    bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelSummary:
    """What the kernel model answered over a run: the model's name, totals, the top ops by time, table misses."""

    model: str
    kernels: int
    total_s: float
    flops: int
    bytes: int
    by_class_s: dict[str, float]
    top: tuple[OpTally, ...]
    """The ops with the most modelled time, largest first (ties: by op name)."""
    misses: dict[str, int] = field(default_factory=dict)
    """``table`` only: kernels per op with no entry of their op and dtype (the fallback roofline answered)."""
    interpolated: dict[str, int] = field(default_factory=dict)
    defaults_used: tuple[str, ...] = ()
    """Kernel-model figures (dotted keys) no profile set: policy defaults."""
    fused: tuple[OpTally, ...] = ()
    """Every fusion region's kernel (``fused::<name>``, `prism_plugin.device.fusion`), by op name."""
    table: dict[str, Any] | None = None
    """``table`` only: the table's file and device, and how its kernels were answered (``exact``, ``scaled`` from
    a neighbour, ``missed``: the roofline answered) with ``missed_fraction``; `table_warning` says when it is
    mostly the roofline."""

    def table_warning(self) -> str | None:
        """A line for the user when most kernels (`MOSTLY_MISSED` or more) missed the table: the step time is then
        mostly the roofline's, whatever the model's name says (a table of another GPU, dtype or program)."""
        t = self.table
        if not t or t["missed_fraction"] < MOSTLY_MISSED:
            return None
        return (f"prism: kernel table {t['source']} ({t['device']}) answered {t['exact'] + t['scaled']} of "
                f"{t['kernels']} kernels; {t['missed']} ({100 * t['missed_fraction']:.1f}%) fell back to the roofline, "
                "so this step time is mostly the roofline's: record a table of this program's kernels, dtype and GPU "
                "(`prism kernels record`)")

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a JSON report."""
        return {
            "model": self.model, "kernels": self.kernels, "total_s": round(self.total_s, 12), "flops": self.flops,
            "bytes": self.bytes, "by_class_s": {k: round(v, 12) for k, v in self.by_class_s.items()},
            "top": [_tally_dict(t) for t in self.top], "fused": [_tally_dict(t) for t in self.fused],
            "misses": self.misses, "interpolated": self.interpolated, "defaults_used": list(self.defaults_used),
            **({"table": self.table} if self.table is not None else {}),
        }

    def lines(self) -> list[str]:
        """A human-readable report, one line per item."""
        out = [f"kernel model {self.model}: {self.kernels} kernels, {self.total_s * 1e3:.3f} ms, "
               f"{self.flops / 1e12:.3f} TFLOP, {self.bytes / 1e9:.3f} GB"]
        for t in self.top:
            out.append(f"  {t.op:<48} {t.kernel_class.value:<11} {t.count:>8} x  {t.total_s * 1e3:10.3f} ms")
        if self.misses:
            out.append("  table misses (roofline used): " + ", ".join(f"{op} x{n}" for op, n in self.misses.items()))
        warning = self.table_warning()
        if warning:
            out.append("  " + warning)
        if self.fused:
            out.append("  fusion regions: " + ", ".join(f"{t.op} x{t.count}" for t in self.fused))
        if self.defaults_used:
            out.append("  policy defaults (no profile figure): " + ", ".join(self.defaults_used))
        return out


MOSTLY_MISSED = 0.5
"""The fraction of kernels missing from a table above which a run says its step time is mostly the roofline's."""


def _table_coverage(table: TableModel) -> dict[str, Any]:
    exact, scaled, missed = (sum(d.values()) for d in (table.hits(), table.interpolated(), table.misses()))
    kernels = exact + scaled + missed
    return {"source": table.source, "device": table.device, "kernels": kernels, "exact": exact, "scaled": scaled,
            "scaled_by": table.scaled_by, "missed": missed,
            "missed_fraction": round(missed / kernels, 6) if kernels else 0.0}


def _tally_dict(t: OpTally) -> dict[str, Any]:
    return {"op": t.op, "class": t.kernel_class.value, "count": t.count, "total_s": round(t.total_s, 12),
            "flops": t.flops, "bytes": t.bytes}


class KernelTimer:
    """Times each op call with a kernel model and tallies per op; the dispatch mode calls `duration_s`, a fusion
    region's end `region_duration_s`.

    Example: ``KernelTimer(kernel_model("roofline", gpu, profile.kernels)).duration_s(func, args, kwargs, out)``
    is the op's modelled seconds, or None when it launches no kernel.
    """

    def __init__(self, model: KernelModel, *, device_types: Collection[str] = ("cuda",)) -> None:
        self.model = model
        self.device_types = tuple(device_types)
        self._tallies: dict[tuple[str, KernelClass], OpTally] = {}
        self._no_kernel: dict[int, Any] = {}
        """id(func) -> func of overloads that launch no kernel (views, metadata): skipped before any costing.
        Keyed by id (an OpOverload hashes in Python) and holding the overload, so the id stays its own."""

    def duration_s(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> float | None:
        if id(func) in self._no_kernel:
            return None
        if isinstance(func, torch._ops.OpOverload) and _op_info(func).kernel_class is None:
            self._no_kernel[id(func)] = func
            return None
        cost = kernel_cost(func, args, kwargs, out, device_types=self.device_types)
        if cost is None:
            return None
        seconds = self.model.duration_s(cost)
        self._tally(cost, seconds)
        return seconds

    def region_duration_s(self, cost: KernelCost, parts: tuple[KernelCost, ...] = ()) -> float:
        """The modelled seconds of a fusion region's one kernel `cost`, tallied under its op (``fused::<name>``).
        A ``table`` model without entries of that kernel (recorded where the region ran unfused, e.g. on a CPU)
        times it as the sum of its ops' costs `parts`, each looked up (and counted) as an op's would be."""
        table = self.model if isinstance(self.model, TableModel) else None
        if parts and table is not None and not table.has_op(cost.op, cost.dtype):
            seconds = sum(table.duration_s(part) for part in parts)
        else:
            seconds = self.model.duration_s(cost)
        self._tally(cost, seconds)
        return seconds

    def _tally(self, cost: KernelCost, seconds: float) -> None:
        key = (cost.op, cost.kernel_class)  # one op may launch kernels of two classes (copy_: device or host)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = OpTally(cost.op, cost.kernel_class)
        tally.count += 1
        tally.total_s += seconds
        tally.flops += cost.flops
        tally.bytes += cost.bytes

    def totals(self) -> dict[tuple[str, str, str], float]:
        """Each op's tallies as running totals, keyed (op, class, figure): what repeated work adds to."""
        return {(t.op, k.value, f): getattr(t, f) for (_, k), t in self._tallies.items()
                for f in ("count", "total_s", "flops", "bytes")}

    def advance(self, deltas: dict[tuple[str, str, str], float], times: int) -> None:
        """Repeated work fast-forwarded (`prism_plugin.device.fast_forward`): each tally grows by `times` x its
        delta (every op in `deltas` ran in the proven work, so it has a tally)."""
        by_key = {(t.op, k.value): t for (_, k), t in self._tallies.items()}
        for (op, kind, figure), delta in deltas.items():
            tally = by_key[(op, kind)]
            setattr(tally, figure, getattr(tally, figure) + times * delta)

    def summary(self, top: int = 15) -> KernelSummary:
        tallies = sorted(self._tallies.values(), key=lambda t: (-round(t.total_s, 12), t.op))
        by_class: dict[str, float] = {}
        for t in tallies:
            by_class[t.kernel_class.value] = by_class.get(t.kernel_class.value, 0.0) + t.total_s
        efficiency = getattr(self.model, "efficiency", None) or getattr(
            getattr(self.model, "fallback", None), "efficiency", None)
        table = self.model if isinstance(self.model, TableModel) else None
        return KernelSummary(
            model=self.model.name, kernels=sum(t.count for t in tallies), total_s=sum(t.total_s for t in tallies),
            flops=sum(t.flops for t in tallies), bytes=sum(t.bytes for t in tallies), by_class_s=by_class,
            top=tuple(OpTally(t.op, t.kernel_class, t.count, t.total_s, t.flops, t.bytes) for t in tallies[:top]),
            misses=table.misses() if table else {}, interpolated=table.interpolated() if table else {},
            defaults_used=efficiency.defaults_used if efficiency is not None else (),
            fused=tuple(OpTally(t.op, t.kernel_class, t.count, t.total_s, t.flops, t.bytes)
                        for t in sorted(tallies, key=lambda t: t.op) if t.op.startswith("fused::")),
            table=_table_coverage(table) if table else None,
        )
