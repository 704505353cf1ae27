"""The Mosaic GPU forward kernel's plan (`msa_pallas.kernels.mosaic.plan.forward_plan`)
and its CUDA lowering on a machine without a GPU (Mosaic GPU's own lowering, layouts
and TMA descriptors included, runs at trace time): the kernel lowers with one CTA
per work item and persistent, two heads per tile, any N; the plan's shared-memory
bytes are what the lowered kernel asks for and its barriers count the copies; the
default tiles fit a CTA; which inputs the kernel takes (`support.supports`) and the
tiles' validation. The kernel itself runs in the interpreter in test_forward.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import mosaic_lowering
import msa_pallas
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.smem import (
    MAX_SHARED_MEMORY, row_tile, row_view_names, smem_tile, split_tiles,
)
from msa_pallas.kernels.mosaic.support import HEAD_DIMS, supports
from msa_pallas.kernels.mosaic.plan import forward_plan
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles

SMALL_TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)


def compiled_forward(
    n_res, head_dim, bias_dtype, tiles=None, has_mask=True, has_gate=True, save_stats=True,
    mask_queries=False, **tile_changes,
):
    """The compiled forward at (1, 4, N, 8, d) bf16, with or without a mask,
    a gate and the residuals, with `tiles` (default: the default tiles)
    changed by `tile_changes`; `mask_queries`: skipping padding, the mask
    masking queries too: (the function, its arguments as
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
    queries = {"skip_masked": True, "mask_queries": True} if mask_queries else {}
    forward = lambda q, k, v, bias, mask, gate: mosaic_forward.attention_forward(  # noqa: E731
        q, k, v, bias, mask, gate, scale=0.2, tiles=tiles, interpret=False,
        save_stats=save_stats, **queries,
    )
    plan = forward_plan(
        shape, jnp.bfloat16, bias_dtype, tiles, mask_dtype=jnp.int8 if has_mask else None,
        gate_dtype=jnp.bfloat16 if has_gate else None, save_stats=save_stats, interpret=False,
        mask_queries=mask_queries,
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


@pytest.mark.parametrize("n_res, head_dim", [(256, 32), (200, 8)])
def test_plain_bias_loads_lower_for_the_gpu_on_a_cpu(n_res, head_dim):
    """A float32 bias read lane by lane (`MosaicTiles.staggered_bias` off)
    lowers for CUDA, one head per tile and two."""
    lowered = lowered_for_cuda(n_res, head_dim, jnp.float32, staggered_bias=False)
    assert "mosaic_gpu" in lowered


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
    "n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats, mask_queries",
    [
        (256, 32, jnp.float32, MosaicTiles(128, 64, 2, 2, persistent=True), True, True, True,
         False),
        (256, 32, jnp.bfloat16, MosaicTiles(64, 128, 3, 1), False, False, False, False),
        (200, 8, jnp.bfloat16, MosaicTiles(128, 64, 2, 2), True, True, True, False),
        (333, 64, jnp.float32, MosaicTiles(64, 64, 2, 2, persistent=True), True, False, True,
         False),
        (37, 16, jnp.float32, MosaicTiles(64, 64, 2, 2), False, True, False, False),
        (384, 8, jnp.float32, MosaicTiles(128, 64, 2, 2, persistent=True), True, True, True,
         True),
        (256, 32, jnp.bfloat16, MosaicTiles(128, 128, 2, 2, persistent=True), True, True, True,
         True),
        (200, 32, jnp.float32, MosaicTiles(64, 64, 2, 4, ping_pong=False, persistent=True),
         True, True, False, True),
    ],
    ids=["d32-persistent", "d32-one-row-3-stages", "d8-pairs", "N333-d64-views", "N37-d16",
         "d8-pairs-masked-queries", "d32-128x128-masked-queries", "N200-four-rows-masked-queries"],
)
def test_plan_bytes_are_what_the_lowered_kernel_allocates(
    n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats, mask_queries
):
    """`plan.forward_plan`'s shared-memory bytes are those Mosaic GPU's lowering
    asks for at launch: every spec (two heads per tile's q copies, the row
    views of N no multiple of 8, the float32 residual's column pieces, the
    persistent output tile; with masked queries on a persistent grid the
    query masks and the tile of zeros) and barrier is in the plan, aligned
    as Mosaic GPU aligns it, and within a CTA's shared memory."""
    forward, args, plan = compiled_forward(
        n_res, head_dim, bias_dtype, tiles, has_mask, has_gate, save_stats, mask_queries
    )
    assert mosaic_lowering.lowered_shared_memory(forward, *args) == plan.shared_memory_bytes
    assert plan.shared_memory_bytes <= MAX_SHARED_MEMORY


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
    def default(rows, n_res, **options):
        return mosaic_forward.default_tiles(
            (1, rows, n_res, 8, head_dim), jnp.bfloat16, bias_dtype, save_stats, **options
        )

    # Where masked queries are skipped, up to N = 256, four MSA rows per CTA
    # where S allows and d <= 32 (one head per tile), in 64 x 64 tiles; else,
    # from N = 384 up, and where they are not skipped, two.
    for rows, n_res in ((4, 256), (8, 128)):
        if 16 <= head_dim <= 32:
            assert default(rows, n_res, skips_masked_queries=True) == MosaicTiles(
                64, 64, 2, 4, ping_pong=False, persistent=True)
    for rows, n_res, skips in ((4, 256, False), (4, 384, True), (6, 256, True), (2, 256, True)):
        tiles = default(rows, n_res, skips_masked_queries=skips)
        if head_dim == 8:
            assert tiles == MosaicTiles(128, 64, 2, 2, persistent=True)
        # The preferred (largest) tiles are taken where they fit, persistent.
        if 16 <= head_dim <= 32 and jnp.dtype(bias_dtype).itemsize == 2:
            assert tiles == MosaicTiles(128, 128, 2, 2, persistent=True)
        if head_dim == 32 and jnp.dtype(bias_dtype).itemsize == 4 and save_stats:
            assert tiles == MosaicTiles(128, 64, 2, 2, persistent=True)
    assert default(4, 256, dropout=True, skips_masked_queries=True).msa_rows != 4
    assert not default(4, 256, persistent=False).persistent


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
    for msa_rows in (3, 4):  # four rows take 64 x 64 tiles alone
        with pytest.raises(ValueError, match="msa_rows"):
            MosaicTiles(msa_rows=msa_rows)
    assert MosaicTiles(msa_rows=2).msa_rows_for(5) == 1
    four = MosaicTiles(64, 64, msa_rows=4)
    assert [four.msa_rows_for(rows) for rows in (12, 6, 3)] == [4, 2, 1]
    # The backward kernels take one or two rows per CTA.
    with pytest.raises(ValueError, match="backward kernels take 1 or 2"):
        MosaicBackwardTiles(dq=four)
