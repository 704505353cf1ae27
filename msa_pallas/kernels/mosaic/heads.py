"""Two heads per tile for d = 8: the kernels read `[..., H, 8]` as
`[..., H / 2, 16]` (no padded copy in HBM), heads 2h and 2h + 1 in one
16-wide tile, and keep each head's products to its own columns."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.mosaic.matmul import WGMMA
from msa_pallas.kernels.mosaic.pipeline import run_when


# The head dim the forward takes as it is, two heads to a 16-wide tile
# (`pairs_heads`).
PAIRED_HEAD_DIM = 8


def pairs_heads(head_dim: int, heads: int) -> bool:
    """Whether the kernels read d = 8 as it is, heads 2h and 2h + 1 in one
    16-wide tile of the `[..., H / 2, 16]` view of `[..., H, 8]` (no padded
    copy in HBM): every product over d takes one operand with the other
    head's half zeroed (`own_head_columns`), every product into d keeps
    its own head's half (`combine_head_columns`). The forward, and the
    backward for 16-bit inputs (`tile_heads`)."""
    return head_dim == PAIRED_HEAD_DIM and heads % 2 == 0


def heads_per_tile(head_dim: int, heads: int) -> int:
    """Heads in one tile of the Mosaic kernels: 2 where `pairs_heads`, else 1."""
    return 2 if pairs_heads(head_dim, heads) else 1


def tile_heads(q_shape, dtype) -> int:
    """The heads in one tile of the backward kernels: 2 where they read d = 8
    as it is (16-bit inputs, an even H: `heads.pairs_heads`), else 1."""
    if jnp.dtype(dtype) == jnp.float32:
        return 1
    return heads_per_tile(q_shape[-1], q_shape[-2])


def as_head_pairs(x, heads_per_tile: int):
    """`[..., H, d]` seen as `[..., H / heads_per_tile, heads_per_tile * d]`
    (a free reshape): heads `2h` and `2h + 1` of d = 8 in one 16-wide tile."""
    *lead, heads, head_dim = x.shape
    return x.reshape(*lead, heads // heads_per_tile, head_dim * heads_per_tile)


def tiles_of_head_pairs(pair: int, *operands):
    """q, k, v and do as the kernels read them: `[..., H / 2, 16]` for two
    heads per tile (`heads.as_head_pairs`), else as they are."""
    if pair == 1:
        return operands
    return tuple(as_head_pairs(x, pair) for x in operands)


def head_of_columns(shape, heads_per_tile: int):
    """`[rows, width]` int32 in the wgmma layout: the head of the tile
    (of `heads_per_tile`, each `width / heads_per_tile` columns wide) that
    each column belongs to."""
    column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
    head_dim = shape[-1] // heads_per_tile
    head = jnp.zeros_like(column)
    for h in range(1, heads_per_tile):
        head = jnp.where(column >= h * head_dim, h, head)
    return head


def own_head_columns(tile, heads_per_tile: int) -> tuple:
    """A tile of several heads (`[rows, heads_per_tile * d]`, registers, the
    wgmma layout) as one copy per head with the other heads' columns
    zeroed: a product over the columns with such a copy sums over that
    head's alone."""
    head = head_of_columns(tile.shape, heads_per_tile)
    return tuple(
        jnp.where(head == h, tile, jnp.zeros_like(tile)) for h in range(heads_per_tile)
    )


def combine_head_columns(per_head):
    """One tile of several heads from one tile per head (each `[rows,
    width]`, the wgmma layout): each head's columns from its own tile."""
    combined = per_head[0]
    if len(per_head) > 1:
        head = head_of_columns(combined.shape, len(per_head))
        for h in range(1, len(per_head)):
            combined = jnp.where(head == h, per_head[h], combined)
    return combined


def store_own_head_tiles(tile_ref, head_refs, index) -> tuple:
    """Writes `own_head_columns` of the shared-memory tile `tile_ref` to
    `head_refs[h].at[index]`, one ref per head (a wgmma operand indexed by a
    constant fails to lower), and returns those views. The caller commits
    the writes (`plgpu.commit_smem`) before a `wgmma` reads them."""
    tile = plgpu.load(tile_ref, layout=WGMMA)
    for ref, own in zip(head_refs, own_head_columns(tile, len(head_refs))):
        ref[index] = own
    return tuple(ref.at[index] for ref in head_refs)


def held_tiles_per_head(smem, tiles: dict, wg, pair: int, when=True) -> list:
    """For each named tile a consumer holds across its loop, one view per
    head of the tile: the tile itself for one head per tile; for `pair`
    heads, copies with the other heads' columns zeroed, written to
    `smem[name + "_heads"]` (`heads.store_own_head_tiles`) and committed,
    where `when` holds (True, or a traced bool: a consumer whose loop runs
    no step writes none)."""
    if pair == 1:
        return [(tile,) for tile in tiles.values()]

    def store():
        for name, tile in tiles.items():
            store_own_head_tiles(tile, smem[f"{name}_heads"], wg)
        plgpu.commit_smem()

    run_when(when, store)
    return [tuple(ref.at[wg] for ref in smem[f"{name}_heads"]) for name in tiles]
