"""Fit a `HardwareProfile` to measured collective times (DESIGN.md section 5, `prism calibrate`).

The measurements come from timing the local backend (`prism_plugin.runtime.calibrate`) or from nccl-tests
logs (`prism_plugin.cost.nccl_tests`). The forward model is `CostModel(profile).collective_us_placed`
itself, so what is fitted is exactly what the emulator will use.

Method. For a fixed algorithm choice (and a fixed branch of the model's `max` between intra- and
inter-node transfer) the modelled time is linear in the alpha-beta parameters
``theta = (collective_overhead_us, p2p_overhead_us, intra latency_us, us per byte of a collective,
us per byte of a send/recv, inter latency_us, inter us per byte)``. Each row of the design matrix is
the model's derivative at the current estimate (finite differences: exact inside one regime), rows
are weighted by 1/measured (we minimise relative error), and a non-negative least squares solve
(exact, by enumerating the active set: at most 5 unknowns) gives the next estimate; the regime is
re-evaluated until it stops changing. Two stages: stage 1 fits the intra-node parameters on
measurements whose group sits in one node; stage 2 fits the inter-node latency and bandwidth on
multi-node measurements with stage 1 held fixed (several starts; the best fit wins).

Identifiability and conventions (limitations):
- Only rate products are observable: bandwidth x efficiency. The profile's intra-node
  ``bandwidth_gbytes_per_s`` is the `link_rates` profile's (a datasheet figure) when given, else the
  faster of the fitted collective and send/recv rates (that one then gets efficiency 1). If a fitted
  rate beats the given link rate, the link rate is raised to it (noted in the description).
  ``inter_node.bandwidth_gbytes_per_s`` is fitted as inter-node collective rate / ``bus_efficiency``:
  one efficiency is shared by both tiers, as in the model.
- A parameter no measurement depends on (no send/recv measured, no multi-node data, an inter-node
  link that is never the bottleneck) is not fitted: it comes from `fallback` when given, else from a
  tie (p2p overhead = collective overhead, inter-node tier = intra-node tier, intra latency 0), and
  the description says which. A latency that cannot be separated from the overheads (e.g. only one
  hop count measured) is fixed the same way; if that is not enough the fit refuses.
- One efficiency and one overhead for every collective: a backend whose ops differ in more than hop
  count and traffic (gloo reduces on the CPU, all_gather only copies) leaves residuals; they are
  reported per op, never hidden. ``per_op_factors=True`` (``prism calibrate --per-op``) then fits one
  transfer multiplier per op on top of the shared fit (`fit_op_factors`).

Pure: stdlib + the cost layer (a small QR least squares, at most 5 unknowns: no numpy); no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost.model import CostModel, GroupPlacement
from prism_plugin.cost.profiles import HardwareProfile, LinkSpec, profile_to_yaml

__all__ = [
    "CalibrationFit",
    "Measurement",
    "OpResidual",
    "fit_op_factors",
    "fit_profile",
    "one_node_placement",
]

# Parameter names (internal): overheads and latencies in us, inverse rates in us per byte.
_OC, _OP, _AI, _UC, _UP, _AE, _UE = "oc", "op", "ai", "uc", "up", "ae", "ue"
_STAGE1 = (_OC, _OP, _AI, _UC, _UP)
_STAGE2 = (_AE, _UE)
_LABEL = {
    _OC: "collective_overhead_us",
    _OP: "p2p_overhead_us",
    _AI: "intra_node.latency_us",
    _UC: "intra-node collective rate (bandwidth x bus_efficiency)",
    _UP: "intra-node send/recv rate (bandwidth x p2p_efficiency)",
    _AE: "inter_node.latency_us",
    _UE: "inter_node.bandwidth_gbytes_per_s",
}
_RATE_PARAMS = (_UC, _UP, _UE)
# Order in which latency-like parameters are fixed when the data cannot separate them.
_FIX_ORDER = (_AI, _AE)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One measured op: the median time of `kind` on `size_bytes` over a group placed as `placement`.

    `size_bytes` follows the cost model's convention (all_gather: output total; reduce_scatter: input
    total; send: the message). Send/recv is ``kind=OpKind.SEND`` with a placement of 2 ranks (on 2
    nodes when the message crosses nodes). Example: 2 local gloo processes, 1 MiB all_reduce ->
    ``Measurement(kind=OpKind.ALL_REDUCE, size_bytes=2**20, placement=one_node_placement(2), time_us=850.0)``.
    """

    kind: OpKind
    size_bytes: int
    placement: GroupPlacement
    time_us: float
    """Median measured time, microseconds (> 0)."""
    samples_us: tuple[float, ...] = ()
    """The individual timings the median came from (for noise figures); may be empty."""
    source: str = ""
    """Where it came from (a log file, `gloo x2`), for messages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        if self.kind is OpKind.RECV:
            object.__setattr__(self, "kind", OpKind.SEND)
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) or self.size_bytes < 0:
            raise ConfigError(f"Measurement.size_bytes must be a non-negative int, got {self.size_bytes!r}")
        if not (isinstance(self.time_us, int | float) and math.isfinite(self.time_us) and self.time_us > 0):
            raise ConfigError(f"Measurement.time_us must be a finite positive number, got {self.time_us!r}")
        if self.placement.size < 2:
            raise ConfigError("Measurement.placement must have >= 2 ranks: a 1-rank group costs 0 in the model")
        if self.kind is OpKind.SEND and self.placement.size != 2:
            raise ConfigError("a send/recv Measurement needs a placement of exactly 2 ranks")


def one_node_placement(num_ranks: int) -> GroupPlacement:
    """The placement of `num_ranks` ranks that all sit on one node (local processes, one NVLink domain)."""
    return GroupPlacement(size=num_ranks, num_nodes=1, max_ranks_per_node=num_ranks, min_ranks_per_node=num_ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpResidual:
    """How well the fitted profile reproduces the measurements of one op kind (relative errors)."""

    kind: OpKind
    num_ranks: int
    """Group size of these measurements."""
    num_nodes: int
    """Nodes the group spans."""
    count: int
    """Number of measurements (sizes) in this group."""

    @property
    def label(self) -> str:
        """e.g. ``all_reduce 16 ranks/2 nodes``."""
        return f"{self.kind.value} {self.num_ranks} ranks/{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
    max_rel_error: float
    """max |model - measured| / measured."""
    median_rel_error: float
    worst_size_bytes: int
    """The size where the max was reached."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationFit:
    """A fitted profile, the measurements it was fitted to, the model's predictions and the residuals."""

    profile: HardwareProfile
    measurements: tuple[Measurement, ...]
    predicted_us: tuple[float, ...]
    """`CostModel(profile).collective_us_placed` for each measurement, same order."""
    residuals: tuple[OpResidual, ...]
    not_fitted: tuple[str, ...]
    """Profile fields that no measurement determined (filled from the fallback or a tie)."""

    def max_rel_error(self, kind: OpKind) -> float:
        """The worst relative error of `kind` over every group it was measured on."""
        errs = [r.max_rel_error for r in self.residuals if r.kind is OpKind(kind)]
        if not errs:
            raise ConfigError(f"{OpKind(kind).value} was not measured; measured: {[r.label for r in self.residuals]}")
        return max(errs)

    def to_yaml(self) -> str:
        """The profile as YAML (`profile_to_yaml`) under a comment block with every measurement and its
        modelled time; `load_profile(path)` reads it back (comments are ignored)."""
        lines = [
            f"# prism calibrate: profile {self.profile.name!r} fitted to {len(self.measurements)} measurements.",
            "# Residuals per op (|model - measured| / measured): max, median.",
        ]
        for r in self.residuals:
            lines.append(
                f"#   {r.label:<36} sizes={r.count:<3} max {100 * r.max_rel_error:6.2f}% "
                f"(at {r.worst_size_bytes} B)  median {100 * r.median_rel_error:6.2f}%"
            )
        if self.not_fitted:
            lines.append(f"# Not fitted (no measurement determines them): {', '.join(self.not_fitted)}")
        lines.append("# op              ranks nodes      size_bytes   measured_us      model_us   error  noise(IQR)")
        for m, p in zip(self.measurements, self.predicted_us, strict=True):
            noise = ""
            if len(m.samples_us) >= 2:
                q1, _, q3 = statistics.quantiles(m.samples_us, n=4)
                noise = f"  {100 * (q3 - q1) / m.time_us:6.1f}%"
            lines.append(
                f"# {m.kind.value:<15} {m.placement.size:>5} {m.placement.num_nodes:>5} {m.size_bytes:>15} "
                f"{m.time_us:>13.2f} {p:>13.2f} {100 * (p - m.time_us) / m.time_us:+6.1f}%{noise}"
            )
        return "\n".join(lines) + "\n" + profile_to_yaml(self.profile)


