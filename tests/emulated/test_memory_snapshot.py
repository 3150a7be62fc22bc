"""Memory snapshots of a virtual GPU, opened with torch's own ``torch.cuda._memory_viz`` code.

A training step (the MLP of tests/emulated/test_virtual_gpu.py, AdamW, two steps) runs on fake ``cuda``
tensors in a fresh process (the virtual CUDA device library loads before torch) with
``torch.cuda.memory._record_memory_history`` on from the first allocation, then dumps
``torch.cuda.memory._dump_snapshot``. This process loads the pickle with plain ``pickle`` (builtin types
only), runs memory_viz's ``segsum`` (which checks its own byte accounting), ``trace``, ``segments``,
``memory``, ``compare``, ``trace_plot`` and ``segment_plot``, and checks the figures: live blocks sum to
``memory_allocated()`` and to the closed form of the step's tensors, segments to ``memory_reserved()``, the
trace replayed from an empty device gives the live blocks, its counts equal the allocator's counters.
Also ``PRISM_MEMORY_SNAPSHOT`` (`snapshot.from_env` / `write_snapshot`), per device and with
expandable segments.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prism_plugin.cost.allocator_config import round_size

MiB = 1 << 20
PARAM_BYTES = sum(round_size(b) for b in (4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4))

PROGRAM = """
import json, os, sys
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
from prism_plugin.cost.allocator_config import AllocatorConfig
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.device import snapshot
from prism_plugin.device.device import VirtualGpu
folder = os.environ["SNAP_DIR"]
out = {}
code = 0
try:
    config = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    with VirtualGpu(gpu_spec("h100-sxm"), num_devices=2, allocator=config) as vg:
        if getattr(torch.cuda.memory._snapshot, "__module__", "") != snapshot.__name__:
            snapshot.install(vg.shim)  # until the shim installs it itself
        run_path = snapshot.from_env(vg.allocators, rank=3)
        torch.cuda.memory._record_memory_history(max_entries=100000)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        model = model.to(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(64, 1024, device="cuda")
        on1 = torch.empty(1000, device="cuda:1")
        for _ in range(2):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.memory._dump_snapshot(os.path.join(folder, "step.pickle"))
        out["allocated"] = [torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)]
        out["reserved"] = [torch.cuda.memory_reserved(0), torch.cuda.memory_reserved(1)]
        out["stats"] = [torch.cuda.memory_stats(i) for i in range(2)]
        out["memory_snapshot"] = len(torch.cuda.memory_snapshot())
        del x
        torch.cuda.empty_cache()
        with open(os.path.join(folder, "after.pickle"), "wb") as f:
            import pickle
            pickle.dump(torch.cuda.memory._snapshot(), f)
        if run_path is not None:
            out["run_path"] = str(snapshot.write_snapshot(vg.allocators, run_path))
        torch.cuda.memory._record_memory_history(enabled=None)
        out["traces_when_off"] = [len(t) for t in torch.cuda.memory._snapshot()["device_traces"]]
except BaseException as exc:
    import traceback
    out["error"] = f"{type(exc).__name__}: {exc}\\n{traceback.format_exc()}"
    code = 1
