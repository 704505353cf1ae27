"""The Mosaic GPU forward kernel (`msa_pallas.kernels.mosaic.forward`) on the
CPU, in the Mosaic GPU interpreter.

Against the float64 NumPy reference and against the Triton forward's
residuals (the Triton backward follows either forward, so their residuals
must agree). The interpreter simulates shared memory, TMA, barriers and the
warpgroups of each CTA; its wgmma takes operands from shared memory only, so
the probabilities-times-V product there is a float32-accumulated `jnp.dot`
of the same 16-bit operands (`_accumulate_product`).

The cases cover several batch elements and heads, MSA-row pairs and query
and key tiles, an odd S (one MSA row per CTA), every head dim. (The
interpreter of jax 0.11.2 hung on this kernel with more than one head and
the residuals saved, unless XLA's concurrency-optimised CPU scheduler is
off, as tests/conftest.py sets.)

The persistent grid (`MosaicTiles.persistent`, one CTA per SM looping over
work items; `pipeline.INTERPRETED_CTAS` CTAs in the interpreter) is checked
bitwise against the grid of one CTA per item, here and on the GPU
(tests/kernels/mosaic/test_gpu.py), and lowered for CUDA in test_forward_plan.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
import pipeline_bounds
import numpy_reference
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.constants import LOG2E
from msa_pallas.kernels.mosaic.logits import accumulator_bias, masked_accumulator_logit
from msa_pallas.kernels.mosaic.support import pad_head_dim
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.triton import forward as triton_forward
from msa_pallas.kernels.vjp import fused_attention
from msa_pallas.reference import MASKED_LOGIT

# Forward-only tolerances of the output against float64 (the bar).
OUT_TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}
SMALL_TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)
FOUR_ROW_TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=4, ping_pong=False)


def run_forward(inputs, tiles=SMALL_TILES, save_stats=True, kernel=mosaic_forward, scale=None):
    """`kernel`'s forward in the interpreter; `scale` defaults to 1 / sqrt(d)."""
    q, k, v, bias, mask, gate, _ = inputs.args
    mask = None if mask is None else mask.astype(jnp.int8)
    if kernel is triton_forward:
        tiles = default_block_config(q.shape[2], q.shape[-1], q.dtype, bias.dtype).forward
    return kernel.attention_forward(
        q, k, v, bias, mask, gate, scale=scale or q.shape[-1] ** -0.5, tiles=tiles,
        interpret=True, save_stats=save_stats,
    )


def check_output(out, inputs, scale, label):
    """`out` against float64 within the issue's bar, and the last MSA row of
    the first batch element, fully masked: uniform weights, the mean of v,
    times the gate."""
    dtype = jnp.dtype(inputs.q.dtype)
    error = helpers.rel_err(out, numpy_reference.forward(*inputs.args[:6], scale=scale))
    print(f"[rel err] {label}: {error:.2e}")
    assert error <= OUT_TOLERANCE[dtype], error
    last = inputs.q.shape[1] - 1
    v_mean = helpers.to_f64(inputs.v[0, last]).mean(axis=0, keepdims=True)
    gate = helpers.to_f64(inputs.gate[0, last])
    np.testing.assert_allclose(
        helpers.to_f64(out[0, last]), v_mean / (1 + np.exp(-gate)),
        rtol=2 * OUT_TOLERANCE[dtype], atol=1e-2,
    )


