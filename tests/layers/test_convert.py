"""Parity of the converted Flax layer with PyTorch, AlphaFold2 and OpenFold.

- PyTorch: stored float64 outputs and input gradients of the reference layer
  (`tests/fixtures/torch_*.npz`, made by `tests/fixtures/make_torch_fixtures.py`
  with torch), plus a live test when `import torch` works.
- The reference layer's maths in NumPy float64 (`layer_numpy_reference.py`),
  checked against those stored outputs, for a state dict with a pair LayerNorm
  (which the PyTorch layer has not, so no PyTorch output exists to store).
- AlphaFold2 / OpenFold: an independent NumPy float64 implementation of
  Algorithm 7 (AF2 supplement, `af2_numpy_reference.py`), fed random
  AF2-format / OpenFold-format weights.

Every comparison is a relative error ||a - b|| / ||b|| against float64.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layer_numpy_reference as layer_reference
from af2_numpy_reference import (
    AF2_PREFIX, af2_row_attention, haiku_nested, random_af2_params, random_msa_inputs,
)
from msa_pallas import convert
from msa_pallas.layers import MSARowAttentionWithPairBias

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _load_fixture_module():
    spec = importlib.util.spec_from_file_location(
        "make_torch_fixtures", FIXTURES / "make_torch_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_torch_case(name: str) -> dict:
    parts = {p: dict(np.load(FIXTURES / f"torch_{name}_{p}.npz"))
             for p in ("inputs", "forward", "backward")}
    return {"inputs": parts["inputs"], "forward": parts["forward"], "backward": parts["backward"]}


def flax_forward_backward(layer, variables, msa, pair, mask, cotangent):
    """Output and (grad msa_repr, grad pair_repr) of the Flax layer for one cotangent."""
    @jax.jit
    def run(variables, msa, pair, mask, cotangent):
        out, vjp = jax.vjp(lambda m, z: layer.apply(variables, m, z, mask), msa, pair)
        return (out, *vjp(cotangent))

    return [np.asarray(x, np.float64) for x in run(variables, msa, pair, mask, cotangent)]


def check_torch_case(case: dict, implementation: str) -> None:
    inp, fwd, bwd = case["inputs"], case["forward"], case["backward"]
    meta = json.loads(str(inp["meta"]))
    state_dict = {k[3:]: inp[k].astype(np.float64) for k in inp if k.startswith("sd/")}
    variables = convert.from_torch_state_dict(state_dict)
    layer = convert.module_from_variables(variables, implementation=implementation)
    assert (layer.msa_dim, layer.pair_dim, layer.num_heads) == (
        meta["msa_dim"], meta["pair_dim"], meta["heads"])

    msa = jnp.asarray(inp["msa_int8"].astype(np.float32) * meta["msa_scale"])
    pair = jnp.asarray(inp["pair_int8"].astype(np.float32) * meta["pair_scale"])
    mask = jnp.asarray(inp["mask"])
    cot = jnp.asarray(bwd["cotangent_int8"].astype(np.float32) * meta["cotangent_scale"])
    out, g_msa, g_pair = flax_forward_backward(layer, variables, msa, pair, mask, cot)

    # torch's grad w.r.t. pair_repr = grad w.r.t. the pair projection @ pair_bias.weight;
    # check the rebuilt one against torch's own samples and norm first.
    w_pair = state_dict["pair_bias.weight"]
    torch_g_pair = np.einsum("bijh,hc->bijc", bwd["grad_proj"].astype(np.float64), w_pair)
    idx = bwd["grad_pair_sample_index"]
    assert rel_err(torch_g_pair.reshape(-1)[idx], bwd["grad_pair_sample_value"]) < 1e-6
    assert abs(np.linalg.norm(torch_g_pair) / bwd["grad_pair_norm"] - 1) < 1e-6

    errors = {
        "out": rel_err(out, fwd["out"]),
        "grad_msa": rel_err(g_msa, bwd["grad_msa"]),
        "grad_pair": rel_err(g_pair, torch_g_pair),
    }
    # The fully masked row (batch 0, row 1) and the partly masked row (batch 0, row 2) alone.
    for s, label in ((1, "fully_masked_row"), (2, "partly_masked_row")):
        errors[f"out_{label}"] = rel_err(out[0, s], fwd["out"][0, s])
        errors[f"grad_msa_{label}"] = rel_err(g_msa[0, s], bwd["grad_msa"][0, s])
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(g_msa)) and np.all(np.isfinite(g_pair))
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"{implementation}: relative errors above {TOL}: {bad} (all: {errors})"


@pytest.mark.parametrize("name, implementation", [
    ("seed", "xla"), ("odd", "xla"), ("seed", "pallas"),
])
def test_torch_fixture_parity(name, implementation):
    """Output and both input gradients match the float64 PyTorch reference to 1e-5."""
    check_torch_case(load_torch_case(name), implementation)


def test_torch_fixture_is_nontrivial():
    """The stored case exercises the pair bias and the mask (they change the output)."""
    inp = load_torch_case("odd")["inputs"]
    meta = json.loads(str(inp["meta"]))
    mask = inp["mask"]
    assert not mask[0, 1].any() and mask[0, 2].any() and not mask[0, 2].all()
    variables = convert.from_torch_state_dict(
        {k[3:]: inp[k].astype(np.float64) for k in inp if k.startswith("sd/")})
    layer = convert.module_from_variables(variables, implementation="xla")
    msa = inp["msa_int8"].astype(np.float32) * meta["msa_scale"]
    pair = inp["pair_int8"].astype(np.float32) * meta["pair_scale"]
    out = layer.apply(variables, msa, pair, mask)
    assert rel_err(layer.apply(variables, msa, 0.0 * pair, mask), out) > 0.1
    no_mask = layer.apply(variables, msa, pair, np.ones_like(mask))
    assert rel_err(no_mask[0, 2], out[0, 2]) > 0.1


def test_torch_live():
    """Builds the reference layer in PyTorch now (skipped without torch) and compares."""
    torch = pytest.importorskip("torch")
    fixtures = _load_fixture_module()
    cfg = dict(B=2, S=3, N=19, msa_dim=24, pair_dim=12, heads=3, seed=7)
    case = fixtures.build_case(cfg)
    check_torch_case(case, "xla")
    # torch tensors (float64, bfloat16) convert like NumPy arrays.
    torch_layer = fixtures.load_reference_module().MSARowAttentionWithPairBias(24, 12, 3).double()
    sd = torch_layer.state_dict()
    from_tensors = convert.from_torch_state_dict(sd)
    from_numpy = convert.from_torch_state_dict({k: v.numpy() for k, v in sd.items()})
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 from_tensors, from_numpy)
    from_bf16 = convert.from_torch_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items()})
    assert jax.tree.map(jnp.shape, from_bf16) == jax.tree.map(jnp.shape, from_numpy)
    # Regenerating the stored "odd" case with this torch gives the stored outputs.
    odd = fixtures.build_case(fixtures.CASES["odd"])
    stored = load_torch_case("odd")
    assert rel_err(odd["forward"]["out"], stored["forward"]["out"]) < 1e-6
    assert rel_err(odd["backward"]["grad_msa"], stored["backward"]["grad_msa"]) < 1e-6


def test_numpy_layer_reference_matches_torch_fixtures():
    """tests/layer_numpy_reference.py (the reference layer's maths in NumPy
    float64, used below and in test_layers.py) gives PyTorch's stored outputs."""
    for name in ("seed", "odd"):
        case = load_torch_case(name)
        inp, meta = case["inputs"], json.loads(str(case["inputs"]["meta"]))
        sd = {k[3:]: inp[k] for k in inp if k.startswith("sd/")}
        out = layer_reference.reference_layer(
            layer_reference.from_torch_state_dict(sd),
            inp["msa_int8"].astype(np.float64) * meta["msa_scale"],
            inp["pair_int8"].astype(np.float64) * meta["pair_scale"],
            inp["mask"], meta["heads"])
        assert rel_err(out, case["forward"]["out"]) < 1e-6, name


