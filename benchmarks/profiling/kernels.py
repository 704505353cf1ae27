"""Per-kernel GPU times: forward, dk/dv, dq, dbias and the fused dq+dbias kernel.

Times each Pallas kernel on its own, so a change to one kernel can be judged
without the noise of the whole step, and tile candidates can be compared:

    python -m benchmarks profile kernels --shapes train,finetune,long --dtypes bf16,f32
    python -m benchmarks profile kernels --shapes long --dtypes f32 \
        --tiles "dkdv=32x64x4x2,64x64x4x3;dq=64x64x4x2"
    python -m benchmarks profile kernels --shapes train,finetune --dtypes f32 \
        --mosaic-dbias 64x64x2x2,64x64x2x1

Every kernel runs first with the default tiles of `default_block_config`
(labelled `default`), then with each candidate of `--tiles`.

Each time is the median over `--samples` batches of `--reps` back-to-back
calls divided by `--reps`: the launches queue up behind each other, so the
host's dispatch latency (tens of microseconds) is not in the number.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp


from benchmarks import timing
from benchmarks.shapes import DIMS as SHAPES, DTYPES

from msa_pallas.attention import msa_row_attention
from msa_pallas.block_sizes import KernelTiles, default_block_config, next_power_of_2
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.triton import backward
from msa_pallas.kernels.triton.forward import attention_forward

# Without a GPU the kernels run in interpret mode: only a check that the script works.
INTERPRET = jax.default_backend() != "gpu"


def make_inputs(shape, dtype, seed=0, bias_dtype=None):
    batch, rows, n_res, heads, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    q, k, v, do, gate = (
        jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[:5]
    )
    bias = jax.random.normal(keys[5], (batch, heads, n_res, n_res), jnp.float32)
    bias = bias.astype(dtype if bias_dtype is None else bias_dtype)
    mask = jax.random.bernoulli(keys[6], 0.9, (batch, rows, n_res)).astype(jnp.int8)
    return q, k, v, do, gate, bias, mask


def backward_delta(do, attention):
    """delta = sum over d of `do` · the ungated output, `[B, S, H, N]` float32: the row
    statistic the backward kernels read beside the forward's max and log2 sum."""
    return jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * attention, -1), 2, 3)


def fused_candidates(n_res: int):
    span = max(16, next_power_of_2(n_res))
    for warps, stages in ((4, 2), (4, 3), (8, 2), (2, 2)):
        yield KernelTiles(16, span, warps, stages)


KERNELS = {
    "forward": "forward",
    "dkdv": "backward_dkdv",
    "dq": "backward_dq",
    "dbias": "backward_dbias",
    "dq_dbias": "backward_dq_dbias",
}


def parse_mosaic(text: str) -> list[MosaicTiles]:
    """`BQxBKxSTAGESxROWS[xPING_PONG[xPERSISTENT[xSTAGGERED_BIAS[xMASK_WITHOUT_SELECT]]]]`
    candidates, comma-separated (the flags 1 or 0; `MosaicTiles`' fields of those
    names, in their order)."""
    tiles = []
    for item in filter(None, text.split(",")):
        block_q, block_k, stages, rows, *flags = (int(x) for x in item.split("x"))
        tiles.append(MosaicTiles(block_q, block_k, stages, rows, *(bool(f) for f in flags)))
    return tiles


def mosaic_text(tiles: MosaicTiles) -> str:
    """One candidate as `parse_mosaic` reads it, every field given:
    `BQxBKxSTAGESxROWSxPING_PONGxPERSISTENTxSTAGGERED_BIASxMASK_WITHOUT_SELECT`."""
    return "x".join(str(int(getattr(tiles, field.name)))
                    for field in dataclasses.fields(MosaicTiles))


