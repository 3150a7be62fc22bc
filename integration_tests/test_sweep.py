"""`prism sweep` end to end: a small Llama job (hidden 512, 2 layers, seq 512) on virtual H100s at N = 8, 64, 512.

Each point is a real ``prism run --device virtual-gpu`` of ``prism_plugin/programs/llama_ddp.py`` (a few seconds).
The job is ZeRO-free DDP at a fixed per-replica batch, so what must hold is: identical per-rank memory at every N
(full model, gradient and optimizer state on each rank), identical compute per step, and a step time that grows
with N by the gradient all-reduce's modelled change (N = 8 is one node on NVLink, 64 and 512 cross 8 and 64 nodes;
this program all-reduces after the backward, so its communication is exposed). The emulated step times are
modelled, so every sweep gives the same ones: they are pinned to the nanosecond (in place of a second sweep
compared with the first, which cost ~30 s of CI). One test runs 2 points as Ray tasks on a local Ray instance, at
a fixed global batch (accumulation 2 and 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.profiles import launch_light_profile
from prism_plugin.recipes.load import load_recipe
from prism_plugin.recipes.sweep import SweepSpec, derive_points, run_points

pytestmark = pytest.mark.slow

SMALL = """\
name: sweep-small-llama
framework: torch
program: llama
tier: virtual-gpu
model: {hidden_size: 512, num_layers: 2, num_attention_heads: 8, num_query_groups: 8, ffn_hidden_size: 1536,
        vocab_size: 32000, seq_length: 512, micro_batch_size: 1}
layout: {}
steps: {total: 3, warmup: 1}
real: none
emulated:
  - {name: n8, world_size: 8, runs: [[5]], profile: dgx-h100, device: virtual-gpu, compare_with: none,
     expect: {fits: true}}
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """The recipe on dgx-h100 with a launch-light host (5 us a launch): the GPU bounds this toy's step, as it does a
    real-size job's, so the all-reduce's growth with N shows in it (at 85 us a launch the host bounds it and hides
    the all-reduce: integration_tests/profiles.py)."""
    path = tmp_path / "sweep-small-llama.yaml"
    path.write_text(SMALL.replace("profile: dgx-h100", f"profile: {launch_light_profile(tmp_path)}"))
    return path


def _sweep(recipe: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "sweep", str(recipe), "--world-sizes",
                           "8,64,512", "--jobs", "2", "--output", str(out), "--json"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # --json: the document on stdout, nothing else
    assert doc == json.loads((out / "sweep.json").read_text())
    return doc


def test_a_three_point_sweep_of_a_small_job(recipe: Path, tmp_path: Path) -> None:
    doc = _sweep(recipe, tmp_path / "a")
    assert doc["schema"] == "prism-sweep/1" and doc["recipe"] == "sweep-small-llama"
    points = doc["points"]
    assert [p["point"]["name"] for p in points] == ["n8", "n64", "n512"] and all(p["ok"] for p in points)
    figs = [p["figures"] for p in points]
    for p, f in zip(points, figs, strict=True):
        assert p["point"]["accumulation"] == 1 and p["point"]["global_batch"] == p["point"]["world_size"]
        assert f["breakdown_note"] == "timeline: mean of 2 measured steps" and f["bubble_s"] == 0.0
        assert f["step_time_s"] == pytest.approx(f["compute_s"] + f["exposed_comm_s"] + f["other_s"], abs=1e-9)
        assert 0 < f["mfu"] < 1 and f["fits"] and f["ooms"] == 0
        assert f["tokens_per_s_per_gpu"] == pytest.approx(512 / f["step_time_s"])  # 1 sequence of 512 per GPU
    # ZeRO-free DDP: each rank holds the whole model, its gradients and AdamW state whatever N is; the device total
    # adds the NCCL buffers of the world group, which grow once the group spans nodes (N=8: one node)
    assert len({(f["peak_allocated_bytes"], f["peak_reserved_bytes"]) for f in figs}) == 1
    totals = [f["device_total_bytes"] for f in figs]
    assert totals == sorted(totals) and totals[0] < totals[-1] and totals[0] > figs[0]["peak_reserved_bytes"]
    assert len({f["flops_per_step"] for f in figs}) == 1
    # same kernels per rank: equal but for the timeline's rounding of each span to the nanosecond
    assert max(f["compute_s"] for f in figs) - min(f["compute_s"] for f in figs) < 1e-8
    steps = [f["step_time_s"] for f in figs]
    comm = [f["modelled_comm_s"] for f in figs]
    assert steps[0] < steps[1] < steps[2] and comm[0] < comm[1] < comm[2]
    for i in (1, 2):  # the step grows by the all-reduce's change (exposed here), less the host time it hides
        assert steps[i] - steps[0] == pytest.approx(comm[i] - comm[0], rel=0.1)
        assert figs[i]["exposed_comm_s"] - figs[0]["exposed_comm_s"] == pytest.approx(comm[i] - comm[0], rel=0.1)
    out = tmp_path / "a"
    for name in ("step_time.png", "memory.png", "mfu.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "sweep.md").read_text()
    assert md.startswith("# prism sweep sweep-small-llama") and "| n512 | 512 | 512 | 1 x 1 |" in md
    assert (out / "n512" / "prism" / "rank5.summary.json").exists()
    assert (out / "n512" / "timeline" / "rank5.timeline.json").exists()
    # deterministic: emulated time does not depend on this host's load (or on the run: pinned)
    assert [f["step_times_s"] for f in figs] == PINNED_STEP_TIMES_S


PINNED_STEP_TIMES_S = [[0.003578846, 0.003578846], [0.004780808, 0.004780808], [0.006040808, 0.006040808]]
"""Each point's emulated steps after warm-up (n8, n64, n512): modelled, the same every sweep."""


@pytest.mark.heavy  # a local Ray instance: about 35 s
def test_points_run_as_ray_tasks_on_a_local_instance(recipe: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    spec = SweepSpec(recipe=load_recipe(recipe), world_sizes=(8, 16), global_batch=16)
    points = derive_points(spec)
    assert [(p.name, p.accumulation) for p in points] == [("n8", 2), ("n16", 1)]
    done: list[str] = []
    results = run_points(points, tmp_path, jobs=2, ray_address="local", on_done=lambda r: done.append(r.point.name))
    assert [r.point.name for r in results] == ["n8", "n16"] and sorted(done) == ["n16", "n8"]
    assert all(r.ok for r in results), [r.error for r in results]
    acc2, acc1 = (r.figures for r in results)
    assert acc2 is not None and acc1 is not None
    assert acc2.flops_per_step == 2 * acc1.flops_per_step  # two micro-batches per step at N = 8, one at 16
    assert acc2.compute_s > acc1.compute_s  # type: ignore[operator]  # + one forward/backward (AdamW's step: once)
    assert (tmp_path / "n16" / "prism" / "rank5.summary.json").exists()
