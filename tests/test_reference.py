"""The plain-jnp path (`implementation="xla"`) against the float64 NumPy reference.

This path is the reference the GPU kernels are compared with in several
places, so it is itself checked against tests/numpy_reference.py: the forward
and every gradient (q, k, v, bias, gate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import compare, fwd_bwd, numpy_results, random_inputs, tolerance

XLA = "xla"

CASES = {
    # id: (batch, S, N, H, d, kwargs)
    "seed": ((2,), 8, 32, 4, 16, {}),
    "N37-d8": ((1,), 3, 37, 2, 8, {}),
    "no-batch": ((), 3, 12, 2, 16, {}),
    "two-batch": ((2, 3), 2, 9, 2, 8, {}),
    "no-mask": ((2,), 3, 16, 2, 16, dict(mask_rate=None)),
    "no-gate": ((2,), 3, 16, 2, 16, dict(gate=False)),
    "bf16-bias": ((1,), 3, 20, 2, 16, dict(bias_dtype=jnp.bfloat16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_xla_float32_matches_numpy(case, seed):
    batch, S, N, H, d, kw = CASES[case]
    inputs = random_inputs(seed, batch, S, N, H, d, jnp.float32, **kw)
    result = fwd_bwd(XLA)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    # A bfloat16 bias gets a bfloat16 gradient: only that one is rounded to bf16.
    loose = {"dbias": 2e-2} if inputs.bias.dtype == jnp.bfloat16 else {}
    compare(result, numpy_results(inputs), tolerance(jnp.float32), f"xla f32 {case}", **loose)


def test_xla_custom_scale(seed):
    inputs = random_inputs(seed, 2, 3, 16, 2, 8, jnp.float32)
    result = fwd_bwd(XLA, scale=0.77)(*inputs.args)
    compare(result, numpy_results(inputs, scale=0.77), 1e-5, "xla f32 scale=0.77")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_xla_half_precision_matches_numpy(dtype, seed):
    inputs = random_inputs(seed, 2, 4, 24, 2, 16, dtype)
    result = fwd_bwd(XLA)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, numpy_results(inputs), tolerance(dtype), f"xla {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case", ["seed", "N37-d8", "two-batch"])
def test_xla_float64_matches_numpy(case, seed):
    """float64 inputs must be computed in float64 (docstring: float64 is
    accepted by the xla path) to within 1e-12 of the NumPy reference."""
    batch, S, N, H, d, kw = CASES[case]
    with jax.enable_x64(True):
        inputs = random_inputs(seed, batch, S, N, H, d, jnp.float64, bias_dtype=jnp.float64, **kw)
        result = fwd_bwd(XLA)(*inputs.args)
        helpers.assert_shapes_dtypes_finite(result, inputs)
        compare(result, numpy_results(inputs), tolerance(jnp.float64), f"xla f64 {case}")


def test_xla_fully_masked_row(seed):
    S, N = 3, 11
    inputs = random_inputs(seed, 2, S, N, 2, 8, jnp.float32, fully_masked_row=(1, 2))
    result = fwd_bwd(XLA)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.assert_fully_masked_row(result, inputs, 1, 2)
    compare(result, numpy_results(inputs), 1e-5, "xla f32 fully-masked-row")


def test_jnp_float64_helper_matches_numpy(seed):
    """The float64 jnp reference the GPU tests use (tests/helpers.py) agrees
    with the NumPy reference."""
    with jax.enable_x64(True):
        inputs = random_inputs(seed, 2, 3, 13, 2, 8, jnp.float32, fully_masked_row=(1, 0))
        result = helpers.jnp_reference_fwd_bwd(inputs, scale=0.6)
        assert result[0].dtype == np.float64
        reference = numpy_results(inputs, scale=0.6)
        compare(result, reference, 1e-12, "jnp f64 helper")
        # Chunked over MSA rows (dbias summed over chunks), keeping the first 2 rows.
        out, grads = helpers.jnp_reference_fwd_bwd(inputs, scale=0.6, chunk_rows=2, keep_rows=2)
        first_rows = lambda x: x[:, :2]
        compare(
            (out, grads),
            (first_rows(reference[0]), tuple(
                g if name == "dbias" else first_rows(g)
                for name, g in zip(helpers.GRAD_NAMES, reference[1])
            )),
            1e-12, "jnp f64 helper, chunked",
        )
