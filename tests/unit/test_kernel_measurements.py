"""The roofline kernel model against Hopper kernel measurements (validation/kernels: h100.yaml, h200_sweep.json).

The dgx-h100 and dgx-h200 profiles' attention and GEMM figures are exactly the fit of the `fit` rows; the model's
kernel times hold the `validate` rows within bounds taken from how far measured figures of the same kernel differ;
and a broken model (GEMM or attention efficiency halved, no GEMM shape factor) fails those bounds."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from prism_plugin.cost import load_profile
from validation.kernels import NEUTRAL_GEMM, errors, fit_attention, fit_gemm, load, model

ATTENTION_MEAN, ATTENTION_MAX = 10.0, 25.0
"""Validate rows of fused attention: cuDNN's own figures for one shape moved by up to 12.4% between releases
(8k-key causal forward: 572.9 TFLOP/s in the 9.1-era file the fit uses, 644 in cuDNN 9.19), and the fit's own
residual reaches 14.5% (512 keys); a model error past 10% on average is not release drift. The worst rows are the
few-wave grids of this project's H200 sweep (12 heads of 2,048 causal keys, 192 thread blocks on 132 SMs: -24.6%
with wave quantization, -43% without), a regime no fit row covers: 25% on a row."""
GEMM_SHAPE_MEAN, GEMM_SHAPE_MAX = 6.0, 20.0
"""Validate rows of GEMMs, each source's rows over that source's median ratio (the shape model apart from the clock
regime): one kernel's figures differ by up to 11% between libraries on one GPU (DeepGEMM's run: 0.96-1.11x of
cuBLAS), and 2048^3 (27 us) is launch- and latency-bound, a regime the fit leaves out (-19.5%)."""
GEMM_LEVEL = (1.0, 1.33)
"""The median ratio of modelled to measured time over the GEMM validate rows: the published figures are short
benchmarks at the 1,980 MHz boost clock, the fit rows a sustained load the 700 W limit holds at 1,380-1,500 MHz;
one 8192^3 BF16 product on an H200 here ran at 788 TFLOP/s in a short burst (KINDS.md) and 657 over 45 s, 1.20x,
and sources differ by 1.11x: the model is slower than those figures by at most 1.20 x 1.11, and never faster."""


def _bounds(table: list[dict[str, Any]], kind: str) -> tuple[float, float]:
    errs = [abs(r["error_pct"]) for r in table if r["kind"] == kind and r["role"] == "validate"]
    return statistics.fmean(errs), max(errs)


def _gemm_bounds(table: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(median modelled / measured ratio, mean and max |error| % of each row against its source's median ratio)."""
    rows = [r for r in table if r["kind"] == "gemm" and r["role"] == "validate"]
    ratios: dict[str, list[float]] = {}
    for r in rows:
        ratios.setdefault(r["row"].split()[0], []).append(1 + r["error_pct"] / 100)
    shape = [abs(100 * (1 + r["error_pct"] / 100) / statistics.median(ratios[r["row"].split()[0]]) - 100) for r in rows]
    return statistics.median(1 + r["error_pct"] / 100 for r in rows), statistics.fmean(shape), max(shape)


def _gemm_holds(table: list[dict[str, Any]]) -> bool:
    level, mean, worst = _gemm_bounds(table)
    return GEMM_LEVEL[0] <= level <= GEMM_LEVEL[1] and mean <= GEMM_SHAPE_MEAN and worst <= GEMM_SHAPE_MAX


@pytest.mark.parametrize("profile", ["dgx-h100", "dgx-h200"])
def test_the_profiles_attention_and_gemm_figures_are_the_fit_of_the_fit_rows(profile: str) -> None:
    rows = load()
    gpu = model(profile).gpu
    fitted = {**fit_attention(rows, gpu.peak_flops_per_s["bfloat16"], gpu.multi_processor_count),
              **fit_gemm(rows, model(profile, NEUTRAL_GEMM))}
    given = dict(load_profile(profile).kernels.given)
    assert {key: given[key] for key in fitted} == fitted


def test_the_gemm_fit_reads_the_h200_sweep_and_its_shape_factors() -> None:
    rows = load()
    fit = [r for r in rows if r.kind == "gemm" and r.role == "fit"]
    assert len(fit) >= 300 and {r.source for r in fit} == {"h200_sweep"}
    assert {r.cost.dtype for r in fit} == {"bfloat16", "float8_e4m3fn"}
    fitted = fit_gemm(rows, model(overrides=NEUTRAL_GEMM))
    assert fitted["gemm.float8_factor"] < 1 and fitted["gemm.k_half"] > 0


def test_fitting_never_reads_a_validate_row() -> None:
    rows = load()
    gpu = model().gpu
    peak, sms = gpu.peak_flops_per_s["bfloat16"], gpu.multi_processor_count
    moved = [r if r.role == "fit" else type(r)(r.kind, r.source, r.role, r.label, r.cost, r.measured_s * 3)
             for r in rows]
    assert fit_attention(moved, peak, sms) == fit_attention(rows, peak, sms)
    neutral = model(overrides=NEUTRAL_GEMM)
    assert fit_gemm(moved, neutral) == fit_gemm(rows, neutral)


@pytest.mark.parametrize("profile", ["dgx-h100", "dgx-h200"])
def test_the_model_holds_the_validate_rows(profile: str) -> None:
    table = errors(load(), model(profile))
    mean, worst = _bounds(table, "attention")
    assert mean <= ATTENTION_MEAN and worst <= ATTENTION_MAX, (mean, worst)
    assert _gemm_holds(table), _gemm_bounds(table)


@pytest.mark.parametrize(("key", "factor"), [("gemm.compute_efficiency", 0.5), ("gemm.compute_efficiency", 1.33),
                                             ("gemm.k_half", 0.0), ("gemm.float8_factor", 1.15)])
def test_a_broken_gemm_model_fails_the_bounds(key: str, factor: float) -> None:
    given = dict(load_profile("dgx-h100").kernels.given)
    assert not _gemm_holds(errors(load(), model(overrides={key: given[key] * factor})))


def test_a_halved_attention_efficiency_fails_the_bounds() -> None:
    given = dict(load_profile("dgx-h100").kernels.given)
    table = errors(load(), model(overrides={"attention.compute_efficiency": given["attention.compute_efficiency"] / 2}))
    assert _bounds(table, "attention")[1] > ATTENTION_MAX
