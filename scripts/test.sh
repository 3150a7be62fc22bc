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
heavy="not heavy and "
if [[ "${1:-}" == "--heavy" ]]; then
  shift
  heavy=""
fi
# the 25 slowest tests are listed at the end: where CI time goes (target: the whole run under 40 minutes)
.venv/bin/python -m pytest -q -p no:cacheprovider -W ignore::FutureWarning --durations=25 -m "${heavy}not wallclock" \
  tests integration_tests "$@"
# the wall-clock checks (real against emulated step times), alone in a step of their own: nothing else of the
# suite runs beside them; a model error fails them, and they skip only when the noise they measure is too wide
# (exit status 5: the arguments selected none of them)
.venv/bin/python -m pytest -q -p no:cacheprovider -W ignore::FutureWarning -rs -m "${heavy}wallclock" \
  tests integration_tests "$@" || { status=$?; [[ $status -eq 5 ]] || exit $status; }
