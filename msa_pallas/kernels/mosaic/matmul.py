"""The matrix products of the Mosaic GPU kernels: `wgmma` from shared memory
(`smem_products`) and with a 16-bit left operand in registers
(`accumulate_products`), float32 operands as sums of bf16 pieces
(`split_float32`, `piece_pairs`), and the wgmma layouts. The only place
where the interpreter's products differ from the GPU's."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.constants import FLOAT32_PIECES


WGMMA = plgpu.Layout.WGMMA
# Vectors along a wgmma tile's rows (one value per row) and columns.
WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)
WGMMA_COL = plgpu.Layout.WGMMA.reduce(0)


def zeros(shape):
    """float32 zeros in the wgmma accumulator layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)


def split_float32(x, pieces: int = FLOAT32_PIECES, in_kernel: bool = False) -> tuple:
    """float32 `x` as `pieces` bfloat16 arrays whose float32 sum is `x`
    (to 24 bits with 3 pieces): each piece is the rounding of what the
    previous ones left.

    In XLA the rounding is a `reduce_precision`: XLA on GPU may drop a
    bf16 -> float32 convert pair (excess precision is allowed by default),
    which would leave every later piece zero. Inside a kernel
    (`in_kernel`), where Mosaic GPU has no `reduce_precision`, the convert
    pair is kept as written.
    """
    split, rest = [], x.astype(jnp.float32)
    for _ in range(pieces):
        if in_kernel:
            piece = rest.astype(jnp.bfloat16)
            rounded = piece.astype(jnp.float32)
        else:
            rounded = lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
            piece = rounded.astype(jnp.bfloat16)
        split.append(piece)
        rest = rest - rounded
    return tuple(split)


def matrix_operand(x, dtype):
    """A float32 register tile as the left operand of a 16-bit `wgmma`: `x`
    rounded to `dtype`, or for float32 inputs its `split_float32` pieces."""
    if jnp.dtype(dtype) == jnp.float32:
        return split_float32(x, in_kernel=True)
    return x.astype(dtype)


def piece_pairs(a, b) -> list:
    """The `(a_i, b_j)` products whose sum is `a @ b` to float32 accuracy.

    `a` and `b` are operands or tuples of the same number P of bf16 pieces
    (`split_float32`): the pairs with `i + j < P`, the terms of the product
    of the two sums above the float32 rounding (P = 3: 6 products, as XLA's
    BF16_BF16_F32_X6), smallest first so that the accumulator adds them
    before the large ones.
    """
    if not isinstance(a, tuple):
        return [(a, b)]
    pieces = len(a)
    pairs = [(i, j) for i in range(pieces) for j in range(pieces) if i + j < pieces]
    return [(a[i], b[j]) for i, j in sorted(pairs, key=lambda ij: -sum(ij))]


def smem_products(
    operands, while_they_run: Callable[[], None] | None = None, inits=None,
    interpret: bool = False,
):
    """`init + a @ b` float32 for each `(a, b)` pair of shared-memory operands
    (`b` may be a transposed view) and its `init` (`[M, N]` float32 in the
    wgmma layout, or None for zeros), issued together and waited for once,
    running `while_they_run()` while the matrix units work.

    `a` and `b` may be tuples of bf16 pieces of float32 operands
    (`piece_pairs`): their products are summed in the one accumulator.

    An `init` starts the product's accumulator: whatever it holds is added
    by the matrix units, at no cost to the FP32 pipe.

    Returns a tuple of `[M, N]` float32 values in the wgmma layout.
    """
    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731
    shapes = [(first(a).shape[0], first(b).shape[1]) for a, b in operands]
    inits = (None,) * len(operands) if inits is None else tuple(inits)

    def accumulate(acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, operands):
            for a_piece, b_piece in piece_pairs(a, b):
                plgpu.wgmma(acc_ref, a_piece, b_piece)
        if while_they_run is not None:
            while_they_run()

    if interpret or all(init is None for init in inits):
        # The interpreter's wgmma takes such operands as the GPU's does, into
        # zeroed accumulators; the inits are added afterwards.
        def compute(*acc_refs):
            accumulate(acc_refs)
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        products = pl.run_scoped(
            compute, *(plgpu.ACC(shape, jnp.float32) for shape in shapes)
        )
        return tuple(
            product if init is None else init + product
            for product, init in zip(products, inits)
        )

    starts = tuple(
        zeros(shape) if init is None else init for shape, init in zip(shapes, inits)
    )
    return pl.run_state(accumulate)(tuple(plgpu.ACC.init(start) for start in starts))


def accumulate_products(
    accs, lhss, rhs_smems, interpret: bool, while_they_run: Callable[[], None] | None = None
):
    """`acc + lhs @ rhs` for each triple, `lhs` 16-bit in registers and `rhs`
    in shared memory, running `while_they_run()` while the matrix units work.
    `lhs` and `rhs` may be tuples of bf16 pieces of float32 operands
    (`matrix_operand`, `operand_at`): their `piece_pairs` products are summed.

    On the GPU each wgmma accumulates into its `acc` in place. The
    interpreter's wgmma takes both operands from shared memory, so there the
    product is a float32-accumulated `jnp.dot` of the same 16-bit operands.
    """
    if interpret:
        products = [
            sum(
                jnp.dot(lhs_piece, rhs_piece[...], preferred_element_type=jnp.float32)
                for lhs_piece, rhs_piece in piece_pairs(lhs, rhs)
            )
            for lhs, rhs in zip(lhss, rhs_smems)
        ]
        if while_they_run is not None:
            while_they_run()
        return tuple(acc + product for acc, product in zip(accs, products))

    def accumulate(acc_refs):
        for acc_ref, lhs, rhs in zip(acc_refs, lhss, rhs_smems):
            for lhs_piece, rhs_piece in piece_pairs(lhs, rhs):
                plgpu.wgmma(acc_ref, lhs_piece, rhs_piece)
        if while_they_run is not None:
            while_they_run()

    if any(isinstance(lhs, tuple) for lhs in lhss):
        # float32 pieces: each step's product starts from zero and is added to
        # the running sum in float32. Accumulated across the loop's tiles in
        # the wgmma accumulator, the errors grew with N on an H200 (2.1e-6
        # at N = 256, 6.9e-6 at N = 1024, against 8e-7 for dbias, whose
        # products are over d only).
        products = pl.run_state(accumulate)(
            tuple(plgpu.ACC.init(zeros(acc.shape)) for acc in accs)
        )
        return tuple(acc + product for acc, product in zip(accs, products))
    return pl.run_state(accumulate)(tuple(plgpu.ACC.init(acc) for acc in accs))