# -- the fit ------------------------------------------------------------------------------------------


def fit_profile(
    measurements: Iterable[Measurement],
    *,
    name: str,
    description: str,
    gpus_per_node: int,
    link_rates: HardwareProfile | None = None,
    fallback: HardwareProfile | None = None,
    per_op_factors: bool = False,
) -> CalibrationFit:
    """Least-squares fit (relative error) of a profile to `measurements`; see the module doc.

    `link_rates`: keep its intra-node bandwidth as the link rate and fit efficiencies against it
    (nccl-tests on a known cluster); None: the fitted rates are the link rates (local backend).
    `fallback`: where parameters no measurement determines come from; None: ties (module doc).
    `per_op_factors`: after the shared fit, give each measured op its own transfer multiplier
    (`HardwareProfile.op_transfer_factors`, see `fit_op_factors`), for backends whose ops differ in more than
    hops and traffic.
    The description gets the residuals and the list of unfitted fields appended.
    Example: ``fit_profile(ms, name="my-cluster", description="...", gpus_per_node=8).profile``.
    """
    ms = tuple(measurements)
    if not ms:
        raise ConfigError("fit_profile: no measurements; measure at least two sizes of two ops")
    crowded = [m for m in ms if m.placement.max_ranks_per_node > gpus_per_node]
    if crowded:
        raise ConfigError(
            f"fit_profile: a {crowded[0].kind.value} measurement puts {crowded[0].placement.max_ranks_per_node} "
            f"ranks on one node but gpus_per_node={gpus_per_node}; pass the measured nodes' size"
        )
    intra = [m for m in ms if m.placement.num_nodes == 1]
    inter = [m for m in ms if m.placement.num_nodes > 1]
    if not intra:
        raise ConfigError(
            "fit_profile: every measurement spans nodes; the intra-node tier needs single-node runs "
            "(e.g. all_reduce_perf and sendrecv_perf on one node)"
        )
    notes: list[str] = []
    # Stage 1: intra-node. The inter-node values do not matter for one-node groups.
    start = {_OC: 1.0, _OP: 1.0, _AI: 0.0, _UC: 1e-3, _UP: 1e-3, _AE: 0.0, _UE: 1e-3}
    theta, missing1 = _fit_stage(intra, start, _STAGE1, fallback=lambda p, th: _fallback(p, th, fallback), notes=notes)
    # Stage 2: inter-node, intra held fixed.
    if inter:
        best: tuple[float, dict[str, float], tuple[str, ...], list[str]] | None = None
        for ae0, ue0 in itertools.product((1.0, 10.0, 100.0), (theta[_UC], 10 * theta[_UC], 100 * theta[_UC])):
            cand_notes: list[str] = []
            cand, miss = _fit_stage(
                inter, {**theta, _AE: ae0, _UE: ue0}, _STAGE2,
                fallback=lambda p, th: _fallback(p, th, fallback), notes=cand_notes,
            )
            err = _sse(inter, cand)
            if best is None or err < best[0] * (1 - 1e-12):
                best = (err, cand, miss, cand_notes)
        assert best is not None
        theta, missing2 = best[1], best[2]
        notes.extend(best[3])
    else:
        missing2 = _STAGE2
        for p in _STAGE2:
            theta[p] = _fallback(p, theta, fallback)
    not_fitted = tuple(_LABEL[p] for p in (*missing1, *missing2))
    profile = _build_profile(theta, name=name, description=description, gpus_per_node=gpus_per_node,
                             link_rates=link_rates, fallback=fallback if _UE in missing2 else None, notes=notes)
    if per_op_factors:
        profile = dataclasses.replace(profile, op_transfer_factors=fit_op_factors(profile, ms))
    model = CostModel(profile)
    predicted = tuple(model.collective_us_placed(m.kind, m.size_bytes, m.placement) for m in ms)
    residuals = _residuals(ms, predicted)
    summary = "; ".join(f"{r.label} {100 * r.max_rel_error:.2f}%" for r in residuals)
    extra = f" Fit residuals (max relative error per op): {summary}."
    if not_fitted:
        source = f"profile {fallback.name!r}" if fallback is not None else "ties (see prism_plugin.cost.calibrate)"
        extra += f" Not fitted (no measurement determines them), from {source}: {', '.join(not_fitted)}."
    if notes:
        extra += " " + " ".join(notes)
    head = description.strip()
    head = head if not head or head.endswith(".") else head + "."
    profile = dataclasses.replace(profile, description=(head + extra).strip())
    return CalibrationFit(profile=profile, measurements=ms, predicted_us=predicted, residuals=residuals,
                          not_fitted=not_fitted)


