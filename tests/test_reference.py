"""The plain-jnp path (`implementation="xla"`) in float64, and the float64 jnp
reference of the GPU tests, against the float64 NumPy reference.

The xla path is the reference the GPU kernels are compared with in several
places, so it is itself checked against tests/numpy_reference.py, the forward
and every gradient (q, k, v, bias, gate): in float32 and 16-bit types by
test_attention.py's cases, run on every backend; in float64 here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import compare, fwd_bwd, numpy_results, random_inputs, tolerance

XLA = "xla"

# id: (batch, S, N, H, d, kwargs). In float32, bfloat16 and float16 the xla
# path runs test_attention.py's cases (its `implementation` fixture).
CASES = {
    "seed": ((2,), 8, 32, 4, 16, {}),
    "N37-d8": ((1,), 3, 37, 2, 8, {}),
    "two-batch": ((2, 3), 2, 9, 2, 8, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_xla_float64_matches_numpy(case, seed):
    """float64 inputs must be computed in float64 (docstring: float64 is
    accepted by the xla path) to within 1e-12 of the NumPy reference."""
    batch, S, N, H, d, kw = CASES[case]
    with jax.enable_x64(True):
        inputs = random_inputs(seed, batch, S, N, H, d, jnp.float64, bias_dtype=jnp.float64, **kw)
        result = fwd_bwd(XLA)(*inputs.args)
        helpers.assert_shapes_dtypes_finite(result, inputs)
        compare(result, numpy_results(inputs), tolerance(jnp.float64), f"xla f64 {case}")


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
