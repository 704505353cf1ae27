"""Times the Flax layer `MSARowAttentionWithPairBias` with each attention core: a training step.

The layer is AlphaFold2's (`MSARowAttentionWithPairBias.alphafold2`: LayerNorms on the MSA
and the pair inputs, no q/k/v biases, AF2's gate initialisation), dropout off, bf16
compute and float32 parameters by default; its output projection is initialised like
the others rather than to zero, so that the cores' outputs can be compared (same
parameters, same inputs). Only its attention core changes between rows:

- `pallas`, `xla`: the layer's own op, `msa_pallas.msa_row_attention(implementation=...)`.
- `cuequivariance`, `tokamax_mosaic`, `tokamax_triton`: the other packages' ops, swapped
  in through the layer's `attention_fn` (adapters in benchmarks/alternatives.py, which
  apply the gate themselves). Reported as skipped where the layer has no `attention_fn`
  field, without a GPU, or without the package.

`--preset reference` times the reference layer instead
(`MSARowAttentionWithPairBias(...)`, the PyTorch layer's twin: q/k/v without
LayerNorm options of AF2, attention dropout). A core named `CORE+dropout` is
CORE with the layer's dropout at `--dropout` (default 0.1) and
`deterministic=False` in both the forward and the step (a fresh `"dropout"`
key per call): attention dropout in the reference preset, AF2's shared-row
output dropout in the alphafold2 one. A `+skip` suffix (after `+dropout`
where both) compiles the core's forward and step inside
`msa_pallas.skipping_padding()`; the table then gives each `+skip` core's
time against the same core's without: what skipping saves on the padded
shapes (`train_padded`, `extra_padded`: a padded batch's mask,
benchmarks/shapes.py), what it costs on the others (nothing to skip).

For each core: the forward, and a training step, `jax.value_and_grad` of a scalar loss
w.r.t. the parameters AND both inputs (msa_repr, pair_repr), all under `jax.jit`; the
median milliseconds, the ratio of each core's time to `pallas`' (> 1: the Pallas layer
is faster), XLA's compiled temporary + output memory of the step where the backend
gives it, and the relative error of each core's forward output against the first core's
at that shape (a swapped core that maps the layout or the gate wrongly shows here).

    python -m benchmarks layer --out benchmarks/out/layer     # GPU: train, finetune, extra
    python -m benchmarks layer --shapes tiny --iters 3 --warmup 1   # CPU smoke test

Shapes (benchmarks/shapes.py, with the AlphaFold2 layer's channels c_m and c_z):
  train     B=1, S=128,  N=256, H=8, d=32, c_m=256, c_z=128   Evoformer, training crop
  finetune  B=1, S=512,  N=384, H=8, d=32, c_m=256, c_z=128   Evoformer, fine-tuning crop
  extra     B=1, S=1024, N=384, H=8, d=8,  c_m=64,  c_z=128   extra-MSA stack
  train_padded, extra_padded: train and extra with the padded masks of shapes.py
  tiny      B=1, S=4,    N=64,  H=2, d=16, c_m=32,  c_z=16    CPU (Pallas in interpret mode)

Writes `results.json` to `--out DIR` (meta: device, commit, date, ...; rows: shape, core,
fwd_ms, fwd_bwd_ms, temp_bytes, status, error), rewritten after every row so that a run
cut short keeps what it measured, and prints a Markdown table. A rerun with the same
`--out` (same commit, device, dtypes and timing) keeps the rows there and measures the
rest; `--budget SECONDS` stops before a row that would not end in time (exit status 4)
and the same command continues.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from pathlib import Path


import jax
import jax.numpy as jnp

from benchmarks import runs, timing
from benchmarks.alternatives import LAYER_CORES, Unavailable
from msa_pallas import skipping_padding
from msa_pallas.layers import MSARowAttentionWithPairBias
from benchmarks.shapes import LAYER_CHANNELS, SHAPES, Shape, make_mask

# The layer's own `implementation`s: "default" is None (what a user gets:
# the Mosaic GPU kernels on Hopper where they run), "pallas" the Triton kernels.
OWN_CORES = ("default", "pallas", "mosaic", "xla")
CORES = OWN_CORES + tuple(LAYER_CORES)
DROPOUT = "+dropout"  # a core's suffix: the same core with the layer's dropout on
SKIP = "+skip"  # a core's last suffix: the same core inside msa_pallas.skipping_padding()
PRESETS = ("alphafold2", "reference")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def layer_shape(name: str) -> dict:
    """B, S, N, H, d of the attention, the layer's channels c_m (msa_dim), c_z (pair_dim),
    and `padding`: a padded shape's fractions of padding (MSA rows, residues), else None."""
    shape = SHAPES[name]
    b, s, n, h, d = shape.dims
    msa_dim, pair_dim = LAYER_CHANNELS[name]
    assert msa_dim == h * d, (name, msa_dim, h, d)
    padding = shape.padding if shape.mask == "padded" else None
    return dict(B=b, S=s, N=n, heads=h, head_dim=d, msa_dim=msa_dim, pair_dim=pair_dim,
                padding=padding)


