"""`prism plan`'s outputs from its document (``prism-plan/1``): the rich table, ``plan.md`` and the plot of each
candidate's memory against its modelled throughput. Every figure is modelled; the table says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_table", "rows", "write_markdown", "write_plot"]

COLUMNS = ("rank", "layout", "status", "tokens/s/GPU", "step ms", "MFU", "peak alloc GiB", "device total GiB",
           "guess #", "mark")


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.1f}"


def rows(document: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per tried candidate, ranked ones first (by rank), then the others in the guess's order."""
    results = sorted(document["results"], key=lambda r: (r["rank"] is None, r["rank"] or 0, r["guess_position"]))
    out = []
    for r in results:
        em, mem = r["emulation"] or {}, r["memory_run"] or {}
        memory = em or mem
        status = r["status"] + (" (cached)" if r["cached"] else "")
        tokens = em.get("tokens_per_s_per_gpu")
        mfu = em.get("mfu")
        out.append((str(r["rank"] or "-"), r["label"], status, "" if tokens is None else f"{tokens:,.0f}",
                    "" if em.get("step_ms") is None else f"{em['step_ms']:.1f}",
                    "" if mfu is None else f"{100 * mfu:.1f}%", _gib(memory.get("peak_allocated_bytes")),
                    _gib(memory.get("device_total_bytes")), str(r["guess_position"] + 1),
                    "*" if r["marks"] else ""))
    return out


def _title(document: dict[str, Any]) -> str:
    return (f"prism plan: {document['model']} on {document['gpus']} GPUs ({document['profile']}), global batch "
            f"{document['global_batch']}, seq {document['seq']}: {document['tried']} of {document['candidates']:,} "
            f"valid layouts tried ({document['combinations']:,} combinations); all figures modelled")


def _caption(document: dict[str, Any]) -> str:
    text = "memory: the emulation's largest class, else rank 0's memory run; guess #: place in the guessed order"
    if document["mark"]:
        where = document["marked_guess_positions"]
        shown = ", ".join(str(i + 1) for i in where[:5]) + ("..." if len(where) > 5 else "")
        text += (f"; * marks {document['mark']} (guess # {shown})" if where
                 else f"; no candidate matches --mark {document['mark']}")
    return text


def print_table(document: dict[str, Any], gpu_memory_bytes: int) -> None:
    """The table on stdout (a terminal's width, else wide enough for no row to wrap)."""
    table = Table(title=_title(document), caption=_caption(document) + f"; GPU memory {_gib(gpu_memory_bytes)} GiB")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("layout", "status") else "right", no_wrap=col == "layout")
    for row in rows(document):
        table.add_row(*row)
    Console(width=None if Console().is_terminal else 220).print(table)


def write_markdown(document: dict[str, Any], path: Path) -> None:
    """``plan.md``: the title, the table and its caption."""
    lines = [f"**{_title(document)}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(document)]
    lines += ["", _caption(document), ""]
    path.write_text("\n".join(lines))


def write_plot(document: dict[str, Any], gpu_memory_bytes: int, path: Path) -> None:
    """Each emulated candidate's device total (GiB) against its modelled tokens/s/GPU; the GPU's memory as a line;
    ranked candidates filled, the others hollow, marked ones labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in document["results"]:
        em = r["emulation"]
        if not em or em.get("tokens_per_s_per_gpu") is None:
            continue
        x, y = em["tokens_per_s_per_gpu"], em["device_total_bytes"] / 2**30
        ranked = r["rank"] is not None
        ax.scatter([x], [y], s=36, facecolors="tab:blue" if ranked else "none", edgecolors="tab:blue")
        if r["marks"] or r["rank"] == 1:
            ax.annotate(r["label"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.axhline(gpu_memory_bytes / 2**30, color="tab:red", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xlabel("tokens/s/GPU (modelled)")
    ax.set_ylabel("device total, GiB (modelled)")
    ax.set_title(f"{document['model']} on {document['gpus']} GPUs: memory against throughput", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
