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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
import numpy_reference

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


def _inputs_to_run(case, implementation, seed):
    """`_inputs`, or a skip where `implementation` does not run `case` here."""
    inputs = _inputs(case, seed)
    if implementation == "mosaic" and inputs.q.dtype == jnp.float32:
        pytest.skip("the Mosaic forward takes 16-bit inputs (float32 runs the Triton forward)")
    if implementation == "mosaic" and case != "end-dead-rows" and jax.default_backend() == "cpu":
        # 40 s in the interpreter; d = 8 pairs, padding in the middle and an
        # all-padding element are held there by the kernels' own tests.
        pytest.skip("one Mosaic case in the interpreter (tests/kernels/mosaic/)")
    return inputs


@pytest.mark.parametrize("implementation", ["mosaic", "triton", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_batches_against_float64(case, implementation, seed):
    inputs = _inputs_to_run(case, implementation, seed)
    dtype = jnp.dtype(inputs.q.dtype)
    result = helpers.fwd_bwd(implementation, skip_padding=True)(*inputs.args)
    for x in (result[0], *result[1]):
        helpers.assert_finite(x)
    helpers.compare(result, helpers.numpy_results(inputs), TOLERANCE[dtype],
                    f"{case} {implementation}", floor=1e-3)
    # The dead rows' gradients of q and k are exactly zero.
    dead = ~np.asarray(inputs.mask).any(axis=-1)
    dq, dk = (helpers.to_f64(g) for g in result[1][:2])
    assert not np.any(dq[dead]) and not np.any(dk[dead])


def _fwd_bwd_with_dropout(implementation, rate, key, skip_padding):
    """`helpers.fwd_bwd` with attention dropout."""

    def run(q, k, v, bias, mask, gate, dout):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation=implementation,
                dropout_rate=rate, dropout_rng=key,
            )

        with msa_pallas.skipping_padding(skip_padding):
            out, pullback = jax.vjp(f, q, k, v, bias, gate)
            return out, pullback(dout)

    return jax.jit(run)


def _check_skipping_with_dropout(inputs, implementation, rate, key, label, *, bitwise):
    """The op with dropout on `inputs`, skipping padding: finite, equal to the
    op visiting every tile (`bitwise`, or to a bf16 step: a float32 rounding
    may move one), and to the float64 reference with the same dropout mask."""
    skipping = _fwd_bwd_with_dropout(implementation, rate, key, True)(*inputs.args)
    visiting = _fwd_bwd_with_dropout(implementation, rate, key, False)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(skipping, inputs)
    for name, x, y in zip(helpers.RESULT_NAMES, jax.tree.leaves(skipping),
                          jax.tree.leaves(visiting)):
        if bitwise:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
        else:
            assert helpers.rel_err(x, y) < 1e-2, name
    batch, rows, n_res, heads, _ = inputs.q.shape
    seeds = msa_pallas.dropout.row_seeds(key, batch, rows, heads)
    drop = (np.asarray(msa_pallas.dropout.keep_mask(seeds, n_res, rate)), rate)
    reference = (numpy_reference.forward(*inputs.args[:6], None, dropout=drop),
                 numpy_reference.vjp(*inputs.args[:6], None, inputs.dout, dropout=drop))
    helpers.compare(skipping, reference, TOLERANCE[jnp.dtype(inputs.q.dtype)], label,
                    floor=1e-3)


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_batches_with_dropout(case, implementation, seed):
    """Skipping with attention dropout: the masked key tiles of live rows
    are skipped and dead rows (their uniform weights dropped too) visited
    by the forward and dk/dv, so the op equals the visiting op (bit for bit
    on the Triton kernels; to float32 rounding on the Mosaic ones, whose
    forward rescales by exp2 of an FMA residue when it passes a masked
    tile) and the float64 reference with the same dropout mask."""
    inputs = _inputs_to_run(case, implementation, seed)
    _check_skipping_with_dropout(inputs, implementation, 0.25, jax.random.key(seed % 1000),
                                 f"{case} {implementation} dropout",
                                 bitwise=implementation == "triton")


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


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["bias-f32", "bias-bf16"])
def test_gpu_padded_crop_with_dropout(bias_dtype, seed):
    """The default kernels (Mosaic on Hopper) at a train-like size, 16 MSA rows
    of the padded crop's mask (a quarter of residues and of rows padding) and
    attention dropout 0.1: skipping equals visiting and the float64 reference
    with the same mask."""
    from benchmarks import shapes

    dims = (1, 16, 256, 8, 32)
    keep = np.asarray(shapes.make_mask(shapes.Shape("padded", dims, mask="padded"),
                                       jax.random.key(0)))
    inputs = helpers.random_inputs(seed, *dims, jnp.bfloat16, bias_dtype=bias_dtype)
    inputs = inputs._replace(mask=jnp.asarray(keep))
    _check_skipping_with_dropout(inputs, None, 0.1, jax.random.key(seed % 1000),
                                 "gpu padded crop dropout", bitwise=False)


