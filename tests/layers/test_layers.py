"""The Flax layers: structure, initialisation, linen/NNX parity, dropout, dtypes, errors.

The layers against the float64 NumPy maths of the reference layer, the
projections' precision and `attention_fn` are in test_numerics.py;
parity with PyTorch, AlphaFold2 and OpenFold through the converters in
test_convert.py. Most tests use implementation="xla" (fast on CPU); the
Pallas path is covered there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import msa_pallas
from msa_pallas.layers import MSARowAttentionWithPairBias
from msa_pallas.nnx_layers import MSARowAttentionWithPairBiasNNX

REFERENCE_NAMES = {"layer_norm", "query", "key", "value", "gate", "pair_bias", "out_proj"}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_inputs(seed, B=2, S=4, N=12, msa_dim=32, pair_dim=16, keep=0.8):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    m = jax.random.normal(k1, (B, S, N, msa_dim))
    z = jax.random.normal(k2, (B, N, N, pair_dim))
    mask = jax.random.bernoulli(k3, keep, (B, S, N)).at[..., 0].set(True)
    return m, z, mask


def perturbed(variables, seed, scale=0.3):
    """Every parameter moved off its initial value (zero-init ones included)."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [
        x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def test_param_names_shapes_and_output():
    m, z, mask = random_inputs(0)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla")
    variables = layer.init(jax.random.key(1), m, z, mask)
    params = variables["params"]
    assert set(params) == REFERENCE_NAMES
    assert params["query"]["kernel"].shape == (32, 32) and params["query"]["bias"].shape == (32,)
    assert params["pair_bias"]["kernel"].shape == (16, 4) and params["pair_bias"]["bias"].shape == (4,)
    assert set(params["layer_norm"]) == {"scale", "bias"}
    out = layer.apply(variables, m, z, mask, deterministic=True)
    assert out.shape == m.shape and out.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out)))
    # Without a mask: the same as an all-ones mask.
    np.testing.assert_allclose(layer.apply(variables, m, z, None),
                               layer.apply(variables, m, z, jnp.ones_like(mask)), rtol=1e-6, atol=1e-6)

    af2 = MSARowAttentionWithPairBias.alphafold2(msa_dim=32, pair_dim=16, num_heads=4)
    assert (af2.pair_layer_norm, af2.qkv_bias, af2.pair_bias_bias, af2.gating_init,
            af2.zero_init_output, af2.dropout_mode, af2.dropout) == (
        True, False, False, "af2", True, "output_shared_rows", 0.15)
    p2 = jax.eval_shape(af2.init, jax.random.key(1), m, z, mask)["params"]
    assert set(p2) == REFERENCE_NAMES | {"pair_layer_norm"}
    assert "bias" not in p2["query"] and "bias" not in p2["key"] and "bias" not in p2["value"]
    assert "bias" not in p2["pair_bias"] and p2["pair_layer_norm"]["scale"].shape == (16,)
    # AF2 defaults are the Evoformer's sizes.
    big = MSARowAttentionWithPairBias.alphafold2()
    assert (big.msa_dim, big.pair_dim, big.num_heads, big.resolved_head_dim) == (256, 128, 8, 32)


def test_initialisation_matches_torch_linear_distribution():
    """Weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as nn.Linear's defaults."""
    msa_dim, pair_dim = 32, 16
    m, z, mask = random_inputs(2)
    layer = MSARowAttentionWithPairBias(msa_dim=msa_dim, pair_dim=pair_dim, num_heads=4)
    params = layer.init(jax.random.key(3), m, z, mask)["params"]
    for name in ("query", "key", "value", "gate", "out_proj", "pair_bias"):
        bound = 1.0 / math.sqrt(pair_dim if name == "pair_bias" else msa_dim)
        w, b = np.asarray(params[name]["kernel"]), np.asarray(params[name]["bias"])
        assert np.abs(w).max() <= bound and np.abs(b).max() <= bound, name
        assert np.abs(w).max() > 0.9 * bound, name   # fills the interval
        assert np.unique(b).size == b.size, name      # random, not constant
    names = ("query", "key", "value", "gate", "out_proj")
    assert not np.allclose(params["query"]["kernel"], params["key"]["kernel"])  # independent draws
    bound = 1.0 / math.sqrt(msa_dim)
    pooled_w = np.concatenate([np.asarray(params[n]["kernel"]).ravel() for n in names])  # 5120
    assert abs(pooled_w.std() / (bound / math.sqrt(3)) - 1) < 0.04, pooled_w.std()
    assert abs(pooled_w.mean()) < 4 * bound / math.sqrt(3 * pooled_w.size)
    # Uniform, not normal: a quarter of the mass in each quarter of the interval.
    hist, _ = np.histogram(pooled_w, bins=4, range=(-bound, bound))
    assert np.all(np.abs(hist / pooled_w.size - 0.25) < 0.03), hist
    pooled_b = np.concatenate([np.asarray(params[n]["bias"]) for n in names])
    assert abs(pooled_b.std() / (bound / math.sqrt(3)) - 1) < 0.2
    np.testing.assert_array_equal(params["layer_norm"]["scale"], np.ones(msa_dim))
    np.testing.assert_array_equal(params["layer_norm"]["bias"], np.zeros(msa_dim))


