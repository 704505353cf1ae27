"""An independent float64 NumPy implementation of MSA row attention.

Written from the op's definition below, not from `msa_pallas/reference.py`, so the
library's two paths (Pallas kernels and plain `jnp`) are both checked against
something that shares no code with them.

    logits[b,s,h,i,j] = scale * <q[b,s,i,h,:], k[b,s,j,h,:]> + bias[b,h,i,j]
    logits[b,s,h,i,j] = -1e9            where mask[b,s,j] is False / 0
    p = softmax_j(logits)
    o[b,s,i,h,:] = sum_j p[b,s,h,i,j] * v[b,s,j,h,:]
    out = o * sigmoid(gate)             when a gate is given

Layouts: q, k, v, gate `[*batch, S, N, H, d]`; bias `[*batch, H, N, N]`;
mask `[*batch, S, N]` (bool or numeric, nonzero keeps). Any number of leading
batch dims (including none); they are flattened to one axis B internally.

Everything is computed in float64 on the inputs upcast to float64 (bfloat16 /
float16 inputs are upcast exactly), and the results are returned in float64.
The backward is analytic:

    do   = dout * sigmoid(g)
    dg   = dout * o * sigmoid(g) * (1 - sigmoid(g))
    dv   = p^T do
    dp   = do v^T
    ds   = p * (dp - sum_j p * dp)        (softmax backward)
    ds   = 0 at masked keys               (the logit was *replaced* by -1e9)
    dq   = scale * ds k,  dk = scale * ds^T q,  dbias = sum_s ds

With attention dropout (`dropout=(keep, rate)`, keep a bool `[B, S, H, N, N]`
mask of the weights kept), z = keep / (1 - rate) multiplies the weights after
the softmax: o = (p * z) v, dv = (p * z)^T do, dp = z * (do v^T), and ds as
above (its row sum is then sum_j p * z * (do . v_j)).
"""

from __future__ import annotations

import math

import numpy as np

MASKED_LOGIT = -1e9


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _split(q):
    """Flattens the leading batch dims; returns (batch_shape, B, S, N, H, d)."""
    q = np.asarray(q)
    if q.ndim < 4:
        raise ValueError(f"q must have rank >= 4, got shape {q.shape}")
    *batch_shape, s, n, h, d = q.shape
    b = math.prod(batch_shape)
    return tuple(batch_shape), b, s, n, h, d


def _prepare(q, k, v, bias, mask, gate, scale):
    batch_shape, b, s, n, h, d = _split(q)
    rows = (b, s, n, h, d)
    # -> [B, S, H, N, d] (heads before residues) for the per-row matrix products.
    to_bshnd = lambda x: _f64(x).reshape(rows).transpose(0, 1, 3, 2, 4)
    qh, kh, vh = to_bshnd(q), to_bshnd(k), to_bshnd(v)
    gh = None if gate is None else to_bshnd(gate)
    bias64 = _f64(bias).reshape(b, h, n, n)
    if mask is None:
        keep = np.ones((b, s, n), dtype=bool)
    else:
        keep = np.asarray(mask).reshape(b, s, n) != 0
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    return batch_shape, rows, qh, kh, vh, gh, bias64, keep, float(scale)


def _probabilities(qh, kh, bias64, keep, scale):
    logits = scale * np.einsum("bshid,bshjd->bshij", qh, kh) + bias64[:, None]
    keep_b = keep[:, :, None, None, :]  # [B, S, 1, 1, N(keys)]
    logits = np.where(keep_b, logits, MASKED_LOGIT)
    logits = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=-1, keepdims=True), keep_b


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _back(x, batch_shape, rows):
    """[B, S, H, N, d] -> [*batch, S, N, H, d]."""
    b, s, n, h, d = rows
    return x.transpose(0, 1, 3, 2, 4).reshape(*batch_shape, s, n, h, d)


def _dropout_factor(dropout):
    """z = keep / (1 - rate), `[B, S, H, N, N]` float64, or 1 without dropout."""
    if dropout is None:
        return 1.0
    keep, rate = dropout
    return np.asarray(keep).astype(np.float64) / (1.0 - float(rate))


