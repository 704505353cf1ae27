#!/usr/bin/env bash
# The one script run on the GPU machine: environment, GPU tests, benchmark.
#
#   bash benchmarks/run_gpu.sh OUT_DIR
#   BENCH_ARGS="--shapes train,long --dtypes bf16" bash benchmarks/run_gpu.sh OUT_DIR
#   COMPARE_WITH=old_run/results.json bash benchmarks/run_gpu.sh OUT_DIR
#
# Writes OUT_DIR/gpu_tests.log, OUT_DIR/bench.log and the op benchmark's
# (`python -m benchmarks op`) results.json, results.md and results.png; the layer
# benchmark's results under OUT_DIR/layer and its log in OUT_DIR/bench_layer.log;
# with MODEL_BENCH=1 the model benchmark's under OUT_DIR/model (OUT_DIR/bench_model.log).
# Both benchmarks continue the results.json they find in their folder (same commit,
# device and settings): with BENCH_ARGS="--budget SECONDS" a long table is measured
# over several calls with the same OUT_DIR, each stopping in time (exit status 4
# while cells are left). Everything also goes to stdout,
# and a compact summary (test summary line, the results table, the comparison
# with an earlier run) comes last, since whoever reads the run may see only the
# end of its output.
#
# The alternatives (cuEquivariance, tokamax) are not in the GPU image: when
# $WHEEL_DIR (default .whl, filled by benchmarks/fetch_wheels.sh and carried
# along) holds wheels, they are installed with pip --no-index --no-deps into
# $BENCH_SITE (default $TMPDIR/msa_pallas_bench_site), which is put first on
# PYTHONPATH for the alternatives check and the two benchmarks only (not for the
# tests). If that fails, the run goes on and their cells read `skipped`.
# `python -m benchmarks check` then checks every implementation's forward
# and gradients against a float32 reference on small shapes (log in
# OUT_DIR/alternatives_check.log; its verdict is in the summary, it does not
# change the exit status).
#
# The tests' wheels (WHEEL_DIR/test: the Haiku drop-in's dependencies and
# pytest-xdist; WHEEL_DIR/alphafold: AlphaFold2's model for the patch's tests;
# both from fetch_wheels.sh) are installed into $TMPDIR/msa_pallas_test_site for
# the tests only. TEST_WORKERS=N (default 0: serial) runs the GPU tests in N
# pytest-xdist processes, each allocating GPU memory as it needs it
# (XLA_PYTHON_CLIENT_PREALLOCATE=false for the tests). The 269 gpu-marked tests
# take about 12 minutes with 8 workers on an H200 (2026-12-04: tests/kernels
# 403 s, the rest 295 s; 16 workers were no faster), so a machine lent ten
# minutes at a time runs them in two calls, e.g. TEST_PATHS=tests/kernels and
# TEST_ARGS=--ignore=tests/kernels (TEST_PATHS: what pytest collects, default
# tests). The workers share the GPU's memory: a test that needs several GiB can
# fail with RESOURCE_EXHAUSTED among them and pass alone, so the tests that fail out
# of memory run again, alone (OUT_DIR/gpu_tests_alone.log): the GPU tests pass when
# those pass alone and nothing else failed (docs/development.md).
# TEST_TIMEOUT=SECONDS stops the tests after that long as Ctrl-C would (SIGINT;
# exit status 124): pytest still prints the summary (-rA: every test so far, passed,
# skipped or failed), so a run cut short names what ran and what did not.
#
# With COMPARE_WITH set to an earlier run's results.json, `python -m benchmarks compare`
# lists the cells of msa_pallas whose median time changed by more than 5%
# against it (COMPARE_ARGS: more arguments, e.g. "--threshold 0.10"); its output
# is in OUT_DIR/compare.log and in the summary.
#
# Environment: PYTHON (default python3), TEST_WORKERS, TEST_TIMEOUT, TEST_PATHS, TEST_ARGS (extra pytest arguments,
# split on spaces, e.g. "-x tests/kernels/triton/test_gpu.py"; TESTS=0 skips the tests), BENCH (0 skips
# the op benchmark and the comparison, e.g. to run the tests and the layer benchmark
# in a call of their own), LAYER_BENCH (0 skips the
# layer benchmark), BENCH_ARGS (extra arguments of
# `python -m benchmarks op`, split on spaces), LAYER_ARGS (of
# `python -m benchmarks layer`), MODEL_BENCH (1 runs `python -m benchmarks model`,
# AlphaFold2's Evoformer iteration, into OUT_DIR/model with WHEEL_DIR/alphafold's
# packages; default 0), MODEL_ARGS (its arguments), XLA_PYTHON_CLIENT_MEM_FRACTION
# (default 0.90 here, so that large XLA baselines get their chance), WHEEL_DIR,
# BENCH_SITE, CHECK_ALTERNATIVES (default 1; 0 skips the check), CHECK_ARGS
# (arguments of `python -m benchmarks check`, default
# "--shapes 2x3x37x2x8,1x4x128x4x32 --dtypes bf16,f32"), COMPARE_WITH, COMPARE_ARGS.
# Exit status: 1 if the GPU tests failed, else the benchmark's status when it
# failed (4: stopped at its --budget with cells left; the same command continues),
# else 3 when the comparison found a regression, else 0.

