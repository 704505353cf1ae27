"""Kernel options that change how the work is split or what the kernels read:
several MSA rows per program (`KernelTiles.msa_rows`), the bias rounded to
q's dtype (`round_bias`), and the float32 bias gradient the kernels write.

Run in Pallas interpret mode on CPU, against the float64 NumPy reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_pallas
from helpers import compare, numpy_results, random_inputs, rel_err, tolerance
from msa_pallas.block_sizes import BlockConfig, KernelTiles
from msa_pallas.kernels.triton import backward
from msa_pallas.kernels.triton.forward import attention_forward


def _config(msa_rows: int) -> BlockConfig:
    per_row = KernelTiles(16, 16, 4, 2, msa_rows)
    # No fused dq+dbias: dq must come from the per-row dq kernel under test.
    return BlockConfig(per_row, per_row, per_row, KernelTiles(16, 32))


def _run(inputs, *, block_config=None, round_bias=False, implementation="pallas"):
    def f(q, k, v, bias, gate):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, inputs.mask, gate, implementation=implementation,
            block_config=block_config, round_bias=round_bias,
        )

    out, pullback = jax.vjp(f, inputs.q, inputs.k, inputs.v, inputs.bias, inputs.gate)
    return out, pullback(inputs.dout)


@pytest.mark.parametrize(
    "S, msa_rows, dtype",
    [
        (6, 3, jnp.float32),  # 2 programs of 3 rows each
        (5, 4, jnp.bfloat16),  # 4 does not divide 5: falls back to 1 row
    ],
)
def test_several_msa_rows_per_program(S, msa_rows, dtype):
    # N = 37 leaves a partial tile; a fully masked row sits inside a
    # multi-row program. Interpret mode fills unwritten outputs with NaN.
    inputs = random_inputs(11, 1, S, 37, 2, 8, dtype, fully_masked_row=(0, 1))
    result = _run(inputs, block_config=_config(msa_rows))
    compare(result, numpy_results(inputs), tolerance(dtype), f"msa_rows={msa_rows}")
    if dtype == jnp.float32:
        # Bitwise equal to one row per program: the same products in the same
        # order, only grouped differently.
        one_row = _run(inputs, block_config=_config(1))
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(one_row)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_round_bias_reads_the_rounded_bias():
    dtype = jnp.bfloat16
    inputs = random_inputs(13, 1, 3, 33, 2, 16, dtype, bias_dtype=jnp.float32)
    inputs = inputs._replace(bias=inputs.bias * 4.0)
    reference = numpy_results(inputs)
    exact = _run(inputs)
    rounded = _run(inputs, round_bias=True)
    # The float32 bias gradient comes back in the bias's dtype.
    assert rounded[1][3].dtype == jnp.float32 and exact[1][3].dtype == jnp.float32
    # What the kernels computed is the op on the rounded bias...
    as_if_rounded = inputs._replace(bias=inputs.bias.astype(dtype).astype(jnp.float32))
    compare(rounded, numpy_results(as_if_rounded), tolerance(dtype), "rounded vs rounded ref")
    # ...which differs from the exact path by more than the exact path's own error.
    exact_err = rel_err(exact[0], reference[0])
    rounded_err = rel_err(rounded[0], reference[0])
    assert rounded_err > exact_err, (rounded_err, exact_err)
    compare(rounded, reference, tolerance(dtype), "rounded vs exact ref")


def test_round_bias_saturates_float16():
    # A -1e9 mask folded into a float32 bias would be -inf in float16: the
    # rounding saturates, so the rows stay finite and the masked keys get no weight.
    inputs = random_inputs(14, 1, 2, 20, 2, 16, jnp.float16, mask_rate=None, bias_dtype=jnp.float32)
    masked = np.random.default_rng(0).random(inputs.bias.shape) < 0.3
    bias = jnp.where(masked, -1e9, inputs.bias)
    inputs = inputs._replace(bias=bias)
    out, grads = _run(inputs, round_bias=True)
    ref_out, ref_grads = numpy_results(inputs)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref_out) < tolerance(jnp.float16)
    assert rel_err(grads[0], ref_grads[0]) < tolerance(jnp.float16)


@pytest.mark.parametrize(
    "q_dtype, bias_dtype, round_bias, expected",
    [
        (jnp.bfloat16, jnp.float32, True, "bfloat16"),
        (jnp.float16, jnp.float32, True, "float16"),
        (jnp.bfloat16, jnp.float32, False, None),  # the default: the bias as given
        (jnp.float32, jnp.float32, True, None),  # float32 inputs: never rounded
        (jnp.bfloat16, jnp.bfloat16, True, None),  # nothing to round
        (jnp.bfloat16, jnp.float16, True, None),  # as narrow as q
    ],
)
def test_which_bias_dtype_the_kernels_read(q_dtype, bias_dtype, round_bias, expected):
    from msa_pallas.attention import kernel_bias_dtype

    assert kernel_bias_dtype(q_dtype, bias_dtype, round_bias) == expected


@pytest.mark.parametrize("kernel", ["backward_dbias", "backward_dq_dbias"])
def test_bias_gradient_in_float32_for_a_16_bit_bias(kernel):
    # The VJP asks the kernels for a float32 bias gradient (summed over S in
    # float32, rounded to the bias dtype once, after any cross-device sum).
    inputs = random_inputs(17, 1, 4, 16, 2, 16, jnp.bfloat16, bias_dtype=jnp.bfloat16)
    q, k, v, bias, mask, gate, dout = inputs.args
    scale = 0.25
    tiles = KernelTiles(16, 16)
    _, attention, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask.astype(jnp.int8), None, scale=scale, tiles=tiles, interpret=True,
        save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    operands = (q, k, v, bias, mask.astype(jnp.int8), dout, row_max, row_log2_sum, delta)
    call = getattr(backward, kernel)
    wide = call(*operands, scale=scale, tiles=tiles, interpret=True, dbias_dtype=jnp.float32)
    narrow = call(*operands, scale=scale, tiles=tiles, interpret=True)
    wide, narrow = (x if kernel == "backward_dbias" else x[1] for x in (wide, narrow))
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wide.astype(jnp.bfloat16)), np.asarray(narrow))
    assert not np.array_equal(np.asarray(wide), np.asarray(narrow.astype(jnp.float32)))
