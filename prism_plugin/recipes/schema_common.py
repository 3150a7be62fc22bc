"""What the recipe schema's modules share: `RecipeError` and the value checks its messages come from.

Pure: stdlib and the config layer.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, TypeVar

from prism_plugin.config.errors import ConfigError, coerce_enum, int_at_least

__all__ = ["RecipeError", "enum_field", "fraction", "positive_int", "range_pair"]


class RecipeError(ConfigError):
    """A recipe that cannot run; the message names the file, the field and the fix."""


E = TypeVar("E", bound=StrEnum)


def positive_int(value: Any, where: str, *, zero: bool = False) -> int:
    return int_at_least(where, value, 0 if zero else 1, error=RecipeError)


def enum_field(cls: type[E], value: Any, where: str) -> E:
    return coerce_enum(cls, value, where, error=RecipeError)


def fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise RecipeError(f"{where} must be a finite number >= 0 (a fraction: 0.25 = 25%), got {value!r}")
    return float(value)


def range_pair(value: Any, where: str) -> tuple[float, float]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or len(value) != 2:
        raise RecipeError(f"{where} must be a [low, high] pair of numbers, got {value!r}")
    low, high = (fraction(v, where) for v in value)
    if low > high:
        raise RecipeError(f"{where}: low {low:g} is above high {high:g}; write [low, high]")
    return low, high
