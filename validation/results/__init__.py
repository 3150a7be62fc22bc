"""The results document, generated from data: ``python -m validation.results [--check]``.

``recipes/RESULTS.md`` holds the latest figures of each producer and nothing else; its history is in git. Each
producer's figures live in one JSON file here (`SOURCES`): the run's date, the command that produces it, the host
conditions, what any fitting touched, and the rows. `validation.results.render` turns them into the document:

    .venv/bin/python -m validation.results            # rewrite recipes/RESULTS.md from validation/results/*.json
    .venv/bin/python -m validation.results --check    # exit 1 when recipes/RESULTS.md differs from the data

A producer writes its file with `write_source`, which regenerates the document:

- ``recipes.json``: ``benchmarks/recipes.py --write-results`` (a re-run recipe replaces that recipe's rows;
  `merge_recipe_run`);
- ``corpus.json``: ``python -m validation.corpus run|table --write-results`` (the validation corpus's table);
- ``megatron_functional.json``: ``python -m validation.megatron_functional.run --write-results``;
- ``virtual_vs_real.json``: the figures the integration tests ``test_kernel_table_cpu.py`` and
  ``test_virtual_time_vs_cpu*.py`` print (no producer writes it yet).
"""

from __future__ import annotations

import argparse
import copy
import json
import string
import sys
from pathlib import Path
from typing import Any

from prism_plugin.config.reference import write_generated
from validation.results.render import SOURCES, markdown

__all__ = ["COMMAND", "DATA_DIR", "DOC_PATH", "SOURCES", "document", "load_sources", "main", "markdown",
           "merge_recipe_run", "write_source"]

DATA_DIR = Path(__file__).resolve().parent
DOC_PATH = DATA_DIR.parents[1] / "recipes" / "RESULTS.md"
COMMAND = "python -m validation.results"


def load_sources(folder: Path = DATA_DIR) -> dict[str, dict[str, Any]]:
    """The data of every source that has a file in ``folder``."""
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in SOURCES
            if (folder / f"{name}.json").is_file()}


def document(folder: Path = DATA_DIR) -> str:
    """The results document the data in ``folder`` gives."""
    return markdown(load_sources(folder))


def write_source(name: str, data: dict[str, Any], *, folder: Path = DATA_DIR, doc: Path = DOC_PATH) -> Path:
    """Write one source's data file (``<folder>/<name>.json``) and regenerate the document ``doc`` from the folder."""
    if name not in SOURCES:
        raise ValueError(f"unknown results source {name!r}; the sources are {', '.join(SOURCES)}")
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    doc.write_text(document(folder))
    return path


def merge_recipe_run(data: dict[str, Any] | None, run: dict[str, Any], rows: list[dict[str, Any]],
                     fault_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``recipes.json`` after one `benchmarks/recipes.py` run: the rows (and fault rows) of every recipe the run
    produced replace that recipe's earlier rows, the run gets the next id, runs no row names any more are dropped."""
    empty: dict[str, Any] = {"source": "recipes", "command": "", "runs": [], "fitting": "", "rows": [],
                             "fault_rows": []}
    merged = copy.deepcopy(data) if data else empty
    ran = {r["recipe"] for r in rows} | {r["recipe"] for r in fault_rows}
    merged["rows"] = [r for r in merged["rows"] if r["recipe"] not in ran]
    merged["fault_rows"] = [r for r in merged.get("fault_rows", []) if r["recipe"] not in ran]
    kept = {r["run"] for r in merged["rows"] + merged["fault_rows"]}
    merged["runs"] = [r for r in merged["runs"] if r["id"] in kept]
    ids = [r["id"] for r in merged["runs"]]
    letters = string.ascii_uppercase
    last = max((letters.index(i) for i in ids if i in letters), default=-1)
    run_id = letters[last + 1] if last + 1 < len(letters) else next(
        (c for c in letters if c not in ids), f"R{len(ids) + 1}")
    merged["runs"].append({"id": run_id, **run})
    merged["rows"] += [{**r, "run": run_id} for r in rows]
    merged["fault_rows"] += [{**r, "run": run_id} for r in fault_rows]
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the document differs from what the data gives")
    ap.add_argument("--data", type=Path, default=DATA_DIR, help="the folder of the JSON files (default: this one)")
    ap.add_argument("--output", "--out", type=Path, default=DOC_PATH, help=f"the document (default {DOC_PATH})")
    args = ap.parse_args(argv)
    return write_generated(args.output, document(args.data), check=args.check, command=COMMAND)


if __name__ == "__main__":
    sys.exit(main())
