"""The Mosaic GPU backward kernels' plans (`msa_pallas.kernels.mosaic.plan`:
`dkdv_plan`, `dq_plan`, `dbias_plan`) and their CUDA lowering on a machine without
a GPU (Mosaic GPU's own lowering, layouts and TMA descriptors included, runs at
trace time): each kernel lowers with its default tiles at every head dim and at N
no whole number of tiles nor of 8, in float32 pieces too; each plan's shared-memory
bytes are what the lowered kernel asks for and its barriers count the copies; the
default tiles fit a CTA. The kernels themselves run in the interpreter in
test_backward.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import mosaic_lowering
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic.plan import dbias_plan, dkdv_plan, dq_plan
from msa_pallas.kernels.mosaic.smem import MAX_SHARED_MEMORY
from msa_pallas.kernels.mosaic.support import HEAD_DIMS
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic.work_items import DEAD_ZEROS_BYTES, dead_zeros_smem

SMALL = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)
# One CTA per SM: with a mask, the consumers' tiles of zeros for dead rows too.
PERSISTENT = dataclasses.replace(SMALL, persistent=True)

BF16, F32 = jnp.bfloat16, jnp.float32
# id -> (d, N, mask, q dtype, bias dtypes). The default tiles of every head dim
# (d = 8: two heads per tile) with both bias widths (the tiles differ by bias
# width: dbias consumers, turns); N = 200, no whole number of tiles, the bias
# rows padded to whole TMA rows, with and without a mask; N = 333, 101 and 203,
# no multiple of 8 (`smem.unaligned_row_tile`; d = 64 at 333; float32 pieces at
# 333 and 101, d = 64 with the float32 gradients' tiles as column pieces). Where
# the tiles do not depend on it, one bias width per case (the bias tile's copies
# are those of the default-tile cases), alternating.
LOWERING_CASES = {
    **{f"d{d}-defaults": (d, 256, True, BF16, (F32, BF16)) for d in HEAD_DIMS},
    "d8-pairs-N384": (8, 384, True, BF16, (F32, BF16)),
    "N200": (32, 200, True, BF16, (F32, BF16)),
    "N200-no-mask": (32, 200, False, BF16, (BF16,)),
    "N333": (32, 333, True, BF16, (F32, BF16)),
    "N101-d16-no-mask": (16, 101, False, BF16, (F32,)),
    "N203-d8-pairs": (8, 203, True, BF16, (BF16,)),
    "N333-d64": (64, 333, True, BF16, (F32,)),
    "N333-float32": (32, 333, True, F32, (BF16,)),
    "N101-d64-float32-no-mask": (64, 101, False, F32, (F32,)),
}


@pytest.mark.parametrize("case", list(LOWERING_CASES))
def test_lowers_for_the_gpu_on_a_cpu(case):
    """The three kernels lower for CUDA on a machine without one, with their
    default tiles (`LOWERING_CASES`): a shape error, an unsupported layout or
    a misaligned GMEM row fails here, not first on the GPU."""
    head_dim, n_res, has_mask, dtype, bias_dtypes = LOWERING_CASES[case]
    for bias_dtype in bias_dtypes:
        shape = (1, 4, n_res, 8, head_dim)
        operands = mosaic_lowering.backward_operands(shape, dtype, bias_dtype, has_mask)
        tiles = mosaic_backward.default_tiles(shape, dtype, bias_dtype)
        for kernel in ("dkdv", "dq", "dbias"):
            function = getattr(mosaic_backward, f"backward_{kernel}")
            text = mosaic_lowering.lowered_for_cuda(
                lambda *args: function(  # noqa: B023
                    *args, scale=0.2, tiles=getattr(tiles, kernel), interpret=False  # noqa: B023
                ),
                *operands,
            )
            assert "mosaic_gpu" in text, (jnp.dtype(bias_dtype).name, kernel)


@pytest.mark.parametrize("head_dim, n_res", [(32, 200), (8, 384)])
def test_other_ways_lower_for_the_gpu_on_a_cpu(head_dim, n_res):
    """Each kernel with a float32 bias read lane by lane and masked keys'
    ds made 0 by a select after the product (`MosaicTiles.staggered_bias`
    and `mask_without_select` off) lowers for CUDA, one head per tile and
    two."""
    shape = (1, 4, n_res, 8, head_dim)
    operands = mosaic_lowering.backward_operands(shape, BF16, F32)
    tiles = mosaic_backward.default_tiles(shape, BF16, F32)
    for kernel in ("dkdv", "dq", "dbias"):
        other = dataclasses.replace(
            getattr(tiles, kernel), staggered_bias=False, mask_without_select=False
        )
        function = getattr(mosaic_backward, f"backward_{kernel}")
        text = mosaic_lowering.lowered_for_cuda(
            lambda *args: function(*args, scale=0.2, tiles=other, interpret=False),  # noqa: B023
            *operands,
        )
        assert "mosaic_gpu" in text, kernel


KERNELS = {"dkdv": dkdv_plan, "dq": dq_plan, "dbias": dbias_plan}


def lowered_and_planned_bytes(kernel, shape, dtype, bias_dtype, tiles, has_mask=True):
    """The shared memory the lowered `kernel` ("dkdv", "dq" or "dbias") asks
    for at q of `shape` with `tiles`, and its plan's."""
    operands = mosaic_lowering.backward_operands(shape, dtype, bias_dtype, has_mask)
    function = getattr(mosaic_backward, f"backward_{kernel}")
    used = mosaic_lowering.lowered_shared_memory(
        lambda *args: function(*args, scale=0.2, tiles=tiles, interpret=False), *operands
    )
    plan = KERNELS[kernel](
        shape, dtype, bias_dtype, tiles, mask_dtype=jnp.int8 if has_mask else None,
        interpret=False,
    )
    return used, plan.shared_memory_bytes


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(
    "shape, dtype, bias_dtype, tiles, has_mask",
    [
        ((1, 4, 256, 8, 32), jnp.bfloat16, jnp.float32, SMALL, True),
        ((1, 3, 200, 4, 8), jnp.bfloat16, jnp.bfloat16, MosaicTiles(64, 128, 3, 2), False),
        ((1, 4, 333, 8, 64), jnp.float32, jnp.float32, MosaicTiles(64, 64, 2, 1), True),
        ((1, 2, 101, 8, 32), jnp.float32, jnp.bfloat16, SMALL, False),
        ((1, 4, 200, 16, 32), jnp.bfloat16, jnp.float32, PERSISTENT, True),
        ((1, 4, 384, 8, 8), jnp.bfloat16, jnp.bfloat16, PERSISTENT, True),
    ],
    ids=["d32", "d8-pairs-odd-S", "float32-N333-d64", "float32-N101-bias-bf16",
         "persistent-H16", "persistent-d8-pairs"],
)
def test_plan_bytes_are_what_the_lowered_kernel_allocates(
    kernel, shape, dtype, bias_dtype, tiles, has_mask
):
    """Each backward kernel's plan gives the shared memory its lowered
    kernel asks for: two heads per tile's held copies, float32 operands'
    bf16 pieces and float32 gradient tiles (column pieces at d = 64 with
    N no multiple of 8), the dbias result through the bias tile (float32
    q and bias) or a tile of its own, and every barrier."""
    used, planned = lowered_and_planned_bytes(kernel, shape, dtype, bias_dtype, tiles, has_mask)
    assert used == planned, (used, planned)


