"""The Mosaic GPU kernels one at a time, as the op calls them: what padding skipping
and attention dropout save or cost in each.

    python -m benchmarks profile variants --shapes train_padded,extra_padded,long_padded
    python -m benchmarks profile variants --shapes train,finetune,extra --variants plain,dropout
    python -m benchmarks profile variants --shapes train_padded --variants plain,dropout,dropout+skip
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false \\
        python -m benchmarks profile variants --shapes tiny      # CPU: the interpreters, a check

For each shape (with its own mask: the padded shapes' padding, the others' random
10% of keys), 16-bit q dtype and bias dtype, the op's plan (`dispatch.plan_call`,
the Mosaic backend) names the kernels and their tiles, and each kernel runs alone
on the same operands in each variant, with the tiles the op plans in that variant:

- `plain`: every tile visited, no dropout (the op's default);
- `skip`: the key tiles and MSA rows the mask removes skipped (`skip_masked`, what
  the op does inside `msa_pallas.skipping_padding()`), the bounds and the dead rows'
  means computed inside the timed call as the op computes them;
- `dropout`: attention dropout at `--dropout-rate`, the words computed inside the
  timed call;
- `dropout+skip`: both (the masked key tiles of live rows skipped, dead rows visited
  by the forward and dk/dv, whose dropped uniform weights have no shortcut).

`--tiles "forward=128x64x2x2x1x1;dkdv=64x64x2x2"` also times each named kernel with
these candidates (`BQxBKxSTAGESxROWS[xPING_PONG[xPERSISTENT[xSTAGGERED_BIAS[
xMASK_WITHOUT_SELECT]]]]`, comma-separated), in every variant, as
`KERNEL BQxBKxSTAGESxROWS...` rows: which tiles suit a variant. `--kernel-options
staggered_bias=0,mask_without_select=0` also times every kernel with its planned tiles
and those flags of `MosaicTiles` set, as `KERNEL with OPTIONS` rows.

Then the op itself, forward and forward+backward (`jax.grad` of q, k, v, bias and
gate), in each variant. A time is the median of `--samples` batches of `--reps`
back-to-back calls, divided by `--reps`. The table gives each variant's ms and its
ratio to `plain`; beside the shape, the kept fraction of the B·S·N² logits (the
mask's mean): the ratio to `plain` that skipping could reach.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.measure import kept_fraction
from benchmarks.profiling.kernels import backward_delta, make_inputs, mosaic_text, parse_mosaic
from benchmarks.profiling.launches import parse_kernel_options
from benchmarks.shapes import DTYPES, HALF_DTYPES, SHAPES, bias_dtype_names, make_mask
from msa_pallas import dispatch, dropout, msa_row_attention, skipping_padding
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.support import pad_head_dim

VARIANTS = ("plain", "skip", "dropout", "dropout+skip")
SKIPPING = ("skip", "dropout+skip")
DROPPING = ("dropout", "dropout+skip")
INTERPRET = jax.default_backend() != "gpu"


def make_operands(shape_name: str, dtype, bias_dtype, seed: int = 0) -> dict:
    """`profiling.kernels.make_inputs` at the shape (q, k, v, the output gradient `do` and
    the gate `[B, S, N, H, d]` in `dtype`, the bias `[B, H, N, N]` in `bias_dtype`), with
    the shape's own bool mask `[B, S, N]` and dropout row seeds `[B, S, H]`."""
    shape = SHAPES[shape_name]
    b, s, _, h, _ = shape.dims
    q, k, v, do, gate, bias, _ = make_inputs(shape.dims, dtype, seed, bias_dtype)
    mask_key, seeds_key = jax.random.split(jax.random.key(seed + 1))
    return dict(q=q, k=k, v=v, do=do, gate=gate, bias=bias, mask=make_mask(shape, mask_key),
                seeds=dropout.row_seeds(seeds_key, b, s, h))


MOSAIC_KERNELS = ("forward", "dkdv", "dq", "dbias")


def parse_candidates(text: str) -> dict[str, list]:
    """`"forward=128x64x2x2x1x1;dkdv=64x64x2x2,64x128x2x1"` -> {kernel: [MosaicTiles]}."""
    candidates = {}
    for group in filter(None, text.split(";")):
        kernel, _, tiles = group.partition("=")
        if kernel not in MOSAIC_KERNELS:
            raise SystemExit(f"--tiles: unknown kernel {kernel!r}; expected one of "
                             f"{MOSAIC_KERNELS}")
        candidates[kernel] = parse_mosaic(tiles)
    return candidates


