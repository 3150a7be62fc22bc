"""DeepSpeed at emulated scale: ZeRO's per-rank model states, virtual pipeline stages, the grid.

Model-state memory per rank, as ZeRO 0.19.8 partitions it (fp32 model, AdamW; the tiny MLP of
ds_programs has parameters of 384, 24, 192 and 8 elements, P = 608):

- ZeRO 1/2: the parameters are flattened into one buffer padded to a multiple of
  ``2 * dp`` elements (``nccl_start_alignment_factor`` 2 times the data-parallel size), held whole
  by every rank; each rank keeps an fp32 master partition of ``flat / dp`` elements, and after the
  first step Adam's two moments of that size, Adam's step counter (a 0-dim fp32 tensor) and the
  stashed global gradient norm (0-dim fp32). Gradients are freed after each step.
- ZeRO 3: every parameter is partitioned on its own into ``ceil(numel / dp)`` elements (padding
  per parameter); S = the sum of those. Each rank holds three flat buffers of S elements (the
  parameter partitions, the fp32 master partitions, the gradient partitions), the reduce bucket
  (``reduce_bucket_size`` elements) and a 1-byte overflow flag; after the first step Adam's two
  moments of S elements, its step counter and the gradient norm (0-dim fp64).

The tracker's live bytes after init and after the steps must equal these figures exactly. (Adam's
step counter is made by ``torch.tensor(0.0)``, which builds its tensor below the dispatcher; it counts
only if the tracker sees such tensors, which `tracker_sees_torch_tensor` probes.)
"""

from __future__ import annotations

import math

import pytest
from ds_grid_programs import grid_equivalence_job, pipeline_setup_at_scale_job, pipeline_topology_error_job
from ds_programs import ds_config, pipe_job, zero_job
from harness import WorkerError

pytestmark = pytest.mark.slow

PARAM_NUMELS = (16 * 24, 24, 24 * 8, 8)
FP32 = 4
BUCKET = 256  # reduce_bucket_size in ds_programs.ds_config


def tracker_sees_torch_tensor() -> bool:
    """Whether `prism_plugin.device.memory.StorageTracker` counts a tensor made by ``torch.tensor(data)``."""
    import torch

    from prism_plugin.device.memory import StorageTracker

    with StorageTracker() as tracker:
        t = torch.tensor([1.0, 2.0])
        seen = tracker.current_bytes == t.nbytes
    return seen


def expected_model_state_bytes(stage: int, dp: int, adam_step: int = FP32) -> tuple[int, int]:
    """(bytes after deepspeed.initialize, bytes after the steps) for one rank, per the module doc.

    `adam_step`: bytes of Adam's step counter as the tracker sees it (4, or 0 if it cannot see it).
    """
    if stage in (1, 2):
        align = 2 * dp
        flat = math.ceil(sum(PARAM_NUMELS) / align) * align
        part = flat // dp
        after_init = (flat + part) * FP32
        return after_init, after_init + 2 * part * FP32 + adam_step + FP32
    s = sum(math.ceil(n / dp) for n in PARAM_NUMELS)
    after_init = 3 * s * FP32 + BUCKET * FP32 + 1
    return after_init, after_init + 2 * s * FP32 + adam_step + 8


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [64, 1024])
def test_model_state_memory_follows_zero_partitioning(cluster, stage, dp):
    config = ds_config(stage=stage, world_size=dp, real_ranks=[5], dp=dp)
    (out,) = cluster.run_jobs(zero_job, [dict(config=config, process_index=0, store_path=None, steps=2)])
    after_init, after_steps = expected_model_state_bytes(stage, dp, FP32 if tracker_sees_torch_tensor() else 0)
    assert out["dp"] == dp and out["rank"] == 5
    assert out["after_init_bytes"] == after_init
    assert out["live_bytes"] == after_steps
    assert all(math.isfinite(x) and x > 0 for x in out["losses"])


def test_zero3_partitioned_construction_at_1024(cluster):
    """deepspeed.zero.Init at DP 1024: the same per-rank model states as partitioning after construction."""
    config = ds_config(stage=3, world_size=1024, real_ranks=[1000], dp=1024)
    (out,) = cluster.run_jobs(zero_job, [dict(config=config, process_index=0, store_path=None, steps=2,
                                              zero_init=True)])
    after_init, after_steps = expected_model_state_bytes(3, 1024, FP32 if tracker_sees_torch_tensor() else 0)
    assert (out["after_init_bytes"], out["live_bytes"]) == (after_init, after_steps)