def test_barrier_arrivals_count_the_copies():
    """A step's barrier awaits one arrival per copy, three per float32
    operand (its bf16 pieces)."""
    shape = (1, 4, 128, 2, 32)
    for dtype, pieces in ((jnp.bfloat16, 1), (jnp.float32, 3)):
        plans = {
            name: plan(shape, dtype, jnp.float32, SMALL, mask_dtype=jnp.int8, interpret=True)
            for name, plan in KERNELS.items()
        }
        # Per consumer (2): q, do, stats; one bias tile.
        assert plans["dkdv"].arrivals("step") == 2 * (2 * pieces + 1) + 1
        assert plans["dkdv"].arrivals("kv") == 2 * pieces + 1
        # Per consumer: K, V, mask; one bias tile.
        assert plans["dq"].arrivals("step") == 2 * (2 * pieces + 1) + 1
        assert plans["dq"].arrivals("q") == 2 * pieces + 1
        # Per consumer: q, do, stats; the row's K, V and mask.
        assert plans["dbias"].arrivals("step") == 2 * (2 * pieces + 1) + 2 * pieces + 1


@pytest.mark.parametrize("head_dim", (8, *HEAD_DIMS))
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_default_tiles_fit_shared_memory(head_dim, bias_dtype):
    """The default tiles' kernels, lowered, ask for no more shared memory
    than a CTA has, as their plans say; also the persistent dq and dk/dv
    kernels (where padding is skipped), with their tiles of zeros."""
    shape = (1, 4, 256, 8, head_dim)
    tiles = mosaic_backward.default_tiles(shape, jnp.bfloat16, bias_dtype)
    persistent = mosaic_backward.default_tiles(shape, jnp.bfloat16, bias_dtype, persistent=True)
    cases = [(kernel, getattr(tiles, kernel)) for kernel in KERNELS]
    cases += [(kernel, getattr(persistent, kernel)) for kernel in ("dq", "dkdv")]
    for kernel, kernel_tiles in cases:
        used, planned = lowered_and_planned_bytes(
            kernel, shape, jnp.bfloat16, bias_dtype, kernel_tiles
        )
        assert used == planned <= MAX_SHARED_MEMORY, (kernel, used, planned)
    # Turns pay with a 16-bit bias only (benchmarks/RESULTS.md).
    assert tiles.ping_pong == (jnp.dtype(bias_dtype).itemsize == 2)


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_float32_kernels_lower_for_the_gpu_on_a_cpu(head_dim):
    """The three kernels with float32 inputs (three bf16 pieces per operand,
    float32 output tiles) lower for CUDA with their default tiles, which
    fit in shared memory (Mosaic GPU checks it at lowering)."""
    shape = (1, 4, 384, 8, head_dim)
    q = jax.ShapeDtypeStruct(shape, jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 8, 384, 384), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 4, 384), jnp.int8)
    stats = jax.ShapeDtypeStruct((1, 4, 8, 3, 384), jnp.float32)
    tiles = mosaic_backward.default_tiles(shape, jnp.float32, jnp.float32)
    for kernel in KERNELS:
        kernel_tiles = getattr(tiles, kernel)
        used, planned = lowered_and_planned_bytes(
            kernel, shape, jnp.float32, jnp.float32, kernel_tiles
        )
        assert used == planned <= MAX_SHARED_MEMORY, (kernel, used, planned)
        function = getattr(mosaic_backward, f"backward_{kernel}")
        lowered = jax.jit(
            lambda *args: function(  # noqa: B023
                *args, scale=0.2, tiles=kernel_tiles, interpret=False  # noqa: B023
            )
        ).trace(q, q, q, bias, mask, q, stats).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text(), kernel