def core_flags(core: str) -> tuple[str, bool, bool]:
    """(the core, with dropout, skipping padding) of a core name `CORE[+dropout][+skip]`;
    ValueError for a name of another form."""
    skip = core.endswith(SKIP)
    base = core.removesuffix(SKIP)
    dropout = base.endswith(DROPOUT)
    base = base.removesuffix(DROPOUT)
    if base not in CORES:
        raise ValueError(f"unknown core {core!r}; choose from {', '.join(CORES)} (each with "
                         f"optional {DROPOUT} and {SKIP} suffixes, in that order)")
    return base, dropout, skip


def supports_attention_fn(layer_cls=MSARowAttentionWithPairBias) -> bool:
    """Whether the layer takes an `attention_fn` (a core with msa_row_attention's signature)."""
    return "attention_fn" in getattr(layer_cls, "__dataclass_fields__", {})


def core_options(core: str, layer_cls=MSARowAttentionWithPairBias) -> dict:
    """The layer's fields that select `core` (its suffixes ignored); raises
    `Unavailable` where it cannot run."""
    core, _, _ = core_flags(core)
    if core == "mosaic" and jax.default_backend() != "gpu":
        raise Unavailable("the Mosaic GPU kernels are timed on a GPU only")
    if core in OWN_CORES:
        return {"implementation": None if core == "default" else core}
    if not supports_attention_fn(layer_cls):
        raise Unavailable(f"{layer_cls.__name__} has no attention_fn field: the core "
                          "cannot be swapped in")
    return {"attention_fn": LAYER_CORES[core]()}


def make_inputs(shape: dict, input_dtype, seed: int = 0):
    """msa_repr `[B, S, N, c_m]`, pair_repr `[B, N, N, c_z]`, mask `[B, S, N]` (90% kept,
    the first residue always; a padded shape's padding masked, `shapes.make_mask`) and a
    float32 cotangent `[B, S, N, c_m]`."""
    # XLA's RngBitGenerator: compiles in a fraction of the time of threefry on CPU.
    k_m, k_z, k_mask, k_cot = jax.random.split(jax.random.key(seed, impl="rbg"), 4)
    B, S, N = shape["B"], shape["S"], shape["N"]
    m = jax.random.normal(k_m, (B, S, N, shape["msa_dim"]), input_dtype)
    z = jax.random.normal(k_z, (B, N, N, shape["pair_dim"]), input_dtype)
    mask = jax.random.bernoulli(k_mask, 0.9, (B, S, N)).at[..., 0].set(True)
    if shape.get("padding") is not None:
        dims = (B, S, N, shape["heads"], shape["head_dim"])
        mask = make_mask(Shape("padded", dims, mask="padded", padding=shape["padding"]), k_mask)
    cot = jax.random.normal(k_cot, (B, S, N, shape["msa_dim"]), jnp.float32)
    return m, z, mask, cot


