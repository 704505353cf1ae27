"""The OpenFold converters on a real OpenFold state dict and OpenFold's own outputs.

`tests/fixtures/openfold_block.npz` (made by
`tests/fixtures/make_openfold_fixtures.py` with torch and an OpenFold
checkout) holds the whole state dict of a small OpenFold `EvoformerStack`
with one block, keys as OpenFold names them (`evoformer.blocks.0.msa_att_row.*`,
`evoformer.blocks.0.pair_stack.tri_att_{start,end}.*`, and every other module
of the block), random inputs, and what OpenFold's `msa_att_row`,
`tri_att_start` and `tri_att_end` computed on them in float64 and in float32.
The converters pick their module out of the whole dict by prefix; the
converted layers run in float32, on the XLA path and on the Pallas (Triton)
kernels (interpreted off a GPU), and are compared by relative error with the
float64 outputs (the float32 ones on fully masked rows, see below).

Fully masked rows (no key kept). OpenFold adds `1e9 * (mask - 1)` to the
logits: in float64 that keeps the logits (to ~1e-7), so such a row gets the
softmax of its unmasked logits; in float32 it rounds them away and the weights
are uniform. The layers replace masked logits with -1e9, so they give uniform
weights in every dtype: they match OpenFold's float32 output on those rows and
its float64 output on all the others.

The ending node. In this OpenFold version `PairStack` builds `tri_att_end` as a
`TriangleAttention` with `starting=True` and transposes the pair and the mask
around the call, so the ending-node update is `tri_att_end(z^T, mask^T)^T`
(stored as `tri_att_end`), while `tri_att_end(z, mask)` on its own is
starting-node maths (stored as `tri_att_end_module`). Its weights converted
give `triangle_module_from_variables(..., starting=False)` for the former and
`starting=True` for the latter.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from helpers import rel_err
from msa_pallas import convert

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "openfold_block.npz"
TOL = 1e-5
# A converter that swapped or mislaid a weight misses OpenFold's output by far more.
WRONG = 1e-2

MSA_ROW = "evoformer.blocks.0.msa_att_row"
TRI_START = "evoformer.blocks.0.pair_stack.tri_att_start"
TRI_END = "evoformer.blocks.0.pair_stack.tri_att_end"

# (prefix, starting, the fixture's output): the ending node as the Evoformer
# applies it, and the tri_att_end module's own call.
TRIANGLE_CASES = {
    "start": (TRI_START, True, "tri_att_start"),
    "end": (TRI_END, False, "tri_att_end"),
    "end_module_call": (TRI_END, True, "tri_att_end_module"),
}


def load_fixture() -> dict:
    """The fixture file: `sd` (OpenFold keys -> float16 arrays), float32 inputs
    `m [B, S, N, c_m]`, `z [B, N, N, c_z]`, bool masks `msa_mask [B, S, N]`,
    `pair_mask [B, N, N]`, the outputs (float32 arrays of OpenFold's float64 /
    float32 runs) and `meta`."""
    with np.load(FIXTURE) as f:
        raw = {k: f[k] for k in f.files}
    meta = json.loads(str(raw.pop("meta")))
    out = {"sd": {k[3:]: v for k, v in raw.items() if k.startswith("sd/")}, "meta": meta}
    out.update({k: v for k, v in raw.items() if not k.startswith("sd/")})
    out["m"] = (raw["msa_int8"] * np.float32(meta["msa_scale"])).astype(np.float32)
    out["z"] = (raw["pair_int8"] * np.float32(meta["pair_scale"])).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def fx() -> dict:
    return load_fixture()


def keeps_a_key(fx: dict, starting: bool | None) -> np.ndarray:
    """Bool over the output's rows: does the query's attention row keep any key?
    None: MSA rows `[B, S]`; True/False: pair queries `[B, N, N]` of the starting /
    ending node (row i keeps keys mask[i, :]; column j keeps keys mask[:, j])."""
    if starting is None:
        return fx["msa_mask"].any(-1)
    pm = fx["pair_mask"]
    rows = pm.any(-1)[..., :, None] if starting else pm.any(-2)[..., None, :]
    return np.broadcast_to(rows, pm.shape)


def msa_layer(sd, implementation):
    variables = convert.from_openfold_state_dict(sd, prefix=MSA_ROW)
    layer = convert.module_from_variables(variables, preset="alphafold2",
                                          implementation=implementation)
    return layer, variables


def triangle_layer(sd, prefix, starting, implementation):
    variables = convert.triangle_from_openfold_state_dict(sd, prefix=prefix)
    layer = convert.triangle_module_from_variables(variables, starting=starting,
                                                   implementation=implementation)
    return layer, variables


def test_fixture_is_a_whole_openfold_block(fx):
    """The converters see OpenFold's real keys, the whole block's, not just their module's."""
    sd, meta = fx["sd"], fx["meta"]
    assert meta["prefixes"] == {"msa_att_row": MSA_ROW, "tri_att_start": TRI_START,
                                "tri_att_end": TRI_END}
    for module in ("msa_att_col", "outer_product_mean", "msa_transition",
                   "pair_stack.tri_mul_out", "pair_stack.tri_mul_in", "pair_stack.pair_transition"):
        assert any(k.startswith(f"evoformer.blocks.0.{module}.") for k in sd), module
    assert "evoformer.linear.weight" in sd
    assert meta["tri_att_end_module_starting"] is True
    # Non-default weights (OpenFold initialises LayerNorms to 1/0, gates to 0/1, outputs to 0).
    for key in (f"{MSA_ROW}.layer_norm_m.weight", f"{MSA_ROW}.mha.linear_o.weight",
                f"{TRI_END}.mha.linear_g.bias", f"{TRI_START}.mha.linear_o.bias"):
        assert np.std(sd[key].astype(np.float64)) > 0.05, key
    for name in ("msa_att_row", "tri_att_start", "tri_att_end", "tri_att_end_module"):
        assert np.all(np.isfinite(fx[name])) and np.std(fx[name]) > 0.1, name
    # The masks hold fully masked rows for the MSA, the starting and the ending node.
    for starting in (None, True, False):
        assert not keeps_a_key(fx, starting).all()


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_msa_row_attention_matches_openfold(fx, implementation):
    layer, variables = msa_layer(fx["sd"], implementation)
    meta = fx["meta"]["block"]
    assert (layer.msa_dim, layer.pair_dim, layer.num_heads, layer.head_dim) == (
        meta["c_m"], meta["c_z"], meta["no_heads_msa"], meta["c_hidden_msa_att"])
    apply = jax.jit(layer.apply)
    out = np.asarray(apply(variables, fx["m"], fx["z"], fx["msa_mask"]))
    keep = keeps_a_key(fx, None)
    assert rel_err(out[keep], fx["msa_att_row"][keep]) < TOL
    # Fully masked rows: uniform weights, as OpenFold's float32 run.
    assert rel_err(out, fx["float32/msa_att_row"]) < TOL
    assert rel_err(out[~keep], fx["msa_att_row"][~keep]) > WRONG
    # OpenFold's float64 run on those rows: the softmax of their unmasked logits.
    unmasked = fx["msa_mask"] | ~keep[..., None]
    out_unmasked = np.asarray(apply(variables, fx["m"], fx["z"], unmasked))
    assert rel_err(out_unmasked[~keep], fx["msa_att_row"][~keep]) < TOL


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", list(TRIANGLE_CASES))
def test_triangle_attention_matches_openfold(fx, case, implementation):
    prefix, starting, name = TRIANGLE_CASES[case]
    layer, variables = triangle_layer(fx["sd"], prefix, starting, implementation)
    meta = fx["meta"]["block"]
    assert (layer.pair_dim, layer.num_heads, layer.resolved_head_dim) == (
        meta["c_z"], meta["no_heads_pair"], meta["c_hidden_pair_att"])
    out = np.asarray(jax.jit(layer.apply)(variables, fx["z"], fx["pair_mask"]))
    keep = keeps_a_key(fx, starting)
    assert rel_err(out[keep], fx[name][keep]) < TOL
    assert rel_err(out[~keep], fx[name][~keep]) > WRONG
    if f"float32/{name}" in fx:
        assert rel_err(out, fx[f"float32/{name}"]) < TOL


