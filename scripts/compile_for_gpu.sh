#!/usr/bin/env bash
# Compiles the op for a GPU on a host without one and lists the compiled program's
# launches (benchmarks/profiling/launches.py), or with `sass` first, the Mosaic GPU
# kernels' innermost loops in their machine code (benchmarks/profiling/sass.py); XLA
# compiles the Triton and Mosaic GPU kernels for that GPU on the way:
#
#   bash scripts/compile_for_gpu.sh --shape train_padded --skip
#   GPU=a100 bash scripts/compile_for_gpu.sh --shape extra_padded --skip --dropout-rate 0.1
#   bash scripts/compile_for_gpu.sh sass --shape extra --kernel-options staggered_bias=0
#
# Needs a CUDA toolkit's ptxas and libdevice (CUDA_HOME, or ptxas on PATH). Installs
# JAX's CUDA plugin, at JAX's own version and without its CUDA libraries, into
# .cuda-plugin/ (once per JAX version), kept apart from .venv so that the CPU tests
# never see it; for `sass`, NVIDIA's nvdisasm wheel there too, where no nvdisasm is on
# PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh
version="$("$PY" -c 'import jax; print(jax.__version__)')"
if [ "$(cat .cuda-plugin/.jax_version 2>/dev/null)" != "$version" ]; then
    rm -rf .cuda-plugin
    "$PY" -m pip install --quiet --no-deps --target .cuda-plugin \
        "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version"
    echo "$version" > .cuda-plugin/.jax_version
fi
command=launches
if [ "${1:-}" = sass ]; then
    command=sass
    shift
    if ! command -v nvdisasm > /dev/null && ! ls .cuda-plugin/nvidia/cu*/bin/nvdisasm > /dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-deps --target .cuda-plugin "nvidia-cuda-nvdisasm==13.2.86"
    fi
fi
PYTHONPATH="$PWD/.cuda-plugin${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=3 \
    exec "$PY" -m benchmarks profile "$command" --deviceless "${GPU:-h200}" "$@"