def fit_op_factors(profile: HardwareProfile, measurements: Iterable[Measurement],
                   *, min_transfer_share: float = 0.5) -> tuple[tuple[str, float], ...]:
    """Per-op transfer multipliers that make `profile` (whose own factors are ignored) fit `measurements`.

    For each op kind: the median over its measurements of ``(measured - latency) / transfer`` (the model's
    split), using only measurements where the transfer is at least `min_transfer_share` of the modelled time
    (else the ratio is mostly noise on the latency); kinds with no such measurement get no factor. Factors
    within 2% of 1 are dropped. Example: gloo all_gather measured 3x the shared fit at large sizes -> 3.0.
    """
    base = CostModel(dataclasses.replace(profile, op_transfer_factors=()))
    ratios: dict[OpKind, list[float]] = {}
    for m in measurements:
        parts = base.breakdown(m.kind, m.size_bytes, m.placement)
        if parts.transfer_us <= 0 or parts.transfer_us < min_transfer_share * parts.total_us:
            continue
        ratios.setdefault(m.kind, []).append(max(m.time_us - parts.latency_us, 0.0) / parts.transfer_us)
    out = []
    for kind, rs in sorted(ratios.items(), key=lambda kv: kv[0].value):
        factor = statistics.median(rs)
        if factor > 0 and abs(factor - 1.0) > 0.02:
            out.append((kind.value, round(factor, 4)))
    return tuple(out)


