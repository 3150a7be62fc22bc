"""`HostCounts`: nn.Module calls by origin while started, device ops in and out of a backward."""

from __future__ import annotations

import torch

from prism_plugin.device.host_counts import HostCounts


class _Counted(torch.autograd.Function):
    """Reports each forward and backward to `counts` as a device op would."""

    counts: HostCounts

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        _Counted.counts.op()
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _Counted.counts.op()
        return grad * 2


class _Local(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_module_calls_are_counted_by_origin_only_while_started() -> None:
    counts = HostCounts()
    linear, local = torch.nn.Linear(2, 2), _Local()
    linear(torch.ones(1, 2))  # before start: not counted
    counts.start()
    linear(torch.ones(1, 2))
    local(linear(torch.ones(1, 2)))
    counts.stop()
    linear(torch.ones(1, 2))  # after stop: not counted
    assert counts.summary()["module_calls"] == {"other": 1, "torch": 2}


def test_ops_inside_a_backward_are_counted_apart() -> None:
    counts = HostCounts()
    _Counted.counts = counts
    x = torch.ones(3, requires_grad=True)
    _Counted.apply(x).sum().backward()
    summary = counts.summary()
    assert (summary["device_ops"], summary["backward_device_ops"]) == (2, 1)
