"""The interleaved schedule's fast-forward bookkeeping (`prism_plugin.adapters.megatron.interleaved`): which
iteration's seam results a skipped iteration returns, how far back they must reach, and where a skip must stop.
No process, no device, no Megatron."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from prism_plugin.adapters.megatron.interleaved import InterleavedRun, _Completed, _fresh, _strong, _weak


def _run(num_microbatches: int, chunks: int, group: int, warmup: int) -> InterleavedRun:
    run = InterleavedRun(None, num_microbatches, chunks, [None] * chunks)
    run.group, run.warmup = group, warmup
    return run


@pytest.mark.parametrize(("m", "vp", "g", "w"), [(64, 2, 4, 10), (64, 5, 4, 22), (64, 6, 8, 54), (60, 2, 8, 14)])
def test_a_skip_returns_the_results_of_the_same_place_in_the_window(m: int, vp: int, g: int, w: int) -> None:
    run = _run(m, vp, g, w)
    period, window = run.period, run.window
    assert period == g * vp and window % period == 0 and window >= w + (vp - 1) * g + 2
    k = window + 1
    n = (run._last() + 1 - k) // period
    if n < 1:
        pytest.skip("no whole period fits")
    run.skip = (k, k + n * period)
    for j in range(k, k + n * period):
        source = run._source(j)
        assert k - window <= source < k and (source - j) % period == 0  # the same phase, inside the window
        if j >= k + n * period - window:  # what the program still holds at the resume: n periods earlier
            assert source == j - n * period


@pytest.mark.parametrize(("m", "vp", "g", "w", "last"), [
    (64, 2, 4, 10, 116),  # 128 virtual micro-batches: the last steady iteration (117) runs, as it receives nothing
    (64, 5, 4, 22, 296),
    (60, 2, 8, 14, 96),   # a partial last group (60 % 8 = 4): the table repeats only over 56 x 2 = 112 steps
])
def test_a_skip_stays_clear_of_the_ends(m: int, vp: int, g: int, w: int, last: int) -> None:
    run = _run(m, vp, g, w)
    total, full = m * vp, m // g * g * vp
    assert run._last() == last == min(total - w - 2, total - run.period - 1, full - w - 2)


def test_results_are_remembered_weakly_and_given_back_in_new_containers() -> None:
    tensor = torch.ones(3)
    handle = _Completed()
    remembered = _weak((tensor, {"send_next": handle, "recv_prev": handle}))
    strong = _strong(remembered)
    assert strong[0] is tensor and strong[1]["send_next"] is handle
    given = _fresh(strong)
    assert given[1] is not strong[1] and given[1]["recv_prev"] is handle  # the schedule pops the dictionary
    probe = weakref.ref(tensor)
    del tensor, strong, given
    gc.collect()
    assert probe() is None  # remembering kept nothing alive
    dead = _strong(remembered)
    assert dead[0] is None and isinstance(dead[1]["send_next"], _Completed)  # still alive: the local `handle`
    del handle
    gc.collect()
    assert isinstance(_strong(remembered)[1]["recv_prev"], _Completed) and _Completed().wait()


class _Engine:
    """A proof that always holds (`prism_plugin.device.fast_forward.FastForward`'s side of `_boundary`)."""

    def __init__(self) -> None:
        from collections import Counter

        self.not_proven: Counter[str] = Counter()
        self.pending: tuple[object, ...] = ()

    def mark(self, **_: object) -> None:
        pass

    def proven(self) -> bool:
        return True

    def allowed(self, periods: int, unit: int = 1) -> int:
        return periods


class _Driver:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.skipped: list[tuple[int, int]] = []

    def held(self, store: object) -> frozenset[int]:
        return frozenset()

    def _totals(self, run: object) -> dict[str, float]:
        return {}

    def _start_skipping(self, run: object, periods: int, microbatches: int, adopt_per_forward: bool = True) -> None:
        self.skipped.append((periods, microbatches))


@pytest.mark.parametrize(("k", "periods"), [(321, 2), (401, 0)])
def test_a_skip_is_never_shorter_than_the_window_of_held_objects(k: int, periods: int) -> None:
    """`prism plan`'s Llama-3-70B candidate TP4 PP4 VP20 CP2 (32 micro-batches, stage 1: 80 warm-up forwards): a
    period of 80 iterations, a window of 160. Proven at iteration 401 only one period remains before the end: the
    objects the program holds at the mark would stand for some made before it, so nothing is skipped."""
    driver = _Driver()
    run = InterleavedRun(driver, 32, 20, [None] * 20)
    run.group, run.warmup = 4, 80
    assert (run.period, run.window, run._last()) == (80, 160, 558)
    run.returns = {j: {} for j in range(k - run.window, k)}
    assert run._boundary(k) is bool(periods)
    if periods:
        assert driver.skipped == [(periods, periods * run.group)]
    else:
        assert driver.skipped == [] and driver.engine.not_proven == {
            "fewer periods to advance than the window of objects the schedule holds": 1}
