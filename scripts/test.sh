#!/usr/bin/env bash
# Runs the test suite in .venv (made on first use by scripts/env.sh).
#
#   bash scripts/test.sh                 # all tests; GPU-only tests skip without a GPU
#   bash scripts/test.sh -x -k forward   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
exec "$PY" -m pytest -q "$@"
