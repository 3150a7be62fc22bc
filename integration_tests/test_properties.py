"""Property-based conformance: random short programs, random groups, random real ranks.

Each example is a program of 1-4 catalogue ops (programs.OPS), each with a random dtype, shape
(1-3 dims of 1-4), group (any non-empty subset of the 4 ranks, or the default group) and sync/async;
plus a random choice of real ranks for prism (one rank, or an ordered pair: process 0 may play the
higher rank). The program runs on 4 real gloo processes and under prism (twice, for determinism),
and every real rank's results must satisfy `checks.check_case` (bit for bit, or the documented rule
where the source is virtual or gloo refuses). Same worker pool as the rest of the suite.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import programs as prog
import pytest
from checks import check_case
from harness import Mode, Setup, all_subsets
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

GROUPS = prog.standard_groups()
GLOO = Setup(mode=Mode.GLOO, groups=GROUPS)
SUBSETS = list(all_subsets(4))
REAL_CHOICES = [(r,) for r in range(4)] + list(itertools.permutations(range(4), 2))


def _normalise(case: dict[str, Any]) -> dict[str, Any]:
    op = prog.OPS[case["op"]]
    kw = {"op": op.name, "dtype": case["dtype"] if op.dtypes else "fp32",
          "async_op": case["async_op"] and op.has_async, "shape": case["shape"]}
    if case["ranks"] == (0, 1, 2, 3) and case["default_group"]:
        kw["family"] = "world"
    else:
        kw["family"], kw["ranks"] = None, case["ranks"]
    return kw


CASE = st.fixed_dictionaries({
    "op": st.sampled_from(sorted(prog.OPS)),
    "dtype": st.sampled_from(sorted(prog.DTYPES)),
    "ranks": st.sampled_from(SUBSETS),
    "default_group": st.booleans(),
    "async_op": st.booleans(),
    "shape": st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
}).map(_normalise)


# PRISM_IT_EXAMPLES raises the example count for a deeper (nightly) search; 25 keeps CI at ~10 s
@settings(max_examples=int(os.environ.get("PRISM_IT_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(CASE, min_size=1, max_size=4), real=st.sampled_from(REAL_CHOICES))
def test_random_programs_conform(cluster, program: list[dict[str, Any]], real: tuple[int, ...]) -> None:
    calls = [(prog.collective, kw) for kw in program]
    gloo = cluster.run_batch(GLOO, calls)
    prism = cluster.run_batch(Setup(mode=Mode.PRISM, real_ranks=real, groups=GROUPS), calls + calls)
    first, second = prism[: len(calls)], prism[len(calls):]
    for i, kw in enumerate(program):
        for rank in real:
            where = f"op {i} {kw} under prism real ranks {list(real)}, rank {rank}"
            rule = check_case(kw, rank, real, gloo[i][rank], first[i][rank], second[i][rank], first[i], where)
            event(f"rule: {rule}")