def test_ending_node_is_not_the_module_call(fx):
    """starting=False is tri_att_end as PairStack applies it, not `tri_att_end(z, mask)`."""
    assert rel_err(fx["tri_att_end"], fx["tri_att_end_module"]) > 0.1
    layer, variables = triangle_layer(fx["sd"], TRI_END, False, "xla")
    out = np.asarray(jax.jit(layer.apply)(variables, fx["z"], fx["pair_mask"]))
    keep = keeps_a_key(fx, True) & keeps_a_key(fx, False)
    assert rel_err(out[keep], fx["tri_att_end_module"][keep]) > WRONG


def _swap(sd, prefix, a, b):
    sd = dict(sd)
    sd[f"{prefix}.{a}"], sd[f"{prefix}.{b}"] = sd[f"{prefix}.{b}"], sd[f"{prefix}.{a}"]
    return sd


def _heads_transposed(sd, prefix, key, heads):
    """Rows `h * d + c` of `key` [H * d, in] reordered as `c * H + h`."""
    sd = dict(sd)
    w = sd[f"{prefix}.{key}"]
    sd[f"{prefix}.{key}"] = w.reshape(heads, -1, w.shape[-1]).transpose(1, 0, 2).reshape(w.shape)
    return sd


def _transposed(sd, prefix, key):
    """`key`'s transpose read back in its own shape (a converter that forgot `[out, in]`)."""
    sd = dict(sd)
    sd[f"{prefix}.{key}"] = sd[f"{prefix}.{key}"].T.reshape(sd[f"{prefix}.{key}"].shape)
    return sd


