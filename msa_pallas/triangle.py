"""Triangle attention around the starting and the ending node, in flax.linen and flax.nnx.

`TriangleAttention` (linen) and `TriangleAttentionNNX` mirror OpenFold's
`TriangleAttentionStartingNode` / `TriangleAttentionEndingNode` (Algorithms
13 and 14 of the AlphaFold2 supplement), on `msa_pallas.msa_row_attention`.

Starting node, for a pair representation `z [*batch, N, N, c]`, row i, head h::

    x = LayerNorm(z)                                  # eps 1e-5
    q, k, v, g = query(x), key(x), value(x), gate(x)  # [*, N_i, N_j, H, d], no biases on q/k/v
    b[h, j, k] = pair_bias(x)[j, k, h]                # Linear c -> H, no bias
    o[i, j] = softmax_k(q[i,j] . k[i,k] / sqrt(d) + b[j, k], keys k with mask[i, k])
              @ v[i, :] * sigmoid(g[i, j])
    out = out_proj(o)                                 # [*, N, N, c]

That is the op with the pair's rows as its "MSA rows" (S = N) and the bias
computed from the same normalised pair: q, k, v and the gate come out of the
projections already in the op's `[*, S, N, H, d]` layout. The ending node is
the starting node on the transposed pair (`z` and the mask swapped on their
two residue axes, the output swapped back), as OpenFold computes it. Only the
`[*, N, N, c]` input and output are transposed: XLA folds the first into the
layer norm that reads it and the second into the output's consumer; q, k, v,
the gate and the bias are never transposed.

Masks: OpenFold adds `1e9 * (mask - 1)` to the logits; the op replaces the
masked logits with -1e9. They agree on every row that keeps a key; a row with
no key kept gets uniform weights here and in OpenFold's float32 (the -1e9 shift
swallows the logits), the softmax of its unmasked logits in OpenFold's float64;
OpenFold zeroes such padded rows downstream.

Parameters (linen names; the NNX module has the same tree)::

    layer_norm/{scale,bias}        [c]             OpenFold layer_norm, AF2 query_norm
    query, key, value/kernel       [c, H * d]      glorot uniform (OpenFold "glorot")
    gate/{kernel,bias}             [c, H * d]      zeros / ones  (OpenFold "gating")
    pair_bias/kernel               [c, H]          normal(1/sqrt(c)) (AF2 feat_2d_weights)
    out_proj/{kernel,bias}         [H * d, c]      zeros (OpenFold "final", AF2 zero_init)

Dropout (0.25 in AlphaFold2, per row for the starting node, per column for
the ending node) is applied by the model around the module, as in OpenFold
and AlphaFold2: the module has none.

Example::

    import jax, jax.numpy as jnp
    from msa_pallas.triangle import TriangleAttention

    layer = TriangleAttention(pair_dim=128, num_heads=4, head_dim=32, starting=False)
    z = jax.random.normal(jax.random.key(0), (64, 64, 128))
    mask = jnp.ones((64, 64), bool)
    variables = layer.init(jax.random.key(1), z, mask)
    update = layer.apply(variables, z, mask)              # [64, 64, 128]
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from msa_pallas import layer_core as core
from msa_pallas.validation import shape_str

__all__ = ["TriangleAttention", "TriangleAttentionNNX", "check_pair_inputs"]


def _glorot():
    return jax.nn.initializers.glorot_uniform()


def _bias_kernel_init(pair_dim: int):
    """AF2's feat_2d_weights: normal with stddev 1/sqrt(c)."""
    return jax.nn.initializers.normal(1.0 / math.sqrt(pair_dim))


def check_pair_inputs(pair_repr, pair_mask, pair_dim: int) -> None:
    """ValueError naming the argument when `pair_repr [*, N, N, c]` or its mask do not fit."""
    shape = tuple(pair_repr.shape)
    if len(shape) < 3 or shape[-1] != pair_dim or shape[-2] != shape[-3]:
        raise ValueError(f"pair_repr has shape {shape_str(shape)}; expected "
                         f"[*batch, N, N, pair_dim={pair_dim}].")
    if pair_mask is not None and tuple(pair_mask.shape) != shape[:-1]:
        raise ValueError(f"pair_mask has shape {shape_str(pair_mask.shape)}; expected "
                         f"[{', '.join(map(str, shape[:-1]))}] ([*batch, N, N] of pair_repr).")


