"""The public op `msa_pallas.msa_row_attention` with the Pallas kernels.

On a machine without a GPU, `implementation="pallas"` runs the kernels in
Pallas interpret mode, so these tests check the kernels' indexing, masking
and online-softmax logic on CPU. The forward and every gradient (q, k, v,
bias, gate) are compared with the float64 NumPy reference
(tests/numpy_reference.py) and with the plain-jnp path (`"xla"`).

In interpret mode, an output element that no kernel program writes holds NaN.
So "every output is finite" together with "every output is within tolerance
of the reference" proves that the kernels write every element of every
output (tile tails past N, head-dim columns past d, all MSA rows and heads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
import numpy_reference
from helpers import compare, fwd_bwd, numpy_results, random_inputs, rel_err, tolerance

PALLAS, XLA = "pallas", "xla"

# id: (batch, S, N, H, d, dtype, random_inputs kwargs)
CASES = {
    "seed-2x8x32x4x16": ((2,), 8, 32, 4, 16, jnp.float32, {}),
    "N37": ((1,), 2, 37, 2, 16, jnp.float32, {}),
    "d8": ((1,), 2, 24, 2, 8, jnp.float32, {}),
    "d64": ((1,), 2, 20, 2, 64, jnp.float32, {}),
    "S3": ((2,), 3, 16, 2, 16, jnp.float32, {}),
    "H1": ((2,), 2, 19, 1, 16, jnp.float32, {}),
    "no-batch-dims": ((), 2, 21, 2, 16, jnp.float32, {}),
    "two-batch-dims": ((2, 2), 2, 12, 2, 8, jnp.float32, {}),
    "no-mask": ((1,), 3, 20, 2, 16, jnp.float32, dict(mask_rate=None)),
    "no-gate": ((1,), 3, 20, 2, 16, jnp.float32, dict(gate=False)),
    "no-mask-no-gate": ((1,), 2, 18, 2, 8, jnp.float32, dict(mask_rate=None, gate=False)),
    "fully-masked-row": ((2,), 3, 20, 2, 16, jnp.float32, dict(fully_masked_row=(1, 2))),
    "bf16": ((1,), 3, 40, 2, 32, jnp.bfloat16, {}),
    "fp16": ((1,), 3, 40, 2, 32, jnp.float16, {}),
    "bf16-bias": ((1,), 2, 24, 2, 16, jnp.float32, dict(bias_dtype=jnp.bfloat16)),
    "bf16-q-f32-gate": ((1,), 2, 20, 2, 16, jnp.bfloat16, dict(gate_dtype=jnp.float32)),
}


def _check_case(inputs, label, scale=None, block_config=None):
    """pallas vs numpy float64, xla vs numpy float64, and pallas vs xla; in
    bfloat16 / float16, also the kernels' error against at most twice the xla
    path's (`helpers.assert_no_worse_than_xla`)."""
    dtype = inputs.q.dtype
    tol = tolerance(dtype)
    # A bfloat16 bias gets a bfloat16 gradient: only that result is rounded to bf16.
    loose = {"dbias": 2e-2} if inputs.bias.dtype == jnp.bfloat16 else {}
    reference = numpy_results(inputs, scale)
    pallas = fwd_bwd(PALLAS, scale, block_config)(*inputs.args)
    xla = fwd_bwd(XLA, scale)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(pallas, inputs)
    pallas_errors = compare(pallas, reference, tol, f"pallas {label}", **loose)
    xla_errors = compare(xla, reference, tol, f"xla {label}", **loose)
    compare(pallas, (xla[0], xla[1]), tol, f"pallas-vs-xla {label}", **loose)
    if jnp.dtype(dtype).itemsize < 4:
        helpers.assert_no_worse_than_xla(pallas_errors, xla_errors, dtype, label)
    return pallas, xla, reference


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_matches_references(case, seed):
    batch, S, N, H, d, dtype, kw = CASES[case]
    inputs = random_inputs(seed, batch, S, N, H, d, dtype, **kw)
    _check_case(inputs, case)


def test_fully_masked_row_uniform_weights(seed):
    S, N, H, d = 3, 20, 2, 16  # the "fully-masked-row" case's shape: compiled already
    inputs = random_inputs(seed, 2, S, N, H, d, fully_masked_row=(0, 1), mask_rate=0.3)
    result = fwd_bwd(PALLAS)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.assert_fully_masked_row(result, inputs, 0, 1)
    compare(result, numpy_results(inputs), 1e-5, "pallas fully-masked-row (0, 1)")


