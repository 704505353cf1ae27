"""Reading weight dictionaries for the converters (`msa_pallas.convert`,
`msa_pallas.convert_triangle`): arrays from torch, JAX or NumPy, errors that
name the key, and torch Linear / LayerNorm weights as Flax params."""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

__all__ = [
    "to_numpy", "as_param", "check_keys", "expect_shape", "strip_prefix", "flatten_haiku",
    "torch_linear", "torch_layer_norm", "OPENFOLD_ATTENTION_KEYS", "openfold_attention",
]


def to_numpy(value, key: str) -> np.ndarray:
    """A torch tensor (any device, bf16 included), JAX or NumPy array -> NumPy."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        value = value.numpy()
    try:
        array = np.asarray(value)
    except Exception as err:  # pragma: no cover - depends on exotic inputs
        raise TypeError(f"{key!r}: cannot convert {type(value).__name__} to an array.") from err
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
        raise TypeError(f"{key!r} has dtype {array.dtype}; expected a floating array.")
    return array


def as_param(array: np.ndarray, dtype) -> jnp.ndarray:
    """A parameter of `dtype` from a NumPy array."""
    return jnp.asarray(np.asarray(array), dtype=dtype)


def check_keys(got, required, optional, what: str) -> None:
    """ValueError listing the missing and the unexpected keys of `what`."""
    got = set(got)
    missing = sorted(set(required) - got)
    unexpected = sorted(got - set(required) - set(optional))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        raise ValueError(f"{what}: " + "; ".join(parts) + ".")


def expect_shape(key: str, array: np.ndarray, shape: tuple, meaning: str) -> None:
    """ValueError naming `key` when `array` does not have `shape`."""
    if tuple(array.shape) != tuple(shape):
        raise ValueError(
            f"{key!r} has shape {tuple(array.shape)}; expected {tuple(shape)} ({meaning})."
        )


def strip_prefix(state_dict: Mapping, prefix: str, what: str) -> dict:
    """The entries whose key starts with `prefix` (a dotted module path), prefix removed."""
    if prefix and not prefix.endswith("."):
        prefix += "."
    out = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out:
        raise ValueError(f"{what}: no key starts with prefix {prefix!r}.")
    return out


def flatten_haiku(params: Mapping, parent: str = "") -> dict[str, Any]:
    """`{"a/b": {"w": x}}`, `{"a": {"b": {"w": x}}}` or `{"a/b//w": x}` -> `{"a/b/w": x}`."""
    flat = {}
    for key, value in params.items():
        key = str(key).replace("//", "/")
        path = f"{parent}/{key}" if parent else key
        if isinstance(value, Mapping):
            flat.update(flatten_haiku(value, path))
        else:
            flat[path] = value
    return flat


def torch_linear(sd: dict, name: str, n_in: int, n_out: int, bias: bool | None, dtype, what: str):
    """Flax Dense params from torch `name.weight [out, in]` (+ `name.bias [out]`)."""
    w = sd[f"{name}.weight"]
    expect_shape(f"{name}.weight", w, (n_out, n_in), f"[out, in] of {what}")
    params = {"kernel": as_param(w.T, dtype)}
    if bias is None:
        bias = f"{name}.bias" in sd
    if bias:
        b = sd[f"{name}.bias"]
        expect_shape(f"{name}.bias", b, (n_out,), f"[out] of {what}")
        params["bias"] = as_param(b, dtype)
    return params


def torch_layer_norm(sd: dict, name: str, n: int, dtype, what: str):
    """Flax LayerNorm params from torch `name.weight [n]` and `name.bias [n]`."""
    w, b = sd[f"{name}.weight"], sd[f"{name}.bias"]
    expect_shape(f"{name}.weight", w, (n,), what)
    expect_shape(f"{name}.bias", b, (n,), what)
    return {"scale": as_param(w, dtype), "bias": as_param(b, dtype)}


# The keys of OpenFold's `Attention` (its `mha` submodule) in a layer's state dict.
OPENFOLD_ATTENTION_KEYS = (
    "mha.linear_q.weight", "mha.linear_k.weight", "mha.linear_v.weight",
    "mha.linear_g.weight", "mha.linear_g.bias", "mha.linear_o.weight", "mha.linear_o.bias",
)


def openfold_attention(sd: dict, c_in: int, num_heads: int, dtype, c_in_name: str) -> dict:
    """Flax params `query`, `key`, `value`, `gate`, `out_proj` from OpenFold's `Attention`
    keys (OPENFOLD_ATTENTION_KEYS): `linear_{q,k,v}.weight [H * c_hidden, c_in]` without
    bias, `linear_g` `[H * c_hidden, c_in]` with bias, `linear_o` `[c_in, H * c_hidden]`
    with bias; c_hidden is inferred. `c_in_name` names c_in in errors (`c_m`, `c_in`)."""
    wq = sd["mha.linear_q.weight"]
    if wq.ndim != 2 or wq.shape[0] % num_heads:
        raise ValueError(f"'mha.linear_q.weight' has shape {wq.shape}; expected "
                         f"[no_heads * c_hidden, {c_in_name}] with no_heads={num_heads}.")
    inner = wq.shape[0]
    into = f"{c_in_name} -> H*c_hidden"
    return {
        "query": torch_linear(sd, "mha.linear_q", c_in, inner, False, dtype, f"linear_q: {into}"),
        "key": torch_linear(sd, "mha.linear_k", c_in, inner, False, dtype, f"linear_k: {into}"),
        "value": torch_linear(sd, "mha.linear_v", c_in, inner, False, dtype, f"linear_v: {into}"),
        "gate": torch_linear(sd, "mha.linear_g", c_in, inner, True, dtype, f"linear_g: {into}"),
        "out_proj": torch_linear(sd, "mha.linear_o", inner, c_in, True, dtype,
                                 f"linear_o: H*c_hidden -> {c_in_name}"),
    }
