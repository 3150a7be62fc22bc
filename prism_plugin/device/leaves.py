"""The leaves of an op's arguments or result, in ``torch.utils._pytree.tree_flatten`` order, at a fraction of its
cost: the dispatch modes (storage tracker, virtual GPU) flatten every ATen call, and pytree's general node
machinery (a spec object per node, registry look-ups) was a tenth of a virtual-GPU step's host time.

Exact tuples, lists and dicts (what ATen calls take and return) are walked here; any other container type
pytree knows (namedtuples, structseqs, OrderedDict, ...) goes to pytree itself, so the leaves and their order
are pytree's in every case (`tests/unit/test_leaves.py` checks it).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from torch.utils._pytree import tree_flatten

__all__ = ["leaves"]

_CONTAINERS = (tuple, list, dict, deque)


def leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``.

    >>> leaves(((1, [2, 3]), {"a": 4, "b": (5,)}))
    [1, 2, 3, 4, 5]
    """
    out: list[Any] = []
    _into(tree, out)
    return out


def _into(tree: Any, out: list[Any]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            _into(x, out)
    elif kind is dict:
        for x in tree.values():
            _into(x, out)
    elif isinstance(tree, _CONTAINERS):  # a subclass or a deque: pytree decides (namedtuple, torch.Size, ...)
        out.extend(tree_flatten(tree)[0])
    else:
        out.append(tree)
