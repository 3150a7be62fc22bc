"""Published kernel measurements against the roofline kernel model: fit on the ``fit`` rows, held to the ``validate``.

``validation/kernels/h100.yaml`` lists published fused-attention and GEMM throughputs on Hopper with their sources and
roles; ``validation/kernels/h200_sweep.json`` is this project's own sweep on an H200 (``benchmarks/gpu_kernels.py``:
its GEMM rows are ``fit`` rows, its cuDNN attention rows ``validate``). `fit_attention` derives the profile's
attention figures (``kernels.attention``: ``compute_efficiency``, ``seq_half``, ``backward_factor``, ``full_factor``,
`prism_plugin.cost.kernels.KernelEfficiency.attention_factor`) and `fit_gemm` its GEMM figures (``kernels.gemm``:
``compute_efficiency``, ``float8_factor``, ``k_half``, `KernelEfficiency.gemm_factor`) from the fit rows alone;
`errors` compares every row's measured kernel time with the model's under a profile.

    python -m validation.kernels            # the fit, then every row's error (fit and validate apart), as JSON

Conventions: a row's TFLOP/s is its source's (attention: forward 4·b·h·s²·d, halved when causal, backward 2.5x
forward; GEMM 2·m·n·k), turned into the kernel's measured time; the model's kernel is what a virtual GPU records
for the same call (torch's FLOPs: a backward twice its forward, a causal kernel its unmasked pairs).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from prism_plugin.cost import load_profile
from prism_plugin.cost.gpu import gpu_spec
from prism_plugin.cost.kernels import KernelClass, KernelCost, RooflineModel, attention_wave_utilization
from prism_plugin.cost.profiles import override_profile

__all__ = ["DATA", "NEUTRAL_GEMM", "SWEEP", "Measurement", "errors", "fit_attention", "fit_gemm", "least_squares",
           "load", "model"]

DATA = Path(__file__).resolve().parent / "h100.yaml"
SWEEP = Path(__file__).resolve().parent / "h200_sweep.json"
_SEQ_HALF_GRID = range(0, 4001)
"""Key lengths tried for ``seq_half`` (the fit's one nonlinear figure)."""
_K_HALF_GRID = range(0, 2001, 4)
"""Inner dimensions tried for ``gemm.k_half`` (the GEMM fit's one nonlinear figure)."""
NEUTRAL_GEMM = {"gemm.compute_efficiency": 1.0, "gemm.float8_factor": 1.0, "gemm.k_half": 0.0}
"""The GEMM figures `fit_gemm`'s neutral model takes: the dtype's peak, wave quantization alone."""
_SWEEP_MIN_US = 25.0
"""Sweep GEMMs shorter than this are left out of the fit: launch- and latency-bound (512^3 and 1024^3 take 12-14 us
at 18-21% of peak), a regime the kernel floor and wave model stand for, not the efficiency."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One published kernel figure, and the kernel a virtual GPU would record for the same call."""

    kind: str
    """``attention`` or ``gemm``."""
    source: str
    role: str
    label: str
    cost: KernelCost
    measured_s: float


def _attention(row: Sequence[Any]) -> Measurement:
    source, direction, causal, b, h, s, d, tflops, role = row
    forward = 4 * b * h * s * s * d
    published = forward * (0.5 if causal else 1.0) * (2.5 if direction == "backward" else 1.0)
    ours = forward * (s + 1) // (2 * s) if causal else forward  # torch's count: the unmasked pairs
    ours *= 2 if direction == "backward" else 1
    io = 4 * b * s * h * d * 2 * (2 if direction == "backward" else 1)
    op = f"prism_te.fused_attn_{'bwd' if direction == 'backward' else 'fwd'}.default"
    shape = (b, h, s, s, d, 1) if causal else (b, h, s, s, d)
    cost = KernelCost(op=op, kernel_class=KernelClass.ATTENTION, flops=ours, bytes=io, dtype="bfloat16", shape=shape)
    label = f"{source} {direction} {'causal' if causal else 'full'} {b}x{s} h{h} d{d}"
    return Measurement("attention", source, role, label, cost, published / (tflops * 1e12))


def _gemm(row: Sequence[Any]) -> Measurement:
    source, dtype, m, n, k, tflops, role = row
    size = 1 if dtype.startswith("float8") else 2
    cost = KernelCost(op="aten._scaled_mm.default" if size == 1 else "aten.mm.default", kernel_class=KernelClass.GEMM,
                      flops=2 * m * n * k, bytes=size * (m * k + k * n) + 2 * m * n, dtype=dtype, shape=(m, n, k))
    return Measurement("gemm", source, role, f"{source} {dtype} {m}x{n}x{k}", cost, 2 * m * n * k / (tflops * 1e12))


def _sweep(path: Path) -> list[Measurement]:
    """The H200 sweep's rows: its GEMMs of at least `_SWEEP_MIN_US` (fit), its cuDNN attention (validate; the
    flash backend is FlashAttention-2, which TransformerEngine does not run on Hopper)."""
    measured = json.loads(path.read_text())["measured"]
    rows = []
    for r in measured["gemm"] + measured["fp8"]:
        if "error" not in r and r["us"] >= _SWEEP_MIN_US:
            tflops = 2 * r["m"] * r["n"] * r["k"] / (r["us"] * 1e-6) / 1e12
            row = _gemm(["h200_sweep", r["dtype"], r["m"], r["n"], r["k"], tflops, "fit"])
            rows.append(replace(row, label=f"{row.label} ({r['where']})", measured_s=r["us"] * 1e-6))
    for r in measured["attention"]:
        if "error" not in r and r["backend"] == "cudnn":
            for direction, key in (("forward", "fwd_us"), ("backward", "bwd_us")):
                flops = 4 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] * (0.5 if r["causal"] else 1.0)
                flops *= 2.5 if direction == "backward" else 1.0
                rows.append(_attention(["h200_sweep", direction, r["causal"], r["batch"], r["heads"], r["seq"],
                                        r["head_dim"], flops / (r[key] * 1e-6) / 1e12, "validate"]))
    return rows


