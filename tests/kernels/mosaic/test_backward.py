"""The Mosaic GPU backward kernels (`msa_pallas.kernels.mosaic.backward`) on
the CPU, in the Mosaic GPU interpreter.

Each kernel is fed the residuals of the Triton forward and checked against
the float64 NumPy gradients; the op's gradients through
`implementation="mosaic"` (Mosaic forward and backward) are checked in
tests/kernels/mosaic/test_forward.py. The interpreter's wgmma takes operands from
shared memory only, so the products with an operand in registers are
float32-accumulated `jnp.dot`s of the same 16-bit operands there
(`matmul.accumulate_products`).

Most cases have one batch element and one head and cover the other axes:
MSA-row pairs and odd S, several query and key tiles, head dims 16, 32 and
128, row chunks of the bias gradient; `test_several_heads_and_batch_elements`
runs B * H > 1. (The interpreter of jax 0.11.2 hangs on B * H > 1, and on
the dbias kernel with two consumers and a 16-bit bias, unless XLA's
concurrency-optimised CPU scheduler is off, as tests/conftest.py sets.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import pipeline_bounds
import numpy_reference
from msa_pallas import block_sizes
from msa_pallas.block_sizes import default_block_config, row_chunks
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.constants import FLOAT32_PIECES
from msa_pallas.kernels.mosaic.matmul import split_float32
from msa_pallas.kernels.mosaic.plan import dbias_plan
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles
from msa_pallas.kernels.triton import forward as triton_forward

SMALL = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)
SMALL_TILES = MosaicBackwardTiles(dkdv=SMALL, dq=SMALL, dbias=SMALL)
# The default tiles of d <= 32 with one dbias consumer (see the module docstring).
ONE_DBIAS_CONSUMER = MosaicBackwardTiles(
    dbias=MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=1), ping_pong=True
)


def run_backward(operands, scale, tiles: MosaicBackwardTiles):
    bound = dict(scale=scale, interpret=True)
    dk, dv = mosaic_backward.backward_dkdv(
        *operands, tiles=tiles.dkdv, ping_pong=tiles.ping_pong, **bound
    )
    dq = mosaic_backward.backward_dq(*operands, tiles=tiles.dq, ping_pong=tiles.ping_pong, **bound)
    dbias = mosaic_backward.backward_dbias(*operands, tiles=tiles.dbias, **bound)
    return dq, dk, dv, dbias


# (S, N, d, q dtype, bias dtype, tiles): MSA-row pairs over several query
# and key tiles, an odd S (one row per CTA) with a 16-bit bias and the
# default dk/dv and dq tiles of d = 16, d = 128 with its default tiles, and
# an N that is no whole number of tiles nor of TMA rows (N = 72: the last
# query and key tiles run past N, the bias and mask rows are padded), and
# float32 inputs split into bf16 pieces, with MSA-row pairs and with the
# float32 default tiles at an odd S.
# Turns on and off: test_ping_pong_changes_nothing; other head dims' tiles:
# test_backward_plan.py.
CASES = {
    "pairs-bf16-ping-pong": (4, 128, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "odd-S-fp16": (3, 128, 16, jnp.float16, jnp.float16, ONE_DBIAS_CONSUMER),
    "d128-defaults": (2, 128, 128, jnp.float16, jnp.float32, None),
    "tails-N72": (2, 72, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    # float32: three bf16 pieces per operand, six products per product.
    "float32-pieces": (2, 72, 32, jnp.float32, jnp.float32, SMALL_TILES),
    "float32-defaults-d16": (3, 64, 16, jnp.float32, jnp.float32, None),
    # N no multiple of 8 (`support.takes_any_n`): the statistics padded to
    # whole TMA strides, the bias rows to 8, the dbias rows sliced.
    "any-N37": (2, 37, 32, jnp.bfloat16, jnp.float32, SMALL_TILES),
    "any-N101-odd-S-fp16": (3, 101, 16, jnp.float16, jnp.float16, ONE_DBIAS_CONSUMER),
    "float32-any-N45": (2, 45, 32, jnp.float32, jnp.float32, SMALL_TILES),
}


def check_gradients(gradients, inputs, scale: float, label: str) -> None:
    """dq, dk, dv and dbias finite, of the reference's shapes, and within the
    dtype's tolerance of the float64 NumPy gradients."""
    q, k, v, bias, mask, _, dout = inputs.args
    expected = numpy_reference.vjp(q, k, v, bias, mask, None, scale, dout)[:4]
    errors = {}
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), gradients, expected):
        helpers.assert_finite(got, name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        errors[name] = helpers.rel_err(got, want)
    print(f"[rel err] {label}: {errors}")
    tolerance = helpers.tolerance(q.dtype)
    assert all(e <= tolerance for e in errors.values()), errors


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_against_float64(case, seed):
    rows, n_res, head_dim, dtype, bias_dtype, tiles = CASES[case]
    inputs = helpers.random_inputs(
        seed, 1, rows, n_res, 1, head_dim, dtype, bias_dtype=bias_dtype, gate=False,
        fully_masked_row=(0, rows - 1),
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    if tiles is None:
        tiles = mosaic_backward.default_tiles(inputs.q.shape, dtype, bias_dtype)
    dq, dk, dv, dbias = run_backward(operands, scale, tiles)
    check_gradients((dq, dk, dv, dbias), inputs, scale, f"mosaic backward {case}")
    dout = inputs.args[-1]
    assert dq.dtype == dk.dtype == dv.dtype == dtype and dbias.dtype == jnp.float32
    # The fully masked row: no gradient reaches its q and k, and its uniform
    # weights give every key's v the mean of the row's cotangents.
    assert not np.asarray(dq[0, rows - 1]).any() and not np.asarray(dk[0, rows - 1]).any()
    dv_row = helpers.to_f64(dout[0, rows - 1]).mean(axis=0, keepdims=True)
    np.testing.assert_allclose(
        helpers.to_f64(dv[0, rows - 1]), np.broadcast_to(dv_row, dv.shape[2:]),
        rtol=2e-2, atol=2e-2,
    )


@pytest.mark.parametrize(
    "batch, heads, head_dim, bias_dtype",
    [(2, 2, 32, jnp.bfloat16), (1, 4, 8, jnp.float32)],
    ids=["B2-H2-d32-bias-bf16", "H4-d8-two-pairs"],
)
def test_several_heads_and_batch_elements(batch, heads, head_dim, bias_dtype, seed):
    """B * H > 1: two batch elements and two heads (the dbias kernel with two
    consumers and a 16-bit bias), then four heads of d = 8, two pairs per
    tile; N past the last whole tile, a fully masked row."""
    inputs = helpers.random_inputs(
        seed, batch, 2, 72, heads, head_dim, jnp.bfloat16, bias_dtype=bias_dtype, gate=False,
        fully_masked_row=(batch - 1, 1),
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    gradients = run_backward(operands, scale, SMALL_TILES)
    check_gradients(gradients, inputs, scale, f"mosaic backward B={batch} H={heads} d={head_dim}")


def _dbias_against_float64(rows: int, seed, label: str, chunks: int):
    """The dbias kernel (one consumer) at S = `rows` on two tiles, with a dead
    row, against float64; its grid holds `chunks` row chunks."""
    tiles = ONE_DBIAS_CONSUMER.dbias
    inputs = helpers.random_inputs(
        seed, 1, rows, 128, 1, 16, jnp.bfloat16, gate=False, fully_masked_row=(0, 5)
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    plan = dbias_plan(inputs.q.shape, jnp.bfloat16, inputs.bias.dtype, tiles,
                      mask_dtype=jnp.int8, interpret=True)
    assert plan.grid[-1] == chunks  # chunks x batch x heads
    dbias = mosaic_backward.backward_dbias(*operands, scale=scale, tiles=tiles, interpret=True)
    q, k, v, bias, mask, _, dout = inputs.args
    expected = numpy_reference.vjp(q, k, v, bias, mask, None, scale, dout)[3]
    error = helpers.rel_err(dbias, expected)
    print(f"[rel err] mosaic dbias over {label}: {error:.2e}")
    assert error <= helpers.tolerance(jnp.bfloat16), error


def test_bias_gradient_over_row_chunks(seed):
    """S = 34 on two tiles: two row chunks of 17 rows each, so the dbias
    kernel's loop over rows and the sum of the chunks both run."""
    assert row_chunks(2, 34) == 2
    _dbias_against_float64(34, seed, "row chunks", chunks=2)


def test_bias_gradient_over_uneven_row_chunks(seed, monkeypatch):
    """S = 35 in 3 row chunks (11, 12 and 12 rows: chunks need not divide S,
    `block_sizes.row_chunks_in_waves`), a dead row in the first: the
    chunks' rows computed at run time, against float64."""
    monkeypatch.setattr(block_sizes, "row_chunks_in_waves", lambda programs, rows, slots: 3)
    _dbias_against_float64(35, seed, "uneven row chunks", chunks=3)


def spy_head_dims(monkeypatch, forward_module) -> list:
    """Records `(kernel, head dim of its q)` of every call of
    `forward_module.attention_forward` and of the three Mosaic backward
    kernels, in order, into the list it returns."""
    seen = []

    def spy(module, name):
        kernel = getattr(module, name)

        def spied(q, *args, **kwargs):
            seen.append((name, q.shape[-1]))
            return kernel(q, *args, **kwargs)

        monkeypatch.setattr(module, name, spied)

    spy(forward_module, "attention_forward")
    for name in ("backward_dkdv", "backward_dq", "backward_dbias"):
        spy(mosaic_backward, name)
    return seen


@pytest.mark.parametrize("heads", [1, 2])
def test_op_takes_head_dim_8(heads, seed, monkeypatch):
    """`implementation="mosaic"` with d = 8 (AlphaFold2's extra-MSA stack).
    An even H: every kernel reads q, k, v (and `do`) as they are, two heads
    per 16-wide tile. An odd H: the op zero-pads q, k, v and the gate to 16
    for the forward kernel, the backward kernels read them padded to 16,
    and refuse d = 8 themselves. Output and gradients keep d = 8 and match
    float64."""
    tile_width = 8 if heads % 2 == 0 else 16
    seen = spy_head_dims(monkeypatch, mosaic_forward)
    inputs = helpers.random_inputs(seed, 1, 2, 128, heads, 8, jnp.bfloat16, fully_masked_row=True)
    result = helpers.fwd_bwd("mosaic")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, helpers.numpy_results(inputs), helpers.tolerance(jnp.bfloat16),
        f"mosaic d=8 H={heads}",
    )
    assert seen == [("attention_forward", tile_width), ("backward_dkdv", tile_width),
                    ("backward_dq", tile_width), ("backward_dbias", tile_width)], seen
    if heads % 2:
        operands, scale = helpers.mosaic_backward_operands(inputs._replace(gate=None))
        with pytest.raises(ValueError, match="pad it to 16"):
            mosaic_backward.backward_dq(*operands, scale=scale, tiles=SMALL, interpret=True)


@pytest.mark.parametrize(
    "bias_dtype, dbias_consumers", [(jnp.float32, 2), (jnp.bfloat16, 1)], ids=["f32", "bf16"]
)
def test_paired_heads_equal_the_padded_head_dim(bias_dtype, dbias_consumers, seed):
    """d = 8 with two heads: the kernels read both heads' 16-wide tiles
    (`mosaic_backward.tile_heads`), each head's products over its own
    columns, so with the same tiles every gradient is that of the heads
    zero-padded to 16: bitwise, but for dbias (below). An odd S, N past the
    last whole tile, several query and key tiles, a fully masked row; with
    a float32 bias the dbias result leaves through the bias tile, with a
    bf16 one through a tile of its own."""
    inputs = helpers.random_inputs(
        seed, 1, 3, 72, 2, 8, jnp.bfloat16, bias_dtype=bias_dtype, gate=False,
        fully_masked_row=(0, 1),
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    assert mosaic_backward.tile_heads(inputs.q.shape, inputs.q.dtype) == 2
    tiles = MosaicBackwardTiles(
        dkdv=SMALL, dq=SMALL, dbias=dataclasses.replace(SMALL, msa_rows=dbias_consumers)
    )
    paired = run_backward(operands, scale, tiles)
    q, k, v, bias, mask, do, stats = operands
    pad = lambda x: jnp.pad(x, ((0, 0),) * 4 + ((0, 8),))  # noqa: E731
    padded = run_backward((pad(q), pad(k), pad(v), bias, mask, pad(do), stats), scale, tiles)
    for name, x, y in zip(("dq", "dk", "dv"), paired, padded):
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y[..., :8].astype(jnp.float32)),
            err_msg=name,
        )
    # The paired dbias kernel takes q and do from registers, which the
    # interpreter multiplies with `jnp.dot`, not its wgmma: float32 rounding
    # apart here (bitwise on the GPU, tests/kernels/mosaic/test_gpu.py).
    error = helpers.rel_err(paired[3], padded[3])
    assert error <= 1e-6, error


def test_float32_head_dim_8_pads_only_for_the_backward(seed, monkeypatch):
    """float32 with d = 8 on `implementation="mosaic"`: the Triton forward
    reads q as it is (d = 8, no padded copy), the Mosaic backward kernels
    read it zero-padded to 16; gradients keep d = 8 and match float64 to
    float32 accuracy."""
    seen = spy_head_dims(monkeypatch, triton_forward)
    inputs = helpers.random_inputs(seed, 1, 2, 64, 1, 8, jnp.float32, fully_masked_row=True)
    result = helpers.fwd_bwd("mosaic")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, helpers.numpy_results(inputs), helpers.tolerance(jnp.float32), "mosaic f32 d=8"
    )
    assert seen == [("attention_forward", 8), ("backward_dkdv", 16), ("backward_dq", 16),
                    ("backward_dbias", 16)], seen


def test_loops_between_runtime_bounds(seed):
    """The dq kernel's key loop and the dk/dv kernel's query loop run between
    bounds known only at run time (`pipeline_bounds.strict_tile_bounds`: two
    of the three tiles, from tile 0 or 1), the ring's slots counted from the
    loop's first step: the gradients match float64 over each CTA's tiles."""
    inputs = helpers.random_inputs(
        seed, 1, 2, 136, 1, 32, jnp.bfloat16, bias_dtype=jnp.float32, gate=False,
        mask_rate=0.1,
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    bound = dict(
        scale=scale, tiles=SMALL, interpret=True, tile_bounds=pipeline_bounds.strict_tile_bounds
    )
    dq = mosaic_backward.backward_dq(*operands, **bound)
    dk, dv = mosaic_backward.backward_dkdv(*operands, **bound)
    expected = pipeline_bounds.gradients_between_tile_bounds(inputs, scale)
    tolerance = helpers.tolerance(jnp.bfloat16)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        error = helpers.rel_err(got, want)
        assert error <= tolerance, (name, error)


def test_ping_pong_changes_nothing(seed):
    """Taking turns reorders the consumers' work, never their arithmetic."""
    inputs = helpers.random_inputs(seed, 1, 2, 128, 1, 32, jnp.bfloat16, gate=False)
    operands, scale = helpers.mosaic_backward_operands(inputs)
    in_turns = run_backward(operands, scale, SMALL_TILES)
    apart = run_backward(
        operands, scale, MosaicBackwardTiles(dkdv=SMALL, dq=SMALL, dbias=SMALL, ping_pong=False)
    )
    for a, b in zip(in_turns, apart):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("way", helpers.MOSAIC_OTHER_WAYS.values(),
                         ids=helpers.MOSAIC_OTHER_WAYS.keys())
def test_other_ways_with_masked_keys_and_the_bias_change_nothing(way, bias_dtype, seed):
    """Each other way gives the default kernels' gradients (a zero's sign
    aside), with masked keys, a fully masked row and keys past N (N = 72),
    and stays within tolerance of float64."""
    inputs = helpers.random_inputs(
        seed, 1, 2, 72, 1, 32, jnp.bfloat16, bias_dtype=bias_dtype, gate=False,
        fully_masked_row=(0, 1),
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    default = run_backward(operands, scale, SMALL_TILES)
    other = dataclasses.replace(SMALL, **way)
    assert other != SMALL
    other_grads = run_backward(
        operands, scale, MosaicBackwardTiles(dkdv=other, dq=other, dbias=other)
    )
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), default, other_grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    check_gradients(other_grads, inputs, scale, f"kernels with {way}")


def test_masking_without_select_zeroes_masked_keys_ds(seed):
    """Where a masked key's logit gradient would not be 0 but for the mask
    (its logit, without the mask, the row's largest), no kernel passes
    gradient through it without a select after the product (the default,
    `mask_without_select`) either: the bias gradient of a key masked in
    every row is exactly 0, and so is that key's dk."""
    inputs = helpers.random_inputs(seed, 1, 2, 128, 1, 32, jnp.bfloat16, gate=False)
    masked_key = 7
    mask = inputs.mask.at[..., masked_key].set(False)
    inputs = inputs._replace(mask=mask, bias=inputs.bias.at[..., masked_key].add(30.0))
    operands, scale = helpers.mosaic_backward_operands(inputs)
    assert SMALL.mask_without_select
    dq, dk, dv, dbias = run_backward(operands, scale, SMALL_TILES)
    assert not np.asarray(dbias[..., masked_key]).any()
    assert not np.asarray(dk[:, :, masked_key]).any()
    check_gradients((dq, dk, dv, dbias), inputs, scale, "mask without select")


def test_keys_past_n_pass_no_gradient(seed):
    """N = 72, no mask: the keys past N in the last key tile read zeros, and
    a query row whose logits are all near -430 (base 2) gives those keys a
    probability of 2^430 = inf. The dq kernel must drop them (with a mask,
    the zeros read past N mask them); the dk/dv and dbias kernels write no
    gradient there."""
    n_res = 72
    inputs = helpers.random_inputs(seed, 1, 2, n_res, 1, 32, jnp.bfloat16, mask_rate=None, gate=False)
    inputs = inputs._replace(bias=inputs.bias.at[..., 5, :].add(-300.0))
    q, k, v, bias, _, _, dout = inputs.args
    scale = q.shape[-1] ** -0.5
    tiles = default_block_config(n_res, 32, q.dtype, bias.dtype).forward
    _, attention, row_max, row_log2_sum = triton_forward.attention_forward(
        q, k, v, bias, None, None, scale=scale, tiles=tiles, interpret=True, save_stats=True
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
    operands = (q, k, v, bias, None, dout, stats)
    got = run_backward(operands, scale, SMALL_TILES)
    expected = numpy_reference.vjp(q, k, v, bias, None, None, scale, dout)[:4]
    for name, g, want in zip(("dq", "dk", "dv", "dbias"), got, expected):
        helpers.assert_finite(g, name)
        assert g.shape == want.shape, (name, g.shape, want.shape)
        error = helpers.rel_err(g, want)
        assert error <= helpers.tolerance(jnp.bfloat16), (name, error)


@pytest.mark.parametrize("consumers, n_res", [(1, 72)])
def test_float32_bias_gradient_in_bf16_pieces(consumers, n_res, seed):
    """float32 q, k, v and do with one dbias consumer (two: CASES): the
    kernel multiplies three bf16 pieces of each (six products per product)
    and matches float64 to float32 accuracy."""
    inputs = helpers.random_inputs(
        seed, 1, 3, n_res, 1, 32, jnp.float32, gate=False, fully_masked_row=(0, 1)
    )
    operands, scale = helpers.mosaic_backward_operands(inputs)
    tiles = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=consumers)
    dbias = mosaic_backward.backward_dbias(*operands, scale=scale, tiles=tiles, interpret=True)
    q, k, v, bias, mask, _, dout = inputs.args
    expected = numpy_reference.vjp(q, k, v, bias, mask, None, scale, dout)[3]
    error = helpers.rel_err(dbias, expected)
    print(f"[rel err] mosaic float32 dbias, {consumers} consumers, N={n_res}: {error:.2e}")
    assert dbias.dtype == jnp.float32 and dbias.shape == expected.shape
    assert error <= helpers.tolerance(jnp.float32), error


def test_split_float32_sums_to_float32():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1000)), jnp.float32)
    pieces = split_float32(x)
    assert len(pieces) == FLOAT32_PIECES and all(p.dtype == jnp.bfloat16 for p in pieces)
    total = sum(p.astype(jnp.float32) for p in reversed(pieces))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(x))
    # Two pieces fall 8 bits short.
    assert helpers.rel_err(pieces[0].astype(jnp.float32) + pieces[1], x) > 1e-7