def _orient(x, starting: bool, axis: int):
    """The ending node works on the transpose: residue axes `axis` and `axis + 1` swapped."""
    return x if starting else jnp.swapaxes(x, axis, axis + 1)


class TriangleAttention(nn.Module):
    """Triangle self-attention around the starting or ending node (flax.linen).

    Attributes:
      pair_dim: channels c of the pair representation (OpenFold `c_in`).
      num_heads: heads H (`no_heads`; 4 in AlphaFold2).
      head_dim: per-head width d (`c_hidden`; 32 in AlphaFold2); default
        `pair_dim // num_heads`.
      starting: True for the starting node (attention along each row), False
        for the ending node (along each column).
      implementation, block_config: passed to `msa_pallas.msa_row_attention`.
      dtype: compute dtype (None: from the inputs and params); layer norm
        statistics and the softmax stay float32.
      param_dtype: parameter dtype (float32).
      precision: matmul precision of the projections; None: `HIGHEST` when
        computing in float32, the default otherwise.
      layer_norm_eps: 1e-5, as OpenFold and AlphaFold2.
      attention_fn: a callable with `msa_row_attention`'s signature in place
        of the op (None: the op).
    """

    pair_dim: int
    num_heads: int
    head_dim: int | None = None
    starting: bool = True
    implementation: str | None = None
    block_config: Any = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    layer_norm_eps: float = core.LAYER_NORM_EPS
    attention_fn: Callable | None = None

    @property
    def resolved_head_dim(self) -> int:
        return core.resolve_head_dim(self.pair_dim, self.num_heads, self.head_dim)

    @nn.compact
    def __call__(self, pair_repr, pair_mask=None):
        """Applies the module.

        Args:
          pair_repr: `[*batch, N, N, pair_dim]`.
          pair_mask: `[*batch, N, N]`, bool or numeric (nonzero keeps), or None.

        Returns:
          The update `[*batch, N, N, pair_dim]` in the compute dtype.
        """
        check_pair_inputs(pair_repr, pair_mask, self.pair_dim)
        heads, d = self.num_heads, self.resolved_head_dim
        inner = heads * d
        precision = core.resolve_precision(self.precision, self.dtype, self.param_dtype)

        def dense(features, name, use_bias=False, kernel_init=_glorot(), bias_init=None):
            return nn.Dense(features, use_bias=use_bias, dtype=self.dtype,
                            param_dtype=self.param_dtype, precision=precision,
                            kernel_init=kernel_init,
                            bias_init=bias_init or jax.nn.initializers.zeros, name=name)

        x = _orient(pair_repr, self.starting, -3)
        mask = None if pair_mask is None else _orient(pair_mask, self.starting, -2)
        x = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype,
                         param_dtype=self.param_dtype, use_fast_variance=False,
                         name="layer_norm")(x)
        q, k, v = (dense(inner, name)(x) for name in ("query", "key", "value"))
        g = dense(inner, "gate", True, **core.gate_initializers("af2"))(x)
        pair_proj = dense(heads, "pair_bias", kernel_init=_bias_kernel_init(self.pair_dim))(x)
        o = core.gated_row_attention(
            q, k, v, g, pair_proj, mask, num_heads=heads, head_dim=d,
            implementation=self.implementation, block_config=self.block_config,
            attention_fn=self.attention_fn,
        )
        out = dense(self.pair_dim, "out_proj", True, **core.output_initializers(True))(o)
        return _orient(out, self.starting, -3)


_NNX_OPTIONS = ("head_dim", "starting", "implementation", "block_config", "dtype",
                "param_dtype", "precision", "layer_norm_eps", "attention_fn")