def forward(q, k, v, bias, mask=None, gate=None, scale=None, dropout=None):
    """The attention output, float64, shape of q. `dropout`: None or
    `(keep, rate)`, keep a bool `[B, S, H, N, N]` (module docstring)."""
    batch_shape, rows, qh, kh, vh, gh, bias64, keep, scale = _prepare(
        q, k, v, bias, mask, gate, scale
    )
    p, _ = _probabilities(qh, kh, bias64, keep, scale)
    o = np.einsum("bshij,bshjd->bshid", p * _dropout_factor(dropout), vh)
    if gh is not None:
        o = o * _sigmoid(gh)
    return _back(o, batch_shape, rows)


def probabilities(q, k, bias, mask=None, scale=None):
    """The softmax weights, float64, `[B, S, H, N, N]` (leading batch dims flattened)."""
    _, _, qh, kh, _, _, bias64, keep, scale = _prepare(q, k, k, bias, mask, None, scale)
    return _probabilities(qh, kh, bias64, keep, scale)[0]


def vjp(q, k, v, bias, mask, gate, scale, dout, dropout=None):
    """Analytic gradients of `sum(forward(...) * dout)` (`dropout` as `forward`'s).

    Returns:
      (dq, dk, dv, dbias, dgate), float64, shaped like the inputs; dgate is
      None when gate is None.
    """
    batch_shape, rows, qh, kh, vh, gh, bias64, keep, scale = _prepare(
        q, k, v, bias, mask, gate, scale
    )
    b, s, n, h, d = rows
    douth = _f64(dout).reshape(rows).transpose(0, 1, 3, 2, 4)
    p, keep_b = _probabilities(qh, kh, bias64, keep, scale)
    z = _dropout_factor(dropout)
    o = np.einsum("bshij,bshjd->bshid", p * z, vh)
    if gh is None:
        do, dg = douth, None
    else:
        sg = _sigmoid(gh)
        do = douth * sg
        dg = douth * o * sg * (1.0 - sg)
    dv = np.einsum("bshij,bshid->bshjd", p * z, do)
    dp = z * np.einsum("bshid,bshjd->bshij", do, vh)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    ds = np.where(keep_b, ds, 0.0)
    dq = scale * np.einsum("bshij,bshjd->bshid", ds, kh)
    dk = scale * np.einsum("bshij,bshid->bshjd", ds, qh)
    dbias = ds.sum(axis=1).reshape(*batch_shape, h, n, n)
    back = lambda x: _back(x, batch_shape, rows)
    return back(dq), back(dk), back(dv), dbias, None if dg is None else back(dg)


def forward_loops(q, k, v, bias, mask=None, gate=None, scale=None):
    """The same forward written with explicit loops (tiny inputs only).

    A second, structurally different transcription of the definition, used to check
    `forward` itself.
    """
    batch_shape, b, s_rows, n, h, d = _split(q)
    rows = (b, s_rows, n, h, d)
    q, k, v = (_f64(x).reshape(rows) for x in (q, k, v))
    gate = None if gate is None else _f64(gate).reshape(rows)
    bias = _f64(bias).reshape(b, h, n, n)
    mask = None if mask is None else np.asarray(mask).reshape(b, s_rows, n)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = np.zeros(rows)
    for bi in range(b):
        for si in range(s_rows):
            for hi in range(h):
                for i in range(n):
                    logits = []
                    for j in range(n):
                        if mask is not None and not mask[bi, si, j]:
                            logits.append(MASKED_LOGIT)
                        else:
                            dot = sum(q[bi, si, i, hi, c] * k[bi, si, j, hi, c] for c in range(d))
                            logits.append(scale * dot + bias[bi, hi, i, j])
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    total = sum(weights)
                    for c in range(d):
                        acc = sum(weights[j] * v[bi, si, j, hi, c] for j in range(n)) / total
                        if gate is not None:
                            acc *= 1.0 / (1.0 + math.exp(-gate[bi, si, i, hi, c]))
                        out[bi, si, i, hi, c] = acc
    return out.reshape(*batch_shape, s_rows, n, h, d)
