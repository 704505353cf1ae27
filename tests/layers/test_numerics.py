"""The Flax layers' numerics, checked directly rather than through the converters:

- the linen and NNX layers against an independent float64 NumPy transcription
  of the PyTorch reference layer's maths (tests/layer_numpy_reference.py, itself
  checked against PyTorch's stored outputs in test_convert.py), output and input
  gradients, with a non-symmetric pair bias (a transposed bias fails), both
  presets, the plain-jnp path and the kernels;
- the precision of the projections in the traced program (float32 compute:
  `Precision.HIGHEST`, never the default, which is TF32 on NVIDIA GPUs);
- `attention_fn`, the swappable attention core.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
import layer_numpy_reference as layer_reference
import msa_pallas
from helpers import rel_err
from msa_pallas.layers import MSARowAttentionWithPairBias
from msa_pallas.nnx_layers import MSARowAttentionWithPairBiasNNX

B, S, N, C_M, C_Z, H = 2, 3, 13, 24, 8, 3   # d = 8
TOL = 1e-5
HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _layer(preset, **options):
    if preset == "alphafold2":
        return MSARowAttentionWithPairBias.alphafold2(C_M, C_Z, H, **options)
    return MSARowAttentionWithPairBias(msa_dim=C_M, pair_dim=C_Z, num_heads=H, **options)


def _random_variables(layer, rng, m, z, mask):
    """Random weights (NumPy) in the layer's parameter tree: LayerNorm scales
    around 1, every other parameter nonzero (zero inits included); q/k and the
    pair projection scaled up, so that the logits and the pair bias shape the
    attention. `init` is only traced (`eval_shape`), never compiled."""
    shapes = jax.eval_shape(layer.init, jax.random.key(0), m, z, mask)["params"]
    gains = {"query": 1.5, "key": 1.5, "pair_bias": 3.0}

    def draw(module, name, shape):
        if name == "scale":
            return 1.0 + 0.3 * rng.standard_normal(shape.shape)
        if name == "bias":
            return 0.3 * rng.standard_normal(shape.shape)
        fan_in = shape.shape[0]
        return gains.get(module, 1.0) * rng.standard_normal(shape.shape) / np.sqrt(fan_in)

    return {"params": {
        module: {name: draw(module, name, leaf).astype(np.float32) for name, leaf in group.items()}
        for module, group in shapes.items()
    }}


def _apply_fn(kind, layer, variables, mask):
    """`(msa, pair) -> out` of the linen layer or of the NNX layer with the same weights."""
    if kind == "linen":
        return lambda m, z: layer.apply(variables, m, z, mask, deterministic=True)
    nnx_layer = MSARowAttentionWithPairBiasNNX.from_linen(layer, variables)
    return lambda m, z: nnx_layer(m, z, mask, deterministic=True)


@pytest.mark.parametrize("kind, preset, implementation", [
    ("linen", "reference", "xla"),
    ("nnx", "alphafold2", "pallas"),
])
def test_layer_matches_numpy_reference_layer(kind, preset, implementation, seed):
    """Output (1e-5) and the gradients w.r.t. msa_repr and pair_repr (along random
    directions, against central differences of the float64 maths), with a fully
    and a partly masked MSA row. The transposed pair bias gives a different
    result here, so a layer that transposes it fails."""
    rng = np.random.default_rng(seed)
    m, z, mask = layer_reference.random_layer_inputs(rng, B, S, N, C_M, C_Z)
    layer = _layer(preset, implementation=implementation)
    variables = _random_variables(layer, rng, m, z, mask)
    weights = layer_reference.from_flax_params(variables["params"])
    expected = layer_reference.reference_layer(weights, m, z, mask, H)
    transposed = layer_reference.reference_layer(weights, m, z, mask, H, transpose_bias=True)
    assert rel_err(transposed, expected) > 5e-2

    cot = rng.standard_normal(m.shape)
    f = _apply_fn(kind, layer, variables, mask)

    @jax.jit
    def run(m, z):
        out, pullback = jax.vjp(f, m, z)
        return (out, *pullback(cot.astype(np.float32)))

    out, g_msa, g_pair = run(m, z)
    assert out.dtype == jnp.float32
    assert rel_err(out, expected) < TOL, rel_err(out, expected)
    assert rel_err(out[0, 1], expected[0, 1]) < TOL  # the fully masked row alone

    def loss64(msa, pair):
        return float(np.sum(layer_reference.reference_layer(weights, msa, pair, mask, H) * cot))

    for name, grad, arg in (("msa", g_msa, m), ("pair", g_pair, z)):
        direction = rng.standard_normal(arg.shape)
        eps = 1e-4
        shifted = lambda t: (m + t * direction, z) if name == "msa" else (m, z + t * direction)
        numeric = (loss64(*shifted(eps)) - loss64(*shifted(-eps))) / (2 * eps)
        analytic = float(np.sum(np.asarray(grad, np.float64) * direction))
        assert abs(analytic - numeric) <= 1e-4 * abs(numeric), (name, analytic, numeric)


def _projection_precisions(kind, **options):
    rng = np.random.default_rng(0)
    m, z, mask = layer_reference.random_layer_inputs(rng, 1, 2, 5, C_M, C_Z)
    layer = _layer("reference", implementation="xla", **options)
    variables = jax.eval_shape(layer.init, jax.random.key(0), m, z, mask)
    variables = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), variables)
    f = _apply_fn(kind, layer, variables, mask)
    found = helpers.dot_precisions(jax.make_jaxpr(f)(m, z).jaxpr)
    # 3 projection products (q/k/v/gate as one, the pair bias, out_proj) and the op's 2.
    assert len(found) >= 5, found
    return [(precision, dtype) for _, precision, dtype in found]


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_projection_precision_in_traced_program(kind):
    """float32 compute: every matrix product of the layer (the projections, q/k/v
    and the gate in one, and the op's plain-jnp products) is `Precision.HIGHEST`, never the backend
    default (TF32 on NVIDIA GPUs; on CPU both are float32, so only the traced
    program shows it). bf16 compute: the native products. `precision=` overrides."""
    found = _projection_precisions(kind)
    assert all(p == HIGHEST and dt == jnp.float32 for p, dt in found), found

    found = _projection_precisions(kind, dtype=jnp.bfloat16)
    assert all(p != HIGHEST for p, _ in found), found
    assert sum(dt == jnp.bfloat16 for _, dt in found) >= 3, found

    default = (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)
    found = _projection_precisions(kind, precision=jax.lax.Precision.DEFAULT)
    assert sum(p == default for p, _ in found) == 3, found  # the projections only


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_attention_fn_swaps_the_attention_core(kind):
    """`attention_fn` receives the op's arguments ([*batch, S, N, H, d] rows,
    [*batch, H, N, N] bias, the mask, the gate logits, the keywords) and its
    result goes to out_proj: doubling it equals doubling out_proj's kernel."""
    rng = np.random.default_rng(3)
    m, z, mask = layer_reference.random_layer_inputs(rng, B, S, N, C_M, C_Z)
    calls = []

    def doubled(q, k, v, bias, mask=None, gate=None, **kwargs):
        calls.append(dict(rows=q.shape, bias=bias.shape, mask=mask.shape, gate=gate.shape,
                          implementation=kwargs["implementation"]))
        return 2.0 * msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, **kwargs)

    layer = _layer("reference", implementation="xla")
    assert layer.attention_fn is None  # None: msa_pallas.msa_row_attention
    variables = _random_variables(layer, rng, m, z, mask)
    twice = jax.tree.map(lambda x: x, variables)
    twice["params"]["out_proj"]["kernel"] = 2.0 * twice["params"]["out_proj"]["kernel"]
    expected = jax.jit(layer.apply)(twice, m, z, mask)

    out = jax.jit(_apply_fn(kind, layer.clone(attention_fn=doubled), variables, mask))(m, z)
    assert rel_err(out, expected) < 1e-6
    assert calls == [dict(rows=(B, S, N, H, C_M // H), bias=(B, H, N, N), mask=(B, S, N),
                          gate=(B, S, N, H, C_M // H), implementation="xla")]
    if kind == "nnx":
        direct = MSARowAttentionWithPairBiasNNX(C_M, C_Z, H, attention_fn=doubled, rngs=nnx.Rngs(0))
        assert direct.attention_fn is doubled
    with pytest.raises(TypeError, match="attention_fn must be a callable"):
        layer.clone(attention_fn="pallas")
