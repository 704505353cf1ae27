"""The GPU timeline of one step: every kernel's start, duration and the gap before it.

Runs `profile launch`'s step (its arguments: the op's forward+backward, or with
`--layer PRESET` the Flax layer's training step) a few times, then one more
time under `jax.profiler.trace`, and prints that step's kernels from the trace's
GPU streams in the order they started. Unlike `profile durations` (Nsight Compute,
one launch at a time, minutes for a layer step whose compile autotunes), it sees
the step as a timed call runs it, gaps between kernels included, in seconds
(`--hlo FILE` writes the compiled step's HLO, where XLA's fusion names are defined):

    python -m benchmarks profile timeline --layer reference --shape train --implementation default
    python -m benchmarks profile timeline --shape finetune --dropout-rate 0.1 --trace-dir /tmp/t

The summary gives the span from the first kernel's start to the last one's end,
the kernels' busy time, and the busy time of the `--top` costliest kernel names.
Needs the GPU profiler (CUPTI) that jax's CUDA plugin brings; a backend without
it gives a trace without GPU streams, and the command says so.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax

from benchmarks.profiling.launch import make_call, make_parser


def read_trace(log_dir: str | Path) -> dict:
    """The newest `*.trace.json.gz` that `jax.profiler.trace(log_dir)` wrote."""
    traces = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"),
                    key=lambda path: path.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(traces[-1], "rb") as f:
        return json.load(f)


def _names(events: list[dict]) -> tuple[dict, dict]:
    """(process name by pid, thread name by (pid, tid)) from a trace's metadata events."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return processes, threads


def gpu_kernels(trace: dict) -> list[dict]:
    """The complete events ("ph": "X") on the GPU devices' stream threads, by start
    time: each a dict with name, ts and dur (microseconds), and the thread's name."""
    events = trace.get("traceEvents", [])
    processes, threads = _names(events)
    kernels = [
        dict(name=e.get("name", "?"), ts=float(e["ts"]), dur=float(e.get("dur", 0.0)),
             stream=threads.get((e["pid"], e.get("tid")), ""))
        for e in events
        if e.get("ph") == "X" and "GPU" in processes.get(e.get("pid"), "")
        and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")
    ]
    return sorted(kernels, key=lambda k: k["ts"])


def describe_threads(trace: dict) -> str:
    """The trace's processes and threads, one line each (to see why nothing matched)."""
    events = trace.get("traceEvents", [])
    processes, threads = _names(events)
    counts = collections.Counter((e.get("pid"), e.get("tid")) for e in events if e.get("ph") == "X")
    return "\n".join(f"  {processes.get(pid, pid)} / {threads.get((pid, tid), tid)}: {n} events"
                     for (pid, tid), n in sorted(counts.items(), key=lambda kv: -kv[1]))


def summarise(kernels: list[dict], top: int) -> list[str]:
    """Markdown lines: one per kernel (start offset, duration, gap before it), then
    the span, the busy time and the costliest names."""
    if not kernels:
        return []
    t0 = kernels[0]["ts"]
    lines = ["| # | start µs | µs | gap µs | kernel |", "|---|---|---|---|---|"]
    end = t0
    for i, k in enumerate(kernels):
        gap = max(0.0, k["ts"] - end)
        lines.append(f"| {i} | {k['ts'] - t0:.1f} | {k['dur']:.1f} | {gap:.1f} | {k['name'][:90]} |")
        end = max(end, k["ts"] + k["dur"])
    busy = sum(k["dur"] for k in kernels)
    lines += ["", f"{len(kernels)} kernels; span {end - t0:.1f} µs from the first start to the "
                  f"last end; busy {busy:.1f} µs ({busy / max(end - t0, 1e-9):.0%} of the span)"]
    by_name = collections.Counter()
    launches = collections.Counter()
    for k in kernels:
        by_name[k["name"]] += k["dur"]
        launches[k["name"]] += 1
    lines += ["", "| µs | share of busy | launches | kernel |", "|---|---|---|---|"]
    for name, us in by_name.most_common(top):
        lines.append(f"| {us:.1f} | {us / busy:.0%} | {launches[name]} | {name[:90]} |")
    return lines


def main(argv=None, prog: str | None = None) -> int:
    parser = make_parser(prog, __doc__.splitlines()[0])
    parser.add_argument("--trace-dir", default=None,
                        help="keep the trace here (default: a temporary folder)")
    parser.add_argument("--hlo", default=None,
                        help="write the compiled step's HLO here (the kernels' fusion names)")
    parser.add_argument("--top", type=int, default=15, help="costliest kernel names listed")
    args = parser.parse_args(argv)
    call, compiled, what = make_call(args)
    if args.hlo:
        Path(args.hlo).write_text(compiled.as_text())
    for _ in range(max(args.calls, 1)):
        jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = args.trace_dir or scratch
        with jax.profiler.trace(log_dir):
            jax.block_until_ready(call())
        trace = read_trace(log_dir)
    kernels = gpu_kernels(trace)
    print(f"# one of the {what}, traced after {max(args.calls, 1)} untraced", flush=True)
    if not kernels:
        print("profile timeline: the trace has no GPU stream events; its threads:\n"
              + describe_threads(trace), file=sys.stderr)
        return 1
    print("\n".join(summarise(kernels, args.top)))
    return 0
