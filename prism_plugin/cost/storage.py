"""Checkpoint storage: the bandwidth one rank writes and reads a checkpoint at, and the time that takes.

A hardware profile's optional ``storage:`` section (every key optional)::

    storage:
      write_bandwidth_gbytes_per_s: 0.5   # what one GPU (rank) writes to the checkpoint file system, 1e9 bytes/s
      read_bandwidth_gbytes_per_s: 1.5    # what one GPU reads back from it when a job resumes

A figure the profile does not set is this module's policy default, listed by `StorageSpec.defaults_used` so a
summary can say which storage figures no profile gave. The defaults are the per-GPU share of a published
cluster's storage: Llama 3's 16,384-H100 training cluster wrote its checkpoints to Tectonic, which sustains
2 TB/s and peaks at 7 TB/s (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.1):

    write: 2e12 B/s / 16,384 GPUs = 122,070,312.5 B/s per GPU (0.1220703125 GB/s)
    read:  7e12 B/s / 16,384 GPUs = 427,246,093.75 B/s per GPU (0.42724609375 GB/s)

Limitations: one figure per GPU, whatever the job's size (a shared file system gives a small job more per GPU
than a full-cluster job gets); no metadata or per-file latency; writes of different ranks do not contend.
Set the figures your file system delivers (an IOR or fio run with one writer per GPU).

Pure: stdlib only (and the config layer's error contract).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self

from prism_plugin.config.errors import ConfigError

__all__ = ["DEFAULTS_GBYTES_PER_S", "GbytesSection", "StorageSpec"]

DEFAULTS_GBYTES_PER_S: Mapping[str, float] = {
    "write_bandwidth_gbytes_per_s": 2000.0 / 16384,  # Llama 3's Tectonic, 2 TB/s sustained over 16,384 GPUs
    "read_bandwidth_gbytes_per_s": 7000.0 / 16384,  # its 7 TB/s peak over the same GPUs
}
"""The policy defaults of the ``storage:`` figures (module docstring: where they come from)."""


class GbytesSection:
    """A profile section of optional per-GPU bandwidths in 1e9 bytes/s: the subclass's dataclass fields, each a
    positive number or None (its policy default, `DEFAULTS`); `SECTION` is the section's YAML key. Shared by
    ``storage:`` (`StorageSpec`) and ``host:`` (`prism_plugin.cost.host.HostSpec`)."""

    __slots__ = ()
    SECTION: ClassVar[str]
    DEFAULTS: ClassVar[Mapping[str, float]]

    def __post_init__(self) -> None:
        for name in self.DEFAULTS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"`{self.SECTION}.{name}` must be a positive number of 1e9 bytes/s per GPU, got "
                                  f"{value!r}; e.g. {name}: 0.5")
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_mapping(cls, data: object, *, where: str = "", error: type[ConfigError] = ConfigError) -> Self:
        """Parse the profile's mapping (None: all defaults); `where` prefixes messages (a file name)."""
        where = f"{where}: " if where else ""
        if data is None:
            return cls()
        first = next(iter(cls.DEFAULTS))
        if not isinstance(data, Mapping):
            raise error(f"{where}`{cls.SECTION}` must be a mapping, e.g. {{{first}: 0.5}}; got {data!r}")
        unknown = sorted(str(k) for k in data if k not in cls.DEFAULTS)
        if unknown:
            raise error(f"{where}unknown field `{cls.SECTION}.{unknown[0]}`; known fields: "
                        f"{', '.join(cls.DEFAULTS)}")
        try:
            return cls(**{str(k): v for k, v in data.items()})
        except ConfigError as exc:
            raise error(f"{where}{exc}") from None

    def to_mapping(self) -> dict[str, float]:
        """The figures the profile set (empty when none); `from_mapping` reads it back."""
        return {name: getattr(self, name) for name in self.DEFAULTS if getattr(self, name) is not None}

    @property
    def defaults_used(self) -> tuple[str, ...]:
        """Dotted keys (``<section>.<field>``) whose policy default is in use."""
        return tuple(f"{self.SECTION}.{name}" for name in self.DEFAULTS if getattr(self, name) is None)

    def bandwidth_bytes_per_s(self, name: str) -> float:
        """The figure `name` (a `DEFAULTS` key) in bytes/s: the profile's, else the default."""
        value = getattr(self, name)
        return 1e9 * (self.DEFAULTS[name] if value is None else value)


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageSpec(GbytesSection):
    """A profile's ``storage:`` section: per-GPU checkpoint bandwidths; None: the policy default.

    Example: ``StorageSpec().write_s(122_070_312.5 * 2) == 2.0`` (two seconds at the default write bandwidth),
    and ``StorageSpec().defaults_used == ("storage.write_bandwidth_gbytes_per_s",
    "storage.read_bandwidth_gbytes_per_s")``.
    """

    SECTION: ClassVar[str] = "storage"
    DEFAULTS: ClassVar[Mapping[str, float]] = DEFAULTS_GBYTES_PER_S

    write_bandwidth_gbytes_per_s: float | None = None
    """What one GPU writes to checkpoint storage, in 1e9 bytes/s (None: `DEFAULTS_GBYTES_PER_S`)."""
    read_bandwidth_gbytes_per_s: float | None = None
    """What one GPU reads from checkpoint storage, in 1e9 bytes/s (None: `DEFAULTS_GBYTES_PER_S`)."""

    def write_s(self, size_bytes: int) -> float:
        """Seconds one rank takes to write `size_bytes` to checkpoint storage."""
        return size_bytes / self.bandwidth_bytes_per_s("write_bandwidth_gbytes_per_s")

    def read_s(self, size_bytes: int) -> float:
        """Seconds one rank takes to read `size_bytes` back from checkpoint storage."""
        return size_bytes / self.bandwidth_bytes_per_s("read_bandwidth_gbytes_per_s")
