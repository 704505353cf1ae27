"""Kernel-level tools: `python -m benchmarks profile kernels|forward|backward|launch|durations|stalls|memory`.

- kernels.py: each Pallas Triton kernel timed alone, default tiles and candidates;
- forward.py / backward.py: the Triton and Mosaic GPU kernels side by side;
- launch.py: a few forward+backward calls at one shape, for a profiler;
- profile_ncu.sh: Nsight Compute sections and the Mosaic kernels' machine code
  (`bash benchmarks/profiling/profile_ncu.sh OUT_DIR [launch arguments]`);
- durations.py: every kernel launch of one call under Nsight Compute;
- stall_sources.py: where a kernel's warps wait, from profile_ncu.sh's source CSVs;
- memory_breakdown.py: the largest buffers of the compiled forward+backward.
"""

from __future__ import annotations

from benchmarks import dispatch

COMMANDS = {
    "kernels": ("benchmarks.profiling.kernels", "each Triton kernel alone: default tiles, candidates"),
    "forward": ("benchmarks.profiling.forward", "the Triton and Mosaic forward kernels side by side"),
    "backward": ("benchmarks.profiling.backward", "the Triton and Mosaic backward kernels side by side"),
    "launch": ("benchmarks.profiling.launch", "a few forward+backward calls, for a profiler"),
    "durations": ("benchmarks.profiling.durations", "every launch of one call under Nsight Compute"),
    "stalls": ("benchmarks.profiling.stall_sources", "where the warps wait (profile_ncu.sh's CSVs)"),
    "memory": ("benchmarks.profiling.memory_breakdown", "the largest buffers of the compiled f+b"),
}


def main(argv=None, prog: str = "python -m benchmarks profile") -> int:
    return dispatch(prog, COMMANDS, list(argv or []))
