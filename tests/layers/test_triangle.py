"""Triangle attention (msa_pallas.triangle, msa_pallas.haiku_triangle) against a
float64 NumPy reference written from OpenFold's / AlphaFold2's TriangleAttention,
and its converters from OpenFold state dicts and AlphaFold2 parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import rel_err
from msa_pallas.convert import (
    triangle_from_alphafold2_params, triangle_from_openfold_state_dict,
    triangle_module_from_variables,
)
from msa_pallas.triangle import TriangleAttention, TriangleAttentionNNX

AF2_PATH = "alphafold/alphafold_iteration/evoformer/evoformer_iteration/"
OPENFOLD_PREFIX = "evoformer.blocks.0.pair_stack."


def reference(z, mask, p, starting):
    """OpenFold's TriangleAttention in float64 from AF2-named arrays: mask bias 1e9 * (mask - 1)."""
    z, mask = np.asarray(z, np.float64), np.asarray(mask, np.float64)
    if not starting:
        z, mask = np.swapaxes(z, -2, -3), np.swapaxes(mask, -1, -2)
    mu = z.mean(-1, keepdims=True)
    x = (z - mu) / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    x = x * p["query_norm/scale"] + p["query_norm/offset"]
    d = p["attention/query_w"].shape[-1]
    bias = np.einsum("...jkc,ch->...hjk", x, p["feat_2d_weights"])
    q, k, v, g = (np.einsum("...ijc,chd->...ijhd", x, p[f"attention/{n}"])
                  for n in ("query_w", "key_w", "value_w", "gating_w"))
    logits = np.einsum("...ijhd,...ikhd->...ihjk", q, k) / np.sqrt(d)
    logits = logits + bias[..., None, :, :, :] + 1e9 * (mask[..., :, None, None, :] - 1)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    gate = 1 / (1 + np.exp(-(g + p["attention/gating_b"])))
    o = np.einsum("...ihjk,...ikhd->...ijhd", w, v) * gate
    out = np.einsum("...ijhd,hdc->...ijc", o, p["attention/output_w"]) + p["attention/output_b"]
    return np.swapaxes(out, -2, -3) if not starting else out


def random_af2_params(rng, c, heads, d, layers=None):
    lead = () if layers is None else (layers,)
    shapes = {
        "query_norm/scale": (c,), "query_norm/offset": (c,), "feat_2d_weights": (c, heads),
        "attention/query_w": (c, heads, d), "attention/key_w": (c, heads, d),
        "attention/value_w": (c, heads, d), "attention/gating_w": (c, heads, d),
        "attention/gating_b": (heads, d), "attention/output_w": (heads, d, c),
        "attention/output_b": (c,),
    }
    p = {k: rng.normal(size=lead + s) / np.sqrt(s[0]) for k, s in shapes.items()}
    p["query_norm/scale"] += 1.0
    return {k: v.astype(np.float32) for k, v in p.items()}


def openfold_state_dict(p, prefix):
    """The OpenFold TriangleAttention state dict (torch [out, in] weights) holding AF2's arrays."""
    c, heads, d = p["attention/query_w"].shape
    flat = lambda name: p[name].reshape(c, heads * d).T
    return {prefix + k: v for k, v in {
        "layer_norm.weight": p["query_norm/scale"], "layer_norm.bias": p["query_norm/offset"],
        "linear.weight": p["feat_2d_weights"].T,
        "mha.linear_q.weight": flat("attention/query_w"),
        "mha.linear_k.weight": flat("attention/key_w"),
        "mha.linear_v.weight": flat("attention/value_w"),
        "mha.linear_g.weight": flat("attention/gating_w"),
        "mha.linear_g.bias": p["attention/gating_b"].reshape(-1),
        "mha.linear_o.weight": p["attention/output_w"].reshape(heads * d, c).T,
        "mha.linear_o.bias": p["attention/output_b"],
    }.items()}


def pair_inputs(rng, lead, n, c):
    z = rng.normal(size=(*lead, n, n, c)).astype(np.float32)
    mask = rng.uniform(size=(*lead, n, n)) > 0.25
    mask[..., 0] = mask[..., 0, :] = True  # every row and column keeps a key
    return z, mask


@pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_openfold_weights_match_reference(seed, starting, implementation):
    rng = np.random.default_rng(seed)
    c, heads, d, n = 16, 2, 8, 12
    p = random_af2_params(rng, c, heads, d)
    name = "tri_att_start" if starting else "tri_att_end"
    sd = openfold_state_dict(p, f"{OPENFOLD_PREFIX}{name}.")
    variables = triangle_from_openfold_state_dict(sd, prefix=OPENFOLD_PREFIX + name)
    layer = triangle_module_from_variables(variables, starting=starting,
                                           implementation=implementation)
    z, mask = pair_inputs(rng, (), n, c)
    out = jax.jit(layer.apply)(variables, z, mask)
    assert out.shape == z.shape
    assert rel_err(out, reference(z, mask, p, starting)) < 1e-5


@pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
def test_alphafold2_stacked_params_linen_nnx_and_haiku(seed, starting):
    """One layer of stacked AF2 params: linen, NNX and the Haiku drop-in all equal the reference."""
    import haiku as hk
    from msa_pallas.haiku_triangle import TriangleAttention as HaikuTriangleAttention

    rng = np.random.default_rng(seed)
    c, heads, d, n, layers, index = 16, 4, 4, 10, 3, 1
    node = "triangle_attention_starting_node" if starting else "triangle_attention_ending_node"
    stacked = random_af2_params(rng, c, heads, d, layers)
    # AF2's npz keys: "module/path//name", the last scope part of the name (attention/...)
    npz = {f"{AF2_PATH}{node}" + ("/" + k.rsplit("/", 1)[0] if "/" in k else "") + "//"
           + k.rsplit("/", 1)[-1]: v for k, v in stacked.items()}
    variables = triangle_from_alphafold2_params(npz, AF2_PATH + node, index=index)
    p = {k: v[index] for k, v in stacked.items()}
    z, mask = pair_inputs(rng, (2,), n, c)  # a leading batch axis
    expected = reference(z, mask, p, starting)

    layer = triangle_module_from_variables(variables, starting=starting, implementation="xla")
    assert rel_err(layer.apply(variables, z, mask), expected) < 1e-5
    nnx_layer = TriangleAttentionNNX.from_linen(layer, variables)
    assert rel_err(nnx_layer(z, mask), expected) < 1e-5
    round_trip = nnx_layer.to_linen_variables()
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     round_trip, variables))

    config = dict(num_head=heads, gating=True,
                  orientation="per_row" if starting else "per_column")
    forward = hk.transform(lambda x, m: HaikuTriangleAttention(
        config, dict(zero_init=True), name=node, implementation="xla")(x, m))
    haiku_params = {f"{node}" + ("/" + k.rsplit("/", 1)[0] if "/" in k else ""): {} for k in p}
    for k, v in p.items():
        scope = node + ("/" + k.rsplit("/", 1)[0] if "/" in k else "")
        haiku_params[scope][k.rsplit("/", 1)[-1]] = jnp.asarray(v)
    init_params = forward.init(jax.random.key(seed), z[0], mask[0])
    assert jax.tree.map(jnp.shape, init_params) == jax.tree.map(jnp.shape, haiku_params)
    out = jax.vmap(lambda x, m: forward.apply(haiku_params, None, x, m))(z, mask)
    assert rel_err(out, expected) < 1e-5


def test_nnx_init_matches_linen_tree_and_runs(seed):
    layer = TriangleAttention(pair_dim=16, num_heads=2, starting=False, implementation="xla")
    z, mask = pair_inputs(np.random.default_rng(seed), (), 8, 16)
    variables = layer.init(jax.random.key(seed), z, mask)
    nnx_layer = TriangleAttentionNNX(16, 2, starting=False, implementation="xla",
                                     rngs=nnx.Rngs(seed))
    assert (jax.tree.map(jnp.shape, nnx_layer.to_linen_variables())
            == jax.tree.map(jnp.shape, variables))
    # AF2 / OpenFold's init: the gate starts at sigmoid(1), the output projection at zero.
    params = variables["params"]
    assert float(jnp.abs(params["out_proj"]["kernel"]).max()) == 0.0
    assert float(jnp.abs(params["gate"]["bias"] - 1).max()) == 0.0
    assert "bias" not in params["query"] and "bias" not in params["pair_bias"]


def test_gradients_pallas_match_xla(seed):
    """d(loss)/d(params, z) through the Triton interpreter equals the XLA path's."""
    rng = np.random.default_rng(seed)
    p = random_af2_params(rng, 16, 2, 8)
    variables = triangle_from_alphafold2_params({"triangle_attention_ending_node": p})
    z, mask = pair_inputs(rng, (), 8, 16)
    grads = {}
    for implementation in ("xla", "pallas"):
        layer = triangle_module_from_variables(variables, starting=False,
                                               implementation=implementation)
        loss = lambda v, x: jnp.sum(jnp.sin(layer.apply(v, x, mask)))
        grads[implementation] = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, z)
    for a, b in zip(jax.tree.leaves(grads["pallas"]), jax.tree.leaves(grads["xla"])):
        assert rel_err(a, b) < 1e-5


