#!/usr/bin/env bash
# The one script run on the GPU machine: environment, GPU tests, benchmark.
#
#   bash benchmarks/run_gpu.sh OUT_DIR
#   BENCH_ARGS="--shapes train,long --dtypes bf16" bash benchmarks/run_gpu.sh OUT_DIR
#
# Writes OUT_DIR/gpu_tests.log, OUT_DIR/bench.log and the benchmark's
# results.json, results.md and results.png; the layer benchmark's results
# under OUT_DIR/layer and its log in OUT_DIR/bench_layer.log. Everything also goes to stdout,
# and a compact summary (test summary line and the results table) comes last,
# since whoever reads the run may see only the end of its output.
#
# Environment: PYTHON (default python3), BENCH_ARGS (extra arguments of
# benchmarks/bench_attention.py, split on spaces), XLA_PYTHON_CLIENT_MEM_FRACTION
# (default 0.90 here, so that large XLA baselines get their chance).
# Exit status: 1 if the GPU tests failed, else the benchmark's status.

set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash benchmarks/run_gpu.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT_DIR=$(cd "$1" && pwd)

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
PYTHON=${PYTHON:-python3}
read -r -a BENCH_ARGV <<< "${BENCH_ARGS:-}"

section() { printf '\n===== %s =====\n' "$*"; }

section "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    || echo "nvidia-smi failed (exit $?)"
"$PYTHON" -c 'import sys, jax; print("python", sys.version.split()[0]); print("jax", jax.__version__, jax.devices())' \
    || echo "python/jax check failed (exit $?)"
echo "repo $PWD; out $OUT_DIR; XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"

section "GPU tests: $PYTHON -m pytest -q -m gpu tests -s"
"$PYTHON" -m pytest -q -m gpu tests -s 2>&1 | tee "$OUT_DIR/gpu_tests.log"
test_status=${PIPESTATUS[0]}

section "benchmark: $PYTHON benchmarks/bench_attention.py --out $OUT_DIR ${BENCH_ARGS:-}"
"$PYTHON" benchmarks/bench_attention.py --out "$OUT_DIR" ${BENCH_ARGV[@]+"${BENCH_ARGV[@]}"} \
    2>&1 | tee "$OUT_DIR/bench.log"
bench_status=${PIPESTATUS[0]}

section "layer benchmark: $PYTHON benchmarks/bench_layer.py --out $OUT_DIR/layer"
"$PYTHON" benchmarks/bench_layer.py --out "$OUT_DIR/layer" 2>&1 | tee "$OUT_DIR/bench_layer.log"
layer_status=${PIPESTATUS[0]}
(( bench_status == 0 )) && bench_status=$layer_status

# pytest exits 5 when no test was collected/selected: not a failure.
case $test_status in
    0) tests_failed=0; test_verdict="passed" ;;
    5) tests_failed=0; test_verdict="no gpu tests selected" ;;
    *) tests_failed=1; test_verdict="FAILED (pytest exit $test_status)" ;;
esac

section "summary"
echo "tests: $test_verdict"
# pytest's own last line, e.g. "3 failed, 40 passed, 2 skipped in 12.3s".
grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$OUT_DIR/gpu_tests.log" | tail -n 1
grep -E '^(FAILED|ERROR) ' "$OUT_DIR/gpu_tests.log" | head -n 15
echo "benchmark: exit $bench_status"
if [[ -s "$OUT_DIR/results.md" ]]; then
    cat "$OUT_DIR/results.md"
else
    echo "no results.md; last lines of bench.log:"
    tail -n 20 "$OUT_DIR/bench.log"
fi
tail -n 8 "$OUT_DIR/bench_layer.log"

if (( tests_failed )); then
    exit 1
fi
exit "$bench_status"
