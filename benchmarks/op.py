"""The op benchmark: `msa_pallas.msa_row_attention` against every other implementation.

For every (shape, dtype, bias dtype, implementation) it measures the forward (`fwd`) and
the forward plus the gradients of q, k, v and bias (`f+b`): median and minimum wall
time of jitted calls, XLA's compiled temporary and output memory, and the time against
a lower bound set by the exponentials and the matrix work.

    python -m benchmarks op                     # the full table: every shape, dtype, alternative
    python -m benchmarks op --budget 500        # stops before 500 s; the same command continues
    python -m benchmarks op --shapes train,long --dtypes bf16 --bias-dtypes f32
    python -m benchmarks op --shapes 1x128x4096x8x32          # a custom B x S x N x H x d
    python -m benchmarks op --shapes 1x64x256x8x32:padded     # ... padded like train_padded
    python -m benchmarks op --impls msa_pallas,cuequivariance,tokamax_mosaic --out DIR
    python -m benchmarks op --impls all         # with msa_pallas's own variants (Triton, Mosaic)
    python -m benchmarks op --shapes train --calls-per-program 10   # 10 calls in each program

Writes `OUT/results.json` (every number and the run's metadata) after every
measurement, `OUT/results.md` (the Markdown table, with the targets read off the run)
and `OUT/results.png` (when matplotlib is importable), and prints the table at the
end; OUT is benchmarks/out/op unless `--out` says otherwise. A rerun with the same
`--out` skips the cells the file holds (an implementation at a case, both modes) when
the file is of the same commit, device, packages and timing settings (`--fresh` starts
over); `--budget SECONDS` stops before a case (or, in a case longer than the budget, a
cell) that the longest so far says would not end in time, with exit status 4, and the
same command continues. Failures (out of memory, unsupported shapes) are recorded per
cell and never stop the run.

A cell's `queued_ms` is the host's time per call to queue the calls; where it is most
of the time per call the report calls the cell host-bound: the GPU waited for the host.
`--calls-per-program K` times programs that each make K calls
(`measure.in_one_program`), so that the host dispatches one program per K calls, as
inside a model's compiled step; their memory is still one call's.

Without a GPU the default is the `tiny` shape, the kernels in their interpreters: the
run says which shapes it leaves out and which implementations cannot run here, and why.

The parts: shapes.py (shapes, dtypes, masks), alternatives.py (one adapter per
implementation; packages.py imports the other packages), measure.py (inputs, timing,
memory), report.py (tables, plot), runs.py (progress, budget, the results file).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import jax

import msa_pallas
from benchmarks import measure, report, runs, shapes, timing
from benchmarks.alternatives import (
    ALTERNATIVE_PACKAGES, IMPLEMENTATIONS, TABLE_IMPLEMENTATIONS, on_gpu, package_version,
)

# Names of several implementations at once, for --impls.
IMPLEMENTATION_GROUPS = {"table": TABLE_IMPLEMENTATIONS, "all": tuple(IMPLEMENTATIONS)}
DEFAULT_OUT = runs.REPO_ROOT / "benchmarks" / "out" / "op"
# Metadata a results file must share with this run for the run to continue it.
SAME_RUN_KEYS = ("commit", "device_kind", "backend", "jax_version", "packages", "iters", "reps",
                 "warmup", "seed", "calls_per_program")


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def metadata(args) -> dict:
    device = jax.devices()[0]
    return {
        "date_utc": runs.utc_now(),
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "msa_pallas_version": getattr(msa_pallas, "__version__", None),
        "packages": {name: package_version(name) for name in ALTERNATIVE_PACKAGES},
        "python": platform.python_version(),
        "commit": runs.commit_id(args.commit),
        "argv": runs.portable_argv(args.argv),
        "impls": args.impls,
        "dtypes": args.dtypes,
        "bias_dtypes": args.bias_dtypes,
        "shapes": {s.name: {"dims": list(s.dims), "mask": s.mask}
                   | ({"padding": list(s.padding)} if s.mask == "padded" else {})
                   for s in args.shapes},
        "iters": args.iters,
        "reps": args.reps,
        # Only where a program makes several calls: files from before the option read as 1.
        **({"calls_per_program": args.calls_per_program} if args.calls_per_program > 1 else {}),
        "warmup": args.warmup,
        "settle_seconds": timing.SETTLE_SECONDS,
        "seed": args.seed,
        "compile_threads": args.compile_threads,
        "primed": args.prime,
        "env": {name: os.environ.get(name) for name in (
            "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "constants": {
            "exp_per_s": measure.EXP_PER_S, "matmul_flop_per_s": measure.MATMUL_FLOP_PER_S,
            "l2_bytes": measure.L2_BYTES, "exps_per_logit": measure.EXPS_PER_LOGIT,
            "matmul_flops_per_logit_and_dim": measure.MATMUL_FLOPS_PER_LOGIT_AND_DIM,
            "masked_fraction": shapes.RANDOM_MASKED_FRACTION,
            "note": "floor constants are an H200's; on other devices the fractions are only indicative",
        },
    }


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None, prog: str | None = None):
    gpu = on_gpu()
    defaults = shapes.GPU_DEFAULT_SHAPES if gpu else shapes.CPU_DEFAULT_SHAPES
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(defaults),
                        help=f"comma-separated names ({', '.join(shapes.SHAPES)}) or "
                             "BxSxNxHxd[:padded] (default: %(default)s)")
    parser.add_argument("--dtypes", default=",".join(shapes.DEFAULT_DTYPES),
                        help=f"q/k/v dtypes, of {', '.join(shapes.DTYPES)} (default %(default)s)")
    parser.add_argument("--bias-dtypes", default=",".join(shapes.BIAS_DTYPES),
                        help="bias dtypes: f32 and/or input (the q/k/v dtype); float32 inputs "
                             "get one case for both (default %(default)s)")
    parser.add_argument("--impls", default="table",
                        help=f"comma-separated, of {', '.join(IMPLEMENTATIONS)}; `table` "
                             f"(the default) is {', '.join(TABLE_IMPLEMENTATIONS)}, `all` every "
                             "one (msa_pallas's own variants and the no-bias reference point "
                             "too); those that cannot run here are recorded as skipped")
    parser.add_argument("--iters", type=int, default=10 if gpu else 5,
                        help="timed samples per measurement (default 10 on GPU, 5 on CPU)")
    parser.add_argument("--reps", type=int, default=10 if gpu else 1,
                        help="back-to-back calls per timed sample (default 10 on GPU, 1 on CPU)")
    parser.add_argument("--calls-per-program", type=int, default=1,
                        help="each timed call a compiled program making this many calls of the "
                             "implementation (`measure.in_one_program`): "
                             "the host's cost of dispatching a program left out of the time per "
                             "call, as inside a model's step (default 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")
    parser.add_argument("--prime", action=argparse.BooleanOptionalAction, default=gpu,
                        help="measure the first case once, its numbers dropped, before it is "
                             "measured for the table (default on a GPU: see `prime`)")
    parser.add_argument("--compile-threads", type=int, default=4,
                        help="a case's cells are compiled this many at a time before the first "
                             "is timed (1: each just before it is timed; default 4)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for results.json, results.md, results.png "
                             "(default benchmarks/out/op); a rerun continues its results.json")
    runs.add_run_options(parser, unit="case (or, in a case longer than the budget, a cell)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args.shapes = [shapes.parse_shape(name) for name in split_list(args.shapes)]
    except ValueError as exc:
        parser.error(str(exc))
    args.dtypes = split_list(args.dtypes)
    args.bias_dtypes = split_list(args.bias_dtypes)
    args.impls = [name for group in split_list(args.impls)
                  for name in IMPLEMENTATION_GROUPS.get(group, (group,))]
    for kind, chosen, known in (("dtype", args.dtypes, shapes.DTYPES),
                                ("bias dtype", args.bias_dtypes, shapes.BIAS_DTYPES),
                                ("impl", args.impls, IMPLEMENTATIONS)):
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            parser.error(f"unknown or no {kind} {', '.join(unknown)}; expected {', '.join(known)}")
    if min(args.iters, args.reps, args.compile_threads, args.calls_per_program) < 1:
        parser.error("--iters, --reps, --compile-threads and --calls-per-program must be >= 1")
    return args


def cases(args) -> list[shapes.Case]:
    """Every (dtype, shape, bias dtype): a shape's bias dtypes side by side in the table."""
    return [shapes.Case(shape, dtype, bias)
            for dtype in args.dtypes for shape in args.shapes
            for bias in shapes.bias_dtype_names(dtype, args.bias_dtypes)]