def test_converter_errors_name_the_key(seed):
    p = random_af2_params(np.random.default_rng(seed), 8, 2, 4)
    sd = openfold_state_dict(p, "")
    del sd["mha.linear_g.bias"]
    with pytest.raises(ValueError, match="mha.linear_g.bias"):
        triangle_from_openfold_state_dict(sd)
    sd = openfold_state_dict(p, "")
    sd["linear.weight"] = sd["linear.weight"][:, :4]
    with pytest.raises(ValueError, match="linear.weight"):
        triangle_from_openfold_state_dict(sd)
    stacked = {k: np.stack([v, v]) for k, v in p.items()}
    with pytest.raises(ValueError, match="index="):
        triangle_from_alphafold2_params({"triangle_attention_starting_node": stacked})
    two = {"a/triangle_attention_starting_node": p, "a/triangle_attention_ending_node": p}
    with pytest.raises(ValueError, match="several candidates"):
        triangle_from_alphafold2_params(two)
    bad = dict(p, **{"attention/gating_b": p["attention/gating_b"][:1]})
    with pytest.raises(ValueError, match="gating_b"):
        triangle_from_alphafold2_params({"triangle_attention_starting_node": bad})


def test_input_shape_errors():
    layer = TriangleAttention(pair_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="pair_repr"):
        layer.init(jax.random.key(0), jnp.ones((4, 5, 8)))
    with pytest.raises(ValueError, match="pair_mask"):
        layer.init(jax.random.key(0), jnp.ones((4, 4, 8)), jnp.ones((4, 3), bool))


@pytest.mark.gpu
@pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_triangle_matches_reference(seed, starting, dtype):
    """AlphaFold2's sizes (c = 128, H = 4, d = 32) at N = 200 and the default kernels."""
    rng = np.random.default_rng(seed)
    p = random_af2_params(rng, 128, 4, 32)
    variables = triangle_from_alphafold2_params({"triangle_attention_starting_node": p})
    z, mask = pair_inputs(rng, (), 200, 128)
    layer = triangle_module_from_variables(variables, starting=starting, dtype=dtype)
    out = jax.jit(layer.apply)(variables, jnp.asarray(z, dtype), mask)
    assert rel_err(out, reference(z, mask, p, starting)) < (1e-4 if dtype == jnp.float32 else 2e-2)


def test_haiku_inference_chunks_equal_one_call(seed):
    """inference_chunk_bytes: rows in lax.map chunks (the last padded) at inference
    give the unchunked result; training ignores it."""
    import haiku as hk
    from msa_pallas.haiku_triangle import TriangleAttention as HaikuTriangleAttention

    rng = np.random.default_rng(seed)
    p = random_af2_params(rng, 16, 2, 8)
    z, mask = pair_inputs(rng, (), 10, 16)
    node = "triangle_attention_ending_node"
    params = {node: {"feat_2d_weights": p["feat_2d_weights"]},
              f"{node}/query_norm": {"scale": p["query_norm/scale"],
                                     "offset": p["query_norm/offset"]},
              f"{node}/attention": {k.split("/")[1]: v for k, v in p.items()
                                    if k.startswith("attention/")}}
    config = dict(num_head=2, gating=True, orientation="per_column")
    outs, jaxprs = {}, {}
    for chunk_bytes, training in ((None, False), (3 * 6 * 10 * 16 * 4, False),
                                  (3 * 6 * 10 * 16 * 4, True)):
        forward = hk.transform(lambda x, m, cb=chunk_bytes, t=training: HaikuTriangleAttention(
            config, dict(zero_init=True), name=node, implementation="xla",
            inference_chunk_bytes=cb)(x, m, is_training=t))
        apply = lambda x, m, f=forward: f.apply(params, None, x, m)
        outs[chunk_bytes, training] = apply(z, mask)
        jaxprs[chunk_bytes, training] = str(jax.make_jaxpr(apply)(z, mask))
    chunked = (3 * 6 * 10 * 16 * 4, False)
    assert "scan" in jaxprs[chunked] and "scan" not in jaxprs[None, False]
    assert "scan" not in jaxprs[3 * 6 * 10 * 16 * 4, True]
    expected = reference(z, mask, p, starting=False)
    for out in outs.values():
        assert rel_err(out, expected) < 1e-5
