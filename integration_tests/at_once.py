"""Independent runs of one test (or of one module's tests) started together: each is a subprocess on one core (a
virtual-GPU or fake run is single-threaded Python), so on CI's 2 cores two runs take about the time of one. Only for
runs whose checked figures are modelled or counted (virtual time, the allocator model, op counts), never measured
times: a run's figures must not depend on what else the machine does."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def outcomes(**calls: Callable[[], T]) -> dict[str, Future[T]]:
    """Each of `calls` in its own thread (each starts and waits for its subprocess), all at once; their futures by
    name, every one done. A module fixture returns them and each test reads its own with ``.result()``, which raises
    that call's exception (a failed run fails the tests that read it, not the others)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return {name: pool.submit(call) for name, call in calls.items()}


def at_once(*calls: Callable[[], T]) -> list[T]:
    """Each of `calls` at once (`outcomes`); their results in order. The first failed call's exception is raised
    here, after every call has ended."""
    futures = outcomes(**{str(i): call for i, call in enumerate(calls)})
    return [f.result() for f in futures.values()]
