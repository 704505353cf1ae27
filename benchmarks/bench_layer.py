"""Times the Flax layer `MSARowAttentionWithPairBias`: forward, and forward + backward.

Forward + backward is `jax.value_and_grad` of a scalar loss w.r.t. the
parameters AND both inputs (msa_repr, pair_repr), all under `jax.jit`, with
bf16 compute (`dtype=jnp.bfloat16`, float32 parameters) by default. Each
implementation of the attention op ("pallas", "xla") is timed at the same
shapes; the table gives the median milliseconds and the ratio xla / pallas
(> 1: the Pallas layer is faster). XLA's compiled temporary memory of the
forward + backward is reported where the backend gives it.

    PYTHONPATH=. python3 benchmarks/bench_layer.py --out benchmarks/out/layer     # GPU: train, finetune
    PYTHONPATH=. python3 benchmarks/bench_layer.py --shapes tiny --iters 3 --warmup 1   # CPU smoke test

Shapes (SPEC §4, AlphaFold2 Evoformer row attention: c_m=256, c_z=128, H=8, d=32):
  train     B=1, S=128, N=256
  finetune  B=1, S=512, N=384
  tiny      B=1, S=4,   N=24, c_m=32, c_z=16, H=4 (CPU; Pallas runs in interpret mode)

Writes `results.json` to `--out DIR` (rows: shape, implementation, fwd_ms,
fwd_bwd_ms, temp_bytes, error) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from msa_pallas.layers import MSARowAttentionWithPairBias

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from msa_pallas.timing import batched_times_ms  # noqa: E402

SHAPES = {
    "tiny": dict(B=1, S=4, N=24, msa_dim=32, pair_dim=16, heads=4),
    "train": dict(B=1, S=128, N=256, msa_dim=256, pair_dim=128, heads=8),
    "finetune": dict(B=1, S=512, N=384, msa_dim=256, pair_dim=128, heads=8),
}
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def make_inputs(shape: dict, input_dtype, seed: int = 0):
    k_m, k_z, k_mask, k_cot = jax.random.split(jax.random.key(seed), 4)
    B, S, N = shape["B"], shape["S"], shape["N"]
    m = jax.random.normal(k_m, (B, S, N, shape["msa_dim"]), input_dtype)
    z = jax.random.normal(k_z, (B, N, N, shape["pair_dim"]), input_dtype)
    mask = jax.random.bernoulli(k_mask, 0.9, (B, S, N)).at[..., 0].set(True)
    cot = jax.random.normal(k_cot, (B, S, N, shape["msa_dim"]), jnp.float32)
    return m, z, mask, cot


def time_fn(fn, args, warmup: int, iters: int, reps: int) -> float:
    """Median per-call milliseconds of `fn(*args)` (already compiled) over
    `iters` samples of `reps` back-to-back calls (`msa_pallas.timing.batched_times_ms`)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(batched_times_ms(lambda i: fn(*args), samples=iters, reps=reps))


