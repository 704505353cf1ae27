"""The GPU time of every kernel launch of the op's last forward+backward call.

Runs `profile launch` under Nsight Compute with one metric,
`gpu__time_duration.sum`, for every kernel (XLA's fusions too, not only the
Pallas ones), and prints the launches of the last call, one line each, and
their sum: what each kernel and each XLA pass between them costs. Launches
run one at a time under the profiler, so the sum leaves out the gaps between
kernels that a timed call has:

    python -m benchmarks profile durations --calls 2 -- --shape train --implementation default
    python -m benchmarks profile durations -- --shape long --bias-dtype f32

Everything after `--` goes to `profile launch` (its `--calls` is this
script's). Needs `ncu` on PATH or in /opt/nvidia/nsight-compute.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

METRIC = "gpu__time_duration.sum"
# Unit of the metric's values, as Nsight Compute's CSV names it, in microseconds.
UNITS_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
            "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def find_ncu() -> str | None:
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)


def parse_launches(csv_text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) per launch, in launch order, from the CSV
    `ncu --csv --metrics gpu__time_duration.sum` prints (lines that are not
    part of the table, such as the program's own output, are skipped)."""
    rows = [row for row in csv.reader(csv_text.splitlines()) if len(row) > 10]
    if not rows:
        return []
    header, *rows = rows
    name, metric, value, unit = (
        header.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit")
    )
    return [
        (row[name], float(row[value].replace(",", "")) * UNITS_US[row[unit]])
        for row in rows
        if row[metric] == METRIC
    ]


def last_call(launches: list, calls: int) -> list:
    """The launches of the last of `calls` identical calls: the shortest
    tail that the launches before it repeat `calls` - 1 times, kernel by
    kernel; all launches if there is none. (Making the inputs and compiling
    launch kernels of their own first, some as many times as there are
    calls: a count of launches per kernel cannot tell where the calls begin.)"""
    names = [kernel for kernel, _ in launches]
    for length in range(1, len(names) // calls + 1):
        tail = names[len(names) - length:]
        if all(names[len(names) - (i + 1) * length: len(names) - i * length] == tail
               for i in range(1, calls)):
            return launches[len(launches) - length:]
    return launches


def main(argv=None, prog: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2, help="forward+backward calls (>= 2)")
    args = parser.parse_args(own)
    ncu = find_ncu()
    if ncu is None:
        print("profile durations: no ncu found", file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parents[2]  # the repository
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    command = [
        ncu, "--clock-control", "none", "--metrics", METRIC, "--csv",
        sys.executable, "-m", "benchmarks", "profile", "launch",
        "--calls", str(args.calls), *rest,
    ]
    result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    launches = parse_launches(result.stdout)
    if not launches:
        print(result.stdout[-2000:], result.stderr[-2000:], sep="\n", file=sys.stderr)
        return result.returncode or 1
    shown = last_call(launches, args.calls)
    print("| # | µs | kernel |")
    print("|---|---|---|")
    for i, (kernel, us) in enumerate(shown):
        print(f"| {i} | {us:.1f} | {kernel[:90]} |")
    print(f"| | **{sum(us for _, us in shown):.1f}** | sum of {len(shown)} launches |")
    return 0
