"""The error contract of every layer, and the validators the config layers share.

`ConfigError` (a `ValueError`) is the base of every user-input error: emulation config, hardware profile
(`prism_plugin.cost.profiles.ProfileError`), recipe (`prism_plugin.recipes.schema.RecipeError`), graph file,
layout string, rank trace or slicing plan (`prism_plugin.graph.errors.GraphError`), fault spec, launch flags.
Its message names the field (and the file, where one was read) and says how to fix it; the CLI catches
`ConfigError` alone, prints it and exits 2, before any process group exists. Internal invariants are
``assert``s, not errors.

Validators (`positive_int`, `int_at_least`, `rank_in_range`, `parse_rank_list`, `coerce_enum`) are the one
copy of each check the config, topology, graph, faults, profile and recipe layers make. Each takes an
optional `hint` (the fix, appended to the message) and `error` (the layer's `ConfigError` subclass to raise).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["ConfigError", "coerce_enum", "int_at_least", "parse_rank_list", "positive_int", "rank_in_range"]

E = TypeVar("E", bound=Enum)


class ConfigError(ValueError):
    """User input that cannot describe an emulation; the message names the field and the fix."""


def _is_int_at_least(value: object, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def parse_rank_list(text: str, *, field_name: str = "real_ranks",
                    error: type[ConfigError] = ConfigError) -> tuple[int, ...]:
    """Parse ``"0,5,8-11"`` into ``(0, 5, 8, 9, 10, 11)``; ranges are inclusive.

    >>> parse_rank_list("0,5,8-11")
    (0, 5, 8, 9, 10, 11)
    >>> parse_rank_list("7-4")
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: real_ranks: range '7-4' is empty; write it low-high, e.g. 4-7
    """
    ranks: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        lo, sep, hi = part[1:].partition("-")
        try:
            if sep:
                start, stop = int(part[0] + lo), int(hi)
            else:
                start = stop = int(part)
        except ValueError:
            raise error(
                f"{field_name}: {part!r} is not a rank; give comma-separated integers or ranges, e.g. 0,5,8-11"
            ) from None
        if stop < start:
            raise error(f"{field_name}: range {part!r} is empty; write it low-high, e.g. 4-7")
        ranks.extend(range(start, stop + 1))
    if not ranks:
        raise error(f"{field_name}: no ranks given; name at least one real rank, e.g. 0")
    return tuple(ranks)


def positive_int(name: str, value: object, *, hint: str = "pass an integer >= 1",
                 error: type[ConfigError] = ConfigError) -> int:
    """`value` when it is an int >= 1 (not a bool), else `error` naming `name` (a size or a count).

    >>> positive_int("tp", 8)
    8
    >>> positive_int("tp", 0)
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: tp=0 must be a positive int: pass an integer >= 1
    """
    if not _is_int_at_least(value, 1):
        raise error(f"{name}={value!r} must be a positive int: {hint}")
    return value  # type: ignore[return-value]


def int_at_least(name: str, value: object, minimum: int, *, hint: str = "",
                 error: type[ConfigError] = ConfigError) -> int:
    """`value` when it is an int >= `minimum` (not a bool), else `error` naming `name` (steps, offsets).

    >>> int_at_least("steps.warmup", 0, 1, hint="step 0 is always discarded")
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: steps.warmup must be an integer >= 1, got 0 (step 0 is always discarded)
    """
    if not _is_int_at_least(value, minimum):
        raise error(f"{name} must be an integer >= {minimum}, got {value!r}" + (f" ({hint})" if hint else ""))
    return value  # type: ignore[return-value]


def rank_in_range(rank: object, world_size: int, name: str = "rank", *, hint: str = "",
                  error: type[ConfigError] = ConfigError) -> int:
    """`rank` when it is an int in ``[0, world_size)``, else `error` naming `name`.

    >>> rank_in_range(16, 16)
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: rank=16 is out of range for world_size=16: pass an int with 0 <= rank < 16
    """
    if not _is_int_at_least(rank, 0) or rank >= world_size:  # type: ignore[operator]
        raise error(
            f"{name}={rank!r} is out of range for world_size={world_size}: "
            f"pass an int with 0 <= {name} < {world_size}" + (f" ({hint})" if hint else "")
        )
    return rank  # type: ignore[return-value]


def coerce_enum(enum: type[E], value: object, name: str, *, hint: str = "",
                error: type[ConfigError] = ConfigError) -> E:
    """`value` as a member of `enum` (a member, or its value), else `error` listing the choices.

    >>> from prism_plugin.config.kinds import DataPolicy
    >>> coerce_enum(DataPolicy, "mirror", "data_policy")
    <DataPolicy.MIRROR: 'mirror'>
    >>> coerce_enum(DataPolicy, "random", "data_policy")
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: data_policy='random' is not one of mirror, recorded, zeros
    """
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in enum)
        raise error(f"{name}={value!r} is not one of {choices}" + (f"; {hint}" if hint else "")) from None
