"""Numerical edge cases on CPU (masking, NaN/Inf, large values): the Pallas kernels in interpret
mode and the plain-jnp path, forward and every gradient.

- a fully masked batch element (every row of it): finite, uniform weights,
  zero dq / dk / dbias, the expected dv;
- a NaN or Inf query row stays in its rows: outside what that query feeds
  (its output, the keys of its row and head, its bias-gradient row),
  forward and gradients are finite and unchanged;
- a bias of +-1e4 in bfloat16 and float16: no overflow, float64 accuracy;
- N = 1, S = 1, H = 1 (d = 8).

The same checks run on a GPU in kernels/triton/test_gpu_reliability.py (edge_checks.py holds
them). Shapes reuse test_attention.py's where they can: interpret-mode
compiles are the expensive part of the CPU suite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import edge_checks
import helpers
from helpers import fwd_bwd, numpy_results, random_inputs, tolerance

IMPLEMENTATIONS = ["pallas", "xla"]
TRANSFORM_SHAPE = (2, 3, 20, 2, 8)  # test_attention.py's: compiled already


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_batch_element(implementation, seed):
    inputs = random_inputs(seed, *TRANSFORM_SHAPE, mask_rate=0.2)
    edge_checks.fully_masked_batch_element(
        inputs, 1, fwd_bwd(implementation), numpy_results, 1e-5, implementation
    )


def test_fully_masked_batch_element_no_gate_no_other_keys(seed):
    """One batch element, all of it masked, no gate: the whole output is the
    mean of v per (row, head), and the gradients of q, k and the bias vanish."""
    inputs = random_inputs(seed, 1, 3, 20, 2, 8, mask_rate=0.0, gate=False)
    inputs = inputs._replace(mask=jnp.zeros_like(inputs.mask))
    out, (dq, dk, dv, dbias, dgate) = result = fwd_bwd("pallas")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    v = helpers.to_f64(inputs.v)
    np.testing.assert_allclose(
        helpers.to_f64(out), np.broadcast_to(v.mean(axis=2, keepdims=True), v.shape),
        rtol=1e-5, atol=1e-6,
    )
    for name, g in (("dq", dq), ("dk", dk), ("dbias", dbias)):
        assert np.all(np.asarray(g) == 0), name
    edge_checks.assert_close(result, numpy_results(inputs), 1e-5, "all masked, no gate")


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nonfinite_query_row_stays_in_its_rows(implementation, value, seed):
    inputs = random_inputs(seed, *TRANSFORM_SHAPE, mask_rate=0.2)
    edge_checks.nonfinite_query_row(
        inputs, (1, 2, 5, 1), value, fwd_bwd(implementation), 1e-6,
        f"{implementation} q row = {value}",
    )


def test_nonfinite_query_row_last_tile_tail(seed):
    """The poisoned query sits in the tail of the last query tile (N = 37 with
    16-row tiles), where the kernels mask their loads."""
    import msa_pallas

    T = msa_pallas.KernelTiles
    config = msa_pallas.BlockConfig(T(16, 16), T(16, 16), T(16, 16), T(16, 16))
    inputs = random_inputs(seed, 1, 3, 37, 2, 8, jnp.float32, fully_masked_row=(0, 2))
    edge_checks.nonfinite_query_row(
        inputs, (0, 1, 36, 0), np.nan, fwd_bwd("pallas", None, config), 1e-6,
        "pallas N37 16x16 tiles, q row 36 = nan",
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bias_1e4_half_precision(implementation, dtype, seed):
    """bias = +-1e4 in the inputs' half-precision dtype (1e4 is exact in
    neither: the float64 reference takes the same rounded values)."""
    # The shape of test_attention.py's bf16/fp16 cases (compiled already),
    # with one fully masked MSA row next to the huge logits.
    inputs = random_inputs(seed, 1, 3, 40, 2, 32, dtype, bias_dtype=dtype, fully_masked_row=(0, 1))
    inputs = edge_checks.huge_bias(inputs, 1e4)
    result = fwd_bwd(implementation)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, numpy_results(inputs), tolerance(dtype),
        f"{implementation} bias +-1e4 {jnp.dtype(dtype).name}",
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bias_minus_1e4_everywhere_but_masked(implementation, seed):
    """Every kept key at bias -1e4 and masked keys at the replaced -1e9: the
    kept keys still win, nothing underflows to a 0/0.

    float32 holds a logit near 1e4 only to half an ulp, 5e-4, so the softmax
    weights are good to ~5e-4 relative, not 1e-5 (both paths measure ~4e-5):
    this checks against float64 at 1e-3."""
    inputs = random_inputs(seed, *TRANSFORM_SHAPE, mask_rate=0.5)
    inputs = inputs._replace(bias=jnp.full_like(inputs.bias, -1e4))
    result = fwd_bwd(implementation)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    edge_checks.assert_close(result, numpy_results(inputs), 1e-3, f"{implementation} bias -1e4")


# id: (batch, S, N, H, d, random_inputs kwargs)
TINY = {
    "N1": ((2,), 3, 1, 2, 8, dict(mask_rate=0.5)),
    "S1": ((1,), 1, 20, 2, 8, {}),
    "S1-N1-H1": ((1,), 1, 1, 1, 8, {}),
    "N1-masked": ((1,), 2, 1, 2, 8, dict(mask_rate=None, fully_masked_row=(0, 1))),
    "N2-no-batch-dims": ((), 1, 2, 1, 8, {}),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(TINY))
def test_tiny_shapes(case, implementation, seed):
    """N = 1 (one key: weight 1, so dq = dk = dbias = 0 in exact arithmetic),
    S = 1, H = 1. Compared with float64 with an absolute floor (edge_checks.assert_close)."""
    batch, S, N, H, d, kw = TINY[case]
    inputs = random_inputs(seed, batch, S, N, H, d, **kw)
    result = fwd_bwd(implementation)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    edge_checks.assert_close(result, numpy_results(inputs), 1e-5, f"{implementation} {case}")
    if N == 1:
        # One key: out = v * sigmoid(gate), masked or not.
        sig = 1.0 / (1.0 + np.exp(-helpers.to_f64(inputs.gate)))
        np.testing.assert_allclose(
            helpers.to_f64(result[0]), helpers.to_f64(inputs.v) * sig, rtol=1e-5, atol=1e-6
        )
