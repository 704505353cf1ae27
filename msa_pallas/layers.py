"""Flax (linen) layer: MSA row-wise gated self-attention with pair bias.

`MSARowAttentionWithPairBias` mirrors the PyTorch reference layer
(`tests/fixtures/torch_reference.py`: same sub-module names, same maths, PyTorch's
`nn.Linear` initialisation in distribution) and, through options or the
`MSARowAttentionWithPairBias.alphafold2(...)` preset, AlphaFold2's / OpenFold's
variant (Algorithm 7 of the AF2 supplement).

The projections produce `[*batch, S, N, H, d]` directly (`nn.Dense` parameters
per projection, q, k, v and the gate computed by `layer_core.fused_projections`:
one product where all four have biases; a free reshape to heads), and the gate
logits are handed to `msa_pallas.msa_row_attention`, which applies
`sigmoid(gate)` inside the kernel: no transposes of q, k, v, gate or output.
The only transpose is of the small pair projection
`[*batch, N, N, H] -> [*batch, H, N, N]`.

Example::

    import jax, jax.numpy as jnp
    import msa_pallas

    layer = msa_pallas.MSARowAttentionWithPairBias(msa_dim=64, pair_dim=64, num_heads=4)
    m = jax.random.normal(jax.random.key(0), (2, 8, 32, 64))
    z = jax.random.normal(jax.random.key(1), (2, 32, 32, 64))
    mask = jnp.ones((2, 8, 32), bool)
    variables = layer.init(jax.random.key(2), m, z, mask)
    out = layer.apply(variables, m, z, mask, deterministic=True)   # [2, 8, 32, 64]
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

from msa_pallas.layer_core import (
    DROPOUT_MODES,
    GATING_INITS,
    LAYER_NORM_EPS,
    alphafold2_options,
    attention_dropout_rate,
    check_config,
    check_inputs,
    fused_projections,
    gate_initializers,
    gated_row_attention,
    needs_dropout_rng,
    output_dropout,
    output_initializers,
    resolve_head_dim,
    resolve_precision,
    torch_linear_bias_init,
    torch_linear_kernel_init,
)

# Names re-exported here for code written against earlier releases, where
# this module also held the shared maths (now msa_pallas.layer_core).
__all__ = [
    "MSARowAttentionWithPairBias",
    "torch_linear_kernel_init",
    "torch_linear_bias_init",
    "resolve_precision",
    "DROPOUT_MODES",
    "GATING_INITS",
    "LAYER_NORM_EPS",
]


# --------------------------------------------------------------------------
# The linen layer.
# --------------------------------------------------------------------------

class _DenseParams(nn.Module):
    """An `nn.Dense`'s parameters without its product: `kernel [in, out]` and
    `bias [out]`, created in Dense's order with its names."""

    in_features: int
    features: int
    use_bias: bool
    kernel_init: Callable
    bias_init: Callable
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", self.kernel_init, (self.in_features, self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return kernel, bias


