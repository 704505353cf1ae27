"""Runs the op's forward and backward a few times at one shape, for a profiler.

Under Nsight Compute (`benchmarks/profiling/profile_ncu.sh`) each launch of a kernel is
measured on its own; with `MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR` the
Mosaic GPU kernels' PTX is written to DIR as they compile (their SASS too with
`MOSAIC_GPU_DUMP_SASS=1`, where `nvdisasm` is on PATH):

    python -m benchmarks profile launch --shape 1x32x1024x8x32 --implementation mosaic
    python -m benchmarks profile launch --shape extra_padded --skip   # padding skipped
    python -m benchmarks profile launch --shape extra_padded --skip --persistent-backward
    python -m benchmarks profile launch --shape extra_padded --skip \
        --kernel-options prologue_kernel=0,mask_without_select=0
    python -m benchmarks profile launch --shape train_padded --skip --mask-queries
    python -m benchmarks profile launch --shape extra_padded --skip --mask-queries --forward-only
    python -m benchmarks profile launch --shape finetune --dropout-rate 0.1
    python -m benchmarks profile launch --layer reference --shape train --dropout-rate 0.1

`--layer PRESET` runs the Flax layer's training step instead (benchmarks/layer.py's,
`--implementation` its core: default, mosaic, pallas or xla) at one of its shapes.
A shape of shapes.py by name keys its own mask (a padded shape's padding); a
`BxSxNxHxd` shape keeps 90% of keys at random.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp


from benchmarks.layer import PRESETS, LayerProgram, core_options, layer_shape
from benchmarks.profiling.forward import parse_shape
from benchmarks.profiling.kernels import make_inputs
from benchmarks.shapes import DTYPES, SHAPES, make_mask
from benchmarks.alternatives import asked_block_config
from benchmarks.profiling.launches import (
    add_narrow_arguments, parse_kernel_options, split_kernels,
)
from msa_pallas import msa_row_attention, skipping_padding


def layer_step_call(args):
    """The layer's training step (`args.layer`'s preset, bf16 compute): a call without
    arguments that runs it, the compiled program, and a line saying what it runs."""
    if (args.no_gate or args.bias_dtype != "input" or args.persistent_backward
            or args.kernel_options or args.mask_queries or args.narrow_keys
            or args.narrow_queries or args.forward_only):
        raise ValueError("--no-gate, --bias-dtype, --persistent-backward, --kernel-options, "
                         "--mask-queries, --forward-only and --narrow-keys/--narrow-queries "
                         "are the op's: the layer has its gate, and its bias takes the "
                         "compute dtype")
    options = core_options(args.implementation)
    program = LayerProgram(layer_shape(args.shape), args.layer, args.dropout_rate,
                           jnp.bfloat16, DTYPES[args.dtype], options)
    with skipping_padding() if args.skip else contextlib.nullcontext():
        _, step = program.compile()
    return (lambda: step(*program.args)), step, (
        f"training steps of the {args.layer} layer at {args.shape}, core "
        f"{args.implementation}" + (f", dropout {args.dropout_rate}" if args.dropout_rate else ""))


def op_call(args):
    """The op's forward+backward (its forward alone with `--forward-only`): a call
    without arguments that runs it, the compiled program, and a line saying what it
    runs."""
    dtype = DTYPES[args.dtype]
    bias_dtype = dtype if args.bias_dtype == "input" else DTYPES[args.bias_dtype]
    q, k, v, do, gate, bias, mask = make_inputs(parse_shape(args.shape), dtype, bias_dtype=bias_dtype)
    gate = None if args.no_gate else gate
    if args.shape in SHAPES:
        mask = make_mask(SHAPES[args.shape], jax.random.key(1))

    implementation = None if args.implementation == "default" else args.implementation
    block_config = asked_block_config(
        q, bias, mask != 0, gate, implementation=implementation, skip=args.skip,
        persistent_backward=args.persistent_backward,
        kernel_options=parse_kernel_options(args.kernel_options),
        narrow_key_tiles=split_kernels(args.narrow_keys),
        narrow_query_tiles=split_kernels(args.narrow_queries),
    )

    def loss(q, k, v, bias, gate):
        out = msa_row_attention(
            q, k, v, bias, mask != 0, gate, implementation=implementation,
            block_config=block_config, dropout_rate=args.dropout_rate,
            dropout_rng=jax.random.key(2) if args.dropout_rate else None,
            mask_queries=args.mask_queries,
        )
        if args.forward_only:
            return out
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    program = jax.jit(loss if args.forward_only else jax.grad(loss, argnums=(0, 1, 2, 3)))
    with skipping_padding() if args.skip else contextlib.nullcontext():
        program = program.lower(q, k, v, bias, gate).compile()
    return (lambda: program(q, k, v, bias, gate)), program, (
        f"{'forward' if args.forward_only else 'forward+backward'} calls at {args.shape} {args.dtype}"
        + (" skipping padding" if args.skip else "")
        + (", persistent dq and dk/dv" if args.persistent_backward else "")
        + (f", kernel options {args.kernel_options}" if args.kernel_options else "")
        + (f", dropout {args.dropout_rate}" if args.dropout_rate else "")
        + (", queries masked" if args.mask_queries else "")
        + (f", 64-key tiles of {args.narrow_keys}" if args.narrow_keys else "")
        + (f", 64-query tiles of {args.narrow_queries}" if args.narrow_queries else ""))


def make_parser(prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x32x1024x8x32", help="a name of shapes.py or BxSxNxHxd")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--bias-dtype", default="input", help="input (q's dtype) or a dtype name")
    parser.add_argument("--implementation", default="mosaic",
                        help="msa_row_attention's implementation; default: its own choice")
    parser.add_argument("--calls", type=int, default=2, help="forward+backward calls")
    parser.add_argument("--no-gate", action="store_true")
    parser.add_argument("--skip", action="store_true",
                        help="trace inside msa_pallas.skipping_padding()")
    parser.add_argument("--persistent-backward", action="store_true",
                        help="the Mosaic dq and dk/dv kernels persistent (one CTA per SM)")
    parser.add_argument("--kernel-options", default="",
                        help="NAME=0|1,...: MosaicTiles flags set in every Mosaic kernel, "
                             "and MosaicBackwardTiles' prologue_kernel")
    parser.add_argument("--dropout-rate", type=float, default=0.0,
                        help="attention dropout's rate (0: none)")
    parser.add_argument("--mask-queries", action="store_true",
                        help="msa_row_attention's mask_queries (the mask masks queries too)")
    parser.add_argument("--forward-only", action="store_true",
                        help="the op's forward alone (its output, no gradient)")
    add_narrow_arguments(parser)
    parser.add_argument("--layer", choices=PRESETS, default=None,
                        help="run the layer's training step (this preset) instead of the op's")
    return parser


def make_call(args):
    """(a call without arguments that runs one step, the compiled step, what it runs)
    for parsed `args`."""
    return layer_step_call(args) if args.layer else op_call(args)


def main(argv=None, prog: str | None = None) -> int:
    args = make_parser(prog).parse_args(argv)
    call, _, what = make_call(args)
    for _ in range(args.calls):
        jax.block_until_ready(call())
    print("ran", args.calls, what, flush=True)
    return 0