def load(path: Path = DATA, sweep: Path | None = SWEEP) -> list[Measurement]:
    """The rows of `path` (published figures) and of `sweep` (this project's own, when given)."""
    data = yaml.safe_load(path.read_text())
    rows = [_attention(r) for r in data["attention"]] + [_gemm(r) for r in data["gemm"]]
    rows += _sweep(sweep) if sweep is not None else []
    for m in rows:
        if m.role not in ("fit", "validate") or m.source not in data["sources"]:
            raise ValueError(f"{path}: {m.label}: role must be fit or validate and the source one of `sources`")
    return rows


def model(profile: str = "dgx-h100", overrides: Mapping[str, Any] | None = None) -> RooflineModel:
    """The roofline model of a profile (``overrides``: dotted ``kernels`` figures replacing the profile's)."""
    loaded = override_profile(load_profile(profile), {f"kernels.{k}": v for k, v in (overrides or {}).items()})
    return RooflineModel(gpu_spec(loaded.gpu), loaded.kernels)


def fit_attention(rows: Sequence[Measurement], peak_flops_per_s: float, sms: int) -> dict[str, float]:
    """``kernels.attention`` figures from the fit rows: for each ``seq_half`` of `_SEQ_HALF_GRID`, the least-squares
    fit of ``log(efficiency) = log(compute_efficiency) + [backward] log(backward_factor) + [full] log(full_factor) +
    log(s / (s + seq_half))``, efficiency being of the peak times `attention_wave_utilization` on `sms` SMs; the
    ``seq_half`` with the smallest squared error wins (the first of equals)."""
    fit = [m for m in rows if m.kind == "attention" and m.role == "fit"]
    if not fit:
        raise ValueError("no attention row has role fit")
    points = [("bwd" in m.cost.op, len(m.cost.shape) == 5, m.cost.shape[3],
               math.log(m.cost.flops / (m.measured_s * peak_flops_per_s
                                        * attention_wave_utilization(m.cost.shape, "bwd" in m.cost.op, sms))))
              for m in fit]
    best: tuple[float, int, list[float]] | None = None
    for half in _SEQ_HALF_GRID:
        xs = [(1.0, float(bwd), float(full)) for bwd, full, _, _ in points]
        ys = [y - math.log(seq / (seq + half)) for _, _, seq, y in points]
        beta = least_squares(xs, ys)
        sse = sum((y - sum(b * x for b, x in zip(beta, row, strict=True))) ** 2 for row, y in zip(xs, ys, strict=True))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, half, beta)
    assert best is not None
    _, half, (e, b, f) = best
    return {"attention.compute_efficiency": round(math.exp(e), 4), "attention.seq_half": float(half),
            "attention.backward_factor": round(math.exp(b), 4), "attention.full_factor": round(math.exp(f), 4)}


