"""The PyTorch reference layer's maths (tests/fixtures/torch_reference.py) in NumPy float64.

Independent of msa_pallas: written from the PyTorch layer, so the Flax layers
can be checked without torch and without the converters. Weights are given
as Linear maps `(W [in, out], b [out] or None)`; `from_torch_state_dict`
reads a PyTorch `state_dict` (`nn.Linear.weight` is `[out, in]`) and
`from_flax_params` reads the Flax layers' parameters (`kernel [in, out]`).

Beyond the PyTorch layer, an optional pair LayerNorm (`pair_layer_norm`,
before the pair projection, as AlphaFold2's `feat_2d_norm`) and a missing
q/k/v or pair-projection bias are supported, as the Flax layer's options.

    x = LayerNorm(msa)                            eps 1e-5
    q, k, v = query(x), key(x), value(x)          -> [B, S, H, N, d]
    g = sigmoid(gate(x))
    bias[b, h, i, j] = pair_bias(LN?(pair))[b, i, j, h]     (i query, j key)
    logits = q.k / sqrt(d) + bias;  logits = -1e9 where mask[b, s, j] == 0
    out = out_proj(g * softmax(logits) @ v)
"""

from __future__ import annotations

import numpy as np

LINEAR_NAMES = ("query", "key", "value", "gate", "pair_bias", "out_proj")


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def layer_norm(x, scale, offset, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + offset


def from_torch_state_dict(sd) -> dict:
    """`{name: (W [in, out], b)}` and `{"layer_norm": (scale, offset), ...}` from torch keys."""
    weights = {}
    for name in LINEAR_NAMES:
        weights[name] = (_f64(sd[f"{name}.weight"]).T, _f64(sd.get(f"{name}.bias")))
    for name in ("layer_norm", "pair_layer_norm"):
        if f"{name}.weight" in sd:
            weights[name] = (_f64(sd[f"{name}.weight"]), _f64(sd[f"{name}.bias"]))
    return weights


def from_flax_params(params) -> dict:
    """The same from the Flax layers' `params` (linen names; NNX's are the same)."""
    weights = {}
    for name in LINEAR_NAMES:
        p = params[name]
        weights[name] = (_f64(p["kernel"]), _f64(p.get("bias")))
    for name in ("layer_norm", "pair_layer_norm"):
        if name in params:
            weights[name] = (_f64(params[name]["scale"]), _f64(params[name]["bias"]))
    return weights


def _linear(x, wb):
    w, b = wb
    y = x @ w
    return y if b is None else y + b


def pair_bias(weights, pair):
    """`[B, H, N_i, N_j]`: the pair projection, heads moved before the two residue axes."""
    z = _f64(pair)
    if "pair_layer_norm" in weights:
        z = layer_norm(z, *weights["pair_layer_norm"])
    return np.moveaxis(_linear(z, weights["pair_bias"]), -1, -3)


def reference_layer(weights, msa, pair, mask, num_heads: int, *, transpose_bias: bool = False):
    """The layer's output `[B, S, N, msa_dim]` in float64.

    Args:
      weights: from `from_torch_state_dict` or `from_flax_params`.
      msa: `[B, S, N, msa_dim]`; pair: `[B, N, N, pair_dim]`; mask: `[B, S, N]`
        (nonzero keeps a key) or None.
      transpose_bias: use `bias[h, j, i]` in place of `bias[h, i, j]` (a wrong
        layer, to show that a test tells the two apart).
    """
    msa = _f64(msa)
    batch, rows, n_res, _ = msa.shape
    x = layer_norm(msa, *weights["layer_norm"])

    def heads(y):  # [B, S, N, H*d] -> [B, S, H, N, d]
        return y.reshape(batch, rows, n_res, num_heads, -1).transpose(0, 1, 3, 2, 4)

    q, k, v = (heads(_linear(x, weights[name])) for name in ("query", "key", "value"))
    g = 1.0 / (1.0 + np.exp(-heads(_linear(x, weights["gate"]))))
    bias = pair_bias(weights, pair)
    if transpose_bias:
        bias = np.swapaxes(bias, -1, -2)
    logits = np.einsum("bshid,bshjd->bshij", q, k) / np.sqrt(q.shape[-1]) + bias[:, None]
    if mask is not None:
        keep = np.asarray(mask) != 0
        logits = np.where(keep[:, :, None, None, :], logits, -1e9)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    o = g * np.einsum("bshij,bshjd->bshid", p, v)
    o = o.transpose(0, 1, 3, 2, 4).reshape(batch, rows, n_res, -1)
    return _linear(o, weights["out_proj"])


def random_torch_state_dict(rng, msa_dim, pair_dim, heads, head_dim=None, *,
                            pair_layer_norm=False, qkv_bias=True) -> dict[str, np.ndarray]:
    """Random non-default weights in the PyTorch layer's `state_dict` layout (float32).

    q and k are scaled up and the pair projection more so, so that the logits
    and the (non-symmetric) pair bias both shape the attention. The pair
    LayerNorm's scale is ~1 and its offset ~0.5: different, so swapping them
    changes the output.
    """
    inner = heads * (head_dim or msa_dim // heads)
    gains = {"query": 2.0, "key": 2.0, "value": 1.0, "gate": 1.0, "pair_bias": 3.0, "out_proj": 1.0}
    shapes = {"query": (inner, msa_dim), "key": (inner, msa_dim), "value": (inner, msa_dim),
              "gate": (inner, msa_dim), "pair_bias": (heads, pair_dim), "out_proj": (msa_dim, inner)}
    sd = {}
    for name, (n_out, n_in) in shapes.items():
        bound = 1.0 / np.sqrt(n_in)
        sd[f"{name}.weight"] = gains[name] * rng.uniform(-bound, bound, (n_out, n_in))
        if qkv_bias or name not in ("query", "key", "value"):
            sd[f"{name}.bias"] = rng.uniform(-bound, bound, n_out)
    sd["layer_norm.weight"] = 1.0 + 0.3 * rng.standard_normal(msa_dim)
    sd["layer_norm.bias"] = 0.2 * rng.standard_normal(msa_dim)
    if pair_layer_norm:
        sd["pair_layer_norm.weight"] = 1.0 + 0.4 * rng.standard_normal(pair_dim)
        sd["pair_layer_norm.bias"] = 0.5 + 0.3 * rng.standard_normal(pair_dim)
    return {k: v.astype(np.float32) for k, v in sd.items()}


def random_layer_inputs(rng, batch, rows, n_res, msa_dim, pair_dim):
    """msa, pair (non-symmetric), and a mask with a fully and a partly masked row."""
    msa = rng.standard_normal((batch, rows, n_res, msa_dim)) + rng.standard_normal((batch, rows, n_res, 1))
    pair = rng.standard_normal((batch, n_res, n_res, pair_dim))
    mask = rng.random((batch, rows, n_res)) > 0.2
    mask[..., 0] = True
    if rows > 2:
        mask[0, 1] = False                    # every key masked: uniform weights
        mask[0, 2, : n_res // 2] = False      # half the keys masked
        mask[0, 2, -1] = True
    return msa.astype(np.float32), pair.astype(np.float32), mask