# (B, S, N, d, q dtype, bias dtype, tiles): pairs of MSA rows per CTA over
# several query and key tiles, an odd S (one row per CTA), every head dim,
# and N that are no whole number of tiles (the last query and key tiles run
# past N) nor of TMA rows (the bias and mask rows are padded): N = 72, and
# N = 8 with a 16-bit bias. Heads: 1 but where HEADS says. (Each work item
# costs about a second in the interpreter: B = 2 only where H = 2.)
CASES = {
    "pairs-bf16": (1, 4, 128, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "odd-S-fp16": (1, 3, 128, 16, jnp.float16, jnp.float16, MosaicTiles(128, 128, 2, 2)),
    "d64": (1, 2, 128, 64, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "d128": (1, 2, 128, 128, jnp.float16, jnp.float32, MosaicTiles(64, 64, 2, 1)),
    "tails-N72": (2, 2, 72, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "N8-fp16": (1, 2, 8, 16, jnp.float16, jnp.float16, SMALL_TILES),
    # N no multiple of 8 (`support.takes_any_n`): the bias rows padded to 8.
    "any-N37": (2, 2, 37, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "any-N100-odd-S-fp16": (1, 3, 100, 16, jnp.float16, jnp.float16, SMALL_TILES),
    # Four consumers (MSA rows) per CTA, sharing each bias tile.
    "four-rows-bf16": (1, 8, 128, 32, jnp.bfloat16, jnp.float32, FOUR_ROW_TILES),
}
HEADS = {"pairs-bf16": 3, "tails-N72": 2, "any-N37": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_against_float64_and_triton_residuals(case, seed):
    batch, rows, n_res, head_dim, dtype, bias_dtype, tiles = CASES[case]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, HEADS.get(case, 1), head_dim, dtype, bias_dtype=bias_dtype,
        fully_masked_row=(0, rows - 1),
    )
    out, attention, row_max, row_log2_sum = run_forward(inputs, tiles)
    helpers.assert_finite(out, "out")
    check_output(out, inputs, head_dim**-0.5, f"mosaic forward {case}")

    _, t_attention, t_row_max, t_row_log2_sum = run_forward(inputs, kernel=triton_forward)
    np.testing.assert_allclose(row_max, t_row_max, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(row_log2_sum, t_row_log2_sum, rtol=1e-5, atol=1e-5)
    assert helpers.rel_err(attention, t_attention) < 1e-2


# (B, S, N, H, q dtype, bias dtype, tiles) with d = 8: two heads per tile
# (`heads.pairs_heads`), H = 2: one pair (two pairs in the backward's
# tests/kernels/mosaic/test_backward.py::test_several_heads_and_batch_elements).
PAIRED_CASES = {
    "pair-B2-bf16": (2, 2, 128, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "pair-odd-S-N72-fp16": (1, 3, 72, jnp.float16, jnp.float16, SMALL_TILES),
    "pair-any-N44-bf16": (1, 2, 44, jnp.bfloat16, jnp.float32, SMALL_TILES),
}


@pytest.mark.parametrize("case", list(PAIRED_CASES))
def test_paired_heads_equal_the_padded_head_dim(case, seed):
    """d = 8 with an even H: the kernel reads q, k, v and the gate as they
    are, two heads per 16-wide tile, with the other head's half of each q
    tile zeroed. Its products then add exactly the terms of d = 8 zero-padded
    to 16, so every result, residuals included, equals the padded inputs'
    bitwise; and the output matches float64, with uniform weights in a
    fully masked row."""
    batch, rows, n_res, dtype, bias_dtype, tiles = PAIRED_CASES[case]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, 2, 8, dtype, bias_dtype=bias_dtype,
        fully_masked_row=(0, rows - 1),
    )
    paired = run_forward(inputs, tiles)
    assert paired[0].shape == paired[1].shape == inputs.q.shape
    # Head by head: each head padded alone is the reference of its columns.
    for head in range(2):
        one_head = lambda x: pad_head_dim(x[..., head : head + 1, :])  # noqa: E731
        padded = run_forward(
            inputs._replace(
                q=one_head(inputs.q), k=one_head(inputs.k), v=one_head(inputs.v),
                gate=one_head(inputs.gate), bias=inputs.bias[:, head : head + 1],
            ),
            tiles, scale=8**-0.5,
        )
        for name, x, y in zip(("out", "attention"), paired, padded):
            np.testing.assert_array_equal(x[..., head : head + 1, :], y[..., :8], err_msg=name)
        for name, x, y in zip(("row_max", "row_log2_sum"), paired[2:], padded[2:]):
            np.testing.assert_array_equal(x[:, :, head : head + 1], y, err_msg=name)

    check_output(paired[0], inputs, 8**-0.5, f"mosaic forward, paired heads, {case}")


@pytest.mark.parametrize(
    "case",
    [(2, 3, 72, 2, 32, jnp.bfloat16), (1, 4, 128, 4, 8, jnp.float32),
     (2, 2, 37, 2, 32, jnp.float32)],
    ids=["B2-S3-N72-H2-d32-bias-bf16", "H4-d8-pairs", "B2-N37-any-n"],
)
def test_persistent_grid_equals_one_cta_per_item(case, seed):
    """Each persistent CTA runs several work items (of every batch element,
    head and MSA-row pair), loading the next item's q and gate tiles early
    and keeping the ring's phases across items: its results and residuals
    are bitwise those of one CTA per item. The first case has one 128-key
    tile, fewer than the ring's stages, so a CTA's second item still finds
    a slot that no step has used; the third has N = 37, no multiple of 8."""
    batch, rows, n_res, heads, head_dim, bias_dtype = case
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16, bias_dtype=bias_dtype,
        fully_masked_row=(0, 1),
    )
    tiles = mosaic_forward.default_tiles(
        inputs.q.shape, inputs.q.dtype, bias_dtype, save_stats=True, has_gate=True,
        persistent=True,
    )
    assert tiles.persistent
    persistent = run_forward(inputs, tiles)
    per_item = run_forward(inputs, dataclasses.replace(tiles, persistent=False))
    for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), persistent, per_item):
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "one-cta-per-item"])
def test_key_loop_between_runtime_bounds(persistent, seed):
    """Each work item's key loop runs between bounds known only at run time
    (`pipeline_bounds.strict_key_bounds`: 1 to 3 of the 3 key tiles, from
    tile 0 or 1), the ring's slots and barrier phases carried from item to
    item by the count of steps taken: with the persistent grid (3 CTAs in
    the interpreter, four items each) a slot or phase off by one step would
    pair an item with another item's tiles, or stall. The output matches
    float64 over each item's keys, and the persistent grid's results are
    bitwise those of one CTA per item."""
    inputs = helpers.random_inputs(seed, 1, 4, 136, 2, 16, jnp.bfloat16, mask_rate=0.1)
    tiles = dataclasses.replace(SMALL_TILES, persistent=persistent)
    q, k, v, bias, mask, gate, _ = inputs.args
    forward = functools.partial(
        mosaic_forward.attention_forward, scale=0.25, interpret=True, save_stats=True,
        key_bounds=pipeline_bounds.strict_key_bounds,
    )
    result = forward(q, k, v, bias, mask.astype(jnp.int8), gate, tiles=tiles)
    expected = pipeline_bounds.forward_between_key_bounds(inputs, 0.25, SMALL_TILES.msa_rows)
    error = helpers.rel_err(result[0], expected)
    assert error <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)], error
    if persistent:
        per_item = forward(
            q, k, v, bias, mask.astype(jnp.int8), gate,
            tiles=dataclasses.replace(tiles, persistent=False),
        )
        for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), result, per_item):
            np.testing.assert_array_equal(
                np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
            )


