"""Shared by every in-process test: each test leaves the process as it found it (`prism_plugin.device.active`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _leaves_no_process_wide_state() -> Iterator[None]:
    """Fail the test that ends holding a session, a shim, a tracker or an adapter it started (and let it go, so the
    next test starts clean)."""
    from prism_plugin.device import active

    before = {name: list(objs) for name, objs in active.held().items()}
    yield
    leaked = {name: [o for o in objs if o not in before.get(name, [])] for name, objs in active.held().items()}
    leaked = {name: objs for name, objs in leaked.items() if objs}
    for name, objs in leaked.items():
        for obj in objs:
            active.SLOTS[name].leave(obj)
    assert not leaked, f"the test left process-wide state held: {sorted(leaked)}"
