"""Child programs on virtual GPUs: the device library must load before torch, so each case runs in a fresh
interpreter that prints its figures as one ``RESULT {json}`` line (and ``"error"`` when it raised)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping

__all__ = ["EPILOGUE", "program", "run_child", "timed_h100_prelude"]


EPILOGUE = """
except BaseException as exc:
    import traceback; traceback.print_exc()
    out["error"] = f"{type(exc).__name__}: {exc}"
    code = 1
print("RESULT " + json.dumps(out))
cuda_runtime.exit_now(code)
"""
"""The end of a child whose prelude opened ``try:`` with ``out = {}`` and ``code = 0``: the error (traceback on
stderr) or the figures as the ``RESULT`` line, then the virtual-GPU process's exit (`cuda_runtime.exit_now`)."""


def timed_h100_prelude(launch_s: float, imports: str = "") -> str:
    """A child's opening: a virtual H100 started with virtual time (dgx-h100's roofline through a `KernelTimer`,
    `launch_s` per launch) as ``vg``, ``timer`` and ``clock``; ``out = {}``, ``code = 0`` and the open ``try:``.
    `imports`: more import lines, run before the GPU starts."""
    return f"""
import json
from prism_plugin.device import cuda_runtime
cuda_runtime.preload()
import torch
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernel_models import kernel_model
from prism_plugin.cost.profiles import load_profile
from prism_plugin.device.device import VirtualGpu
from prism_plugin.device.kernel_timer import KernelTimer
{imports}
out = {{}}
code = 0
try:
    vg = VirtualGpu(gpu_spec("h100-sxm")).start()
    timer = KernelTimer(kernel_model("roofline", vg.gpu, load_profile("dgx-h100").kernels))
    clock = vg.start_time(timer.duration_s, {launch_s!r}, region_time=timer.region_duration_s)
"""


def program(prelude: str, body: str, epilogue: str) -> str:
    """`body` indented into the ``try:`` that `prelude` opens and `epilogue` closes."""
    return prelude + textwrap.indent(textwrap.dedent(body), "    ") + epilogue


def run_child(source: str, *, env: Mapping[str, str] | None = None, allow_error: bool = False) -> dict:
    """Run `source` with this interpreter; the last ``RESULT`` line's JSON. Fails the test with the child's output
    when it printed none, or when it reported an error and `allow_error` is false."""
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300,
                          env=None if env is None else dict(env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert allow_error or "error" not in result, proc.stderr[-4000:]
    return result
