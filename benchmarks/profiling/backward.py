"""Backward kernels side by side: the Triton kernels and Mosaic GPU candidates.

For each shape, q dtype and bias dtype: the time of each Triton backward
kernel (default tiles) and of each Mosaic GPU backward kernel for its
candidates, the relative difference of each Mosaic result from the Triton
kernels' (same residuals, from the Triton forward), the time against the
exponential floor (B*S*H*N^2 exponentials at `measure.EXP_PER_S` per kernel), and
the op's forward + backward with `implementation="pallas"` and `"mosaic"`:

    python -m benchmarks profile backward --shapes train,finetune,long --dtypes bf16
    python -m benchmarks profile backward --shapes long --dkdv 64x128x2x2 --dbias 64x64x2x2

A candidate is BQxBKxSTAGESxROWS (`MosaicTiles`; what BQ, BK and ROWS mean
per kernel: `MosaicBackwardTiles`). Without a GPU the kernels run in their
interpreters at a small shape: only a check that it works.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


from benchmarks.measure import relative_error
from benchmarks.profiling.forward import INTERPRET, parse_mosaic, profile_cases
from benchmarks import timing
from benchmarks.profiling.kernels import backward_delta, make_inputs
from msa_pallas import msa_row_attention
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic.support import supports
from msa_pallas.kernels.triton import backward as triton_backward
from msa_pallas.kernels.triton.forward import attention_forward

MOSAIC_KERNELS = ("dkdv", "dq", "dbias")


def tiles_label(tiles) -> str:
    """`BQxBK` then stages, MSA rows (and warps, for Triton tiles)."""
    warps = f"w{tiles.num_warps}" if hasattr(tiles, "num_warps") else ""
    return f"{tiles.block_q}x{tiles.block_k} {warps}s{tiles.num_stages} r{tiles.msa_rows}"


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="1x2x128x1x32" if INTERPRET else "train,finetune,long,longer",
        help="names from shapes.py or BxSxNxHxd",
    )
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--bias-dtypes", default="f32,input", help="f32 and/or input (q's dtype)")
    for kernel in MOSAIC_KERNELS:
        parser.add_argument(f"--{kernel}", default="",
                            help="candidates BQxBKxSTAGESxROWS")
    parser.add_argument("--ping-pong", default="default", choices=("default", "on", "off", "both"),
                        help="the dk/dv and dq kernels' two consumers taking turns "
                             "(default: as the default tiles have it)")
    parser.add_argument("--no-op", action="store_true", help="skip the op's f+b")
    parser.add_argument("--reps", type=int, default=1 if INTERPRET else 10)
    parser.add_argument("--samples", type=int, default=1 if INTERPRET else 5)
    args = parser.parse_args(argv)
    time_it = lambda call: timing.median_ms(  # noqa: E731
        lambda i: call(), samples=args.samples, reps=args.reps)

    print("| shape | dtype | bias | kernel | tiles | ms | floor % | rel. diff. from Triton |")
    print("|---|---|---|---|---|---|---|---|")
    for case in profile_cases(args):
        shape_name, shape, dtype_name, dtype, bias_name, bias_dtype, floor_ms = case
        *_, n_res, _, head_dim = shape
        q, k, v, do, gate, bias, mask = make_inputs(shape, dtype, bias_dtype=bias_dtype)
        scale = head_dim**-0.5
        config = default_block_config(n_res, head_dim, dtype, bias_dtype)
        _, attention, row_max, row_log2_sum = attention_forward(
            q, k, v, bias, mask, gate, scale=scale, tiles=config.forward,
            interpret=INTERPRET, save_stats=True,
        )
        delta = backward_delta(do, attention)
        triton_operands = (q, k, v, bias, mask, do, row_max, row_log2_sum, delta)
        stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
        mosaic_operands = (q, k, v, bias, mask, do, stats)

        def emit(kernel, label, ms, diff=""):
            floor = f"{100 * floor_ms / ms:.0f}" if isinstance(ms, float) else ""
            ms = f"{ms:.3f}" if isinstance(ms, float) else ms
            print(f"| {shape_name} | {dtype_name} | {bias_name} | {kernel} | {label} "
                  f"| {ms} | {floor} | {diff} |", flush=True)

        reference = {}
        triton_kernels = {
            "dkdv": (triton_backward.backward_dkdv, config.backward_dkdv),
            "dq": (triton_backward.backward_dq, config.backward_dq),
            "dbias": (triton_backward.backward_dbias, config.backward_dbias),
        }
        for kernel, (function, tiles) in triton_kernels.items():
            call = lambda: function(  # noqa: E731
                *triton_operands, scale=scale, tiles=tiles.clipped(n_res),
                interpret=INTERPRET,
                **({"dbias_dtype": jnp.float32} if kernel == "dbias" else {}),
            )
            reference[kernel] = jax.tree.leaves(call())
            emit(f"triton {kernel}", tiles_label(tiles), time_it(call))

        if supports(shape, dtype, bias_dtype) is not None:
            continue
        defaults = mosaic_backward.default_tiles(shape, dtype, bias_dtype)
        turns = {"default": (defaults.ping_pong,), "on": (True,), "off": (False,),
                 "both": (True, False)}[args.ping_pong]
        defaults_of = {kernel: getattr(defaults, kernel) for kernel in MOSAIC_KERNELS}
        for kernel in MOSAIC_KERNELS:
            function = getattr(mosaic_backward, f"backward_{kernel}")
            candidates = parse_mosaic(getattr(args, kernel)) or [defaults_of[kernel]]
            variants = [
                (tiles, ping_pong)
                for tiles in candidates
                for ping_pong in (turns if kernel != "dbias" else (None,))
            ]
            for tiles, ping_pong in variants:
                extra = {} if ping_pong is None else {"ping_pong": ping_pong}
                label = tiles_label(tiles) + (" ping-pong" if ping_pong else "")
                call = lambda: function(  # noqa: E731
                    *mosaic_operands, scale=scale, tiles=tiles, interpret=INTERPRET,
                    **extra,
                )
                try:
                    results = jax.tree.leaves(call())
                    diff = max(relative_error(a, b)
                               for a, b in zip(results, reference[kernel]))
                    emit(f"mosaic {kernel}", label, time_it(call), f"{diff:.1e}")
                except Exception as exc:  # a candidate that does not compile
                    emit(f"mosaic {kernel}", label,
                         f"failed: {type(exc).__name__}: {str(exc)[:200]}")

        if args.no_op:
            continue
        for implementation in ("pallas", "mosaic"):
            def loss(q, k, v, bias, gate, implementation=implementation):
                out = msa_row_attention(q, k, v, bias, mask != 0, gate,
                                        implementation=implementation)
                return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

            fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
            ms = time_it(lambda: fwd_bwd(q, k, v, bias, gate))
            print(f"| {shape_name} | {dtype_name} | {bias_name} | op f+b "
                  f"| {implementation} | {ms:.3f} | {100 * 3 * floor_ms / ms:.0f} | |",
                  flush=True)
    return 0