def _prologue_config(inputs, prologue_kernel: bool, skip: bool = True):
    """The default block config with the Mosaic backward tiles of the plan
    (skipping or not), `prologue_kernel` set."""
    q, _, _, bias, mask, gate, _ = inputs.args
    with msa_pallas.skipping_padding(skip):
        plan = msa_pallas.explain(q, q, q, bias, mask, gate, implementation="mosaic")
    tiles = msa_pallas.MosaicBackwardTiles(
        **dict(plan.backward_tiles), ping_pong=plan.ping_pong, prologue_kernel=prologue_kernel)
    config = msa_pallas.default_block_config(q.shape[2], q.shape[-1], q.dtype, bias.dtype)
    return dataclasses.replace(config, mosaic_backward=tiles)


def check_prologue_kernel(inputs, name: str, skip: bool = True):
    """The Mosaic kernels, skipping padding or not, with the backward's
    prologue kernel (`kernels.triton.backward_prologue`) in place of XLA's
    passes: the plan takes it, the forward is bit for bit the same, the
    gradients the same up to float32 sums grouped otherwise, and both
    against float64."""
    q, _, _, bias, mask, gate, _ = inputs.args
    configs = {on: _prologue_config(inputs, on, skip) for on in (True, False)}
    with msa_pallas.skipping_padding(skip):
        plans = {on: msa_pallas.explain(q, q, q, bias, mask, gate, implementation="mosaic",
                                        block_config=configs[on]) for on in (True, False)}
    assert plans[True].prologue_kernel and not plans[False].prologue_kernel
    assert "backward prologue" in str(plans[True])
    results = {on: helpers.fwd_bwd("mosaic", block_config=configs[on], skip_padding=skip)(
        *inputs.args) for on in (True, False)}
    (out, grads), (out_xla, grads_xla) = results[True], results[False]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_xla, np.float32))
    for grad, grad_xla, grad_name in zip(grads, grads_xla, ("dq", "dk", "dv", "dbias", "dgate")):
        if grad_xla is None:
            assert grad is None, grad_name
            continue
        helpers.assert_finite(grad, grad_name)
        assert helpers.rel_err(grad, grad_xla) < 2e-3, (name, grad_name)
    helpers.compare(results[True], helpers.numpy_results(inputs), TOLERANCE[jnp.dtype(q.dtype)],
                    f"{name} prologue kernel", floor=1e-3)


@pytest.mark.parametrize("skip,gated", [(True, True), (True, False), (False, True)],
                         ids=["skipping", "skipping-no-gate", "visiting"])
def test_backward_prologue_kernel(skip, gated, seed):
    (batch, rows, n_res, heads, head_dim), dtype, _ = CASES["middle-all-padding-d8"]
    inputs = helpers.random_inputs(seed, batch, rows, 64, 2, 16, dtype)
    keep = helpers.padded_mask(batch, rows, 64, seed, dead=(1, 3), dead_batch=(1,))
    inputs = inputs._replace(mask=jnp.asarray(keep))
    if not gated:
        inputs = inputs._replace(gate=None)
    check_prologue_kernel(inputs, f"prologue skip={skip} gated={gated}", skip=skip)


def test_backward_prologue_kernel_is_not_taken_with_dropout(seed):
    """With dropout (the XLA passes scale `do` and delta for it) the plan
    keeps XLA's passes, skipping or not."""
    inputs = _inputs("end-dead-rows", seed)
    q, _, _, bias, mask, gate, _ = inputs.args
    for skip in (True, False):
        config = _prologue_config(inputs, True, skip)
        with msa_pallas.skipping_padding(skip):
            plan = msa_pallas.explain(q, q, q, bias, mask, gate, implementation="mosaic",
                                      block_config=config, dropout_rate=0.1,
                                      dropout_rng=jax.random.key(0))
        assert not plan.prologue_kernel and "backward prologue" not in str(plan)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["bias-f32", "bias-bf16"])
def test_gpu_backward_prologue_kernel(bias_dtype, seed):
    """At a train-like size with the padded crop's mask (a quarter of the
    residues and rows padding), gated, and d = 8 pairs with a dead batch
    element; skipping padding and visiting it."""
    from benchmarks import shapes

    for dims in ((1, 16, 256, 8, 32), (2, 8, 200, 8, 8)):
        # A writable copy: a batch element is made all padding below.
        keep = np.array(shapes.make_mask(shapes.Shape("padded", dims, mask="padded"),
                                         jax.random.key(seed % 1000)))
        if dims[0] > 1:
            keep[-1] = False  # a batch element all padding
        inputs = helpers.random_inputs(seed, *dims, jnp.bfloat16, bias_dtype=bias_dtype)
        for skip in (True, False):
            check_prologue_kernel(inputs._replace(mask=jnp.asarray(keep)),
                                  f"gpu {dims} skip={skip}", skip=skip)
