"""Issue 12, item 5(b): fake-CUDA vs fake-CPU allocations of the same job, by allocation site, each difference
explained; none unexplained.

The job: prism_plugin/programs/toy_train.py (TP2 MLP, hidden 512, batch 64, 3 SGD steps) as rank 0 of 2, once on a
virtual H100 (``--device cuda``: fake cuda tensors, the allocator tracker) and once on fake CPU tensors
(``-m prism_plugin.runtime.fake_cpu``, the CPU tracker). ``memory_sites.py`` lists every storage either tracker
registers by the program line that made it. Requested bytes (storage sizes, before the caching allocator's
rounding) are compared site by site. The differences, each asserted exactly:

- **host-only work** (a path that differs by device): ``(torch.randn(h, shard) / h**0.5).to(device)`` draws and
  scales on the host; on a GPU job those are host tensors (the virtual GPU runs host ops for real, off the device's
  books) and only the moved weight is device memory; on CPU the unscaled draw is one more storage (2 MiB each);
- **backward on autograd's device thread** (same bytes, another site): for cuda tensors autograd runs the backward
  on its worker thread of that device, whose stack has no program frame; on CPU it runs in the calling thread at
  ``loss.backward()``; the root gradient (4 B, ``ones_like(loss)``) is made in the calling thread in both;
- **mse_loss's result** (a known gap of the virtual GPU): the real kernel keeps the unreduced storage for the 0-dim
  loss (131,072 B); the CPU tracker counts that (`memory._FULL_STORAGE_LOSSES`), the virtual GPU's dispatch does not
  pass the op to the tracker yet and counts FakeTensorMode's 4 B.

No GPU-only buffer appears in this job (the cuBLAS workspaces and NCCL buffers are outside the tracked tensors: the
device total adds them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SITES = Path(__file__).resolve().parent / "memory_sites.py"
PROGRAM = ROOT / "prism_plugin" / "programs" / "toy_train.py"
ARGS = ["-m", "prism_plugin.programs.toy_train", "--tp", "2", "--hidden", "512", "--batch", "64", "--steps", "3",
        "--json"]


def _line(text: str) -> str:
    (n,) = [i for i, line in enumerate(PROGRAM.read_text().splitlines(), 1) if text in line]
    return f"toy_train.py:{n}"


def _sites(tmp_path: Path, name: str, *argv: str) -> dict[str, list[int]]:
    proc = subprocess.run([sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "2", "--real-ranks",
                           "0", "--profile", "dgx-h100", "--output", str(tmp_path / name), *argv],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("MEMORY_SITES ")]
    return {site: sizes for site, (_, _, sizes) in json.loads(line.split(" ", 1)[1]).items()}


def test_fake_cuda_and_fake_cpu_differ_only_where_explained(tmp_path: Path) -> None:
    gpu = _sites(tmp_path, "gpu", "--device", "virtual-gpu", "--", str(SITES), *ARGS, "--device", "cuda")
    cpu = _sites(tmp_path, "cpu", "--", "-m", "prism_plugin.runtime.fake_cpu", str(SITES), "--tracker", *ARGS)
    w1, w2 = _line("w1 = torch.nn.Parameter"), _line("w2 = torch.nn.Parameter")
    loss, backward = _line("mse_loss(y, target)"), _line("loss.backward()")
    steps, weight, batch = 3, 512 * 1024 * 4, 64 * 512 * 4  # a 512 x 1024 fp32 TP shard; a 64 x 512 fp32 batch

    # backward: autograd's device thread (no program frame) on the GPU, the calling thread on CPU; the same storages
    thread = gpu.pop("(none)")
    assert "(none)" not in cpu and gpu[backward] == [4] * steps  # the root gradients, made in the calling thread
    assert sorted(gpu[backward] + thread) == sorted(cpu[backward])
    # per step: mse_loss's input gradient (64 x 512), w2's and w1's gradients, the hidden activation's gradient
    # through the matmul and through gelu (64 x 1024 each)
    assert sum(thread) == steps * (batch + 2 * weight + 2 * 64 * 1024 * 4) == 14_548_992
    # host-only work: the unscaled draw of each weight is a host tensor on the GPU job
    assert (gpu[w1], cpu[w1]) == ([weight], [weight, weight]) and (gpu[w2], cpu[w2]) == ([weight], [weight, weight])
    # mse_loss's 0-dim result: the real kernel's storage (CPU tracker) vs FakeTensorMode's (virtual GPU, a gap)
    assert (gpu[loss], cpu[loss]) == ([4] * steps, [batch] * steps)
    # every other site: the same storages in the same order
    explained = {w1, w2, loss, backward}
    assert set(gpu) == set(cpu)
    assert {s: gpu[s] for s in gpu if s not in explained} == {s: cpu[s] for s in cpu if s not in explained}
    total_difference = sum(map(sum, cpu.values())) - sum(map(sum, gpu.values())) - sum(thread)
    assert total_difference == 2 * weight + steps * (batch - 4) == 4_587_508
