#!/usr/bin/env bash
# dropout check on the H200: GPU tests of the dropout paths, then the layer benchmark.
set -u
mkdir -p /tmp/o
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ts .whl/test/*.whl .whl/xdist/*.whl .whl/alphafold/*.whl > /tmp/o/pip.log 2>&1
export PYTHONPATH=/tmp/ts:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false MSA_PALLAS_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name --format=csv > /tmp/o/env.log 2>&1
timeout ${T1:-240} python3 -m pytest -q -n 6 -p no:cacheprovider ${TESTS1:-tests/test_dropout.py} > /tmp/o/tests1.log 2>&1
echo "tests1 rc $?" >> /tmp/o/tests1.log
timeout ${T2:-200} python3 -m benchmarks layer --preset reference --shapes ${LSHAPES:-train,finetune} --cores ${LCORES:-default,default+dropout,xla+dropout} --out /tmp/o/layer --iters 5 --reps 5 --warmup 2 --fresh > /tmp/o/layer.log 2>&1
echo "layer rc $?" >> /tmp/o/layer.log
tail -5 /tmp/o/tests1.log; tail -12 /tmp/o/layer.log
tar czf $OUT/o.tgz -C /tmp o