@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128])
def test_masked_logit_is_exact_in_base_2(head_dim):
    """The kernel's masked logit is a power of two in the units of `q . k`, at
    least AlphaFold's 1e9 in magnitude once scaled (and the first such one), so
    its base-2 value is an exact float32 product: a fully masked row's logits
    minus their max are exactly 0."""
    scale = head_dim**-0.5
    masked = masked_accumulator_logit(scale)
    assert masked * scale <= MASKED_LOGIT < masked * scale / 2
    to_log2 = np.float32(scale * LOG2E)
    assert float(np.float32(masked) * to_log2) == float(np.float32(masked)) * float(to_log2)


def test_bias_enters_in_the_units_of_q_dot_k():
    """A 32-bit bias is divided by the scale once per call; a 16-bit one is
    left for the kernels, which divide it in float32 (exact)."""
    bias = jax.random.normal(jax.random.key(0), (1, 2, 8, 8), jnp.float32) * 4
    np.testing.assert_allclose(accumulator_bias(bias, 0.125), bias * 8, rtol=1e-7)
    half = bias.astype(jnp.bfloat16)
    assert accumulator_bias(half, 0.125) is half


def test_without_residuals_equals_with(seed):
    inputs = helpers.random_inputs(seed, 1, 2, 128, 1, 32, jnp.bfloat16)
    alone = run_forward(inputs, save_stats=False)
    with_stats = run_forward(inputs, save_stats=True)[0]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(with_stats))


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_plain_bias_loads_change_nothing(bias_dtype, seed):
    """`MosaicTiles.staggered_bias` off reads each lane's own bias elements:
    the same values, so the same outputs and residuals, bitwise (the
    compiled kernels: tests/kernels/mosaic/test_gpu.py)."""
    inputs = helpers.random_inputs(
        seed, 1, 2, 128, 2, 32, jnp.bfloat16, bias_dtype=bias_dtype, fully_masked_row=(0, 1)
    )
    staggered = run_forward(inputs)
    plain = run_forward(inputs, tiles=dataclasses.replace(SMALL_TILES, staggered_bias=False))
    for name, a, b in zip(("out", "attention", "row_max", "row_log2_sum"), staggered, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_no_mask_no_gate(seed):
    inputs = helpers.random_inputs(seed, 1, 2, 128, 1, 16, jnp.bfloat16, mask_rate=None, gate=False)
    out = run_forward(inputs, save_stats=False)
    expected = numpy_reference.forward(*inputs.args[:6], scale=16**-0.5)
    assert helpers.rel_err(out, expected) <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)]


def test_nan_stays_in_its_row(seed):
    """A NaN in one MSA row's q reaches that row's queries only."""
    inputs = helpers.random_inputs(seed, 1, 4, 128, 1, 32, jnp.bfloat16)
    inputs = inputs._replace(q=inputs.q.at[0, 1, 5].set(jnp.nan))
    out = np.asarray(run_forward(inputs, save_stats=False).astype(jnp.float32))
    assert np.isnan(out[0, 1, 5]).all()
    bad = np.isnan(out)
    bad[0, 1, 5] = False
    assert not bad.any()


def test_triton_backward_follows_the_mosaic_forward(seed):
    """Either backward follows either forward (`kernels.vjp`): the Mosaic
    forward and the Triton backward on its residuals; the gradients match
    float64."""
    inputs = helpers.random_inputs(seed, 1, 2, 128, 1, 32, jnp.bfloat16, fully_masked_row=True)
    q, k, v, bias, mask, gate, dout = inputs.args
    triton = msa_pallas.explain(q, k, v, bias, mask, gate, implementation="triton")
    plan = dataclasses.replace(triton, forward="mosaic", forward_tiles=SMALL_TILES)
    assert plan.interpret

    def op(q, k, v, bias, gate):
        return fused_attention(q, k, v, bias, mask.astype(jnp.int8), gate, None, 32**-0.5, plan)

    out, pullback = jax.vjp(op, q, k, v, bias, gate)
    result = (out, pullback(dout))
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, helpers.numpy_results(inputs), helpers.tolerance(q.dtype), "mosaic fwd, triton bwd"
    )
