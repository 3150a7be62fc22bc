"""`prism_plugin.device.leaves.leaves` gives pytree's leaves, in pytree's order, for what ATen calls carry."""

from __future__ import annotations

from collections import OrderedDict, deque, namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from prism_plugin.device.leaves import leaves

Pair = namedtuple("Pair", "a b")
t1, t2, t3 = torch.zeros(1), torch.ones(2), torch.empty(0)

CASES = [
    (),
    None,
    t1,
    ((t1, [t2, 3.0]), {"b": t3, "a": (None, "cuda:0")}),
    ([t1, t2], {}),
    (torch.Size([2, 3]), [torch.device("cuda", 1)], {"dtype": torch.bfloat16, "out": (t1, t2)}),
    (Pair(t1, [t2]), OrderedDict(z=t3, y=1)),
    (deque([t1, (t2,)]), torch.return_types.max((t1, t2))),
    [[[]], ((),), {"k": [[t1]]}],
]


@pytest.mark.parametrize("tree", CASES)
def test_leaves_are_pytrees(tree: object) -> None:
    got, want = leaves(tree), tree_flatten(tree)[0]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
