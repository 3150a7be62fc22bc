"""Reports of a sweep (`prism_plugin.recipes.sweep`): its table (rich and Markdown) and three PNG plots.

Under the sweep's output folder: ``sweep.md`` (the table, the definitions, the plots), ``step_time.png`` (per
point: compute / exposed communication / bubble / other stacked, the step time on top), ``memory.png`` (the
rank's peak allocated, peak reserved and device total per point, the GPU's memory as a line) and ``mfu.png``.
Points are in the order run (world size within each layout); a failed point is a row with its error and a gap
in the plots. Every title names the recipe.

matplotlib is optional (the ``reports`` extra): without it `plot_sweep` returns no paths and the Markdown says so.
Non-goals: interactive plots, comparing sweeps with each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from prism_plugin.recipes.sweep import PointResult

__all__ = ["COLUMNS", "markdown_table", "plot_sweep", "rich_table", "short_error", "table_rows", "write_markdown"]

COLUMNS = ("point", "N", "dp", "micro x acc", "step ms", "tokens/s/GPU", "MFU", "compute ms", "exposed comm ms",
           "bubble ms", "other ms", "comm ms (modelled)", "peak alloc GiB", "peak reserved GiB", "device total GiB",
           "fits")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def short_error(text: str | None) -> str:
    """The first two sentences of an error ("CUDA out of memory. Tried to allocate 32.00 GiB.")."""
    parts = (text or "").split(". ")
    return ". ".join(parts[:2]).rstrip(".") + "." if len(parts) > 2 else (text or "")


def table_rows(results: Sequence[PointResult]) -> list[tuple[str, ...]]:
    """One row of `COLUMNS` per point (a failed point: its figures where its summary had them, and the error
    in the last column)."""
    rows = []
    for r in results:
        p, f = r.point, r.figures
        head = (p.name, str(p.world_size), str(p.dp), f"{p.micro_batch} x {p.accumulation}")
        if f is None:
            rows.append(head + ("-",) * (len(COLUMNS) - len(head) - 1) + (f"ERROR: {short_error(r.error)}",))
            continue
        fits = "yes" if f.fits else f"NO ({f.ooms} OOMs)"
        if r.error:
            fits = f"ERROR: {short_error(r.error)}"
        rows.append(head + (
            _ms(f.step_time_s), "-" if f.tokens_per_s_per_gpu is None else f"{f.tokens_per_s_per_gpu:,.0f}",
            "-" if f.mfu is None else f"{100 * f.mfu:.1f}%", _ms(f.compute_s), _ms(f.exposed_comm_s),
            _ms(f.bubble_s), _ms(f.other_s), _ms(f.modelled_comm_s), _gib(f.peak_allocated_bytes),
            _gib(f.peak_reserved_bytes), _gib(f.device_total_bytes), fits))
    return rows


def _title(doc: dict[str, Any]) -> str:
    spec = doc["spec"]
    batch = f"global batch {spec['global_batch']}" if spec["global_batch"] else "fixed per-replica batch"
    return (f"prism sweep {doc['recipe']} ({doc['emulation']}, rank {spec['rank']}, {spec['profile']}, {batch}, "
            f"seq {spec['seq_length']})")


def rich_table(doc: dict[str, Any], results: Sequence[PointResult]) -> Table:
    table = Table(title=_title(doc))
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("point", "fits") else "right")
    for row in table_rows(results):
        table.add_row(*row)
    gpu = next((r.figures.gpu for r in results if r.figures is not None), None)
    table.caption = (f"emulated time (virtual GPUs{': ' + gpu if gpu else ''}); MFU = kernel FLOPs per step / step / "
                     "bf16 peak; exposed comm = comm stream busy while no kernel runs; sweep.json has the definitions")
    return table


def markdown_table(results: Sequence[PointResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def write_markdown(doc: dict[str, Any], results: Sequence[PointResult], output: Path,
                   plots: Sequence[Path]) -> Path:
    """``output/sweep.md``: title, table, definitions, plots."""
    lines = [f"# {_title(doc)}", "", markdown_table(results), ""]
    lines += ["Definitions (emulated time, deterministic):", ""]
    lines += [f"- `{k}`: {v}" for k, v in doc["definitions"].items()]
    lines.append("")
    if plots:
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    else:
        lines.append("(plots skipped: install the `reports` extra for matplotlib)")
    path = Path(output) / "sweep.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_sweep(doc: dict[str, Any], results: Sequence[PointResult], output: Path) -> list[Path]:
    """``step_time.png``, ``memory.png``, ``mfu.png`` in `output` (empty when matplotlib is missing)."""
    plt = _pyplot()
    if plt is None or not results:
        return []
    output = Path(output)
    labels = [r.point.name for r in results]
    x = list(range(len(results)))
    figs = [r.figures for r in results]
    paths = [output / "step_time.png", output / "memory.png", output / "mfu.png"]
    title = doc["recipe"]

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(x) + 2), 4.5))
    bottom = [0.0] * len(x)
    for key, label, color in (("compute_s", "compute", "tab:blue"), ("exposed_comm_s", "exposed comm", "tab:red"),
                              ("bubble_s", "bubble", "tab:gray"), ("other_s", "other (host)", "tab:olive")):
        vals = [1e3 * (getattr(f, key) or 0.0) if f is not None else 0.0 for f in figs]
        ax.bar(x, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    steps = [1e3 * f.step_time_s if f is not None and f.step_time_s is not None else None for f in figs]
    ax.plot([i for i, s in zip(x, steps, strict=True) if s is not None], [s for s in steps if s is not None],
            "k_", markersize=20, label="step time (median)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("emulated ms per step")
    ax.set_title(f"{title}: step-time breakdown vs N")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(x) + 2), 4.5))
    width = 0.27
    for j, (key, label) in enumerate((("peak_allocated_bytes", "peak allocated"),
                                      ("peak_reserved_bytes", "peak reserved"),
                                      ("device_total_bytes", "device total"))):
        vals = [getattr(f, key) / 2**30 if f is not None else 0.0 for f in figs]
        ax.bar([i + (j - 1) * width for i in x], vals, width=width, label=label)
    capacity = next((f.gpu_memory_bytes for f in figs if f is not None), None)
    if capacity:
        ax.axhline(capacity / 2**30, color="k", linestyle="--", label="GPU memory")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GiB (rank's own device)")
    ax.set_title(f"{title}: memory vs N")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(x) + 2), 4.0))
    mfu = [100 * f.mfu if f is not None and f.mfu is not None else None for f in figs]
    ax.plot([i for i, m in zip(x, mfu, strict=True) if m is not None], [m for m in mfu if m is not None], "o-")
    ax.set_xticks(x, labels)
    ax.set_ylabel("MFU % (bf16 peak)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}: MFU vs N")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths
