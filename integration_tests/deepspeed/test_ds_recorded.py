"""Real vs emulated, same rank: DeepSpeed ZeRO 1/2/3 and PipelineEngine replayed bit for bit.

For each case three jobs run in the reusable cluster:
1. real: plain torch.distributed over gloo, every rank a process (DeepSpeed's own TorchBackend);
2. recording: the same job through `prism_plugin.deepspeed.init_distributed` with every rank real and
   ``"record_dir"`` set (its losses must equal the real run's: the recording run is faithful);
3. emulated: one real process plays one rank, every other rank virtual, ``"data_policy": "recorded"``.

The emulated rank must compute the real rank's losses bit for bit over 3 steps, and its peak and final
tensor-storage bytes (the adapter's deterministic CPU tracker) must equal the real rank's to the byte.
(The recording run's own memory is not the reference: its inner gloo exchanges allocate visibly on
the calling thread, where a plain gloo collective's internals are one opaque op to the tracker.)

The real run's memory is not always deterministic: a gloo work that DeepSpeed no longer references may
still hold its tensors on gloo's own thread for a moment, and when the main thread allocates (or the
run ends) in that moment the real figure rises by that buffer (peaks +896 and +1,408 B in ZeRO-2, final
bytes +8 B in ZeRO-3 and a pipeline, under load, a few cases in some full runs; peak +4 B in plain
data parallelism, in 3 real runs in a row once). The emulated rank has
no such race. So when the figures differ, the real run is repeated (up to `REAL_RETRIES` more times) and
the emulated rank must equal the lowest real figures, those without the transient, and never exceed them.
"""

from __future__ import annotations

import pytest
from ds_programs import ds_config, pipe_job, zero_job

pytestmark = pytest.mark.slow

# (ZeRO stage, data-parallel size, the rank replayed): stages 1-3 at DP 2, 3 and 4 (and plain data
# parallelism, stage 0, at DP 2); the replayed rank varies so that rank 0 is virtual in most cases
ZERO_CASES = [(0, 2, 1)] + [(stage, dp, (stage + dp) % dp) for stage in (1, 2, 3) for dp in (2, 3, 4)]
REAL_RETRIES = 5  # a fresh-clone CI run once saw the +4 B transient in 3 real runs in a row (ZeRO-0, DP 2)


def _jobs(cluster, fn, config, n, **kwargs):
    store = cluster.store_path()
    return cluster.run_jobs(fn, [dict(config=config, process_index=i, store_path=store, **kwargs) for i in range(n)])


def _real_and_recording(cluster, tmp_path, fn, n, make_config, **kwargs):
    record_dir = tmp_path / "rec"
    real = _jobs(cluster, fn, make_config(real_ranks=list(range(n))), n, plain_gloo=True, **kwargs)
    recording = _jobs(cluster, fn, make_config(real_ranks=list(range(n)), record_dir=str(record_dir)), n, **kwargs)
    for r, (a, b) in enumerate(zip(real, recording, strict=True)):
        assert a["rank"] == b["rank"] == r
        assert b["losses"] == a["losses"], f"rank {r}: the recording run diverged from the real run"
    return real, record_dir


def _reference(cluster, fn, make_config, n, rank, real, emulated, **kwargs):
    """The real rank's figures; when its memory differs from the emulated rank's, the real run is repeated
    (up to REAL_RETRIES times) and the lowest peak and final bytes kept: those without a gloo transient."""
    reference = dict(real[rank])
    runs = [reference]
    while ((emulated["peak_bytes"], emulated["live_bytes"]) != (reference["peak_bytes"], reference["live_bytes"])
           and len(runs) <= REAL_RETRIES):
        again = _jobs(cluster, fn, make_config(real_ranks=list(range(n))), n, plain_gloo=True, **kwargs)[rank]
        assert again["losses"] == reference["losses"], "the real run's losses changed between runs"
        runs.append(again)
        reference["peak_bytes"] = min(r["peak_bytes"] for r in runs)
        reference["live_bytes"] = min(r["live_bytes"] for r in runs)
    assert emulated["peak_bytes"] <= reference["peak_bytes"], f"emulated peak above every real run's: {runs}"
    return reference


def _assert_same(emulated, real):
    assert emulated["rank"] == real["rank"]
    assert emulated["losses"] == real["losses"], "losses differ (bit for bit)"
    assert emulated["peak_bytes"] == real["peak_bytes"], "peak tensor memory differs"
    assert emulated["live_bytes"] == real["live_bytes"], "final tensor memory differs"


