"""Loop bounds that differ from work item to work item, known only at run
time, for the tests of the Mosaic kernels' pipelines (`key_bounds` of the
forward, `tile_bounds` of the dq and dk/dv kernels), and the float64
results they should give."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

import helpers
from msa_pallas.reference import MASKED_LOGIT

# The tile width the bounds are written for (query and key tiles alike).
BLOCK = 64


def strict_key_bounds(work, key_tiles):
    """Key-tile bounds (`attention_forward`'s `key_bounds`) that differ from
    item to item: odd MSA-row groups skip the first key tile, items of odd
    batch + head + query tile the last one."""
    batch, head, row_group, q_start = work
    lower = lax.rem(row_group, 2)
    upper = key_tiles - lax.rem(batch + head + q_start // BLOCK, 2)
    return lower, upper


def forward_between_key_bounds(inputs, scale, msa_rows):
    """The float64 output when each work item's queries attend only to the
    keys of its key tiles (`strict_key_bounds`; `msa_rows` rows per item),
    AlphaFold's -1e9 for masked keys among them."""
    q, k, v, bias, mask, gate = (helpers.to_f64(x) for x in inputs.args[:6])
    batch, rows, n_res, heads, _ = q.shape
    logits = np.einsum("bsqhd,bskhd->bshqk", q, k) * scale + bias[:, None]
    logits = np.where(mask[:, :, None, None, :], logits, MASKED_LOGIT)
    key_tile = np.arange(n_res) // BLOCK
    key_tiles = -(-n_res // BLOCK)
    for b in range(batch):
        for h in range(heads):
            for r in range(rows):
                for q_start in range(0, n_res, BLOCK):
                    work = (jnp.int32(b), jnp.int32(h), jnp.int32(r // msa_rows),
                            jnp.int32(q_start))
                    lower, upper = (int(x) for x in strict_key_bounds(work, key_tiles))
                    outside = (key_tile < lower) | (key_tile >= upper)
                    logits[b, r, h, q_start:q_start + BLOCK, outside] = -np.inf
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bshqk,bskhd->bsqhd", weights, v)
    return out / (1 + np.exp(-gate))


def strict_tile_bounds(work, tiles):
    """Loop bounds (`tile_bounds` of `backward_dq` / `backward_dkdv`) that
    differ from CTA to CTA: the CTA of tile t (its held query or key tile)
    visits tiles [t % 2, tiles - (t + 1) % 2) of the loop's."""
    *_, start = work
    held = start // BLOCK
    return lax.rem(held, 2), tiles - lax.rem(held + 1, 2)


def gradients_between_tile_bounds(inputs, scale):
    """Float64 dq, dk and dv when each query tile's dq sums over the key
    tiles of `strict_tile_bounds` alone, and each key tile's dk and dv over
    its query tiles alone (the probabilities and their statistics still over
    every key); the cotangent `dout` is the ungated output's."""
    q, k, v, bias, mask, _, dout = (
        None if x is None else helpers.to_f64(x) for x in inputs.args
    )
    n_res = q.shape[2]
    logits = np.einsum("bsqhd,bskhd->bshqk", q, k) * scale + bias[:, None]
    keep = mask[:, :, None, None, :]
    logits = np.where(keep, logits, MASKED_LOGIT)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bsqhd,bskhd->bshqk", dout, v)
    ds = np.where(keep, p * (dp - np.sum(p * dp, -1, keepdims=True)), 0.0)
    tile = np.arange(n_res) // BLOCK
    tiles = -(-n_res // BLOCK)

    def visited(held):
        """[N] bool: the other axis's residues the CTA of tile `held` visits."""
        lower, upper = (int(x) for x in strict_tile_bounds((jnp.int32(held * BLOCK),), tiles))
        return (tile >= lower) & (tile < upper)

    # Row i: the residues of the other axis that residue i's tile visits.
    visits = np.stack([visited(t) for t in tile])
    dq = scale * np.einsum("bshqk,bskhd->bsqhd", ds * visits, k)
    dk = scale * np.einsum("bshqk,bsqhd->bskhd", ds * visits.T, q)
    dv = np.einsum("bshqk,bsqhd->bskhd", p * visits.T, dout)
    return dq, dk, dv