def unfinished(record: dict | None, impl: str) -> bool:
    """Whether the cell of `impl` (both modes) in a case's record is still to be measured."""
    entry = (record or {}).get("impls", {}).get(impl)
    return entry is None or any(mode not in entry for mode in measure.MODES)


def _union(*lists) -> list:
    return list(dict.fromkeys(item for items in lists for item in items))


def start_results(args) -> tuple[dict, str | None]:
    """(results, None): the earlier results in `--out` to continue, or new ones; or
    (None, why) when the file there is of another commit, device or setting."""
    now = metadata(args)
    earlier = None if args.fresh else runs.read_json(args.out / "results.json")
    if earlier is None:
        return {"metadata": {**now, "runs": []}, "cases": []}, None
    meta = earlier["metadata"]
    why = runs.same_run(meta, now, SAME_RUN_KEYS)
    if why is not None:
        return None, why
    meta["impls"] = _union(meta["impls"], now["impls"])
    meta["dtypes"] = _union(meta["dtypes"], now["dtypes"])
    meta["bias_dtypes"] = _union(meta["bias_dtypes"], now["bias_dtypes"])
    meta["shapes"] = {**meta["shapes"], **now["shapes"]}
    meta.setdefault("runs", [])
    return earlier, None


def all_measured(results: dict) -> bool:
    """Whether every cell that any call asked for (`runs`: its cases and impls) is there."""
    records = {measure.case_key(record): record for record in results["cases"]}
    return not any(unfinished(records.get(key), impl)
                   for run in results["metadata"]["runs"]
                   for key in run["cases"] for impl in run["impls"])


