"""AlphaFold2's MSA row attention (Algorithm 7 of the AF2 supplement) in NumPy float64.

Independent of msa_pallas: written from AlphaFold2's `modules.py`
(`MSARowAttentionWithPairBias` and `Attention`), used by `tests/layers/test_convert.py`
(the Flax layer fed AF2 / OpenFold weights) and `tests/layers/test_haiku.py` (the Haiku
module). Parameters use AF2's names without the module prefix
(`"query_norm/scale"`, `"attention/query_w"`, ...).

Mask conventions (`mask_mode`):
- `"additive"`: `logits + 1e9 * (mask - 1)`, AlphaFold2 v2.0-v2.3 and
  OpenFold, evaluated in float64. A fully masked row keeps its softmax over
  `q.k + pair bias` (the shift cancels).
- `"additive_float32"`: the same sum rounded to float32, as those AF2
  releases compute it. The float32 spacing at 1e9 is 64, so `-1e9 + x` is
  exactly `-1e9` for |x| < 32: a fully masked row gets uniform weights.
- `"replace"`: `where(mask, logits, -1e9)`, AlphaFold2's current `Attention`
  (`jnp.where(mask, logits, _SOFTMAX_MASK)`) and msa_pallas's op:
  a fully masked row gets uniform weights.
All three agree whenever a row keeps at least one key.
"""

from __future__ import annotations

import numpy as np


def layer_norm(x, scale, offset, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + offset


def af2_row_attention(m, z, mask, p, mask_mode="additive"):
    """MSA row-wise gated self-attention with pair bias (AF2 Algorithm 7), float64.

    Args:
      m: [*, S, N, c_m]; z: [*, N, N, c_z]; mask: [*, S, N] (1 keeps a key).
      p: AF2 names without the module prefix ("query_norm/scale", ...).
      mask_mode: "additive" is AlphaFold2 v2.0-v2.3's / OpenFold's
        `logits + 1e9 * (mask - 1)` in float64; "additive_float32" is that sum
        rounded to float32 (as those releases compute it); "replace" is
        `where(mask, logits, -1e9)` (AlphaFold2's current `Attention`,
        the op). They agree whenever a row keeps at least one key (see the
        module docstring for a fully masked row).
    """
    if mask_mode not in ("additive", "additive_float32", "replace"):
        raise ValueError(f"mask_mode={mask_mode!r}")
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    m = layer_norm(np.asarray(m, np.float64), f["query_norm/scale"], f["query_norm/offset"])
    z = layer_norm(np.asarray(z, np.float64), f["feat_2d_norm/scale"], f["feat_2d_norm/offset"])
    mask = np.asarray(mask, np.float64)
    d = f["attention/query_w"].shape[-1]
    bias = np.einsum("...qkc,ch->...hqk", z, f["feat_2d_weights"])           # [*, H, N, N]
    q = np.einsum("...sqa,ahc->...sqhc", m, f["attention/query_w"]) * d ** -0.5
    k = np.einsum("...ska,ahc->...skhc", m, f["attention/key_w"])
    v = np.einsum("...ska,ahc->...skhc", m, f["attention/value_w"])
    logits = np.einsum("...sqhc,...skhc->...shqk", q, k) + bias[..., None, :, :, :]
    key_mask = mask[..., :, None, None, :]                                  # [*, S, 1, 1, N]
    if mask_mode == "additive":
        logits = logits + 1e9 * (key_mask - 1.0)
    elif mask_mode == "additive_float32":
        mask_bias = np.float32(1e9) * (key_mask.astype(np.float32) - np.float32(1.0))
        logits = (logits.astype(np.float32) + mask_bias).astype(np.float64)
    else:
        logits = np.where(key_mask > 0, logits, -1e9)
    logits = logits - logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(-1, keepdims=True)
    o = np.einsum("...shqk,...skhc->...sqhc", weights, v)
    gate = np.einsum("...sqa,ahc->...sqhc", m, f["attention/gating_w"]) + f["attention/gating_b"]
    o = o / (1.0 + np.exp(-gate))
    return np.einsum("...sqhc,hco->...sqo", o, f["attention/output_w"]) + f["attention/output_b"]


def random_af2_params(rng, c_m, c_z, heads, d) -> dict[str, np.ndarray]:
    """Random, non-zero AF2-format weights (AF2 would init gating_w/output_w to 0)."""
    def normal(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    return {
        "query_norm/scale": normal((c_m,), 0.2, 1.0), "query_norm/offset": normal((c_m,), 0.2),
        "feat_2d_norm/scale": normal((c_z,), 0.2, 1.0), "feat_2d_norm/offset": normal((c_z,), 0.2),
        "feat_2d_weights": normal((c_z, heads), 2.0 / np.sqrt(c_z)),
        "attention/query_w": normal((c_m, heads, d), 1.5 / np.sqrt(c_m)),
        "attention/key_w": normal((c_m, heads, d), 1.5 / np.sqrt(c_m)),
        "attention/value_w": normal((c_m, heads, d), 1.0 / np.sqrt(c_m)),
        "attention/gating_w": normal((c_m, heads, d), 1.0 / np.sqrt(c_m)),
        "attention/gating_b": normal((heads, d), 0.5, 1.0),
        "attention/output_w": normal((heads, d, c_m), 1.0 / np.sqrt(heads * d)),
        "attention/output_b": normal((c_m,), 0.3),
    }


def haiku_nested(flat: dict, prefix: str) -> dict:
    """{"a/b/name": x} -> Haiku's {"prefix/a/b": {"name": x}}."""
    out = {}
    for key, value in flat.items():
        scope, _, name = key.rpartition("/")
        out.setdefault(f"{prefix}/{scope}" if scope else prefix, {})[name] = value
    return out


def random_msa_inputs(rng, lead, S, N, c_m, c_z, every_row_keeps_a_key=True):
    m = (rng.standard_normal((*lead, S, N, c_m)) + rng.standard_normal((*lead, S, N, 1)))
    z = rng.standard_normal((*lead, N, N, c_z))
    mask = rng.random((*lead, S, N)) > 0.3
    if every_row_keeps_a_key:
        mask[..., rng.integers(N)] = True
    return m.astype(np.float32), z.astype(np.float32), mask


AF2_PREFIX = "alphafold/alphafold_iteration/evoformer/evoformer_iteration/msa_row_attention_with_pair_bias"