def test_float32_head_dims_above_64_raise():
    with pytest.raises(ValueError, match="d <= 64"):
        mosaic_backward.default_tiles((1, 4, 384, 8, 128), jnp.float32, jnp.float32)


def test_dkdv_refuses_block_k_192():
    """block_k = 192 compiles, then the dk/dv kernel's launch fails with a
    misaligned address on the H200 (jax 0.11.2): the plan refuses it first."""
    with pytest.raises(ValueError, match="block_k=192"):
        dkdv_plan((1, 4, 256, 8, 32), jnp.bfloat16, jnp.float32, MosaicTiles(64, 192, 2, 2),
                  mask_dtype=jnp.int8, interpret=False)



@pytest.mark.parametrize(
    "width, n_res, rows, columns",
    [(64, 384, 64, 64), (256, 256, 16, 256), (512, 200, 16, 256), (288, 40, 16, 144),
     (16, 40, 64, 16)],
)
def test_dead_zeros_tiles(width, n_res, rows, columns):
    """A persistent consumer's tile of zeros (`work_items.dead_zeros_smem`):
    columns a divisor of the output's row width that one TMA box takes (at
    most 256), rows as many as 8 KB hold, a power of two, at most N rounded
    up to one."""
    smem = dead_zeros_smem(width, jnp.bfloat16, n_res)
    assert smem.shape == (rows, columns)
    assert width % columns == 0 and columns <= 256
    assert rows * columns * 2 <= DEAD_ZEROS_BYTES