class TriangleAttentionNNX(nnx.Module):
    """Triangle self-attention (flax.nnx): the linen `TriangleAttention`'s
    arguments, maths and parameter tree (see there); `rngs` draws the
    initial parameters.

    Example::

        layer = TriangleAttentionNNX(128, 4, head_dim=32, starting=True, rngs=nnx.Rngs(0))
        update = layer(z, mask)
    """

    def __init__(self, pair_dim: int, num_heads: int, *, head_dim: int | None = None,
                 starting: bool = True, implementation: str | None = None,
                 block_config: Any = None, dtype: Any = None, param_dtype: Any = jnp.float32,
                 precision: Any = None, layer_norm_eps: float = core.LAYER_NORM_EPS,
                 attention_fn: Callable | None = None, rngs: nnx.Rngs):
        self.pair_dim, self.num_heads = pair_dim, num_heads
        self.head_dim = core.resolve_head_dim(pair_dim, num_heads, head_dim)
        self.starting = starting
        self.implementation, self.block_config = implementation, block_config
        self.dtype, self.param_dtype = dtype, param_dtype
        self.precision = precision
        self.layer_norm_eps = layer_norm_eps
        self.attention_fn = attention_fn
        inner = num_heads * self.head_dim
        resolved = core.resolve_precision(precision, dtype, param_dtype)

        def linear(n_in, n_out, use_bias=False, kernel_init=_glorot(), bias_init=None):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype,
                              param_dtype=param_dtype, precision=resolved,
                              kernel_init=kernel_init,
                              bias_init=bias_init or jax.nn.initializers.zeros, rngs=rngs)

        self.layer_norm = nnx.LayerNorm(pair_dim, epsilon=layer_norm_eps,
                                        param_dtype=param_dtype, use_fast_variance=False,
                                        rngs=rngs)
        self.query = linear(pair_dim, inner)
        self.key = linear(pair_dim, inner)
        self.value = linear(pair_dim, inner)
        self.gate = linear(pair_dim, inner, True, **core.gate_initializers("af2"))
        self.pair_bias = linear(pair_dim, num_heads, kernel_init=_bias_kernel_init(pair_dim))
        self.out_proj = linear(inner, pair_dim, True, **core.output_initializers(True))

    def __call__(self, pair_repr, pair_mask=None):
        """`pair_repr [*batch, N, N, c]`, `pair_mask [*batch, N, N]` or None -> `[*batch, N, N, c]`."""
        check_pair_inputs(pair_repr, pair_mask, self.pair_dim)
        x = _orient(pair_repr, self.starting, -3)
        mask = None if pair_mask is None else _orient(pair_mask, self.starting, -2)
        x = self.layer_norm(x)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        o = core.gated_row_attention(
            self.query(x), self.key(x), self.value(x), self.gate(x), self.pair_bias(x), mask,
            num_heads=self.num_heads, head_dim=self.head_dim,
            implementation=self.implementation, block_config=self.block_config,
            attention_fn=self.attention_fn,
        )
        return _orient(self.out_proj(o), self.starting, -3)

    def to_linen_variables(self) -> dict:
        """The weights as the linen module's variables `{"params": {...}}`."""
        state = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return {"params": jax.tree.map(jnp.asarray, {k: dict(v) for k, v in state.items() if v})}

    def load_linen_variables(self, variables: Mapping) -> "TriangleAttentionNNX":
        """Copies linen variables (as the converters return) into this module; returns it."""
        params = variables.get("params", variables)
        expected = {k: v for k, v in nnx.to_pure_dict(nnx.state(self, nnx.Param)).items() if v}
        problems = []
        for name, sub in expected.items():
            for leaf, ref in sub.items():
                got = params.get(name, {}).get(leaf)
                if got is None or tuple(np.shape(got)) != tuple(np.shape(ref)):
                    problems.append(f"{name}/{leaf}: expected {tuple(np.shape(ref))}, got "
                                    f"{None if got is None else tuple(np.shape(got))}")
        extra = sorted(f"{n}/{leaf}" for n, sub in params.items() for leaf in sub
                       if leaf not in expected.get(n, {}))
        if problems or extra:
            raise ValueError("linen variables do not fit TriangleAttentionNNX: "
                             + "; ".join(problems + [f"unexpected {extra}"] * bool(extra)))
        for name, sub in expected.items():
            module = getattr(self, name)
            for leaf in sub:
                var = getattr(module, leaf)
                var[...] = jnp.asarray(params[name][leaf], dtype=var[...].dtype)
        return self

    @classmethod
    def from_linen(cls, module: TriangleAttention, variables: Mapping, *,
                   rngs: nnx.Rngs | None = None, **overrides) -> "TriangleAttentionNNX":
        """The NNX module with the linen `module`'s fields and `variables`' weights."""
        kwargs = {name: getattr(module, name) for name in _NNX_OPTIONS}
        kwargs.update(overrides)
        layer = cls(module.pair_dim, module.num_heads,
                    rngs=rngs if rngs is not None else nnx.Rngs(0), **kwargs)
        return layer.load_linen_variables(variables)
