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
(tests/test_mosaic_gpu.py), and lowered for CUDA here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import helpers
import mosaic_lowering
import msa_pallas
import pipeline_bounds
import numpy_reference
from msa_pallas.attention import resolve_implementation
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.constants import LOG2E
from msa_pallas.kernels.mosaic.logits import accumulator_bias, masked_accumulator_logit
from msa_pallas.kernels.mosaic.smem import (
    MAX_SHARED_MEMORY, row_tile, row_view_names, smem_tile, split_tiles,
)
from msa_pallas.kernels.mosaic.support import HEAD_DIMS, pad_head_dim, supports
from msa_pallas.kernels.mosaic.plan import forward_plan
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.triton import forward as triton_forward
from msa_pallas.kernels.vjp import fused_attention
from msa_pallas.reference import MASKED_LOGIT

# Forward-only tolerances of the output against float64 (the bar).
OUT_TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}
SMALL_TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)


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
# N = 8 with a 16-bit bias. Heads: 1 but where HEADS says.
CASES = {
    "pairs-bf16": (2, 4, 128, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "odd-S-fp16": (1, 3, 128, 16, jnp.float16, jnp.float16, MosaicTiles(128, 128, 2, 2)),
    "d64": (1, 2, 128, 64, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "d128": (1, 2, 128, 128, jnp.float16, jnp.float32, MosaicTiles(64, 64, 2, 1)),
    "tails-N72": (2, 2, 72, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "N8-fp16": (1, 2, 8, 16, jnp.float16, jnp.float16, SMALL_TILES),
    # N no multiple of 8 (`support.takes_any_n`): the bias rows padded to 8.
    "any-N37": (2, 2, 37, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "any-N100-odd-S-fp16": (1, 3, 100, 16, jnp.float16, jnp.float16, SMALL_TILES),
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
# tests/test_mosaic_backward.py::test_several_heads_and_batch_elements).
PAIRED_CASES = {
    "pair-bf16": (2, 4, 128, jnp.bfloat16, jnp.float32, SMALL_TILES),
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


@pytest.mark.parametrize(
    "dtype, n_res",
    [(jnp.bfloat16, 128), (jnp.float32, 72), (jnp.bfloat16, 37), (jnp.float32, 37)],
)
def test_op_gradients_through_the_mosaic_kernels(dtype, n_res, seed):
    """`implementation="mosaic"`: the Mosaic forward's residuals feed the
    Mosaic backward kernels; the gradients match float64. float32: the
    Triton forward and the Mosaic backward on bf16 pieces, within float32's
    tolerance. N = 37, no multiple of 8: the row tiles of every kernel
    (float32: of every bf16 piece) through `smem.unaligned_row_tile`
    (compiled; here as 8-row tiles)."""
    inputs = helpers.random_inputs(seed, 1, 2, n_res, 1, 32, dtype, fully_masked_row=True)
    result = helpers.fwd_bwd("mosaic")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(result, helpers.numpy_results(inputs), helpers.tolerance(dtype), "mosaic")
    # The fully masked row passes no gradient to its q and k.
    _, (dq, dk, *_) = result
    assert not np.asarray(dq[0, 0]).any() and not np.asarray(dk[0, 0]).any()


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
        return fused_attention(q, k, v, bias, mask.astype(jnp.int8), gate, 32**-0.5, plan)

    out, pullback = jax.vjp(op, q, k, v, bias, gate)
    result = (out, pullback(dout))
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, helpers.numpy_results(inputs), helpers.tolerance(q.dtype), "mosaic fwd, triton bwd"
    )


def compiled_forward(
    n_res, head_dim, bias_dtype, tiles=None, has_mask=True, has_gate=True, save_stats=True,
    **tile_changes,
):
    """The compiled forward at (1, 4, N, 8, d) bf16, with or without a mask,
    a gate and the residuals, with `tiles` (default: the default tiles)
    changed by `tile_changes`: (the function, its arguments as
    `jax.ShapeDtypeStruct`s, its plan)."""
    shape = (1, 4, n_res, 8, head_dim)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, n_res, n_res), bias_dtype)
    mask = jax.ShapeDtypeStruct((1, 4, n_res), jnp.int8) if has_mask else None
    gate = q if has_gate else None
    if tiles is None:
        tiles = mosaic_forward.default_tiles(
            shape, jnp.bfloat16, bias_dtype, save_stats=save_stats, has_gate=has_gate
        )
    tiles = dataclasses.replace(tiles, **tile_changes)
    forward = lambda q, k, v, bias, mask, gate: mosaic_forward.attention_forward(  # noqa: E731
        q, k, v, bias, mask, gate, scale=0.2, tiles=tiles, interpret=False,
        save_stats=save_stats,
    )
    plan = forward_plan(
        shape, jnp.bfloat16, bias_dtype, tiles, mask_dtype=jnp.int8 if has_mask else None,
        gate_dtype=jnp.bfloat16 if has_gate else None, save_stats=save_stats, interpret=False,
        skips_masked=has_mask,
    )
    return forward, (q, q, q, bias, mask, gate), plan


def lowered_for_cuda(n_res, head_dim, bias_dtype, **tile_changes) -> str:
    """The forward with its residuals, a mask and a gate (`compiled_forward`)
    lowered for CUDA on this machine: its text."""
    forward, args, _ = compiled_forward(n_res, head_dim, bias_dtype, **tile_changes)
    return mosaic_lowering.lowered_for_cuda(forward, *args)


@pytest.mark.parametrize("head_dim", [32, 8])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("n_res, bias_dtype", [(256, jnp.float32), (200, jnp.bfloat16)])
def test_lowers_for_the_gpu_on_a_cpu(n_res, bias_dtype, persistent, head_dim):
    """The kernel, with one CTA per work item and persistent, and with two
    heads per tile (d = 8), lowers for
    CUDA on a machine without one (Mosaic GPU's own lowering, layouts and
    TMA descriptors included, runs at trace time): a
    shape error, an unsupported layout or a misaligned GMEM row fails here,
    not first on the GPU. N = 200 is no whole number of tiles, and its bias
    rows are no whole number of 128-byte TMA rows until padded."""
    assert "mosaic_gpu" in lowered_for_cuda(n_res, head_dim, bias_dtype, persistent=persistent)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize(
    "n_res, head_dim, bias_dtype",
    [
        (37, 32, jnp.bfloat16), (100, 32, jnp.float32),
        (203, 8, jnp.bfloat16), (203, 16, jnp.float32), (333, 64, jnp.float32),
    ],
)
def test_lowers_for_any_n_on_a_cpu(n_res, head_dim, bias_dtype, persistent):
    """N no multiple of 8 lowers for CUDA: the row tiles' TMA copies go
    through untiled views (`smem.unaligned_row_tile`; at d = 64 the float32
    residual as two column pieces); through the 8-row tiled ones Mosaic GPU
    refuses such N at this point ("must have size smaller or a multiple of
    its tiling 8")."""
    assert "mosaic_gpu" in lowered_for_cuda(n_res, head_dim, bias_dtype, persistent=persistent)


def test_row_tiles_are_view_pairs_one_swizzle_wide():
    """`smem.row_tile` at N no multiple of 8: a row up to one swizzle wide
    is one pair of views (16-bit d <= 64, float32 d <= 32); a wider row
    (float32 d = 64) is one pair per 128-byte column piece; and
    `row_view_names` finds both kinds, and `split_tiles`' bf16 pieces."""
    assert isinstance(row_tile((2, 64, 64), jnp.bfloat16, True), plgpu.RefUnion)
    assert isinstance(row_tile((2, 64, 32), jnp.float32, True), plgpu.RefUnion)
    pieces = row_tile((2, 64, 64), jnp.float32, True)
    assert isinstance(pieces, tuple) and len(pieces) == 2
    assert all(isinstance(piece, plgpu.RefUnion) for piece in pieces)
    aligned = row_tile((2, 64, 64), jnp.float32, False)
    assert not isinstance(aligned, (tuple, plgpu.RefUnion))
    smem = {
        "residual": pieces,
        "q": row_tile((2, 64, 16), jnp.float16, True),
        "k_pieces": split_tiles((2, 64, 32), jnp.float32, 3, True),
        "bias": smem_tile((2, 64, 64), jnp.float32),
        "k_heads": tuple(smem_tile((2, 64, 16), jnp.bfloat16) for _ in range(2)),
    }
    assert row_view_names(smem) == ("residual", "q", "k_pieces")


@pytest.mark.parametrize(
    "n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats",
    [
        (256, 32, jnp.float32, MosaicTiles(128, 64, 2, 2, persistent=True), True, True, True),
        (256, 32, jnp.bfloat16, MosaicTiles(64, 128, 3, 1), False, False, False),
        (200, 8, jnp.bfloat16, MosaicTiles(128, 64, 2, 2), True, True, True),
        (333, 64, jnp.float32, MosaicTiles(64, 64, 2, 2, persistent=True), True, False, True),
        (37, 16, jnp.float32, MosaicTiles(64, 64, 2, 2), False, True, False),
    ],
    ids=["d32-persistent", "d32-one-row-3-stages", "d8-pairs", "N333-d64-views", "N37-d16"],
)
def test_plan_bytes_are_what_the_lowered_kernel_allocates(
    n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats
):
    """`plan.forward_plan`'s shared-memory bytes are those Mosaic GPU's lowering
    asks for at launch: every spec (two heads per tile's q copies, the row
    views of N no multiple of 8, the float32 residual's column pieces, the
    persistent output tile) and barrier is in the plan, aligned as Mosaic
    GPU aligns it."""
    forward, args, plan = compiled_forward(
        n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats
    )
    assert mosaic_lowering.lowered_shared_memory(forward, *args) == plan.shared_memory_bytes


def test_barrier_arrivals_count_the_copies():
    """Each `produced` barrier awaits one arrival per copy: per consumer its
    q and gate tiles; per ring step each consumer's K tile and mask vector
    and each head's bias tile, and each consumer's V tile."""
    shape = (1, 4, 128, 2, 8)
    plan = forward_plan(
        shape, jnp.bfloat16, jnp.float32, SMALL_TILES, mask_dtype=jnp.int8,
        gate_dtype=jnp.bfloat16, save_stats=True, interpret=True,
    )
    assert {name: plan.arrivals(name) for name in plan.copies} == {"q": 2, "k": 2 + 2 + 2, "v": 2}
    produced, consumed, turn = plan.barriers()
    assert produced["k"].num_arrivals == 6 and produced["q"].num_arrivals == 2
    assert consumed["v"].num_arrivals == 2 and len(turn) == 1
    no_mask = forward_plan(
        shape, jnp.bfloat16, jnp.float32, SMALL_TILES, mask_dtype=None, gate_dtype=None,
        save_stats=False, interpret=True,
    )
    assert no_mask.arrivals("q") == 1 and no_mask.arrivals("k") == 2 + 2


@pytest.mark.parametrize("head_dim", (8, *HEAD_DIMS))
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("save_stats", [False, True])
def test_default_tiles_fit_shared_memory(head_dim, bias_dtype, save_stats):
    """The default tiles' kernel, lowered with a mask and a gate, asks for
    no more shared memory than a CTA has, as its plan says."""
    forward, args, plan = compiled_forward(256, head_dim, bias_dtype, save_stats=save_stats)
    used = mosaic_lowering.lowered_shared_memory(forward, *args)
    assert used == plan.shared_memory_bytes <= MAX_SHARED_MEMORY
    tiles = mosaic_forward.default_tiles(
        (1, 4, 256, 8, head_dim), jnp.bfloat16, bias_dtype, save_stats
    )
    if head_dim == 8:
        assert tiles == MosaicTiles(128, 64, 2, 2, persistent=True)
    # The preferred (largest) tiles are taken where they fit, persistent.
    if 16 <= head_dim <= 32 and jnp.dtype(bias_dtype).itemsize == 2:
        assert tiles == MosaicTiles(128, 128, 2, 2, persistent=True)
    if head_dim == 32 and jnp.dtype(bias_dtype).itemsize == 4 and save_stats:
        assert tiles == MosaicTiles(128, 64, 2, 2, persistent=True)
    assert not mosaic_forward.default_tiles(
        (1, 4, 256, 8, head_dim), jnp.bfloat16, bias_dtype, save_stats, persistent=False
    ).persistent


@pytest.mark.parametrize(
    "shape, dtype, bias_dtype, fragment",
    [
        ((1, 2, 64, 4, 128), jnp.float32, jnp.float32, "head dim 128 in float32"),
        ((1, 2, 128, 4, 24), jnp.bfloat16, jnp.float32, "head dim 24"),
        ((1, 2, 100, 4, 128), jnp.bfloat16, jnp.bfloat16, "N=100"),
    ],
)
def test_unsupported_inputs_raise_naming_the_reason(shape, dtype, bias_dtype, fragment):
    q = jnp.ones(shape, dtype)
    bias = jnp.ones((shape[0], shape[3], shape[2], shape[2]), bias_dtype)
    with pytest.raises(ValueError, match=fragment):
        msa_pallas.msa_row_attention(q, q, q, bias, implementation="mosaic")


def test_n_a_multiple_of_8_is_supported():
    for n_res in (8, 64, 72, 200, 320):
        assert supports((1, 2, n_res, 4, 32), jnp.bfloat16, jnp.float32) is None, n_res
    for n_res in (0, 100, 333):
        assert "multiple of 8" in supports((1, 2, n_res, 4, 128), jnp.bfloat16, jnp.float32)


def test_any_n_for_d_up_to_64():
    for head_dim in (8, 16, 32, 64):
        for n_res in (1, 37, 100, 333):
            assert supports((1, 2, n_res, 4, head_dim), jnp.float16, jnp.float32) is None
    # float32: the backward's bf16 pieces, d <= 64.
    for head_dim in (8, 32, 64):
        assert supports((1, 2, 100, 4, head_dim), jnp.float32, jnp.float32) is None
    assert "multiple of 8" in supports((1, 2, 100, 4, 128), jnp.bfloat16, jnp.float32)
    assert "multiple of 8" in supports((1, 2, 0, 4, 32), jnp.bfloat16, jnp.float32)
    assert "bias dtype int8" in supports((1, 2, 64, 4, 32), jnp.bfloat16, jnp.int8)


def test_forward_kernel_refuses_float32():
    """float32 runs the Triton forward; the Mosaic forward kernel says so."""
    q = jnp.ones((1, 2, 64, 1, 32), jnp.float32)
    bias = jnp.ones((1, 1, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="takes bfloat16 / float16"):
        mosaic_forward.attention_forward(
            q, q, q, bias, None, None, scale=0.2, tiles=SMALL_TILES, interpret=True,
            save_stats=False,
        )


def test_tiles_validate_their_fields():
    with pytest.raises(ValueError, match="block_q"):
        MosaicTiles(block_q=32)
    with pytest.raises(ValueError, match="block_k"):
        MosaicTiles(block_k=96)
    for msa_rows in (3, 4):
        with pytest.raises(ValueError, match="msa_rows"):
            MosaicTiles(msa_rows=msa_rows)
    assert MosaicTiles(msa_rows=2).msa_rows_for(5) == 1
