#!/usr/bin/env bash
# Runs the test suite in .venv (made on first use by scripts/env.sh).
#
#   bash scripts/test.sh                 # all tests; GPU-only tests skip without a GPU
#   bash scripts/test.sh -x -k forward   # extra arguments go to pytest
#   bash scripts/test.sh -n 0            # serially (or MSA_PALLAS_TEST_WORKERS=0)
#
# Without a GPU the tests run in parallel (pytest-xdist), one worker per core:
# `-n auto --dist loadfile`, each test module in one worker, so its tests share
# its compiles and its module-scoped fixtures (tests/conftest.py says more).
# MSA_PALLAS_TEST_WORKERS sets the number of workers (at most the number of
# cores; 0 = serial). With a GPU (nvidia-smi lists one) the default is serial:
# worker processes would each claim the GPU's memory and share its timings.
#
# The run is stopped after MSA_PALLAS_TEST_TIMEOUT seconds (default 2700; 0:
# no limit), exit status 124: after a worker crash xdist's replacement worker
# can hang, and a hung run should fail at once rather than at CI's own limit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

workers="${MSA_PALLAS_TEST_WORKERS:-}"
if [ -z "$workers" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        workers=0
    else
        workers=auto
    fi
fi
if [ "$workers" != auto ]; then
    cores="$(nproc 2>/dev/null || echo 1)"
    if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
        echo "test.sh: MSA_PALLAS_TEST_WORKERS=$workers: expected a number or 'auto'" >&2
        exit 2
    fi
    [ "$workers" -gt "$cores" ] && workers="$cores"
fi
limit="${MSA_PALLAS_TEST_TIMEOUT:-2700}"
if ! [[ "$limit" =~ ^[0-9]+$ ]]; then
    echo "test.sh: MSA_PALLAS_TEST_TIMEOUT=$limit: expected a number of seconds" >&2
    exit 2
fi
# On TERM pytest's xdist controller stops its workers; KILL a minute later.
exec timeout --kill-after=60 "$limit" "$PY" -m pytest -q -n "$workers" --dist loadfile "$@"