set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/script_prelude.sh" || exit 2
script_prelude run_gpu.sh "$@"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
read -r -a BENCH_ARGV <<< "${BENCH_ARGS:-}"
WHEEL_DIR=${WHEEL_DIR:-.whl}
SCRATCH=${TMPDIR:-/tmp}
BENCH_SITE=${BENCH_SITE:-$SCRATCH/msa_pallas_bench_site}
read -r -a LAYER_ARGV <<< "${LAYER_ARGS:-}"
read -r -a MODEL_ARGV <<< "${MODEL_ARGS:-}"
read -r -a COMPARE_ARGV <<< "${COMPARE_ARGS:-}"
CHECK_ALTERNATIVES=${CHECK_ALTERNATIVES:-1}
read -r -a CHECK_ARGV <<< "${CHECK_ARGS:---shapes 2x3x37x2x8,1x4x128x4x32 --dtypes bf16,f32}"

section() { printf '\n===== %s =====\n' "$*"; }

section "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    || echo "nvidia-smi failed (exit $?)"
"$PYTHON" -c 'import sys, jax; print("python", sys.version.split()[0]); print("jax", jax.__version__, jax.devices())' \
    || echo "python/jax check failed (exit $?)"
echo "repo $PWD; out $OUT_DIR; XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"