@pytest.mark.parametrize("stage,dp,rank", ZERO_CASES, ids=[f"zero{s}-dp{d}-rank{r}" for s, d, r in ZERO_CASES])
def test_zero_replays_real_rank(cluster, tmp_path, stage, dp, rank):
    def make(**kw):
        return ds_config(stage=stage, world_size=dp, dp=dp, **kw)

    real, record_dir = _real_and_recording(cluster, tmp_path, zero_job, dp, make)
    config = make(real_ranks=[rank], policy="recorded", replay_dir=str(record_dir))
    (emulated,) = cluster.run_jobs(zero_job, [dict(config=config, process_index=0, store_path=None)])
    _assert_same(emulated, _reference(cluster, zero_job, make, dp, rank, real, emulated))
    assert emulated["dp"] == dp
    assert all(v > 0 for v in emulated["op_counts"].values())


# bf16 mixed precision (fp16 is GPU-only: DeepSpeed's CPU accelerator refuses it), gradient accumulation,
# ZeRO-3 partitioned construction (deepspeed.zero.Init)
VARIANTS = [("bf16", 1, 3, 2, {"bf16": {"enabled": True}}), ("bf16", 1, 1, 2, {"bf16": {"enabled": True}}),
            ("gas2", 2, 2, 3, {}), ("zero_init", 1, 3, 2, {})]


@pytest.mark.parametrize("name,rank,stage,dp,extra", VARIANTS, ids=[f"{v[0]}-zero{v[2]}" for v in VARIANTS])
def test_zero_variants_replay_real_rank(cluster, tmp_path, name, rank, stage, dp, extra):
    gas = 2 if name == "gas2" else 1
    zero_init = name == "zero_init"

    def make(**kw):
        return {**ds_config(stage=stage, world_size=dp, dp=dp, gas=gas, **kw), **extra}

    real, record_dir = _real_and_recording(cluster, tmp_path, zero_job, dp, make, gas=gas, zero_init=zero_init)
    config = make(real_ranks=[rank], policy="recorded", replay_dir=str(record_dir))
    (emulated,) = cluster.run_jobs(zero_job, [dict(config=config, process_index=0, store_path=None, gas=gas,
                                               zero_init=zero_init)])
    _assert_same(emulated, _reference(cluster, zero_job, make, dp, rank, real, emulated, gas=gas,
                                      zero_init=zero_init))
    assert len(emulated["losses"]) == 3 * gas


def test_zero2_two_real_ranks_of_four(cluster, tmp_path):
    """Any subset of ranks may be real: ranks 1 and 3 of 4 replay their real losses bit for bit."""
    def make(**kw):
        return ds_config(stage=2, world_size=4, dp=4, **kw)

    real, record_dir = _real_and_recording(cluster, tmp_path, zero_job, 4, make)
    config = make(real_ranks=[1, 3], policy="recorded", replay_dir=str(record_dir))
    emulated = _jobs(cluster, zero_job, config, 2)
    assert [e["rank"] for e in emulated] == [1, 3]
    for e in emulated:
        assert e["losses"] == real[e["rank"]]["losses"]


# (pipeline stages, data-parallel size, the rank replayed): rank 3 of 2x2 is the last stage of the
# second replica; rank 1 of 3x1 is the middle stage (both of its neighbours virtual)
PIPE_CASES = [(2, 2, 3), (2, 2, 0), (3, 1, 1)]


@pytest.mark.parametrize("stages,dp,rank", PIPE_CASES, ids=[f"pp{s}-dp{d}-rank{r}" for s, d, r in PIPE_CASES])
def test_pipeline_replays_real_rank(cluster, tmp_path, stages, dp, rank):
    n = stages * dp

    def make(**kw):
        return ds_config(stage=1, world_size=n, dp=dp, gas=4, **kw)

    real, record_dir = _real_and_recording(cluster, tmp_path, pipe_job, n, make, stages=stages)
    config = make(real_ranks=[rank], policy="recorded", replay_dir=str(record_dir))
    (emulated,) = cluster.run_jobs(pipe_job, [dict(config=config, process_index=0, store_path=None, stages=stages)])
    _assert_same(emulated, _reference(cluster, pipe_job, make, n, rank, real, emulated, stages=stages))
    assert emulated["stage"] == real[rank]["stage"] == rank // dp
    assert emulated["op_counts"]["send"] > 0 and emulated["op_counts"]["recv"] > 0