def test_numeric_mask_equals_bool_mask(seed):
    """A float 0/1 mask gives bitwise the results of the equal bool mask."""
    batch, S, N, H, d, dtype, kw = CASES["N37"]
    inputs = random_inputs(seed, batch, S, N, H, d, dtype, mask_rate=0.3)
    as_float = inputs._replace(mask=inputs.mask.astype(jnp.float32))
    run = fwd_bwd(PALLAS)
    expected = jax.tree.leaves(run(*inputs.args))
    got = jax.tree.leaves(run(*as_float.args))
    assert len(got) == len(expected) == 6
    for name, a, b in zip(helpers.RESULT_NAMES, got, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    compare((got[0], tuple(got[1:])), numpy_results(inputs), 1e-5, "pallas float mask")


def test_custom_scale(seed):
    batch, S, N, H, d, dtype, kw = CASES["N37"]
    inputs = random_inputs(seed, batch, S, N, H, d, dtype)
    _check_case(inputs, "scale=0.3", scale=0.3)


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
    _check_case(inputs, f"block_config {config_id}", block_config=config)


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
    _check_case(inputs, f"fused {case}", block_config=config)


def test_fused_dq_dbias_equals_separate_kernels(seed):
    """The fused kernel and the separate dq and dbias kernels (tiles that
    make both see all 50 keys in one 64-wide tile) agree to float32 rounding,
    on every output and gradient."""
    T = msa_pallas.KernelTiles
    separate = msa_pallas.BlockConfig(T(16, 16), T(16, 16), T(16, 64), T(16, 64))
    fused = dataclasses.replace(separate, backward_dq_dbias=T(16, 64))
    inputs = random_inputs(seed, 1, 4, 50, 2, 16, jnp.float32)
    got = fwd_bwd(PALLAS, None, fused)(*inputs.args)
    want = fwd_bwd(PALLAS, None, separate)(*inputs.args)
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
    result = fwd_bwd(PALLAS, None, config)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, reference, 1e-5, f"{kernel}, {rows} rows per program")


# --- transformations ----------------------------------------------------------

TRANSFORM_SHAPE = (2, 3, 20, 2, 8)  # B, S, N, H, d


def _attention(implementation=PALLAS):
    def f(q, k, v, bias, mask, gate):
        return msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation=implementation)
    return f


def test_eager_and_jit(seed):
    inputs = random_inputs(seed, *TRANSFORM_SHAPE)
    q, k, v, bias, mask, gate, dout = inputs.args
    f = _attention()
    eager_out, pullback = jax.vjp(lambda *a: f(*a[:4], mask, a[4]), q, k, v, bias, gate)
    eager = (eager_out, pullback(dout))
    compare(eager, numpy_results(inputs), 1e-5, "pallas eager")
    jit_out = jax.jit(f)(q, k, v, bias, mask, gate)
    np.testing.assert_array_equal(np.asarray(jit_out), np.asarray(eager_out))


def test_vmap_over_extra_leading_axis(seed):
    V = 2
    B, S, N, H, d = TRANSFORM_SHAPE
    inputs = random_inputs(seed, (V, B), S, N, H, d)

    def one(q, k, v, bias, mask, gate, dout):
        out, pullback = jax.vjp(lambda *a: _attention()(*a[:4], mask, a[4]), q, k, v, bias, gate)
        return out, pullback(dout)

    result = jax.jit(jax.vmap(one))(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, numpy_results(inputs), 1e-5, "pallas vmap")


def test_checkpoint_and_value_and_grad(seed):
    inputs = random_inputs(seed, *TRANSFORM_SHAPE)
    q, k, v, bias, mask, gate, dout = inputs.args
    ref_out, ref_grads = numpy_results(inputs)

    def loss(q, k, v, bias, gate):
        return jnp.sum(_attention()(q, k, v, bias, mask, gate) * dout)

    argnums = (0, 1, 2, 3, 4)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums))(q, k, v, bias, gate)
    ref_value = float(np.sum(ref_out * helpers.to_f64(dout)))
    assert abs(float(value) - ref_value) <= 1e-5 * np.sum(np.abs(ref_out * helpers.to_f64(dout)))
    for name, g, r in zip(helpers.GRAD_NAMES, grads, ref_grads):
        assert rel_err(g, r) <= 1e-5, (name, rel_err(g, r))

    ckpt_grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums))(q, k, v, bias, gate)
    for name, g, r in zip(helpers.GRAD_NAMES, ckpt_grads, ref_grads):
        assert rel_err(g, r) <= 1e-5, ("checkpoint", name, rel_err(g, r))
        helpers.assert_finite(g, name)