def time_fn(fn, args, warmup: int, iters: int, reps: int) -> float:
    """Median per-call milliseconds of `fn(*args)` (already compiled) (`timing.median_ms`)."""
    return timing.median_ms(lambda i: fn(*args), samples=iters, reps=reps, warmup=warmup)


def temp_bytes(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def relative_error(out, reference) -> float:
    out, reference = (jnp.asarray(x, jnp.float32) for x in (out, reference))
    return float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))


def make_layer(shape: dict, preset: str, dropout: float, dtype, options: dict):
    """The layer timed: AF2's preset (output projection not zero-initialised,
    so that cores can be compared) or the reference one."""
    dims = dict(msa_dim=shape["msa_dim"], pair_dim=shape["pair_dim"], num_heads=shape["heads"])
    if preset == "reference":
        return MSARowAttentionWithPairBias(**dims, dropout=dropout, dtype=dtype, **options)
    return MSARowAttentionWithPairBias.alphafold2(
        **dims, dropout=dropout, zero_init_output=False, dtype=dtype, **options)


def meta_layer(preset: str) -> str:
    if preset == "reference":
        return "MSARowAttentionWithPairBias(...)"
    return "MSARowAttentionWithPairBias.alphafold2(zero_init_output=False)"


class LayerProgram:
    """The layer's jitted forward and training step at one shape, and their arguments.

    The step is `jax.value_and_grad` of `sum(forward * cot)` w.r.t. the parameters and
    both inputs; with `rate > 0` both run with `deterministic=False` and a `"dropout"`
    key, which `args` carries (unused without dropout).
    """

    def __init__(self, shape: dict, preset: str, rate: float, dtype, input_dtype,
                 options: dict):
        self.rate = rate
        self.layer = make_layer(shape, preset, rate, dtype, options)
        m, z, mask, cot = make_inputs(shape, input_dtype)
        # The parameters depend on the channels only: one MSA row and one residue
        # initialise them in a small program, whatever the shape.
        params = jax.jit(self.layer.init)(
            jax.random.key(1, impl="rbg"), m[:, :1, :1], z[:, :1, :1], mask[:, :1, :1])["params"]
        self.args = (params, m, z, mask, cot, jax.random.key(2))

    def forward(self, params, m, z, mask, key):
        if not self.rate:
            return self.layer.apply({"params": params}, m, z, mask, deterministic=True)
        return self.layer.apply({"params": params}, m, z, mask, deterministic=False,
                                rngs={"dropout": key})

    def loss(self, params, m, z, mask, cot, key):
        return jnp.sum(self.forward(params, m, z, mask, key).astype(jnp.float32) * cot)

    def compile(self):
        """(forward, step), compiled for `args`: `forward(*args[:4], args[5])`, `step(*args)`."""
        params, m, z, mask, cot, key = self.args
        forward = jax.jit(self.forward).lower(params, m, z, mask, key).compile()
        step = jax.jit(jax.value_and_grad(self.loss, argnums=(0, 1, 2)))
        return forward, step.lower(*self.args).compile()


