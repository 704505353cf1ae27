"""The plain-`jnp` path: MSA row attention written with einsum and softmax.

This is the semantic definition the Pallas kernels are tested against, and the
implementation used where no GPU is present. It materialises the full
`[B, S, H, N, N]` logits, so it is memory-hungry at AlphaFold scale.

Numerics mirror the kernels: logits and softmax in float32 (float64 for
float64 inputs), the probabilities
cast to the value dtype for the second product (as the kernels feed the matrix
units), accumulation in float32, output in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from msa_pallas.dropout import keep_mask, row_seeds

# AlphaFold's `where(mask, logits, -1e9)`: a fully masked row stays finite
# (uniform weights) where `-inf` would give NaN.
MASKED_LOGIT = -1e9


def key_keep(mask: jax.Array) -> jax.Array:
    """The kept keys of a mask: bool `[*shape]` from a bool or numeric one
    (nonzero keeps).

    No implicit promotion (a bool compared with a Python 0 is refused under
    `jax.numpy_dtype_promotion("strict")`): a bool mask is returned as it is,
    a numeric one compared with a zero of its own dtype.
    """
    if mask.dtype == jnp.bool_:
        return mask
    return mask != jnp.zeros((), mask.dtype)


def _matmul_precision(dtype) -> jax.lax.Precision:
    # float32 must mean float32: without HIGHEST, XLA on GPU may use TF32.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def msa_row_attention_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    mask: jax.Array | None = None,
    gate: jax.Array | None = None,
    *,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_seeds: jax.Array | None = None,
) -> jax.Array:
    """Biased, masked, optionally gated softmax attention along N, per MSA row.

    Args:
      q, k, v: `[B, S, N, H, d]`, one floating dtype.
      bias: `[B, H, N, N]`, any floating dtype; shared by the S rows.
      mask: `[B, S, N]` bool or None; True keeps a key.
      gate: `[B, S, N, H, d]` gate logits or None.
      scale: multiplies `q . k`.
      dropout_rate: probability of zeroing each attention weight (the
        survivors are scaled by 1 / (1 - rate)); 0 disables dropout.
      dropout_rng: PRNG key for the dropout mask (`dropout.row_seeds`), or
      dropout_seeds: `[B, S, H]` uint32 seeds drawn from one; one of the two
        when rate > 0. The mask is `dropout.keep_mask`'s, the kernels' own.

    Returns:
      `[B, S, N, H, d]` in q's dtype.
    """
    precision = _matmul_precision(q.dtype)
    # float32 statistics for 16- and 32-bit inputs; float64 stays float64.
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum(
        "bsihc,bsjhc->bshij", q, k,
        preferred_element_type=acc_dtype, precision=precision,
    )
    logits = logits * scale + bias.astype(acc_dtype)[:, None]
    if mask is not None:
        logits = jnp.where(mask[:, :, None, None, :], logits, MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1)
    if dropout_rate > 0.0:
        if dropout_seeds is None:
            dropout_seeds = row_seeds(dropout_rng, *q.shape[:2], q.shape[3])
        keep = keep_mask(dropout_seeds, q.shape[2], dropout_rate)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum(
        "bshij,bsjhc->bsihc", probs.astype(v.dtype), v,
        preferred_element_type=acc_dtype, precision=precision,
    )
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(acc_dtype))
    return out.astype(q.dtype)
