"""The compiled Mosaic GPU kernels on a Hopper GPU (marked `gpu`; skipped
elsewhere, and on GPUs other than sm90).

`implementation="mosaic"`: the Mosaic forward and the Mosaic backward
kernels that follow it through the shared residuals, against the float64
reference of tests/kernels/triton/test_gpu.py (chunked over MSA rows), at the shapes that matter
and at the edges: head dims 16-128, an odd S, several batch elements and
heads, N that is no whole number of tiles or no multiple of 8, fully masked
rows, NaN locality, bitwise-repeatable gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import helpers
import msa_pallas
import pipeline_bounds
from gpu_inputs import SHAPES, chunk_rows, device_inputs
from helpers import compare, fwd_bwd
from msa_pallas.attention import on_hopper
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.smem import unaligned_row_tile
from msa_pallas.kernels.triton import forward as triton_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jax.default_backend() == "gpu" and not on_hopper(), reason="needs an sm90 GPU"
    ),
]

MOSAIC = "mosaic"
# The forward's output against float64 (the Mosaic forward issue's bar).
OUT_TOLERANCE = {
    jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.float32): 1e-5,
}
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
BIAS_DTYPES = {"bias-f32": jnp.float32, "bias-input": None}


def check(inputs, label, implementation=MOSAIC):
    start = time.perf_counter()
    result = jax.block_until_ready(fwd_bwd(implementation)(*inputs.args))
    elapsed = time.perf_counter() - start
    helpers.assert_shapes_dtypes_finite(result, inputs)
    reference = helpers.jnp_reference_fwd_bwd(inputs, chunk_rows=chunk_rows(inputs.q.shape))
    dtype = jnp.dtype(inputs.q.dtype)
    errors = compare(result, reference, helpers.tolerance(dtype), label, out=OUT_TOLERANCE[dtype])
    print(f"[gpu] {label}: first call (compile + run) {elapsed:.2f} s")
    return result, errors


@pytest.mark.parametrize("bias_id", list(BIAS_DTYPES))
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("shape_id", ["train", "finetune", "long-S16", "longer-S16"])
def test_shapes_against_float64(shape_id, dtype_id, bias_id, seed):
    dtype = DTYPES[dtype_id]
    bias_dtype = BIAS_DTYPES[bias_id] or dtype
    inputs = device_inputs(seed, SHAPES[shape_id], dtype, bias_dtype=bias_dtype)
    check(inputs, f"mosaic {shape_id} {dtype_id} {bias_id}")


@pytest.mark.parametrize("shape_id", ["train", "finetune", "long-S16", "longer-S16"])
def test_float32_backward_against_float64(shape_id, seed):
    """float32: the Triton forward and the Mosaic backward on three bf16
    pieces per operand, within float32's 1e-5 of float64."""
    check(device_inputs(seed, SHAPES[shape_id], jnp.float32), f"mosaic float32 {shape_id}")


