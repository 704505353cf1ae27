"""Forward + backward of MSA row attention on every visible device against one device.

For every (shape, variant, axis) it times `f+b`, the forward plus the gradients, on one
device and sharded over a 1-D mesh of all visible devices, and reports the speed-up
(one-device time / sharded time), the efficiency (speed-up / devices), the collectives
of the compiled sharded program and how far the sharded gradients are from the
one-device ones.

    python -m benchmarks multi-gpu --out DIR                          # all GPUs
    python -m benchmarks multi-gpu --out DIR --shapes long --axes rows --iters 20
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m benchmarks multi-gpu --out DIR --shapes 1x8x16x4x8 --iters 1
        # CPU, simulated devices (the plain-jnp path unless --implementation pallas)

Variants:

- `op-f32-bias`: `msa_pallas.msa_row_attention`, q/k/v in --dtype (default bf16), a
  float32 bias, 90% of keys kept at random; gradients of q, k, v and bias.
- `op-bias-in-dtype`: the same with the bias in q's dtype.
- `layer`: `msa_pallas.MSARowAttentionWithPairBias` (c_m = H * d, c_z = 128, --dtype
  compute, bf16 inputs); gradients of the parameters, the MSA and the pair inputs.

Axes (the mesh has one axis over all devices):

- `rows`: the MSA rows S are sharded (S must divide by the device count). The bias
  gradient is a sum over S: each device sums its rows in float32 and the partial sums
  are all-reduced in float32 (the layer also all-reduces its parameter gradients).
- `heads`: the heads H are sharded. For the layer this is head (tensor) parallelism:
  the q/k/v/gate and pair-bias projections are sharded by output feature and the output
  projection by input feature, so the output and the MSA gradient are all-reduced.
- `batch`: the batch B is sharded. B = 1 in the shapes below, so the batch rows run
  with B = the device count, on one device and sharded (the one-device time is then
  that of the larger batch: the same work on both sides).

The mesh axes are Auto by default (the compiler propagates the inputs' shardings);
`--axis-type explicit` puts the sharding in the types instead (the op's kernels then run
under a shard_map; the layer's head-parallel projections need out_sharding annotations
that it does not have, so its heads rows fail there).

`dbias max rel` is max |dbias_sharded - dbias_one| / max |dbias_one| (the layer: its
pair-input gradient, which the bias gradient feeds); `grads max rel` is the largest
such ratio over all the gradients (`grads_max_rel_by_name` in results.json has each).
With a bias in a 16-bit dtype the bias gradient is summed in float32 and rounded once,
so it stays within one spacing of that dtype (2^-7 relative for bfloat16) of the
one-device gradient, usually equal to it. The layer's parameter gradients with bf16
compute come from Flax's Dense backward in bf16: each device's part of a parameter
gradient is rounded to bf16 before the cross-device sum, so they differ from one
device's by a few 1e-2 of their largest entry (rows, batch); head parallelism sums
each device's bf16 part of the MSA and pair gradients the same way (~1e-2).

`--budget S` starts no run that the longest so far says would end after S seconds; the
MSA-row runs go first (every shape and variant), then heads, then batch, and what is left
is recorded as skipped (exit status 4). A rerun with the same `--out` (same devices, dtype and timing)
keeps the rows there that ran and measures the rest.

Writes `DIR/results.json` (every number, the collectives and the run's metadata) and
`DIR/results.md` (a Markdown table), and prints the table. A failure (out of memory, a
shape that does not divide) is recorded in its row and never stops the run.

On CPU, `--implementation pallas` with the bf16 layer sharded over rows can take many
minutes to compile: XLA's simplify-while-loops pass on the interpret-mode kernels
(`XLA_FLAGS=--xla_disable_hlo_passes=simplify-while-loops` avoids it). GPUs compile
the kernels to Triton calls and are not affected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from benchmarks import runs, timing

from benchmarks.multi_gpu_problems import VARIANTS, make_problem
from benchmarks.shapes import DIMS

SHAPES = DIMS  # (B, S, N, H, d) by name
DEFAULT_SHAPES = ("train", "finetune", "long", "extra")
AXES = ("rows", "heads", "batch")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """A name of SHAPES or `BxSxNxHxd`."""
    if text in SHAPES:
        return text, SHAPES[text]
    parts = text.lower().split("x")
    if len(parts) == 5 and all(p.isdigit() and int(p) > 0 for p in parts):
        return text, tuple(int(p) for p in parts)
    raise ValueError(f"unknown shape {text!r}; expected one of {', '.join(SHAPES)} or BxSxNxHxd")


def collectives(hlo: str) -> dict:
    """Counts of each collective in HLO text (async `-start` forms included), and
    `"shapes"`: the result type of each, layouts dropped, e.g.
    `"f32[1,8,1024,1024] all-reduce"` (a combined one: `"(f32[8], bf16[4,4]) all-reduce"`)."""
    counts = {op: 0 for op in COLLECTIVES}
    shapes = []
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            found = re.search(rf"=\s*(.*?)\s+{op}(?:-start)?\(", line)
            if found:
                counts[op] += 1
                shapes.append(f"{re.sub(r'{[^}]*}', '', found.group(1))} {op}")
    counts["shapes"] = shapes
    return counts


@jax.jit
def _max_abs_differences(a, b):
    """Per leaf: (max |a - b|, max |b|), in float32 on the device (the difference of
    two bf16 or f16 numbers is exact in float32)."""
    def one(x, y):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        return jnp.max(jnp.abs(x - y)), jnp.max(jnp.abs(y))
    return jax.tree.map(one, a, b)


def max_rel(a, b, mesh) -> dict:
    """{leaf path: max |a - b| / max |b|} over two pytrees of arrays, `a` sharded
    over `mesh`, `b` anywhere (it is moved to `a`'s shardings)."""
    b = jax.device_put(b, jax.tree.map(lambda x: x.sharding, a))
    with jax.set_mesh(mesh):
        pairs = jax.device_get(_max_abs_differences(a, b))
    flat = jax.tree_util.tree_leaves_with_path(pairs, is_leaf=lambda x: isinstance(x, tuple))
    return {
        jax.tree_util.keystr(path): float(diff) / (float(scale) if scale > 0 else 1.0)
        for path, (diff, scale) in flat
    }


def time_ms(compiled, args, samples: int, reps: int) -> dict:
    times = timing.times_ms(lambda i: compiled(*args), samples=samples, reps=reps)
    return dict(median_ms=statistics.median(times), min_ms=min(times))


def one_device(key, variant, dims, dtype, implementation, device, samples, reps, cache):
    """The problem and its one-device run: (problem, compiled program, its
    arguments on `device`, timing), cached by (shape name, dims, variant)."""
    if key not in cache:
        problem = make_problem(variant, dims, dtype, implementation, seed=0)
        single = jax.device_put(problem[1], device)
        compiled = jax.jit(problem[0]).lower(*single).compile()
        cache[key] = (problem, compiled, single, time_ms(compiled, single, samples, reps))
    return cache[key]


def bench_one(name, dims, variant, axis, devices, dtype, implementation, samples, reps,
              cache: dict, axis_type=AxisType.Auto) -> dict:
    n = len(devices)
    if axis == "batch":
        dims = (n, *dims[1:])
    B, S, N, H, d = dims
    row = dict(shape=name, dims=list(dims), variant=variant, axis=axis, devices=n, error=None)
    size = {"batch": B, "rows": S, "heads": H}[axis]
    if size % n:
        row["error"] = f"{axis} ({size}) does not divide over {n} devices"
        return row
    # One device (shared by the axes of the same dims: rows and heads).
    problem, single_compiled, single, one = one_device(
        (name, tuple(dims), variant), variant, dims, dtype, implementation, devices[0],
        samples, reps, cache)
    f_and_b, args, specs, bias_grad, vanishing = problem

    mesh = jax.make_mesh((n,), (axis,), devices=devices, axis_types=(axis_type,))
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs(axis),
        is_leaf=lambda x: isinstance(x, P),
    )
    sharded = jax.device_put(single, shardings)
    start = time.perf_counter()
    compiled = jax.jit(f_and_b).lower(*sharded).compile()
    row["compile_s"] = time.perf_counter() - start
    found = collectives(compiled.as_text())
    many = found.pop("shapes")
    row["collectives"] = found
    row["collective_shapes"] = sorted(set(many))
    sharded_time = time_ms(compiled, sharded, samples, reps)

    by_name = max_rel(compiled(*sharded)[1], single_compiled(*single)[1], mesh)
    del sharded
    row["grads_max_rel_by_name"] = by_name
    meaningful = {k: e for k, e in by_name.items() if k not in vanishing}
    row["worst_grad"] = max(meaningful, key=meaningful.get)
    row["grads_max_rel"] = meaningful[row["worst_grad"]]
    row["dbias_max_rel"] = by_name[f"['{bias_grad}']"]
    row["one_ms"], row["one_min_ms"] = one["median_ms"], one["min_ms"]
    row["sharded_ms"], row["sharded_min_ms"] = sharded_time["median_ms"], sharded_time["min_ms"]
    row["speedup"] = one["median_ms"] / sharded_time["median_ms"]
    row["efficiency"] = row["speedup"] / n
    return row


