"""``python -m validation.corpus list|run|table``: the validation corpus's one command.

    python -m validation.corpus list [--rows GLOB ...]          # rows, roles, sources, results' state
    python -m validation.corpus run [--rows GLOB ...] [--stale] [--kind throughput|functional] [--jobs N]
        [--rows-at-once K] [--write-results]
    python -m validation.corpus table [--write-results]         # the table from the results as they are

``run`` predicts each chosen row in turn (all of them by default; ``--stale``: only those whose result is stale or
missing), writing ``validation/corpus/results/<row>.json`` after each, so a stopped run keeps what it finished;
``--jobs N`` runs N of a throughput row's profiling runs at a time (``prism emulate --jobs``: the prediction is the
same, the wall time shorter on a machine with the cores); ``--rows-at-once K`` predicts K rows at a time, each in its
own process (most throughput rows are one profiling run: a whole re-run of the corpus on 2 cores wants
``--rows-at-once 2``; K x N processes work at once at most).
``--write-results`` writes ``validation/results/corpus.json`` and regenerates the results document
(``recipes/RESULTS.md``). Exit status 0, or 2 for bad input (a row file, an unknown row).
"""

from __future__ import annotations

import argparse
import os
import sys

from validation.corpus.fingerprint import ROOT, model_fingerprint
from validation.corpus.rows import Row, RowError, load_rows
from validation.corpus.runner import load_result, run_row, write_result
from validation.corpus.table import corpus_data, stale_because
from validation.results.render import corpus_markdown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m validation.corpus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "run", "table"):
        p = sub.add_parser(name)
        p.add_argument("--rows", nargs="+", metavar="GLOB", help="row names or shell globs (default: every row)")
        p.add_argument("--kind", choices=("throughput", "functional"), help="only rows of this kind")
        if name != "list":
            p.add_argument("--write-results", action="store_true",
                           help="write validation/results/corpus.json and regenerate recipes/RESULTS.md")
        if name == "run":
            p.add_argument("--stale", action="store_true", help="only rows whose result is stale or missing")
            p.add_argument("--timeout", type=float, default=3600.0, help="seconds per functional row's run")
            p.add_argument("--jobs", type=int, default=1,
                           help="a throughput row's profiling runs at a time (prism emulate --jobs; default 1)")
            p.add_argument("--rows-at-once", type=int, default=1, metavar="K",
                           help="rows predicted at a time, each in its own process (default 1)")
    return parser


def _predict(i: int, n: int, row: Row, timeout_s: float, jobs: int) -> str:
    """Predict `row` (the `i`-th of `n`) and write its result; the line that says so."""
    print(f"[{i}/{n}] {row.name}: {row.command}", file=sys.stderr, flush=True)
    result = run_row(row, timeout_s=timeout_s, jobs=jobs, progress=lambda text: print(text, file=sys.stderr))
    return f"[{i}/{n}] {row.name}: {result['outcome']} in {result['wall_s']} s -> {write_result(result)}"


def _run_rows(rows: list[Row], *, timeout_s: float, jobs: int, at_once: int) -> None:
    """Predict `rows`, `at_once` at a time (each in a process of its own when more than one), in their order."""
    if at_once == 1:
        for i, row in enumerate(rows, 1):
            print(_predict(i, len(rows), row, timeout_s, jobs), file=sys.stderr, flush=True)
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=at_once) as pool:
        futures = [pool.submit(_predict, i, len(rows), row, timeout_s, jobs) for i, row in enumerate(rows, 1)]
        for future in as_completed(futures):
            print(future.result(), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        rows = load_rows(args.rows)
    except (RowError, OSError) as exc:
        print(f"validation.corpus: {exc}", file=sys.stderr)
        return 2
    rows = [r for r in rows if args.kind in (None, r.kind)]
    fingerprint = model_fingerprint()
    if args.command == "list":
        for row in rows:
            result = load_result(row.name)
            because = None if result is None else stale_because(row, result, fingerprint)
            state = "never run" if result is None else f"{result['outcome']}{f', stale ({because})' if because else ''}"
            print(f"{row.name:70s} {row.kind:10s} {row.role:8s} {row.gpus:6d} GPUs  {state}")
        print(f"{len(rows)} rows; model fingerprint {fingerprint}")
        return 0
    if args.command == "run":
        os.chdir(ROOT)  # the rows' programs are repository paths
        results = {r.name: load_result(r.name) for r in rows} if args.stale else {}
        chosen = [r for r in rows if not args.stale or results[r.name] is None
                  or stale_because(r, results[r.name] or {}, fingerprint) is not None]
        if args.rows_at_once < 1 or args.jobs < 1:
            print("validation.corpus: --jobs and --rows-at-once take a count of 1 or more", file=sys.stderr)
            return 2
        _run_rows(chosen, timeout_s=args.timeout, jobs=args.jobs, at_once=args.rows_at_once)
    from datetime import UTC, datetime

    data = corpus_data(load_rows(), date=datetime.now(UTC).date().isoformat())
    print("\n".join(corpus_markdown(data)))
    if args.write_results:
        from validation.results import write_source

        print(f"wrote {write_source('corpus', data)} and recipes/RESULTS.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