def _fit_stage(
    ms: Sequence[Measurement],
    start: dict[str, float],
    free: tuple[str, ...],
    *,
    fallback: Callable[[str, dict[str, float]], float],
    notes: list[str],
) -> tuple[dict[str, float], tuple[str, ...]]:
    """Iterate linearise-and-solve from `start` over the `free` parameters; returns (theta, unfitted)."""
    t = [m.time_us for m in ms]
    w = [1.0 / x for x in t]
    theta = dict(start)
    best: tuple[float, dict[str, float], tuple[str, ...]] | None = None
    for _ in range(40):
        pred, jac, steps = _linearise(ms, theta, free)
        # Affine in theta inside this regime: time = pred + J (theta_new - theta_now), so J theta_new = rhs.
        rhs = [t[r] - pred[r] + sum(jac[j][r] * theta[p] for j, p in enumerate(free)) for r in range(len(ms))]
        # A parameter moving no prediction by more than rounding is not determined by these measurements.
        missing = [p for j, p in enumerate(free)
                   if max(abs(jac[j][r]) * steps[j] / abs(pred[r]) for r in range(len(ms))) < 1e-11]
        cols = [j for j, p in enumerate(free) if p not in missing]
        weighted = [[jac[j][r] * w[r] for r in range(len(ms))] for j in range(len(free))]
        fixed: list[str] = []
        new = dict(theta)
        while cols and _rank([weighted[c] for c in cols]) < len(cols):
            rank = _rank([weighted[c] for c in cols])
            for p in _FIX_ORDER:
                j = free.index(p) if p in free else -1
                if j in cols and _rank([weighted[c] for c in cols if c != j]) == rank:
                    cols.remove(j)
                    fixed.append(p)
                    new[p] = fallback(p, new)
                    rhs = [rhs[r] - jac[j][r] * new[p] for r in range(len(ms))]
                    break
            else:
                kinds = sorted({m.kind.value for m in ms})
                raise ConfigError(
                    f"calibration: the measurements ({', '.join(kinds)}) cannot separate "
                    f"{', '.join(_LABEL[free[c]] for c in cols)}; measure more sizes and ops with different "
                    "hop counts (e.g. all_reduce and all_gather, plus send/recv)"
                )
        if cols:
            sol = _nnls([weighted[c] for c in cols], [rhs[r] * w[r] for r in range(len(ms))])
            for c, v in zip(cols, sol, strict=True):
                new[free[c]] = v
        for p in _RATE_PARAMS:  # an inverse rate of 0 (infinite bandwidth) is not a profile
            if p in free and p not in missing and new[p] <= 0:
                missing.append(p)
        if _UC in missing and _UP in missing:
            raise ConfigError(
                "calibration: no measured time grows with message size; measure sizes spanning at least "
                "two orders of magnitude (e.g. 1 KiB .. 64 MiB)"
            )
        for p in sorted(missing, key=lambda q: q in _RATE_PARAMS):  # rate ties read fitted rates
            new[p] = fallback(p, new)
        err = _sse(ms, new)
        unfitted = tuple(p for p in free if p in missing or p in fixed)
        if best is None or err < best[0] * (1 - 1e-12):
            best = (err, new, unfitted)
        converged = all(abs(new[p] - theta[p]) <= 1e-10 * max(abs(theta[p]), 1e-12) for p in free)
        theta = new
        if converged:
            break
    assert best is not None
    if any(p in _FIX_ORDER for p in best[2]):
        notes.append(
            "Latency not separable from the overheads with these measurements: "
            + ", ".join(_LABEL[p] for p in best[2] if p in _FIX_ORDER) + " fixed, not fitted."
        )
    return best[1], best[2]