def test_expected_figures_worked_example():
    # dp=64: ZeRO-1 pads 608 -> 640 (multiple of 128), partition 10; ZeRO-3 partitions 6+1+3+1 = 11
    assert expected_model_state_bytes(1, 64) == ((640 + 10) * 4, (640 + 10) * 4 + 80 + 8)
    assert expected_model_state_bytes(3, 64) == (3 * 11 * 4 + 1024 + 1, 3 * 11 * 4 + 1024 + 1 + 88 + 12)


PIPE_ACTS = {"pipe_activations": {"shape": [2, 16], "dtype": "float32"}}


@pytest.mark.parametrize("rank", [5, 70, 130])
def test_pipeline_stage_with_virtual_neighbours(cluster, rank):
    """3 stages x DP 64 (N = 192), mirror policy: the first, a middle and the last stage run alone."""
    config = ds_config(stage=1, world_size=192, real_ranks=[rank], dp=64, gas=4, extra_prism=PIPE_ACTS)
    (out,) = cluster.run_jobs(pipe_job, [dict(config=config, process_index=0, store_path=None, stages=3)])
    assert out["stage"] == rank // 64 and out["dp"] == 64
    assert all(math.isfinite(x) for x in out["losses"])
    if out["stage"] == 2:  # the last stage computes the loss itself
        assert all(x > 0 for x in out["losses"])
    counts = out["op_counts"]
    assert counts["send"] > 0 and counts["recv"] > 0


def test_middle_stage_without_activation_shapes_is_refused(cluster):
    config = ds_config(stage=1, world_size=192, real_ranks=[70], dp=64, gas=4)
    with pytest.raises(WorkerError, match="pipe_activations"):
        cluster.run_jobs(pipe_job, [dict(config=config, process_index=0, store_path=None, stages=3)])


TOPOLOGIES = [((2, 1, 4), (0, 5, 7)), ((3, 2, 2), (0, 4, 11)), ((4, 1, 1), (2,)), ((2, 2, 3), (1, 9))]


@pytest.mark.parametrize("topo,ranks", TOPOLOGIES, ids=[f"pp{t[0]}-mp{t[1]}-dp{t[2]}" for t, _ in TOPOLOGIES])
def test_grid_equals_stock_deepspeed(cluster, topo, ranks):
    for rank in ranks:
        (out,) = cluster.run_jobs(grid_equivalence_job, [dict(topo_args=topo, rank=rank)])
        stock, fast = out["stock"], out["fast"]
        assert fast["calls"] == stock["calls"], "new_group calls differ"
        assert fast["attrs"] == stock["attrs"]
        assert fast["group_names"] == stock["group_names"]
        assert fast["queries"] == stock["queries"]


def test_pipeline_topology_must_fit_the_virtual_world(cluster):
    def run(**kw):
        (msg,) = cluster.run_jobs(pipeline_topology_error_job, [kw])
        return msg

    assert "spans 6 ranks but prism.world_size is 8" in run(world_size=8, pp=2, dp=3, topology=None)
    assert "contradicts prism.topology" in run(world_size=8, pp=2, dp=4, topology={"pipe": 4, "data": 2})
    assert run(world_size=8, pp=4, dp=2, topology={"pipe": 4, "data": 2}) == ""


def test_pipeline_setup_at_65536_is_fast(cluster):
    """PipelineModule + deepspeed.initialize as rank 5 of 65536 (4 stages): DeepSpeed's own grid takes ~59 s.

    The bound is on the process's CPU time (wall time on an idle machine; ~3 s here), so that other jobs
    sharing the 2 cores cannot fail the test.
    """
    n, stages = 65536, 4
    (out,) = cluster.run_jobs(pipeline_setup_at_scale_job, [dict(world_size=n, rank=5, stages=stages)], timeout_s=300)
    assert out["setup_cpu_s"] < 10.0, out
    dp = n // stages
    assert out["stage"] == 0
    assert out["dp_group"] == list(range(dp))
    assert out["pp_group"] == [5 + s * dp for s in range(stages)]
    assert out["num_p2p"] == n and out["p2p_first"] == [[0, dp], [1, dp + 1], [2, dp + 2]]
    assert out["p2p_last"] == [n - 1, dp - 1]
