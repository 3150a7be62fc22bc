"""Fake execution on the CPU device (`prism_plugin.runtime.fake_cpu`) counted by the storage tracker as a real CPU
run is: the kernels whose real storage differs from FakeTensorMode's meta, tensors made from data, reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _bytes(body: str, fake: bool) -> list[int]:
    """Run `body` (which appends to `marks`) under a StorageTracker, fake or real, in a fresh process."""
    code = textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from prism_plugin.runtime.fake_cpu import FakeCpu
        from prism_plugin.device.memory import StorageTracker
        if {fake}:
            fc = FakeCpu().start()
        t = StorageTracker().start()
        marks = []
    """) + textwrap.dedent(body) + "\nprint(marks)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("body", [
    # F.mse_loss / smooth_l1_loss / binary_cross_entropy with a reduction: the real kernel's 0-dim result keeps the
    # unreduced storage (64 x 512 x 4 = 131,072 B); l1_loss (composite: sub, abs, mean) does not
    """
    x, y = torch.randn(64, 512), torch.rand(64, 512)
    p = torch.sigmoid(x)
    kept = []
    for loss in (lambda: F.mse_loss(x, y), lambda: F.mse_loss(x, y, reduction="sum"), lambda: F.smooth_l1_loss(x, y),
                 lambda: F.binary_cross_entropy(p, y), lambda: F.l1_loss(x, y),
                 lambda: F.mse_loss(x, y, reduction="none")):
        before = t.current_bytes
        kept.append(loss())
        marks.append(t.current_bytes - before)
    """,
    # a tensor made from data is unseen in a real run (lift_fresh of a storage made outside the dispatcher)
    """
    a = torch.tensor(0.0); b = torch.tensor([1, 2, 3]); c = torch.as_tensor([1.0, 2.0])
    marks.append(t.current_bytes)
    z = torch.zeros(()); marks.append(t.current_bytes)
    """,
])
def test_fake_cpu_counts_what_real_cpu_counts(body: str) -> None:
    real = _bytes(body, fake=False)
    assert _bytes(body, fake=True) == real
    assert real in ([131_072, 131_072, 131_072, 131_072, 4, 131_072],  # l1_loss: its mean's 4 B only
                    [0, 4])  # nothing from data; then a factory's 4 B


def test_reads_of_data_constants_and_small_random_fills_have_values() -> None:
    out = _bytes("""
        flags = torch.tensor([1, 0, 1], dtype=torch.long)
        marks.append([int(flags[0].item()), int(flags[1].item())])
        g = torch.Generator().manual_seed(3)
        seed = torch.empty((), dtype=torch.int64).random_(generator=g).item()
        marks.append(seed == torch.empty((), dtype=torch.int64).random_(
            generator=torch.Generator().manual_seed(3)).item())
        l2 = [[torch.randn(4).norm() for _ in range(3)]]
        n = torch.tensor(l2)  # of fake scalars: a fake of their shape, values unknown (the policy's float)
        marks.append([list(n.shape), str(n.dtype), float(n.norm())])
        marks.append(fc.summary()["values"]["constants_read"])
    """, fake=True)
    assert out == [[1, 0], True, [[1, 3], "torch.float32", 1.0], 4]  # constants read: 2 flags, 2 seeds