def date_range(meta: dict) -> str:
    """When the cells of a results file were measured: a date, or `FIRST to LAST`."""
    dates = [run["date_utc"] for run in meta.get("runs", []) if run.get("cells")]
    if not dates:
        return meta["date_utc"]
    return dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"


def say_what_cannot_run(args) -> None:
    """Without a GPU: which shapes the defaults leave out, and why."""
    if on_gpu():
        return
    left_out = [name for name in shapes.GPU_DEFAULT_SHAPES
                if name not in {shape.name for shape in args.shapes}]
    if left_out:
        print(f"# no GPU ({jax.default_backend()}): the kernels run in their interpreters, "
              f"where the table's shapes ({', '.join(left_out)}) would take hours; measuring "
              f"{', '.join(s.name for s in args.shapes)} (--shapes NAME,... runs others)",
              flush=True)


def cannot_run_lines(results: dict) -> list[str]:
    """One line per implementation with a cell that could not run here, and why."""
    reasons: dict[str, list[str]] = {}
    for case in results["cases"]:
        for impl, entry in case["impls"].items():
            for mode in measure.MODES:
                status = entry.get(mode, {}).get("status", "ok")
                if status.startswith("skipped: ") and status not in reasons.get(impl, []):
                    reasons.setdefault(impl, []).append(status)
    return [f"#   {impl}: {'; '.join(s.removeprefix('skipped: ') for s in why)}"
            for impl, why in reasons.items()]


class _Unreported:
    """A `runs.Progress` that reports nothing: the priming case's cells."""

    def describe(self, text: str) -> None:
        pass

    def result(self, line: str) -> None:
        pass


