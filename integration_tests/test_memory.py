"""No retained memory: prism's ops hold nothing after they complete, and with one real member
they allocate nothing at all (DESIGN.md section 4, rule 1: peak memory must stay exact).

How allocations are counted: `programs_probes.AllocationLog`, a TorchDispatchMode that records
every ATen op whose output owns a storage none of its inputs owns (a factory or out-of-place op; a
view or in-place op returns an input's storage). prism's backend is Python calling ATen, so every
tensor it creates passes through the mode, named by the op that made it, and a weak reference to
each tells whether it outlives the op. (torch.profiler's profile_memory was the alternative: it
sees the same allocations and, in addition, the 0-dim CPU tensors the Python argument parser
wraps scalars in, e.g. 8 bytes for ``t.mul_(4)``, which are freed on return and never touch device
memory; it cannot name the op that owns an allocation, so the dispatch mode is used.)

Retention: weak references to every user tensor (inputs, outputs) and every scratch tensor must be
dead once the op completed and the program dropped its references, with garbage collection
disabled (freed by reference counting, as a real backend frees them). With two real ranks, gloo's
worker thread drops its own reference to a finished work's tensors a moment after wait() returns,
so there the check allows a grace of up to 1 s (it is always dead within milliseconds here); with
one real rank there is no inner work and the check is immediate.
"""

from __future__ import annotations

import pytest
from harness import Mode, Setup
from programs_probes import memory_probe

pytestmark = pytest.mark.slow


def test_one_real_rank_allocates_and_retains_nothing(cluster) -> None:
    # rank 1 real: it is the root of reduce/gather/scatter (group rank 1); its p2p peer and a
    # broadcast source (rank 0) are virtual
    # backend prism: no emulated backend's refusals, so every path is measured (gloo refuses uneven all_gather)
    report = cluster.run(Setup(mode=Mode.PRISM, real_ranks=(1,), backend="prism"), memory_probe,
                         peers={1: 0}, real_src=1, virtual_src=0, root=1)[1]
    state = report.pop("_group_state")
    assert len(report) >= 20, sorted(report)
    for op, entry in report.items():
        assert entry["allocated"] == [], f"{op}: k=1 path allocated {entry['allocated']}"
        assert entry["user_alive"] == 0, f"{op}: a user tensor outlived the op"
        assert entry["scratch_alive"] == [], f"{op}: scratch tensors outlived the op"
    assert state == {"pending_root_payloads": 0, "sent_alive": 0}


def test_two_real_ranks_free_every_temporary(cluster) -> None:
    # ranks 1 and 2 real in the world group of 4: inner gloo exchanges plus virtual shares
    per_rank = cluster.run(Setup(mode=Mode.PRISM, real_ranks=(1, 2), backend="prism"), memory_probe,
                           peers={1: 0, 2: 3}, real_src=1, virtual_src=0, root=1)
    for rank, report in per_rank.items():
        state = report.pop("_group_state")
        for op, entry in report.items():
            assert entry["alive_after_grace"] == 0, f"rank {rank} {op}: tensors still referenced"
            # the documented temporaries only: chunk/tensor-sized clones (PRODUCT means,
            # reduce-scatter chunks of other real members); 64 fp32 elements = 256 bytes here
            for func, _shape, nbytes in entry["allocated"]:
                assert func == "aten.clone.default" and nbytes <= 256, f"rank {rank} {op}: {func} {nbytes} B"
        assert state == {"pending_root_payloads": 0, "sent_alive": 0}
    # all_reduce SUM, all_gather and all_to_all need no temporary even with 2 real members
    for rank, report in per_rank.items():
        for op in ("all_reduce.SUM", "all_gather.tensor", "all_to_all_single", "broadcast.from_virtual"):
            assert report[op]["allocated"] == [], f"rank {rank} {op}: {report[op]['allocated']}"