def test_alphafold2_initialisation():
    """AF2: gate weight 0 and bias 1, output projection zero: the layer starts as zero."""
    m, z, mask = random_inputs(4)
    layer = MSARowAttentionWithPairBias.alphafold2(msa_dim=32, pair_dim=16, num_heads=4,
                                                   implementation="xla")
    params = layer.init(jax.random.key(5), m, z, mask)["params"]
    np.testing.assert_array_equal(params["gate"]["kernel"], 0.0)
    np.testing.assert_array_equal(params["gate"]["bias"], 1.0)
    np.testing.assert_array_equal(params["out_proj"]["kernel"], 0.0)
    np.testing.assert_array_equal(params["out_proj"]["bias"], 0.0)
    assert np.abs(np.asarray(params["query"]["kernel"])).max() > 0
    out = layer.apply({"params": params}, m, z, mask)
    np.testing.assert_array_equal(out, 0.0)


def test_layer_norm_epsilon_is_1e5():
    """Tiny-variance input, where eps 1e-5 vs flax's default 1e-6 matters."""
    m, z, mask = random_inputs(6)
    m = 1e-3 * m + 0.5
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla")
    variables = perturbed(layer.init(jax.random.key(7), m, z, mask), 8)
    _, state = layer.apply(variables, m, z, mask, capture_intermediates=True)
    got = np.asarray(state["intermediates"]["layer_norm"]["__call__"][0], np.float64)
    p = variables["params"]["layer_norm"]
    x = np.asarray(m, np.float64)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)

    def ln(eps):
        return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"]) + np.asarray(p["bias"])

    assert rel_err(got, ln(1e-5)) < 1e-4
    assert rel_err(got, ln(1e-6)) > 1e-2


@pytest.mark.parametrize("preset", ["reference", "alphafold2"])
def test_linen_and_nnx_identical(preset):
    """Same weights, same inputs: identical outputs and gradients (also after a round trip)."""
    m, z, mask = random_inputs(9)
    if preset == "reference":
        layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla")
    else:
        layer = MSARowAttentionWithPairBias.alphafold2(msa_dim=32, pair_dim=16, num_heads=2,
                                                       head_dim=8, implementation="xla")
    variables = perturbed(layer.init(jax.random.key(10), m, z, mask), 11)
    nnx_layer = MSARowAttentionWithPairBiasNNX.from_linen(layer, variables)
    assert set(nnx_layer.to_linen_variables()["params"]) == set(variables["params"])

    def linen_loss(m, z):
        return jnp.sum(jnp.sin(layer.apply(variables, m, z, mask)))

    def nnx_loss(m, z):
        return jnp.sum(jnp.sin(nnx_layer(m, z, mask, deterministic=True)))

    out_l = layer.apply(variables, m, z, mask)
    out_n = nnx_layer(m, z, mask, deterministic=True)
    np.testing.assert_array_equal(np.asarray(out_l), np.asarray(out_n))
    assert float(jnp.abs(out_l).max()) > 0.1
    g_l = jax.grad(linen_loss, argnums=(0, 1))(m, z)
    g_n = jax.grad(nnx_loss, argnums=(0, 1))(m, z)
    for a, b in zip(g_l, g_n):
        assert rel_err(b, a) < 1e-6
    # Round trip NNX -> linen variables.
    back = nnx_layer.to_linen_variables()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, variables)
    # A fresh NNX layer built directly has the same structure as the linen one.
    direct = (MSARowAttentionWithPairBiasNNX(32, 16, 4, rngs=nnx.Rngs(0)) if preset == "reference"
              else MSARowAttentionWithPairBiasNNX.alphafold2(32, 16, 2, head_dim=8, rngs=nnx.Rngs(0)))
    assert jax.tree.map(jnp.shape, direct.to_linen_variables()) == jax.tree.map(jnp.shape, variables)
    with pytest.raises(ValueError, match="missing"):
        direct.load_linen_variables({"params": {k: v for k, v in variables["params"].items() if k != "gate"}})


