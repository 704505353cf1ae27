"""Times one AlphaFold2 Evoformer iteration, AlphaFold2's own against msa_pallas inside it.

The block is `alphafold.model.modules.EvoformerIteration` of alphafold-colabfold
2.3.27 with AlphaFold2's configuration (`msa_pallas.alphafold2.evoformer_iteration`):

- `unpatched`: AlphaFold2 as it ships (its attention in XLA, its `subbatch_size`
  = 4 inference chunking of the row and triangle attention as it is);
- `patched`: the same block traced inside `msa_pallas.alphafold2.patched()`: its
  MSARowAttentionWithPairBias and both TriangleAttention modules on the fused op
  (the op's default kernels; at inference the rows in chunks of
  `--inference-chunk-mib` of projections, the patch's default
  `alphafold2.INFERENCE_CHUNK_BYTES`), everything else AlphaFold2's.

Same random parameters (every weight moved off AF2's zero init) and inputs for
both. For each block, N, dtype and mode:

- `inference`: `is_training=False`, deterministic, jitted forward;
- `train`: `jax.value_and_grad` of a scalar loss of both outputs w.r.t. the
  parameters, `is_training=True` with AF2's dropout, jitted;

the median milliseconds, XLA's memory analysis of the compiled program
(`peak_bytes` = arguments + outputs + temporaries - aliased; `temp_bytes`), and
for `patched` the relative error of its inference outputs against `unpatched`.
The (up to four) cells of a block, N and dtype are compiled together,
`--compile-threads` at a time, and timed one after the other once all are
compiled, so that no compile (XLA autotunes on the GPU) runs beside a timing;
`compile_s` is each cell's tracing and compile time, the compiles overlapping.
A cell that fails (e.g. out of memory) is recorded with its error and the run
goes on.

Blocks and MSA depths (AlphaFold2's monomer config): `evoformer` c_m = 256,
c_z = 128, S = 512 (max_msa_clusters); `extra_msa` c_m = 64, c_z = 128,
S = 1024 (max_extra_msa of models 3-5; `--extra-depth 5120` for models 1-2).

    python -m benchmarks model --out benchmarks/out/evoformer
    python -m benchmarks model --sizes 256,384 --dtypes bf16 --blocks evoformer \\
        --out benchmarks/out/evoformer_small
    python -m benchmarks model --sizes 16 --msa-depth 4 --extra-depth 4 \\
        --iters 1 --warmup 0 --out /tmp/evo                               # CPU smoke test

Writes `results.json` in `--out` (meta, rows), rewritten after every cell, and
prints a Markdown table (time ratio > 1: patched is faster). A rerun with the same
`--out` (same commit, device and settings) keeps the rows there and measures the rest;
`--budget SECONDS` stops before a block, N and dtype that the longest so far says would
not end in time (exit status 4) and the same command continues.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report, runs, timing
from msa_pallas import alphafold2

BLOCKS = {"evoformer": dict(c_m=256, c_z=128, extra_msa=False),
          "extra_msa": dict(c_m=64, c_z=128, extra_msa=True)}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
VARIANTS = ("unpatched", "patched")
MODES = ("inference", "train")


def make_inputs(S, N, c_m, c_z, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    msa = jax.random.normal(keys[0], (S, N, c_m), dtype)
    pair = jax.random.normal(keys[1], (N, N, c_z), dtype)
    msa_mask = jax.random.bernoulli(keys[2], 0.95, (S, N)).astype(jnp.float32)
    pair_mask = jnp.ones((N, N), jnp.float32)
    return msa, pair, msa_mask, pair_mask


def randomised(params, seed=1):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype) / np.sqrt(x.shape[0] if x.ndim > 1 else 1)
        for x, k in zip(leaves, keys)])


def step_fn(forward, mode):
    if mode == "inference":
        return forward.apply

    def loss(params, key, *inputs):
        msa, pair = forward.apply(params, key, *inputs)
        return (jnp.mean(jnp.square(msa.astype(jnp.float32)))
                + jnp.mean(jnp.square(pair.astype(jnp.float32))))

    return jax.value_and_grad(loss)


def memory(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
        return {"peak_bytes": int(peak), "temp_bytes": int(m.temp_size_in_bytes)}
    except Exception:  # not every backend reports it
        return {"peak_bytes": None, "temp_bytes": None}


def lower_cell(block, n, dtype_name, mode, variant, args, params, key, inputs):
    """Traces one cell's jitted step (the patch is global, so tracing stays on one thread)."""
    forward = alphafold2.evoformer_iteration(extra_msa=BLOCKS[block]["extra_msa"],
                                             is_training=mode == "train",
                                             deterministic=mode != "train")
    step = jax.jit(step_fn(forward, mode))
    if variant == "patched":
        chunk = args.inference_chunk_mib * 2**20 if args.inference_chunk_mib else None
        with alphafold2.patched(inference_chunk_bytes=chunk):
            return step.lower(params, key, *inputs)
    return step.lower(params, key, *inputs)


def measure_cell(row, compiling, args, params, key, inputs, outputs):
    """Times one compiled cell into `row`; a failure (e.g. out of memory) is recorded."""
    try:
        compiled, seconds = compiling.result()
        row["compile_s"] = round(seconds, 1)
        row.update(memory(compiled))
        out = jax.block_until_ready(compiled(params, key, *inputs))
        row["ms"] = timing.median_ms(lambda i: compiled(params, key, *inputs),
                                     samples=args.iters, reps=args.reps, warmup=args.warmup)
        if row["mode"] == "inference":
            outputs[row["variant"]] = [np.asarray(x, np.float32) for x in out]
            if row["variant"] == "patched" and "unpatched" in outputs:
                row["rel_err_vs_unpatched"] = max(
                    float(np.linalg.norm(a - b) / np.linalg.norm(b))
                    for a, b in zip(outputs["patched"], outputs["unpatched"]))
        row["status"] = "ok"
        del out
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result too
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
    return row


