"""The one owner of process-wide state: what is active in this process, slot by slot.

An emulated rank is one process, and a few objects are process-wide by nature: the session that answers
torch.distributed, the CUDA shim that answers ``torch.cuda``, the storage tracker that sees every allocation,
the fused regions a kernel falls in, a framework adapter's hooks. Each module that owns one declares a `Slot`
here (``SESSION = active.slot("session")``) instead of a module global of its own, and enters / leaves its
object through it. So one place lists every piece of process-wide state (`SLOTS`), says what is held now
(`held`: a leak check after a test or a teardown), and refuses a second holder where only one may exist.

    >>> demo = Slot("demo")  # a module declares its slot with `slot("demo")`, which also lists it in SLOTS
    >>> with demo.holding("one"):
    ...     demo.current()
    'one'
    >>> demo.current() is None
    True

A stacked slot (``stack=True``) holds several objects, innermost last (nested trackers, nested regions).
A permanent slot (``permanent=True``) holds what a process keeps once loaded (a compiled library, stand-in
modules installed in ``sys.modules``): listed, never reported by `held` as a leak.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["SLOTS", "AlreadyActive", "Slot", "held", "slot"]

T = TypeVar("T")

_LOCK = threading.RLock()
SLOTS: dict[str, Slot[object]] = {}
"""Every slot of the process, by name (module import order)."""


class AlreadyActive(RuntimeError):
    """A second object entered a single slot while the first still holds it."""


class Slot(Generic[T]):
    """One kind of process-wide object; at most one holder unless `stack`."""

    def __init__(self, name: str, *, stack: bool = False, permanent: bool = False) -> None:
        self.name = name
        self.stack = stack
        self.permanent = permanent
        self._held: list[T] = []

    def current(self) -> T | None:
        """The object held (the innermost one of a stacked slot), or None."""
        with _LOCK:
            return self._held[-1] if self._held else None

    def all(self) -> list[T]:
        """Every object held, outermost first."""
        with _LOCK:
            return list(self._held)

    def enter(self, obj: T) -> None:
        """Hold `obj`; `AlreadyActive` when a single slot is held already."""
        with _LOCK:
            if self._held and not self.stack:
                raise AlreadyActive(f"prism: {self.name} is already active in this process ({self._held[-1]!r}); "
                                    "end it before starting another")
            self._held.append(obj)

    def leave(self, obj: T) -> None:
        """Stop holding `obj` (nothing when it is not held)."""
        with _LOCK:
            if obj in self._held:
                self._held.remove(obj)

    @contextmanager
    def holding(self, obj: T) -> Iterator[T]:
        self.enter(obj)
        try:
            yield obj
        finally:
            self.leave(obj)

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, held={len(self._held)})"


def slot(name: str, *, stack: bool = False, permanent: bool = False) -> Slot[T]:
    """Declare the slot `name` (once per process: a module's import). A second declaration is refused."""
    with _LOCK:
        if name in SLOTS:
            raise ValueError(f"slot {name!r} is declared twice; one module owns each piece of process-wide state")
        made: Slot[T] = Slot(name, stack=stack, permanent=permanent)
        SLOTS[name] = made  # type: ignore[assignment]
        return made


def held() -> dict[str, list[object]]:
    """The slots that hold something now, permanent ones left out: empty after every teardown."""
    with _LOCK:
        return {name: list(s._held) for name, s in SLOTS.items() if s._held and not s.permanent}
