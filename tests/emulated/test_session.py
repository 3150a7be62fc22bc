"""Single-process emulation (tier b): one real rank of N, parametrized over the rank played."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import prism_plugin as P
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld


@pytest.fixture
def emulate():
    started = []

    def start(world_size: int, rank: int, **kwargs) -> P.Session:
        session = P.activate(EmulationConfig(world=VirtualWorld(world_size=world_size, real_ranks=(rank,)),
                                             **kwargs))
        started.append(session)
        return session

    yield start
    P.deactivate()


@pytest.mark.parametrize("rank", [0, 5, 8191])
def test_rank_and_groups_as_seen_by_the_program(emulate, rank: int) -> None:
    emulate(8192, rank, timing=False)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (rank, 8192, "gloo")  # emulated gloo
    base = rank - rank % 8
    tp = None
    for start in range(0, 64, 8):  # every rank creates every group, members or not
        g = dist.new_group(list(range(start, start + 8)))
        if start == base:
            tp = g
    gloo_twin = dist.new_group([base, base + 1] if rank % 8 < 2 else [0, 1], backend="gloo")
    if rank >= 64:
        assert tp is None
        tp = dist.new_group(list(range(base, base + 8)))
    assert dist.get_process_group_ranks(tp) == list(range(base, base + 8))
    assert dist.get_rank(tp) == rank % 8
    if rank % 8 < 2:
        assert dist.get_world_size(gloo_twin) == 2
    t = torch.full((4,), 3.0)
    dist.all_reduce(t, group=tp)
    assert torch.equal(t, torch.full((4,), 24.0))
    out = torch.empty(8 * 3)
    dist.all_gather_into_tensor(out, torch.arange(3.0), group=tp)
    assert torch.equal(out, torch.arange(3.0).repeat(8))


def test_in_place_gather_and_reduce_scatter_alias(emulate) -> None:
    """Megatron's distributed optimizer passes views of one buffer as input and output."""
    emulate(64, 3, timing=False)
    g = dist.new_group(list(range(8)))
    buf = torch.zeros(8 * 4)
    buf[12:16] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    dist.all_gather_into_tensor(buf, buf[12:16], group=g)
    assert torch.equal(buf, torch.tensor([1.0, 2.0, 3.0, 4.0]).repeat(8))
    grads = torch.arange(32.0)
    expected = grads[12:16] * 8
    dist.reduce_scatter_tensor(grads[12:16], grads, group=g)
    assert torch.equal(grads[12:16], expected)
    assert torch.equal(grads[:12], torch.arange(12.0)), "the rest of the input is untouched"


def test_virtual_sources_are_valid(emulate) -> None:
    emulate(16, 2, timing=False)
    objs: list = [None, None]
    dist.broadcast_object_list(objs, src=0)  # virtual root: mirrors this rank's own objects
    assert objs == [None, None]
    objs = [{"lr": 0.1}, "iter 7"]
    dist.broadcast_object_list(objs, src=9)
    assert objs == [{"lr": 0.1}, "iter 7"]
    sent = torch.arange(6.0)
    dist.send(sent, dst=3)
    got = torch.full((6,), float("nan"))
    dist.recv(got, src=1)  # mirrors the last tensor this rank sent with that shape
    assert torch.equal(got, sent)
    other = torch.full((5,), float("nan"))
    dist.recv(other, src=1)
    assert torch.equal(other, torch.zeros(5))
    gathered: list = [None] * 16
    dist.all_gather_object(gathered, ("me", 2))
    assert gathered == [("me", 2)] * 16


@pytest.mark.parametrize("op,expected", [
    (dist.ReduceOp.SUM, 16.0), (dist.ReduceOp.AVG, 2.0), (dist.ReduceOp.MAX, 2.0),
    (dist.ReduceOp.MIN, 2.0), (dist.ReduceOp.PRODUCT, 256.0),
])
def test_reduce_ops_mirror(emulate, op, expected: float) -> None:
    emulate(8, 1, timing=False)
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=op)
    assert torch.equal(t, torch.full((3,), expected))


def test_bitwise_and_zeros_policy(emulate) -> None:
    emulate(8, 1, timing=False, data_policy="zeros")
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    assert torch.equal(t, torch.full((3,), 2.0))
    t = torch.full((3,), 2.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((3,), 0.25))


def test_unsupported_ops_fail_loudly(emulate) -> None:
    emulate(8, 0, timing=False)
    with pytest.raises(RuntimeError, match="ANY_SOURCE"):
        dist.recv(torch.empty(2))
    with pytest.raises(RuntimeError, match="^Cannot use ReduceOp.PREMUL_SUM with Gloo$"):  # gloo's own text
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))


