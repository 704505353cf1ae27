"""The Triton kernels through the op (`implementation="triton"`, interpret mode on
the CPU) with tiles other than the defaults: small tiles over several query and key
tiles, the fused dq+dbias kernel and its row chunks, several MSA rows summed per
bias-gradient program; and the backward's rounding of `do`. Each against the
float64 NumPy reference and the plain-jnp path (`"xla"`).

The op's behaviour with the default tiles, on every backend, is in
tests/test_attention.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import helpers
import msa_pallas
from helpers import compare, fwd_bwd, numpy_results, random_inputs, rel_err, tolerance

TRITON, XLA = "triton", "xla"


def _check_case(inputs, label, block_config):
    """The kernels with `block_config` against float64 and against the xla path."""
    tol = tolerance(inputs.q.dtype)
    reference = numpy_results(inputs)
    triton = fwd_bwd(TRITON, None, block_config)(*inputs.args)
    xla = fwd_bwd(XLA)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(triton, inputs)
    triton_errors = compare(triton, reference, tol, f"triton {label}")
    xla_errors = compare(xla, reference, tol, f"xla {label}")
    if jnp.dtype(inputs.q.dtype).itemsize < 4:
        helpers.assert_no_worse_than_xla(triton_errors, xla_errors, inputs.q.dtype, label)


@pytest.mark.parametrize(
    "config_id", ["all-16x16", "mixed"],
)
def test_block_config(config_id, seed):
    """Small non-default tiles: N=37 spans 3 tiles both ways, so the online-softmax
    rescale across key tiles, the tail masks of the last tile and (for dbias)
    tiles in both directions are exercised."""
    T = msa_pallas.KernelTiles
    if config_id == "all-16x16":
        config = msa_pallas.BlockConfig(T(16, 16), T(16, 16), T(16, 16), T(16, 16))
    else:
        config = msa_pallas.BlockConfig(
            forward=T(16, 32, num_warps=2, num_stages=1),
            backward_dkdv=T(32, 16),
            backward_dq=T(16, 32),
            backward_dbias=T(32, 16, num_warps=8, num_stages=3),
        )
    inputs = random_inputs(seed, 1, 3, 37, 2, 8, jnp.float32, fully_masked_row=(0, 2))
    _check_case(inputs, f"block_config {config_id}", config)


# id: (batch, S, N, H, d, dtype, random_inputs kwargs, fused tiles)
FUSED_CASES = {
    # N=37 in a 64-wide key tile (tail masked), S=3: each row its own chunk.
    "N37-S3": ((1,), 3, 37, 2, 8, jnp.float32, dict(fully_masked_row=(0, 2)), (16, 64)),
    # S=5 (prime), two batch elements, 3 query tiles.
    "N40-S5-B2": ((2,), 5, 40, 2, 16, jnp.float32, {}, (16, 64)),
    # One query tile holding all of N, no mask, no gate.
    "N16-no-mask": ((1,), 4, 16, 3, 16, jnp.float32, dict(mask_rate=None, gate=False), (16, 16)),
    "N24-bf16": ((1,), 6, 24, 2, 32, jnp.bfloat16, {}, (16, 32)),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_dq_dbias(case, seed):
    """The fused dq+dbias kernel (one key tile spanning all N, the S rows
    split into chunks whose partial bias gradients are added) against
    float64 and xla."""
    batch, S, N, H, d, dtype, kw, (block_q, block_k) = FUSED_CASES[case]
    T = msa_pallas.KernelTiles
    config = dataclasses.replace(
        msa_pallas.block_sizes.default_block_config(N, d, dtype),
        backward_dq_dbias=T(block_q, block_k),
    )
    assert config.fuses_dq_dbias(N)
    inputs = random_inputs(seed, batch, S, N, H, d, dtype, **kw)
    _check_case(inputs, f"fused {case}", config)


def test_fused_dq_dbias_equals_separate_kernels(seed):
    """The fused kernel and the separate dq and dbias kernels (tiles that
    make both see all 50 keys in one 64-wide tile) agree to float32 rounding,
    on every output and gradient."""
    T = msa_pallas.KernelTiles
    separate = msa_pallas.BlockConfig(T(16, 16), T(16, 16), T(16, 64), T(16, 64))
    fused = dataclasses.replace(separate, backward_dq_dbias=T(16, 64))
    inputs = random_inputs(seed, 1, 4, 50, 2, 16, jnp.float32)
    got = fwd_bwd(TRITON, None, fused)(*inputs.args)
    want = fwd_bwd(TRITON, None, separate)(*inputs.args)
    names = helpers.RESULT_NAMES
    for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(a, b) < 1e-6, name


def _rows_per_dbias_program(tiles, batch, S, N, H, key_tiles=None):
    """MSA rows one program of a kernel that loops over S (dbias, dq+dbias) sums:
    S divided by the row chunks the kernels split S into (`row_chunks`)."""
    query_tiles = -(-N // tiles.block_q)
    key_tiles = -(-N // tiles.block_k) if key_tiles is None else key_tiles
    return S // msa_pallas.block_sizes.row_chunks(query_tiles * key_tiles * H * batch, S)


@pytest.mark.parametrize("kernel", ["dbias", "dq_dbias"])
def test_bias_gradient_sums_several_rows_per_program(kernel, seed):
    """S = 48 with one tile per (batch, head): the grid is small, so S is split
    into (at most 16) chunks, and each program of the bias-gradient kernel
    loops over 3 MSA rows, summing their ds in registers. The other cases have
    S <= 16: one row per program, a loop of one iteration, which cannot tell
    a sum over the rows from the last row alone."""
    batch, S, N, H, d = 1, 48, 20, 1, 8
    T = msa_pallas.KernelTiles
    config = msa_pallas.BlockConfig(T(32, 32), T(32, 32), T(32, 32), T(32, 32))
    if kernel == "dq_dbias":
        config = dataclasses.replace(config, backward_dq_dbias=T(16, 32))
        assert config.fuses_dq_dbias(N)
        rows = _rows_per_dbias_program(config.backward_dq_dbias, batch, S, N, H, key_tiles=1)
    else:
        assert not config.fuses_dq_dbias(N)
        rows = _rows_per_dbias_program(config.backward_dbias, batch, S, N, H)
    assert rows >= 2, f"each {kernel} program sees {rows} MSA row(s): the loop is not tested"
    inputs = random_inputs(seed, batch, S, N, H, d, jnp.float32, fully_masked_row=(0, 5))
    reference = numpy_results(inputs)
    result = fwd_bwd(TRITON, None, config)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, reference, 1e-5, f"{kernel}, {rows} rows per program")



@pytest.mark.parametrize(
    "gate, expect_rounding", [(False, False), (True, True)], ids=["no-gate", "gate"]
)
def test_backward_rounds_do_only_when_it_is_computed(gate, expect_rounding):
    """Without a gate the kernels' `do` is the cotangent itself (already in
    q's dtype): the VJP must pass it through, not write a rounded copy (one
    more [B, S, N, H, d] array in memory). With a gate, `do = dout * sigmoid(g)`
    is new and must be rounded to bf16 before delta sees it."""
    inputs = random_inputs(0, 1, 2, 16, 2, 16, jnp.bfloat16, gate=gate)
    jaxpr = str(jax.make_jaxpr(fwd_bwd(TRITON))(*inputs.args))
    assert ("reduce_precision" in jaxpr) == expect_rounding