def _directional_check(loss64, grad, arg, rng, what):
    """jax's gradient `grad` of a float32 loss along a random direction against a
    central difference of the float64 loss `loss64(arg)`."""
    direction = rng.standard_normal(arg.shape)
    eps = 1e-4
    numeric = (loss64(arg + eps * direction) - loss64(arg - eps * direction)) / (2 * eps)
    analytic = float(np.sum(np.asarray(grad, np.float64) * direction))
    assert abs(analytic - numeric) <= 1e-4 * abs(numeric), (what, analytic, numeric)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_torch_state_dict_with_pair_layer_norm(implementation):
    """A reference-layer state dict with a pair LayerNorm (`pair_layer_norm.{weight,bias}`,
    no q/k/v biases): the converted layer against the NumPy float64 maths of the
    reference layer with that LayerNorm, output and input gradients.

    The fixture is made here with NumPy (the reference layer itself has no pair
    LayerNorm, so there is no PyTorch output to store); the NumPy maths are
    checked against PyTorch's stored outputs above."""
    rng = np.random.default_rng(7)
    B, S, N, c_m, c_z, heads = 1, 3, 11, 16, 6, 2
    sd = layer_reference.random_torch_state_dict(rng, c_m, c_z, heads, pair_layer_norm=True,
                                                 qkv_bias=False)
    variables = convert.from_torch_state_dict(sd)
    layer = convert.module_from_variables(variables, implementation=implementation)
    assert layer.pair_layer_norm and not layer.qkv_bias
    m, z, mask = layer_reference.random_layer_inputs(rng, B, S, N, c_m, c_z)
    weights = layer_reference.from_torch_state_dict(sd)
    cot = rng.standard_normal(m.shape)
    out, g_msa, g_pair = flax_forward_backward(layer, variables, m, z, mask, cot.astype(np.float32))
    expected = layer_reference.reference_layer(weights, m, z, mask, heads)
    assert rel_err(out, expected) < TOL

    def loss64(msa=m, pair=z):
        return float(np.sum(layer_reference.reference_layer(weights, msa, pair, mask, heads) * cot))

    _directional_check(lambda a: loss64(msa=a), g_msa, m.astype(np.float64), rng, "msa")
    _directional_check(lambda a: loss64(pair=a), g_pair, z.astype(np.float64), rng, "pair")
    # The LayerNorm's scale and offset matter (swapping them would show).
    swapped = dict(weights, pair_layer_norm=weights["pair_layer_norm"][::-1])
    assert rel_err(layer_reference.reference_layer(swapped, m, z, mask, heads), expected) > 1e-2


