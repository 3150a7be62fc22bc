"""When rank 0 is virtual, the lowest real rank builds Megatron's datasets as rank 0 does (and writes the index
files rank 0 would write to --data-cache-path); the other ranks read them after the barrier, as on a cluster."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from prism_plugin.adapters.megatron import data
from prism_plugin.device.undo import Patches

pytest.importorskip("megatron.core")


def test_the_lowest_real_rank_takes_rank_zeros_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 7)
    order: list[Any] = []
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: order.append("barrier"))

    def build() -> str:
        order.append(("built as", dist.get_rank()))
        return "dataset"

    with Patches() as patches:
        data._install_rank0_dataset_build(patches)
        assert BlendedMegatronDatasetBuilder.build_generic_dataset(build, lambda: True, True) == "dataset"
    assert order == [("built as", 0), "barrier"]  # rank 0's path: build first, then the barrier
    assert dist.get_rank() == 7  # outside the builder this rank keeps its own rank
    order.clear()
    assert BlendedMegatronDatasetBuilder.build_generic_dataset(build, lambda: True, True) == "dataset"
    assert order == ["barrier", ("built as", 7)]  # undone: Megatron's own order for rank 7
