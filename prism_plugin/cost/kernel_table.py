"""Kernel tables: kernel durations measured on a device (``prism kernels record``) as a kernel model of virtual
time (`TableModel`, ``--kernel-model table``), and the roofline a table's own entries measure (`MeasuredRoofline`),
by which a table recorded on another device than the GPU emulated scales a near shape. The file format is
`TABLE_FORMAT` version `TABLE_VERSION` (written by `prism_plugin.runtime.kernel_recorder`). Pure: stdlib only.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prism_plugin.config.errors import ConfigError
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel

__all__ = ["TABLE_FORMAT", "TABLE_VERSION", "MeasuredRoofline", "TableModel"]

TABLE_FORMAT = "prism-kernel-table"
TABLE_VERSION = 1


@dataclass(frozen=True, slots=True)
class _Entry:
    cost: KernelCost
    duration_s: float


class TableModel:
    """Durations measured on a device, by (op, shape, dtype, device); nearest-shape scaling; roofline on a miss.

    Lookup of a kernel (within the table's one device): (1) an entry of the same op, shape and dtype: its
    measured time; (2) else the entry of the same op and dtype nearest in ``|ln(flops ratio)| + |ln(bytes
    ratio)|`` (ties: the first in the file's sorted order), its time scaled by the fallback roofline's ratio
    ``roofline(kernel) / roofline(neighbour)`` (the flops ratio when compute-bound, the bytes ratio when
    memory-bound, with wave quantization and the floor), counted in `interpolated`; (3) else the fallback
    roofline's time, counted in `misses`. Repeated entries of one key take their median.

    The roofline of step (2) is the measured device's. When the table's device is the GPU emulated
    (`target_device`, the GPU's name, or None: assumed the same), that is the fallback's. When it is another device
    (a table recorded on this host's CPU, emulating an H100 by name), the GPU's roofline would scale a CPU-measured
    time by H100 figures (a 64 x 512 x 2048 GEMM and one 4x its size both sit at an H100's kernel floor: ratio 1),
    so the neighbour is scaled by `MeasuredRoofline`: the roofline the table's own entries measure.

    File (JSON, written by ``prism kernels record``)::

        {"format": "prism-kernel-table", "version": 1, "entries": [
          {"op": "aten.mm.default", "kernel_class": "gemm", "shape": [4096, 4096, 4096], "dtype": "bfloat16",
           "device": "NVIDIA H100 80GB HBM3", "flops": 137438953472, "bytes": 100663296, "duration_us": 201.5}]}

    Limitations: the neighbour is one entry (no interpolation between two); a table measured on one device says
    nothing about another GPU's kernels: its exact entries are used as measured whatever the GPU emulated.
    """

    name = "table"

    def __init__(self, entries: list[tuple[KernelCost, str, float]], fallback: RooflineModel,
                 *, device: str | None = None, target_device: str | None = None, source: str = "<table>") -> None:
        """`entries`: (cost, device, duration_s) rows; `device`: which device's rows to use (None: the only one);
        `target_device`: the emulated GPU's name (another than the table's: neighbours scale by the table's own
        roofline)."""
        devices = sorted({dev for _, dev, _ in entries})
        if device is None:
            if len(devices) != 1:
                raise ConfigError(f"{source}: the table holds devices {devices}; name one (kernel table device)"
                                  if devices else f"{source}: the table has no entries; record one first")
            device = devices[0]
        elif device not in devices:
            raise ConfigError(f"{source}: no entries for device {device!r}; the table holds {devices}")
        self.device, self.fallback, self.source = device, fallback, source
        grouped: dict[tuple[str, tuple[int, ...], str], list[tuple[KernelCost, float]]] = {}
        for cost, dev, seconds in sorted(entries, key=lambda e: (e[0].op, e[0].dtype, e[0].shape, e[2])):
            if dev == device:
                grouped.setdefault((cost.op, cost.shape, cost.dtype), []).append((cost, seconds))
        self._exact = {key: _Entry(rows[0][0], sorted(s for _, s in rows)[len(rows) // 2])
                       for key, rows in grouped.items()}
        self._by_op: dict[tuple[str, str], list[_Entry]] = {}
        for (op, _, dtype), entry in self._exact.items():
            self._by_op.setdefault((op, dtype), []).append(entry)
        self._scale: RooflineModel | MeasuredRoofline = (
            fallback if target_device in (None, device) else MeasuredRoofline(list(self._exact.values())))
        self._hits: Counter[str] = Counter()
        self._interpolated: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()

    @classmethod
    def from_json(cls, path: str | Path, fallback: RooflineModel, *, device: str | None = None,
                  target_device: str | None = None) -> TableModel:
        """Load a table file (format above); a `ConfigError` naming the file, the entry and the field otherwise."""
        source = str(path)
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read kernel table {source!r} ({exc.strerror or exc}); check the path, "
                              "or record one with `prism kernels record -- <program>`") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}:{exc.lineno}:{exc.colno}: malformed JSON ({exc.msg})") from None
        if not isinstance(data, Mapping) or data.get("format") != TABLE_FORMAT:
            raise ConfigError(f"{source}: not a kernel table (expected an object with format: {TABLE_FORMAT!r})")
        if data.get("version") != TABLE_VERSION:
            raise ConfigError(f"{source}: table version {data.get('version')!r}; this build reads {TABLE_VERSION}")
        rows = data.get("entries")
        if not isinstance(rows, list):
            raise ConfigError(f"{source}: `entries` must be a list of measured kernels")
        return cls([_parse_entry(row, f"{source}: entries[{i}]") for i, row in enumerate(rows)], fallback,
                   device=device, target_device=target_device, source=source)

    def duration_s(self, cost: KernelCost) -> float:
        entry = self._exact.get((cost.op, cost.shape, cost.dtype))
        if entry is not None:
            self._hits[cost.op] += 1
            return entry.duration_s
        near = self._by_op.get((cost.op, cost.dtype))
        if not near:
            self._misses[cost.op] += 1
            return self.fallback.duration_s(cost)
        self._interpolated[cost.op] += 1
        best = min(near, key=lambda e: _distance(e.cost, cost))
        return best.duration_s * self._scale.duration_s(cost) / self._scale.duration_s(best.cost)

    @property
    def scaled_by(self) -> str:
        """Whose roofline scales a neighbour: ``gpu`` (the emulated GPU's, the table measured on it) or
        ``measured`` (the table's own, `MeasuredRoofline`: it was measured on another device)."""
        return "gpu" if self._scale is self.fallback else "measured"

    def has_op(self, op: str, dtype: str) -> bool:
        """Whether the table holds entries of `op` at `dtype` (a fusion region's kernel: only if recorded fused)."""
        return (op, dtype) in self._by_op

    def hits(self) -> dict[str, int]:
        """Kernels answered by an exact entry, per op."""
        return dict(sorted(self._hits.items()))

    def interpolated(self) -> dict[str, int]:
        """Kernels scaled from a neighbour of the same op and dtype, per op."""
        return dict(sorted(self._interpolated.items()))

    def misses(self) -> dict[str, int]:
        """Kernels with no entry of their op and dtype (the fallback roofline answered), per op."""
        return dict(sorted(self._misses.items()))


class MeasuredRoofline:
    """The roofline a kernel table's own entries measure, for scaling one entry to a near shape on the device it
    was measured on: ``max(flops / F, bytes / B, floor)``, with F the highest FLOP/s any entry of the kernel's
    class and dtype achieved (all its classes' when that one has none with FLOPs), B the highest bytes/s of an
    entry of its class (all classes' likewise) and the floor the shortest entry. No wave quantization (a CPU has
    no waves; a GPU's table is scaled by that GPU's roofline instead).

    >>> gemm = KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=2 * 64 * 512 * 2048,
    ...                   bytes=4 * (64 * 512 + 512 * 2048 + 64 * 2048), dtype="float32", shape=(64, 2048, 512))
    >>> roof = MeasuredRoofline([_Entry(gemm, 4e-3)])
    >>> big = KernelCost(op="aten.mm.default", kernel_class=KernelClass.GEMM, flops=4 * gemm.flops,
    ...                  bytes=4 * gemm.bytes, dtype="float32", shape=(64, 4096, 1024))
    >>> round(roof.duration_s(big) / roof.duration_s(gemm), 6)  # compute-bound at the measured rate: 4x the FLOPs
    4.0
    """

    name = "measured"

    def __init__(self, entries: list[_Entry]) -> None:
        self._flops: dict[tuple[KernelClass, str], float] = {}
        self._bytes: dict[KernelClass, float] = {}
        for e in entries:
            key = (e.cost.kernel_class, e.cost.dtype)
            if e.cost.flops:
                self._flops[key] = max(self._flops.get(key, 0.0), e.cost.flops / e.duration_s)
            if e.cost.bytes:
                self._bytes[e.cost.kernel_class] = max(self._bytes.get(e.cost.kernel_class, 0.0),
                                                       e.cost.bytes / e.duration_s)
        self._any_flops = max(self._flops.values(), default=0.0)
        self._any_bytes = max(self._bytes.values(), default=0.0)
        self._floor_s = min((e.duration_s for e in entries), default=0.0)

    def duration_s(self, cost: KernelCost) -> float:
        rate = self._flops.get((cost.kernel_class, cost.dtype), self._any_flops)
        bandwidth = self._bytes.get(cost.kernel_class, self._any_bytes)
        return max(cost.flops / rate if cost.flops and rate else 0.0,
                   cost.bytes / bandwidth if cost.bytes and bandwidth else 0.0, self._floor_s)


def _distance(a: KernelCost, b: KernelCost) -> float:
    return abs(math.log(max(a.flops, 1) / max(b.flops, 1))) + abs(math.log(max(a.bytes, 1) / max(b.bytes, 1)))


def _parse_entry(row: object, where: str) -> tuple[KernelCost, str, float]:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: must be an object with op, kernel_class, shape, dtype, device, flops, "
                          "bytes, duration_us")
    for key in ("op", "kernel_class", "shape", "dtype", "device", "flops", "bytes", "duration_us"):
        if key not in row:
            raise ConfigError(f"{where}: missing field `{key}`")
    for key in ("op", "dtype", "device"):
        if not isinstance(row[key], str) or not row[key]:
            raise ConfigError(f"{where}: `{key}` must be a non-empty string, got {row[key]!r}")
    try:
        kernel_class = KernelClass(row["kernel_class"])
    except ValueError:
        raise ConfigError(f"{where}: `kernel_class` {row['kernel_class']!r} is not one of "
                          f"{', '.join(c.value for c in KernelClass)}") from None
    shape = row["shape"]
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ConfigError(f"{where}: `shape` must be a list of integers >= 0, got {shape!r}")
    for key in ("flops", "bytes"):
        if isinstance(row[key], bool) or not isinstance(row[key], int) or row[key] < 0:
            raise ConfigError(f"{where}: `{key}` must be an integer >= 0, got {row[key]!r}")
    us = row["duration_us"]
    if isinstance(us, bool) or not isinstance(us, int | float) or not math.isfinite(us) or us <= 0:
        raise ConfigError(f"{where}: `duration_us` must be a number > 0 (a measured kernel time), got {us!r}")
    cost = KernelCost(op=row["op"], kernel_class=kernel_class, flops=row["flops"], bytes=row["bytes"],
                      dtype=row["dtype"], shape=tuple(shape))
    return cost, row["device"], us / 1e6
