"""Haiku module: AlphaFold2's `TriangleAttention` on the fused op.

A drop-in for `alphafold.model.modules.TriangleAttention` (Algorithms 13 and
14 of the AlphaFold2 supplement): same constructor, same call (with AF2's
`residual=`), same parameter tree, so AlphaFold2's parameter files load into
it unchanged. `config.orientation` `"per_row"` is the starting node (each row
of the pair attends along itself), `"per_column"` the ending node (the same
on the transposed pair, as AF2 computes it). Needs dm-haiku, as
`msa_pallas.haiku`.

Parameters (AlphaFold2's, under the module's name, e.g.
`triangle_attention_starting_node`), created in AF2's order with AF2's
initialisers::

    feat_2d_weights                [c_z, H]     normal(stddev = 1/sqrt(c_z))
    query_norm/{scale,offset}      [c_z]        ones / zeros
    attention/query_w, key_w, value_w  [c_z, H, d]  glorot_uniform
    attention/gating_w             [c_z, H, d]  zeros     (config.gating)
    attention/gating_b             [H, d]       ones      (config.gating)
    attention/output_w             [H, d, c_z]  zeros if global_config.zero_init
    attention/output_b             [c_z]        zeros

Maths, per row i of the (for per_column: transposed) pair, head h::

    x = LayerNorm(pair_act)                                   # query_norm
    bias[h, j, k] = sum_c x[j, k, c] * feat_2d_weights[c, h]  # the pair's own bias
    o[i, j] = softmax_k(d**-0.5 q[i,j] . k[i,k] + bias[h,j,k], keys with pair_mask[i, k])
              @ v[i, :] * sigmoid(gate[i, j])

Masks: AF2 adds `-1e9 * (1 - mask)` and clips the logits to +-1e8, so every
masked logit becomes -1e8 and a row with no key kept gets uniform weights;
the op replaces masked logits with -1e9: the same weights. AF2's
`subbatch_size` chunking is not reproduced (the op needs none); dropout is
applied outside the module by AF2's `dropout_wrapper` (`inference_chunk_bytes`
bounds the projections' memory at inference instead). Precision and dtypes
as `msa_pallas.haiku.MSARowAttentionWithPairBias`: float32 parameters, the
layer norm and the bias in float32, the projections and the attention in the
pair's dtype.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax.numpy as jnp

from msa_pallas.haiku import _Attention, _config_value, _is_half, inference_row_chunk
from msa_pallas.layer_core import LAYER_NORM_EPS, resolve_precision
from msa_pallas.validation import shape_str

__all__ = ["TriangleAttention", "ORIENTATIONS"]

ORIENTATIONS = ("per_row", "per_column")


class TriangleAttention(hk.Module):
    """Triangle self-attention around the starting (`per_row`) or ending
    (`per_column`) node: AlphaFold2's module, fused.

    Args:
      config: AF2's `triangle_attention_starting_node` /
        `triangle_attention_ending_node` config (ConfigDict, SimpleNamespace
        or Mapping): `num_head`, `gating`, `orientation`, optionally
        `key_dim` / `value_dim` (default c_z; equal per-head dims).
      global_config: reads `zero_init`.
      name: the Haiku scope (AF2's default `triangle_attention`; the
        Evoformer names them `triangle_attention_starting_node` and
        `triangle_attention_ending_node`).
      implementation, block_config: passed to `msa_pallas.msa_row_attention`.
      precision: matmul precision of the projections and the bias; None:
        `HIGHEST` for float32, the default for 16-bit.
      inference_chunk_bytes: None: all rows in one op call. A byte count: at
        inference the rows of the pair go through the projections and the op
        in chunks whose q, k, v, gate and output take at most that much.
    """

    takes_residual = True  # AF2's dropout_wrapper then hands the residual in

    def __init__(self, config, global_config, name: str = "triangle_attention", *,
                 implementation: str | None = None, block_config: Any = None,
                 precision: Any = None, inference_chunk_bytes: int | None = None):
        super().__init__(name=name)
        self.inference_chunk_bytes = inference_chunk_bytes
        self.config = config
        self.global_config = global_config
        self.implementation = implementation
        self.block_config = block_config
        self.precision = precision

    def __call__(self, pair_act, pair_mask, is_training: bool = False, residual=None):
        """Applies the module.

        Args:
          pair_act: `[N_res, N_res, c_z]` (leading batch axes accepted).
          pair_mask: `[N_res, N_res]` 0/1 mask (nonzero keeps), or None.
          is_training: True turns `inference_chunk_bytes` off.
          residual: added to the update when given (AF2's fused residual).

        Returns:
          The update `[N_res, N_res, c_z]` (plus `residual`), pair_act's dtype.
        """
        what = "config (triangle_attention)"
        num_head = int(_config_value(self.config, "num_head", what))
        gating = bool(_config_value(self.config, "gating", what))
        orientation = _config_value(self.config, "orientation", what)
        if orientation not in ORIENTATIONS:
            raise ValueError(f"config.orientation={orientation!r}; expected one of {ORIENTATIONS}.")
        zero_init = bool(_config_value(self.global_config, "zero_init", "global_config"))

        pair_act = jnp.asarray(pair_act)
        _check_pair(pair_act, pair_mask)
        c_z = pair_act.shape[-1]
        key_dim = int(_config_value(self.config, "key_dim", what, c_z))
        value_dim = int(_config_value(self.config, "value_dim", what, c_z))
        if num_head < 1 or key_dim % num_head or value_dim % num_head or key_dim != value_dim:
            raise ValueError(f"key_dim={key_dim}, value_dim={value_dim}, num_head={num_head}: "
                             "the fused op needs equal per-head key and value dims.")
        head_dim = key_dim // num_head

        column = orientation == "per_column"
        if column:
            pair_act = jnp.swapaxes(pair_act, -2, -3)
            if pair_mask is not None:
                pair_mask = jnp.swapaxes(jnp.asarray(pair_mask), -1, -2)

        dtype = pair_act.dtype
        param_dtype = jnp.float32 if _is_half(dtype) else dtype
        # AF2 creates feat_2d_weights before query_norm: the same rng draws.
        feat_2d_weights = hk.get_parameter(
            "feat_2d_weights", (c_z, num_head), param_dtype,
            init=hk.initializers.RandomNormal(stddev=1.0 / jnp.sqrt(int(c_z))),
        )
        x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=LAYER_NORM_EPS,
                         name="query_norm")(pair_act.astype(param_dtype))
        bias = jnp.einsum("...qkc,ch->...hqk", x, feat_2d_weights,
                          precision=resolve_precision(self.precision, param_dtype, param_dtype))
        mask = None if pair_mask is None else jnp.asarray(pair_mask) != 0

        attention = _Attention(
            num_head=num_head, head_dim=head_dim, gating=gating, zero_init=zero_init,
            output_dim=c_z, param_dtype=param_dtype,
            precision=resolve_precision(self.precision, dtype, dtype),
            implementation=self.implementation, block_config=self.block_config,
            row_chunk=None if is_training else inference_row_chunk(
                x.shape, dtype, num_head, head_dim, self.inference_chunk_bytes),
        )
        out = attention(x.astype(dtype), mask, bias)
        if column:
            out = jnp.swapaxes(out, -2, -3)
        return out if residual is None else residual + out


def _check_pair(pair_act, pair_mask) -> None:
    shape = tuple(pair_act.shape)
    if len(shape) < 3 or shape[-2] != shape[-3] or not jnp.issubdtype(pair_act.dtype, jnp.floating):
        raise ValueError(f"pair_act has shape {shape_str(shape)} and dtype {pair_act.dtype}; "
                         "expected a floating [N_res, N_res, c_z].")
    if pair_mask is not None and tuple(jnp.shape(pair_mask)) != shape[:-1]:
        raise ValueError(f"pair_mask has shape {shape_str(jnp.shape(pair_mask))}; expected "
                         f"[{', '.join(map(str, shape[:-1]))}] ([N_res, N_res] of pair_act).")
