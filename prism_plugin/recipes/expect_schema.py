"""The recipe schema's `Expect`: what an emulation's faults, or its virtual GPU, must produce.

Checked when a recipe loads (`Expect.check`, called by `prism_plugin.recipes.schema.Emulation`); what the runs
produced is checked against it by `prism_plugin.recipes.expect` (faults) and `prism_plugin.recipes.memory`
(virtual-GPU memory). Pure: stdlib and the config layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_plugin.recipes.schema_common import RecipeError
from prism_plugin.recipes.schema_common import fraction as _fraction
from prism_plugin.recipes.schema_common import positive_int as _positive_int
from prism_plugin.recipes.schema_common import range_pair as _range

__all__ = ["Expect"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Expect:
    """What an emulation's `faults` must produce; `prism_plugin.recipes.expect` checks it after the run.

    Either a failure (hang, crash, kill: the run must fail, quickly, with the backend's error)::

        expect: {failure: "Timed out waiting 3000ms", within_s: 25, after_s: 3}

    or figures of a run that completes, on every compared emulated rank (straggler, link, jitter)::

        expect: {blame_root: 1, wait_rel: [1, 3], from_step: 3}       # straggler: who is waited on, how long
        expect: {comm_factor: [3.99, 4.01]}                            # link: comm per step with / without it
        expect: {comm_factor: [0.4, 2.5], min_comm_spread: 0.1}        # jitter: it varies from step to step
    """

    failure: str | None = None
    """Text the run's output must contain; the run must exit non-zero (no metrics are compared)."""
    within_s: float | None = None
    """With `failure` (required): every process must have ended this many seconds after the start (the run is
    stopped then: a hang that never raises fails the recipe instead of blocking it)."""
    after_s: float = 0.0
    """With `failure`: the run must not end earlier (a hang raises only after the job's timeout)."""
    blame_root: int | None = None
    """The rank every delayed step's blame chain (the compared rank's ``faults`` summary) must end at."""
    wait_ms: tuple[float, float] | None = None
    """[low, high]: the median, over measured steps >= from_step, of the per-step wait on `blame_root` (ms)."""
    wait_rel: tuple[float, float] | None = None
    """[low, high]: that median wait / the reference run's median step time (a machine's speed cancels out:
    a straggler of factor f costs about (f - 1) x the compute before the op that waits for it)."""
    from_step: int = 0
    """Steps before it must show no wait at all (the fault's own ``from_step``)."""
    comm_factor: tuple[float, float] | None = None
    """[low, high]: every measured step's modelled communication with the faults (links, jitter) / without
    them (the session models each op's cost; the faults scale it: the probe records both per step)."""
    min_comm_spread: float = 0.0
    """The highest minus the lowest of those per-step factors must reach this (jitter varies; a link does not)."""
    peak_allocated_bytes: int | None = None
    """device: virtual-gpu: the exact modelled peak allocated bytes on each real rank's device."""
    peak_reserved_bytes: int | None = None
    """device: virtual-gpu: the exact modelled peak reserved bytes (the caching allocator's segments)."""
    fits: bool | None = None
    """device: virtual-gpu: whether the job fits the GPU (peak reserved + CUDA context <= its memory, no OOM)."""
    ooms: int | None = None
    """device: virtual-gpu: the number of allocations that crossed the GPU's memory (oom: report)."""
    emulated_step_s: float | None = None
    """device: virtual-gpu with virtual time: the rank's exact emulated step (median of its marked iterations, to
    the nanosecond): deterministic, so any change to the kernel model, the clock or the program shows."""

    @property
    def states_memory(self) -> bool:
        return (self.peak_allocated_bytes, self.peak_reserved_bytes, self.fits, self.ooms,
                self.emulated_step_s) != (None,) * 5

    def _check_memory(self, where: str) -> None:
        for name in ("peak_allocated_bytes", "peak_reserved_bytes", "ooms"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"{where}.{name}", zero=True)
        if self.fits is not None and not isinstance(self.fits, bool):
            raise RecipeError(f"{where}.fits must be true or false, got {self.fits!r}")
        if self.emulated_step_s is not None and (isinstance(self.emulated_step_s, bool) or not isinstance(
                self.emulated_step_s, int | float) or self.emulated_step_s <= 0):
            raise RecipeError(f"{where}.emulated_step_s must be a positive number of seconds (the summary's "
                              f"virtual_time step), got {self.emulated_step_s!r}")
        if self.fits is True and self.ooms:
            raise RecipeError(f"{where}: fits: true with ooms={self.ooms}: a job that fits has no OOM")

    def check(self, where: str) -> None:
        """RecipeError naming `where` (``emulated[<name>].expect``) for an inconsistent block."""
        self._check_memory(where)
        if self.failure is not None and self.states_memory:
            raise RecipeError(f"{where}: a failure expectation has no memory figures; remove peak_*/fits/ooms/"
                              "emulated_step_s "
                              "(or drop failure)")
        if self.failure is not None:
            if not isinstance(self.failure, str) or not self.failure.strip():
                raise RecipeError(f"{where}.failure must be the text of the expected error, e.g. "
                                  "\"Timed out waiting\", got {self.failure!r}")
            if self.within_s is None:
                raise RecipeError(f"{where}.within_s is required with failure: the seconds after which a run that "
                                  "has not failed is stopped and the recipe fails, e.g. 25")
            within = _fraction(self.within_s, f"{where}.within_s")
            after = _fraction(self.after_s, f"{where}.after_s")
            if within <= after:
                raise RecipeError(f"{where}: within_s={within:g} must exceed after_s={after:g}")
            object.__setattr__(self, "within_s", within)
            object.__setattr__(self, "after_s", after)
            if (self.blame_root, self.wait_ms, self.wait_rel, self.comm_factor) != (None,) * 4:
                raise RecipeError(f"{where}: a failure expectation compares no figures; remove blame_root/wait_ms/"
                                  "wait_rel/comm_factor (or drop failure)")
            return
        if self.within_s is not None or self.after_s:
            raise RecipeError(f"{where}.within_s/after_s go with failure: add failure: \"<error text>\" or remove them")
        if (self.blame_root is None) != (self.wait_ms is None and self.wait_rel is None):
            raise RecipeError(f"{where}: blame_root goes with wait_ms and/or wait_rel (who is waited on, and how "
                              "long: wait_ms: [low, high] per step, wait_rel: [low, high] x the reference's step)")
        if self.blame_root is not None:
            _positive_int(self.blame_root, f"{where}.blame_root", zero=True)
            for name in ("wait_ms", "wait_rel"):
                if getattr(self, name) is not None:
                    object.__setattr__(self, name, _range(getattr(self, name), f"{where}.{name}"))
        _positive_int(self.from_step, f"{where}.from_step", zero=True)
        if self.comm_factor is not None:
            object.__setattr__(self, "comm_factor", _range(self.comm_factor, f"{where}.comm_factor"))
        object.__setattr__(self, "min_comm_spread", _fraction(self.min_comm_spread, f"{where}.min_comm_spread"))
        if self.min_comm_spread and self.comm_factor is None:
            raise RecipeError(f"{where}.min_comm_spread needs comm_factor: [low, high]")
        if self.blame_root is None and self.comm_factor is None and not self.states_memory:
            raise RecipeError(f"{where} states nothing to check: give failure (+ within_s), blame_root + "
                              "wait_ms/wait_rel, or comm_factor")