def test_attention_dropout():
    """Attention dropout in the layer: deterministic is no dropout, a key
    gives one mask, the kernels draw the xla path's (Triton here; every
    backend in tests/test_dropout.py), and the mean over keys is the
    undropped output (xla path, 256 keys)."""
    m, z, mask = random_inputs(12)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, dropout=0.25,
                                        implementation="xla")
    no_drop = layer.clone(dropout=0.0)
    variables = perturbed(no_drop.init(jax.random.key(13), m, z, mask), 14)
    det = layer.apply(variables, m, z, mask, deterministic=True)
    ref = no_drop.apply(variables, m, z, mask)
    np.testing.assert_array_equal(np.asarray(det), np.asarray(ref))
    key = {"dropout": jax.random.key(1)}
    kernels = layer.clone(implementation="triton").apply(
        variables, m, z, mask, deterministic=False, rngs=key)
    xla = layer.apply(variables, m, z, mask, deterministic=False, rngs=key)
    assert rel_err(kernels, xla) < 1e-5 and rel_err(xla, ref) > 0.05

    keys = jnp.concatenate([jnp.stack([jax.random.key(1), jax.random.key(1)]),
                            jax.random.split(jax.random.key(3), 254)])
    samples = jax.jit(jax.vmap(
        lambda v, key: layer.apply(v, m, z, mask, deterministic=False, rngs={"dropout": key}),
        in_axes=(None, 0)))(variables, keys)
    a, a2, b = samples[0], samples[1], samples[2]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert rel_err(a, ref) > 0.05 and rel_err(a, b) > 0.05
    with pytest.raises(Exception, match="dropout"):
        layer.apply(variables, m, z, mask, deterministic=False)   # no rng
    # Unbiased: the mean over masks is close to the deterministic output
    # (out_proj is affine in the dropped attention output).
    mean = jnp.mean(samples[1:], axis=0)
    assert rel_err(mean, ref) < 0.05, rel_err(mean, ref)


def test_padded_training_step_with_dropout_skips_padding():
    """The reference layer's training step (attention dropout on) on a padded
    batch: traced inside `skipping_padding()`, its loss and every parameter
    gradient equal the step's that visits every tile (Triton kernels: the
    masked key tiles of live rows add exact zeros, dead rows are visited as
    before), and the plan it runs says padding is skipped."""
    m, z, _ = random_inputs(21, B=2, S=4, N=40)
    keep = np.ones((2, 4, 40), bool)
    keep[..., 30:] = False  # padding residues
    keep[:, 3] = False      # a padding row
    keep[1, 2:] = False
    mask = jnp.asarray(keep)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, dropout=0.2,
                                        implementation="triton")
    variables = perturbed(layer.init(jax.random.key(22), m, z, mask), 23)

    def loss(params):
        out = layer.apply({"params": params}, m, z, mask, deterministic=False,
                          rngs={"dropout": jax.random.key(24)})
        return jnp.sum(out * m)

    step = jax.value_and_grad(loss)
    visiting = jax.jit(step)(variables["params"])
    visiting_text = str(jax.make_jaxpr(step)(variables["params"]))
    with msa_pallas.skipping_padding():
        skipping = jax.jit(step)(variables["params"])
        # The step's kernels read the mask's summaries: it traces otherwise.
        assert str(jax.make_jaxpr(step)(variables["params"])) != visiting_text
        q = jax.ShapeDtypeStruct((2, 4, 40, 4, 8), jnp.float32)
        plan = msa_pallas.explain(q, q, q, jax.ShapeDtypeStruct((2, 4, 40, 40), jnp.float32),
                                  mask, implementation="triton", dropout_rate=0.2,
                                  dropout_rng=jax.random.key(24))
    assert plan.skips_padding and plan.dropout_rate == 0.2
    for x, y in zip(jax.tree.leaves(skipping), jax.tree.leaves(visiting)):
        assert np.all(np.isfinite(np.asarray(x)))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_output_dropout_shares_mask_across_rows(kind):
    """AlphaFold2's output dropout, in the linen and in the NNX layer: one mask
    for all S rows, about `rate` of the entries dropped, the kept ones scaled
    by 1 / (1 - rate) (so the mean over masks is the deterministic output)."""
    m, z, mask = random_inputs(15)
    rate = 0.3
    layer = MSARowAttentionWithPairBias.alphafold2(msa_dim=32, pair_dim=16, num_heads=4,
                                                   dropout=rate, implementation="xla")
    variables = perturbed(layer.init(jax.random.key(16), m, z, mask), 17)
    if kind == "linen":
        def run(key, deterministic=False):
            rngs = None if key is None else {"dropout": key}
            return layer.apply(variables, m, z, mask, deterministic=deterministic, rngs=rngs)
    else:
        nnx_layer = MSARowAttentionWithPairBiasNNX.from_linen(layer, variables)

        def run(key, deterministic=False):
            return nnx_layer(m, z, mask, deterministic=deterministic, rngs=key)
    det = np.asarray(run(None, True))
    assert np.all(det != 0)

    samples = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(0), 256))
    out = np.asarray(samples[0])
    dropped = out == 0
    for s in range(1, out.shape[1]):
        np.testing.assert_array_equal(dropped[:, s], dropped[:, 0])
    assert not np.array_equal(dropped[0, 0], dropped[1, 0])  # independent per batch element
    assert abs(dropped.mean() - rate) < 0.06
    np.testing.assert_allclose(out[~dropped], det[~dropped] / (1 - rate), rtol=1e-4, atol=1e-5)
    mean = jnp.mean(samples, axis=0)
    assert rel_err(mean, det) < 0.1, rel_err(mean, det)