# ---------------------------------------------------------------------------
# AlphaFold2, Algorithm 7: the NumPy float64 reference lives in
# tests/af2_numpy_reference.py (shared with test_haiku.py).
# ---------------------------------------------------------------------------


def test_alphafold2_params_match_numpy_algorithm7():
    """AF2 Haiku params (unbatched, as AF2 runs) -> the AF2 preset; 1e-5 vs float64."""
    rng = np.random.default_rng(0)
    c_m, c_z, heads, d, S, N = 32, 16, 4, 8, 6, 21
    p = random_af2_params(rng, c_m, c_z, heads, d)
    variables = convert.from_alphafold2_params(haiku_nested(p, AF2_PREFIX))
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")
    assert layer.pair_layer_norm and not layer.qkv_bias and not layer.pair_bias_bias
    assert layer.dropout_mode == "output_shared_rows" and layer.dropout == 0.15
    m, z, mask = random_msa_inputs(rng, (), S, N, c_m, c_z)
    out = layer.apply(variables, m, z, mask, deterministic=True)
    assert out.shape == (S, N, c_m)
    expected = af2_row_attention(m, z, mask, p, "additive")
    assert rel_err(out, expected) < TOL
    # Both mask conventions agree here (every row keeps a key).
    assert rel_err(af2_row_attention(m, z, mask, p, "replace"), expected) < 1e-12


def test_alphafold2_npz_format_stacked_layers_and_batch():
    """The flat `module//name` npz format with stacked layers, `index=`, and a batch axis."""
    rng = np.random.default_rng(1)
    c_m, c_z, heads, d, S, N, layers = 24, 8, 3, 8, 4, 13, 3
    per_layer = [random_af2_params(rng, c_m, c_z, heads, d) for _ in range(layers)]
    raw = {}
    for key in per_layer[0]:
        scope, _, name = key.rpartition("/")
        path = f"{AF2_PREFIX}/{scope}" if scope else AF2_PREFIX
        raw[f"{path}//{name}"] = np.stack([p[key] for p in per_layer])
    # An unrelated extra-MSA layer too: the prefix must then be explicit.
    raw.update({k.replace("evoformer_iteration", "extra_msa_stack"): v for k, v in raw.items()})
    with pytest.raises(ValueError, match="several candidates"):
        convert.from_alphafold2_params(raw)
    with pytest.raises(ValueError, match="pass index="):
        convert.from_alphafold2_params(raw, AF2_PREFIX)
    variables = convert.from_alphafold2_params(raw, AF2_PREFIX, index=2)
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")
    m, z, mask = random_msa_inputs(rng, (2,), S, N, c_m, c_z)
    out = layer.apply(variables, m, z, mask)
    assert rel_err(out, af2_row_attention(m, z, mask, per_layer[2])) < TOL
    assert rel_err(out, af2_row_attention(m, z, mask, per_layer[1])) > 1e-2


