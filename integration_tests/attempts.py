"""Repeated attempts for the wall-clock fidelity checks of issue 13, part 6(d), on a shared 2-core host.

Each check builds a prediction from one recording (``prism kernels record``) and compares it with real runs of the
same job taken around that recording. A model error beyond the bound shows in every attempt; a burst of foreign
load during one attempt does not. CI stop 16 failed on two such bursts, at load averages under the skip threshold:

- megatron-tp2-n2: real means 152.0 / 113.2 / 107.7 ms (the run before the recording 40% slower than the two
  after it) and 53.6 ms a step recorded inside the collective calls (the peer's stall waited out), prediction
  +40.9% / +47.0% against a 25% bound; the same check passed 3 of 3 times before (+3.4 .. +4.7%);
- the one-process toy, wall clock: the recording's own step 14.08 ms, the three real runs 16.34-17.73 ms: -23.8%
  against a 17% bound, while the cpu clock of the same attempt was -5.7% against 10%.

So a check is made up to `ATTEMPTS` times, each with a fresh recording and fresh real runs in its own directory;
the first attempt within its bound passes; every attempt's figures are printed. When every attempt misses, the
test fails, unless every attempt was unclear (the real runs' own spread beyond the check's limit, or the load
average beyond the skip threshold): then it skips naming all the figures (a visible skip, never a pass).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ATTEMPTS = int(os.environ.get("PRISM_TIMING_ATTEMPTS", "3"))


@dataclass(frozen=True)
class Attempt:
    """One attempt's outcome: its figures, what missed its bound, and what its real runs' spread left unchecked."""

    report: str
    missed: Sequence[object] = field(default_factory=tuple)
    noisy: Sequence[object] = field(default_factory=tuple)


def check_in_attempts(measure: Callable[[Path], Attempt], tmp: Path, max_load: float, noisy_limit: str = "") -> None:
    """Run `measure` (in a fresh directory under `tmp` each time) until one attempt is within its bound."""
    reports, unclear = [], []
    for n in range(1, max(1, ATTEMPTS) + 1):
        work = tmp / f"attempt{n}"
        work.mkdir()
        outcome = measure(work)
        load = os.getloadavg()
        reports.append(f"attempt {n}: {outcome.report}; load average {tuple(round(x, 2) for x in load)}")
        print(reports[-1])
        if not outcome.missed and not outcome.noisy:
            return
        unclear.append(bool(outcome.noisy) or load[0] > max_load)
    summary = " | ".join(reports)
    if all(unclear):
        pytest.skip(f"every attempt unclear (real runs' spread beyond {noisy_limit or 'the limit'}, or load average "
                    f"beyond {max_load}): {summary}")
    pytest.fail(f"beyond the bound in all {len(reports)} attempts: {summary}", pytrace=False)