@pytest.mark.parametrize(
    "shape", [(1, 3, 333, 8, 32), (2, 2, 101, 2, 64), (1, 4, 203, 4, 8)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_float32_backward_at_any_n(shape, seed):
    """float32 at N no multiple of 8: every bf16 piece's row tiles through
    `smem.unaligned_row_tile`, at d = 64 the float32 gradients' tiles as
    two column pieces, d = 8 padded to 16."""
    check(device_inputs(seed, shape, jnp.float32), f"mosaic float32 {shape}")


@pytest.mark.parametrize(
    "shape",
    [
        (1, 3, 256, 4, 32),  # odd S: one MSA row per CTA
        (2, 4, 256, 2, 16),
        (1, 4, 256, 4, 64),
        (1, 2, 128, 2, 128),
        # N no whole number of tiles: the last query and key tiles run past N.
        (1, 4, 200, 4, 32),
        (2, 3, 328, 8, 32),
        (1, 2, 8, 2, 16),
        # N no multiple of 8: every kernel's row tiles through
        # `smem.unaligned_row_tile`.
        (2, 3, 37, 4, 32),
        (1, 4, 333, 8, 8),
        (1, 2, 101, 2, 16),
        # d = 64: the float32 residual as two column pieces (`smem.row_tile`).
        (1, 3, 203, 4, 64),
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_edges(shape, seed):
    check(device_inputs(seed, shape, jnp.bfloat16), f"mosaic edges {shape}")


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_statistics_past_n_match_triton(bias_dtype, seed):
    """N = 200, H = 8: the forward's row statistics of the last query tile,
    which runs past N, land in their own head's plane (a contiguous window
    stored past N would overwrite the next head's), and equal the Triton
    forward's."""
    inputs = device_inputs(seed, (1, 4, 200, 8, 32), jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, _ = inputs.args
    mask = mask.astype(jnp.int8)
    scale = 32**-0.5
    tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    mosaic = mosaic_forward.attention_forward(
        q, k, v, bias, mask, gate, scale=scale, tiles=tiles, interpret=False, save_stats=True
    )
    triton_tiles = default_block_config(200, 32, q.dtype, bias.dtype).forward
    triton = triton_forward.attention_forward(
        q, k, v, bias, mask, gate, scale=scale, tiles=triton_tiles, interpret=False,
        save_stats=True,
    )
    for name, a, b in zip(("row_max", "row_log2_sum"), mosaic[2:], triton[2:]):
        assert a.shape == b.shape == (1, 4, 8, 200), (name, a.shape)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4, err_msg=name)
    assert helpers.rel_err(mosaic[1], triton[1]) < 1e-2


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [SHAPES["train"], SHAPES["finetune"], (1, 3, 256, 4, 32), (2, 3, 328, 8, 32), (1, 4, 200, 8, 16),
     (1, 512, 128, 8, 32), (1, 8, 333, 8, 32)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_persistent_forward_equals_one_cta_per_item(shape, bias_dtype, seed):
    """The persistent grid (one CTA per SM looping over work items) computes
    each item as the grid of one CTA per item does: the outputs and
    residuals are bitwise equal, at the train and finetune crops, an odd S,
    N past the last whole tile, N = 128 with many items per CTA (one
    128-key tile with a 16-bit bias: fewer key tiles than ring stages), and
    N = 333, no multiple of 8."""
    inputs = device_inputs(seed, shape, jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, _ = inputs.args
    tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    reference, other = [
        mosaic_forward.attention_forward(
            q, k, v, bias, mask.astype(jnp.int8), gate, scale=shape[-1] ** -0.5,
            tiles=one, interpret=False, save_stats=True,
        )
        for one in (tiles, dataclasses.replace(tiles, persistent=False))
    ]
    for name, expected, result in zip(
        ("out", "attention", "row_max", "row_log2_sum"), reference, other
    ):
        np.testing.assert_array_equal(
            np.asarray(result.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)),
            err_msg=name,
        )


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape", [SHAPES["train"], (1, 8, 328, 4, 32), (2, 4, 200, 8, 16)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-item"])
def test_four_msa_rows_per_cta_equal_two(shape, bias_dtype, persistent, seed):
    """Four consumers per CTA (`MosaicTiles.msa_rows` = 4, the default up
    to N = 256 where masked queries are skipped) compute each row as two do
    with the same 64 x 64 tiles: the outputs and residuals are bitwise
    equal, at the training crop, at N = 328 (six key tiles, the last past
    N) and with two batch elements and d = 16."""
    inputs = device_inputs(seed, shape, jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, _ = inputs.args
    two, four = [
        mosaic_forward.attention_forward(
            q, k, v, bias, mask.astype(jnp.int8), gate, scale=shape[-1] ** -0.5,
            tiles=MosaicTiles(64, 64, 2, rows, ping_pong=rows == 2, persistent=persistent),
            interpret=False, save_stats=True,
        )
        for rows in (2, 4)
    ]
    for name, expected, result in zip(("out", "attention", "row_max", "row_log2_sum"), two, four):
        np.testing.assert_array_equal(
            np.asarray(result.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)),
            err_msg=name,
        )
    error = helpers.rel_err(four[0], helpers.jnp_reference_fwd_bwd(
        inputs, chunk_rows=chunk_rows(shape))[0])
    assert error <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)], error


@pytest.mark.parametrize("n_res", [37, 100, 64])
def test_unaligned_row_tile_copies_any_n(n_res, seed):
    """`smem.unaligned_row_tile`, the building block for N % 8 != 0: q and
    k tiles of `[B, S, N, H, 32]` copied in by TMA through the untiled view,
    `q k^T` by `wgmma` from the tiled view against float64 NumPy (keys past
    N read as zeros), and q's tile written through the tiled view and
    copied out through the untiled one, equal to q (rows past N dropped)."""
    rows, heads, head_dim, block = 2, 2, 32, 64
    q_key, k_key = jax.random.split(jax.random.key(seed))
    shape = (1, rows, n_res, heads, head_dim)
    q = jax.random.normal(q_key, shape, jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(k_key, shape, jnp.float32).astype(jnp.bfloat16)
    tiles = pl.cdiv(n_res, block)

    def body(q_gmem, k_gmem, logits_gmem, out_gmem, q_smem, k_smem, out_smem, logits_smem,
             loaded):
        row, head, tile = (jax.lax.axis_index(name) for name in ("s", "h", "t"))
        plgpu.copy_gmem_to_smem(
            q_gmem.at[0, row, pl.ds(tile * block, block), head], q_smem[0], loaded.at[0]
        )
        plgpu.copy_gmem_to_smem(k_gmem.at[0, row, pl.ds(0, block), head], k_smem[0], loaded.at[1])
        plgpu.barrier_wait(loaded.at[0])
        plgpu.barrier_wait(loaded.at[1])

        def product(acc):
            plgpu.wgmma(acc, q_smem[1], k_smem[1].T)
            return acc[...]

        logits_smem[...] = pl.run_scoped(product, plgpu.ACC((block, block), jnp.float32))
        out_smem[1][...] = q_smem[1][...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(logits_smem, logits_gmem.at[row, head, tile])
        plgpu.copy_smem_to_gmem(out_smem[0], out_gmem.at[0, row, pl.ds(tile * block, block), head])
        plgpu.wait_smem_to_gmem(0)

    tile = unaligned_row_tile((block, head_dim), jnp.bfloat16)
    logits, out = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((rows, heads, tiles, block, block), jnp.float32),
                  jax.ShapeDtypeStruct(shape, jnp.bfloat16)),
        grid=(rows, heads, tiles), grid_names=("s", "h", "t"),
        scratch_types=(tile, tile, tile, plgpu.SMEM((block, block), jnp.float32),
                       plgpu.Barrier(num_barriers=2)),
    )(q, k)
    q32, k32, logits = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(logits)
    keys = min(block, n_res)
    for row in range(rows):
        for head in range(heads):
            want = q32[0, row, :, head] @ k32[0, row, :keys, head].T
            got = np.concatenate([logits[row, head, t] for t in range(tiles)])
            np.testing.assert_allclose(
                got[:n_res, :keys], want, rtol=0, atol=1e-5 * np.abs(want).max()
            )
            assert not got[:n_res, keys:].any(), "keys past N must read as zeros"
    assert np.array_equal(np.asarray(out), np.asarray(q))


def test_keys_past_n_pass_no_gradient(seed):
    """N = 200 without a mask, one query row's logits all near -430 (base
    2): the keys past N, read as zeros, get probability inf there, and must
    reach no gradient."""
    inputs = device_inputs(seed, (1, 4, 200, 4, 32), jnp.bfloat16, mask_rate=None)
    inputs = inputs._replace(bias=inputs.bias.at[..., 5, :].add(-300.0))
    check(inputs, "mosaic keys past N, no mask")


def test_nan_stays_local(seed):
    inputs = device_inputs(seed, (1, 4, 256, 4, 32), jnp.bfloat16)
    q = inputs.q.at[0, 2, 7, 1].set(jnp.nan)
    out = msa_pallas.msa_row_attention(
        q, inputs.k, inputs.v, inputs.bias, inputs.mask, inputs.gate, implementation=MOSAIC
    )
    bad = np.isnan(np.asarray(out.astype(jnp.float32)))
    assert bad[0, 2, 7, 1].all()
    bad[0, 2, 7, 1] = False
    assert not bad.any()


def test_repeatable_bitwise(seed):
    inputs = device_inputs(seed, (1, 8, 384, 8, 32), jnp.bfloat16)
    first = jax.block_until_ready(fwd_bwd(MOSAIC)(*inputs.args))
    second = jax.block_until_ready(fwd_bwd(MOSAIC)(*inputs.args))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_default_picks_on_hopper():
    """On this GPU, the rule of `resolve_implementation` (test_forward.py
    checks it with the platform patched)."""

    def picks(n_res, head_dim, dtype=jnp.bfloat16):
        q = jnp.ones((1, 2, n_res, 4, head_dim), dtype)
        bias = jnp.ones((1, 4, n_res, n_res), jnp.float32)
        return msa_pallas.resolve_implementation(None, q, 0.0, bias)

    # d = 8 (the extra-MSA stack) too: two heads per tile, H being even.
    # N no multiple of 8 (250, 333) with d <= 64 too.
    for n_res, head_dim in ((256, 32), (384, 32), (384, 8), (1024, 64), (200, 32), (320, 32),
                            (250, 32), (333, 8), (333, 64)):
        assert picks(n_res, head_dim) == MOSAIC, (n_res, head_dim)
    assert picks(128, 32) == picks(250, 128) == "triton"
    # float32 with a float32 bias: the Triton forward, the Mosaic backward.
    assert picks(384, 32, jnp.float32) == MOSAIC
    assert picks(320, 32, jnp.float32) == "triton"


@pytest.mark.parametrize("bias_id", list(BIAS_DTYPES))
@pytest.mark.parametrize("shape_id", ["train", "finetune"])
def test_default_against_float64(shape_id, bias_id, seed):
    """`implementation=None` at the train and finetune crops: the Mosaic
    kernels, with the persistent forward."""
    bias_dtype = BIAS_DTYPES[bias_id] or jnp.bfloat16
    inputs = device_inputs(seed, SHAPES[shape_id], jnp.bfloat16, bias_dtype=bias_dtype)
    check(inputs, f"default {shape_id} bf16 {bias_id}", implementation=None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_head_dim_8(dtype, seed):
    # bf16: the Mosaic kernels read d = 8 as it is, two heads per tile;
    # float32: the Triton forward reads d = 8 and the Mosaic backward pads.
    inputs = device_inputs(seed, (1, 4, 384, 8, 8), dtype)
    check(inputs, f"mosaic d=8 {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 384, 8, 8), (2, 3, 200, 4, 8)], ids=str)
def test_paired_heads_equal_the_padded_head_dim(shape, bias_dtype, seed):
    """d = 8 with an even H: the forward's products over a tile of two
    heads, the other head's q columns zeroed, add exactly the terms of d = 8
    zero-padded to 16; so with the same tiles every result and residual is
    bitwise that of the padded inputs (the extra-MSA stack's N and H, then
    an odd S, two batch elements and N past the last whole tile)."""
    inputs = device_inputs(seed, shape, jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, _ = inputs.args
    tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)

    def forward(q, k, v, gate):
        return mosaic_forward.attention_forward(
            q, k, v, bias, mask.astype(jnp.int8), gate, scale=8**-0.5, tiles=tiles,
            interpret=False, save_stats=True,
        )

    pad = lambda x: jnp.pad(x, ((0, 0),) * 4 + ((0, 8),))  # noqa: E731
    paired, padded = forward(q, k, v, gate), forward(pad(q), pad(k), pad(v), pad(gate))
    for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), paired, padded):
        y = y[..., :8] if name in ("out", "attention") else y
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 384, 8, 8), (2, 3, 200, 4, 8)], ids=str)
def test_paired_backward_equals_the_padded_head_dim(shape, bias_dtype, seed):
    """The backward kernels on d = 8 with an even H, two heads per tile
    (`mosaic_backward.tile_heads`): with the same tiles, bitwise the
    gradients of d zero-padded to 16 (the extra-MSA stack's N and H, then
    an odd S, two batch elements and N past the last whole tile)."""
    inputs = device_inputs(seed, shape, jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, _, dout = inputs.args
    mask, scale = mask.astype(jnp.int8), 8**-0.5
    forward_tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    _, attention, row_max, row_log2_sum = mosaic_forward.attention_forward(
        q, k, v, bias, mask, None, scale=scale, tiles=forward_tiles, interpret=False,
        save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
    assert mosaic_backward.tile_heads(q.shape, q.dtype) == 2
    tiles = mosaic_backward.default_tiles(q.shape, q.dtype, bias.dtype)

    def backward(q, k, v, do):
        operands = (q, k, v, bias, mask, do, stats)
        bound = dict(scale=scale, interpret=False)
        dk, dv = mosaic_backward.backward_dkdv(
            *operands, tiles=tiles.dkdv, ping_pong=tiles.ping_pong, **bound
        )
        dq = mosaic_backward.backward_dq(
            *operands, tiles=tiles.dq, ping_pong=tiles.ping_pong, **bound
        )
        return dq, dk, dv, mosaic_backward.backward_dbias(*operands, tiles=tiles.dbias, **bound)

    pad = lambda x: jnp.pad(x, ((0, 0),) * 4 + ((0, 8),))  # noqa: E731
    paired = backward(q, k, v, dout)
    padded = backward(pad(q), pad(k), pad(v), pad(dout))
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), paired, padded):
        y = y if name == "dbias" else y[..., :8]
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [SHAPES["train"], (1, 4, 384, 8, 8), (2, 3, 200, 4, 32)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("way", helpers.MOSAIC_OTHER_WAYS.values(),
                         ids=helpers.MOSAIC_OTHER_WAYS.keys())
def test_other_ways_change_nothing(way, shape, bias_dtype, seed):
    """Compiled, each other way (`MosaicTiles.mask_without_select` off in the
    backward kernels, `staggered_bias` off in every kernel) gives the default
    kernels' outputs, residuals and gradients, with masked keys and a fully
    masked row: at the training crop, the extra MSA's d = 8 (two heads per
    tile), and N past the last whole tile.

    Bitwise (a zero's sign aside), but for dbias with the select: without it
    the compiler fuses each row's `p (dp - delta)` with the sum over rows into
    one FMA (in SASS at the training crop, dbias's loop has 128 FFMA and no
    FMUL where the select's has 64 of each), one rounding less per term. So
    there the two sums over S rows must agree within S float32 roundings of
    dbias's largest value, far below what a wrong logit gradient would change
    (at the training crop they differed by at most 1.9e-6 on an H100)."""
    inputs = device_inputs(seed, shape, jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, dout = inputs.args
    mask, scale = mask.astype(jnp.int8), shape[-1] ** -0.5
    forward_tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    backward_tiles = mosaic_backward.default_tiles(q.shape, q.dtype, bias.dtype)

    def forward(tiles):
        return mosaic_forward.attention_forward(
            q, k, v, bias, mask, gate, scale=scale, tiles=tiles, interpret=False,
            save_stats=True,
        )

    default_forward = forward(forward_tiles)
    other_forward = forward(dataclasses.replace(forward_tiles, **way))
    for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), default_forward,
                          other_forward):
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )
    _, attention, row_max, row_log2_sum = default_forward
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    operands = (q, k, v, bias, mask, dout, jnp.stack([row_max, row_log2_sum, delta], axis=3))

    def backward(changes):
        tiles = {name: dataclasses.replace(getattr(backward_tiles, name), **changes)
                 for name in ("dkdv", "dq", "dbias")}
        bound = dict(scale=scale, interpret=False)
        turns = dict(ping_pong=backward_tiles.ping_pong)
        dk, dv = mosaic_backward.backward_dkdv(*operands, tiles=tiles["dkdv"], **turns, **bound)
        dq = mosaic_backward.backward_dq(*operands, tiles=tiles["dq"], **turns, **bound)
        return dq, dk, dv, mosaic_backward.backward_dbias(*operands, tiles=tiles["dbias"], **bound)

    assert backward_tiles.dbias.mask_without_select
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), backward({}), backward(way)):
        x, y = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
        if name == "dbias" and "mask_without_select" in way:
            rows = shape[1]
            np.testing.assert_allclose(
                y, x, rtol=0, atol=rows * np.finfo(np.float32).eps * np.abs(x).max(),
                err_msg=name,
            )
            assert not np.array_equal(x, np.zeros_like(x))
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_forward_key_loop_between_runtime_bounds(bias_dtype, seed):
    """The forward's key loop between bounds known only at run time
    (`pipeline_bounds.strict_key_bounds`, 64 x 64 tiles): the persistent
    grid, whose CTAs carry the ring's slots and phases from item to item by
    the count of steps taken, gives bitwise the results of one CTA per
    item, and the output matches float64 over each item's keys; N = 200
    (four key tiles, the last past N), 512 items: about four per CTA."""
    inputs = device_inputs(seed, (1, 64, 200, 4, 32), jnp.bfloat16, bias_dtype=bias_dtype)
    q, k, v, bias, mask, gate, _ = inputs.args
    tiles = MosaicTiles(64, 64, 2, 2, persistent=True)
    forward = functools.partial(
        mosaic_forward.attention_forward, q, k, v, bias, mask.astype(jnp.int8), gate,
        scale=32**-0.5, interpret=False, save_stats=True,
        key_bounds=pipeline_bounds.strict_key_bounds,
    )
    persistent = forward(tiles=tiles)
    per_item = forward(tiles=dataclasses.replace(tiles, persistent=False))
    for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), persistent, per_item):
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )
    expected = pipeline_bounds.forward_between_key_bounds(inputs, 32**-0.5, tiles.msa_rows)
    error = helpers.rel_err(persistent[0], expected)
    assert error <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)], error


