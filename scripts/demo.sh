#!/usr/bin/env bash
# Runs examples/demo.py in .venv (made on first use by scripts/env.sh): the Pallas
# kernels against the plain-jnp path, forward and gradients, errors and timings.
#
#   bash scripts/demo.sh                                   # default shape for the backend
#   bash scripts/demo.sh --shape 1 512 384 8 32 --dtype bfloat16
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
exec "$PY" examples/demo.py "$@"