def kernel_calls(ops: dict, plan, variant: str, rate: float, candidates=None,
                 options: dict | None = None) -> dict:
    """{kernel name: a call of it alone}, each kernel with the plan's tiles and the
    variant's keywords, on operands as the op hands them over (mask int8, d padded as
    the plan pads it, the backward's statistics from the plain forward); then each of
    `candidates` ({kernel: [MosaicTiles]}) as "KERNEL TILES". A backward candidate's
    ping_pong field sets the dk/dv and dq kernels' turns. With `options` (fields of
    `MosaicTiles`), each kernel again with its planned tiles and those fields set, as
    "KERNEL with NAME=VALUE,..."."""
    scale = ops["q"].shape[-1] ** -0.5
    q, k, v, do, gate = (ops[name] for name in ("q", "k", "v", "do", "gate"))
    if plan.forward_head_dim > q.shape[-1]:
        q, k, v, do, gate = (pad_head_dim(x) for x in (q, k, v, do, gate))
    bias, mask = ops["bias"], ops["mask"].astype(jnp.int8)
    if plan.bias_dtype is not None:
        bias = bias.astype(plan.bias_dtype)
    keywords = {"skip_masked": variant in SKIPPING}
    seeds = None
    if variant in DROPPING:
        keywords["dropout_rate"] = rate
        seeds = ops["seeds"]
    common = dict(scale=scale, interpret=plan.interpret, **keywords)
    _, attention, row_max, row_log2_sum = mosaic_forward.attention_forward(
        q, k, v, bias, mask, gate, scale=scale, tiles=plan.forward_tiles,
        interpret=plan.interpret, save_stats=True)
    stats = jnp.stack([row_max, row_log2_sum, backward_delta(do, attention)], axis=3)

    def forward_call(tiles):
        return lambda: mosaic_forward.attention_forward(
            q, k, v, bias, mask, gate, seeds, tiles=tiles, save_stats=True, **common)

    def backward_call(name, tiles, ping_pong):
        kernel = getattr(mosaic_backward, f"backward_{name}")
        extra = {"ping_pong": ping_pong} if name in ("dkdv", "dq") else {}
        return lambda: kernel(q, k, v, bias, mask, do, stats, seeds, tiles=tiles, **common,
                              **extra)

    calls = {"forward": forward_call(plan.forward_tiles)}
    for name, tiles in plan.backward_tiles:
        calls[name] = backward_call(name, tiles, plan.ping_pong)
    for name, tried in (candidates or {}).items():
        for tiles in tried:
            calls[f"{name} {mosaic_text(tiles)}"] = (
                forward_call(tiles) if name == "forward"
                else backward_call(name, tiles, tiles.ping_pong))
    if options:
        label = ",".join(f"{key}={int(value)}" for key, value in options.items())
        calls[f"forward with {label}"] = forward_call(
            dataclasses.replace(plan.forward_tiles, **options))
        for name, tiles in plan.backward_tiles:
            calls[f"{name} with {label}"] = backward_call(
                name, dataclasses.replace(tiles, **options), plan.ping_pong)
    return calls


def parse_tile_options(text: str) -> dict[str, bool]:
    """`parse_kernel_options` of flags of `MosaicTiles` alone: the kernels here
    run one by one, so an option of the backward's kernels together
    (`prologue_kernel`) has nothing to act on."""
    return parse_kernel_options(text, op_options=False)


def op_calls(ops: dict, variant: str, rate: float) -> dict:
    """{"op forward": ..., "op forward+backward": ...} of `msa_row_attention` in the
    variant (traced inside `skipping_padding()` for `SKIPPING`)."""
    mask = ops["mask"]
    options = {}
    if variant in DROPPING:
        options = dict(dropout_rate=rate, dropout_rng=jax.random.key(3))

    def forward(q, k, v, bias, gate):
        return msa_row_attention(q, k, v, bias, mask, gate, implementation="mosaic", **options)

    def loss(q, k, v, bias, gate):
        return jnp.sum(forward(q, k, v, bias, gate).astype(jnp.float32)
                       * ops["do"].astype(jnp.float32))

    args = tuple(ops[name] for name in ("q", "k", "v", "bias", "gate"))
    with skipping_padding() if variant in SKIPPING else contextlib.nullcontext():
        # Traced (and compiled) here, inside the context.
        compiled = {
            "op forward": jax.jit(forward).lower(*args).compile(),
            "op forward+backward": jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
            .lower(*args).compile(),
        }
    return {name: (lambda fn=fn: fn(*args)) for name, fn in compiled.items()}