def bench_one(shape_name: str, core: str, dtype, input_dtype, warmup: int, iters: int,
              reps: int, reference=None, preset: str = "alphafold2",
              dropout: float = 0.1) -> tuple[dict, object]:
    """One row: the layer at `shape_name` with `core`, forward and training step
    (`dropout` applies to a `+dropout` core only).

    Returns (row, forward output or None); `reference`, an earlier core's output,
    gives the row's `rel_err` (its core's name is `reference_core`; not for
    cores with dropout, whose outputs differ by design)."""
    shape = layer_shape(shape_name)
    row = dict(shape=shape_name, core=core, implementation=core, **shape,
               dtype=jnp.dtype(dtype).name, input_dtype=jnp.dtype(input_dtype).name)
    try:
        options = core_options(core)
    except Unavailable as why:
        row.update(status=f"skipped: {why}")
        return row, None
    _, dropped, skips = core_flags(core)
    rate = dropout if dropped else 0.0
    row["dropout"], row["skips_padding"] = rate, skips
    out = None
    try:
        program = LayerProgram(shape, preset, rate, dtype, input_dtype, options)
        with skipping_padding(skips):  # read when the programs are traced, here
            fwd_c, step_c = program.compile()
        params, m, z, mask, cot, key = program.args
        row["temp_bytes"] = temp_bytes(step_c)
        row["fwd_ms"] = time_fn(fwd_c, (params, m, z, mask, key), warmup, iters, reps)
        row["fwd_bwd_ms"] = time_fn(step_c, (params, m, z, mask, cot, key), warmup, iters, reps)
        out = fwd_c(params, m, z, mask, key)
        row["finite"] = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        if reference is not None and not rate:
            row["rel_err"] = relative_error(out, reference)
        row["status"] = "ok"
    except Exception as err:  # e.g. out of memory: record it and go on
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        row["status"] = "error"
        traceback.print_exc(file=sys.stderr)
        out = None
    return row, out


