"""msa_pallas.haiku.MSARowAttentionWithPairBias's parameters are AlphaFold2's.

The parameter tree (scopes, names, shapes), written out below from
`alphafold/model/modules.py` for the Evoformer and the extra-MSA stack; the
initialisers; and `init` drawing bit-for-bit what AF2's parameter creation
(transcribed below, creation calls only) draws with the same key.
"""

from __future__ import annotations

import numpy as np
import pytest

hk = pytest.importorskip("haiku")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from haiku_helpers import SCOPE, configs, dummy_inputs, transformed  # noqa: E402


# ---------------------------------------------------------------------------
# Parameters: AlphaFold2's tree, initialisers and creation order.
# ---------------------------------------------------------------------------

# From alphafold/model/modules.py: MSARowAttentionWithPairBias (query_norm,
# feat_2d_norm, feat_2d_weights [c_z, num_head]) and its Attention(c, gc, c_m)
# (query_w/key_w/value_w [c_m, H, key_dim // H], gating_w [c_m, H, d],
# gating_b [H, d], output_w [H, d, c_m], output_b [c_m]).
EVOFORMER_TREE = {  # model_1 evoformer: c_m 256, c_z 128, 8 heads of 32
    "msa_row_attention_with_pair_bias/query_norm": {"scale": (256,), "offset": (256,)},
    "msa_row_attention_with_pair_bias/feat_2d_norm": {"scale": (128,), "offset": (128,)},
    "msa_row_attention_with_pair_bias": {"feat_2d_weights": (128, 8)},
    "msa_row_attention_with_pair_bias/attention": {
        "query_w": (256, 8, 32), "key_w": (256, 8, 32), "value_w": (256, 8, 32),
        "gating_w": (256, 8, 32), "gating_b": (8, 32),
        "output_w": (8, 32, 256), "output_b": (256,),
    },
}
EXTRA_MSA_TREE = {  # extra_msa_stack: c_m 64, c_z 128, 8 heads of 8
    "msa_row_attention_with_pair_bias/query_norm": {"scale": (64,), "offset": (64,)},
    "msa_row_attention_with_pair_bias/feat_2d_norm": {"scale": (128,), "offset": (128,)},
    "msa_row_attention_with_pair_bias": {"feat_2d_weights": (128, 8)},
    "msa_row_attention_with_pair_bias/attention": {
        "query_w": (64, 8, 8), "key_w": (64, 8, 8), "value_w": (64, 8, 8),
        "gating_w": (64, 8, 8), "gating_b": (8, 8),
        "output_w": (8, 8, 64), "output_b": (64,),
    },
}


@pytest.mark.parametrize("c_m, c_z, expected", [
    (256, 128, EVOFORMER_TREE), (64, 128, EXTRA_MSA_TREE),
], ids=["evoformer", "extra_msa_stack"])
def test_parameter_tree_is_alphafold2s(c_m, c_z, expected):
    shapes = jax.eval_shape(transformed(*configs()).init, jax.random.key(0),
                            *dummy_inputs(4, 7, c_m, c_z))
    assert {k: {n: tuple(v.shape) for n, v in g.items()} for k, g in shapes.items()} == expected
    assert all(v.dtype == jnp.float32 for g in shapes.values() for v in g.values())

    no_gating = jax.eval_shape(transformed(*configs(gating=False)).init, jax.random.key(0),
                               *dummy_inputs(4, 7, c_m, c_z))
    attention = dict(expected[f"{SCOPE}/attention"])
    del attention["gating_w"], attention["gating_b"]
    assert {n: tuple(v.shape) for n, v in no_gating[f"{SCOPE}/attention"].items()} == attention