def _linearise(
    ms: Sequence[Measurement], theta: dict[str, float], free: tuple[str, ...]
) -> tuple[list[float], list[list[float]], list[float]]:
    """Modelled times at `theta`, their derivatives w.r.t. each `free` parameter (one list per parameter)
    and the steps used. Forward differences: the model is affine in theta inside one regime, so any small
    step is exact up to rounding, and a fixed point of the iteration reproduces noise-free data exactly."""
    base = _predict(ms, theta)
    jac, steps = [], []
    for p in free:
        h = max(abs(theta[p]) * 1e-4, 1e-3) if p not in _RATE_PARAMS else abs(theta[p]) * 1e-4
        moved = _predict(ms, {**theta, p: theta[p] + h})
        jac.append([(a - b) / h for a, b in zip(moved, base, strict=True)])
        steps.append(h)
    return base, jac, steps


def _predict(ms: Sequence[Measurement], theta: dict[str, float]) -> list[float]:
    model = CostModel(_raw_profile(theta))
    return [model.collective_us_placed(m.kind, m.size_bytes, m.placement) for m in ms]


def _sse(ms: Sequence[Measurement], theta: dict[str, float]) -> float:
    return math.fsum(((p - m.time_us) / m.time_us) ** 2 for p, m in zip(_predict(ms, theta), ms, strict=True))


