"""Flax (linen) layer: MSA row-wise gated self-attention with pair bias.

`MSARowAttentionWithPairBias` mirrors the PyTorch layer in the project's
`reference/torch_reference.py` (same sub-module names, same maths, PyTorch's
`nn.Linear` initialisation in distribution) and, through options or the
`MSARowAttentionWithPairBias.alphafold2(...)` preset, AlphaFold2's / OpenFold's
variant (Algorithm 7 of the AF2 supplement).

The projections produce `[*batch, S, N, H, d]` directly (a Dense to `H * d`
features and a free reshape), and the gate logits are handed to
`msa_pallas.msa_row_attention`, which applies `sigmoid(gate)` inside the
kernel: no transposes of q, k, v, gate or output. The only transpose is of the
small pair projection `[*batch, N, N, H] -> [*batch, H, N, N]`.

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

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from msa_pallas.attention import msa_row_attention
from msa_pallas.validation import shape_str

GATING_INITS = ("default", "af2")
DROPOUT_MODES = ("attention", "output_shared_rows")
LAYER_NORM_EPS = 1e-5  # PyTorch's and AlphaFold's; flax's default is 1e-6.

__all__ = [
    "MSARowAttentionWithPairBias",
    "torch_linear_kernel_init",
    "torch_linear_bias_init",
    "DROPOUT_MODES",
    "GATING_INITS",
]


# --------------------------------------------------------------------------
# Initialisers equal in distribution to PyTorch's nn.Linear defaults.
# --------------------------------------------------------------------------

def torch_linear_kernel_init():
    """`nn.Linear.weight`'s default, kaiming_uniform(a=sqrt(5)), for a Flax kernel.

    PyTorch draws `U(-b, b)` with `b = gain * sqrt(3 / fan_in)`,
    `gain = sqrt(2 / (1 + 5)) = sqrt(1/3)`, i.e. `b = 1 / sqrt(fan_in)`. A
    Flax kernel is `[in, out]`, so fan_in is axis -2: `variance_scaling(1/3,
    "fan_in", "uniform")` draws from exactly that distribution.
    """
    return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_linear_bias_init(fan_in: int):
    """`nn.Linear.bias`'s default: `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _constant_init(value: float):
    def init(key, shape, dtype=jnp.float32):
        del key
        return jnp.full(shape, value, dtype)

    return init


# --------------------------------------------------------------------------
# Configuration checks and the maths shared with the NNX layer.
# --------------------------------------------------------------------------

def resolve_head_dim(msa_dim: int, num_heads: int, head_dim: int | None) -> int:
    """`head_dim`, defaulting to `msa_dim // num_heads` (which must divide)."""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads}; expected >= 1.")
    if head_dim is not None:
        if head_dim < 1:
            raise ValueError(f"head_dim={head_dim}; expected >= 1.")
        return head_dim
    if msa_dim % num_heads:
        raise ValueError(
            f"msa_dim={msa_dim} is not divisible by num_heads={num_heads}; "
            "pass head_dim explicitly or choose a divisor."
        )
    return msa_dim // num_heads


def check_config(cfg) -> None:
    """Checks the option fields shared by the linen and NNX layers."""
    if cfg.gating_init not in GATING_INITS:
        raise ValueError(f"gating_init={cfg.gating_init!r}; expected one of {GATING_INITS}.")
    if cfg.dropout_mode not in DROPOUT_MODES:
        raise ValueError(f"dropout_mode={cfg.dropout_mode!r}; expected one of {DROPOUT_MODES}.")
    if not 0.0 <= float(cfg.dropout) < 1.0:
        raise ValueError(f"dropout={cfg.dropout!r}; expected a float in [0, 1).")
    for name in ("msa_dim", "pair_dim"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}; expected >= 1.")
    resolve_head_dim(cfg.msa_dim, cfg.num_heads, cfg.head_dim)


def check_inputs(msa_repr, pair_repr, msa_mask, msa_dim: int, pair_dim: int) -> None:
    """ValueError naming the argument when the layer inputs do not fit together."""
    if msa_repr.ndim < 3 or msa_repr.shape[-1] != msa_dim:
        raise ValueError(
            f"msa_repr has shape {shape_str(msa_repr.shape)}; expected [*batch, S, N, msa_dim={msa_dim}]."
        )
    *batch, _, n_res, _ = msa_repr.shape
    expected_pair = (*batch, n_res, n_res, pair_dim)
    if tuple(pair_repr.shape) != expected_pair:
        raise ValueError(
            f"pair_repr has shape {shape_str(pair_repr.shape)}; expected "
            f"[{', '.join(map(str, expected_pair))}] ([*batch, N, N, pair_dim] for msa_repr "
            f"of shape {shape_str(msa_repr.shape)})."
        )
    if msa_mask is not None and tuple(msa_mask.shape) != tuple(msa_repr.shape[:-1]):
        raise ValueError(
            f"msa_mask has shape {shape_str(msa_mask.shape)}; expected "
            f"[{', '.join(map(str, msa_repr.shape[:-1]))}] ([*batch, S, N] for msa_repr of "
            f"shape {shape_str(msa_repr.shape)})."
        )


def resolve_precision(precision, dtype, param_dtype):
    """Matmul precision of the projections.

    None means float32 really is float32 when the layer computes in float32
    (`HIGHEST`: no silent TF32 on GPUs, as the op's plain path), and the
    backend default for bf16/fp16 compute. Pass `jax.lax.Precision.DEFAULT`
    to allow TF32.
    """
    if precision is not None:
        return precision
    compute = jnp.dtype(dtype if dtype is not None else param_dtype)
    return jax.lax.Precision.HIGHEST if compute == jnp.float32 else None


