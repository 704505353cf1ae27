"""Weight converters into `msa_pallas.triangle.TriangleAttention` variables
(re-exported by `msa_pallas.convert`).

- `triangle_from_openfold_state_dict`: OpenFold's `TriangleAttention`
  (`TriangleAttentionStartingNode` / `EndingNode`, e.g. the keys under
  `evoformer.blocks.0.pair_stack.tri_att_start`).
- `triangle_from_alphafold2_params`: AlphaFold2's Haiku `TriangleAttention`
  (`.../evoformer_iteration/triangle_attention_starting_node/...`).
- `triangle_module_from_variables`: the linen module whose sizes fit them.

Both return linen variables `{"params": {...}}` (the NNX module loads them
with `TriangleAttentionNNX.from_linen` or `load_linen_variables`), infer the
sizes from the weights and raise `ValueError` naming the key for missing or
unexpected keys and inconsistent shapes. Whether a layer is the starting or
the ending node is not in its weights: the caller says it
(`triangle_module_from_variables(variables, starting=...)`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from msa_pallas.triangle import TriangleAttention
from msa_pallas.weight_checks import (
    OPENFOLD_ATTENTION_KEYS, as_param, check_keys, expect_shape, flatten_haiku, openfold_attention,
    strip_prefix, to_numpy, torch_layer_norm, torch_linear,
)

__all__ = [
    "triangle_from_openfold_state_dict",
    "triangle_from_alphafold2_params",
    "triangle_module_from_variables",
]

_AF2_NAMES = (
    "query_norm/scale", "query_norm/offset", "feat_2d_weights",
    "attention/query_w", "attention/key_w", "attention/value_w",
    "attention/gating_w", "attention/gating_b", "attention/output_w", "attention/output_b",
)


def triangle_from_openfold_state_dict(state_dict: Mapping[str, Any], *, prefix: str = "",
                                      dtype=jnp.float32) -> dict:
    """Linen `TriangleAttention` variables from OpenFold's `TriangleAttention.state_dict()`.

    Keys (`prefix` stripped, e.g. `"evoformer.blocks.0.pair_stack.tri_att_start"`):
    `layer_norm.{weight,bias}` `[c]`, `linear.weight` `[H, c]` (the bias
    projection), `mha.linear_{q,k,v}.weight` `[H * c_hidden, c]`,
    `mha.linear_g.{weight,bias}`, `mha.linear_o.weight` `[c, H * c_hidden]`,
    `mha.linear_o.bias` `[c]`. OpenFold scales q by `1/sqrt(c_hidden)` before
    `q.k`, the op scales `q.k`: the same logits.

    Example::

        sd = model.evoformer.blocks[0].pair_stack.tri_att_end.state_dict()
        variables = triangle_from_openfold_state_dict(sd)
        layer = triangle_module_from_variables(variables, starting=False)
        update = layer.apply(variables, z, pair_mask)

    `update` is the ending node's update as OpenFold's `PairStack` computes it:
    it calls `tri_att_end` (built as a starting node) on z and the mask with the
    two residue axes swapped and swaps the result back, so `tri_att_end(z,
    pair_mask)` called directly is `starting=True` on the same variables
    (tests/layers/test_openfold_keys.py checks both).
    """
    what = "OpenFold state_dict of TriangleAttention"
    sd = strip_prefix(state_dict, prefix, what) if prefix else dict(state_dict)
    sd = {k: to_numpy(v, k) for k, v in sd.items()}
    check_keys(sd, ["layer_norm.weight", "layer_norm.bias", "linear.weight",
                    *OPENFOLD_ATTENTION_KEYS], [], what)
    ln = sd["layer_norm.weight"]
    if ln.ndim != 1:
        raise ValueError(f"'layer_norm.weight' has shape {ln.shape}; expected [c_in].")
    c = ln.shape[0]
    wb = sd["linear.weight"]
    if wb.ndim != 2:
        raise ValueError(f"'linear.weight' has shape {wb.shape}; expected [no_heads, c_in].")
    heads = wb.shape[0]
    expect_shape("linear.weight", wb, (heads, c), "[no_heads, c_in]")
    params = {
        "layer_norm": torch_layer_norm(sd, "layer_norm", c, dtype, "[c_in]"),
        "pair_bias": torch_linear(sd, "linear", c, heads, False, dtype, "linear: c_in -> H"),
        **openfold_attention(sd, c, heads, dtype, "c_in"),
    }
    return {"params": params}


def _af2_module_arrays(params: Mapping, prefix: str | None, index: int | None) -> tuple[str, dict]:
    """`(prefix, {name: array})` of one AF2 TriangleAttention, one layer of a stack picked by index."""
    flat = flatten_haiku(params)
    if prefix is None:
        found = sorted(k[: -len("/feat_2d_weights")] for k in flat
                       if k.endswith("/feat_2d_weights") and "triangle_attention" in k)
        if len(found) != 1:
            raise ValueError("triangle_from_alphafold2_params: pass prefix=, the module path; "
                             + (f"several candidates: {found}." if found
                                else "no triangle_attention module found."))
        prefix = found[0]
    prefix = prefix.rstrip("/")
    sub = {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + "/")}
    what = f"AlphaFold2 params under {prefix!r}"
    if not sub:
        raise ValueError(f"{what}: no parameter has this module path.")
    check_keys(sub, _AF2_NAMES, [], what)
    arrays = {k: to_numpy(v, f"{prefix}/{k}") for k, v in sub.items()}
    layers = arrays["query_norm/scale"]
    if layers.ndim == 2:
        if index is None:
            raise ValueError(f"{what} are stacked over {layers.shape[0]} layers (leading axis); "
                             "pass index= to pick one.")
        if not -layers.shape[0] <= index < layers.shape[0]:
            raise ValueError(f"index={index} out of range for {layers.shape[0]} stacked layers.")
        for k, v in arrays.items():
            if v.ndim == 0 or v.shape[0] != layers.shape[0]:
                raise ValueError(f"'{prefix}/{k}' has shape {v.shape}; expected a leading layer "
                                 f"axis of {layers.shape[0]} like query_norm/scale.")
        arrays = {k: v[index] for k, v in arrays.items()}
    elif index is not None:
        raise ValueError(f"index={index} given, but {what} are not stacked "
                         f"(query_norm/scale has shape {layers.shape}).")
    return prefix, arrays


def triangle_from_alphafold2_params(params: Mapping[str, Any], prefix: str | None = None, *,
                                    index: int | None = None, dtype=jnp.float32) -> dict:
    """Linen `TriangleAttention` variables from AlphaFold2's Haiku parameters of one layer.

    Reads, under the module path `prefix`: `query_norm/{scale,offset}` `[c]`,
    `feat_2d_weights` `[c, H]`, `attention/{query_w,key_w,value_w,gating_w}`
    `[c, H, d]`, `attention/gating_b` `[H, d]`, `attention/output_w`
    `[H, d, c]`, `attention/output_b` `[c]`.

    Args:
      params: Haiku params (`{module_path: {name: array}}`, nested, or the flat
        `{"module_path//name": array}` of AlphaFold's `params_*.npz`).
      prefix: the module path, e.g. `"alphafold/alphafold_iteration/evoformer/
        evoformer_iteration/triangle_attention_ending_node"`; None: the only
        path holding a `triangle_attention*` module (an error lists several).
      index: layer of parameters stacked over layers (AF2 stacks the 48
        Evoformer blocks); required when stacked.
      dtype: parameter dtype of the result.

    Example::

        raw = dict(np.load("params_model_1.npz"))
        path = "alphafold/alphafold_iteration/evoformer/evoformer_iteration/"
        variables = triangle_from_alphafold2_params(
            raw, path + "triangle_attention_ending_node", index=0)
        layer = triangle_module_from_variables(variables, starting=False)
    """
    prefix, arrays = _af2_module_arrays(params, prefix, index)
    qw = arrays["attention/query_w"]
    if qw.ndim != 3:
        raise ValueError(f"'{prefix}/attention/query_w' has shape {qw.shape}; expected [c, H, d].")
    c, heads, d = qw.shape
    expected = {
        "query_norm/scale": (c,), "query_norm/offset": (c,), "feat_2d_weights": (c, heads),
        "attention/key_w": (c, heads, d), "attention/value_w": (c, heads, d),
        "attention/gating_w": (c, heads, d), "attention/gating_b": (heads, d),
        "attention/output_w": (heads, d, c), "attention/output_b": (c,),
    }
    for k, shape in expected.items():
        expect_shape(f"{prefix}/{k}", arrays[k], shape, f"c={c}, H={heads}, d={d} from query_w")

    def heads_flat(name):  # [c, H, d] -> Dense kernel [c, H * d], feature h * d + e
        return as_param(arrays[name].reshape(c, heads * d), dtype)

    params_out = {
        "layer_norm": {"scale": as_param(arrays["query_norm/scale"], dtype),
                       "bias": as_param(arrays["query_norm/offset"], dtype)},
        "query": {"kernel": heads_flat("attention/query_w")},
        "key": {"kernel": heads_flat("attention/key_w")},
        "value": {"kernel": heads_flat("attention/value_w")},
        "gate": {"kernel": heads_flat("attention/gating_w"),
                 "bias": as_param(arrays["attention/gating_b"].reshape(heads * d), dtype)},
        "pair_bias": {"kernel": as_param(arrays["feat_2d_weights"], dtype)},
        "out_proj": {"kernel": as_param(arrays["attention/output_w"].reshape(heads * d, c), dtype),
                     "bias": as_param(arrays["attention/output_b"], dtype)},
    }
    return {"params": params_out}


def triangle_module_from_variables(variables: Mapping, *, starting: bool,
                                   **overrides) -> TriangleAttention:
    """The linen `TriangleAttention` whose sizes fit `variables`; `overrides` set any
    other field (e.g. `implementation="xla"`, `dtype=jnp.bfloat16`)."""
    params = variables.get("params", variables)
    try:
        pair_dim, heads = (int(s) for s in np.shape(params["pair_bias"]["kernel"]))
        inner = int(np.shape(params["query"]["kernel"])[1])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError("variables do not look like TriangleAttention params (need "
                         "pair_bias/kernel [c, H] and query/kernel [c, H * d]).") from err
    return TriangleAttention(pair_dim=pair_dim, num_heads=heads, head_dim=inner // heads,
                             starting=starting, **overrides)
