"""Forward kernels side by side: the Triton forward and Mosaic GPU candidates.

For each shape, q dtype and bias dtype: the time of the Triton forward (its
default tiles) and of the Mosaic GPU forward for each `--mosaic` candidate,
with and without the residuals the backward needs, the relative error of each
against a float32 XLA forward, and the time against the exponential floor
(B*S*H*N^2 exponentials at `measure.EXP_PER_S`):

    python -m benchmarks profile forward --shapes train,finetune,long --dtypes bf16
    python -m benchmarks profile forward --shapes long --mosaic 64x128x2x2,64x64x3x2
    python -m benchmarks profile forward --shapes long --skip-triton --mosaic 128x64x2x2x1x1

A candidate is BQxBKxSTAGESxROWS[xPING_PONG[xPERSISTENT]] (`MosaicTiles`).
Without a GPU both kernels run in their interpreters at the `seed` shape (the
Mosaic one with one CTA per item): only a check that it works.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


from benchmarks.measure import EXP_PER_S, relative_error
from benchmarks import timing
from benchmarks.profiling.kernels import make_inputs, parse_mosaic
from benchmarks.shapes import DIMS as SHAPES, DTYPES
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.support import supports
from msa_pallas.kernels.triton import forward as triton_forward
from msa_pallas.reference import msa_row_attention_xla

INTERPRET = jax.default_backend() != "gpu"


def parse_shape(name: str) -> tuple[int, int, int, int, int]:
    """A shape of shapes.py by name, or `BxSxNxHxd`."""
    return SHAPES.get(name) or tuple(int(x) for x in name.split("x"))


def profile_cases(args):
    """Each (shape name, shape, dtype name, dtype, bias name, bias dtype,
    floor ms) of `--shapes` x `--dtypes` x `--bias-dtypes`; the floor is
    B*S*H*N^2 exponentials at `measure.EXP_PER_S`."""
    for shape_name in args.shapes.split(","):
        shape = parse_shape(shape_name)
        batch, rows, n_res, heads, _ = shape
        floor_ms = batch * rows * heads * n_res**2 / EXP_PER_S * 1e3
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for bias_name in args.bias_dtypes.split(","):
                bias_dtype = jnp.float32 if bias_name == "f32" else dtype
                yield shape_name, shape, dtype_name, dtype, bias_name, bias_dtype, floor_ms


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="seed" if INTERPRET else "train,finetune,extra,long,longer",
        help="names from shapes.py or BxSxNxHxd",
    )
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--bias-dtypes", default="f32,input", help="f32 and/or input (q's dtype)")
    parser.add_argument("--mosaic", default="",
                        help="candidates BQxBKxSTAGESxROWS[xPING_PONG[xPERSISTENT]], "
                        "comma-separated")
    parser.add_argument("--skip-triton", action="store_true",
                        help="time the Mosaic candidates only (residuals then against the first)")
    parser.add_argument("--reps", type=int, default=1 if INTERPRET else 20)
    parser.add_argument("--samples", type=int, default=1 if INTERPRET else 7)
    args = parser.parse_args(argv)

    residuals_against = "first candidate" if args.skip_triton else "Triton"
    print("| shape | dtype | bias | kernel | tiles | fwd ms | fwd+stats ms | floor % | rel err "
          f"| residuals vs {residuals_against} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in profile_cases(args):
        shape_name, shape, dtype_name, dtype, bias_name, bias_dtype, floor_ms = case
        *_, n_res, _, head_dim = shape
        q, k, v, _, gate, bias, mask = make_inputs(shape, dtype, bias_dtype=bias_dtype)
        scale = head_dim**-0.5
        reference = msa_row_attention_xla(
            *(x.astype(jnp.float32) for x in (q, k, v, bias)), mask != 0,
            gate.astype(jnp.float32), scale=scale,
        )
        config = default_block_config(n_res, head_dim, dtype, bias_dtype)
        kernels = [] if args.skip_triton else [
            ("triton", str(config.forward), triton_forward.attention_forward, config.forward)
        ]
        candidates = parse_mosaic(args.mosaic) or [
            mosaic_forward.default_tiles(
                shape, dtype, bias_dtype, save_stats=True, persistent=not INTERPRET
            )
        ]
        if supports(shape, dtype, bias_dtype) is None:
            kernels += [("mosaic", str(t), mosaic_forward.attention_forward, t)
                        for t in candidates]
        reference_stats = None
        for kernel_name, label, forward, tiles in kernels:
            run = lambda save_stats: forward(
                q, k, v, bias, mask, gate, scale=scale, tiles=tiles,
                interpret=INTERPRET, save_stats=save_stats,
            )
            try:
                out = run(False)
                error = relative_error(out, reference)
                fwd = timing.median_ms(lambda i: run(False), samples=args.samples, reps=args.reps)
                with_stats = timing.median_ms(lambda i: run(True), samples=args.samples,
                                              reps=args.reps)
                stats = run(True)[1:]
                reference_stats = stats if reference_stats is None else reference_stats
                residuals = max(
                    float(jnp.max(jnp.abs(a - b))) for a, b in zip(stats, reference_stats)
                )
            except Exception as exc:  # a candidate that does not compile
                print(f"| {shape_name} | {dtype_name} | {bias_name} | {kernel_name} "
                      f"| {label} | failed: {type(exc).__name__}: {str(exc)[:200]} |")
                continue
            print(f"| {shape_name} | {dtype_name} | {bias_name} | {kernel_name} | {label} "
                  f"| {fwd:.3f} | {with_stats:.3f} | {100 * floor_ms / fwd:.0f} "
                  f"| {error:.1e} | {residuals:.1e} |", flush=True)
    return 0
