"""The op, forward and backward, on padded batches, through every backend.

The kernels skip the key tiles and MSA rows that the mask removes
(`msa_pallas.kernels.key_tiles`); what they skip contributes exactly
nothing, so the op must agree with the float64 NumPy reference on every
output and gradient: dead rows (uniform weights: the mean of v; zero dq, dk
and bias-gradient parts; dv the mean of their output gradient), padded
residues at the end and in the middle, a batch element that is all
padding, masks that change between rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas

# float32 for the float32 path; bf16 inputs against float64 as the suite's
# other f+b checks hold them.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}

CASES = {
    # (B, S, N, H, d), dtype, mask
    "end-dead-rows": ((1, 6, 256, 1, 32), jnp.bfloat16, dict(dead=(1, 4, 5))),
    "middle-all-padding-d8": ((2, 4, 136, 4, 8), jnp.bfloat16,
                              dict(middle=(64, 128), dead_batch=(1,))),
    "float32": ((1, 4, 130, 2, 16), jnp.float32, dict(dead=(3,), middle=(10, 90))),
}


def _inputs(case, seed):
    (batch, rows, n_res, heads, head_dim), dtype, mask = CASES[case]
    inputs = helpers.random_inputs(seed, batch, rows, n_res, heads, head_dim, dtype)
    return inputs._replace(mask=jnp.asarray(helpers.padded_mask(batch, rows, n_res, seed, **mask)))


@pytest.mark.parametrize("implementation", ["mosaic", "triton", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_batches_against_float64(case, implementation, seed):
    inputs = _inputs(case, seed)
    dtype = jnp.dtype(inputs.q.dtype)
    if implementation == "mosaic" and dtype == jnp.float32:
        pytest.skip("the Mosaic forward takes 16-bit inputs (float32 runs the Triton forward)")
    if implementation == "mosaic" and case != "end-dead-rows" and jax.default_backend() == "cpu":
        # 40 s in the interpreter; d = 8 pairs, padding in the middle and an
        # all-padding element are held there by the kernels' own padding tests.
        pytest.skip("one Mosaic case in the interpreter (tests/kernels/mosaic/test_padding_*)")
    result = helpers.fwd_bwd(implementation, skip_padding=True)(*inputs.args)
    for x in (result[0], *result[1]):
        helpers.assert_finite(x)
    helpers.compare(result, helpers.numpy_results(inputs), TOLERANCE[dtype],
                    f"{case} {implementation}", floor=1e-3)
    # The dead rows' gradients of q and k are exactly zero.
    dead = ~np.asarray(inputs.mask).any(axis=-1)
    dq, dk = (helpers.to_f64(g) for g in result[1][:2])
    assert not np.any(dq[dead]) and not np.any(dk[dead])


def test_one_jitted_function_skips_inside_the_context_alone(seed):
    """`skipping_padding()` is part of JAX's jit cache key: one jitted
    function, called outside, inside and outside again, is traced with
    skipping inside only (its lowering then reads the mask's summaries), and
    both give the same results (a dead row's mean of v summed in another
    order)."""
    inputs = _inputs("float32", seed)
    q, k, v, bias, mask, gate, _ = inputs.args
    attend = jax.jit(lambda *args: msa_pallas.msa_row_attention(*args, implementation="triton"))
    args = (q, k, v, bias, mask, gate)
    visiting = attend.lower(*args).as_text()
    with msa_pallas.skipping_padding():
        skipping = attend.lower(*args).as_text()
        skipped = attend(*args)
        with msa_pallas.skipping_padding(False):
            assert attend.lower(*args).as_text() == visiting
    assert skipping != visiting and attend.lower(*args).as_text() == visiting
    assert helpers.rel_err(skipped, attend(*args)) < 1e-6
