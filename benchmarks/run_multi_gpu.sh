#!/usr/bin/env bash
# Everything that needs two or more GPUs, in one command:
#
#   bash benchmarks/run_multi_gpu.sh OUT_DIR
#   BENCH_ARGS="--shapes long --axes rows --iters 20" bash benchmarks/run_multi_gpu.sh OUT_DIR
#
# 1. the multi-device GPU tests (`pytest -m gpu -k on_gpus`): the bf16 bias gradient
#    summed in float32 across GPUs, the benchmark's own check, the training example on
#    2 GPUs against 1, the sharded kernels against one GPU;
# 2. `python -m benchmarks multi-gpu` on all visible GPUs (f+b of the op and the layer,
#    sharded over MSA rows, heads and batch, against one GPU), at most 120 s of new runs
#    (the MSA-row runs first; the same command continues with the rest, or
#    BENCH_ARGS="--budget 1000" for all of them):
#    OUT_DIR/bench/results.{json,md};
# 3. examples/train_stack.py with the Pallas kernels on a 2-GPU mesh (data=2 in float32,
#    rows=2 in bfloat16), each against the same training on one GPU (--compare);
# then a summary: the test summary line, the benchmark table, the loss-curve comparisons.
# Logs: OUT_DIR/tests.log, OUT_DIR/bench.log, OUT_DIR/train.log.
#
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is exported for every step.
# Environment: PYTHON (default python3), BENCH_ARGS (extra arguments of
# `python -m benchmarks multi-gpu`, split on spaces), TRAIN_ARGS (extra arguments of train_stack.py),
# TESTS=0 / BENCH=0 / TRAIN=0 skip a step.
# Exit status: 0 when every step that ran succeeded, else 1.

set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/script_prelude.sh" || exit 2
script_prelude run_multi_gpu.sh "$@"
export NCCL_NVLS_ENABLE=0
read -r -a BENCH_ARGV <<< "${BENCH_ARGS:-}"
read -r -a TRAIN_ARGV <<< "${TRAIN_ARGS:-}"
status=0
start=$SECONDS

section() { printf '\n===== %s (%d s) =====\n' "$*" $((SECONDS - start)); }

section "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    || echo "nvidia-smi failed (exit $?)"
"$PYTHON" -c 'import sys, jax; print("python", sys.version.split()[0]); print("jax", jax.__version__, jax.devices())' \
    || echo "python/jax check failed (exit $?)"
gpus=$("$PYTHON" -c 'import jax; print(jax.device_count() if jax.default_backend() == "gpu" else 0)' 2>/dev/null)
echo "repo $PWD; out $OUT_DIR; GPUs: ${gpus:-?}; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
if [[ ${gpus:-0} -lt 2 ]]; then
    echo "needs two or more GPUs; found ${gpus:-none}" >&2
    exit 1
fi

if [[ ${TESTS:-1} != 0 ]]; then
    section "multi-GPU tests"
    "$PYTHON" -m pytest -q -m gpu -k on_gpus -p no:cacheprovider -rs --durations=10 \
        tests/test_sharding.py tests/benchmarks/test_multi_gpu.py tests/test_train_example.py \
        tests/kernels/triton/test_gpu_reliability.py 2>&1 | tee "$OUT_DIR/tests.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi

if [[ ${BENCH:-1} != 0 ]]; then
    section "benchmark: python -m benchmarks multi-gpu on $gpus GPUs"
    "$PYTHON" -m benchmarks multi-gpu --out "$OUT_DIR/bench" --budget 120 \
        ${BENCH_ARGV[@]+"${BENCH_ARGV[@]}"} 2>&1 | tee "$OUT_DIR/bench.log"
    bench_status=${PIPESTATUS[0]}
    # 4: stopped at its budget, what is left for the same command: not a failure.
    [[ $bench_status -eq 0 || $bench_status -eq 4 ]] || status=1
fi

if [[ ${TRAIN:-1} != 0 ]]; then
    section "training example: 2 GPUs against 1"
    : > "$OUT_DIR/train.log"
    # (The GPU tests above train rows=2 in float32 and data=2 in bfloat16.)
    for run in "data=2 float32" "rows=2 bfloat16"; do
        read -r mesh dtype <<< "$run"
        "$PYTHON" examples/train_stack.py --implementation pallas --mesh "$mesh" --compare \
            --dtype "$dtype" --steps 30 --batch 2 --rows 64 --res 128 --msa-dim 128 \
            --pair-dim 64 --heads 4 ${TRAIN_ARGV[@]+"${TRAIN_ARGV[@]}"} 2>&1 \
            | tee -a "$OUT_DIR/train.log"
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
fi

section "summary"
if [[ -f $OUT_DIR/tests.log ]]; then
    echo "tests: $(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/tests.log" | tail -n 1)"
fi
if [[ -f $OUT_DIR/bench/results.md ]]; then
    echo
    cat "$OUT_DIR/bench/results.md"
fi
if [[ -f $OUT_DIR/train.log ]]; then
    echo
    grep -E "vs 1 device" "$OUT_DIR/train.log"
fi
echo
echo "total $((SECONDS - start)) s; exit status $status"
exit $status