def temp_bytes(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def bench_one(
    shape_name: str, implementation: str, dtype, input_dtype, warmup: int, iters: int, reps: int
) -> dict:
    shape = SHAPES[shape_name]
    layer = MSARowAttentionWithPairBias(
        msa_dim=shape["msa_dim"], pair_dim=shape["pair_dim"], num_heads=shape["heads"],
        implementation=implementation, dtype=dtype,
    )
    m, z, mask, cot = make_inputs(shape, input_dtype)
    params = jax.jit(layer.init)(jax.random.key(1), m, z, mask)["params"]

    def forward(params, m, z, mask):
        return layer.apply({"params": params}, m, z, mask, deterministic=True)

    def loss(params, m, z, mask, cot):
        out = forward(params, m, z, mask)
        return jnp.sum(out.astype(jnp.float32) * cot)

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    row = dict(shape=shape_name, implementation=implementation, **shape,
               head_dim=shape["msa_dim"] // shape["heads"], dtype=jnp.dtype(dtype).name,
               input_dtype=jnp.dtype(input_dtype).name)
    try:
        fwd_c = fwd.lower(params, m, z, mask).compile()
        fwd_bwd_c = fwd_bwd.lower(params, m, z, mask, cot).compile()
        row["temp_bytes"] = temp_bytes(fwd_bwd_c)
        row["fwd_ms"] = time_fn(fwd_c, (params, m, z, mask), warmup, iters, reps)
        row["fwd_bwd_ms"] = time_fn(fwd_bwd_c, (params, m, z, mask, cot), warmup, iters, reps)
        out = fwd_c(params, m, z, mask)
        row["finite"] = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    except Exception as err:  # e.g. out of memory: record it and go on
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        traceback.print_exc(file=sys.stderr)
    return row


def fmt_ms(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def markdown(rows: list[dict], impls: list[str]) -> str:
    lines = []
    header = ["shape", "B, S, N, H, d"]
    for impl in impls:
        header += [f"{impl} fwd", f"{impl} f+b"]
    if "pallas" in impls and "xla" in impls:
        header += ["fwd xla/pallas", "f+b xla/pallas"]
    header += [f"{impl} f+b temp GB" for impl in impls]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by_impl = {r["implementation"]: r for r in rows if r["shape"] == shape}
        any_row = next(iter(by_impl.values()))
        cells = [shape, f"{any_row['B']}, {any_row['S']}, {any_row['N']}, {any_row['heads']}, {any_row['head_dim']}"]
        for impl in impls:
            r = by_impl.get(impl, {})
            if "error" in r:
                cells += ["error", "error"]
            else:
                cells += [fmt_ms(r.get("fwd_ms")), fmt_ms(r.get("fwd_bwd_ms"))]
        if "pallas" in impls and "xla" in impls:
            p, x = by_impl.get("pallas", {}), by_impl.get("xla", {})
            for key in ("fwd_ms", "fwd_bwd_ms"):
                if p.get(key) and x.get(key):
                    cells.append(f"{x[key] / p[key]:.2f}×")
                else:
                    cells.append("–")
        for impl in impls:
            t = by_impl.get(impl, {}).get("temp_bytes")
            cells.append("–" if t is None else f"{t / 1e9:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma-separated from %s (default: train,finetune on GPU, tiny elsewhere)"
                        % ",".join(SHAPES))
    p.add_argument("--impls", default="pallas,xla")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="compute dtype")
    p.add_argument("--input-dtype", default=None, choices=sorted(DTYPES),
                   help="dtype of msa_repr/pair_repr (default: the compute dtype)")
    p.add_argument("--warmup", type=int, default=None, help="default 5 on GPU, 1 elsewhere")
    p.add_argument("--iters", type=int, default=None, help="samples; default 10 on GPU, 3 elsewhere")
    p.add_argument("--reps", type=int, default=None,
                   help="back-to-back calls per sample; default 10 on GPU, 1 elsewhere")
    p.add_argument("--out", default=None, help="directory for results.json")
    args = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    shapes = (args.shapes or ("train,finetune" if on_gpu else "tiny")).split(",")
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    impls = args.impls.split(",")
    for impl in impls:
        if impl not in ("pallas", "xla"):
            p.error(f"unknown implementation {impl!r}; choose pallas and/or xla")
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 3)
    reps = args.reps if args.reps is not None else (10 if on_gpu else 1)
    dtype = DTYPES[args.dtype]
    input_dtype = DTYPES[args.input_dtype or args.dtype]

    device = jax.devices()[0]
    print(f"# MSARowAttentionWithPairBias layer, {jnp.dtype(dtype).name} compute, "
          f"{jnp.dtype(input_dtype).name} inputs, float32 params; device: {device.device_kind} "
          f"({jax.default_backend()}); jax {jax.__version__}; median of {iters} samples of {reps} calls after {warmup} warm-up",
          flush=True)
    if not on_gpu and "pallas" in impls:
        print("# no GPU: 'pallas' runs the kernels in interpret mode (slow; a smoke test only)", flush=True)
    rows = []
    for shape in shapes:
        for impl in impls:
            start = time.perf_counter()
            row = bench_one(shape, impl, dtype, input_dtype, warmup, iters, reps)
            row["wall_s"] = round(time.perf_counter() - start, 2)
            rows.append(row)
            status = row.get("error") or (f"fwd {fmt_ms(row['fwd_ms'])} ms, "
                                          f"f+b {fmt_ms(row['fwd_bwd_ms'])} ms")
            print(f"  {shape:9s} {impl:7s} {status}  ({row['wall_s']} s)", flush=True)
    table = markdown(rows, impls)
    print()
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(device=device.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                    python=platform.python_version(), warmup=warmup, iters=iters, reps=reps,
                    dtype=jnp.dtype(dtype).name, input_dtype=jnp.dtype(input_dtype).name,
                    xla_flags=os.environ.get("XLA_FLAGS", ""))
        (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, table=table), indent=2))
        print(f"\nwrote {out / 'results.json'}")
    return rows


if __name__ == "__main__":
    main()