def fmt_ms(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def markdown(rows: list[dict], cores: list[str]) -> str:
    """One row per shape: each core's fwd and step times, ratios to msa_pallas' own
    (the "default" core, else "pallas"), step memory."""
    subject = next((core for core in ("default", "pallas") if core in cores), None)
    others = [core for core in cores if core != subject] if subject else []
    header = ["shape", "B, S, N, H, d", "c_m, c_z"]
    header += [f"{core} {mode}" for core in cores for mode in ("fwd", "f+b")]
    header += [f"{core} / {subject} fwd, f+b" for core in others]
    header += [f"{core} f+b temp GB" for core in cores]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by_core = {r["core"]: r for r in rows if r["shape"] == shape}
        r0 = next(iter(by_core.values()))
        cells = [shape, f"{r0['B']}, {r0['S']}, {r0['N']}, {r0['heads']}, {r0['head_dim']}",
                 f"{r0['msa_dim']}, {r0['pair_dim']}"]
        for core in cores:
            status = by_core.get(core, {}).get("status", "–")
            if status == "ok":
                cells += [fmt_ms(by_core[core]["fwd_ms"]), fmt_ms(by_core[core]["fwd_bwd_ms"])]
            else:
                cells += ["n/a" if status.startswith("skipped") else status] * 2
        ours = by_core.get(subject, {})
        for core in others:
            theirs = by_core.get(core, {})
            cells.append(", ".join(
                f"{theirs[key] / ours[key]:.2f}×" if ours.get(key) and theirs.get(key)
                else "–" for key in ("fwd_ms", "fwd_bwd_ms")))
        for core in cores:
            t = by_core.get(core, {}).get("temp_bytes")
            cells.append("–" if t is None else f"{t / 1e9:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    checked = [r for r in rows if "rel_err" in r]
    if checked:
        lines += ["", "Forward output against the first core's at the same shape (relative "
                  "error): " + ", ".join(f"{r['shape']} {r['core']} vs {r['reference_core']} "
                                          f"{r['rel_err']:.1e}" for r in checked)]
    lines += dropout_lines(rows)
    lines += skipping_lines(rows)
    skipped = {f"{r['core']}: {r['status']}" for r in rows if r["status"].startswith("skipped")}
    if skipped:
        lines += ["", *sorted(f"- {text}" for text in skipped)]
    return "\n".join(lines)


# The dropout targets: the training step with dropout on the kernels within this factor
# of the step without dropout, and this many times faster than the XLA path with dropout.
DROPOUT_STEP_SLACK = 1.15
DROPOUT_TARGET_SPEEDUP = 2.0


def dropout_lines(rows: list[dict]) -> list[str]:
    """Per shape measured with `default`, `default+dropout` and `xla+dropout`: the
    step (f+b) with dropout on the kernels against the step without (at most
    DROPOUT_STEP_SLACK) and against the XLA path's with dropout (at least
    DROPOUT_TARGET_SPEEDUP times faster)."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        step = {r["core"]: r.get("fwd_bwd_ms") for r in rows
                if r["shape"] == shape and r.get("status") == "ok"}
        plain, kernels, xla = (step.get(core) for core in
                               ("default", "default" + DROPOUT, "xla" + DROPOUT))
        if not (plain and kernels and xla):
            continue
        slower, faster = kernels / plain, xla / kernels
        lines.append(
            f"- {shape}: step with dropout / without {slower:.2f} (target ≤ "
            f"{DROPOUT_STEP_SLACK:g}: {'yes' if slower <= DROPOUT_STEP_SLACK else 'no'}); "
            f"XLA path with dropout / the kernels' {faster:.2f}× (target ≥ "
            f"{DROPOUT_TARGET_SPEEDUP:g}×: {'yes' if faster >= DROPOUT_TARGET_SPEEDUP else 'no'})")
    return ["", "Attention dropout (f+b, the training step):", "", *lines] if lines else []


def skipping_lines(rows: list[dict]) -> list[str]:
    """Per shape, each `CORE+skip` core's forward and step against CORE's (skipping
    the padding against visiting it), beside the fraction of the attention's B·S·N²
    logits a padded shape's mask keeps."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by_core = {r["core"]: r for r in rows if r["shape"] == shape and r.get("status") == "ok"}
        for core, row in by_core.items():
            visiting = by_core.get(core.removesuffix(SKIP))
            if not core.endswith(SKIP) or visiting is None:
                continue
            ratios = ", ".join(f"{mode} {row[key] / visiting[key]:.2f}" for mode, key in
                               (("fwd", "fwd_ms"), ("f+b", "fwd_bwd_ms")))
            if row.get("padding"):
                rows_padding, residues_padding = row["padding"]
                kept = (1 - rows_padding) * (1 - residues_padding)
                about = f"the mask keeps {kept:.2f} of the logits"
            else:
                about = "no padding: nothing to skip"
            lines.append(f"- {shape}: {core} / {visiting['core']}: {ratios} ({about})")
    return ["", "Padding skipped (skipping / visiting):", "", *lines] if lines else []


# Metadata a results file must share with this run for the run to continue it.
SAME_RUN_KEYS = ("device", "backend", "jax", "commit", "warmup", "iters", "reps", "dtype",
                 "input_dtype", "preset", "dropout")


def main(argv=None, prog: str | None = None) -> list[dict]:
    """Runs the benchmark; returns its rows (those of an earlier call with the same --out too)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma-separated from %s (default: train,finetune,extra on GPU, tiny "
                        "elsewhere)" % ",".join(LAYER_CHANNELS))
    p.add_argument("--cores", "--impls", dest="cores", default=",".join(CORES),
                   help="attention cores, comma-separated from %(default)s (default: all)")
    p.add_argument("--preset", default="alphafold2", choices=PRESETS,
                   help="the layer: AF2's preset (default) or the reference layer's")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="the layer's dropout for the CORE+dropout cores (default 0.1)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="compute dtype")
    p.add_argument("--input-dtype", default=None, choices=sorted(DTYPES),
                   help="dtype of msa_repr/pair_repr (default: the compute dtype)")
    p.add_argument("--warmup", type=int, default=None, help="default 5 on GPU, 1 elsewhere")
    p.add_argument("--iters", type=int, default=None, help="samples; default 10 on GPU, 3 elsewhere")
    p.add_argument("--reps", type=int, default=None,
                   help="back-to-back calls per sample; default 10 on GPU, 1 elsewhere")
    p.add_argument("--out", default=None,
                   help="directory for results.json (rewritten after every row)")
    runs.add_run_options(p, unit="row")
    args = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    shapes = (args.shapes or ("train,finetune,extra" if on_gpu else "tiny")).split(",")
    for s in shapes:
        if s not in LAYER_CHANNELS:
            p.error(f"unknown shape {s!r}; choose from {', '.join(LAYER_CHANNELS)}")
    cores = [c for c in args.cores.split(",") if c]
    for core in cores:
        try:
            core_flags(core)
        except ValueError as error:
            p.error(str(error))
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 3)
    reps = args.reps if args.reps is not None else (10 if on_gpu else 1)
    dtype = DTYPES[args.dtype]
    input_dtype = DTYPES[args.input_dtype or args.dtype]

    device = jax.devices()[0]
    print(f"# {meta_layer(args.preset)} layer, {jnp.dtype(dtype).name} compute, "
          f"{jnp.dtype(input_dtype).name} inputs, float32 params; device: {device.device_kind} "
          f"({jax.default_backend()}); jax {jax.__version__}; median of {iters} samples of "
          f"{reps} calls after {warmup} warm-up; attention_fn "
          f"{'supported' if supports_attention_fn() else 'not supported'}", flush=True)
    if not on_gpu and "pallas" in cores:  # ("default" is the XLA path there)
        print("# no GPU: 'pallas' runs the kernels in interpret mode (slow; a smoke test only)",
              flush=True)
    meta = dict(device=device.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                python=platform.python_version(), commit=runs.commit_id(args.commit),
                date_utc=runs.utc_now(),
                warmup=warmup, iters=iters, reps=reps,
                dtype=jnp.dtype(dtype).name, input_dtype=jnp.dtype(input_dtype).name,
                preset=args.preset, dropout=args.dropout,
                layer=meta_layer(args.preset),
                attention_fn_supported=supports_attention_fn(),
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    out_dir = Path(args.out) if args.out else None
    rows = runs.earlier_rows(out_dir, meta, SAME_RUN_KEYS, fresh=args.fresh)
    if rows:
        print(f"# continuing {out_dir}/results.json: {len(rows)} rows there", flush=True)

    def save(table=None):
        # After every row, so that a run cut short keeps the rows it measured.
        if out_dir is not None:
            runs.write_json(out_dir / "results.json", dict(meta=meta, rows=rows, table=table))

    done = {(row["shape"], row["core"]): row for row in rows}
    todo = [(shape, core) for shape in shapes for core in cores if (shape, core) not in done]
    budget = runs.Budget(args.budget)
    progress = runs.Progress(len(todo))
    references = {}  # shape -> (the first core's output at it, that core)
    stopped = False
    for shape, core in todo:
        if not budget.allows_another():
            stopped = True
            break
        start = time.perf_counter()
        reference, reference_core = references.get(shape, (None, None))
        progress.describe(f"{shape} {core}")
        row, out = bench_one(shape, core, dtype, input_dtype, warmup, iters, reps, reference,
                             preset=args.preset, dropout=args.dropout)
        if reference is None and out is not None:
            references[shape] = (out, core)
        elif "rel_err" in row:
            row["reference_core"] = reference_core
        del out
        row["wall_s"] = round(time.perf_counter() - start, 2)
        budget.spent(row["wall_s"])
        rows.append(row)
        status = row.get("error") or (
            f"fwd {fmt_ms(row['fwd_ms'])} ms, f+b {fmt_ms(row['fwd_bwd_ms'])} ms"
            + (f", rel.err vs {reference_core} {row['rel_err']:.1e}" if "rel_err" in row
               else "") if row["status"] == "ok" else row["status"])
        progress.result(f"  {shape:9s} {core:15s} {status}  ({row['wall_s']} s)")
        save()
    progress.close()
    order = {key: i for i, key in enumerate((s, c) for s in shapes for c in cores)}
    rows.sort(key=lambda row: order.get((row["shape"], row["core"]), len(order)))
    table = markdown(rows, cores)
    print()
    print(table)
    if out_dir is not None:
        save(None if stopped else table)
        print(f"\nwrote {out_dir / 'results.json'}")
    if stopped:
        print(f"# stopped before the budget of {args.budget:g} s: the same command continues")
        raise SystemExit(runs.EXIT_UNFINISHED)
    return rows
