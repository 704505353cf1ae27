#!/usr/bin/env python3
"""Benchmark `msa_pallas.msa_row_attention` against other attention implementations.

For every (shape, dtype, bias dtype, implementation) it measures the forward (`fwd`) and
the forward plus the gradients of q, k, v and bias (`f+b`): median and minimum wall
time of jitted calls, XLA's compiled temporary and output memory, and the time against
a lower bound set by the exponentials and the matrix work.

    python benchmarks/bench_attention.py --out DIR                  # GPU: every shape but seed
    python benchmarks/bench_attention.py --shapes train,long --dtypes bf16 --bias-dtypes f32
    python benchmarks/bench_attention.py --shapes 1x128x4096x8x32   # a custom B x S x N x H x d
    python benchmarks/bench_attention.py --shapes 1x64x256x8x32:padded   # ... padded like train_padded
    python benchmarks/bench_attention.py --out benchmarks/out/cpu --iters 3   # CPU: tiny shape, interpret mode
    python benchmarks/bench_attention.py --impls msa_pallas,cuequivariance,tokamax_mosaic

Writes `DIR/results.json` (every number and the run's metadata), `DIR/results.md`
(a Markdown table for benchmarks/RESULTS.md, with the targets read off the run) and
`DIR/results.png` (when matplotlib is importable), and prints the table at the end.
Failures (out of memory, unsupported shapes) are recorded per cell and never stop the
run. Compare two runs with benchmarks/compare.py.

The parts: benchmarks/shapes.py (shapes, dtypes, masks), alternatives.py (one adapter
per implementation; packages.py imports the other packages), measure.py (inputs,
timing, memory), report.py (tables, plot).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import msa_pallas  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
import shapes  # noqa: E402
from alternatives import ALTERNATIVE_PACKAGES, IMPLEMENTATIONS, on_gpu, package_version  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


class Progress:
    """A tqdm bar on stderr when stderr is a terminal; result lines go to stdout.

    When stderr is not a terminal (a log file), the bar is disabled and each result
    line carries `[k/n]` instead, so that a captured log stays one line per result.
    """

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, disable=not self.tty)

    def describe(self, text: str) -> None:
        self.bar.set_description_str(text)

    def result(self, line: str) -> None:
        self.done += 1
        if self.tty:
            self.bar.write(line, file=sys.stdout)
        else:
            print(f"[{self.done:>{len(str(self.total))}}/{self.total}] {line}", flush=True)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def commit_id(explicit: str | None) -> str:
    """--commit, else $MSA_PALLAS_COMMIT, else `git rev-parse --short HEAD` with
    "+dirty" when tracked files differ from it (the numbers are then of a
    tree no commit holds), else unknown."""
    if explicit:
        return explicit
    if os.environ.get("MSA_PALLAS_COMMIT"):
        return os.environ["MSA_PALLAS_COMMIT"]
    git = lambda *args: subprocess.run(  # noqa: E731
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True,
    ).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def metadata(args) -> dict:
    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "msa_pallas_version": getattr(msa_pallas, "__version__", None),
        "packages": {name: package_version(name) for name in ALTERNATIVE_PACKAGES},
        "python": platform.python_version(),
        "commit": commit_id(args.commit),
        "argv": portable_argv(sys.argv[1:]),
        "impls": args.impls,
        "dtypes": args.dtypes,
        "bias_dtypes": args.bias_dtypes,
        "shapes": {s.name: {"dims": list(s.dims), "mask": s.mask} for s in args.shapes},
        "iters": args.iters,
        "reps": args.reps,
        "warmup": args.warmup,
        "seed": args.seed,
        "env": {name: os.environ.get(name) for name in (
            "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "constants": {
            "exp_per_s": measure.EXP_PER_S, "matmul_flop_per_s": measure.MATMUL_FLOP_PER_S,
            "l2_bytes": measure.L2_BYTES, "exps_per_logit": measure.EXPS_PER_LOGIT,
            "matmul_flops_per_logit_and_dim": measure.MATMUL_FLOPS_PER_LOGIT_AND_DIM,
            "masked_fraction": shapes.RANDOM_MASKED_FRACTION,
            "padding_fraction": shapes.PADDING_FRACTION,
            "note": "floor constants are an H200's; on other devices the fractions are only indicative",
        },
    }


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def portable_argv(argv: list[str]) -> list[str]:
    """The command line as recorded in the results: the output folder, a
    path of the machine that ran it, reads OUT_DIR."""
    recorded, after_out = [], False
    for arg in argv:
        if after_out:
            arg, after_out = "OUT_DIR", False
        elif arg == "--out":
            after_out = True
        elif arg.startswith("--out="):
            arg = "--out=OUT_DIR"
        recorded.append(arg)
    return recorded


def parse_args(argv=None):
    gpu = on_gpu()
    defaults = shapes.GPU_DEFAULT_SHAPES if gpu else shapes.CPU_DEFAULT_SHAPES
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(defaults),
                        help=f"comma-separated names ({', '.join(shapes.SHAPES)}) or "
                             "BxSxNxHxd[:padded] (default: %(default)s)")
    parser.add_argument("--dtypes", default=",".join(shapes.DEFAULT_DTYPES),
                        help=f"q/k/v dtypes, of {', '.join(shapes.DTYPES)} (default %(default)s)")
    parser.add_argument("--bias-dtypes", default=",".join(shapes.BIAS_DTYPES),
                        help="bias dtypes: f32 and/or input (the q/k/v dtype); float32 inputs "
                             "get one case for both (default %(default)s)")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                        help=f"comma-separated, of {', '.join(IMPLEMENTATIONS)} (default: all; "
                             "those that cannot run here are recorded as skipped)")
    parser.add_argument("--iters", type=int, default=10 if gpu else 5,
                        help="timed samples per measurement (default 10 on GPU, 5 on CPU)")
    parser.add_argument("--reps", type=int, default=10 if gpu else 1,
                        help="back-to-back calls per timed sample (default 10 on GPU, 1 on CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip measurements that would start after this many seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json, results.md, results.png")
    parser.add_argument("--commit", default=None,
                        help="commit id to record (default $MSA_PALLAS_COMMIT or git)")
    args = parser.parse_args(argv)
    try:
        args.shapes = [shapes.parse_shape(name) for name in split_list(args.shapes)]
    except ValueError as exc:
        parser.error(str(exc))
    args.dtypes = split_list(args.dtypes)
    args.bias_dtypes = split_list(args.bias_dtypes)
    args.impls = split_list(args.impls)
    for kind, chosen, known in (("dtype", args.dtypes, shapes.DTYPES),
                                ("bias dtype", args.bias_dtypes, shapes.BIAS_DTYPES),
                                ("impl", args.impls, IMPLEMENTATIONS)):
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            parser.error(f"unknown or no {kind} {', '.join(unknown)}; expected {', '.join(known)}")
    if args.iters < 1 or args.reps < 1:
        parser.error("--iters and --reps must be >= 1")
    return args


def cases(args) -> list[shapes.Case]:
    """Every (dtype, shape, bias dtype): a shape's bias dtypes side by side in the table."""
    return [shapes.Case(shape, dtype, bias)
            for dtype in args.dtypes for shape in args.shapes
            for bias in shapes.bias_dtype_names(dtype, args.bias_dtypes)]


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    settings = measure.Settings(
        iters=args.iters, warmup=args.warmup, reps=args.reps, seed=args.seed,
        deadline=None if args.budget_s is None else start + args.budget_s)
    results = {"metadata": metadata(args), "cases": []}
    meta = results["metadata"]
    print(f"# {meta['device_kind']} ({meta['backend']}), jax {meta['jax_version']}, "
          f"commit {meta['commit']}, impls {','.join(args.impls)}, "
          f"iters {args.iters} x reps {args.reps}", flush=True)
    todo = cases(args)
    progress = Progress(len(todo) * len(args.impls) * len(measure.MODES))
    try:
        for case in todo:
            results["cases"].append(measure.run_case(case, args.impls, settings, progress))
            meta["elapsed_s"] = time.monotonic() - start
            if args.out is not None:
                report.write_outputs(results, args.out)
    finally:
        progress.close()
    table = report.markdown_table(results)
    if args.out is not None:
        why_not = report.plot(results, args.out / "results.png")
        print(f"# wrote {args.out}/results.json, results.md"
              + (f"; no plot: {why_not}" if why_not else ", results.png"), flush=True)
    print(f"# total {time.monotonic() - start:.0f} s\n", flush=True)
    print(table, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
