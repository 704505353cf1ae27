#!/usr/bin/env bash
# Downloads the wheels that let `python -m benchmarks op` and `layer`
# measure NVIDIA's cuEquivariance and Google's tokamax beside msa_pallas on a
# GPU machine that has no network.
#
#   bash benchmarks/fetch_wheels.sh          # into .whl/ at the repository root
#   bash benchmarks/fetch_wheels.sh DIR      # into DIR (relative to the current directory)
#
# Run it where pip can reach the package index; then carry `.whl` to the GPU
# machine, where benchmarks/run_gpu.sh installs the wheels with
# `pip install --no-index --no-deps --target $BENCH_SITE` for the benchmarks
# only. `.whl/` is git-ignored.
#
# Wheels are for CPython 3.12 on manylinux x86-64 (the GPU image), fetched with
# --no-deps, so every runtime dependency that the GPU image lacks is named
# below, pinned, one version each. Dependencies the GPU image already has are
# not fetched: networkx, numpy, opt-einsum, scipy, sympy (cuequivariance); einops,
# packaging, jax (cuequivariance-jax); nvidia-cublas, tqdm, nvidia-ml-py
# (cuequivariance-ops-cu13); absl-py, jax, jaxlib, jaxtyping, tqdm (tokamax);
# flax (qwix); protobuf (tensorboardx). tokamax also requires xprof, which
# is not fetched: benchmarks/packages.py provides a stand-in for the one
# module tokamax imports from it.
#
# AlphaFold2's own model for `python -m benchmarks model` and
# tests/test_alphafold2_patch.py go into DIR/alphafold (install them, with
# DIR/test's dm-haiku, into a --target folder put on PYTHONPATH: README,
# "Inside AlphaFold2 / OpenFold / AlphaFold3-style models"). They are fetched
# with --no-deps: of alphafold-colabfold's declared dependencies only dm-tree,
# ml-collections and immutabledict (and theirs: wrapt, attrs, PyYAML) are
# imported by its model code; absl-py, numpy and scipy are in the GPU image;
# pandas and biopython (its data pipeline) are not needed; colabfold-kernels'
# CUDA kernel wheels serve only its own cuda_legacy backend, which AlphaFold2's
# default configuration (use_pallas False) never loads.
#
# Environment: PYTHON (default python3; any Python with pip: the target
# interpreter is given by --python-version), MAX_MB (default 55: exit 1 when
# the wheels in DIR add up to more, to keep the copy carried to the GPU
# machine beside the working tree small).

set -uo pipefail

