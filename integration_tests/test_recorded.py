"""Recorded policy: an emulated rank computes bit for bit what it computed in the real run.

A non-symmetric program (programs_recorded.py: rank-dependent float data, several groups, p2p with
virtual and real peers, a broadcast and a broadcast_object_list from rank 3) is recorded by prism
with all 4 ranks real (record_dir), then replayed under policy "recorded" with 1 real rank (rank 1,
rank 3) and with 2 real ranks (0 and 2; and 2 and 1, where process 0 plays the higher rank). Every
value each real rank produced must equal that rank's recorded-run value bit for bit. The all-real
prism run must also equal a plain gloo run of the same program (prism over real members only routes
through inner gloo groups).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import programs as prog
import pytest
from compare import assert_same, same
from harness import Mode, Setup
from programs_recorded import recorded_program

pytestmark = pytest.mark.slow

GROUPS = prog.standard_groups()


@pytest.fixture(scope="module")
def recording(cluster, tmp_path_factory) -> tuple[Path, dict[int, Any]]:
    record_dir = tmp_path_factory.mktemp("recording")
    setup = Setup(mode=Mode.PRISM, real_ranks=(0, 1, 2, 3), record_dir=str(record_dir), groups=GROUPS)
    results = cluster.run(setup, recorded_program)
    summaries = cluster.teardown()  # deactivate() writes rank<R>.pt
    assert [s["rank"] for s in summaries] == [0, 1, 2, 3]
    return record_dir, results


def test_recording_written(recording) -> None:
    record_dir, _ = recording
    assert sorted(p.name for p in record_dir.iterdir()) == [f"rank{r}.pt" for r in range(4)]


def test_all_real_prism_equals_plain_gloo(cluster, recording) -> None:
    _, recorded = recording
    gloo = cluster.run(Setup(mode=Mode.GLOO, groups=GROUPS), recorded_program)
    for rank in range(4):
        assert_same(recorded[rank], gloo[rank], f"rank {rank}: prism all-real vs gloo")


@pytest.mark.parametrize("real", [(1,), (3,), (0, 2), (2, 1)], ids=lambda r: "real" + "-".join(map(str, r)))
def test_replay_is_bit_exact(cluster, recording, real: tuple[int, ...]) -> None:
    record_dir, recorded = recording
    setup = Setup(mode=Mode.PRISM, real_ranks=real, data_policy="recorded", replay_dir=str(record_dir),
                  groups=GROUPS)
    replayed = cluster.run(setup, recorded_program)
    for rank in real:
        assert_same(replayed[rank], recorded[rank], f"rank {rank} replayed with real ranks {list(real)}")


def test_replay_on_the_creator_path(cluster, recording) -> None:
    """A recording made with torch 2.13's new_group delegation replays on the older-torch path
    (PRISM_NEW_GROUP_DELEGATION=0): payloads are keyed by torch's group names, the same on both."""
    record_dir, recorded = recording
    setup = Setup(mode=Mode.PRISM, real_ranks=(2,), data_policy="recorded", replay_dir=str(record_dir),
                  groups=GROUPS, delegation=False)
    assert_same(cluster.run(setup, recorded_program)[2], recorded[2], "rank 2 replayed without delegation")


def test_mirror_does_not_reproduce_the_recording(cluster, recording) -> None:
    """The replay check is not vacuous: without the recording, rank 1's values differ."""
    _, recorded = recording
    mirrored = cluster.run(Setup(mode=Mode.PRISM, real_ranks=(1,), groups=GROUPS), recorded_program)
    assert not same(mirrored[1], recorded[1])
