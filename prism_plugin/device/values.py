"""The value policy of fake execution: what a data-dependent read returns when no tensor holds values.

Under fake tensors nothing is computed, so a read of a tensor's value (``aten._local_scalar_dense``: ``.item()``,
``float(t)``, ``bool(t)``, ``if t:``) has no answer of its own. The policy answers it from what produced the
tensor, and counts every answer per call site (the first frame outside torch and prism_plugin) for the summary:

- checks for bad values answer "none found": ``isnan`` / ``isinf`` / ``isneginf`` / ``isposinf`` give False,
  ``isfinite`` True, ``x != inf`` True, and reductions (``any``, ``all``, ``sum``, ``amax``, ...), products
  or ``logical_not`` of them keep or flip that answer; ``eq`` gives True and ``ne`` False (Megatron's RNG-tracker check
  ``torch.all(a == b).item()`` passes); a found-inf buffer after ``_amp_foreach_non_finite_check_and_unscale_``
  reads 0.0 (no inf: the optimizer steps);
- a read inside a program function an adapter stated an answer for (`SiteAnswer`, `ValuePolicy.state`: e.g.
  Megatron's count of zero gradient elements, which it only logs) returns that answer;
- any other floating-point read returns `float_value` (1.0: a finite loss, a finite grad norm);
- any other integer or boolean read has no stated answer and raises `NoValueError` naming the op and the call
  site (and how to run it on the host's own device, spelled as the entry point in use spells it:
  `ValuePolicy.real_device_hint`): never a silently wrong control path.

Non-goals: data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``) raise as FakeTensorMode
does; MoE routing counts are answered by the adapters' routing policy, not here.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from prism_plugin.device.leaves import leaves

__all__ = ["NoValueError", "SiteAnswer", "ValuePolicy"]

aten = torch.ops.aten
_FALSE_CHECKS = {aten.isnan.default, aten.isinf.default, aten.isneginf.default, aten.isposinf.default, aten.ne.Tensor}
_TRUE_CHECKS = {aten.isfinite.default, aten.eq.Tensor}
_SCALAR_CHECKS = {aten.eq.Scalar: False, aten.ne.Scalar: True}
"""Comparisons with a non-finite scalar (``x != inf``, ``x == nan``): what they answer for finite values."""
_KEEP = {aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims,
         aten.sum.default, aten.sum.dim_IntList, aten.amax.default, aten.max.default, aten.logical_or.default,
         aten.logical_and.default, aten._to_copy.default, aten.clone.default, aten.view.default,
         aten.reshape.default, aten.squeeze.default, aten.unsqueeze.default, aten.detach.default,
         aten.alias.default, aten.stack.default, aten.cat.default, aten.copy_.default, aten.bitwise_and.Tensor,
         aten.bitwise_or.Tensor, aten.mul.Tensor}
_FLIP = {aten.logical_not.default, aten.bitwise_not.default}
_DATA_LIMIT = 4096
_UNFILLED = frozenset({
    torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
})
"""Ops whose output holds no values (uninitialised memory): never computed on real values, never tagged; their
outputs are unknown until written."""
"""Largest tensor (elements) whose real values are kept: flags, counters, timestamps; never model tensors."""
_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,) if m.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # prism_plugin/


class NoValueError(RuntimeError):
    """A data-dependent read the value policy has no stated answer for."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteAnswer:
    """A stated answer for the data-dependent reads inside one program function (whatever the tensor's dtype).

    Example: ``SiteAnswer(path_suffix="megatron/core/optimizer/clip_grads.py", function="count_zeros_fp32",
    value=0, reason="no gradient element is exactly zero")``.
    """

    path_suffix: str
    """The end of the function's source path (``/``-separated), e.g. ``megatron/core/optimizer/clip_grads.py``."""
    function: str
    """The function's name (``co_name``) in that file."""
    value: bool | int | float
    """What every read there returns (cast to the read tensor's dtype)."""
    reason: str
    """Why this answer keeps the program's control flow valid (listed in the summary)."""

    def matches(self, path: str, function: str) -> bool:
        return function == self.function and path.replace(os.sep, "/").endswith(self.path_suffix)


