"""Recorded policy on Megatron-core: each emulated rank reproduces its real-run step bit for bit.

For each layout (TP=2, PP=2, DP=2 with the distributed optimizer, TP=2 x PP=2 with sequence
parallelism, and MoE with EP=2 through the all-to-all and the all-gather token dispatchers;
MoE layers without linear biases: megatron-core 0.19's local expert MLP modifies a custom
Function's output view in place when they are on), three runs of the same Megatron program
(programs_megatron.train_case: GPT, DDP, distributed Adam, ``get_forward_backward_func()``, 3 steps):

1. the real run: every rank a real process (prism with all ranks real, inner gloo groups);
2. the recording run: the same, with ``record_dir`` (its losses must equal run 1's: recording
   changes no value);
3. per rank r, the emulated run: r is the only real rank, the others virtual, policy RECORDED;
   for TP=2 x PP=2 also two real processes at once (ranks 1 and 3: a pipeline pair, whose
   transfers are then real and whose TP peers are virtual).

Run 3 must equal run 1 for rank r bit for bit (losses, every gradient buffer, every parameter
after each optimizer step, the grad norm) and in peak tensor memory to the byte (the CPU
tensor-storage tracker of `prism_plugin.device.memory`, model build included; run 1 is the memory
reference because the recorder's own copies count in run 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import programs_megatron as pm
import pytest
import torch
from harness import Mode, Setup

pytestmark = pytest.mark.slow

MOE = dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.0, add_bias_linear=False)
LAYOUTS = {
    "tp2": dict(world=2, tp=2, pp=1),
    "pp2": dict(world=2, tp=1, pp=2),
    "dp2": dict(world=2, tp=1, pp=1),
    "tp2pp2sp": dict(world=4, tp=2, pp=2, sp=True),
    "ep2-alltoall": dict(world=2, ep=2, moe=dict(MOE, moe_token_dispatcher_type="alltoall")),
    "ep2-allgather": dict(world=2, ep=2, moe=dict(MOE, moe_token_dispatcher_type="allgather")),
}


def _bits_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b), f"{where}: values differ"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bits_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


REAL_RETRIES = 2  # real runs repeated when the peaks differ (see test_emulated_rank_is_bit_exact)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_runs(request, mcluster, tmp_path_factory) -> tuple[str, dict[str, Any], dict[int, Any], Path]:
    name = request.param
    spec = dict(LAYOUTS[name])
    world = spec.pop("world")
    ranks = tuple(range(world))
    real = mcluster.run(Setup(mode=Mode.PRISM, world_size=world, real_ranks=ranks, label=f"{name}-real"),
                        pm.train_case, **spec)
    record_dir = tmp_path_factory.mktemp(f"rec-{name}")
    recorded = mcluster.run(Setup(mode=Mode.PRISM, world_size=world, real_ranks=ranks, record_dir=str(record_dir),
                                  label=f"{name}-rec"), pm.train_case, track_memory=False, **spec)
    mcluster.teardown()  # deactivate() writes rank<R>.pt
    for rank in ranks:
        _bits_equal(recorded[rank]["losses"], real[rank]["losses"], f"{name} rank {rank} recording vs real")
    return name, spec, real, record_dir


def test_real_run_trains(layout_runs) -> None:
    name, _spec, real, _ = layout_runs
    for rank, result in real.items():
        assert result["finite"], f"{name} rank {rank}: non-finite loss or gradient"
        assert not torch.equal(result["params"][0][0], result["params"][-1][0]), f"{name} rank {rank}: no update"
    last = [r for r in real.values() if r["losses"][0]]
    assert last, f"{name}: no rank reported a loss"


def test_emulated_rank_is_bit_exact(mcluster, layout_runs) -> None:
    name, spec, real, record_dir = layout_runs
    world = len(real)
    for rank in range(world):
        setup = Setup(mode=Mode.PRISM, world_size=world, real_ranks=(rank,), data_policy="recorded",
                      replay_dir=str(record_dir), label=f"{name}-replay")
        emulated = mcluster.run(setup, pm.train_case, **spec)[rank]
        where = f"{name}: rank {rank} emulated (others virtual) vs real"
        for key in ("losses", "grad_norm", "grads", "params"):
            _bits_equal(emulated[key], real[rank][key], f"{where} {key}")
        runs = [real[rank]]
        while emulated["peak_bytes"] not in [r["peak_bytes"] for r in runs] and len(runs) <= REAL_RETRIES:
            # the real run's peak may carry a transient: gloo's worker thread still holding the last reference to a
            # tensor when the main thread, told the op completed, allocates (+2,688 B and +7,024 B in ep2-allgather
            # under CI's load); the tracker counts such late frees. Repeat the real run.
            again = mcluster.run(Setup(mode=Mode.PRISM, world_size=world, real_ranks=tuple(range(world)),
                                       label=f"{name}-real-again"), pm.train_case, **spec)[rank]
            _bits_equal(again["losses"], real[rank]["losses"], f"{where} (real run repeated) losses")
            runs.append(again)
        for run in runs:
            peak, late = run["peak_bytes"], run["late_free_bytes"]
            figures = f"{where}: peak tensor memory {emulated['peak_bytes']} B vs real {peak} B ({late} B freed late)"
            if late:  # a race-free peak lies between the emulated one and this upper bound
                assert emulated["peak_bytes"] <= peak <= emulated["peak_bytes"] + late, figures
            else:
                assert emulated["peak_bytes"] == peak, figures


def test_two_real_ranks_replay_bit_exact(mcluster, layout_runs) -> None:
    name, spec, real, record_dir = layout_runs
    if name != "tp2pp2sp":
        pytest.skip("one two-process replay is enough: the TP=2 x PP=2 layout")
    setup = Setup(mode=Mode.PRISM, world_size=4, real_ranks=(1, 3), data_policy="recorded",
                  replay_dir=str(record_dir), label=f"{name}-replay2")
    emulated = mcluster.run(setup, pm.train_case, **spec)
    attempts = 1
    while any(_peak_mismatch(emulated[r], real[r]) for r in (1, 3)) and attempts <= REAL_RETRIES:
        # a transient in either run (its late frees below the difference): repeat both
        real = mcluster.run(Setup(mode=Mode.PRISM, world_size=len(real), real_ranks=tuple(range(len(real))),
                                  label=f"{name}-real-again"), pm.train_case, **spec)
        emulated = mcluster.run(setup, pm.train_case, **spec)
        attempts += 1
    for rank in (1, 3):
        where = f"{name}: rank {rank} emulated with real ranks 1 and 3 vs real ({attempts} run(s))"
        for key in ("losses", "grad_norm", "grads", "params"):
            _bits_equal(emulated[rank][key], real[rank][key], f"{where} {key}")
        mismatch = _peak_mismatch(emulated[rank], real[rank])
        assert mismatch is None, f"{where}: {mismatch}"


def _peak_mismatch(emulated: dict[str, Any], real: dict[str, Any]) -> str | None:
    """None when the peaks agree: equal, or the higher above the other by no more than its own late frees. With two
    real ranks both runs have gloo worker threads, and either may hold a tensor's last reference past the op's
    completion while its main thread allocates (+120 B on rank 3 of tp2pp2sp under CI's load; see
    test_emulated_rank_is_bit_exact)."""
    if emulated["peak_bytes"] == real["peak_bytes"]:
        return None
    high, low = (real, emulated) if real["peak_bytes"] > emulated["peak_bytes"] else (emulated, real)
    excess = high["peak_bytes"] - low["peak_bytes"]
    if excess <= (high["late_free_bytes"] or 0):
        return None
    return (f"peak tensor memory emulated {emulated['peak_bytes']} B vs real {real['peak_bytes']} B; the higher run "
            f"freed {high['late_free_bytes']} B late, less than the {excess} B difference")