def test_fully_masked_row_semantics():
    """A row with no key kept: the op's `where(mask, logits, -1e9)` gives uniform weights.

    AlphaFold2 / OpenFold add `1e9 * (mask - 1)`: in float64 that leaves the
    softmax of a fully masked row unchanged (shift invariance), in float32 it
    rounds to nearly uniform. The layer follows the replacement convention
    (and the PyTorch reference's `masked_fill`), so only rows with at least one
    key kept are compared with the additive convention above.
    """
    rng = np.random.default_rng(2)
    c_m, c_z, heads, d, S, N = 16, 8, 2, 8, 3, 10
    p = random_af2_params(rng, c_m, c_z, heads, d)
    variables = convert.from_alphafold2_params(haiku_nested(p, AF2_PREFIX))
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")
    m, z, mask = random_msa_inputs(rng, (), S, N, c_m, c_z)
    mask[1] = False
    out = np.asarray(layer.apply(variables, m, z, mask))
    replace = af2_row_attention(m, z, mask, p, "replace")
    additive = af2_row_attention(m, z, mask, p, "additive")
    assert np.all(np.isfinite(out))
    assert rel_err(out, replace) < TOL
    assert rel_err(out[1], additive[1]) > 1e-3          # the conventions differ on row 1 ...
    assert rel_err(out[[0, 2]], additive[[0, 2]]) < TOL  # ... and agree on the others


def openfold_from_af2(p: dict, c_m: int, heads: int, d: int) -> dict:
    """The same weights in OpenFold's MSARowAttentionWithPairBias layout (torch [out, in])."""
    return {
        "layer_norm_m.weight": p["query_norm/scale"], "layer_norm_m.bias": p["query_norm/offset"],
        "layer_norm_z.weight": p["feat_2d_norm/scale"], "layer_norm_z.bias": p["feat_2d_norm/offset"],
        "linear_z.weight": p["feat_2d_weights"].T,
        "mha.linear_q.weight": p["attention/query_w"].reshape(c_m, heads * d).T,
        "mha.linear_k.weight": p["attention/key_w"].reshape(c_m, heads * d).T,
        "mha.linear_v.weight": p["attention/value_w"].reshape(c_m, heads * d).T,
        "mha.linear_g.weight": p["attention/gating_w"].reshape(c_m, heads * d).T,
        "mha.linear_g.bias": p["attention/gating_b"].reshape(heads * d),
        "mha.linear_o.weight": p["attention/output_w"].reshape(heads * d, c_m).T,
        "mha.linear_o.bias": p["attention/output_b"],
    }


def test_openfold_state_dict_matches_numpy_algorithm7():
    """OpenFold keys (with a prefix, c_hidden * H != c_m) -> AF2 preset; 1e-5 vs float64."""
    rng = np.random.default_rng(3)
    c_m, c_z, heads, d, S, N = 40, 12, 4, 8, 5, 17   # H * d = 32 != c_m
    p = random_af2_params(rng, c_m, c_z, heads, d)
    sd = {f"evoformer.blocks.0.msa_att_row.{k}": np.ascontiguousarray(v, np.float64)
          for k, v in openfold_from_af2(p, c_m, heads, d).items()}
    sd["evoformer.blocks.1.msa_att_row.layer_norm_m.weight"] = np.ones(c_m)
    variables = convert.from_openfold_state_dict(sd, prefix="evoformer.blocks.0.msa_att_row")
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")
    assert (layer.msa_dim, layer.pair_dim, layer.num_heads, layer.head_dim) == (c_m, c_z, heads, d)
    m, z, mask = random_msa_inputs(rng, (2,), S, N, c_m, c_z)
    out = layer.apply(variables, m, z, mask)
    assert rel_err(out, af2_row_attention(m, z, mask, p)) < TOL
    # OpenFold and AF2 formats give the same variables.
    af2_vars = convert.from_alphafold2_params(haiku_nested(p, AF2_PREFIX))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 variables, af2_vars)


