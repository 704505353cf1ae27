"""Weight converters into `msa_pallas.MSARowAttentionWithPairBias` variables.

- `from_torch_state_dict`: the PyTorch reference layer (`tests/fixtures/torch_reference.py`).
- `from_openfold_state_dict`: OpenFold's `MSARowAttentionWithPairBias`.
- `from_alphafold2_params`: AlphaFold2's Haiku parameters (`msa_row_attention_with_pair_bias`).
- `triangle_from_openfold_state_dict`, `triangle_from_alphafold2_params`,
  `triangle_module_from_variables`: the same for `msa_pallas.triangle.TriangleAttention`
  (defined in `msa_pallas.convert_triangle`).

Each returns linen variables `{"params": {...}}`, infers the sizes from the
weights, and raises `ValueError` naming the key for missing or unexpected
keys and inconsistent shapes. `module_from_variables` builds the matching
linen layer, `to_nnx` the matching NNX layer.

PyTorch `nn.Linear.weight` is `[out, in]`; a Flax `Dense` kernel is `[in, out]`
(transposed here). Heads are laid out as PyTorch's `.view(..., H, d)`: feature
`h * d + c`, which is also the row-major flattening of AlphaFold's `[c_m, H, d]`.

Example::

    import torch, msa_pallas
    torch_layer = MSARowAttentionWithPairBias(64, 64, 4)      # the reference layer
    variables = msa_pallas.convert.from_torch_state_dict(torch_layer.state_dict())
    layer = msa_pallas.convert.module_from_variables(variables)
    out = layer.apply(variables, msa_repr, pair_repr, msa_mask)
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from msa_pallas.layer_core import alphafold2_options
from msa_pallas.layers import MSARowAttentionWithPairBias
from msa_pallas.weight_checks import (
    OPENFOLD_ATTENTION_KEYS, as_param, check_keys, expect_shape, flatten_haiku, openfold_attention,
    strip_prefix, to_numpy, torch_layer_norm, torch_linear,
)
from msa_pallas.convert_triangle import (  # noqa: F401  (re-exported)
    triangle_from_alphafold2_params, triangle_from_openfold_state_dict,
    triangle_module_from_variables,
)

__all__ = [
    "from_torch_state_dict",
    "from_openfold_state_dict",
    "from_alphafold2_params",
    "module_from_variables",
    "to_nnx",
    "DEFAULT_ALPHAFOLD2_MODULE",
    "triangle_from_openfold_state_dict",
    "triangle_from_alphafold2_params",
    "triangle_module_from_variables",
]

# The Evoformer's row attention in AlphaFold2's parameter files; the extra-MSA
# stack's is ".../evoformer/extra_msa_stack/msa_row_attention_with_pair_bias".
DEFAULT_ALPHAFOLD2_MODULE = "msa_row_attention_with_pair_bias"


def from_torch_state_dict(state_dict: Mapping[str, Any], *, prefix: str = "",
                          dtype=jnp.float32) -> dict:
    """Linen variables from the PyTorch reference layer's `state_dict()`.

    Keys (`prefix` stripped): `layer_norm.{weight,bias}`, `{query,key,value,gate,
    out_proj}.{weight,bias}`, `pair_bias.{weight,bias}`. Optional: the q/k/v
    biases (all three or none; absent -> `qkv_bias=False`), `pair_bias.bias`,
    and `pair_layer_norm.{weight,bias}` (a variant with a pair LayerNorm).
    Sizes are inferred: msa_dim from `layer_norm.weight`, num_heads and
    pair_dim from `pair_bias.weight [H, pair_dim]`, head_dim from `query.weight`.

    Args:
      state_dict: values are torch tensors (any device/dtype) or NumPy arrays.
      prefix: a key prefix to select and strip, e.g. `"blocks.0.row_attn"`.
      dtype: parameter dtype of the result (float32).

    Returns:
      `{"params": {...}}` for `module_from_variables(variables)`, i.e.
      `MSARowAttentionWithPairBias(msa_dim, pair_dim, num_heads)`.

    Example::

        torch_layer = MSARowAttentionWithPairBias(64, 64, 4).eval()   # PyTorch
        variables = from_torch_state_dict(torch_layer.state_dict())
        layer = module_from_variables(variables)                       # Flax
        out = layer.apply(variables, m, z, mask)      # == torch_layer(m, z, mask)
    """
    what = "torch state_dict of MSARowAttentionWithPairBias"
    sd = strip_prefix(state_dict, prefix, what) if prefix else dict(state_dict)
    sd = {k: to_numpy(v, k) for k, v in sd.items()}
    required = ["layer_norm.weight", "layer_norm.bias", "pair_bias.weight"]
    required += [f"{n}.weight" for n in ("query", "key", "value", "gate", "out_proj")]
    required += ["gate.bias", "out_proj.bias"]
    optional = ["query.bias", "key.bias", "value.bias", "pair_bias.bias",
                "pair_layer_norm.weight", "pair_layer_norm.bias"]
    check_keys(sd, required, optional, what)
    qkv_biases = [f"{n}.bias" in sd for n in ("query", "key", "value")]
    if len(set(qkv_biases)) != 1:
        raise ValueError(f"{what}: query/key/value biases must be all present or all absent; "
                         f"got {dict(zip(('query.bias', 'key.bias', 'value.bias'), qkv_biases))}.")
    if ("pair_layer_norm.weight" in sd) != ("pair_layer_norm.bias" in sd):
        raise ValueError(f"{what}: pair_layer_norm needs both .weight and .bias.")

    ln = sd["layer_norm.weight"]
    if ln.ndim != 1:
        raise ValueError(f"'layer_norm.weight' has shape {ln.shape}; expected [msa_dim].")
    msa_dim = ln.shape[0]
    pw = sd["pair_bias.weight"]
    if pw.ndim != 2:
        raise ValueError(f"'pair_bias.weight' has shape {pw.shape}; expected [num_heads, pair_dim].")
    num_heads, pair_dim = pw.shape
    qw = sd["query.weight"]
    if qw.ndim != 2 or qw.shape[0] % num_heads:
        raise ValueError(
            f"'query.weight' has shape {qw.shape}; expected [num_heads * head_dim, msa_dim] "
            f"with num_heads={num_heads} (from pair_bias.weight)."
        )
    inner = qw.shape[0]

    params = {"layer_norm": torch_layer_norm(sd, "layer_norm", msa_dim, dtype, "[msa_dim]")}
    for name in ("query", "key", "value"):
        params[name] = torch_linear(sd, name, msa_dim, inner, qkv_biases[0], dtype,
                               f"{name}: msa_dim -> num_heads*head_dim")
    params["gate"] = torch_linear(sd, "gate", msa_dim, inner, True, dtype,
                             "gate: msa_dim -> num_heads*head_dim")
    if "pair_layer_norm.weight" in sd:
        params["pair_layer_norm"] = torch_layer_norm(sd, "pair_layer_norm", pair_dim, dtype, "[pair_dim]")
    params["pair_bias"] = torch_linear(sd, "pair_bias", pair_dim, num_heads, None, dtype,
                                  "pair_bias: pair_dim -> num_heads")
    params["out_proj"] = torch_linear(sd, "out_proj", inner, msa_dim, True, dtype,
                                 "out_proj: num_heads*head_dim -> msa_dim")
    return {"params": params}


def from_openfold_state_dict(state_dict: Mapping[str, Any], *, prefix: str = "",
                             dtype=jnp.float32) -> dict:
    """Linen variables from OpenFold's `MSARowAttentionWithPairBias.state_dict()`.

    Keys (`prefix` stripped, e.g. `"evoformer.blocks.0.msa_att_row"`):
    `layer_norm_m.{weight,bias}`, `layer_norm_z.{weight,bias}`, `linear_z.weight`
    `[H, c_z]`, `mha.linear_{q,k,v}.weight` `[H*c_hidden, c_m]`,
    `mha.linear_g.{weight,bias}`, `mha.linear_o.{weight,bias}`. OpenFold scales
    q by `1/sqrt(c_hidden)` before `q.k`, the op scales `q.k` by the same
    factor: same maths. Sizes (c_m, c_z, H, c_hidden) are inferred.

    Returns:
      `{"params": {...}}` for `module_from_variables(variables, preset="alphafold2")`,
      i.e. `MSARowAttentionWithPairBias.alphafold2(c_m, c_z, H, head_dim=c_hidden)`.

    Example::

        sd = openfold_model.evoformer.blocks[0].msa_att_row.state_dict()
        variables = from_openfold_state_dict(sd)
        layer = module_from_variables(variables, preset="alphafold2")
        out = layer.apply(variables, m, z, mask)   # == msa_att_row(m, z, mask)
    """
    what = "OpenFold state_dict of MSARowAttentionWithPairBias"
    sd = strip_prefix(state_dict, prefix, what) if prefix else dict(state_dict)
    sd = {k: to_numpy(v, k) for k, v in sd.items()}
    required = ["layer_norm_m.weight", "layer_norm_m.bias", "layer_norm_z.weight",
                "layer_norm_z.bias", "linear_z.weight", *OPENFOLD_ATTENTION_KEYS]
    check_keys(sd, required, [], what)
    ln_m, ln_z = sd["layer_norm_m.weight"], sd["layer_norm_z.weight"]
    if ln_m.ndim != 1 or ln_z.ndim != 1:
        raise ValueError(f"{what}: layer_norm_m.weight / layer_norm_z.weight must be 1-D; "
                         f"got {ln_m.shape} / {ln_z.shape}.")
    c_m, c_z = ln_m.shape[0], ln_z.shape[0]
    wz = sd["linear_z.weight"]
    if wz.ndim != 2:
        raise ValueError(f"'linear_z.weight' has shape {wz.shape}; expected [no_heads, c_z].")
    num_heads = wz.shape[0]
    expect_shape("linear_z.weight", wz, (num_heads, c_z), "[no_heads, c_z]")
    params = {
        "layer_norm": torch_layer_norm(sd, "layer_norm_m", c_m, dtype, "[c_m]"),
        "pair_layer_norm": torch_layer_norm(sd, "layer_norm_z", c_z, dtype, "[c_z]"),
        "pair_bias": torch_linear(sd, "linear_z", c_z, num_heads, False, dtype, "linear_z: c_z -> H"),
        **openfold_attention(sd, c_m, num_heads, dtype, "c_m"),
    }
    return {"params": params}


def from_alphafold2_params(params: Mapping[str, Any], prefix: str | None = None, *,
                           index: int | None = None, dtype=jnp.float32) -> dict:
    """Linen variables from AlphaFold2's Haiku parameters of one row-attention layer.

    Reads, under the module path `prefix`: `query_norm/{scale,offset}`,
    `feat_2d_norm/{scale,offset}`, `feat_2d_weights [c_z, H]`,
    `attention/{query_w,key_w,value_w} [c_m, H, d]`, `attention/gating_w
    [c_m, H, d]`, `attention/gating_b [H, d]`, `attention/output_w [H, d, c_m]`,
    `attention/output_b [c_m]`.

    Args:
      params: Haiku params `{module_path: {name: array}}`, a nested dict, or
        the flat `{"module_path//name": array}` of AlphaFold's `params_*.npz`
        (`dict(np.load(path))`).
      prefix: module path of the layer, e.g.
        `"alphafold/alphafold_iteration/evoformer/evoformer_iteration/msa_row_attention_with_pair_bias"`.
        None: the unique module path ending in `msa_row_attention_with_pair_bias`
        (an error lists them when there are several, e.g. the Evoformer's and
        the extra-MSA stack's).
      index: layer index for parameters stacked over layers (AlphaFold stacks
        the 48 Evoformer blocks on a leading axis); required when stacked.
      dtype: parameter dtype of the result.

    Returns:
      `{"params": {...}}` for `module_from_variables(variables, preset="alphafold2")`.

    Example::

        raw = dict(np.load("params_model_1.npz"))
        variables = from_alphafold2_params(
            raw, "alphafold/alphafold_iteration/evoformer/evoformer_iteration/"
                 "msa_row_attention_with_pair_bias", index=0)
        layer = module_from_variables(variables, preset="alphafold2")   # c_m=256, c_z=128, H=8
    """
    flat = flatten_haiku(params)
    if prefix is None:
        suffix = DEFAULT_ALPHAFOLD2_MODULE + "/feat_2d_weights"
        found = sorted(k[: -len("/feat_2d_weights")] for k in flat
                       if k == suffix or k.endswith("/" + suffix))
        if len(found) != 1:
            raise ValueError(
                "from_alphafold2_params: pass prefix=, the module path of the layer; "
                + (f"several candidates: {found}." if found
                   else f"no parameter path ends in {suffix!r}.")
            )
        prefix = found[0]
    prefix = prefix.rstrip("/")
    names = {
        "query_norm/scale", "query_norm/offset", "feat_2d_norm/scale", "feat_2d_norm/offset",
        "feat_2d_weights", "attention/query_w", "attention/key_w", "attention/value_w",
        "attention/gating_w", "attention/gating_b", "attention/output_w", "attention/output_b",
    }
    sub = {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + "/")}
    what = f"AlphaFold2 params under {prefix!r}"
    if not sub:
        raise ValueError(f"{what}: no parameter has this module path.")
    check_keys(sub, names, [], what)
    arrays = {k: to_numpy(v, f"{prefix}/{k}") for k, v in sub.items()}

    stacked = arrays["query_norm/scale"].ndim == 2
    if stacked:
        if index is None:
            raise ValueError(
                f"{what} are stacked over {arrays['query_norm/scale'].shape[0]} layers "
                "(leading axis); pass index= to pick one."
            )
        n_layers = arrays["query_norm/scale"].shape[0]
        if not -n_layers <= index < n_layers:
            raise ValueError(f"index={index} out of range for {n_layers} stacked layers.")
        for k, v in arrays.items():
            if v.ndim == 0 or v.shape[0] != n_layers:
                raise ValueError(f"'{prefix}/{k}' has shape {v.shape}; expected a leading "
                                 f"layer axis of {n_layers} like query_norm/scale.")
        arrays = {k: v[index] for k, v in arrays.items()}
    elif index is not None:
        raise ValueError(f"index={index} given, but {what} are not stacked "
                         f"(query_norm/scale has shape {arrays['query_norm/scale'].shape}).")

    qw = arrays["attention/query_w"]
    if qw.ndim != 3:
        raise ValueError(f"'{prefix}/attention/query_w' has shape {qw.shape}; expected [c_m, H, d].")
    c_m, heads, d = qw.shape
    w2d = arrays["feat_2d_weights"]
    if w2d.ndim != 2 or w2d.shape[1] != heads:
        raise ValueError(f"'{prefix}/feat_2d_weights' has shape {w2d.shape}; expected "
                         f"[c_z, H={heads}].")
    c_z = w2d.shape[0]
    expected = {
        "query_norm/scale": (c_m,), "query_norm/offset": (c_m,),
        "feat_2d_norm/scale": (c_z,), "feat_2d_norm/offset": (c_z,),
        "attention/key_w": (c_m, heads, d), "attention/value_w": (c_m, heads, d),
        "attention/gating_w": (c_m, heads, d), "attention/gating_b": (heads, d),
        "attention/output_w": (heads, d, c_m), "attention/output_b": (c_m,),
    }
    for k, shape in expected.items():
        expect_shape(f"{prefix}/{k}", arrays[k], shape,
                f"c_m={c_m}, H={heads}, d={d} from query_w, c_z={c_z} from feat_2d_weights")

    def flat_heads(name):  # [c_m, H, d] -> Dense kernel [c_m, H*d]
        return as_param(arrays[name].reshape(c_m, heads * d), dtype)

    params = {
        "layer_norm": {"scale": as_param(arrays["query_norm/scale"], dtype),
                       "bias": as_param(arrays["query_norm/offset"], dtype)},
        "pair_layer_norm": {"scale": as_param(arrays["feat_2d_norm/scale"], dtype),
                            "bias": as_param(arrays["feat_2d_norm/offset"], dtype)},
        "pair_bias": {"kernel": as_param(w2d, dtype)},
        "query": {"kernel": flat_heads("attention/query_w")},
        "key": {"kernel": flat_heads("attention/key_w")},
        "value": {"kernel": flat_heads("attention/value_w")},
        "gate": {"kernel": flat_heads("attention/gating_w"),
                 "bias": as_param(arrays["attention/gating_b"].reshape(heads * d), dtype)},
        "out_proj": {"kernel": as_param(arrays["attention/output_w"].reshape(heads * d, c_m), dtype),
                     "bias": as_param(arrays["attention/output_b"], dtype)},
    }
    return {"params": params}


def module_from_variables(variables: Mapping, *, preset: str = "reference",
                          **overrides) -> MSARowAttentionWithPairBias:
    """The linen layer whose structure fits `variables` (as the converters return).

    Sizes (msa_dim, pair_dim, num_heads, head_dim) and structural flags
    (`qkv_bias`, `pair_bias_bias`, `pair_layer_norm`) come from the weights;
    `preset` sets the rest: `"reference"` (the PyTorch layer's defaults:
    attention dropout) or `"alphafold2"` (AF2/OpenFold: output dropout 0.15
    shared across rows, AF2 gating/output init). `overrides` set any field,
    e.g. `implementation="xla"`, `dtype=jnp.bfloat16`, `dropout=0.0`.
    """
    params = variables.get("params", variables)
    try:
        msa_dim = int(np.shape(params["layer_norm"]["scale"])[0])
        pair_dim, num_heads = (int(s) for s in np.shape(params["pair_bias"]["kernel"]))
        inner = int(np.shape(params["query"]["kernel"])[1])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            "variables do not look like MSARowAttentionWithPairBias params (need "
            "layer_norm/scale, pair_bias/kernel, query/kernel)."
        ) from err
    if preset == "reference":
        options = {}
    elif preset == "alphafold2":
        options = alphafold2_options()
    else:
        raise ValueError(f"preset={preset!r}; expected 'reference' or 'alphafold2'.")
    options.update(
        head_dim=inner // num_heads,
        qkv_bias="bias" in params["query"],
        pair_bias_bias="bias" in params["pair_bias"],
        pair_layer_norm="pair_layer_norm" in params,
    )
    options.update(overrides)
    return MSARowAttentionWithPairBias(msa_dim=msa_dim, pair_dim=pair_dim,
                                       num_heads=num_heads, **options)


def to_nnx(variables: Mapping, module: MSARowAttentionWithPairBias | None = None, *,
           preset: str = "reference", rngs=None, **overrides):
    """An NNX layer (`MSARowAttentionWithPairBiasNNX`) holding `variables`' weights.

    `module` (a linen layer) gives the configuration; without it,
    `module_from_variables(variables, preset=preset)` does.

    Example::

        nnx_layer = to_nnx(from_torch_state_dict(sd))
        out = nnx_layer(m, z, mask, deterministic=True)
    """
    from msa_pallas.nnx_layers import MSARowAttentionWithPairBiasNNX

    if module is None:
        module = module_from_variables(variables, preset=preset)
    return MSARowAttentionWithPairBiasNNX.from_linen(module, variables, rngs=rngs, **overrides)
