# shellcheck shell=bash
# Sourced by run_gpu.sh and run_multi_gpu.sh:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/script_prelude.sh"
#   script_prelude run_gpu.sh "$@"
#
# Checks that the script got one argument, OUT_DIR; makes it and sets OUT_DIR to
# its absolute path; moves to the repository root; exports the environment both
# scripts run Python in (the repository on PYTHONPATH, unbuffered output) and
# sets PYTHON (default python3).
script_prelude() {
    local name=$1
    shift
    if [[ $# -ne 1 ]]; then
        echo "usage: bash benchmarks/$name OUT_DIR" >&2
        exit 2
    fi
    mkdir -p "$1" || exit 2
    OUT_DIR=$(cd "$1" && pwd)
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    PYTHON=${PYTHON:-python3}
}

# The pytest node ids of the tests that LOG's short summary lists as failed out of GPU
# memory (`FAILED id - ...RESOURCE_EXHAUSTED...` or `... out of memory ...`), once each.
out_of_memory_failures() {
    grep -E '^(FAILED|ERROR) [^ ]+ - .*(RESOURCE_EXHAUSTED|[Oo]ut of memory|OUT_OF_MEMORY)' "$1" \
        | sed -E 's/^(FAILED|ERROR) ([^ ]+) - .*/\2/' | sort -u
}
