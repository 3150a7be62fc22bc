"""The error contract of every layer, and the validators the config layers share.

`ConfigError` (a `ValueError`) is the base of every user-input error: emulation config, hardware profile,
recipe, graph file, fault spec, launch flags. Its message names the field and says how to fix it; the CLI
prints it and exits 2, before any process group exists. Internal invariants are ``assert``s, not errors.

Validators (`positive_int`, `rank_in_range`, `parse_rank_list`, `coerce_enum`) are the one copy of each
check the config, topology, faults and recipe layers make.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["ConfigError", "coerce_enum", "parse_rank_list", "positive_int", "rank_in_range"]

E = TypeVar("E", bound=Enum)


class ConfigError(ValueError):
    """User input that cannot describe an emulation; the message names the field and the fix."""


def parse_rank_list(text: str, *, field_name: str = "real_ranks") -> tuple[int, ...]:
    """Parse ``"0,5,8-11"`` into ``(0, 5, 8, 9, 10, 11)``; ranges are inclusive."""
    ranks: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                start, stop = int(lo), int(hi)
                if stop < start:
                    raise ConfigError(f"{field_name}: range {part!r} is empty; write it low-high, e.g. 4-7")
                ranks.extend(range(start, stop + 1))
            else:
                ranks.append(int(part))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"{field_name}: {part!r} is not a rank; give comma-separated integers or ranges, e.g. 0,5,8-11"
            ) from None
    if not ranks:
        raise ConfigError(f"{field_name}: no ranks given; name at least one real rank, e.g. 0")
    return tuple(ranks)


def positive_int(name: str, value: object, *, hint: str = "pass an integer >= 1") -> int:
    """`value` when it is an int >= 1 (not a bool), else a `ConfigError` naming `name`.

    >>> positive_int("tp", 8)
    8
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int: {hint}")
    return value


def rank_in_range(rank: object, world_size: int, name: str = "rank") -> int:
    """`rank` when it is an int in ``[0, world_size)``, else a `ConfigError` naming `name`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(
            f"{name}={rank!r} is out of range for world_size={world_size}: "
            f"pass an int with 0 <= {name} < {world_size}"
        )
    return rank


def coerce_enum(enum: type[E], value: object, name: str) -> E:
    """`value` as a member of `enum` (a member, or its value), else a `ConfigError` listing the choices.

    >>> from prism_plugin.config.kinds import DataPolicy
    >>> coerce_enum(DataPolicy, "mirror", "data_policy")
    <DataPolicy.MIRROR: 'mirror'>
    """
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in enum)
        raise ConfigError(f"{name}={value!r} is not one of: {choices}") from None