def af2_parameter_creation(c_m, c_z, num_head, zero_init, gating=True):
    """AF2's parameter creation for this module, transcribed from alphafold/model/
    modules.py (MSARowAttentionWithPairBias, Attention, glorot_uniform) and
    common_modules.LayerNorm: the same hk.get_parameter calls in the same order."""
    glorot_uniform = hk.initializers.VarianceScaling(
        scale=1.0, mode="fan_avg", distribution="uniform")
    d = c_m // num_head
    f32 = jnp.float32
    with hk.name_scope(SCOPE):
        for norm, channels in (("query_norm", c_m), ("feat_2d_norm", c_z)):
            with hk.name_scope(norm):  # hk.LayerNorm's defaults: ones / zeros
                hk.get_parameter("scale", (channels,), f32, init=jnp.ones)
                hk.get_parameter("offset", (channels,), f32, init=jnp.zeros)
        hk.get_parameter("feat_2d_weights", (c_z, num_head), f32,
                         init=hk.initializers.RandomNormal(stddev=1. / jnp.sqrt(int(c_z))))
        with hk.name_scope("attention"):
            for name in ("query_w", "key_w", "value_w"):
                hk.get_parameter(name, (c_m, num_head, d), f32, init=glorot_uniform)
            if gating:
                hk.get_parameter("gating_w", (c_m, num_head, d), f32,
                                 init=hk.initializers.Constant(0.0))
                hk.get_parameter("gating_b", (num_head, d), f32,
                                 init=hk.initializers.Constant(1.0))
            init = hk.initializers.Constant(0.0) if zero_init else glorot_uniform
            hk.get_parameter("output_w", (num_head, d, c_m), f32, init=init)
            hk.get_parameter("output_b", (c_m,), f32, init=hk.initializers.Constant(0.0))


@pytest.mark.parametrize("zero_init", [True, False])
def test_init_is_alphafold2s_bit_for_bit(zero_init):
    """Same key -> the same values as AF2's parameter creation (initialisers and order)."""
    c_m, c_z, heads = 256, 128, 8
    key = jax.random.key(11)
    ours = jax.jit(transformed(*configs(heads, zero_init=zero_init)).init)(
        key, *dummy_inputs(2, 3, c_m, c_z))
    af2 = jax.jit(hk.transform(
        lambda: af2_parameter_creation(c_m, c_z, heads, zero_init)).init)(key)
    assert jax.tree.structure(ours) == jax.tree.structure(af2)
    jax.tree.map(np.testing.assert_array_equal, ours, af2)


def test_initialisers():
    c_m, c_z, heads, d = 256, 128, 8, 32
    p = jax.jit(transformed(*configs(heads, zero_init=True)).init)(
        jax.random.key(1), *dummy_inputs(2, 3, c_m, c_z))
    att = p[f"{SCOPE}/attention"]
    for norm in ("query_norm", "feat_2d_norm"):
        np.testing.assert_array_equal(p[f"{SCOPE}/{norm}"]["scale"], 1.0)
        np.testing.assert_array_equal(p[f"{SCOPE}/{norm}"]["offset"], 0.0)
    np.testing.assert_array_equal(att["gating_w"], 0.0)
    np.testing.assert_array_equal(att["gating_b"], 1.0)
    np.testing.assert_array_equal(att["output_w"], 0.0)
    np.testing.assert_array_equal(att["output_b"], 0.0)
    # glorot_uniform = VarianceScaling(1, fan_avg, uniform) with Haiku's fans of
    # [c_m, H, d]: fan_in = c_m * H, fan_out = c_m * d -> U(+-sqrt(6 / (c_m (H + d)))).
    bound = np.sqrt(6.0 / (c_m * (heads + d)))
    for name in ("query_w", "key_w", "value_w"):
        w = np.asarray(att[name])
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
        assert abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.02
    w2d = np.asarray(p[SCOPE]["feat_2d_weights"])
    assert abs(w2d.std() * np.sqrt(c_z) - 1) < 0.1 and abs(w2d.mean()) < 0.01

    # zero_init=False: output_w is glorot_uniform too ([H, d, c_m]: fans H d, H c_m).
    p = jax.jit(transformed(*configs(heads, zero_init=False)).init)(
        jax.random.key(1), *dummy_inputs(2, 3, c_m, c_z))
    w = np.asarray(p[f"{SCOPE}/attention"]["output_w"])
    bound = np.sqrt(6.0 / (heads * (d + c_m)))
    assert np.abs(w).max() <= bound and abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.02
