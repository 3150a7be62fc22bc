"""`prism calibrate`: fit a hardware profile by timing local collectives, or from nccl-tests logs.

    prism calibrate --output local.yaml                       # gloo, 2 local processes
    prism calibrate --backend nccl --processes 8 --output node.yaml
    prism calibrate --from-nccl-tests logs/ --output cluster.yaml
    prism calibrate ... --json                             # the fit as JSON on stdout instead of the table

The measuring is `prism_plugin.runtime.calibrate` (its docstring states how ops are timed and the
limitations); the fit is `prism_plugin.cost.calibrate.fit_profile`, nccl-tests parsing
`prism_plugin.cost.nccl_tests`. Bad flags raise `ConfigError` before any process starts (the `prism` CLI
prints it and exits 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prism_plugin.config.errors import ConfigError
from prism_plugin.runtime.calibrate import BACKENDS, CALIBRATION_OPS, CalibrationPlan, calibrate_fit

__all__ = ["add_calibrate_parser", "fit_document"]


def _parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"``, ``"1GiB"``, or plain bytes; `ConfigError` for anything else."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise ConfigError(f"calibrate: size {text!r} (--sizes): write bytes or 4K / 1M / 64M") from None


def add_calibrate_parser(subparsers: Any) -> None:
    """Add ``prism calibrate`` to the `prism` command's subparsers (see the module doc)."""
    ops = ",".join(CALIBRATION_OPS)
    p = subparsers.add_parser("calibrate", help="fit a hardware profile: time local collectives or read nccl-tests")
    p.add_argument("--output", "--out", type=Path, required=True, help="write the fitted profile (YAML) here")
    p.add_argument("--backend", default="gloo", choices=BACKENDS, help="backend to time (default gloo)")
    p.add_argument("--processes", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 1K,64K,1M,16M (default 1K..64M x4)")
    p.add_argument("--ops", default=ops, help=f"ops to time, from {ops}")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per op and size (median kept)")
    p.add_argument("--compute-gap-us", type=float, default=0.0,
                   help="busy compute before each timed op, as in a training step (default 0: back to back)")
    p.add_argument("--statistic", default="median", choices=["median", "mean"],
                   help="median (typical op) or mean (what a step of many ops pays, tail included)")
    p.add_argument("--name", default=None, help="profile name (default local-calibrated / nccl-tests-DIR)")
    p.add_argument("--from-nccl-tests", type=Path, default=None, metavar="DIR",
                   help="fit nccl-tests logs (all_reduce_perf ...) in DIR instead of measuring")
    p.add_argument("--base", default=None,
                   help="with --from-nccl-tests: profile giving link rates and unmeasured figures "
                        "(default: from the GPU name in the logs)")
    # needed by the recipes (issue 6): like-for-like CPU step times need gloo's per-op rates
    p.add_argument("--per-op", action="store_true",
                   help="also fit one transfer multiplier per op (op_transfer_factors in the profile)")
    p.add_argument("--json", action="store_true",
                   help="print the fit (profile, residuals, unfitted fields) as JSON on stdout instead of the table")
    p.set_defaults(func=_cmd_calibrate)


def fit_document(fit: Any, out: Path) -> dict[str, Any]:
    """``prism calibrate --json``: the fitted profile (as its YAML reads back), where it was written, each op's
    residuals and the fields no measurement determined."""
    import yaml

    from prism_plugin.cost.profiles import profile_to_yaml

    return {"schema": "prism-calibrate/1", "profile": yaml.safe_load(profile_to_yaml(fit.profile)), "out": str(out),
            "measurements": len(fit.measurements),
            "residuals": [{"op": r.label, "kind": r.kind.value, "num_ranks": r.num_ranks, "num_nodes": r.num_nodes,
                           "sizes": r.count, "max_rel_error": r.max_rel_error, "median_rel_error": r.median_rel_error,
                           "worst_size_bytes": r.worst_size_bytes} for r in fit.residuals],
            "not_fitted": list(fit.not_fitted)}


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from prism_plugin.cost.nccl_tests import nccl_tests_fit

    console = Console(stderr=True)
    if args.from_nccl_tests is not None:
        fit = nccl_tests_fit(args.from_nccl_tests, base=args.base, name=args.name)
    else:
        if args.base is not None:
            raise ConfigError("calibrate: --base only applies with --from-nccl-tests")
        sizes = tuple(_parse_size(s) for s in args.sizes.split(",")) if args.sizes else None
        ops = []
        for name in filter(None, (o.strip() for o in args.ops.split(","))):
            if name not in CALIBRATION_OPS:
                raise ConfigError(f"calibrate: unknown op {name!r} in --ops; choose from {', '.join(CALIBRATION_OPS)}")
            ops.append(CALIBRATION_OPS[name])
        plan = CalibrationPlan(backend=args.backend, num_processes=args.processes, sizes_bytes=sizes,
                               ops=tuple(ops), repeats=args.repeats, compute_gap_us=args.compute_gap_us,
                               statistic=args.statistic)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as bar:
            rounds = plan.warmup + plan.repeats
            task = bar.add_task(f"starting {plan.num_processes} {plan.backend} processes", total=rounds)
            fit = calibrate_fit(plan, name=args.name or "local-calibrated", on_round=lambda done, total: bar.update(
                task, completed=done, description=f"round {done}/{total} ({len(plan.steps())} op x size each)"),
                per_op=args.per_op)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(fit.to_yaml(), encoding="utf-8")
    if args.json:
        import json

        print(json.dumps(fit_document(fit, args.output), indent=2))
        return 0
    table = Table(title=f"prism calibrate: {fit.profile.name} -> {args.output}")
    for col in ("op", "sizes", "max error", "median error", "worst at (B)"):
        table.add_column(col, justify="right")
    for r in fit.residuals:
        table.add_row(r.label, str(r.count), f"{100 * r.max_rel_error:.1f}%", f"{100 * r.median_rel_error:.1f}%",
                      str(r.worst_size_bytes))
    p = fit.profile
    table.caption = (
        f"intra {p.intra_node.bandwidth_gbytes_per_s:.4g} GB/s, {p.intra_node.latency_us:.3g} us/hop; "
        f"inter {p.inter_node.bandwidth_gbytes_per_s:.4g} GB/s, {p.inter_node.latency_us:.3g} us/hop; "
        f"bus_eff {p.bus_efficiency:.3g}, p2p_eff {p.p2p_efficiency:.3g}; overheads "
        f"{p.collective_overhead_us:.3g} / {p.p2p_overhead_us:.3g} us"
        + (f"; per-op transfer factors {dict(p.op_transfer_factors)}" if p.op_transfer_factors else "")
        + (f"; not fitted: {', '.join(fit.not_fitted)}" if fit.not_fitted else "")
    )
    Console().print(table)
    return 0