# --- the report --------------------------------------------------------------------------


def error_line(text: str) -> str:
    """The exception line of a traceback (the last `SomethingError: ...` line)."""
    lines = text.strip().splitlines()
    found = [l for l in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", l)]
    return (found or lines or [""])[-1]


def fmt(x, spec=".3g") -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"f+b on {meta['devices']} x {meta['device_kind']} against one, "
        f"{meta['dtype']} inputs, implementation {meta['implementation']}, "
        f"{meta['axis_type']} mesh axes, "
        f"median of {meta['samples']} samples of {meta['reps']} calls (ms).",
        "",
        "| shape | variant | axis | 1 device | sharded | speed-up | efficiency "
        "| collectives | dbias max rel | grads max rel |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['shape']} | {r['variant']} | {r['axis']} | skipped: "
                         f"{r['skipped']} |||||||")
            continue
        if r.get("error"):
            text = error_line(r["error"]).replace("|", "/")[:160]
            lines.append(f"| {r['shape']} | {r['variant']} | {r['axis']} | error: {text} |||||||")
            continue
        coll = ", ".join(f"{v} {k}" for k, v in r["collectives"].items() if v) or "none"
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['axis']} | {fmt(r['one_ms'])} "
            f"| {fmt(r['sharded_ms'])} | {r['speedup']:.2f}x | {100 * r['efficiency']:.0f}% "
            f"| {coll} | {fmt(r['dbias_max_rel'], '.2e')} | {fmt(r['grads_max_rel'], '.2e')} |"
        )
    if any(r["axis"] == "batch" for r in rows):
        lines += ["", "batch rows: B = the device count on both sides (the shapes have B = 1)."]
    return "\n".join(lines) + "\n"


