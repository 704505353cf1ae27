"""Shared memory of the Mosaic GPU kernels: tiles swizzled and tiled as TMA
and `wgmma` want them, per-residue vectors, the pairs of views that take
N no multiple of 8 (`unaligned_row_tile`, `row_tile`), operands split into
bf16 pieces (`split_tiles`, `operand_at`)."""

from __future__ import annotations


import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.mosaic.support import RESIDUE_MULTIPLE, SWIZZLE_BYTES


# Shared memory an sm90 CTA may use (227 KiB).
MAX_SHARED_MEMORY = 227 * 1024


def smem_tile(shape, dtype):
    """Shared memory tiled and swizzled as TMA and wgmma want it."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    tiling = plgpu.TilingTransform((8, 8 * swizzle // bits))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def unaligned_row_tile(shape, dtype):
    """Shared memory for a tile of rows of an array whose row count is no
    multiple of 8 (N % 8 != 0): a `plgpu.RefUnion` of two views of the same
    bytes, `(tma_view, wgmma_view)`.

    A TMA copy through a `smem_tile` (8-row tiles) needs the copied array's
    row axis to be a multiple of 8 in jax 0.11.2 (Mosaic GPU's
    `TileTransform` has no rounding up). `tma_view` is swizzled but not
    tiled, so TMA takes any row count (rows past the array read as zeros and
    are not written); `wgmma_view` is `smem_tile`'s layout, which `wgmma`
    needs. Where a row is exactly one swizzle wide (`shape[-1]` times the
    item size = the swizzle, as for d = 16, 32 and 64 in 16 bits) the two
    layouts are the same bytes. Written through one view, read through the
    other. Compiled only: the Mosaic GPU interpreter does not alias the views
    for writes, and copies any rows into 8-row tiles (`row_tile`'s callers
    use `smem_tile` there).
    """
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    if shape[-1] * bits != 8 * swizzle:
        raise ValueError(
            f"a row of {shape[-1]} x {bits} bits is no single {swizzle}-byte swizzle: "
            "the untiled and the tiled views would differ"
        )
    tma_view = plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(swizzle),))
    return plgpu.RefUnion(tma_view, smem_tile(shape, dtype))


def row_tile(shape, dtype, unaligned: bool):
    """Shared memory for a tile of rows of q, k, v, `do`, the gate or an output:
    `smem_tile`, or with `unaligned` (N % 8 != 0) `unaligned_row_tile`'s
    pair of views; a row wider than the widest swizzle (float32 at d = 64)
    as a tuple of such pairs, one per column piece one swizzle wide
    (`store_row_tile`, `copy_row_tile_to_gmem`)."""
    if not unaligned:
        return smem_tile(shape, dtype)
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    if row_bytes <= SWIZZLE_BYTES:
        return unaligned_row_tile(shape, dtype)
    width = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return tuple(
        unaligned_row_tile((*shape[:-1], width), dtype) for _ in range(row_bytes // SWIZZLE_BYTES)
    )


def split_tiles(shape, dtype, pieces: int, unaligned: bool = False):
    """`row_tile(shape, dtype, unaligned)`, or for an operand split into
    `pieces` > 1 bf16 pieces (`split_float32`) a tuple of one bf16
    `row_tile` per piece."""
    if pieces == 1:
        return row_tile(shape, dtype, unaligned)
    return tuple(row_tile(shape, jnp.bfloat16, unaligned) for _ in range(pieces))


def smem_vectors(shape, dtype):
    """Shared memory for per-residue vectors (mask, row statistics), each
    last-axis row starting 128-byte aligned as TMA wants."""
    *lead, length = shape
    return plgpu.SMEM((*lead, max(length, 128 // jnp.dtype(dtype).itemsize)), dtype)


def takes_row_views(n_res: int, interpret: bool) -> bool:
    """Whether a kernel's row tiles are `unaligned_row_tile` pairs: N % 8 != 0,
    compiled (the interpreter copies any rows into 8-row tiles)."""
    return n_res % RESIDUE_MULTIPLE != 0 and not interpret


def row_view_names(smem: dict) -> tuple[str, ...]:
    """The names of shared-memory specs that are `unaligned_row_tile` pairs,
    or tuples of them (`row_tile`'s column pieces, `split_tiles`' bf16
    pieces): `split_row_views`' `row_views`."""
    def is_pair(spec):
        return isinstance(spec, plgpu.RefUnion)

    return tuple(
        name for name, spec in smem.items()
        if is_pair(spec) or (isinstance(spec, tuple) and spec and all(map(is_pair, spec)))
    )


def split_row_views(smem: dict, row_views) -> tuple[dict, dict]:
    """`smem` for TMA copies and `smem` for everything else: each name in
    `row_views` (a pair of views, `unaligned_row_tile`, or a tuple of
    them) replaced by its first view in the one and by its second in the
    other."""
    def view(ref, which):
        return tuple(piece[which] for piece in ref) if isinstance(ref, tuple) else ref[which]

    tma = {name: view(ref, 0) if name in row_views else ref for name, ref in smem.items()}
    return tma, {name: view(ref, 1) if name in row_views else ref for name, ref in smem.items()}


def row_tile_at(tile, index):
    """`tile.at[index]` for a `row_tile`, also for one of column pieces."""
    if isinstance(tile, tuple):
        return tuple(piece.at[index] for piece in tile)
    return tile.at[index]


def store_row_tile(tile, value) -> None:
    """Writes `value` (`[rows, width]`, registers) to a `row_tile` view
    (`row_tile_at`), each column piece its own columns."""
    if not isinstance(tile, tuple):
        tile[...] = value
        return
    width = tile[0].shape[-1]
    for i, piece in enumerate(tile):
        piece[...] = value[:, i * width:(i + 1) * width]


def copy_row_tile_to_gmem(tile, gmem_ref) -> None:
    """`plgpu.copy_smem_to_gmem` of a `row_tile` view (`row_tile_at`, the
    TMA views) to `gmem_ref` (`[rows, width]`), each column piece to its
    own columns."""
    if not isinstance(tile, tuple):
        plgpu.copy_smem_to_gmem(tile, gmem_ref)
        return
    width = tile[0].shape[-1]
    for i, piece in enumerate(tile):
        plgpu.copy_smem_to_gmem(piece, gmem_ref.at[:, pl.ds(i * width, width)])


def operand_at(operand, *index):
    """`operand.at[index]`, or for a split operand (a tuple of one ref per
    piece, see `copy_tiles`) the tuple of each piece's, as `smem_products`
    takes it."""
    if isinstance(operand, tuple):
        return tuple(piece.at[index] for piece in operand)
    return operand.at[index]


def transposed(operand):
    """The transposed view of an operand or of each of its pieces."""
    if isinstance(operand, tuple):
        return tuple(piece.T for piece in operand)
    return operand.T
