"""`dot_product_attention`: tokamax's / AlphaFold3's attention call on the fused op.

    out = msa_pallas.dot_product_attention(query, key, value, bias, mask)

takes the arguments and layouts of `tokamax.dot_product_attention` (and of
`jax.nn.dot_product_attention`): query, key, value `[*batch, T, H, D]`, bias
broadcastable to `[*batch, H, T, T]`, mask a boolean broadcastable to
`[*batch, H, T, T]` (True keeps). AlphaFold3's triangle and grid attention
call it as q `[rows, N, H, D]`, bias `[1, H, N, N]` (one bias for every row),
mask `[rows, 1, 1, N]` (a key mask per row): exactly the op's
`msa_row_attention(q, k, v, bias [H, N, N], mask [rows, N])`, so a user
swaps one function.

How a call maps onto the op. The trailing batch axes along which the bias
has size 1 become the op's rows S (a free reshape), the others its batch;
when the bias varies along every batch axis each element is a row of its
own (S = 1), still fused and exact. The mask must be a key mask (size 1 on
its head and query axes); it is broadcast to `[*batch, T]`.

Anything else runs the plain `jnp` path (the logits in memory) after a
one-line `UserWarning` that names the reason: a mask that varies over
heads or queries, queries and keys of different lengths, `is_causal=True`,
or `query_seq_lengths`. `key_value_seq_lengths` is turned into a key mask
and stays fused. A key whose row keeps no key gets uniform weights on both
paths (the op's convention), where tokamax's XLA path gives NaN or zeros.

`implementation`: the op's names (None, `"triton"` or its alias
`"pallas"`, `"mosaic"`, `"xla"`), which include tokamax's `"triton"`,
`"mosaic"` and `"xla"`; any other name (tokamax's `"cudnn"`) is refused.

Example (AlphaFold3's triangle attention around the starting node)::

    q, k, v = ...                       # [N, N, H, D], rows of the pair first
    bias = pair_logits[None]            # [1, H, N, N]
    mask = pair_mask[:, None, None, :]  # [N, 1, 1, N]
    out = msa_pallas.dot_product_attention(q, k, v, bias=bias, mask=mask)
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from msa_pallas.attention import msa_row_attention
from msa_pallas.validation import canonical_implementation, shape_str

__all__ = ["dot_product_attention"]

_MASK_VALUE = -1e9


def _pad_left(shape, rank: int) -> tuple:
    if len(shape) > rank:
        raise ValueError(f"shape {shape_str(shape)} has more than {rank} axes")
    return (1,) * (rank - len(shape)) + tuple(shape)


def _plain_attention(query, key, value, bias, mask, gate, scale):
    """softmax(scale q.k + bias, masked) v [* sigmoid(gate)], float32 softmax, logits in memory."""
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key,
                        preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, _MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value,
                     preferred_element_type=jnp.float32)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
    return out.astype(query.dtype)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, implementation: str | None = None,
                          gate=None, block_config=None):
    """Multi-head attention with tokamax's layouts, on `msa_pallas.msa_row_attention`.

    Args:
      query, key, value: `[*batch, T, H, D]` (T queries = T keys for the fused
        path), float16 / bfloat16 / float32.
      bias: broadcastable to `[*batch, H, T, T]`, or None.
      mask: boolean (or 0/1) broadcastable to `[*batch, H, T, T]`, True keeps;
        fused when it is a key mask (`[*batch, 1, 1, T]` and any size-1 axes).
      scale: multiplies `q . k`; default `1 / sqrt(D)`.
      is_causal, query_seq_lengths: accepted for tokamax's signature; they take
        the plain path (warning).
      key_value_seq_lengths: `[*batch]` int, keys at or past it masked.
      implementation: None, `"triton"` (or `"pallas"`), `"mosaic"`, `"xla"`.
      gate: msa_pallas's addition, `[*batch, T, H, D]` gate logits: the
        output is multiplied by `sigmoid(gate)` inside the kernel.
      block_config: the op's tiles (optional).

    Returns:
      `[*batch, T, H, D]` in query's dtype.
    """
    implementation = canonical_implementation(implementation)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim < 3 or key.shape != value.shape or key.shape[:-3] != query.shape[:-3] \
            or key.shape[-2:] != query.shape[-2:]:
        raise ValueError(f"query {shape_str(query.shape)}, key {shape_str(key.shape)}, value "
                         f"{shape_str(value.shape)}: expected [*batch, T, H, D] with the same "
                         "batch, heads and head dim.")
    *batch, t_q, heads, head_dim = query.shape
    t_k = key.shape[-3]
    rank = len(batch) + 3
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if gate is not None and tuple(gate.shape) != tuple(query.shape):
        raise ValueError(f"gate has shape {shape_str(gate.shape)}; expected query's "
                         f"{shape_str(query.shape)}.")
    try:
        if bias is not None:
            bias = jnp.asarray(bias)
            bias_shape = _pad_left(bias.shape, rank)
            jnp.broadcast_shapes(bias_shape, (*batch, heads, t_q, t_k))
        if mask is not None:
            mask = jnp.asarray(mask)
            mask_shape = _pad_left(mask.shape, rank)
            jnp.broadcast_shapes(mask_shape, (*batch, heads, t_q, t_k))
    except ValueError as err:
        raise ValueError(f"bias / mask do not broadcast to [*batch, H, T, T] = "
                         f"{shape_str((*batch, heads, t_q, t_k))}: {err}") from err

    if key_value_seq_lengths is not None:
        lengths = jnp.broadcast_to(jnp.asarray(key_value_seq_lengths), tuple(batch))
        kv_mask = (jnp.arange(t_k) < lengths[..., None])[..., None, None, :]
        mask = kv_mask if mask is None else jnp.logical_and(mask != 0, kv_mask)
        mask_shape = _pad_left(mask.shape, rank)

    reason = None
    if is_causal:
        reason = "is_causal=True"
    elif query_seq_lengths is not None:
        reason = "query_seq_lengths"
    elif t_q != t_k:
        reason = f"{t_q} queries and {t_k} keys"
    elif mask is not None and (mask_shape[-3] != 1 or mask_shape[-2] != 1):
        reason = f"a mask of shape {shape_str(mask.shape)} that is not a key mask [*batch, 1, 1, T]"
    if reason is not None:
        warnings.warn(f"msa_pallas.dot_product_attention: {reason}; running the plain "
                      "(unfused) path.", stacklevel=2)
        if is_causal:
            causal = jnp.tril(jnp.ones((t_q, t_k), bool))
            mask = causal if mask is None else jnp.logical_and(mask != 0, causal)
        if query_seq_lengths is not None:
            lengths = jnp.broadcast_to(jnp.asarray(query_seq_lengths), tuple(batch))
            keep_q = (jnp.arange(t_q) < lengths[..., None])[..., None, :, None]
            mask = keep_q if mask is None else jnp.logical_and(mask != 0, keep_q)
        return _plain_attention(query, key, value, bias,
                                None if mask is None else mask != 0, gate, scale)

    # Rows: the trailing batch axes the bias is shared along.
    n_rows_axes = 0
    if bias is not None:
        for size_bias, size in zip(reversed(bias_shape[:len(batch)]), reversed(batch)):
            if size_bias != 1 and size != 1:
                break
            n_rows_axes += 1
    else:
        n_rows_axes = len(batch)
    lead = tuple(batch[:len(batch) - n_rows_axes])
    rows = math.prod(batch[len(batch) - n_rows_axes:])
    op_shape = (*lead, rows, t_q, heads, head_dim)
    q, k, v = (x.reshape(op_shape) for x in (query, key, value))
    g = None if gate is None else gate.reshape(op_shape)

    if bias is None:
        op_bias = jnp.zeros((*lead, heads, t_q, t_k), query.dtype)
    else:
        op_bias = bias.reshape(bias_shape[:len(lead)] + bias_shape[len(batch):])
        op_bias = jnp.broadcast_to(op_bias, (*lead, heads, t_q, t_k))
    op_mask = None
    if mask is not None:
        keys = mask.reshape(mask_shape[:len(batch)] + (mask_shape[-1],))
        op_mask = jnp.broadcast_to(keys != 0, (*batch, t_k)).reshape(*lead, rows, t_k)

    out = msa_row_attention(q, k, v, op_bias, op_mask, g, scale=float(scale),
                            implementation=implementation, block_config=block_config)
    return out.reshape(query.shape)