def _site_frame() -> Any:
    """The first frame outside torch and prism_plugin (the program's call site), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP_DIRS) and not path.startswith(_OWN_DIR) and "<frozen" not in path:
            return frame
        frame = frame.f_back
    return None


def _call_site() -> str:
    frame = _site_frame()
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


class ValuePolicy:
    """Tags tensors that carry a known answer and answers their reads; counts every answer by call site."""

    def __init__(self, float_value: float = 1.0) -> None:
        self.float_value = float_value
        self.answers: Counter[tuple[str, str]] = Counter()  # (call site, answer) -> reads
        # id(tensor) -> answer, dropped when the tensor dies (a WeakKeyDictionary would compare tensors with ==)
        self._answers_of: dict[int, tuple[bool | int | float, weakref.ref]] = {}
        self.constants_read = 0  # reads of a value the program itself put in the tensor (torch.tensor([...]))
        self.stated: list[SiteAnswer] = []
        """Answers adapters stated for reads inside named program functions (`state`)."""
        self.real_device_hint = "--device real"
        """How the entry point in use spells running on the host's own device (named by `NoValueError`)."""

        # id(fake tensor) -> a real CPU tensor holding its values: small tensors the program made from data
        self._data: dict[int, tuple[torch.Tensor, weakref.ref]] = {}

    def state(self, answer: SiteAnswer) -> None:
        """Answer every read inside `answer`'s function with its value from now on (counted per call site)."""
        self.stated.append(answer)

    def _stated(self) -> SiteAnswer | None:
        if not self.stated:
            return None
        frame = _site_frame()
        if frame is None:
            return None
        return next((a for a in self.stated if a.matches(frame.f_code.co_filename, frame.f_code.co_name)), None)

    def tag_data(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Record that the fake `tensor` holds `values` (a real CPU tensor, e.g. a constant moved to a virtual GPU);
        ops on it then compute its values on the CPU (`_propagate`), so later reads see what the program wrote."""
        if values.numel() <= _DATA_LIMIT:
            key = id(tensor)
            self._data[key] = (values, weakref.ref(tensor, lambda _ref, k=key: self._data.pop(k, None)))

    def _data_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        entry = self._data.get(id(tensor))
        if entry is not None and entry[1]() is tensor:
            return entry[0]
        return getattr(tensor, "constant", None)  # a CPU fake keeps its own constant

    def _propagate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Compute `func` on the real values of its inputs when every tensor input has them (one is ours)."""
        if not any(isinstance(x, torch.Tensor) and id(x) in self._data for x in leaves((args, kwargs))):
            return  # the common case, tested without pytree's spec (built only when values propagate)
        if func in _UNFILLED:  # computed on the CPU it would tag uninitialised memory as the program's values
            return
        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        real = [self._data_of(x) if isinstance(x, torch.Tensor) else x for x in flat]
        mutated = [x for x in tensors if id(x) in self._data] if getattr(func, "_schema", None) is not None and \
            func._schema.is_mutable else []
        if any(r is None for r, x in zip(real, flat, strict=True) if isinstance(x, torch.Tensor)):
            for x in mutated:
                self._data.pop(id(x), None)
            return
        real = [torch.device("cpu") if isinstance(x, torch.device) else x for x in real]
        rargs, rkwargs = tree_unflatten(real, spec)
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                result = func(*rargs, **rkwargs)
        except Exception:  # not computable on the CPU: the values are unknown from here on
            for x in mutated:
                self._data.pop(id(x), None)
            return
        for fake, value in zip(_tensors((out,)), _tensors((result,)), strict=False):
            if fake.shape == value.shape:
                self.tag_data(fake, value)

    def _tag(self, tensor: torch.Tensor, answer: bool | int | float) -> None:
        key = id(tensor)
        self._answers_of[key] = (answer, weakref.ref(tensor, lambda _ref, k=key: self._answers_of.pop(k, None)))

    def _known(self, tensor: torch.Tensor) -> bool | int | float | None:
        entry = self._answers_of.get(id(tensor))
        return None if entry is None or entry[1]() is not tensor else entry[0]

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Record what `func` tells of its outputs' values (called for every op under fake execution)."""
        if self._data:
            self._propagate(func, args, kwargs, out)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:  # a tensor written in place no longer holds its known value
            for arg, value in zip(schema.arguments, args, strict=False):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    self._answers_of.pop(id(value), None)
        answer: bool | int | float | None = None
        if func in _FALSE_CHECKS:
            answer = False
        elif func in _TRUE_CHECKS:
            answer = True
        elif func in _SCALAR_CHECKS and len(args) > 1 and isinstance(args[1], float) and not math.isfinite(args[1]):
            answer = _SCALAR_CHECKS[func]
        elif func in _KEEP or func in _FLIP:
            known = [self._known(a) for a in _tensors(args)]
            if known and all(k is not None for k in known) and len(set(known)) == 1:
                answer = known[0] if func in _KEEP else not known[0]
        elif func is aten._amp_foreach_non_finite_check_and_unscale_.default:
            self._tag(args[1], False)  # found_inf: no inf found
            return
        if answer is not None:
            for t in _tensors((out,)):
                self._tag(t, answer)

    def read(self, tensor: torch.Tensor) -> bool | int | float:
        """The value of a one-element tensor read on the host (``aten._local_scalar_dense``)."""
        site = _call_site()
        known = self._known(tensor)
        dtype = tensor.dtype
        data = self._data_of(tensor)  # a value the program put there (FakeTensorMode's constant, or ours)
        if known is None and data is not None and data.numel() == 1:
            self.constants_read += 1
            with _disable_current_modes():
                return data.item()
        stated = self._stated() if known is None else None
        if stated is not None:
            known = stated.value
        if known is not None:
            value: bool | int | float = bool(known) if dtype == torch.bool else (
                float(known) if dtype.is_floating_point else int(known))
        elif dtype.is_floating_point or dtype.is_complex:
            value = self.float_value
        else:
            raise NoValueError(
                f"prism virtual GPU: {site} reads the value of a {dtype} tensor (aten._local_scalar_dense: .item(), "
                "bool(), int()); fake execution has no values and the value policy states no answer for this read. "
                f"Compute it from shapes, or run this part on the host's own device ({self.real_device_hint})")
        self.answers[(site, repr(value))] += 1
        return value

    def read_array(self, tensor: torch.Tensor) -> Any:
        """``tensor.numpy()`` of a fake host tensor (TensorBoard's scalars, loggers): the values the program put
        there when kept; else each element is the answer of a one-element read (`read`: the known answer, the
        stated one, or `float_value` for floating point), counted once per call; an integer or boolean tensor with
        no answer raises `NoValueError` as `read` does."""
        data = self._data_of(tensor)
        if data is not None:
            self.constants_read += 1
            with _disable_current_modes():
                return data.detach().numpy().copy()
        with _disable_current_modes():
            empty = torch.empty(tuple(tensor.shape), dtype=tensor.dtype).numpy()  # torch's dtype refusals (bf16)
        if empty.size:
            empty.fill(self.read(tensor))
        return empty

    def summary(self) -> dict[str, Any]:
        """Per call site, each answer given and how often (what the run's control flow assumed)."""
        return {"float_value": self.float_value, "reads": sum(self.answers.values()),
                "constants_read": self.constants_read,
                "stated": [{"function": f"{a.path_suffix}:{a.function}", "value": a.value, "reason": a.reason}
                           for a in self.stated],
                "by_site": [{"site": site, "value": value, "count": n}
                            for (site, value), n in sorted(self.answers.items())]}


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out