def _raw_profile(theta: dict[str, float], gpus_per_node: int = 1) -> HardwareProfile:
    """A profile with the rates of `theta` (link rate = the faster intra rate; effs <= 1)."""
    rc, rp, re = 1e-3 / theta[_UC], 1e-3 / theta[_UP], 1e-3 / theta[_UE]  # GB/s
    link = max(rc, rp)
    bus, p2p = rc / link, rp / link
    return HardwareProfile(
        name="calibration-fit", description="", gpus_per_node=gpus_per_node,
        intra_node=LinkSpec(bandwidth_gbytes_per_s=link, latency_us=max(theta[_AI], 0.0)),
        # link * (re / rc) == re / bus, written so that tied rates (one loopback) give exactly `link`.
        inter_node=LinkSpec(bandwidth_gbytes_per_s=link * (re / rc), latency_us=max(theta[_AE], 0.0)),
        bus_efficiency=min(bus, 1.0), p2p_efficiency=min(p2p, 1.0),
        collective_overhead_us=max(theta[_OC], 0.0), p2p_overhead_us=max(theta[_OP], 0.0),
    )


def _build_profile(
    theta: dict[str, float],
    *,
    name: str,
    description: str,
    gpus_per_node: int,
    link_rates: HardwareProfile | None,
    fallback: HardwareProfile | None,
    notes: list[str],
) -> HardwareProfile:
    rc, rp = 1e-3 / theta[_UC], 1e-3 / theta[_UP]  # GB/s
    link = max(rc, rp)
    if link_rates is not None:
        given = link_rates.intra_node.bandwidth_gbytes_per_s
        if link > given * (1 + 1e-9):
            notes.append(
                f"The fitted intra-node rate {link:.4g} GB/s beats the link rate {given:g} GB/s of "
                f"{link_rates.name!r}: link rate raised to it."
            )
        else:
            link = given
    bus, p2p = min(rc / link, 1.0), min(rp / link, 1.0)
    if fallback is not None:  # inter-node rate not measured: keep the fallback's link rate
        inter_bw = fallback.inter_node.bandwidth_gbytes_per_s
    else:
        re = 1e-3 / theta[_UE]
        # = re / bus, written so that tied rates (one loopback: theta[_UE] == theta[_UC]) give exactly `link`
        inter_bw = link * (re / rc) if rc <= link else re
    return HardwareProfile(
        name=name, description=description, gpus_per_node=gpus_per_node,
        intra_node=LinkSpec(bandwidth_gbytes_per_s=link, latency_us=theta[_AI]),
        inter_node=LinkSpec(bandwidth_gbytes_per_s=inter_bw, latency_us=theta[_AE]),
        bus_efficiency=bus, p2p_efficiency=p2p,
        collective_overhead_us=theta[_OC], p2p_overhead_us=theta[_OP],
    )


def _fallback(p: str, theta: dict[str, float], fallback: HardwareProfile | None) -> float:
    """The value of an unfitted parameter: from `fallback`'s figures, else a tie (module doc)."""
    if fallback is not None:
        f = fallback
        return {
            _OC: f.collective_overhead_us,
            _OP: f.p2p_overhead_us,
            _AI: f.intra_node.latency_us,
            _AE: f.inter_node.latency_us,
            # Rates keep the fallback's efficiency ratios relative to what was fitted.
            _UC: theta[_UP] * f.p2p_efficiency / f.bus_efficiency,
            _UP: theta[_UC] * f.bus_efficiency / f.p2p_efficiency,
            _UE: theta[_UC] * f.intra_node.bandwidth_gbytes_per_s / f.inter_node.bandwidth_gbytes_per_s,
        }[p]
    return {
        _OC: theta[_OP],
        _OP: theta[_OC],
        _AI: 0.0,
        _AE: theta[_AI],
        _UC: theta[_UP],
        _UP: theta[_UC],
        _UE: theta[_UC],
    }[p]


