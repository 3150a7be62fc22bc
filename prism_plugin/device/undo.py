"""One undo helper for every patch-and-restore site: the session's seams, the adapters' shims, the probe.

`Patches` is a `contextlib.ExitStack` that also sets attributes and remembers how to put them back;
`close()` undoes everything in reverse order (hooks removed, attributes restored), once.

    patches = Patches()
    patches.setattr(torch.cuda, "is_available", lambda: True)
    patches.callback(handle.remove)
    ...
    patches.close()   # torch.cuda.is_available is the original again
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

__all__ = ["Patches"]

_MISSING = object()


class Patches(ExitStack):
    """An `ExitStack` of patches: `setattr` replaces an attribute and registers its restoration."""

    def setattr(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new`` until `close()`; returns the previous value (None when there was none)."""
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        setattr(owner, name, new)
        if old is _MISSING:
            self.callback(delattr, owner, name)
            return None
        self.callback(setattr, owner, name, old)
        return old
