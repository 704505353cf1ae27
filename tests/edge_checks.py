"""Numerical edge cases (masked rows, non-finite inputs, large logits),
written once and run on CPU (Pallas interpret mode and the plain-jnp path,
test_edge_cases.py) and on a GPU (the compiled kernels, kernels/triton/test_gpu_reliability.py).

Each check takes `run`, a jitted `(q, k, v, bias, mask, gate, dout) ->
(out, (dq, dk, dv, dbias, dgate))` (helpers.fwd_bwd), and, where it compares
with float64, `reference(inputs) -> (out, grads)` (the NumPy reference on CPU,
the jnp float64 one on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import helpers
from helpers import Inputs, RESULT_NAMES, to_f64


FLOOR = 0.1  # per element, for assert_close


def assert_close(result, reference, tol: float, label: str = "") -> dict:
    """`helpers.compare` with an absolute floor of 0.1 tol per element (inputs
    are unit normals, so results are O(1)): a gradient that is zero in exact
    arithmetic (N = 1, a fully masked batch element) is compared with its
    rounding noise, not divided by zero."""
    return helpers.compare(result, reference, tol, label, floor=FLOOR)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def fully_masked_batch_element(inputs: Inputs, b: int, run, reference, tol: float, label=""):
    """Every key of every MSA row of batch element `b` masked.

    The weights there are uniform (masked logits are replaced, not
    -inf): out = mean_j v * sigmoid(gate); nothing flows to q, k or the bias
    (dq = dk = dbias = 0 exactly); dv[j] = (1/N) sum_i do[i]. Everything is
    finite, and the whole result (other batch elements included) matches
    float64.
    """
    assert inputs.mask is not None and inputs.gate is not None
    inputs = inputs._replace(mask=jnp.asarray(inputs.mask).at[b].set(False))
    result = run(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    out, (dq, dk, dv, dbias, dgate) = result
    n_res = inputs.q.shape[-3]
    sig = _sigmoid(to_f64(inputs.gate[b]))
    v = to_f64(inputs.v[b])  # [S, N, H, d]
    expected_out = np.broadcast_to(v.mean(axis=-3, keepdims=True), v.shape) * sig
    atol = tol * max(1.0, float(np.abs(expected_out).max()))
    np.testing.assert_allclose(to_f64(out[b]), expected_out, rtol=tol, atol=atol, err_msg=label)
    for name, grad in (("dq", dq), ("dk", dk), ("dbias", dbias)):
        assert np.all(to_f64(grad[b]) == 0.0), f"{label}: {name} of the masked batch element is not 0"
    do = to_f64(inputs.dout[b]) * sig
    expected_dv = np.broadcast_to(do.sum(axis=-3, keepdims=True) / n_res, do.shape)
    atol = tol * max(1.0, float(np.abs(expected_dv).max()))
    np.testing.assert_allclose(to_f64(dv[b]), expected_dv, rtol=tol, atol=atol, err_msg=label)
    assert_close(result, reference(inputs), tol, f"{label} fully masked batch element {b}")
    return result


def poison_query_row(inputs: Inputs, where, value: float):
    """(clean, poisoned) inputs: in both, keys 0 and 1 of the MSA row
    `where[:2]` are kept and their head-`where[3]` k rows are +1 and -1, so
    that an infinite query row has logits +inf and -inf (a NaN softmax row,
    not a silently finite one); in `poisoned`, q[where] (all d) is `value`."""
    b, s, i, h = where
    mask = None if inputs.mask is None else jnp.asarray(inputs.mask).at[b, s, :2].set(True)
    k = inputs.k.at[b, s, 0, h, :].set(1.0).at[b, s, 1, h, :].set(-1.0)
    clean = inputs._replace(mask=mask, k=k)
    poisoned = clean._replace(q=clean.q.at[b, s, i, h, :].set(value))
    return clean, poisoned


def nonfinite_may_reach(where, shapes: dict) -> dict:
    """Where a non-finite q[b, s, i, h, :] may legitimately show, per result:
    out, dq and dgate of that query; dk and dv of every key of (b, s, h)
    (each sums over all queries); the bias gradient of row i of (b, h)."""
    b, s, i, h = where
    reach = {name: np.zeros(shape, bool) for name, shape in shapes.items()}
    for name in ("out", "dq", "dgate"):
        if name in reach:
            reach[name][b, s, i, h] = True
    for name in ("dk", "dv"):
        reach[name][b, s, :, h] = True
    reach["dbias"][b, h, i] = True
    return reach


def nonfinite_query_row(inputs: Inputs, where, value: float, run, tol: float, label=""):
    """A NaN or Inf query row stays in its rows, forward and backward.

    The output row of that query is non-finite; every element outside
    `nonfinite_may_reach` is finite and equals the run on the clean inputs
    (which the other tests check against float64).
    """
    clean_inputs, poisoned = poison_query_row(inputs, where, value)
    clean = jax.tree.leaves(run(*clean_inputs.args))
    got = jax.tree.leaves(run(*poisoned.args))
    names = [n for n in RESULT_NAMES if n != "dgate" or inputs.gate is not None]
    assert len(got) == len(clean) == len(names)
    reach = nonfinite_may_reach(where, {n: x.shape for n, x in zip(names, got)})
    b, s, i, h = where
    out = to_f64(got[0])
    assert not np.isfinite(out[b, s, i, h]).any(), f"{label}: the poisoned query's output is finite"
    for name, a, c in zip(names, got, clean):
        a, c = to_f64(a), to_f64(c)
        outside = ~reach[name]
        bad = outside & ~np.isfinite(a)
        assert not bad.any(), (
            f"{label}: {name} has {int(bad.sum())} non-finite elements outside the "
            f"poisoned query's reach, first at {np.argwhere(bad)[0].tolist()}"
        )
        scale = max(1.0, float(np.abs(c[outside]).max()))
        np.testing.assert_allclose(
            a[outside], c[outside], rtol=tol, atol=tol * scale,
            err_msg=f"{label}: {name} outside the poisoned query's reach",
        )


def huge_bias(inputs: Inputs, magnitude: float = 1e4) -> Inputs:
    """The bias replaced by +-magnitude (random signs), in the bias's dtype:
    logits of +-1e4 (+-1.4e4 in the kernels' base 2), so every softmax row is
    a sharp choice among its +1e4 keys, and a half-precision exponent would
    overflow if computed before the max subtraction."""
    signs = np.sign(to_f64(inputs.bias))
    signs[signs == 0] = 1.0
    return inputs._replace(bias=jnp.asarray(magnitude * signs, inputs.bias.dtype))