def test_backward_loops_between_runtime_bounds(seed):
    """The dq kernel's key loop and the dk/dv kernel's query loop between
    bounds known only at run time (`pipeline_bounds.strict_tile_bounds`,
    64 x 64 tiles, N = 200): the gradients match float64 over each CTA's
    tiles."""
    inputs = device_inputs(seed, (1, 4, 200, 4, 32), jnp.bfloat16, gate=False)
    q, k, v, bias, mask, _, dout = inputs.args
    mask, scale = mask.astype(jnp.int8), 32**-0.5
    forward_tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    _, attention, row_max, row_log2_sum = mosaic_forward.attention_forward(
        q, k, v, bias, mask, None, scale=scale, tiles=forward_tiles, interpret=False,
        save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    operands = (q, k, v, bias, mask, dout, jnp.stack([row_max, row_log2_sum, delta], axis=3))
    bound = dict(
        scale=scale, tiles=MosaicTiles(64, 64, 2, 2), interpret=False,
        tile_bounds=pipeline_bounds.strict_tile_bounds,
    )
    dq = mosaic_backward.backward_dq(*operands, **bound)
    dk, dv = mosaic_backward.backward_dkdv(*operands, **bound)
    expected = pipeline_bounds.gradients_between_tile_bounds(inputs, scale)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        error = helpers.rel_err(got, want)
        assert error <= helpers.tolerance(jnp.bfloat16), (name, error)
