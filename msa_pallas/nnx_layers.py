"""Flax NNX layer: MSA row-wise gated self-attention with pair bias.

`MSARowAttentionWithPairBiasNNX` has the same maths, options and parameter
names (`layer_norm`, `query`, `key`, `value`, `gate`, `pair_bias`, `out_proj`,
`pair_layer_norm`; `kernel [in, out]` / `bias`, LayerNorm `scale` / `bias`) as
the linen `msa_pallas.MSARowAttentionWithPairBias`, so weights move between
them unchanged:

    nnx_layer = MSARowAttentionWithPairBiasNNX.from_linen(linen_layer, variables)
    variables = nnx_layer.to_linen_variables()

Example::

    from flax import nnx
    from msa_pallas.nnx_layers import MSARowAttentionWithPairBiasNNX

    layer = MSARowAttentionWithPairBiasNNX(64, 64, 4, rngs=nnx.Rngs(0))
    out = layer(m, z, mask)            # deterministic by default, as the linen layer
    layer.train()                      # dropout on (with dropout > 0); layer.eval() turns it off
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from msa_pallas import layer_core as core
from msa_pallas.layers import MSARowAttentionWithPairBias

__all__ = ["MSARowAttentionWithPairBiasNNX"]

# Fields shared with the linen module (everything but the sizes and rngs).
_OPTION_FIELDS = (
    "dropout", "head_dim", "pair_layer_norm", "qkv_bias", "pair_bias_bias",
    "gating_init", "zero_init_output", "dropout_mode", "implementation",
    "block_config", "dtype", "param_dtype", "precision", "layer_norm_eps", "attention_fn",
)


class MSARowAttentionWithPairBiasNNX(nnx.Module):
    """MSA row-wise gated self-attention with pair bias (flax.nnx).

    Same arguments and maths as the linen `msa_pallas.MSARowAttentionWithPairBias`
    (see there); sizes and options are constructor arguments, and `rngs`
    supplies the `"params"` stream (initialisation) and the `"dropout"`
    stream (used when `dropout > 0` and the layer is not deterministic).

    `deterministic` is an attribute set by `layer.eval()` / `layer.train()`
    or `nnx.view(layer, deterministic=...)`, overridden per call by the
    `deterministic=` argument. Its default is True, as the linen layer's
    (where `nnx.Dropout` defaults to training), so a layer built for
    inference needs no dropout rng; `layer.train()` turns dropout on. With
    `dropout=0` (the default) it has no effect.

    `attention_fn` (a callable with `msa_pallas.msa_row_attention`'s
    signature; None means that op) swaps the attention core, as the linen
    layer's field of that name.
    """

    def __init__(
        self,
        msa_dim: int,
        pair_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        head_dim: int | None = None,
        pair_layer_norm: bool = False,
        qkv_bias: bool = True,
        pair_bias_bias: bool = True,
        gating_init: str = "default",
        zero_init_output: bool = False,
        dropout_mode: str = "attention",
        implementation: str | None = None,
        block_config: Any = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        layer_norm_eps: float = core.LAYER_NORM_EPS,
        attention_fn: Callable | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs,
    ):
        self.msa_dim, self.pair_dim, self.num_heads = msa_dim, pair_dim, num_heads
        self.dropout = dropout
        self.head_dim = head_dim
        self.pair_layer_norm_enabled = pair_layer_norm
        self.qkv_bias, self.pair_bias_bias = qkv_bias, pair_bias_bias
        self.gating_init, self.zero_init_output = gating_init, zero_init_output
        self.dropout_mode = dropout_mode
        self.implementation, self.block_config = implementation, block_config
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.layer_norm_eps = layer_norm_eps
        self.attention_fn = attention_fn
        self.deterministic = deterministic
        core.check_config(self)
        d = core.resolve_head_dim(msa_dim, num_heads, head_dim)
        self.resolved_head_dim = d
        inner = num_heads * d

        def linear(n_in, n_out, use_bias=True, kernel_init=None, bias_init=None):
            return nnx.Linear(
                n_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                precision=core.resolve_precision(precision, dtype, param_dtype),
                kernel_init=kernel_init or core.torch_linear_kernel_init(),
                bias_init=bias_init or core.torch_linear_bias_init(n_in),
                rngs=rngs,
            )

        def layer_norm(n):
            # dtype=None: statistics and normalisation in float32 from the
            # input as given, then cast (what linen's LayerNorm does).
            return nnx.LayerNorm(
                n, epsilon=layer_norm_eps, param_dtype=param_dtype,
                use_fast_variance=False, rngs=rngs,
            )

        self.layer_norm = layer_norm(msa_dim)
        self.query = linear(msa_dim, inner, qkv_bias)
        self.key = linear(msa_dim, inner, qkv_bias)
        self.value = linear(msa_dim, inner, qkv_bias)
        self.gate = linear(msa_dim, inner, True, **core.gate_initializers(gating_init))
        self.pair_layer_norm = layer_norm(pair_dim) if pair_layer_norm else nnx.data(None)
        self.pair_bias = linear(pair_dim, num_heads, pair_bias_bias)
        self.out_proj = linear(inner, msa_dim, True, **core.output_initializers(zero_init_output))
        if dropout > 0.0 and "dropout" in rngs:
            self.dropout_rngs = rngs["dropout"].fork()
        else:
            self.dropout_rngs = nnx.data(None)

    @classmethod
    def alphafold2(cls, msa_dim: int = 256, pair_dim: int = 128, num_heads: int = 8,
                   dropout: float = 0.15, *, rngs: nnx.Rngs, **kwargs):
        """AlphaFold2 / OpenFold conventions; see the linen `alphafold2()`."""
        options = core.alphafold2_options(dropout)
        options.update(kwargs)
        dropout = options.pop("dropout")
        return cls(msa_dim, pair_dim, num_heads, dropout, rngs=rngs, **options)

    def set_view(self, deterministic: bool | None = None):
        """Used by `nnx.view`, `.eval()` and `.train()`."""
        if deterministic is not None:
            self.deterministic = deterministic

    def _cast(self, x):
        return x if self.dtype is None else x.astype(self.dtype)

    def __call__(self, msa_repr, pair_repr, msa_mask=None, *,
                 deterministic: bool | None = None, rngs: nnx.Rngs | jax.Array | None = None):
        """Applies the layer; arguments and result as the linen layer's.

        `rngs` (an `nnx.Rngs` with a `"dropout"` stream, or a key) overrides
        the dropout stream given at construction.
        """
        core.check_inputs(msa_repr, pair_repr, msa_mask, self.msa_dim, self.pair_dim)
        if deterministic is None:
            deterministic = self.deterministic
        heads, d = self.num_heads, self.resolved_head_dim
        # One key serves whichever dropout the mode applies (only one is active).
        needs_key = core.needs_dropout_rng(self.dropout, deterministic)
        key = self._dropout_key(rngs) if needs_key else None

        x = self._cast(self.layer_norm(msa_repr))
        q, k, v, g = core.fused_projections(
            x,
            [(linear.kernel[...], None if linear.bias is None else linear.bias[...])
             for linear in (self.query, self.key, self.value, self.gate)],
            dtype=self.dtype,
            precision=core.resolve_precision(self.precision, self.dtype, self.param_dtype),
        )
        z = pair_repr
        if self.pair_layer_norm is not None:
            z = self._cast(self.pair_layer_norm(z))
        pair_proj = self.pair_bias(z)

        rate = core.attention_dropout_rate(self.dropout, self.dropout_mode, deterministic)
        o = core.gated_row_attention(
            q, k, v, g, pair_proj, msa_mask,
            num_heads=heads, head_dim=d,
            implementation=self.implementation,
            block_config=self.block_config,
            dropout_rate=rate, dropout_rng=key if rate > 0.0 else None,
            attention_fn=self.attention_fn,
        )
        out = self.out_proj(o)
        return core.output_dropout(out, self.dropout, self.dropout_mode, deterministic, key)

    def _dropout_key(self, rngs):
        if isinstance(rngs, nnx.Rngs):
            return rngs["dropout"]()
        if isinstance(rngs, jax.Array):
            return rngs
        if rngs is not None:
            raise TypeError(f"rngs must be an nnx.Rngs, a key or None; got {type(rngs).__name__}.")
        if self.dropout_rngs is None:
            raise ValueError(
                f"dropout={self.dropout} and deterministic=False need a 'dropout' rng: build "
                "the layer with nnx.Rngs(params=..., dropout=...) or pass rngs= to the call, "
                "or call it with deterministic=True / after .eval()."
            )
        return self.dropout_rngs()

    # ---------------------------------------------------------------- weights

    def to_linen_variables(self) -> dict:
        """The weights as linen variables `{"params": {...}}` (copies)."""
        state = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        params = {name: dict(sub) for name, sub in state.items() if sub}
        return {"params": jax.tree.map(jnp.asarray, params)}

    def load_linen_variables(self, variables: Mapping) -> "MSARowAttentionWithPairBiasNNX":
        """Copies linen variables (`{"params": ...}` or the params dict) into this layer.

        Shapes must match exactly; every parameter of the layer must be given
        and no extra ones. Returns self.
        """
        params = variables.get("params", variables)
        expected = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        expected = {name: sub for name, sub in expected.items() if sub}
        _check_same_tree(params, expected)
        for name, sub in expected.items():
            module = getattr(self, name)
            for leaf in sub:
                var = getattr(module, leaf)
                value = jnp.asarray(params[name][leaf], dtype=var[...].dtype)
                var[...] = value
        return self

    @classmethod
    def from_linen(cls, module: MSARowAttentionWithPairBias, variables: Mapping, *,
                   rngs: nnx.Rngs | None = None, **overrides) -> "MSARowAttentionWithPairBiasNNX":
        """An NNX layer with the linen `module`'s configuration and `variables`' weights.

        Args:
          module: the linen layer whose fields (sizes and options) to copy.
          variables: its variables, `{"params": ...}`.
          rngs: streams for the NNX layer (only `"dropout"` matters; the
            parameters are overwritten). Default `nnx.Rngs(0)`.
          overrides: constructor arguments to change (e.g. `implementation`).
        """
        kwargs = {name: getattr(module, name) for name in _OPTION_FIELDS}
        kwargs.update(overrides)
        dropout = kwargs.pop("dropout")
        layer = cls(module.msa_dim, module.pair_dim, module.num_heads, dropout,
                    rngs=rngs if rngs is not None else nnx.Rngs(0), **kwargs)
        return layer.load_linen_variables(variables)


def _check_same_tree(got: Mapping, expected: Mapping) -> None:
    missing, extra, bad = [], [], []
    for name, sub in expected.items():
        if name not in got:
            missing.append(name)
            continue
        for leaf, ref in sub.items():
            if leaf not in got[name]:
                missing.append(f"{name}/{leaf}")
            elif tuple(np.shape(got[name][leaf])) != tuple(np.shape(ref)):
                bad.append(f"{name}/{leaf}: got {tuple(np.shape(got[name][leaf]))}, "
                           f"expected {tuple(np.shape(ref))}")
        for leaf in got.get(name, {}):
            if leaf not in sub:
                extra.append(f"{name}/{leaf}")
    extra += [name for name in got if name not in expected]
    if missing or extra or bad:
        raise ValueError(
            "linen variables do not fit the NNX layer: "
            + "; ".join(
                part for part in (
                    f"missing {missing}" if missing else "",
                    f"unexpected {extra}" if extra else "",
                    f"wrong shapes {bad}" if bad else "",
                ) if part
            )
        )