# -- small dense linear algebra (columns of a tall matrix; at most 5 of them) -------------------------


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def _qr(cols: Sequence[Sequence[float]]) -> tuple[list[list[float]], list[list[float]]] | None:
    """Thin QR of the matrix with columns `cols` by modified Gram-Schmidt, orthogonalised twice (accurate to
    rounding for a handful of columns); None when a column is (numerically) dependent on the previous ones."""
    q: list[list[float]] = []
    r = [[0.0] * len(cols) for _ in cols]
    for j, col in enumerate(cols):
        v = list(col)
        norm0 = math.sqrt(_dot(v, v))
        for _ in range(2):
            for i, qi in enumerate(q):
                c = _dot(qi, v)
                r[i][j] += c
                v = [a - c * b for a, b in zip(v, qi, strict=True)]
        norm = math.sqrt(_dot(v, v))
        if norm0 == 0 or norm <= 1e-9 * norm0:
            return None
        r[j][j] = norm
        q.append([a / norm for a in v])
    return q, r


def _rank(cols: Sequence[Sequence[float]]) -> int:
    """Numerical rank (columns normalised first; relative tolerance 1e-9)."""
    kept: list[Sequence[float]] = []
    for col in cols:
        if _qr([*kept, col]) is not None:
            kept.append(col)
    return len(kept)


def _lstsq(cols: Sequence[Sequence[float]], b: Sequence[float]) -> list[float] | None:
    """argmin ||A x - b|| for A with columns `cols` (full column rank), by QR; None if rank-deficient."""
    qr = _qr(cols)
    if qr is None:
        return None
    q, r = qr
    y = [_dot(qi, b) for qi in q]
    x = [0.0] * len(cols)
    for i in reversed(range(len(cols))):
        x[i] = (y[i] - math.fsum(r[i][k] * x[k] for k in range(i + 1, len(cols)))) / r[i][i]
    return x


def _nnls(cols: Sequence[Sequence[float]], b: Sequence[float]) -> list[float]:
    """argmin ||A x - b|| subject to x >= 0, exactly, by trying every active set (A has <= 5 columns).
    Columns are scaled to unit norm first (overheads in us and inverse rates in us/byte differ by 1e6)."""
    n = len(cols)
    scale = [math.sqrt(_dot(c, c)) or 1.0 for c in cols]
    unit = [[v / s for v in c] for c, s in zip(cols, scale, strict=True)]
    best_x, best_err = [0.0] * n, _dot(b, b)
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            sol = _lstsq([unit[i] for i in subset], b)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * n
            for i, v in zip(subset, sol, strict=True):
                x[i] = v
            fitted = [math.fsum(x[i] * unit[i][r] for i in subset) for r in range(len(b))]
            err = math.fsum((f - y) ** 2 for f, y in zip(fitted, b, strict=True))
            if err < best_err:
                best_x, best_err = x, err
    return [v / s for v, s in zip(best_x, scale, strict=True)]


def _residuals(ms: Sequence[Measurement], predicted: Sequence[float]) -> tuple[OpResidual, ...]:
    groups: dict[tuple[OpKind, int, int], list[tuple[float, int]]] = {}
    for m, p in zip(ms, predicted, strict=True):
        key = (m.kind, m.placement.size, m.placement.num_nodes)
        groups.setdefault(key, []).append((abs(p - m.time_us) / m.time_us, m.size_bytes))
    out = []
    for (kind, ranks, nodes), errs in sorted(groups.items(), key=lambda kv: (list(OpKind).index(kv[0][0]), kv[0][1:])):
        worst = max(errs)
        out.append(OpResidual(kind=kind, num_ranks=ranks, num_nodes=nodes, count=len(errs), max_rel_error=worst[0],
                              median_rel_error=statistics.median(e for e, _ in errs), worst_size_bytes=worst[1]))
    return tuple(out)