def test_implementation_none_on_cpu_is_xla(seed):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU, implementation=None picks the Pallas kernels")
    inputs = random_inputs(seed, *TRANSFORM_SHAPE)
    auto = jax.tree.leaves(fwd_bwd(None)(*inputs.args))
    xla = jax.tree.leaves(fwd_bwd(XLA)(*inputs.args))
    assert len(auto) == len(xla) == 6
    for a, b in zip(auto, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_deterministic(seed):
    inputs = random_inputs(seed, *TRANSFORM_SHAPE)
    first = jax.tree.leaves(fwd_bwd(PALLAS)(*inputs.args))
    second = jax.tree.leaves(fwd_bwd(PALLAS)(*inputs.args))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- NaN containment, large logits ---------------------------------------------


@pytest.mark.parametrize("implementation", [PALLAS, XLA])
def test_nan_stays_in_its_rows(implementation, seed):
    """A NaN in one query reaches only that query's output; a NaN in one key
    reaches only its (batch, MSA row, head). Forward only."""
    inputs = random_inputs(seed, *TRANSFORM_SHAPE, mask_rate=None)
    q, k, v, bias, mask, gate, _ = inputs.args
    f = jax.jit(_attention(implementation))
    out = np.asarray(f(q.at[1, 2, 5, 1, 3].set(jnp.nan), k, v, bias, mask, gate))
    bad = ~np.isfinite(out)
    assert bad[1, 2, 5, 1].all() and bad.sum() == out.shape[-1]
    out = np.asarray(f(q, k.at[0, 1, 7, 0, 0].set(jnp.nan), v, bias, mask, gate))
    bad = ~np.isfinite(out)
    assert bad[0, 1, :, 0].all() and bad.sum() == bad[0, 1, :, 0].size


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_large_logits_half_precision(dtype, seed):
    """q and k 16x a standard normal: |logits| up to ~1000 and near one-hot
    softmax rows. Nothing overflows in bf16/fp16 and the forward and every
    gradient stay within the half-precision tolerance of float64."""
    batch, S, N, H, d, _, _ = CASES["bf16"]  # same shapes as the bf16/fp16 cases: compiled
    inputs = random_inputs(seed, batch, S, N, H, d, dtype)
    big = lambda x: (x.astype(jnp.float32) * 16).astype(dtype)
    inputs = inputs._replace(q=big(inputs.q), k=big(inputs.k))
    reference = numpy_results(inputs)
    xla = fwd_bwd(XLA)(*inputs.args)
    pallas = fwd_bwd(PALLAS)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(pallas, inputs)
    helpers.assert_shapes_dtypes_finite(xla, inputs)
    compare(xla, reference, tolerance(dtype), f"xla large logits {jnp.dtype(dtype).name}")
    compare(pallas, reference, tolerance(dtype), f"pallas large logits {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_near_one_hot_rows_half_precision(dtype, seed):
    """Every query has one key with +8 in the bias (a different key per query
    and head): softmax rows with a largest weight of ~0.96, where
    `ds = p * (do.v - delta)` is a difference of nearly equal numbers, so delta
    must come from the float32 attention output and from the same rounded
    `do` the kernels use (the gate makes `do = dout * sigmoid(g)` need
    rounding). The kernels' error stays within twice the xla path's (measured:
    0.6 of that bound); a forward that stores its residual output in the input
    dtype, or a delta from the unrounded `do`, gives 1.8 - 3x the bound."""
    batch, S, N, H, d, _, _ = CASES["bf16"]  # same shapes as the bf16/fp16 cases: compiled
    inputs = random_inputs(seed, batch, S, N, H, d, dtype)
    assert inputs.gate is not None
    rng = np.random.default_rng(seed)
    peak = np.zeros(inputs.bias.shape, np.float32)
    for b in range(peak.shape[0]):
        for h in range(H):
            peak[b, h, np.arange(N), rng.permutation(N)] = 8.0
    inputs = inputs._replace(bias=inputs.bias + jnp.asarray(peak))
    probabilities = numpy_reference.probabilities(inputs.q, inputs.k, inputs.bias, inputs.mask)
    assert 0.9 < np.median(probabilities.max(axis=-1)) < 0.99
    reference = numpy_results(inputs)
    name = jnp.dtype(dtype).name
    xla_errors = compare(fwd_bwd(XLA)(*inputs.args), reference, tolerance(dtype), f"xla {name}")
    pallas_errors = compare(fwd_bwd(PALLAS)(*inputs.args), reference, tolerance(dtype),
                            f"pallas {name}")
    helpers.assert_no_worse_than_xla(pallas_errors, xla_errors, dtype, f"near one-hot {name}")


@pytest.mark.parametrize(
    "gate, expect_rounding", [(False, False), (True, True)], ids=["no-gate", "gate"]
)
def test_backward_rounds_do_only_when_it_is_computed(gate, expect_rounding):
    """Without a gate the kernels' `do` is the cotangent itself (already in
    q's dtype): the VJP must pass it through, not write a rounded copy (one
    more [B, S, N, H, d] array in memory). With a gate, `do = dout * sigmoid(g)`
    is new and must be rounded to bf16 before delta sees it."""
    inputs = random_inputs(0, 1, 2, 16, 2, 16, jnp.bfloat16, gate=gate)
    jaxpr = str(jax.make_jaxpr(fwd_bwd(PALLAS))(*inputs.args))
    assert ("reduce_precision" in jaxpr) == expect_rounding