def parse_tiles(text: str) -> dict[str, list[tuple[KernelTiles, bool]]]:
    """`"dkdv=32x64x4x2,64x64x4x3;dq=64x32x4x2:bf16x6"` -> {kernel: [(KernelTiles,
    whether the float32 products were given), ...]}
    (block_q x block_k x num_warps x num_stages [x msa_rows] [:float32 products])."""
    candidates = {}
    for group in filter(None, text.split(";")):
        kernel, _, tiles = group.partition("=")
        if kernel not in KERNELS:
            raise SystemExit(f"--tiles: unknown kernel {kernel!r}; expected one of {list(KERNELS)}")
        candidates[kernel] = []
        for one in filter(None, tiles.split(",")):
            sizes, _, products = one.partition(":")
            tiles = KernelTiles(*map(int, sizes.split("x")), float32_products=products or "tf32x3")
            candidates[kernel].append((tiles, bool(products)))
    return candidates


def profile(name, shape, dtype_name, args, emit):
    dtype = DTYPES[dtype_name]
    bias_dtype = None if args.bias_dtype == "input" else DTYPES[args.bias_dtype]
    q, k, v, do, gate, bias, mask = make_inputs(shape, dtype, bias_dtype=bias_dtype)
    if bias_dtype is not None:
        dtype_name = f"{dtype_name}/bias {args.bias_dtype}"
    scale = shape[-1] ** -0.5
    n_res = shape[2]
    config = default_block_config(n_res, shape[-1], dtype, bias.dtype)
    time_it = lambda call: timing.median_ms(  # noqa: E731
        lambda i: call(), samples=args.samples, reps=args.reps)

    def run(label, call):
        try:
            emit(name, dtype_name, label, f"{time_it(call):.4f}")
        except Exception as exc:  # noqa: BLE001 - one failed variant must not end the run
            emit(name, dtype_name, label, f"ERROR {type(exc).__name__}: {str(exc)[:300]}")

    out, attention, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask, gate, scale=scale, tiles=config.forward, interpret=INTERPRET,
        save_stats=True,
    )
    delta = backward_delta(do, attention)
    operands = (q, k, v, bias, mask, do, row_max, row_log2_sum, delta)

    def kernel_call(kernel, tiles):
        if kernel == "forward":
            return lambda: attention_forward(
                q, k, v, bias, mask, gate, scale=scale, tiles=tiles, interpret=INTERPRET,
                save_stats=True)
        function = getattr(backward, KERNELS[kernel])
        return lambda: function(*operands, scale=scale, tiles=tiles, interpret=INTERPRET)

    defaults = {
        "forward": config.forward, "dkdv": config.backward_dkdv, "dq": config.backward_dq,
        "dbias": config.backward_dbias,
    }
    products = args.float32_products if dtype == jnp.float32 else ("tf32x3",)
    for float32_products in products:
        tag = f"[{float32_products}]" if dtype == jnp.float32 else ""
        for kernel, tiles in defaults.items():
            tiles = dataclasses.replace(tiles, float32_products=float32_products)
            run(f"{KERNELS[kernel]}{tag} {tiles} default", kernel_call(kernel, tiles))
    candidates = {kernel: list(tiles) for kernel, tiles in args.tiles.items()}
    for rows in args.msa_rows:
        # The default tiles serving `rows` MSA rows per program.
        for kernel in ("forward", "dkdv", "dq"):
            candidates.setdefault(kernel, []).append(
                (dataclasses.replace(defaults[kernel], msa_rows=rows), False))
    if n_res <= 512 and not args.skip_fused and "dq_dbias" not in candidates:
        candidates["dq_dbias"] = [(tiles, False) for tiles in fused_candidates(n_res)]
    for kernel, tile_list in candidates.items():
        for tiles, products_given in tile_list:
            tiles = tiles.clipped(n_res)
            if kernel == "dq_dbias" and tiles.block_k < n_res:
                continue
            # A candidate's own float32 products, else each of --float32-products.
            for float32_products in (tiles.float32_products,) if products_given else products:
                tiles = dataclasses.replace(tiles, float32_products=float32_products)
                run(f"{KERNELS[kernel]} {tiles}", kernel_call(kernel, tiles))

    # The Mosaic dbias kernel (float32 q in bf16 pieces), fed the same residuals.
    if args.mosaic_dbias:
        stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
    for tiles in args.mosaic_dbias:
        run(f"mosaic backward_dbias {tiles}", lambda tiles=tiles: mosaic_backward.backward_dbias(
            q, k, v, bias, mask, do, stats, scale=scale, tiles=tiles, interpret=INTERPRET))

    if args.no_op:
        return

    def loss(q, k, v, bias, gate, block_config=None):
        out = msa_row_attention(q, k, v, bias, mask.astype(bool), gate, implementation="pallas",
                                block_config=block_config)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    fwd = jax.jit(lambda *a: msa_row_attention(
        *a[:4], mask.astype(bool), a[4], implementation="pallas"))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    run("op forward", lambda: fwd(q, k, v, bias, gate))
    run("op forward+backward", lambda: fwd_bwd(q, k, v, bias, gate))
    if args.op_tiles:
        # The op with some kernels' tiles replaced (the first candidate of each).
        changed = dataclasses.replace(
            config, **{KERNELS[kernel]: tiles[0][0] for kernel, tiles in args.op_tiles.items()})
        label = args.op_tiles_text
        fwd_c = jax.jit(lambda *a: msa_row_attention(
            *a[:4], mask.astype(bool), a[4], implementation="pallas", block_config=changed))
        fwd_bwd_c = jax.jit(jax.grad(functools.partial(loss, block_config=changed),
                                     argnums=(0, 1, 2, 3, 4)))
        run(f"op forward, {label}", lambda: fwd_c(q, k, v, bias, gate))
        run(f"op forward+backward, {label}", lambda: fwd_bwd_c(q, k, v, bias, gate))
    if bias.dtype != q.dtype:
        # The bias rounded to q's dtype inside the timed call (its gradient
        # comes back through the cast).
        rounded = lambda fn: (lambda q, k, v, bias, gate: fn(q, k, v, bias.astype(q.dtype), gate))
        fwd_r = jax.jit(rounded(lambda *a: msa_row_attention(
            *a[:4], mask.astype(bool), a[4], implementation="pallas")))
        fwd_bwd_r = jax.jit(jax.grad(rounded(loss), argnums=(0, 1, 2, 3, 4)))
        run("op forward, bias rounded to q's dtype", lambda: fwd_r(q, k, v, bias, gate))
        run("op forward+backward, bias rounded", lambda: fwd_bwd_r(q, k, v, bias, gate))


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="train,finetune,long")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--bias-dtype", default="input",
                        help="the bias dtype: input (q's) or one of " + ", ".join(DTYPES))
    parser.add_argument("--msa-rows", default="",
                        help="comma-separated MSA rows per program to time the default "
                             "forward, dk/dv and dq tiles with (e.g. 2,4)")
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--float32-products", default="tf32x3",
                        help="float32: comma-separated product modes to time the default tiles "
                             "and the candidates with (tf32x3, bf16x6, ieee)")
    parser.add_argument("--no-op", action="store_true", help="skip the whole op's times")
    parser.add_argument(
        "--op-tiles", default="",
        help="also time the op with these kernels' tiles in place of the defaults, in "
             "--tiles syntax, e.g. 'dq=64x32x4x1:bf16x6;forward=64x32x4x2:bf16x6'")
    parser.add_argument(
        "--mosaic-dbias", default="",
        help="Mosaic dbias tiles to time (block_q x block_k x stages x msa_rows, comma-"
             "separated, e.g. 64x64x2x2), on the Triton forward's residuals")
    parser.add_argument(
        "--tiles", default="",
        help="candidate tiles per kernel (block_q x block_k x warps x stages), e.g. "
             "'dkdv=32x64x4x2,64x64x4x3;dq=64x32x4x2'; kernels: " + ", ".join(KERNELS))
    args = parser.parse_args(argv)
    args.tiles = parse_tiles(args.tiles)
    args.op_tiles_text, args.op_tiles = args.op_tiles, parse_tiles(args.op_tiles)
    args.float32_products = args.float32_products.split(",")
    args.msa_rows = [int(r) for r in args.msa_rows.split(",") if r]
    args.mosaic_dbias = parse_mosaic(args.mosaic_dbias)
    emit = lambda *fields: print(" | ".join(str(f) for f in fields), flush=True)
    for name in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            profile(name, SHAPES[name], dtype_name, args, emit)
    return 0
