"""Haiku module: AlphaFold2's `MSARowAttentionWithPairBias` on the fused op.

A drop-in replacement for `alphafold.model.modules.MSARowAttentionWithPairBias`
(Algorithm 7 of the AlphaFold2 supplement): same constructor, same call, same
parameter tree (scopes, names, shapes, initialisers), so AlphaFold2's
parameter files load into it unchanged. The attention itself runs through
`msa_pallas.msa_row_attention` (the Pallas kernels on a GPU), which never
materialises the `[S, H, N, N]` logits.

dm-haiku is an optional dependency: `pip install dm-haiku`, or in a checkout
`pip install -e ".[haiku]"`. Import
this module explicitly (`import msa_pallas.haiku`); `import msa_pallas` does
not import Haiku.

Example::

    import types
    import haiku as hk, jax, jax.numpy as jnp
    from msa_pallas.haiku import MSARowAttentionWithPairBias

    config = types.SimpleNamespace(num_head=8, gating=True)   # or AF2's ConfigDict
    global_config = types.SimpleNamespace(zero_init=True)

    @hk.transform
    def forward(msa_act, msa_mask, pair_act):
        return MSARowAttentionWithPairBias(config, global_config)(
            msa_act, msa_mask, pair_act, is_training=False)

    msa_act = jnp.ones((16, 64, 256)); msa_mask = jnp.ones((16, 64))
    pair_act = jnp.ones((64, 64, 128))
    params = forward.init(jax.random.key(0), msa_act, msa_mask, pair_act)
    update = jax.jit(forward.apply)(params, None, msa_act, msa_mask, pair_act)

Parameters (AlphaFold2's, under the module's name, by default
`msa_row_attention_with_pair_bias`)::

    query_norm/{scale,offset}      [c_m]        LayerNorm of msa_act (eps 1e-5): ones / zeros
    feat_2d_norm/{scale,offset}    [c_z]        LayerNorm of pair_act: ones / zeros
    feat_2d_weights                [c_z, H]     normal(stddev = 1/sqrt(c_z))
    attention/query_w, key_w       [c_m, H, d]  glorot_uniform (Haiku's fan_avg VarianceScaling)
    attention/value_w              [c_m, H, d]  glorot_uniform
    attention/gating_w             [c_m, H, d]  zeros      (only when config.gating)
    attention/gating_b             [H, d]       ones       (only when config.gating)
    attention/output_w             [H, d, c_m]  zeros if global_config.zero_init else glorot_uniform
    attention/output_b             [c_m]        zeros

with d = key_dim // num_head, key_dim = config.key_dim if set, else c_m (as
AF2's `Attention`). They are created in AF2's order with AF2's initialisers,
so `init` with the same key draws the same values as AF2's module.

Maths (per MSA row s, head h, residue i), as AF2::

    m = LayerNorm(msa_act); z = LayerNorm(pair_act)
    bias[h, i, j] = sum_c z[i, j, c] * feat_2d_weights[c, h]
    q, k, v = m @ query_w, m @ key_w, m @ value_w                 # [S, N, H, d]
    w = softmax_j(d**-0.5 * q[s,i,h] . k[s,j,h] + bias[h,i,j], masked keys)
    o = sum_j w * v[s,j,h] * sigmoid(m @ gating_w + gating_b)     # [S, N, H, d]
    update = o @ output_w + output_b                              # [S, N, c_m]

q, k, v and the gate logits are produced straight in the op's `[S, N, H, d]`
layout by einsums with the `[c_m, H, d]` weights: nothing is transposed but
the small pair bias `[N, N, H] -> [H, N, N]`.

Masks (`mask_mode`). AlphaFold2 has used two conventions:

- `"replace"` (default): masked logits are *replaced* by -1e9, AF2's current
  `Attention` (`jnp.where(mask, logits, _SOFTMAX_MASK)`) and the op's own
  convention. A row whose keys are all masked (AF2 pads the MSA with such
  rows) gets uniform weights over its keys.
- `"additive"`: `logits + 1e9 * (mask - 1)`, AF2 v2.0 - v2.3 (and OpenFold),
  evaluated exactly: for a fully masked row the shift is the same for every
  key and cancels in the softmax, which stays `softmax(q.k + bias)` over all
  keys. Implemented exactly by handing the op `mask | row_is_fully_masked`,
  i.e. a fully masked row is treated as unmasked.

Both agree whenever a row keeps at least one key (the -1e9 terms underflow to
zero weight either way). AF2 v2.0 - v2.3 compute the additive form in
float32, where the spacing of floats near 1e9 is 64: `-1e9 + x` rounds to
exactly `-1e9` for |x| < 32, so *as those releases run*, a fully masked row
gets the uniform weights of `"replace"` (for larger logits, a quantised
softmax that neither mode reproduces). Masks are AF2's 0/1 masks (bool or
numeric, nonzero keeps a key).

Not reproduced, on purpose: AF2's `mapping.inference_subbatch` chunking
(`global_config.subbatch_size`, MSA rows 4 at a time at inference): the fused
op needs no chunking for the logits, and chunking changes nothing in the
maths. To bound the memory of the projections at inference instead, pass
`inference_chunk_bytes` (chunks of many rows, one op call each). Dropout
(rate 0.15, one mask shared by all rows) is applied *outside* the module by
AF2's `dropout_wrapper`; `is_training` only turns the chunking off.

Precision: float32 inputs compute in float32, with `Precision.HIGHEST` on the
projections (no silent TF32 on GPUs; pass `precision=` to change it); the
softmax and all accumulations inside the op are float32. bfloat16 / float16
inputs compute the projections and the attention in that dtype, as AF2's
bfloat16 mode: parameters are created in float32 and cast to the compute
dtype when used, the LayerNorms run in float32, and the pair bias is kept in
float32. The update has `msa_act`'s dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import haiku as hk
except ImportError as err:  # dm-haiku is an optional extra
    raise ImportError(
        "msa_pallas.haiku needs dm-haiku, an optional dependency of msa_pallas "
        f"(importing it failed: {err}). Install it with: pip install dm-haiku "
        "(or, in a checkout of msa_pallas: pip install -e \".[haiku]\")"
    ) from err

import jax
import jax.numpy as jnp

from msa_pallas.attention import msa_row_attention
from msa_pallas.layer_core import LAYER_NORM_EPS, resolve_precision
from msa_pallas.reference import key_keep
from msa_pallas.validation import shape_str

__all__ = ["MSARowAttentionWithPairBias", "MASK_MODES", "glorot_uniform"]

MASK_MODES = ("replace", "additive")
# LAYER_NORM_EPS (1e-5) is also AlphaFold2's (common_modules.LAYER_NORM_EPSILON).
_MISSING = object()


def glorot_uniform() -> hk.initializers.Initializer:
    """AlphaFold2's `modules.glorot_uniform()`: VarianceScaling(1, fan_avg, uniform)."""
    return hk.initializers.VarianceScaling(scale=1.0, mode="fan_avg", distribution="uniform")