def test_nnx_dropout_modes():
    m, z, mask = random_inputs(18)
    layer = MSARowAttentionWithPairBiasNNX.alphafold2(32, 16, 4, dropout=0.5, implementation="xla",
                                                      rngs=nnx.Rngs(params=0, dropout=1))
    layer.out_proj.kernel[...] = jax.random.normal(jax.random.key(2), layer.out_proj.kernel[...].shape)
    # The default is inference, as linen's deterministic=True: no rng drawn.
    np.testing.assert_array_equal(np.asarray(layer(m, z, mask)), np.asarray(layer(m, z, mask)))
    layer.train()
    train_a, train_b = layer(m, z, mask), layer(m, z, mask)
    assert not np.array_equal(np.asarray(train_a), np.asarray(train_b))
    zeros = np.asarray(train_a) == 0
    assert zeros.any() and all(np.array_equal(zeros[:, s], zeros[:, 0]) for s in range(m.shape[1]))
    layer.eval()
    np.testing.assert_array_equal(np.asarray(layer(m, z, mask)), np.asarray(layer(m, z, mask)))
    attn = MSARowAttentionWithPairBiasNNX(32, 16, 4, dropout=0.5, implementation="xla",
                                          rngs=nnx.Rngs(params=0))
    np.testing.assert_array_equal(np.asarray(attn(m, z, mask)),
                                  np.asarray(attn(m, z, mask, deterministic=True)))
    with pytest.raises(ValueError, match="'dropout' rng"):
        attn(m, z, mask, deterministic=False)
    out = attn(m, z, mask, deterministic=False, rngs=nnx.Rngs(dropout=3))
    assert rel_err(out, attn(m, z, mask, deterministic=True)) > 0.01


def test_bf16_compute_float32_params():
    m, z, mask = random_inputs(19)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla",
                                        dtype=jnp.bfloat16)
    variables = perturbed(layer.init(jax.random.key(20), m, z, mask), 21)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    out = layer.apply(variables, m, z, mask)
    assert out.dtype == jnp.bfloat16
    ref = layer.clone(dtype=None).apply(variables, m, z, mask)
    assert rel_err(out.astype(jnp.float32), ref) < 3e-2
    grads = jax.grad(lambda v: jnp.sum(layer.apply(v, m, z, mask).astype(jnp.float32) ** 2))(variables)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    bf16_params = jax.eval_shape(layer.clone(param_dtype=jnp.bfloat16).init, jax.random.key(0), m, z, mask)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))


def test_batch_dims_are_independent():
    """Unbatched ([S, N, C], as AlphaFold runs) and two batch dims give the per-element result."""
    m, z, mask = random_inputs(22)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla")
    variables = perturbed(layer.init(jax.random.key(23), m, z, mask), 24)
    batched = layer.apply(variables, m, z, mask)
    single = layer.apply(variables, m[1], z[1], mask[1])
    assert rel_err(single, batched[1]) < 1e-6
    two = layer.apply(variables, m[None], z[None], mask[None])
    assert rel_err(two[0], batched) < 1e-6


