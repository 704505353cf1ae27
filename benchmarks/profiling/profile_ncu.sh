#!/usr/bin/env bash
# Nsight Compute profile and machine code of the Mosaic GPU kernels, one shape.
#
#   bash benchmarks/profiling/profile_ncu.sh OUT_DIR [`python -m benchmarks profile launch` arguments ...]
#
# Writes OUT_DIR/ncu.txt (per kernel: speed of light, pipe utilisation,
# warp stall reasons, instruction mix, occupancy; the launches of the kernels
# whose names start with msa_mosaic), and OUT_DIR/sass.tar.gz (what Mosaic GPU
# dumps as the kernels compile: the PTX, the ptxas report with registers and
# spills, and the SASS where `nvdisasm` is on PATH). Needs `ncu` on PATH or in
# /opt/nvidia/nsight-compute. NCU_SECTIONS overrides the sections; NCU_KERNELS
# (a regex, default msa_mosaic) picks the kernels, e.g. msa_row_attention for
# the Triton kernels (with --implementation pallas); NCU_METRICS adds metrics.
# NCU_SOURCE=1 also keeps the report (OUT_DIR/report.ncu-rep) and writes, per
# profiled launch, its SASS with each instruction's warp-state samples
# (OUT_DIR/source_<launch>.csv; `python -m benchmarks profile stalls` summarises them):
# which instructions the warps wait at, and why.
set -uo pipefail
OUT_DIR=${1:?usage: profile_ncu.sh OUT_DIR [profile launch args]}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p "$OUT_DIR/sass"
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Kernel replay saves and restores the memory a kernel writes: no preallocated pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS=${NCU_SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis WarpStateStats SchedulerStats InstructionStats Occupancy LaunchStats MemoryWorkloadAnalysis SourceCounters}

MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT_DIR/sass" \
    "$PYTHON" -m benchmarks profile launch --calls 1 "$@" > "$OUT_DIR/sass/stdout.txt" 2>&1
tar -czf "$OUT_DIR/sass.tar.gz" -C "$OUT_DIR" sass && rm -rf "$OUT_DIR/sass"

if [[ -z $NCU ]]; then
    echo "profile_ncu.sh: no ncu found" | tee "$OUT_DIR/ncu.txt"
    exit 1
fi
section_args=()
for s in $SECTIONS; do section_args+=(--section "$s"); done
if [[ -n ${NCU_METRICS:-} ]]; then
    section_args+=(--metrics "$NCU_METRICS" --print-metric-instances values)
fi
"$NCU" --clock-control none --kernel-name "regex:${NCU_KERNELS:-msa_mosaic}" --launch-count 8 \
    ${NCU_SOURCE:+--export "$OUT_DIR/report"} \
    "${section_args[@]}" "$PYTHON" -m benchmarks profile launch --calls 2 "$@" \
    > "$OUT_DIR/ncu.txt" 2>&1
status=$?
if [[ -n ${NCU_SOURCE:-} && -f $OUT_DIR/report.ncu-rep ]]; then
    # An exported report is not printed as it is taken.
    "$NCU" --import "$OUT_DIR/report.ncu-rep" --page details >> "$OUT_DIR/ncu.txt" 2>&1
    launches=$("$NCU" --import "$OUT_DIR/report.ncu-rep" --page raw --csv \
        --metrics launch__grid_size 2>/dev/null | tail -n +3 | wc -l)
    for ((i = 0; i < launches; i++)); do
        "$NCU" --import "$OUT_DIR/report.ncu-rep" --page source --csv --print-source sass \
            --launch-skip "$i" --launch-count 1 > "$OUT_DIR/source_$i.csv" 2>&1
    done
fi
grep -E "${NCU_KERNELS:-msa_mosaic}|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Registers Per|Pipe|Stall" "$OUT_DIR/ncu.txt" | head -80
exit $status
