"""The conformance rule for one rank-symmetric case: what prism must give a real rank.

Shared by the enumerated suite (test_conformance.py) and the property-based one
(test_properties.py). `check_case` compares what a real rank got under prism with what the same
rank got in the plain gloo run of the same program:

- bit for bit, when every value the rank receives comes from ranks that contribute (the data does
  not depend on the rank, so mirrored virtual members contribute exactly what real ones would);
- when the source is virtual (broadcast / scatter / broadcast_object_list from a virtual root, a
  blocking recv from a virtual previous rank): deterministic (a second run gives the same), finite,
  one payload for all real members of the group where the op broadcasts, and the documented mirror
  rule (own buffer / first real member's buffer / last tensor sent with that shape / zeros);
- when gloo refuses a well-defined combination (`GLOO_REFUSES`): prism, emulating gloo, refuses it with
  gloo's own error (`prism_plugin.comm.backend`; under ``backend="nccl"`` or ``"prism"`` it runs);
- when every real backend refuses it (bitwise reductions of floats): prism must refuse too.
"""

from __future__ import annotations

from typing import Any

import programs as prog
import torch
from compare import all_finite, assert_same
from harness import CaseError

__all__ = ["GLOO_REFUSES", "check_case", "group_ranks"]

# (op, dtype or None for every dtype) -> why gloo refuses although the op is well defined (prism emulating
# gloo refuses them too).
GLOO_REFUSES: dict[tuple[str, str | None], str] = {
    ("all_reduce.AVG", "i64"): "gloo: AVG of an integer tensor ('result type Float can't be cast to Long')",
    ("all_gather.uneven", None): "gloo: all_gather with uneven output sizes ('invalid tensor size')",
}


def group_ranks(kw: dict[str, Any], rank: int, world_size: int = 4) -> tuple[int, ...] | None:
    """The global ranks of the group `rank` runs case `kw` on (None: not a member)."""
    if kw.get("ranks") is not None:
        ranks = tuple(sorted(kw["ranks"]))
        return ranks if rank in ranks else None
    groups = prog.FAMILIES[kw.get("family") or "world"] or (tuple(range(world_size)),)
    return next((g for g in groups if rank in g), None)


def _shape(kw: dict[str, Any]) -> tuple[int, ...]:
    return tuple(kw.get("shape", (6,)))


def virtual_source(kw: dict[str, Any], rank: int, real: tuple[int, ...]) -> int | None:
    """The virtual rank this rank's data comes from; None when it is real or every member adds."""
    source = prog.OPS[kw["op"]].source
    if source is None:
        return None
    granks = group_ranks(kw, rank)
    assert granks is not None
    me = granks.index(rank)
    src = {"root0": granks[0], "rootlast": granks[-1], "prev": granks[(me - 1) % len(granks)]}[source]
    return None if src in real or src == rank else src


def mirror_rule(kw: dict[str, Any], rank: int, real: tuple[int, ...]) -> Any:
    """What the mirror policy documents for a value from a virtual source (DESIGN.md section 4)."""
    dtype = prog.DTYPES[kw["dtype"]]
    granks = group_ranks(kw, rank)
    assert granks is not None
    real_members = [r for r in granks if r in real]
    op, shape = kw["op"], _shape(kw)
    if op.startswith("broadcast."):
        # the receiver keeps its buffer; with 2+ real members, the first real member's buffer
        return torch.full(shape, 100 + real_members[0], dtype=dtype)
    if op.startswith("scatter."):
        return torch.full(shape, 100 + rank, dtype=dtype)  # its own buffer
    if op == "p2p.send_recv":
        # a recv mirrors the last tensor this rank sent with that shape, else zeros: even group
        # ranks send before they receive
        me = granks.index(rank)
        return prog.sym(shape, dtype) if me % 2 == 0 else torch.zeros(shape, dtype=dtype)
    if op == "object.broadcast_object_list.none":
        return [None, None, None]  # this rank's own objects
    raise AssertionError(f"no mirror rule for {op}")


def check_case(kw: dict[str, Any], rank: int, real: tuple[int, ...], ref: Any, got: Any, again: Any,
               per_rank: dict[int, Any], where: str) -> str:
    """Assert the conformance rule for one (case, real rank); returns which rule applied."""
    assert not isinstance(ref, CaseError), f"{where}: the gloo run failed:\n{ref.traceback}"
    assert not isinstance(got, CaseError), f"{where}: prism raised:\n{got.traceback}"
    if not ref["member"] or "skipped" in ref:
        assert_same(got, ref, where)  # no member (a group without real members) / not applicable
        return "not-member"
    if "raised" in ref:
        if kw["dtype"] in prog.OPS[kw["op"]].refused_dtypes:
            assert "raised" in got, f"{where}: real backends refuse it ({ref['raised']}), prism did not"
            return "refused-by-all"
        known = GLOO_REFUSES.get((kw["op"], kw["dtype"])) or GLOO_REFUSES.get((kw["op"], None))
        assert known, f"{where}: gloo refused unexpectedly: {ref['raised']}"
        # prism emulates the backend the program asked for (gloo): it refuses the same, with gloo's text
        assert got.get("raised") == ref["raised"], f"{where}: gloo refused ({ref['raised']}), prism: {got}"
        return "gloo-refuses"
    assert "raised" not in got, f"{where}: prism refused what gloo runs: {got['raised']}"
    if virtual_source(kw, rank, real) is not None:
        assert all_finite(got), f"{where}: non-finite values from a virtual source: {got}"
        if again is not None:
            assert_same(again, got, f"{where}: second run (determinism)")
        assert_same(got["out"], mirror_rule(kw, rank, real), f"{where}: mirror rule")
        if kw["op"].startswith(("broadcast.", "object.broadcast")):
            # one payload for the whole group: every real member of this rank's group agrees
            for other in real:
                if other != rank and other in (group_ranks(kw, rank) or ()):
                    assert_same(per_rank[other]["out"], got["out"], f"{where}: rank {other} vs rank {rank}")
        return "virtual-source"
    assert_same(got, ref, where)
    return "bitwise"