def _config_value(config, name: str, what: str, default=_MISSING):
    """`config.name` (ConfigDict, SimpleNamespace, any object), or `config[name]` (Mapping)."""
    try:
        return getattr(config, name)
    except AttributeError:
        pass
    if isinstance(config, Mapping) and name in config:
        return config[name]
    if default is _MISSING:
        raise AttributeError(f"{what} has no field {name!r} (got {config!r}).")
    return default


def _is_half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def inference_row_chunk(x_shape, dtype, heads: int, head_dim: int,
                        chunk_bytes: int | None) -> int | None:
    """Rows per chunk so that one chunk's q, k, v, gate, output and update
    (6 arrays of `[rows, N, H * d]`) take at most `chunk_bytes`; None (no
    chunking) when `chunk_bytes` is None or every row fits in one chunk."""
    if chunk_bytes is None or len(x_shape) != 3:
        return None
    rows, n_res = x_shape[0], x_shape[1]
    per_row = 6 * n_res * heads * head_dim * jnp.dtype(dtype).itemsize
    chunk = max(1, int(chunk_bytes) // per_row)
    return None if chunk >= rows else chunk


def map_row_chunks(rows_fn, x, mask, row_chunk: int | None):
    """`rows_fn(x, mask)` over chunks of `row_chunk` rows (axis 0 of x `[S, N, c]`
    and mask `[S, N]`), one after another (`lax.map`): the memory of one chunk's
    projections instead of all rows'. The rows are independent, so the result
    is `rows_fn(x, mask)`'s. The last chunk is padded with zero rows, whose
    outputs are dropped. `row_chunk` None: one call on all rows."""
    if row_chunk is None or x.ndim != 3 or row_chunk >= x.shape[0]:
        return rows_fn(x, mask)
    rows = x.shape[0]
    chunks = -(-rows // row_chunk)
    pad = chunks * row_chunk - rows
    x = jnp.pad(x, ((0, pad), (0, 0), (0, 0))).reshape(chunks, row_chunk, *x.shape[1:])
    if mask is None:
        out = jax.lax.map(lambda xc: rows_fn(xc, None), x)
    else:
        mask = jnp.pad(mask, ((0, pad), (0, 0)), constant_values=True)
        out = jax.lax.map(lambda a: rows_fn(*a), (x, mask.reshape(chunks, row_chunk, -1)))
    return out.reshape(chunks * row_chunk, *out.shape[2:])[:rows]


class _Attention(hk.Module):
    """AF2's `modules.Attention` (scope `attention`) with the fused op as its core."""

    def __init__(self, *, num_head: int, head_dim: int, gating: bool, zero_init: bool,
                 output_dim: int, param_dtype, precision, implementation, block_config,
                 row_chunk: int | None = None, name: str = "attention"):
        super().__init__(name=name)
        self.row_chunk = row_chunk
        self.num_head = num_head
        self.head_dim = head_dim
        self.gating = gating
        self.zero_init = zero_init
        self.output_dim = output_dim
        self.param_dtype = param_dtype
        self.precision = precision
        self.implementation = implementation
        self.block_config = block_config

    def __call__(self, x, mask, bias):
        """x [*, S, N, c_m] (normalised, compute dtype); mask [*, S, N] or None; bias [*, H, N, N]."""
        c_m, dtype = x.shape[-1], x.dtype
        heads, d = self.num_head, self.head_dim

        def weight(name, shape, init):
            return hk.get_parameter(name, shape, self.param_dtype, init=init).astype(dtype)

        # Same parameters, shapes, initialisers and creation order as AF2
        # (all fetched before any compute, so that row chunks can close over them).
        query_w = weight("query_w", (c_m, heads, d), glorot_uniform())
        key_w = weight("key_w", (c_m, heads, d), glorot_uniform())
        value_w = weight("value_w", (c_m, heads, d), glorot_uniform())
        gating_w = gating_b = None
        if self.gating:
            gating_w = weight("gating_w", (c_m, heads, d), hk.initializers.Constant(0.0))
            gating_b = weight("gating_b", (heads, d), hk.initializers.Constant(1.0))
        out_init = hk.initializers.Constant(0.0) if self.zero_init else glorot_uniform()
        output_w = weight("output_w", (heads, d, self.output_dim), out_init)
        output_b = weight("output_b", (self.output_dim,), hk.initializers.Constant(0.0))

        def rows(x, mask):
            def project(w):  # [*, S, N, c_m] x [c_m, H, d] -> [*, S, N, H, d], no transpose
                return jnp.einsum("...a,ahc->...hc", x, w, precision=self.precision)

            # Logits (the op applies the sigmoid); the bias's leading axes spelled
            # out, as rank promotion "raise" wants.
            gate = None if gating_w is None else (
                project(gating_w) + jnp.expand_dims(gating_b, tuple(range(x.ndim - 1)))
            )
            o = msa_row_attention(
                project(query_w), project(key_w), project(value_w), bias, mask, gate,
                scale=d ** -0.5,  # AF2 scales q by key_dim**-0.5 before q.k: same product
                implementation=self.implementation, block_config=self.block_config,
            )
            out = jnp.einsum("...hc,hco->...o", o, output_w, precision=self.precision)
            return out + jnp.expand_dims(output_b, tuple(range(out.ndim - 1)))

        return map_row_chunks(rows, x, mask, self.row_chunk)


class MSARowAttentionWithPairBias(hk.Module):
    """MSA row-wise gated self-attention with pair bias: AlphaFold2's module, fused.

    Drop-in for `alphafold.model.modules.MSARowAttentionWithPairBias` (same
    arguments, same parameters; see the module docstring for the parameter
    tree, the maths and the mask conventions).

    Args:
      config: AF2's `msa_row_attention_with_pair_bias` config (an
        `ml_collections.ConfigDict`, `types.SimpleNamespace`, any object with
        attributes, or a Mapping). Reads `num_head` and `gating` (required),
        and optionally `key_dim` / `value_dim` (default c_m; the per-head dims
        `key_dim // num_head` and `value_dim // num_head` must be equal) and
        `orientation` (must be `"per_row"` when present). AF2's
        `dropout_rate` / `shared_dropout` are read by AF2's `dropout_wrapper`
        around the module, not here.
      global_config: reads `zero_init` (output_w initialised to zeros when
        true, glorot_uniform otherwise). `subbatch_size` is not used.
      name: the Haiku scope, AF2's `msa_row_attention_with_pair_bias`.
      mask_mode: `"replace"` (default; AF2's current code and the op) or
        `"additive"` (AF2 v2.0 - v2.3 evaluated exactly). They differ only
        on MSA rows whose keys are all masked.
      implementation: passed to `msa_pallas.msa_row_attention`: None picks the
        Pallas kernels on a GPU and the plain-XLA path elsewhere; `"pallas"`
        without a GPU runs the kernels in interpret mode (slow, for tests).
      block_config: optional `msa_pallas.BlockConfig` for the kernels.
      precision: matmul precision of the projections and the pair bias; None
        means `HIGHEST` for float32 (no TF32) and the default for bf16/fp16.
      inference_chunk_bytes: None (default): all MSA rows in one op call. A
        byte count: at inference (`is_training=False`) the rows go through
        the projections and the op in chunks whose q, k, v, gate and output
        take at most that much (AF2's `subbatch_size` serves the same end);
        the result is the same.
    """

    def __init__(self, config, global_config, name: str = "msa_row_attention_with_pair_bias",
                 *, mask_mode: str = "replace", implementation: str | None = None,
                 block_config: Any = None, precision: Any = None,
                 inference_chunk_bytes: int | None = None):
        super().__init__(name=name)
        self.inference_chunk_bytes = inference_chunk_bytes
        if mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode={mask_mode!r}; expected one of {MASK_MODES}.")
        self.config = config
        self.global_config = global_config
        self.mask_mode = mask_mode
        self.implementation = implementation
        self.block_config = block_config
        self.precision = precision

    def _precision(self, dtype):
        return resolve_precision(self.precision, dtype, dtype)

    def __call__(self, msa_act, msa_mask, pair_act, is_training: bool = False):
        """Applies the module.

        Args:
          msa_act: `[N_seq, N_res, c_m]` MSA representation (leading batch axes
            `[*batch, N_seq, N_res, c_m]` are accepted too).
          msa_mask: `[N_seq, N_res]` 0/1 mask of non-padded positions (bool or
            numeric; nonzero keeps a key), or None to keep all.
          pair_act: `[N_res, N_res, c_z]` pair representation.
          is_training: AF2's flag; True turns `inference_chunk_bytes` off
            (AF2 applies dropout outside the module).

        Returns:
          The update to msa_act, `[N_seq, N_res, c_m]`, in msa_act's dtype.
        """
        # Dropout is applied outside, as in AF2; is_training only turns off the
        # optional inference chunking (inference_chunk_bytes).
        cfg_what = "config (msa_row_attention_with_pair_bias)"
        num_head = int(_config_value(self.config, "num_head", cfg_what))
        gating = bool(_config_value(self.config, "gating", cfg_what))
        orientation = _config_value(self.config, "orientation", cfg_what, "per_row")
        if orientation != "per_row":
            raise ValueError(f"config.orientation={orientation!r}; MSARowAttentionWithPairBias "
                             "is row attention ('per_row').")
        zero_init = bool(_config_value(self.global_config, "zero_init", "global_config"))

        msa_act, pair_act = jnp.asarray(msa_act), jnp.asarray(pair_act)
        self._check_inputs(msa_act, msa_mask, pair_act)
        c_m, c_z = msa_act.shape[-1], pair_act.shape[-1]
        key_dim = int(_config_value(self.config, "key_dim", cfg_what, c_m))
        value_dim = int(_config_value(self.config, "value_dim", cfg_what, c_m))
        if num_head < 1 or key_dim % num_head or value_dim % num_head:
            raise ValueError(f"key_dim={key_dim} and value_dim={value_dim} must be divisible by "
                             f"num_head={num_head} (AF2's Attention asserts the same).")
        head_dim = key_dim // num_head
        if value_dim // num_head != head_dim:
            raise ValueError(
                f"per-head key dim {head_dim} (key_dim={key_dim}) != per-head value dim "
                f"{value_dim // num_head} (value_dim={value_dim}): the fused op needs q, k "
                "and v with one head dim."
            )

        dtype = msa_act.dtype
        # AF2's bfloat16 mode: float32 parameters, cast to bf16 where used.
        param_dtype = jnp.float32 if _is_half(dtype) else dtype
        norm_dtype = param_dtype  # LayerNorms (and the pair bias) never in half precision

        def layer_norm(x, name):
            return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True,
                                eps=LAYER_NORM_EPS, name=name)(x.astype(norm_dtype))

        m = layer_norm(msa_act, "query_norm").astype(dtype)
        z = layer_norm(pair_act, "feat_2d_norm")
        feat_2d_weights = hk.get_parameter(
            "feat_2d_weights", (c_z, num_head), param_dtype,
            init=hk.initializers.RandomNormal(stddev=1.0 / jnp.sqrt(int(c_z))),
        )
        bias = jnp.einsum("...qkc,ch->...hqk", z, feat_2d_weights.astype(norm_dtype),
                          precision=self._precision(norm_dtype))  # [*, H, N, N]

        mask = None
        if msa_mask is not None:
            mask = key_keep(jnp.asarray(msa_mask))
            if self.mask_mode == "additive":
                # logits + 1e9 * (mask - 1), exactly: a uniform shift of every key of
                # a fully masked row cancels in the softmax, i.e. no mask on that row.
                mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)

        attention = _Attention(
            num_head=num_head, head_dim=head_dim, gating=gating, zero_init=zero_init,
            output_dim=c_m, param_dtype=param_dtype, precision=self._precision(dtype),
            implementation=self.implementation, block_config=self.block_config,
            row_chunk=None if is_training else inference_row_chunk(
                m.shape, dtype, num_head, head_dim, self.inference_chunk_bytes),
        )
        return attention(m, mask, bias)

    @staticmethod
    def _check_inputs(msa_act, msa_mask, pair_act) -> None:
        if msa_act.ndim < 3 or not jnp.issubdtype(msa_act.dtype, jnp.floating):
            raise ValueError(f"msa_act has shape {shape_str(msa_act.shape)} and dtype "
                             f"{msa_act.dtype}; expected a floating [N_seq, N_res, c_m].")
        *batch, _, n_res, _ = msa_act.shape
        if pair_act.ndim != msa_act.ndim or tuple(pair_act.shape[:-1]) != (*batch, n_res, n_res):
            raise ValueError(
                f"pair_act has shape {shape_str(pair_act.shape)}; expected "
                f"[{', '.join(map(str, (*batch, n_res, n_res)))}, c_z] for msa_act of shape "
                f"{shape_str(msa_act.shape)}."
            )
        if not jnp.issubdtype(pair_act.dtype, jnp.floating):
            raise ValueError(f"pair_act has dtype {pair_act.dtype}; expected a floating dtype.")
        if msa_mask is not None and tuple(jnp.shape(msa_mask)) != tuple(msa_act.shape[:-1]):
            raise ValueError(
                f"msa_mask has shape {shape_str(jnp.shape(msa_mask))}; expected "
                f"[{', '.join(map(str, msa_act.shape[:-1]))}] ([N_seq, N_res] of msa_act)."
            )