def test_async_op_returns_before_its_emulated_completion(emulate, tmp_path) -> None:
    slow = tmp_path / "slow.yaml"
    from prism_plugin.cost import load_profile, override_profile
    from prism_plugin.cost.profiles import profile_to_yaml

    # a 0.5 GB/s network: a 16 MiB ring all-reduce over 8 nodes models as ~70 ms
    profile = override_profile(load_profile("dgx-h100"), {"inter_node.bandwidth_gbytes_per_s": 0.5})
    slow.write_text(profile_to_yaml(profile))
    session = emulate(64, 0, profile=str(slow))
    g = dist.new_group(list(range(0, 64, 8)))  # 8 ranks on 8 nodes
    t = torch.ones(16 * 1024 * 1024 // 4)
    cost_s = session.cost_s(P.OpKind.ALL_REDUCE, t.numel() * 4, g.vg, None)
    assert cost_s > 0.05
    t0 = time.perf_counter()
    work = dist.all_reduce(t, group=g, async_op=True)
    issued_s = time.perf_counter() - t0
    assert not work.is_completed()
    work.wait()
    total_s = time.perf_counter() - t0
    # issue costs the data write (a 64 MiB multiply, ~10-40 ms here) but never the emulated delay
    assert total_s >= cost_s
    assert work.is_completed() and torch.all(t == 8)
    assert issued_s < total_s


def test_delegation_hidden_path(emulate, monkeypatch) -> None:
    monkeypatch.setenv("PRISM_NEW_GROUP_DELEGATION", "0")
    emulate(4096, 7, timing=False)
    assert not callable(getattr(dist.distributed_c10d._get_default_group(), "new_group", None))
    g = dist.new_group(list(range(8)), backend="gloo")  # would rendezvous with absent ranks if real
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((2,), 8.0))
    assert dist.new_group(list(range(8, 16))) == dist.GroupMember.NON_GROUP_MEMBER


def test_reactivate_after_deactivate() -> None:
    for rank in (1, 2):
        P.activate(EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(rank,)), timing=False))
        assert dist.get_rank() == rank
        summary = P.deactivate()
        assert summary is not None and summary["rank"] == rank
        assert not dist.is_initialized()


def test_summary_reports_how_late_emulated_completions_were_delivered(emulate, tmp_path) -> None:
    """Each wait() that sleeps until an op's emulated completion records how late it woke: the emulator's own
    timing error on this host (sleep overshoot and scheduling), in the summary's "emulated_waits"."""
    profile = tmp_path / "slow.yaml"  # every collective costs >= 5 ms: each sync all-reduce's wait() sleeps
    profile.write_text("name: slow\ndescription: 5 ms per collective\ngpus_per_node: 8\n"
                       "intra_node: {bandwidth_gbytes_per_s: 1.0, latency_us: 10.0}\n"
                       "inter_node: {bandwidth_gbytes_per_s: 1.0, latency_us: 10.0}\n"
                       "bus_efficiency: 1.0\np2p_efficiency: 1.0\ncollective_overhead_us: 5000.0\n"
                       "p2p_overhead_us: 10.0\n")
    emulate(8, 0, profile=str(profile))
    t = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(t)
    dist.all_reduce(t, async_op=True)  # never waited: not counted
    waits = P.deactivate()["emulated_waits"]
    assert 18 <= waits["waits_slept"] <= 20  # a host stalled > 5 ms between issue and wait() would not sleep
    assert 0.0 <= waits["late_median_us"] <= waits["late_p90_us"] <= waits["late_max_us"]
    assert waits["late_median_us"] < 5000.0  # the tail spins: ~1 us on an idle host, 5 ms covers a loaded one


def test_wakeup_stats_keep_a_bounded_uniform_sample() -> None:
    from prism_plugin.device.op_clock import WakeupStats

    stats = WakeupStats()
    assert stats.summary()["waits_slept"] == 0 and stats.summary()["late_median_us"] is None
    for i in range(3 * WakeupStats.CAP):
        stats.add(i * 1e-6)
    s = stats.summary()
    assert s["waits_slept"] == 3 * WakeupStats.CAP and s["late_max_us"] == pytest.approx(3 * WakeupStats.CAP - 1)
    assert len(stats._sample) == WakeupStats.CAP
    assert s["late_median_us"] == pytest.approx(1.5 * WakeupStats.CAP, rel=0.1)  # uniform over 0 .. 3 CAP