def profile_case(shape_name, dtype_name, bias_name, args, emit) -> None:
    dtype = DTYPES[dtype_name]
    bias_dtype = DTYPES[bias_name]
    ops = make_operands(shape_name, dtype, bias_dtype)

    def plan_of(variant):
        """The op's plan in `variant`: with dropout its tiles may differ."""
        dropout_options = {}
        if variant in DROPPING:
            dropout_options = dict(dropout_rate=args.dropout_rate, dropout_rng=jax.random.key(3))
        plan = dispatch.plan_call(ops["q"], ops["k"], ops["v"], ops["bias"], ops["mask"],
                                  ops["gate"], implementation="mosaic", **dropout_options)
        if plan.forward != "mosaic" or plan.backward != "mosaic":
            raise SystemExit(f"{shape_name} {dtype_name}: the op plans {plan.forward} / "
                             f"{plan.backward} kernels here, not Mosaic's ({plan.reason})")
        return plan

    label = f"{shape_name} (kept {kept_fraction(ops['mask']):.2f}) | {dtype_name} | {bias_name}"
    times: dict[str, dict[str, float | str]] = {}
    for variant in args.variants:
        try:
            calls = kernel_calls(ops, plan_of(variant), variant, args.dropout_rate, args.tiles,
                                 args.kernel_options)
            if not args.no_op:
                calls |= op_calls(ops, variant, args.dropout_rate)
        except Exception as exc:  # noqa: BLE001 - one failed variant must not end the run
            times[variant] = {"*": f"error: {type(exc).__name__}: {str(exc)[:200]}"}
            continue
        for name, call in calls.items():
            try:
                times.setdefault(variant, {})[name] = timing.median_ms(
                    lambda i, call=call: call(), samples=args.samples, reps=args.reps)
            except Exception as exc:  # noqa: BLE001
                times.setdefault(variant, {})[name] = f"error: {type(exc).__name__}"
    names = next((list(t) for t in times.values() if "*" not in t), [])
    for name in names:
        plain = times.get("plain", {}).get(name)
        cells = []
        for variant in args.variants:
            ms = times.get(variant, {}).get(name, times.get(variant, {}).get("*", "-"))
            if isinstance(ms, float):
                ratio = (f" ({ms / plain:.2f}×)" if isinstance(plain, float) and variant != "plain"
                         else "")
                cells.append(f"{ms:.4f}{ratio}")
            else:
                cells.append(str(ms))
        emit(f"| {label} | {name} | " + " | ".join(cells) + " |")


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny" if INTERPRET else
                        "train_padded,extra_padded,long_padded,train,finetune,extra",
                        help="names from shapes.py")
    parser.add_argument("--dtypes", default="bf16", help="16-bit: bf16 and/or f16")
    parser.add_argument("--bias-dtypes", default="f32,input", help="f32 and/or input (q's)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--dropout-rate", type=float, default=0.1)
    parser.add_argument("--no-op", action="store_true", help="the kernels alone, not the op")
    parser.add_argument("--tiles", default="", type=parse_candidates,
                        help='more candidates per kernel: "forward=128x64x2x2x1x1;dkdv=64x64x2x2"')
    parser.add_argument("--kernel-options", default="", type=parse_tile_options,
                        help="each kernel again with these MosaicTiles flags: "
                             '"staggered_bias=0,mask_without_select=0"')
    parser.add_argument("--reps", type=int, default=1 if INTERPRET else 20)
    parser.add_argument("--samples", type=int, default=1 if INTERPRET else 5)
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "plain" not in args.variants:
        parser.error(f"--variants: {unknown or 'plain missing'}; expected plain and any of "
                     f"{VARIANTS[1:]}")
    for name in args.dtypes.split(","):
        if name not in HALF_DTYPES:
            parser.error(f"--dtypes: {name}: the Mosaic forward takes 16-bit inputs "
                         f"({', '.join(HALF_DTYPES)})")
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown shape {name!r}")
    emit = lambda line: print(line, flush=True)  # noqa: E731
    emit("| shape | dtype | bias | kernel | " + " | ".join(f"{v} ms" for v in args.variants)
         + " |")
    emit("|---|---|---|---|" + "---|" * len(args.variants))
    timing.warm_up_device()
    for shape_name in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            for bias_name in bias_dtype_names(dtype_name, args.bias_dtypes.split(",")):
                profile_case(shape_name, dtype_name, bias_name, args, emit)
    return 0