def fit_gemm(rows: Sequence[Measurement], neutral: RooflineModel) -> dict[str, float]:
    """``kernels.gemm`` figures from the fit rows that `neutral` (the profile with ``gemm.compute_efficiency`` 1 and
    no shape or dtype factor) finds compute-bound: for each ``k_half`` of `_K_HALF_GRID`, the least-squares fit of
    ``log(efficiency) = log(compute_efficiency) + [FP8] log(float8_factor) + log(k / (k + k_half))``, efficiency
    being the measured FLOP/s over the neutral model's (the dtype's peak with wave quantization); the ``k_half``
    with the smallest squared error wins (the first of equals)."""
    points = []
    for m in rows:
        if m.kind != "gemm" or m.role != "fit":
            continue
        rate = neutral.achieved_flops_per_s(m.cost)
        if m.cost.flops / rate < neutral.duration_s(m.cost):  # memory- or floor-bound under the neutral model
            continue
        efficiency = m.cost.flops / m.measured_s / rate
        points.append((m.cost.dtype.startswith("float8"), m.cost.shape[-1], math.log(efficiency)))
    if not points:
        raise ValueError("no compute-bound GEMM row has role fit")
    best: tuple[float, int, list[float]] | None = None
    xs = [(1.0, float(fp8)) for fp8, _, _ in points]
    for half in _K_HALF_GRID:
        ys = [y - math.log(k / (k + half)) for _, k, y in points]
        beta = least_squares(xs, ys)
        sse = sum((y - beta[0] - beta[1] * x[1]) ** 2 for x, y in zip(xs, ys, strict=True))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, half, beta)
    assert best is not None
    _, half, (e, f) = best
    return {"gemm.compute_efficiency": round(math.exp(e), 4), "gemm.float8_factor": round(math.exp(f), 4),
            "gemm.k_half": float(half)}


def least_squares(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Ordinary least squares by the normal equations (a few unknowns, Gaussian elimination)."""
    n = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(n)] + [sum(x[i] * y for x, y in zip(xs, ys, strict=True))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                ratio = a[r][col] / a[col][col]
                a[r] = [v - ratio * p for v, p in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def errors(rows: Sequence[Measurement], kernel_model: RooflineModel) -> list[dict[str, Any]]:
    """Each row's modelled against measured kernel time: error = modelled / measured - 1 (> 0: the model is slower)."""
    return [{"kind": m.kind, "role": m.role, "row": m.label, "measured_us": round(m.measured_s * 1e6, 3),
             "modelled_us": round(kernel_model.duration_s(m.cost) * 1e6, 3),
             "error_pct": round(100 * (kernel_model.duration_s(m.cost) / m.measured_s - 1), 2)} for m in rows]


def _summary(table: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("attention", "gemm"):
        for role in ("fit", "validate"):
            errs = [abs(r["error_pct"]) for r in table if r["kind"] == kind and r["role"] == role]
            if errs:
                out[f"{kind}_{role}"] = {"rows": len(errs), "mean_abs_error_pct": round(statistics.fmean(errs), 2),
                                         "max_abs_error_pct": max(errs)}
    return out


def main() -> int:
    rows = load()
    roofline = model()
    fitted = fit_attention(rows, roofline.gpu.peak_flops_per_s["bfloat16"], roofline.gpu.multi_processor_count)
    gemm = fit_gemm(rows, model(overrides=NEUTRAL_GEMM))
    table = errors(rows, roofline)
    print(json.dumps({"fitted_attention": fitted, "fitted_gemm": gemm, "summary": _summary(table), "rows": table},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