def measure_group(block, n, dtype_name, modes, args, progress):
    """The cells of one block, N and dtype: traced one after the other, compiled
    `args.compile_threads` at a time, then timed one after the other with nothing else
    on the GPU (XLA's autotuning runs kernels while it compiles). Yields each row."""
    spec = BLOCKS[block]
    S = args.extra_depth if spec["extra_msa"] else args.msa_depth
    inputs = make_inputs(S, n, spec["c_m"], spec["c_z"], DTYPES[dtype_name])
    key = jax.random.key(2)
    init = alphafold2.evoformer_iteration(extra_msa=spec["extra_msa"], is_training=False).init
    params = randomised(jax.jit(init)(key, *inputs))
    cells = [(mode, variant) for mode in modes for variant in VARIANTS]
    with timing.compiling_ahead(args.compile_threads) as pool:
        compiling = {}
        for mode, variant in cells:
            progress.describe(f"{block} N={n} {dtype_name} {mode} {variant}: tracing")
            compiling[mode, variant] = timing.start_compile(
                pool, lambda mode=mode, variant=variant: lower_cell(
                    block, n, dtype_name, mode, variant, args, params, key, inputs))
    for mode in modes:
        outputs = {}
        for variant in VARIANTS:
            progress.describe(f"{block} N={n} {dtype_name} {mode} {variant}")
            row = dict(block=block, N=n, S=S, c_m=spec["c_m"], c_z=spec["c_z"],
                       dtype=dtype_name, mode=mode, variant=variant)
            yield measure_cell(row, compiling.pop((mode, variant)), args, params, key, inputs,
                               outputs)


# Metadata a results file must share with this run for the run to continue it.
SAME_RUN_KEYS = ("device", "backend", "jax", "commit", "settings")


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,384,768,1024")
    parser.add_argument("--dtypes", default="bf16,f32")
    parser.add_argument("--modes", default="inference,train")
    parser.add_argument("--blocks", default="evoformer,extra_msa")
    parser.add_argument("--msa-depth", type=int, default=512)
    parser.add_argument("--extra-depth", type=int, default=1024)
    parser.add_argument("--inference-chunk-mib", type=int,
                        default=alphafold2.INFERENCE_CHUNK_BYTES // 2**20,
                        help="the patched modules' inference row chunks (0: none)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/out/evoformer")
    parser.add_argument("--compile-threads", type=int, default=4,
                        help="cells of a block, N and dtype compiled at once (1: one by one)")
    runs.add_run_options(parser, unit="block, N and dtype (up to four cells)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    settings = dict(msa_depth=args.msa_depth, extra_depth=args.extra_depth, warmup=args.warmup,
                    iters=args.iters, reps=args.reps, chunk_mib=args.inference_chunk_mib,
                    compile_threads=args.compile_threads)
    meta = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                jax=jax.__version__, python=platform.python_version(),
                commit=runs.commit_id(args.commit), date=runs.utc_now(), settings=settings,
                command=" ".join(["python -m benchmarks model",
                                  *runs.portable_argv(sys.argv[1:] if argv is None else argv)]),
                alphafold="alphafold-colabfold 2.3.27",
                # The allocator's share of the GPU decides which large baselines fit.
                env={name: os.environ.get(name) for name in (
                    "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                    "XLA_FLAGS")})
    rows = runs.earlier_rows(out_dir, meta, SAME_RUN_KEYS, fresh=args.fresh)
    done = {(r["block"], r["N"], r["dtype"], r["mode"], r["variant"]) for r in rows}
    groups: dict[tuple, list[str]] = {}  # (block, N, dtype) -> modes to measure
    for block in args.blocks.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            for dtype_name in args.dtypes.split(","):
                for mode in args.modes.split(","):
                    if any((block, n, dtype_name, mode, v) not in done for v in VARIANTS):
                        groups.setdefault((block, n, dtype_name), []).append(mode)
    budget = runs.Budget(args.budget)
    progress = runs.Progress(sum(len(modes) for modes in groups.values()) * len(VARIANTS))
    stopped = False
    for (block, n, dtype_name), modes in groups.items():
        if not budget.allows_another():
            stopped = True
            break
        started = time.monotonic()
        # A mode's pair (unpatched, patched) is measured together.
        rows = [r for r in rows
                if (r["block"], r["N"], r["dtype"]) != (block, n, dtype_name)
                or r["mode"] not in modes]
        for row in measure_group(block, n, dtype_name, modes, args, progress):
            rows.append(row)
            progress.result(json.dumps(row))
            runs.write_json(out_dir / "results.json", {"meta": meta, "rows": rows})
        budget.spent(time.monotonic() - started)
    progress.close()
    meta["complete"] = not stopped
    runs.write_json(out_dir / "results.json", {"meta": meta, "rows": rows})
    table = report.model_table(rows)
    (out_dir / "results.md").write_text(table + "\n")
    print(table)
    if stopped:
        print(f"# stopped before the budget of {args.budget:g} s: the same command continues")
        return runs.EXIT_UNFINISHED
    return 0 if all(r["status"] == "ok" for r in rows) else 1
