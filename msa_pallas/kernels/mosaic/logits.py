"""The logits in the units of `q . k`: the bias as the first product's
accumulator starts from it (`accumulator_bias` in XLA, `bias_tile` in the
kernels), the masked logit, keys past N; the forward's online softmax over
them in base 2, and the gate's sigmoid."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.constants import LOG2E
from msa_pallas.kernels.mosaic.matmul import WGMMA
from msa_pallas.reference import MASKED_LOGIT


def accumulator_bias(bias, scale: float):
    """The bias as the kernels' logit products start from it.

    The kernels compute logits in the units of `q . k`: the first product's
    accumulator starts from `bias / scale`, so the matrix units add the
    bias, and one FMA per logit, `(q.k + bias / scale) * scale * log2(e)`,
    brings it to base 2. A 32-bit bias is divided here, once per call
    (B·H·N² elements, against the kernels' B·S·H·N² logits); a 16-bit one is
    divided in the kernels, in float32 (`bias_tile`), which keeps it exact.
    """
    if jnp.dtype(bias.dtype).itemsize == 4:
        return bias * jnp.float32(1.0 / scale)
    return bias


def bias_tile(tile, scale: float):
    """A bias tile read from shared memory (`accumulator_bias`'s array), as
    float32 in the units of `q . k`."""
    if jnp.dtype(tile.dtype).itemsize == 4:
        return tile
    return tile.astype(jnp.float32) * (1.0 / scale)


def load_bias_tile(ref, scale: float, *, staggered: bool = True):
    """`bias_tile` of the shared-memory tile `ref`, in the wgmma accumulator
    layout.

    Two lanes of a warp that read 8-byte pieces of a 32-bit tile's rows r
    and r ^ 1 hit the same banks whatever the swizzle. With `staggered`,
    Mosaic GPU's conflict-free plan has half the lanes read another column
    of the tile, and a select per element puts each value back in place:
    compiled for an H200, one select per logit, a tenth of each kernel's
    loop instructions. Without it, each lane reads its own elements: two-way
    bank conflicts on the bias's loads, and no select. 16-bit tiles are read
    with ldmatrix either way.
    """
    if not staggered and jnp.dtype(ref.dtype).itemsize == 4:
        return plgpu.load(ref, layout=WGMMA, optimized=False)
    return bias_tile(ref[...], scale)


def masked_accumulator_logit(scale: float) -> float:
    """The logit a masked key gets, in the units of `q . k`: -2^k with the
    smallest k for which it is at least 1e9 in magnitude once scaled.

    A power of two, so that its base-2 value `-2^k * scale * log2(e)` is an
    exact float32 product: in a row whose keys are all masked, every logit
    minus the row max is then exactly 0 and the weights are uniform. In a
    row with a kept key, masked keys get weight 0 as with AlphaFold's -1e9,
    unless every kept logit is itself below -1e9.
    """
    return -(2.0 ** math.ceil(math.log2(-MASKED_LOGIT / scale)))


def keys_before(n_res: int, key_tile, block_k: int, shape):
    """`[rows, block_k]` bool in the wgmma layout: whether each column's key
    (of key tile `key_tile`) lies before N. Keys past N read zeros."""
    key_ids = key_tile * block_k + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
    return key_ids < n_res


def online_softmax(t, row_max, row_sum, to_log2: float):
    """One logit tile `t` (`[rows, keys]` float32, the units of `q . k`) of
    the forward's online softmax: the tile's float32 probabilities, the
    factor that rescales the earlier tiles' sums, and the new row max and
    sum (`[rows]`); `to_log2` is scale * log2(e)."""
    # Base 2 from the accumulator's units: one FMA per logit.
    new_max = jnp.maximum(row_max, t.max(axis=1))
    new_max_log2 = new_max * to_log2
    rescale = jnp.exp2(row_max * to_log2 - new_max_log2)
    p = jnp.exp2(t * to_log2 - lax.broadcast_in_dim(new_max_log2, t.shape, [0]))
    row_sum = row_sum * rescale + p.sum(axis=1)
    return p, rescale, new_max, row_sum


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp2(x * -LOG2E))
