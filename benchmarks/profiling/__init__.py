"""Kernel-level tools: `python -m benchmarks profile COMMAND` (the commands below).

- kernels.py: each Pallas Triton kernel timed alone, default tiles and candidates;
- forward.py / backward.py: the Triton and Mosaic GPU kernels side by side;
- variants.py: each Mosaic GPU kernel alone, and the op, plain against padding
  skipping and against attention dropout;
- launch.py: a few forward+backward calls at one shape, for a profiler;
- profile_ncu.sh: Nsight Compute sections and the Mosaic kernels' machine code
  (`bash benchmarks/profiling/profile_ncu.sh OUT_DIR [launch arguments]`);
- durations.py: every kernel launch of one call under Nsight Compute;
- timeline.py: one call's GPU kernels and the gaps between them, from a jax trace;
- stall_sources.py: where a kernel's warps wait, from profile_ncu.sh's source CSVs;
- memory_breakdown.py: the largest buffers of the compiled forward+backward;
- launches.py: what the compiled forward+backward launches, on a GPU or compiled for one
  from a host without it (`scripts/compile_for_gpu.sh`);
- sass.py: the Mosaic kernels' innermost wgmma loops in their machine code, instruction
  kinds counted, on a GPU or compiled for one (`scripts/compile_for_gpu.sh sass`).
"""

from __future__ import annotations

from benchmarks import dispatch

_HERE = "benchmarks.profiling."
COMMANDS = {
    "kernels": (_HERE + "kernels", "each Triton kernel alone: default tiles, candidates"),
    "forward": (_HERE + "forward", "the Triton and Mosaic forward kernels side by side"),
    "backward": (_HERE + "backward", "the Triton and Mosaic backward kernels side by side"),
    "variants": (_HERE + "variants", "each Mosaic kernel with padding skipping, with dropout"),
    "launch": (_HERE + "launch", "a few forward+backward calls, for a profiler"),
    "durations": (_HERE + "durations", "every launch of one call under Nsight Compute"),
    "timeline": (_HERE + "timeline", "one call's kernels and gaps, from a jax trace"),
    "stalls": (_HERE + "stall_sources", "where the warps wait (profile_ncu.sh's CSVs)"),
    "memory": (_HERE + "memory_breakdown", "the largest buffers of the compiled f+b"),
    "launches": (_HERE + "launches", "the compiled f+b's launches (a GPU's, or for one)"),
    "sass": (_HERE + "sass", "the Mosaic kernels' loop instructions (a GPU's, or for one)"),
}


def main(argv=None, prog: str = "python -m benchmarks profile") -> int:
    return dispatch(prog, COMMANDS, list(argv or []))