# Metadata a results file must share with this run for the run to continue it.
SAME_RUN_KEYS = ("devices", "device_kind", "backend", "jax", "dtype", "implementation",
                 "axis_type", "samples", "reps")


def main(argv=None, prog: str | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, help="directory for results.json and results.md")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"names ({', '.join(SHAPES)}) or BxSxNxHxd, comma-separated")
    p.add_argument("--axes", default=",".join(AXES), help="comma-separated, of " + ", ".join(AXES))
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--implementation", default=None, choices=["pallas", "xla"],
                   help="default: the op's choice (the kernels on GPU, plain jnp on CPU)")
    p.add_argument("--iters", type=int, default=10, help="calls per sample (default 10)")
    p.add_argument("--samples", type=int, default=5, help="samples; the median is reported")
    p.add_argument("--axis-type", default="auto", choices=["auto", "explicit"],
                   help="the mesh axis type: auto (sharding propagated by the compiler, "
                        "the default) or explicit (sharding in types)")
    # What a budget leaves out (recorded as skipped, the MSA-row runs first) is in the epilog.
    runs.add_run_options(p, unit="run", commit=False)
    p.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    args = p.parse_args(argv)

    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    except ValueError as e:
        p.error(str(e))
    axes = [a for a in args.axes.split(",") if a]
    variants = [v for v in args.variants.split(",") if v]
    for a in axes:
        if a not in AXES:
            p.error(f"unknown axis {a!r}; expected among {', '.join(AXES)}")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; expected among {', '.join(VARIANTS)}")
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    if len(devices) < 2:
        print(f"warning: {len(devices)} device(s) visible; the sharded runs use them all",
              file=sys.stderr)
    dtype = DTYPES[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        devices=len(devices), device_kind=devices[0].device_kind, backend=jax.default_backend(),
        jax=jax.__version__, python=platform.python_version(), dtype=args.dtype,
        implementation=args.implementation or "default", axis_type=args.axis_type, samples=args.samples, reps=args.iters,
        nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
    )
    print(json.dumps(meta), flush=True)

    kept = [row for row in runs.earlier_rows(args.out, meta, SAME_RUN_KEYS, fresh=args.fresh)
            if not row.get("skipped")]
    done = {(row["shape"], row["variant"], row["axis"]) for row in kept}

    # The MSA-row runs first (for every shape and variant), then heads, then batch:
    # with --budget, what is left out is the least asked for.
    plan = [(name, dims, variant, axis) for axis in axes for name, dims in shapes
            for variant in variants if (name, variant, axis) not in done]
    rows, cache = list(kept), {}
    budget = runs.Budget(args.budget)
    progress = runs.Progress(len(plan))
    started = time.perf_counter()
    for name, dims, variant, axis in plan:
        start = time.perf_counter()
        if not budget.allows_another():
            rows.append(dict(shape=name, dims=list(dims), variant=variant, axis=axis,
                             devices=len(devices), error=None,
                             skipped=f"time budget of {args.budget:g} s spent"))
            continue
        progress.describe(f"{name} {variant} {axis}")
        try:
            row = bench_one(name, dims, variant, axis, devices, dtype, args.implementation,
                            args.samples, args.iters, cache,
                            getattr(AxisType, args.axis_type.capitalize()))
        except Exception:  # recorded in its row
            row = dict(shape=name, dims=list(dims), variant=variant, axis=axis,
                       devices=len(devices), error=traceback.format_exc())
        row["wall_s"] = time.perf_counter() - start
        budget.spent(row["wall_s"])
        rows.append(row)
        if row.get("error"):
            progress.result(f"{name} {variant} {axis}: error {error_line(row['error'])}")
        else:
            progress.result(
                f"{name} {variant} {axis}: one {row['one_ms']:.3f} ms, sharded "
                f"{row['sharded_ms']:.3f} ms, {row['speedup']:.2f}x "
                f"({100 * row['efficiency']:.0f}%), dbias max rel "
                f"{row['dbias_max_rel']:.2e}, {row['collectives']} [{row['wall_s']:.1f} s]")
        runs.write_json(Path(args.out) / "results.json", dict(meta=meta, rows=rows))
    progress.close()
    meta["wall_s"] = time.perf_counter() - started
    order = {key: i for i, key in enumerate(
        (name, variant, axis) for name, _ in shapes for variant in variants for axis in axes)}
    rows.sort(key=lambda r: order.get((r["shape"], r["variant"], r["axis"]), len(order)))
    runs.write_json(Path(args.out) / "results.json", dict(meta=meta, rows=rows))
    table = markdown(rows, meta)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print("\n" + table, flush=True)
    if any(row.get("skipped") for row in rows):
        print(f"# stopped before the budget of {args.budget:g} s: the same command "
              "continues", flush=True)
        raise SystemExit(runs.EXIT_UNFINISHED)
    return rows