def test_bad_config_and_inputs():
    m, z, mask = random_inputs(25)
    with pytest.raises(ValueError, match="not divisible"):
        MSARowAttentionWithPairBias(msa_dim=30, pair_dim=16, num_heads=4)
    with pytest.raises(ValueError, match="gating_init"):
        MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, gating_init="zeros")
    with pytest.raises(ValueError, match="dropout_mode"):
        MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, dropout_mode="rows")
    with pytest.raises(ValueError, match="dropout"):
        MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, dropout=1.5)
    layer = MSARowAttentionWithPairBias(msa_dim=32, pair_dim=16, num_heads=4, implementation="xla")
    with pytest.raises(ValueError, match=r"msa_repr has shape \[2, 4, 12, 31\]"):
        layer.init(jax.random.key(0), m[..., :31], z, mask)
    with pytest.raises(ValueError, match=r"pair_repr has shape \[2, 12, 5, 16\]; expected \[2, 12, 12, 16\]"):
        layer.init(jax.random.key(0), m, z[:, :, :5], mask)
    with pytest.raises(ValueError, match=r"msa_mask has shape \[2, 12\]"):
        layer.init(jax.random.key(0), m, z, mask[:, 0])
    with pytest.raises(ValueError, match="gating_init"):
        MSARowAttentionWithPairBiasNNX(32, 16, 4, gating_init="zeros", rngs=nnx.Rngs(0))


def test_public_names():
    """The public names: the layers and the converters are reachable from the package."""
    import msa_pallas
    from msa_pallas import convert

    assert getattr(msa_pallas, "MSARowAttentionWithPairBias", None) is MSARowAttentionWithPairBias, (
        "add `from msa_pallas.layers import MSARowAttentionWithPairBias` to msa_pallas/__init__.py")
    assert getattr(msa_pallas, "MSARowAttentionWithPairBiasNNX", None) is MSARowAttentionWithPairBiasNNX
    assert getattr(msa_pallas, "convert", None) is convert


@pytest.mark.gpu
def test_bf16_layer_pallas_vs_xla_gpu():
    """AlphaFold2 training crop, bf16 compute: Pallas and XLA layers agree with a float32 run.

    Forward and the gradients w.r.t. the parameters and both inputs.
    """
    B, S, N, c_m, c_z, H = 1, 128, 256, 256, 128, 8
    m, z, mask = random_inputs(26, B=B, S=S, N=N, msa_dim=c_m, pair_dim=c_z, keep=0.9)
    base = MSARowAttentionWithPairBias(msa_dim=c_m, pair_dim=c_z, num_heads=H, implementation="xla")
    variables = perturbed(base.init(jax.random.key(27), m, z, mask), 28, scale=0.05)
    cot = jax.random.normal(jax.random.key(29), m.shape)

    def run(layer):
        def loss(v, m, z):
            return jnp.sum(layer.apply(v, m, z, mask).astype(jnp.float32) * cot)
        out = layer.apply(variables, m, z, mask)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(variables, m, z)
        named = {jax.tree_util.keystr(path): g
                 for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
        # key.bias and pair_bias.bias shift every logit of a row equally: the
        # softmax ignores them, so their exact gradients are zero (noise here).
        return {"out": out, **{k: g for k, g in named.items()
                               if "['key']['bias']" not in k and "['pair_bias']['bias']" not in k}}

    ref = run(base)
    errors = {}
    for impl in ("pallas", "xla"):
        got = run(base.clone(implementation=impl, dtype=jnp.bfloat16))
        assert got["out"].dtype == jnp.bfloat16
        errors[impl] = {k: rel_err(np.asarray(got[k], np.float32), ref[k]) for k in ref}
        assert max(errors[impl].values()) < 6e-2, (impl, errors[impl])
    # The kernels are no less accurate than XLA's bf16 path.
    for k in ref:
        assert errors["pallas"][k] <= 1.5 * errors["xla"][k] + 2e-3, (k, errors)


@pytest.mark.gpu
def test_attention_dropout_training_step_stays_on_the_kernels_gpu():
    """The reference layer's jitted training step with attention dropout 0.1 at
    the training crop (bf16 compute): it calls the kernels, holds no
    [S, H, N, N] array (its compiled temporaries stay within 10% of the step
    without dropout, where one float32 [S, H, N, N] is 268 MB), and its
    gradients equal the xla path's with the same key (same mask)."""
    B, S, N, c_m, c_z, H = 1, 128, 256, 256, 128, 8
    m, z, mask = random_inputs(31, B=B, S=S, N=N, msa_dim=c_m, pair_dim=c_z, keep=0.9)
    layer = MSARowAttentionWithPairBias(msa_dim=c_m, pair_dim=c_z, num_heads=H, dropout=0.1,
                                        dtype=jnp.bfloat16)
    variables = perturbed(layer.init(jax.random.key(32), m, z, mask), 33, scale=0.05)
    cot = jax.random.normal(jax.random.key(34), m.shape)
    key = jax.random.key(35)

    def step(layer, deterministic):
        def loss(v, m, z):
            out = layer.apply(v, m, z, mask, deterministic=deterministic, rngs={"dropout": key})
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(variables, m, z).compile()

    with_dropout, without = step(layer, False), step(layer, True)
    hlo = with_dropout.as_text()
    assert "mosaic_gpu" in hlo or "triton" in hlo, "the step does not call the kernels"
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(with_dropout) <= 1.1 * temp(without), (temp(with_dropout), temp(without))
    grads = with_dropout(variables, m, z)
    xla = step(layer.clone(implementation="xla"), False)(variables, m, z)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree.leaves(xla)):
        name = jax.tree_util.keystr(path)
        # key.bias and pair_bias.bias: exact gradient zero (the softmax ignores them).
        if "['key']['bias']" not in name and "['pair_bias']['bias']" not in name:
            assert rel_err(np.asarray(got, np.float32), want) < 6e-2, name


