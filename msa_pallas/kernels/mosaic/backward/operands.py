"""What the Mosaic GPU backward kernels share: their operands as the kernels
read them (float32 as bf16 pieces, the bias, mask and statistics rows
padded), the forward's row statistics, and the probabilities and logit
gradient recomputed from them (`recompute`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.constants import FLOAT32_PIECES, LOG2E, MASKED_LOGIT_LOG2
from msa_pallas.kernels.mosaic.matmul import split_float32
from msa_pallas.kernels.mosaic.support import pad_bias_rows, pad_residues


def gradient_rows(operand, pieces: int, dtype):
    """The `jax.ShapeDtypeStruct` of a gradient like `operand` (`[B, S, N,
    heads, tile width]`, or its `pieces` bf16 pieces stacked first), in
    `dtype` and in whole rows, `[B, S, N, heads * tile width]`: every head
    of a residue in one row, so that the persistent kernels store a dead
    row's zeros in contiguous boxes (`work_items.store_dead_zeros`)."""
    shape = operand.shape[pieces > 1:]
    return jax.ShapeDtypeStruct((*shape[:3], math.prod(shape[3:])), dtype)


def recompute(
    s, dp, keep, stats, *, scale: float, query_axis: int, with_p: bool, dropout_keep=None,
    mask_without_select: bool = False,
):
    """The probabilities `p` (if `with_p`, else None) and the logit gradient
    `ds` of one tile, float32, as the forward computed them.

    With dropout (`dropout_keep`: the tile's bool keep mask,
    `dropout_words`), `ds = p (keep dp - delta)` and `p` is returned as
    `p keep`, the weights `dv` takes: `do` and delta come scaled by the
    caller (`do / (1 - rate)`, `delta = (1 - rate) sum_d do o`), so the
    kernels never scale.

    Args:
      s: `q . k + bias / scale` of the tile (the product started from the
        bias tile, `logits.bias_tile`); dp: `do . v`; both in the same
        orientation, queries along `query_axis`.
      keep: `[keys]` bool (nonzero keeps) or None.
      stats: row max, log2 row sum and delta, `[queries]` float32 each.
      mask_without_select: a masked key's ds is made 0 without a select
        after the product: without `with_p`, its exponent is set to -inf
        (so its p, and with it its ds, is exactly 0); with `with_p`, whose
        masked keys keep their own weight (a row whose keys are all masked
        weighs them 1 / N), ds is multiplied by the key's 0 or 1. Else ds is
        selected to 0 after the product: compiled for an H200, LLVM moves
        that select past the bf16 rounding of ds, where it takes two byte
        permutes and two selects per pair of elements. The same ds either
        way, a zero's sign aside.
    """
    row_max, row_log2_sum, delta = stats
    per_query = lambda x: lax.broadcast_in_dim(x, s.shape, [query_axis])  # noqa: E731
    # For a row with a kept key the row max is an ordinary logit, so one
    # subtraction of m + log2(l) is exact enough; masked keys take their own
    # value below (m is -1.44e9 for a fully masked row). One FMA per logit.
    x = s * (scale * LOG2E) - per_query(row_max + row_log2_sum)
    keep_factor = None
    if keep is not None:
        if with_p and mask_without_select:
            # Made per key, then broadcast: one multiply per logit.
            keep_factor = lax.broadcast_in_dim(
                jnp.where(keep, jnp.float32(1), jnp.float32(0)), s.shape, [1 - query_axis]
            )
        keep = lax.broadcast_in_dim(keep, s.shape, [1 - query_axis])
        if with_p:
            masked = per_query((MASKED_LOGIT_LOG2 - row_max) - row_log2_sum)
            x = jnp.where(keep, x, masked)
        elif mask_without_select:
            x = jnp.where(keep, x, -jnp.inf)
    p = jnp.exp2(x)
    if dropout_keep is None:
        ds = p * (dp - per_query(delta))
    elif with_p:
        # `p keep` serves dv and ds alike: one select per weight, not two.
        kept_p = jnp.where(dropout_keep, p, 0.0)
        ds = kept_p * dp - p * per_query(delta)
        p = kept_p
    else:
        ds = p * (jnp.where(dropout_keep, dp, 0.0) - per_query(delta))
    # A masked key's logit is a constant: no gradient flows through it.
    if keep_factor is not None:
        ds = ds * keep_factor
    elif keep is not None and not mask_without_select:
        ds = jnp.where(keep, ds, 0.0)
    return (p if with_p else None), ds


def load_stats(stats_ref, layout):
    """Row max, log2 row sum and delta: the rows of a `[3, queries]` tile."""
    return tuple(plgpu.load(stats_ref.at[i], layout=layout) for i in range(3))


def split_operands(*operands):
    """(pieces, operands): 1 and the operands as they are for 16-bit inputs;
    for float32 ones `FLOAT32_PIECES` and each operand's bf16 pieces stacked
    on a new leading axis (`matmul.split_float32`, one XLA pass each)."""
    if operands[0].dtype != jnp.float32:
        return 1, operands
    return FLOAT32_PIECES, tuple(jnp.stack(split_float32(x, FLOAT32_PIECES)) for x in operands)


def kernel_operands(**named):
    """The kernel's inputs by name, the bias, mask and statistics rows
    padded to whole TMA rows (`support.pad_residues`) and the bias's rows to
    whole 8-row tiles (`support.pad_bias_rows`; N % 8 != 0); None entries
    dropped."""
    swizzled = {"bias": True, "bias_t": True, "mask": False, "stats": False}
    padded = {
        name: pad_residues(x, swizzled[name]) if name in swizzled else x
        for name, x in named.items() if x is not None
    }
    return {
        name: pad_bias_rows(x) if name in ("bias", "bias_t") else x for name, x in padded.items()
    }