print("RESULT " + json.dumps(out))
cuda_runtime.exit_now(code)
"""


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"the snapshot pickles a {module}.{name}: torch's holds builtin types only")


def _load(path: Path) -> dict:
    with open(path, "rb") as f:
        return _BuiltinsOnly(f).load()


@pytest.fixture(scope="module")
def library() -> None:
    subprocess.run([sys.executable, "-m", "prism_plugin.device.cuda_runtime"], check=True,
                   capture_output=True, timeout=600)


def _run(folder: Path, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SNAP_DIR": str(folder), **env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert "error" not in out, out["error"]
    return out


def _replay(trace: list[dict]) -> dict[int, int]:
    blocks: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            blocks[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert blocks.pop(e["addr"]) == e["size"]
    return blocks


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"], ids=["default", "expandable"])
def test_a_training_steps_snapshot_opens_in_memory_viz(library: None, tmp_path: Path, alloc_conf: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from torch.cuda import _memory_viz as viz

    out = _run(tmp_path, PYTORCH_CUDA_ALLOC_CONF=alloc_conf,
               PRISM_MEMORY_SNAPSHOT=str(tmp_path / "run" / "rank{rank}.pickle"))
    snap = _load(tmp_path / "step.pickle")
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert snap["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == alloc_conf
    assert snap["allocator_settings"]["expandable_segments"] is bool(alloc_conf)
    segments, traces = snap["segments"], snap["device_traces"]
    assert len(traces) == 2 and out["memory_snapshot"] == len(segments)

    # the figures: the allocator model's own, and the step's tensors
    for device in (0, 1):
        mine = [s for s in segments if s["device"] == device]
        active = {b["address"]: b for s in mine for b in s["blocks"] if b["state"] == "active_allocated"}
        assert sum(b["size"] for b in active.values()) == out["allocated"][device]
        assert sum(s["total_size"] for s in mine) == out["reserved"][device]
        assert all(s["is_expandable"] is bool(alloc_conf) for s in mine)
        trace = traces[device]
        assert trace[-1]["action"] == "snapshot"
        assert _replay(trace) == {a: b["requested_size"] for a, b in active.items()}
        stats = out["stats"][device]
        count = {a: sum(e["action"] == a for e in trace) for a in ("alloc", "free_completed", "segment_alloc",
                                                                   "segment_map")}
        assert count["alloc"] == stats["allocation.all.allocated"]
        assert count["free_completed"] == stats["allocation.all.freed"]
        assert count["segment_alloc" if not alloc_conf else "segment_map"] == stats["num_device_alloc"]
    # parameters + AdamW's two states + x + the 0-dim loss + torch's two cuBLAS workspaces (test_virtual_gpu's closed
    # form); 4000 B on cuda:1
    assert out["allocated"] == [3 * PARAM_BYTES + round_size(64 * 1024 * 4) + round_size(4) + 2 * 32 * MiB,
                                round_size(4000)]
    assert out["traces_when_off"] == [0, 0]  # disabling clears the history, as torch does

    # frames: the program's stack, innermost first, without prism's or the fake tensor's frames
    # (but the autograd thread's cuBLAS workspace: allocated in backward, where torch's Python stack is empty too)
    blocks = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    frameless = [b for b in blocks if not b["frames"]]
    assert [b["size"] for b in frameless] == [32 * MiB]
    files = {f["filename"] for b in blocks for f in b["frames"]}
    assert "<string>" in files and any(f.endswith("torch/optim/adam.py") for f in files)  # AdamW's states
    assert not any("prism_plugin" in f or "_subclasses" in f for f in files)

    # torch's memory_viz reads it
    summary = viz.segsum(snap)  # raises on any byte-accounting mismatch
    assert f"segments: {len(segments)}\n" in summary
    assert viz.trace(snap).count("\n") > len(traces[0])
    lines = viz.segments(snap, format_flamegraph=lambda text: text)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines.splitlines()) == sum(s["total_size"] for s in segments)
    assert "<string>:" in viz.memory(snap, format_flamegraph=lambda text: text)
    after = _load(tmp_path / "after.pickle")
    viz.compare(snap["segments"], after["segments"], format_flamegraph=lambda text: text)
    for html in (viz.trace_plot(snap), viz.trace_plot(snap, plot_segments=True), viz.segment_plot(snap)):
        encoded = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))[0]["base64"]
        assert pickle.loads(base64.b64decode(encoded)) == snap
    capsys.readouterr()
    viz.trace_plot(pickle.loads(pickle.dumps(snap)), filter_freed=True)
    assert "free_completed without free_requested" not in capsys.readouterr().out

    # PRISM_MEMORY_SNAPSHOT: the whole run from the first allocation, at the path named for rank 3
    run = _load(Path(out["run_path"]))
    assert out["run_path"] == str(tmp_path / "run" / "rank3.pickle")
    assert run["device_traces"][0][0]["action"] == ("segment_map" if alloc_conf else "segment_alloc")


def test_install_patches_torchs_api_until_uninstall_and_reads_the_legacy_form(tmp_path: Path) -> None:
    """In this process (no fake tensors needed): the patched names, torch's legacy call, the env helper."""
    from types import SimpleNamespace

    import torch

    from prism_plugin.cost.allocator import CachingAllocatorModel
    from prism_plugin.device import snapshot
    from prism_plugin.device.undo import Patches

    originals = (torch.cuda.memory._snapshot, torch.cuda.memory._dump_snapshot, torch.cuda.memory_snapshot)
    models = [CachingAllocatorModel(80 << 30, device=i) for i in range(2)]
    shim = SimpleNamespace(allocators=models, _patches=Patches())
    snapshot.install(shim)
    try:
        # Megatron's --record-memory-history call: keep 100,000 entries, frames on the alloc entries
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100000, trace_alloc_record_context=True)
        history = models[0].history
        assert history.enabled and history.context.name == "ALLOC" and history.entries.maxlen == 100000
        block = models[1].malloc(4096)
        assert [s["device"] for s in torch.cuda.memory_snapshot()] == [1]
        torch.cuda.memory._dump_snapshot(str(tmp_path / "legacy.pickle"))
        trace = _load(tmp_path / "legacy.pickle")["device_traces"][1]
        assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "snapshot"]
        assert trace[1]["addr"] == block.ptr and trace[1]["frames"][0]["name"] == (
            "test_install_patches_torchs_api_until_uninstall_and_reads_the_legacy_form")
        with pytest.raises(ValueError, match="expected stacks"):
            torch.cuda.memory._record_memory_history("all", stacks="cpp")
    finally:
        shim._patches.close()
    assert (torch.cuda.memory._snapshot, torch.cuda.memory._dump_snapshot, torch.cuda.memory_snapshot) == originals

    assert snapshot.from_env(models, environ={}) is None
    path = snapshot.from_env(models, rank=5, environ={snapshot.ENV: str(tmp_path / "r{rank}.pickle"),
                                                      snapshot.ENV_MAX_ENTRIES: "7"})
    assert path == tmp_path / "r5.pickle" and models[0].history.entries.maxlen == 7
    with pytest.raises(ValueError, match="no rank"):
        snapshot.from_env(models, environ={snapshot.ENV: "snap-{rank}.pickle"})
    with pytest.raises(ValueError, match="PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES=.lots.: give an integer >= 1"):
        snapshot.from_env(models, environ={snapshot.ENV: "snap.pickle", snapshot.ENV_MAX_ENTRIES: "lots"})