def attention_dropout_active(dropout: float, dropout_mode: str, deterministic: bool) -> bool:
    return dropout > 0.0 and not deterministic and dropout_mode == "attention"


def op_implementation(implementation: str | None, attention_dropout: bool) -> str | None:
    """The `implementation` handed to the op.

    The Pallas kernels do not do attention dropout yet (the op raises for
    `"pallas"` with a rate > 0), so while attention dropout is active a layer
    configured with `"pallas"` passes `None`, which lets the op pick the path
    that supports it (today the plain `"xla"` path).
    """
    if attention_dropout and implementation == "pallas":
        return None
    return implementation


def gated_row_attention(
    q, k, v, gate, pair_proj, msa_mask, *,
    num_heads: int, head_dim: int,
    implementation: str | None, block_config=None,
    dropout_rate: float = 0.0, dropout_rng=None,
):
    """The attention core shared by the linen and NNX layers.

    Args:
      q, k, v, gate: `[*batch, S, N, H * d]` projections (gate as logits).
      pair_proj: `[*batch, N, N, H]` pair projection.
      msa_mask: `[*batch, S, N]` or None.

    Returns:
      `[*batch, S, N, H * d]`, the gated attention output before `out_proj`.
    """
    def heads(x):  # a free reshape to the op's [*batch, S, N, H, d] layout
        return x.reshape(*x.shape[:-1], num_heads, head_dim)

    bias = jnp.moveaxis(pair_proj, -1, -3)  # [*batch, H, N, N]
    out = msa_row_attention(
        heads(q), heads(k), heads(v), bias, msa_mask, heads(gate),
        implementation=implementation, block_config=block_config,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
    )
    return out.reshape(*out.shape[:-2], num_heads * head_dim)


def alphafold2_options(dropout: float = 0.15) -> dict[str, Any]:
    """The fields that make the layer AlphaFold2's / OpenFold's (Algorithm 7)."""
    return dict(
        dropout=dropout,
        pair_layer_norm=True,
        qkv_bias=False,
        pair_bias_bias=False,
        gating_init="af2",
        zero_init_output=True,
        dropout_mode="output_shared_rows",
    )


# --------------------------------------------------------------------------
# The linen layer.
# --------------------------------------------------------------------------

class MSARowAttentionWithPairBias(nn.Module):
    """MSA row-wise gated self-attention with pair bias (flax.linen).

    Computes, per batch element, MSA row s, head h, residue i::

        x = LayerNorm(msa_repr)                    # eps 1e-5
        q, k, v, g = query(x), key(x), value(x), gate(x)      # [.., S, N, H, d]
        bias = pair_bias(pair_repr)                # [.., N, N, H] -> [.., H, N, N]
        o = msa_row_attention(q, k, v, bias, msa_mask, gate=g)  # softmax(q.k/sqrt(d) + bias) v * sigmoid(g)
        out = out_proj(o)                          # [.., S, N, msa_dim]

    Defaults match the PyTorch reference layer (`reference/torch_reference.py`):
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
        layer's `nn.Dropout` after the softmax). The Pallas kernels have no
        dropout yet, so while it is active (`dropout > 0` and
        `deterministic=False`) the op runs its plain `"xla"` path, even with
        `implementation="pallas"`; inference (`deterministic=True`) uses the
        kernels. `"output_shared_rows"` is AlphaFold2's: dropout on the
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
        q = self._dense(inner, self.msa_dim, "query", self.qkv_bias)(x)
        k = self._dense(inner, self.msa_dim, "key", self.qkv_bias)(x)
        v = self._dense(inner, self.msa_dim, "value", self.qkv_bias)(x)
        if self.gating_init == "af2":
            gate_inits = dict(kernel_init=nn.initializers.zeros, bias_init=_constant_init(1.0))
        else:
            gate_inits = {}
        g = self._dense(inner, self.msa_dim, "gate", True, **gate_inits)(x)

        z = pair_repr
        if self.pair_layer_norm:
            z = self._layer_norm("pair_layer_norm")(z)
        pair_proj = self._dense(heads, self.pair_dim, "pair_bias", self.pair_bias_bias)(z)

        attn_dropout = attention_dropout_active(self.dropout, self.dropout_mode, deterministic)
        o = gated_row_attention(
            q, k, v, g, pair_proj, msa_mask,
            num_heads=heads, head_dim=head_dim,
            implementation=op_implementation(self.implementation, attn_dropout),
            block_config=self.block_config,
            dropout_rate=float(self.dropout) if attn_dropout else 0.0,
            dropout_rng=self.make_rng("dropout") if attn_dropout else None,
        )

        if self.zero_init_output:
            out_inits = dict(kernel_init=nn.initializers.zeros, bias_init=nn.initializers.zeros)
        else:
            out_inits = {}
        out = self._dense(self.msa_dim, inner, "out_proj", True, **out_inits)(o)

        if self.dropout_mode == "output_shared_rows" and self.dropout > 0.0:
            # One mask per [*batch, N, C], shared by the S rows (axis -3).
            out = nn.Dropout(
                rate=self.dropout, broadcast_dims=(out.ndim - 3,), name="output_dropout"
            )(out, deterministic=deterministic)
        return out
