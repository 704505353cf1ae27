"""Tile loads and the biased, masked logits tile shared by every kernel.

All kernels see q, k, v, gate and output refs laid out `[N, d_pad]` (one MSA
row, one head), the bias `[N, N]` (one head) and the key mask `[N]`. Tiles
past N and head-dim columns past d are masked in the loads, never padded in
memory: loads fill them with 0 and the logits of keys past N are -inf, so
they carry no weight.

Logits are computed in base 2 (`exp2` is the hardware's native exponential):
`t = log2(e) * (scale * q.k + bias)`, so softmax(logits) = 2^t / sum 2^t.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas.reference import MASKED_LOGIT

LOG2E = math.log2(math.e)
MASKED_LOGIT_LOG2 = MASKED_LOGIT * LOG2E


def dot_precision(dtype):
    """float32 inputs use IEEE float32 products (never TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def row_ids(start, block: int):
    return start + jnp.arange(block, dtype=jnp.int32)


def load_rows(ref, prefix: tuple, start, block: int, n_res: int, head_dim: int):
    """Loads rows `[start, start + block)` of a `[*prefix, N, d_pad]` ref.

    Rows >= N and columns >= head_dim read as 0.

    Returns:
      `[block, d_pad]` in the ref's dtype.
    """
    d_pad = ref.shape[-1]
    mask = None
    if n_res % block:
        mask = (row_ids(start, block) < n_res)[:, None]
    if head_dim != d_pad:
        col_ok = (jnp.arange(d_pad) < head_dim)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    view = ref.at[(*prefix, pl.ds(start, block), slice(None))]
    if mask is None:
        return view[...]
    return plgpu.load(view, mask=mask, other=0)


def store_rows(ref, prefix: tuple, start, value, n_res: int, head_dim: int):
    """Stores `[block, d_pad]` into rows `[start, start + block)`, columns < head_dim."""
    block, d_pad = value.shape
    mask = None
    if n_res % block:
        mask = (row_ids(start, block) < n_res)[:, None]
    if head_dim != d_pad:
        col_ok = (jnp.arange(d_pad) < head_dim)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    view = ref.at[(*prefix, pl.ds(start, block), slice(None))]
    plgpu.store(view, value.astype(ref.dtype), mask=mask)


def load_vector(ref, prefix: tuple, start, block: int, n_res: int, other=0):
    """Loads entries `[start, start + block)` of a `[*prefix, N]` ref; past N reads `other`."""
    view = ref.at[(*prefix, pl.ds(start, block))]
    if n_res % block == 0:
        return view[...]
    return plgpu.load(view, mask=row_ids(start, block) < n_res, other=other)


def store_vector(ref, prefix: tuple, start, value, n_res: int):
    block = value.shape[0]
    view = ref.at[(*prefix, pl.ds(start, block))]
    mask = None if n_res % block == 0 else row_ids(start, block) < n_res
    plgpu.store(view, value.astype(ref.dtype), mask=mask)


def load_bias_tile(bias_ref, q_start, k_start, block_q: int, block_k: int, n_res: int):
    """The `[block_q, block_k]` float32 tile of a `[N, N]` bias, scaled to base 2."""
    view = bias_ref.at[pl.ds(q_start, block_q), pl.ds(k_start, block_k)]
    mask = None
    if n_res % block_q:
        mask = (row_ids(q_start, block_q) < n_res)[:, None]
    if n_res % block_k:
        col_ok = (row_ids(k_start, block_k) < n_res)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    tile = view[...] if mask is None else plgpu.load(view, mask=mask, other=0)
    return tile.astype(jnp.float32) * LOG2E


def load_key_keep(mask_ref, prefix: tuple, k_start, block_k: int, n_res: int):
    """`[block_k]` bool: True where the key is kept. None when there is no mask."""
    if mask_ref is None:
        return None
    return load_vector(mask_ref, prefix, k_start, block_k, n_res) != 0


def log2_logits(q, k, bias_log2, key_keep, k_start, *, qk_scale_log2: float, n_res: int):
    """Base-2 logits of one tile.

    Args:
      q: `[block_q, d_pad]`; k: `[block_k, d_pad]`, input dtype.
      bias_log2: `[block_q, block_k]` float32, already times log2(e).
      key_keep: `[block_k]` bool or None.
      k_start: first key of the tile.

    Returns:
      `[block_q, block_k]` float32: masked keys hold MASKED_LOGIT_LOG2 (the
      replaced logit -1e9, as AlphaFold), keys past N hold -inf.
    """
    block_k = k.shape[0]
    t = plgpu.dot(q, k, trans_b=True, precision=dot_precision(q.dtype))
    t = t * qk_scale_log2 + bias_log2
    if key_keep is not None:
        t = jnp.where(key_keep[None, :], t, MASKED_LOGIT_LOG2)
    if n_res % block_k:
        t = jnp.where((row_ids(k_start, block_k) < n_res)[None, :], t, -jnp.inf)
    return t


def probabilities(t, row_max, row_log2_sum):
    """softmax weights from base-2 logits and the forward's row statistics.

    `(t - m) - log2(l)` rather than `t - (m + log2 l)`: for a fully masked row
    m is -1.44e9, where float32 cannot hold m + log2(l) apart from m.
    """
    return jnp.exp2((t - row_max[:, None]) - row_log2_sum[:, None])


def logit_gradient(p, dp, delta, key_keep):
    """d(loss)/d(logit) of one tile: `p * (dp - delta)`, zero at masked keys.

    A masked logit was replaced by a constant, so nothing flows back through
    it to q, k or the bias (the weights of a fully masked row are uniform
    but not a function of the logits).
    """
    ds = p * (dp - delta[:, None])
    if key_keep is not None:
        ds = jnp.where(key_keep[None, :], ds, 0.0)
    return ds
