"""The NCCL variables of a launch script that decide which collective algorithms NCCL may use.

``NCCL_ALGO`` (NCCL's environment documentation, "NCCL_ALGO"): a comma-separated list of algorithms, not case
sensitive, among Ring, Tree, CollnetDirect, CollnetChain, NVLS, NVLSTree and PAT; a list that starts with ``^``
names the algorithms to exclude instead. Since NCCL 2.24 the list may be given per collective, segments separated
by ``;``, each ``collective:list`` (``allreduce``, ``allgather``, ``reducescatter``, ``broadcast``, ``reduce``);
a segment without a collective applies to every collective not named. ``NCCL_NVLS_ENABLE=0`` removes NVLS and
NVLSTree. `parse_nccl_algo` reads both into an `NcclAlgorithms`: per collective, the NCCL algorithms allowed.

    >>> a = parse_nccl_algo("allreduce:tree;^nvls")
    >>> sorted(a.allowed("all_reduce")), "nvls" in a.allowed("all_gather"), "ring" in a.allowed("all_gather")
    (['tree'], False, True)
    >>> parse_nccl_algo("Ring,Tre")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    prism_plugin.config.errors.ConfigError: NCCL_ALGO='Ring,Tre': 'tre' is not an NCCL algorithm; ...

Which of them the cost model can time, and how, is the cost model's (`prism_plugin.cost.model`). Pure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from prism_plugin.config.errors import ConfigError

__all__ = ["ALGORITHMS", "COLLECTIVES", "NcclAlgorithms", "nccl_from_environ", "parse_nccl_algo"]

ALGORITHMS = ("ring", "tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
"""NCCL's algorithm names, lower case, as ``NCCL_ALGO`` takes them."""
COLLECTIVES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "broadcast": "broadcast", "reduce": "reduce"}
"""``NCCL_ALGO``'s collective names and the op kinds (`prism_plugin.config.kinds.OpKind` values) they govern."""


@dataclass(frozen=True, slots=True)
class NcclAlgorithms:
    """Per op kind (``all_reduce``, ...), the NCCL algorithms allowed; a kind not listed may use every one."""

    by_kind: Mapping[str, frozenset[str]] = field(default_factory=dict)
    text: str = ""
    """What the variables said (``NCCL_ALGO=...; NCCL_NVLS_ENABLE=0``), for messages."""

    def allowed(self, kind: str) -> frozenset[str]:
        return self.by_kind.get(kind, frozenset(ALGORITHMS))

    @property
    def restricted(self) -> bool:
        return any(v != frozenset(ALGORITHMS) for v in self.by_kind.values())


def _names(spec: str, text: str) -> frozenset[str]:
    exclude = spec.startswith("^")
    names = [n.strip().lower() for n in spec.lstrip("^").split(",") if n.strip()]
    if not names:
        raise ConfigError(f"NCCL_ALGO={text!r}: an empty list of algorithms; name some of {', '.join(ALGORITHMS)} "
                          "(a leading ^ excludes them)")
    for name in names:
        if name not in ALGORITHMS:
            raise ConfigError(f"NCCL_ALGO={text!r}: {name!r} is not an NCCL algorithm; use {', '.join(ALGORITHMS)} "
                              "(not case sensitive, a leading ^ excludes)")
    return frozenset(ALGORITHMS) - frozenset(names) if exclude else frozenset(names)


def parse_nccl_algo(text: str | None, nvls_enable: str | None = None) -> NcclAlgorithms:
    """``NCCL_ALGO`` and ``NCCL_NVLS_ENABLE`` as the module docstring reads them (None: unset)."""
    every: frozenset[str] = frozenset(ALGORITHMS)
    named: dict[str, frozenset[str]] = {}
    for segment in (text or "").split(";"):
        segment = segment.strip()
        if not segment:
            continue
        collective, sep, spec = segment.partition(":")
        if not sep:
            every = _names(segment, text or "")
            continue
        kind = COLLECTIVES.get(collective.strip().lower())
        if kind is None:
            raise ConfigError(f"NCCL_ALGO={text!r}: {collective.strip()!r} is not a collective NCCL_ALGO takes; use "
                              f"{', '.join(COLLECTIVES)}")
        named[kind] = _names(spec.strip(), text or "")
    by_kind = {kind: named.get(kind, every) for kind in COLLECTIVES.values()}
    said = [f"NCCL_ALGO={text}"] if text else []
    if nvls_enable is not None and nvls_enable.strip() not in ("", "1", "2"):
        if nvls_enable.strip() != "0":
            raise ConfigError(f"NCCL_NVLS_ENABLE={nvls_enable!r}: give 0 (off) or 1 (on)")
        by_kind = {kind: names - {"nvls", "nvlstree"} for kind, names in by_kind.items()}
        said.append("NCCL_NVLS_ENABLE=0")
    return NcclAlgorithms(by_kind, "; ".join(said))


def nccl_from_environ(environ: Mapping[str, str] | None = None) -> NcclAlgorithms:
    """`parse_nccl_algo` of ``NCCL_ALGO`` and ``NCCL_NVLS_ENABLE`` in `environ` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return parse_nccl_algo(env.get("NCCL_ALGO"), env.get("NCCL_NVLS_ENABLE"))
