#!/usr/bin/env bash
# Set up the environment if needed, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check prism_plugin tests integration_tests benchmarks validation
# type check of the pure core (topology, cost, graph, comm): [tool.mypy] in pyproject.toml
.venv/bin/mypy
.venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
# unit tests (pure and single-process), then the multi-process integration tests; the real-size jobs marked
# `heavy` (minutes each) only with --heavy as the first argument
select=(-m "not heavy")
if [[ "${1:-}" == "--heavy" ]]; then
  shift
  select=()
fi
# the 25 slowest tests are listed at the end: where CI time goes (target: the whole run under 40 minutes)
.venv/bin/python -m pytest -q -p no:cacheprovider -W ignore::FutureWarning --durations=25 "${select[@]}" tests integration_tests "$@"
