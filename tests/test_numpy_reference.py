"""Self-checks of the float64 NumPy reference (tests/numpy_reference.py).

The analytic vjp is checked against central finite differences of the
forward, and the vectorised forward against an explicit-loop transcription of
the op's definition, on a tiny case with a masked key and a fully masked MSA row.
"""

from __future__ import annotations

import numpy as np
import pytest

import numpy_reference as npr


def _tiny_case(rng, batch=(2,), S=3, N=5, H=2, d=3):
    rows = (*batch, S, N, H, d)
    q, k, v, gate, dout = (rng.standard_normal(rows) for _ in range(5))
    bias = rng.standard_normal((*batch, H, N, N))
    mask = np.ones((*batch, S, N), dtype=bool)
    index0 = (0,) * len(batch)
    mask[index0 + (0, 2)] = False  # one masked key in row 0
    mask[index0 + (1,)] = False  # MSA row 1: every key masked
    mask[(-1,) * len(batch) + (S - 1, N - 1)] = False  # a masked key elsewhere
    return q, k, v, bias, mask, gate, dout


def _finite_difference(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = f()
        flat[i] = old - eps
        minus = f()
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


@pytest.mark.parametrize("use_gate", [True, False])
def test_vjp_matches_finite_differences(use_gate):
    rng = np.random.default_rng(1234 + use_gate)
    q, k, v, bias, mask, gate, dout = _tiny_case(rng)
    gate = gate if use_gate else None
    scale = 0.7
    loss = lambda: float(np.sum(npr.forward(q, k, v, bias, mask, gate, scale) * dout))
    analytic = npr.vjp(q, k, v, bias, mask, gate, scale, dout)
    primals = (q, k, v, bias, gate)
    for name, x, g in zip(("dq", "dk", "dv", "dbias", "dgate"), primals, analytic):
        if x is None:
            assert g is None
            continue
        numeric = _finite_difference(loss, x)
        assert g.shape == x.shape
        err = np.linalg.norm(g - numeric) / np.linalg.norm(numeric)
        assert err < 1e-7, (name, err)


def test_fully_masked_row_is_uniform_and_blocks_gradients():
    rng = np.random.default_rng(99)
    q, k, v, bias, mask, gate, dout = _tiny_case(rng)
    out = npr.forward(q, k, v, bias, mask, gate)
    sig = 1.0 / (1.0 + np.exp(-gate[0, 1]))
    expected = v[0, 1].mean(axis=0, keepdims=True) * sig  # [N, H, d]
    np.testing.assert_allclose(out[0, 1], expected, rtol=1e-13, atol=1e-13)
    dq, dk, dv, dbias, dgate = npr.vjp(q, k, v, bias, mask, gate, None, dout)
    # No gradient flows through replaced logits: row 1 contributes nothing to q, k.
    assert np.all(dq[0, 1] == 0) and np.all(dk[0, 1] == 0)
    assert np.all(dk[0, 0, 2] == 0)  # the masked key of row 0
    assert np.all(np.abs(dv[0, 1]) > 0)  # but v still receives the uniform weights
    p = npr.probabilities(q, k, bias, mask)
    np.testing.assert_allclose(p[0, 1], 1.0 / q.shape[-3], rtol=1e-13)


@pytest.mark.parametrize("batch", [(), (2,), (2, 1)])
def test_forward_matches_loops(batch):
    rng = np.random.default_rng(7 + len(batch))
    q, k, v, bias, mask, gate, _ = _tiny_case(rng, batch=batch if batch else (1,), S=2, N=4, d=2)
    if not batch:  # drop the leading dim: q is [S, N, H, d]
        q, k, v, bias, mask, gate = (x[0] for x in (q, k, v, bias, mask, gate))
    for m, g in ((mask, gate), (None, None)):
        a = npr.forward(q, k, v, bias, m, g, 0.9)
        b = npr.forward_loops(q, k, v, bias, m, g, 0.9)
        assert a.shape == q.shape
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