@pytest.mark.parametrize("missing_biases", [(), (1, 2)], ids=["one-product", "separate"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_projections_equal_one_dense_each(dtype, missing_biases):
    """q, k, v and the gate equal four `nn.Dense` applications with the same
    parameters, in the compute dtype: one product where every projection has a
    bias, one product each where some have none."""
    from flax import linen as nn
    from msa_pallas.layer_core import fused_projections

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 3, 7, 16)), jnp.float32)
    projections = [
        (jnp.asarray(rng.standard_normal((16, 12)), jnp.float32),
         None if i in missing_biases else jnp.asarray(rng.standard_normal(12), jnp.float32))
        for i in range(4)
    ]
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    fused = fused_projections(x, projections, dtype=dtype, precision=precision)
    products = [eqn for eqn in jax.make_jaxpr(
        lambda x: fused_projections(x, projections, dtype=dtype, precision=precision))(x).eqns
        if eqn.primitive.name == "dot_general"]
    assert len(products) == (4 if missing_biases else 1)
    for out, (kernel, bias) in zip(fused, projections, strict=True):
        params = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
        dense = nn.Dense(12, use_bias=bias is not None, dtype=dtype, precision=precision)
        expected = dense.apply({"params": params}, x)
        assert out.dtype == expected.dtype == dtype
        tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
        assert rel_err(out, expected) < tolerance, rel_err(out, expected)


def test_layer_projection_parameters_are_dense_layers_parameters():
    """The linen layer's query/key/value/gate parameters are created as `nn.Dense`'s
    would be under the same names: same tree, same shapes, same values for a key."""
    from flax import linen as nn
    from msa_pallas import layer_core

    layer = MSARowAttentionWithPairBias(msa_dim=16, pair_dim=8, num_heads=2)

    class WithDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            for name, init in (("query", {}), ("gate", layer_core.gate_initializers("af2"))):
                nn.Dense(16, kernel_init=init.get("kernel_init",
                                                  layer_core.torch_linear_kernel_init()),
                         bias_init=init.get("bias_init", layer_core.torch_linear_bias_init(16)),
                         name=name)(x)

    m = jnp.ones((1, 2, 5, 16))
    params = layer.init(jax.random.key(3), m, jnp.ones((1, 5, 5, 8)))["params"]
    af2 = layer.clone(gating_init="af2").init(jax.random.key(3), m, jnp.ones((1, 5, 5, 8)))
    expected = WithDense().init(jax.random.key(3), m)["params"]
    for name, got in (("query", params["query"]), ("gate", af2["params"]["gate"])):
        assert jax.tree.structure(got) == jax.tree.structure(expected[name])
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected[name]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
