"""What the program asked of the host, counted: the evidence for a host-time model richer than one figure a launch.

The virtual clock charges the host one figure per launch (`prism_plugin.device.clock`). On a real GPU host a small
model's iteration is as long as its host takes to issue it, and that time is not only launches: every ATen op the
program dispatches costs PyTorch's dispatcher, views and metadata ops included; every ``nn.Module`` call costs its
Python (TransformerEngine's modules their FP8 and parameter bookkeeping, Megatron's its layer logic); ops replayed
by the autograd engine cost less Python than those issued from a forward. `HostCounts` counts each of them, for
the summary (``virtual_gpu.host_counts``), so that a host model by kind can be fitted on the functional fit rows
(`validation.megatron_functional.host_model`) and checked on the validate rows before it is adopted.

Counting only: nothing here moves the emulated clock or the allocator, so it is outside the model fingerprint
(`validation.corpus.fingerprint`). A fast-forward advances the counts by whole periods as it advances the clock's
(`totals` / `advance`), so they are the full run's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["HostCounts"]

_ORIGINS = (("transformer_engine", "transformer_engine"), ("megatron", "megatron"), ("torch", "torch"))
"""A module's origin by the first part of its class's module path."""


def _origin(module: torch.nn.Module) -> str:
    root = type(module).__module__.split(".", 1)[0]
    return next((name for prefix, name in _ORIGINS if root == prefix), "other")


class HostCounts:
    """Device ops dispatched (in a backward or not) and ``nn.Module`` calls by origin, from `start` to `stop`."""

    def __init__(self) -> None:
        self.ops = 0
        self.backward_ops = 0
        self.module_calls: Counter[str] = Counter()
        self._handle: Any = None

    def op(self) -> None:
        """A device op was dispatched (a kernel or not: views and metadata ops cost the dispatcher too)."""
        self.ops += 1
        if torch._C._current_graph_task_id() != -1:
            self.backward_ops += 1

    def _module_call(self, module: torch.nn.Module, _args: Any) -> None:
        self.module_calls[_origin(module)] += 1

    def start(self) -> None:
        if self._handle is None:
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._module_call)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def totals(self) -> dict[Any, int]:
        """Every count, keyed for a fast-forward's captures (`prism_plugin.device.fast_forward`)."""
        return {"ops": self.ops, "backward_ops": self.backward_ops,
                **{("module", origin): n for origin, n in self.module_calls.items()}}

    def advance(self, deltas: dict[Any, float], periods: int) -> None:
        """`periods` more of a period whose counts grew by `deltas` (keys of `totals`)."""
        for key, delta in deltas.items():
            if key == "ops":
                self.ops += periods * int(delta)
            elif key == "backward_ops":
                self.backward_ops += periods * int(delta)
            else:
                self.module_calls[key[1]] += periods * int(delta)

    def summary(self) -> dict[str, Any]:
        return {"device_ops": self.ops, "backward_device_ops": self.backward_ops,
                "module_calls": dict(sorted(self.module_calls.items())),
                "note": "counted, not timed: the host time is the clock's (launches); see "
                        "prism_plugin/device/host_counts.py"}