PYTHON=${PYTHON:-python3}
MAX_MB=${MAX_MB:-55}
if [[ $# -gt 1 ]]; then
    echo "usage: bash benchmarks/fetch_wheels.sh [DIR]" >&2
    exit 2
fi
if [[ $# -eq 1 ]]; then
    mkdir -p "$1" || exit 2
    DIR=$(cd "$1" && pwd)
else
    DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.whl
    mkdir -p "$DIR" || exit 2
fi

# NAME==VERSION. cuEquivariance (triangle_attention):
WHEELS=(
    cuequivariance==0.13.0
    cuequivariance-jax==0.13.0
    cuequivariance-ops-jax-cu13==0.13.0
    cuequivariance-ops-cu13==0.13.0
    platformdirs==4.14.8
# tokamax (dot_product_attention, implementation="mosaic" | "triton"):
    tokamax==0.0.17
    einshape==1.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    qwix==0.1.8
    immutabledict==4.3.1
    tensorboardx==2.6.5
)
# The optional Haiku drop-in's GPU tests (tests/layers/test_haiku.py), and
# pytest-xdist for run_gpu.sh's TEST_WORKERS, into DIR/test: benchmarks/run_gpu.sh
# installs these for the tests only.
TEST_WHEELS=(
    dm-haiku==0.0.17
    jmp==0.0.4
    tabulate==0.10.0
    pytest-xdist==3.8.0
    execnet==2.1.2
)

# AlphaFold2 (alphafold.model.modules and its imports), into DIR/alphafold:
ALPHAFOLD_WHEELS=(
    alphafold-colabfold==2.3.27
    colabfold-kernels==0.9.0
    ml-collections==1.1.0
    dm-tree==0.1.10
    wrapt==2.5.2
    attrs==26.1.0
    pyyaml==6.0.4
)

BASE_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
                manylinux2014_x86_64 manylinux1_x86_64)
# Tried only when a wheel is not found with the base tags (pip matches N
# exactly); the GPU image is Ubuntu 24.04 (glibc 2.39).
MORE_PLATFORMS=(manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
                manylinux_2_35_x86_64 manylinux_2_39_x86_64)

platform_args() {
    local tag
    for tag in "$@"; do printf -- '--platform\n%s\n' "$tag"; done
}

download() {  # download DEST SPEC PLATFORM...
    local dest=$1 spec=$2
    shift 2
    local -a plat
    mapfile -t plat < <(platform_args "$@")
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d "$dest" "$spec"
}

# The distribution name of a wheel file, normalised (PEP 503).
dist_name() {
    local base=${1##*/}
    echo "${base%%-*}" | tr 'A-Z_.' 'a-z--'
}

failed=()
for spec in "${WHEELS[@]}"; do
    # Drop other versions of this distribution left in DIR by an earlier run:
    # two versions of one package stop the whole install on the GPU machine.
    name=$(echo "${spec%%==*}" | tr 'A-Z_.' 'a-z--')
    version=${spec##*==}
    for old in "$DIR"/*.whl; do
        [[ -e $old ]] || continue
        if [[ $(dist_name "$old") == "$name" && ${old##*/} != *-"$version"-* ]]; then
            echo "removing other version: ${old##*/}"
            rm -f -- "$old"
        fi
    done
    if download "$DIR" "$spec" "${BASE_PLATFORMS[@]}"; then
        continue
    fi
    echo "retrying $spec with more manylinux tags" >&2
    if ! download "$DIR" "$spec" "${BASE_PLATFORMS[@]}" "${MORE_PLATFORMS[@]}"; then
        failed+=("$spec")
    fi
done
mkdir -p "$DIR/test"
for spec in "${TEST_WHEELS[@]}"; do
    # Pure-Python wheels: no platform tags needed.
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version 3.12 -d "$DIR/test" "$spec" || failed+=("$spec")
done
echo "test wheels in $DIR/test: $(cd "$DIR/test" && ls *.whl 2>/dev/null | tr '\n' ' ')"
mkdir -p "$DIR/alphafold"
for spec in "${ALPHAFOLD_WHEELS[@]}"; do
    # dm-tree, wrapt and PyYAML have compiled parts: the GPU image's platform tags.
    download "$DIR/alphafold" "$spec" "${BASE_PLATFORMS[@]}" \
        || download "$DIR/alphafold" "$spec" "${BASE_PLATFORMS[@]}" "${MORE_PLATFORMS[@]}" \
        || failed+=("$spec")
done
echo "AlphaFold2 wheels in $DIR/alphafold: $(cd "$DIR/alphafold" && ls *.whl 2>/dev/null | tr '\n' ' ')"

echo
echo "wheels in $DIR:"
total=0
declare -A seen=()
duplicates=()
for wheel in "$DIR"/*.whl; do
    [[ -e $wheel ]] || continue
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "${wheel##*/}"
    name=$(dist_name "$wheel")
    [[ -n ${seen[$name]:-} ]] && duplicates+=("$name")
    seen[$name]=1
done
total_mb=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1e6 }')
echo "total: $total bytes ($total_mb MB) in ${#seen[@]} distributions"

status=0
if (( ${#failed[@]} )); then
    echo "FAILED to download: ${failed[*]}" >&2
    status=1
fi
if (( ${#duplicates[@]} )); then
    echo "more than one version of: ${duplicates[*]} (remove all but one)" >&2
    status=1
fi
if awk -v b="$total" -v m="$MAX_MB" 'BEGIN { exit !(b > m * 1e6) }'; then
    echo "total $total_mb MB is above MAX_MB=$MAX_MB" >&2
    status=1
fi
exit $status