class MSARowAttentionWithPairBias(nn.Module):
    """MSA row-wise gated self-attention with pair bias (flax.linen).

    Computes, per batch element, MSA row s, head h, residue i::

        x = LayerNorm(msa_repr)                    # eps 1e-5
        q, k, v, g = query(x), key(x), value(x), gate(x)      # [.., S, N, H, d]
        bias = pair_bias(pair_repr)                # [.., N, N, H] -> [.., H, N, N]
        o = msa_row_attention(q, k, v, bias, msa_mask, gate=g)  # softmax(q.k/sqrt(d) + bias) v * sigmoid(g)
        out = out_proj(o)                          # [.., S, N, msa_dim]

    Defaults match the PyTorch reference layer (`tests/fixtures/torch_reference.py`):
    biases on every projection, no pair LayerNorm, PyTorch `nn.Linear`
    initialisation (`U(-1/sqrt(fan_in), 1/sqrt(fan_in))` for weights and
    biases), dropout on the attention weights. `MSARowAttentionWithPairBias.alphafold2()`
    sets AlphaFold2 / OpenFold's conventions.

    Attributes:
      msa_dim: channels of the MSA representation (c_m).
      pair_dim: channels of the pair representation (c_z).
      num_heads: attention heads H.
      dropout: dropout rate, active only with `deterministic=False` (rng stream
        `"dropout"`); where it applies is set by `dropout_mode`.
      head_dim: per-head width d; default `msa_dim // num_heads`.
      pair_layer_norm: LayerNorm (eps 1e-5) on `pair_repr` before the pair
        projection (AlphaFold2's `feat_2d_norm`, OpenFold's `layer_norm_z`).
      qkv_bias: biases on the query/key/value projections (False in AF2).
      pair_bias_bias: bias on the pair projection (False in AF2).
      gating_init: `"default"` (PyTorch Linear init) or `"af2"` (gate weight 0,
        bias 1, so the gate starts at sigmoid(1)).
      zero_init_output: initialise `out_proj` weight and bias to zero (AF2's
        "final" init: the layer starts as the zero function).
      dropout_mode: `"attention"` drops attention weights (the reference
        layer's `nn.Dropout` after the softmax), inside the op's kernels
        (`msa_pallas.dropout`: the mask is a function of the `"dropout"`
        key and the weight's coordinates, the same on every backend).
        `"output_shared_rows"` is AlphaFold2's: dropout on the
        layer's output with one mask shared by all S rows (AF2's
        `shared_dropout`, `orientation="per_row"`); the kernels stay in use.
      implementation: passed to `msa_pallas.msa_row_attention` (None: Pallas
        on GPU, plain XLA elsewhere; `"pallas"` on CPU runs interpret mode).
      block_config: optional `msa_pallas.BlockConfig` for the kernels.
      dtype: compute dtype (e.g. `jnp.bfloat16`); None infers from inputs and
        params. LayerNorm statistics and the softmax stay float32.
      param_dtype: dtype of the parameters (default float32).
      precision: matmul precision of the projections; None: `HIGHEST` when
        computing in float32 (no silent TF32 on GPUs), the default otherwise.
      layer_norm_eps: LayerNorm epsilon (1e-5, as PyTorch and AlphaFold).
      attention_fn: the attention core, a callable with
        `msa_pallas.msa_row_attention`'s signature (called as
        `attention_fn(q, k, v, bias, mask, gate, implementation=...,
        block_config=..., dropout_rate=..., dropout_rng=...)` with q, k, v,
        gate `[*batch, S, N, H, d]` and bias `[*batch, H, N, N]`, returning
        `[*batch, S, N, H, d]`); None means `msa_pallas.msa_row_attention`.
        Lets a benchmark or a test swap the op and keep the layer.
    """

    msa_dim: int
    pair_dim: int
    num_heads: int
    dropout: float = 0.0
    head_dim: int | None = None
    pair_layer_norm: bool = False
    qkv_bias: bool = True
    pair_bias_bias: bool = True
    gating_init: str = "default"
    zero_init_output: bool = False
    dropout_mode: str = "attention"
    implementation: str | None = None
    block_config: Any = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    layer_norm_eps: float = LAYER_NORM_EPS
    attention_fn: Callable | None = None

    def __post_init__(self):
        check_config(self)
        super().__post_init__()

    @classmethod
    def alphafold2(
        cls,
        msa_dim: int = 256,
        pair_dim: int = 128,
        num_heads: int = 8,
        dropout: float = 0.15,
        **kwargs,
    ) -> "MSARowAttentionWithPairBias":
        """AlphaFold2 / OpenFold's layer (Evoformer MSA row attention, Algorithm 7).

        Pair LayerNorm, no q/k/v or pair-projection biases, gate init weight 0
        bias 1, zero-initialised output projection, dropout 0.15 on the output
        with a mask shared across MSA rows. Defaults are the Evoformer's sizes
        (c_m=256, c_z=128, H=8, d=32); the extra-MSA stack is
        `alphafold2(msa_dim=64, num_heads=8)` (d=8). Any field can be
        overridden through kwargs, e.g. `dtype=jnp.bfloat16`.

        Example::

            layer = MSARowAttentionWithPairBias.alphafold2()
            variables = layer.init(rng, m, z, mask)
            out = layer.apply(variables, m, z, mask, deterministic=False,
                              rngs={"dropout": key})
        """
        options = alphafold2_options(dropout)
        options.update(kwargs)
        return cls(msa_dim=msa_dim, pair_dim=pair_dim, num_heads=num_heads, **options)

    @property
    def resolved_head_dim(self) -> int:
        return resolve_head_dim(self.msa_dim, self.num_heads, self.head_dim)

    def _dense(self, features: int, fan_in: int, name: str, use_bias: bool = True,
               kernel_init=None, bias_init=None) -> nn.Dense:
        return nn.Dense(
            features,
            use_bias=use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=resolve_precision(self.precision, self.dtype, self.param_dtype),
            kernel_init=kernel_init or torch_linear_kernel_init(),
            bias_init=bias_init or torch_linear_bias_init(fan_in),
            name=name,
        )

    def _dense_params(self, features: int, fan_in: int, name: str, use_bias: bool = True,
                      kernel_init=None, bias_init=None):
        """(kernel, bias or None) of an `nn.Dense` named `name`: the same parameters,
        initialised alike, for a product that `fused_projections` shares."""
        return _DenseParams(
            fan_in, features, use_bias,
            kernel_init=kernel_init or torch_linear_kernel_init(),
            bias_init=bias_init or torch_linear_bias_init(fan_in),
            param_dtype=self.param_dtype,
            name=name,
        )()

    def _layer_norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(
            epsilon=self.layer_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_fast_variance=False,
            name=name,
        )

    @nn.compact
    def __call__(self, msa_repr, pair_repr, msa_mask=None, deterministic: bool = True):
        """Applies the layer.

        Args:
          msa_repr: `[*batch, S, N, msa_dim]`.
          pair_repr: `[*batch, N, N, pair_dim]`.
          msa_mask: `[*batch, S, N]`, bool or numeric (nonzero keeps a key), or None.
          deterministic: True disables dropout (the default; pass False to train
            with dropout, with a `"dropout"` rng: `rngs={"dropout": key}`).

        Returns:
          `[*batch, S, N, msa_dim]` in the compute dtype.
        """
        check_inputs(msa_repr, pair_repr, msa_mask, self.msa_dim, self.pair_dim)
        heads, head_dim = self.num_heads, self.resolved_head_dim
        inner = heads * head_dim

        x = self._layer_norm("layer_norm")(msa_repr)
        q, k, v, g = fused_projections(
            x,
            [self._dense_params(inner, self.msa_dim, "query", self.qkv_bias),
             self._dense_params(inner, self.msa_dim, "key", self.qkv_bias),
             self._dense_params(inner, self.msa_dim, "value", self.qkv_bias),
             self._dense_params(inner, self.msa_dim, "gate", True,
                                **gate_initializers(self.gating_init))],
            dtype=self.dtype,
            precision=resolve_precision(self.precision, self.dtype, self.param_dtype),
        )

        z = pair_repr
        if self.pair_layer_norm:
            z = self._layer_norm("pair_layer_norm")(z)
        pair_proj = self._dense(heads, self.pair_dim, "pair_bias", self.pair_bias_bias)(z)

        # One key serves whichever dropout the mode applies (only one is active).
        key = self.make_rng("dropout") if needs_dropout_rng(self.dropout, deterministic) else None
        rate = attention_dropout_rate(self.dropout, self.dropout_mode, deterministic)
        o = gated_row_attention(
            q, k, v, g, pair_proj, msa_mask,
            num_heads=heads, head_dim=head_dim,
            implementation=self.implementation,
            block_config=self.block_config,
            dropout_rate=rate, dropout_rng=key if rate > 0.0 else None,
            attention_fn=self.attention_fn,
        )
        out = self._dense(self.msa_dim, inner, "out_proj", True,
                          **output_initializers(self.zero_init_output))(o)
        return output_dropout(out, self.dropout, self.dropout_mode, deterministic, key)