section "GPU tests: $PYTHON -m pytest -q -m gpu ${TEST_PATHS:-tests} -s --durations=15 -rA (TEST_WORKERS=${TEST_WORKERS:-0}) ${TEST_ARGS:-}"
read -r -a TEST_ARGV <<< "${TEST_ARGS:-}"
read -r -a TEST_PATHV <<< "${TEST_PATHS:-tests}"
# The tests' own dependencies (WHEEL_DIR/test, WHEEL_DIR/alphafold), for the tests and the
# model benchmark only: sets TEST_PYTHONPATH.
install_test_wheels() {
    [[ -n ${TEST_PYTHONPATH:-} ]] && return
    TEST_PYTHONPATH=$PYTHONPATH
    local wheel test_wheels=()
    for wheel in "$WHEEL_DIR"/test/*.whl "$WHEEL_DIR"/alphafold/*.whl; do
        [[ -e $wheel ]] && test_wheels+=("$wheel")
    done
    if (( ${#test_wheels[@]} )) && "$PYTHON" -m pip install -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$SCRATCH/msa_pallas_test_site" \
            "${test_wheels[@]}"; then
        TEST_PYTHONPATH=$SCRATCH/msa_pallas_test_site:$PYTHONPATH
    fi
}

if [[ ${TESTS:-1} != 0 ]]; then
    install_test_wheels
    workers=()
    test_env=()
    if [[ ${TEST_WORKERS:-0} != 0 ]]; then
        workers=(-n "$TEST_WORKERS")
        test_env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
    fi
    limit=()
    if [[ -n ${TEST_TIMEOUT:-} ]]; then
        limit=(timeout -s INT -k 60 "$TEST_TIMEOUT")
    fi
    ${limit[@]+"${limit[@]}"} env PYTHONPATH="$TEST_PYTHONPATH" ${test_env[@]+"${test_env[@]}"} \
        "$PYTHON" -m pytest -q -m gpu "${TEST_PATHV[@]}" -s -p no:cacheprovider --durations=15 -rA \
        ${workers[@]+"${workers[@]}"} ${TEST_ARGV[@]+"${TEST_ARGV[@]}"} 2>&1 \
        | tee "$OUT_DIR/gpu_tests.log"
    test_status=${PIPESTATUS[0]}
    # The workers share the GPU's memory: the tests that failed out of memory among them
    # run again, one process alone; the tests count as passed when those pass alone and
    # nothing else failed. Both outcomes are in the summary.
    if [[ ${TEST_WORKERS:-0} != 0 && $test_status == 1 ]]; then
        mapfile -t oom_tests < <(out_of_memory_failures "$OUT_DIR/gpu_tests.log")
        failures=$(grep -cE '^(FAILED|ERROR) ' "$OUT_DIR/gpu_tests.log")
        if (( ${#oom_tests[@]} )); then
            section "again, alone: ${#oom_tests[@]} of $failures failures were out of GPU memory among the workers"
            env PYTHONPATH="$TEST_PYTHONPATH" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
                "${oom_tests[@]}" 2>&1 | tee "$OUT_DIR/gpu_tests_alone.log"
            alone_status=${PIPESTATUS[0]}
            alone_verdict="${#oom_tests[@]} out of memory among the workers, alone: $(
                grep -E '(passed|failed|error)' "$OUT_DIR/gpu_tests_alone.log" | tail -n 1)"
            if (( alone_status == 0 && failures == ${#oom_tests[@]} )); then
                test_status=0
            fi
        fi
    fi
else
    echo "skipped (TESTS=0)" | tee "$OUT_DIR/gpu_tests.log"
    test_status=5
fi

# The alternatives' wheels, for the check and the benchmarks only.
BENCH_PYTHONPATH=$PYTHONPATH
rm -f "$OUT_DIR/alternatives_check.log"
wheels=("$WHEEL_DIR"/*.whl)
if [[ -e ${wheels[0]} ]]; then
    section "alternatives: installing ${#wheels[@]} wheels from $WHEEL_DIR into $BENCH_SITE"
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$BENCH_SITE" "${wheels[@]}"; then
        BENCH_PYTHONPATH=$BENCH_SITE:$PYTHONPATH
        echo "installed; PYTHONPATH for the benchmark: $BENCH_PYTHONPATH"
    else
        echo "pip install failed (exit $?): the benchmark goes on without them"
    fi
else
    echo "no wheels in $WHEEL_DIR (see benchmarks/fetch_wheels.sh):" \
        "cuequivariance and tokamax will be skipped"
fi

check_verdict="not run (CHECK_ALTERNATIVES=$CHECK_ALTERNATIVES)"
if [[ $CHECK_ALTERNATIVES != 0 ]]; then
    section "alternatives check: $PYTHON -m benchmarks check ${CHECK_ARGV[*]}"
    PYTHONPATH=$BENCH_PYTHONPATH "$PYTHON" -m benchmarks check \
        ${CHECK_ARGV[@]+"${CHECK_ARGV[@]}"} 2>&1 | tee "$OUT_DIR/alternatives_check.log"
    check_status=${PIPESTATUS[0]}
    case $check_status in
        0) check_verdict="passed" ;;
        1) check_verdict="FAILED (see the FAIL lines below)" ;;
        *) check_verdict="did not finish (exit $check_status)" ;;
    esac
fi

# `run_benchmark SWITCH_NAME LOG COMMAND ARGS...`: `python -m benchmarks COMMAND ARGS...`
# with the alternatives' packages on PYTHONPATH, its output also in LOG, unless
# $SWITCH_NAME is 0; its exit status.
run_benchmark() {
    local switch=$1 log=$2
    shift 2
    if [[ ${!switch:-1} == 0 ]]; then
        echo "skipped ($switch=0)" | tee "$log"
        return 0
    fi
    PYTHONPATH=$BENCH_PYTHONPATH "$PYTHON" -m benchmarks "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}

section "benchmark: $PYTHON -m benchmarks op --out $OUT_DIR ${BENCH_ARGS:-}"
run_benchmark BENCH "$OUT_DIR/bench.log" op --out "$OUT_DIR" \
    ${BENCH_ARGV[@]+"${BENCH_ARGV[@]}"}
bench_status=$?

rm -f "$OUT_DIR/compare.log"
compare_status=0
if [[ -n ${COMPARE_WITH:-} && ${BENCH:-1} != 0 ]]; then
    section "comparison: $PYTHON -m benchmarks compare $COMPARE_WITH $OUT_DIR/results.json ${COMPARE_ARGS:-}"
    "$PYTHON" -m benchmarks compare "$COMPARE_WITH" "$OUT_DIR/results.json" \
        ${COMPARE_ARGV[@]+"${COMPARE_ARGV[@]}"} 2>&1 | tee "$OUT_DIR/compare.log"
    compare_status=${PIPESTATUS[0]}
fi

section "layer benchmark: $PYTHON -m benchmarks layer --out $OUT_DIR/layer ${LAYER_ARGS:-}"
run_benchmark LAYER_BENCH "$OUT_DIR/bench_layer.log" layer \
    --out "$OUT_DIR/layer" ${LAYER_ARGV[@]+"${LAYER_ARGV[@]}"}
layer_status=$?
(( bench_status == 0 )) && bench_status=$layer_status

# AlphaFold2's Evoformer iteration, its own against msa_pallas inside (off by default:
# its whole table takes about half an hour; MODEL_ARGS="--budget SECONDS" splits it).
model_status=0
if [[ ${MODEL_BENCH:-0} != 0 ]]; then
    section "model benchmark: $PYTHON -m benchmarks model --out $OUT_DIR/model ${MODEL_ARGS:-}"
    install_test_wheels
    PYTHONPATH=$TEST_PYTHONPATH "$PYTHON" -m benchmarks model --out "$OUT_DIR/model" \
        ${MODEL_ARGV[@]+"${MODEL_ARGV[@]}"} 2>&1 | tee "$OUT_DIR/bench_model.log"
    model_status=${PIPESTATUS[0]}
    (( bench_status == 0 )) && bench_status=$model_status
fi

# pytest exits 5 when no test was collected/selected: not a failure.
case $test_status in
    0) tests_failed=0; test_verdict="passed" ;;
    5) tests_failed=0; test_verdict="no gpu tests run" ;;
    *) tests_failed=1; test_verdict="FAILED (pytest exit $test_status)" ;;
esac

section "summary"
echo "tests: $test_verdict"
# pytest's own last line, e.g. "3 failed, 40 passed, 2 skipped in 12.3s".
grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$OUT_DIR/gpu_tests.log" | tail -n 1
grep -E '^(FAILED|ERROR) ' "$OUT_DIR/gpu_tests.log" | head -n 15
[[ -n ${alone_verdict:-} ]] && echo "$alone_verdict"
echo "alternatives check: $check_verdict"
if [[ -s $OUT_DIR/alternatives_check.log ]]; then
    grep -E '  (FAIL: |error: |OOM)|row differs' "$OUT_DIR/alternatives_check.log" | head -n 15
    tail -n 1 "$OUT_DIR/alternatives_check.log"
fi
echo "benchmark: exit $bench_status$( ((bench_status == 4)) && echo ' (stopped at its budget: run the same command again to continue)')"
if [[ -s "$OUT_DIR/results.md" ]]; then
    cat "$OUT_DIR/results.md"
else
    echo "no results.md; last lines of bench.log:"
    tail -n 20 "$OUT_DIR/bench.log"
fi
echo "layer benchmark: exit $layer_status"
# The layer table and its notes: from the table's header to the end of the log.
awk '/^\| shape /{found=1} found' "$OUT_DIR/bench_layer.log" | grep -v '^wrote ' | head -n 20
if [[ ${MODEL_BENCH:-0} != 0 ]]; then
    echo "model benchmark: exit $model_status"
    [[ -s $OUT_DIR/model/results.md ]] && cat "$OUT_DIR/model/results.md"
fi
if [[ -n ${COMPARE_WITH:-} && ${BENCH:-1} != 0 ]]; then
    case $compare_status in
        0) echo "comparison with $COMPARE_WITH: no regression" ;;
        1) echo "comparison with $COMPARE_WITH: REGRESSED" ;;
        *) echo "comparison with $COMPARE_WITH: did not run (exit $compare_status)" ;;
    esac
    head -n 60 "$OUT_DIR/compare.log"
fi

if (( tests_failed )); then
    exit 1
fi
if (( bench_status != 0 )); then
    exit "$bench_status"
fi
(( compare_status == 1 )) && exit 3
exit 0
