"""Bit-exact comparison of results returned by the workers (nested dicts / lists of tensors)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["assert_same", "assert_same_figures", "bits", "all_finite", "same"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (so -0.0 != 0.0 and NaN payloads compare exactly)."""
    t = t.detach().contiguous()
    if t.is_floating_point() or t.is_complex():
        return t.view(_INT_OF_SIZE[t.element_size()] if not t.is_complex() else torch.int64)
    return t


def _diff(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(bits(a), bits(b)):
            return (f"{path}: values differ\n  got      {a.flatten()[:16].tolist()}\n"
                    f"  expected {b.flatten()[:16].tolist()}")
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            found = _diff(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def same(a: Any, b: Any) -> bool:
    return _diff(a, b, "") is None


def assert_same(got: Any, expected: Any, what: str = "result") -> None:
    """Fail naming the first differing leaf unless `got` equals `expected` bit for bit."""
    found = _diff(got, expected, what)
    assert found is None, found


def all_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() and not bool(torch.isfinite(value).all()))
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(all_finite(v) for v in value)
    return True


def assert_same_figures(a: Any, b: Any, *, rel_tol: float, abs_tol: float, ignore: frozenset[str] = frozenset(),
                        path: str = "") -> None:
    """Two runs' reports (nested dicts and lists of numbers) are the same: the same keys but `ignore`d ones, the same
    integers and strings, floats within `rel_tol` / `abs_tol` (a sum against a product); the first difference is
    named by its path."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() - ignore == b.keys() - ignore, path
        for k in a.keys() - ignore:
            assert_same_figures(a[k], b[k], rel_tol=rel_tol, abs_tol=abs_tol, ignore=ignore, path=f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_figures(x, y, rel_tol=rel_tol, abs_tol=abs_tol, ignore=ignore, path=f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol), (path, a, b)
    else:
        assert a == b, (path, a, b)