def prime(case: shapes.Case, impls: list[str], settings: measure.Settings) -> float:
    """Measures `case` once, every cell of it, and drops the numbers; returns the seconds.

    The first case of a run read its forward cells slow, every implementation's
    alike, after the GPU warm-up, with tight samples, while its f+b cells and
    the later cases read as in other runs (H200: msa_pallas' forward at the
    training crop 0.093 against 0.071 ms on the same kernel later in the run,
    2026-12-04; tokamax's Mosaic forward at train_padded 0.140 against 0.117 ms
    in another run, 2026-12-05). Priming gives the table's first case the
    place of a second one.
    """
    started = time.monotonic()
    measure.run_case(case, impls, settings, _Unreported())
    return time.monotonic() - started


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    budget = runs.Budget(args.budget)
    results, why = start_results(args)
    if results is None:
        print(f"# {args.out}/results.json is of another run ({why}): pass --fresh to start "
              "over, or another --out", file=sys.stderr)
        return 2
    meta = results["metadata"]
    records = {measure.case_key(record): record for record in results["cases"]}
    todo = [(case, [impl for impl in args.impls if unfinished(records.get(case.key), impl)])
            for case in cases(args)]
    todo = [(case, impls) for case, impls in todo if impls]
    cells_left = sum(len(impls) for _, impls in todo)
    say_what_cannot_run(args)
    print(f"# {meta['device_kind']} ({meta['backend']}), jax {meta['jax_version']}, "
          f"commit {meta['commit']}, impls {','.join(args.impls)}, "
          f"iters {args.iters} x reps {args.reps}; {cells_left} cells to measure"
          + (f" ({sum(len(c['impls']) for c in results['cases'])} done in {args.out})"
             if results["cases"] else ""), flush=True)
    this_run = {"date_utc": runs.utc_now(), "argv": runs.portable_argv(args.argv), "cells": 0,
                "cases": [case.key for case in cases(args)], "impls": args.impls}
    meta["runs"].append(this_run)
    settings = measure.Settings(iters=args.iters, warmup=args.warmup, reps=args.reps,
                                seed=args.seed, compile_threads=args.compile_threads,
                                calls_per_program=args.calls_per_program)
    if todo and args.compile_threads == 1:
        # Compiled ahead, each case's cells warm the GPU up after their compiles.
        timing.warm_up_device()
    if todo and args.prime:
        seconds = prime(*todo[0], settings)
        print(f"# primed: {todo[0][0].key} measured once, dropped ({seconds:.0f} s)", flush=True)
    progress = runs.Progress(cells_left * len(measure.MODES))
    stopped = False
    try:
        for case, impls in todo:
            # A whole case in one call where it fits, so that a row's ratios are measured
            # side by side; a case longer than the budget is split between calls by cell.
            if not budget.allows_another("case"):
                stopped = True
                break
            case_started = budget.elapsed()
            record = records.get(case.key)
            record, done = measure.run_case(case, impls, settings, progress, record, budget)
            budget.spent(budget.elapsed() - case_started, "case")
            if case.key not in records and record["impls"]:
                records[case.key] = record
                results["cases"].append(record)
            this_run["cells"] += done
            cells_left -= done
            meta["date_utc"] = date_range(meta)
            this_run["elapsed_s"] = budget.elapsed()
            meta["elapsed_s"] = sum(run.get("elapsed_s", 0.0) for run in meta["runs"])
            meta["complete"] = all_measured(results)
            report.write_outputs(results, args.out)
            if done < len(impls):
                stopped = True
                break
    finally:
        progress.close()
    meta["complete"] = all_measured(results)
    if not this_run["cells"]:
        meta["runs"].remove(this_run)  # a call that measured nothing leaves no trace
    report.write_outputs(results, args.out)
    why_not = report.plot(results, args.out / "results.png")
    print(f"# wrote {args.out}/results.json, results.md"
          + (f"; no plot: {why_not}" if why_not else ", results.png"), flush=True)
    print(f"# this call {budget.elapsed():.0f} s\n", flush=True)
    print(report.markdown_table(results), end="", flush=True)
    cannot = cannot_run_lines(results)
    if cannot:
        print("\n# not run here, and why:\n" + "\n".join(cannot), flush=True)
    if stopped:
        print(f"\n# stopped before the budget of {args.budget:g} s with {cells_left} cells "
              "left: the same command continues", flush=True)
        return runs.EXIT_UNFINISHED
    return 0