@pytest.mark.parametrize("mistake", ["q_k_swapped", "v_heads_transposed", "o_transposed",
                                     "layer_norm_bias_reversed", "ending_as_starting"])
def test_comparison_catches_a_wrong_conversion(fx, mistake):
    """The tolerances above fail a converter that mislays a weight."""
    sd, meta = fx["sd"], fx["meta"]["block"]
    if mistake == "layer_norm_bias_reversed":
        sd = dict(sd)
        sd[f"{MSA_ROW}.layer_norm_m.bias"] = sd[f"{MSA_ROW}.layer_norm_m.bias"][::-1].copy()
        layer, variables = msa_layer(sd, "xla")
        out = layer.apply(variables, fx["m"], fx["z"], fx["msa_mask"])
        keep = keeps_a_key(fx, None)
        assert rel_err(np.asarray(out)[keep], fx["msa_att_row"][keep]) > WRONG
        return
    if mistake == "ending_as_starting":
        prefix, starting, name = TRI_END, True, "tri_att_end"
    else:
        prefix, starting, name = TRI_START, True, "tri_att_start"
        sd = {
            "q_k_swapped": lambda: _swap(sd, prefix, "mha.linear_q.weight", "mha.linear_k.weight"),
            "v_heads_transposed": lambda: _heads_transposed(sd, prefix, "mha.linear_v.weight",
                                                            meta["no_heads_pair"]),
            "o_transposed": lambda: _transposed(sd, prefix, "mha.linear_o.weight"),
        }[mistake]()
    layer, variables = triangle_layer(sd, prefix, starting, "xla")
    out = np.asarray(layer.apply(variables, fx["z"], fx["pair_mask"]))
    keep = keeps_a_key(fx, True) & keeps_a_key(fx, False)
    assert rel_err(out[keep], fx[name][keep]) > WRONG


def test_wrong_prefix_raises_naming_the_key(fx):
    sd, block = fx["sd"], "evoformer.blocks.0"
    with pytest.raises(ValueError, match=r"evoformer\.blocks\.1\.msa_att_row\."):
        convert.from_openfold_state_dict(sd, prefix="evoformer.blocks.1.msa_att_row")
    # A prefix ends at a module boundary.
    with pytest.raises(ValueError, match=r"evoformer\.blocks\.0\.msa_att\."):
        convert.from_openfold_state_dict(sd, prefix=f"{block}.msa_att")
    # The column attention has no pair bias.
    with pytest.raises(ValueError,
                       match=r"missing keys \[.*'layer_norm_z\.weight'.*'linear_z\.weight'"):
        convert.from_openfold_state_dict(sd, prefix=f"{block}.msa_att_col._msa_att")
    # The whole block: every other module's keys are unexpected.
    with pytest.raises(ValueError,
                       match=r"unexpected keys \[.*'msa_att_row\.layer_norm_m\.weight'"):
        convert.from_openfold_state_dict(sd, prefix=block)
    # A triangle module's keys are not a row attention's, and the reverse.
    with pytest.raises(ValueError, match=r"missing keys \[.*'layer_norm_m\.weight'"):
        convert.from_openfold_state_dict(sd, prefix=TRI_START)
    with pytest.raises(ValueError, match=r"missing keys \[.*'linear\.weight'.*"
                                         r"unexpected keys \[.*'linear_z\.weight'"):
        convert.triangle_from_openfold_state_dict(sd, prefix=MSA_ROW)
    with pytest.raises(ValueError, match=r"evoformer\.blocks\.0\.pair_stack\.tri_att\."):
        convert.triangle_from_openfold_state_dict(sd, prefix=f"{block}.pair_stack.tri_att")
    with pytest.raises(ValueError, match=r"unexpected keys \[.*'tri_att_end\.linear\.weight'"):
        convert.triangle_from_openfold_state_dict(sd, prefix=f"{block}.pair_stack")