# ---------------------------------------------------------------------------
# Bad input: clear errors.
# ---------------------------------------------------------------------------

def _torch_like_state_dict(rng, msa_dim=16, pair_dim=8, heads=2):
    sd = {"layer_norm.weight": rng.standard_normal(msa_dim), "layer_norm.bias": rng.standard_normal(msa_dim),
          "pair_bias.weight": rng.standard_normal((heads, pair_dim)), "pair_bias.bias": rng.standard_normal(heads)}
    for name in ("query", "key", "value", "gate", "out_proj"):
        sd[f"{name}.weight"] = rng.standard_normal((msa_dim, msa_dim))
        sd[f"{name}.bias"] = rng.standard_normal(msa_dim)
    return sd


def test_converter_errors_name_the_key():
    rng = np.random.default_rng(4)
    sd = _torch_like_state_dict(rng)
    variables = convert.from_torch_state_dict(sd)
    np.testing.assert_array_equal(variables["params"]["query"]["kernel"], sd["query.weight"].T.astype(np.float32))
    layer = convert.module_from_variables(variables)
    assert (layer.msa_dim, layer.pair_dim, layer.num_heads, layer.qkv_bias) == (16, 8, 2, True)

    with pytest.raises(ValueError, match=r"missing keys \['gate.weight'\]"):
        convert.from_torch_state_dict({k: v for k, v in sd.items() if k != "gate.weight"})
    with pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\]"):
        convert.from_torch_state_dict({**sd, "extra.weight": sd["gate.weight"]})
    with pytest.raises(ValueError, match=r"'key.weight' has shape \(16, 15\); expected \(16, 16\)"):
        convert.from_torch_state_dict({**sd, "key.weight": sd["key.weight"][:, :15]})
    with pytest.raises(ValueError, match="all present or all absent"):
        convert.from_torch_state_dict({k: v for k, v in sd.items() if k != "value.bias"})
    with pytest.raises(ValueError, match="no key starts with prefix"):
        convert.from_torch_state_dict(sd, prefix="encoder")
    no_qkv_bias = {k: v for k, v in sd.items() if k not in ("query.bias", "key.bias", "value.bias")}
    assert not convert.module_from_variables(convert.from_torch_state_dict(no_qkv_bias)).qkv_bias

    of = openfold_from_af2(random_af2_params(rng, 16, 8, 2, 8), 16, 2, 8)
    with pytest.raises(ValueError, match=r"missing keys \['mha.linear_o.bias'\]"):
        convert.from_openfold_state_dict({k: v for k, v in of.items() if k != "mha.linear_o.bias"})
    with pytest.raises(ValueError, match="'mha.linear_g.weight' has shape"):
        convert.from_openfold_state_dict({**of, "mha.linear_g.weight": of["mha.linear_g.weight"][:8]})

    p = random_af2_params(rng, 16, 8, 2, 8)
    with pytest.raises(ValueError, match="gating_b' has shape"):
        convert.from_alphafold2_params(haiku_nested({**p, "attention/gating_b": p["attention/gating_b"][:1]}, AF2_PREFIX))
    with pytest.raises(ValueError, match=r"missing keys \['attention/output_w'\]"):
        convert.from_alphafold2_params(haiku_nested({k: v for k, v in p.items() if k != "attention/output_w"}, AF2_PREFIX))
    with pytest.raises(ValueError, match="no parameter path ends in"):
        convert.from_alphafold2_params({"other/module": {"w": np.ones(3)}})
    with pytest.raises(TypeError, match="expected a floating array"):
        convert.from_torch_state_dict({**sd, "gate.bias": np.arange(16)})


def test_to_nnx_from_converted_weights():
    rng = np.random.default_rng(5)
    sd = _torch_like_state_dict(rng)
    variables = convert.from_torch_state_dict(sd)
    layer = convert.module_from_variables(variables, implementation="xla")
    nnx_layer = convert.to_nnx(variables, implementation="xla")
    m, z, mask = random_msa_inputs(rng, (1,), 3, 9, 16, 8)
    a = layer.apply(variables, m, z, mask)
    b = nnx_layer(m, z, mask, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(layer, MSARowAttentionWithPairBias)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["seed", "odd"])
def test_torch_fixture_parity_gpu(name):
    """On a GPU: the Triton kernels and float32 projections (no silent TF32) within 1e-5."""
    case = load_torch_case(name)
    check_torch_case(case, "pallas")
    check_torch_case(case, "xla")
