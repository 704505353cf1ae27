"""The configurations of the Mosaic GPU kernels: `MosaicTiles` (the forward,
and each backward kernel's) and `MosaicBackwardTiles`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from msa_pallas.kernels.constants import FLOAT32_PIECES


def _largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest divisor of `rows` that is <= `limit` (at least 1)."""
    return max(r for r in range(1, min(limit, rows) + 1) if rows % r == 0)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiles of the Mosaic GPU forward kernel (`msa_pallas.kernels.mosaic`).

    Attributes:
      block_q: query residues per consumer warpgroup (64 or 128).
      block_k: keys per pipeline stage (a multiple of 64).
      num_stages: depth of the shared-memory ring of K, V and bias tiles.
      msa_rows: consumer warpgroups per CTA, one MSA row each, sharing every
        bias tile (1 or 2; used as the largest divisor of S not above it).
      ping_pong: with two consumers, the forward's consumers take turns
        (`kernels.mosaic.pipeline.PingPong`). The backward kernels follow
        `MosaicBackwardTiles.ping_pong` instead.
      persistent: the forward launches one CTA per SM, each looping over
        its share of the (MSA-row group, query tile, batch-head) work items,
        so that one item's epilogue overlaps the loads of the next. The
        backward kernels ignore it.
    """

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    msa_rows: int = 2
    ping_pong: bool = True
    persistent: bool = False

    def __post_init__(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q={self.block_q}; expected 64 or 128.")
        if self.block_k % 64 or not 64 <= self.block_k <= 256:
            raise ValueError(f"block_k={self.block_k}; expected 64, 128, 192 or 256.")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages}; expected >= 2.")
        if self.msa_rows not in (1, 2):
            raise ValueError(f"msa_rows={self.msa_rows}; expected 1 or 2.")

    def msa_rows_for(self, rows: int) -> int:
        """MSA rows per CTA for S = `rows`: the largest divisor of S <= msa_rows."""
        return _largest_divisor_at_most(rows, self.msa_rows)


def mosaic_shared_memory_bytes(
    tiles: MosaicTiles, head_dim: int, dtype, bias_dtype, *, has_mask: bool, has_gate: bool,
    save_stats: bool, heads_per_tile: int = 1,
) -> int:
    """Shared memory the Mosaic forward kernel allocates with `tiles`;
    `head_dim` is the width of its tiles, `heads_per_tile` the heads that
    share one (2 for d = 8: `kernels.mosaic.heads.pairs_heads`)."""
    rows, stages = tiles.msa_rows, tiles.num_stages
    item, bias_item = jnp.dtype(dtype).itemsize, jnp.dtype(bias_dtype).itemsize
    query_tile = rows * tiles.block_q * head_dim
    used = query_tile * item  # q, then the output
    used += query_tile * item * heads_per_tile if heads_per_tile > 1 else 0  # q per head
    used += 2 * stages * rows * tiles.block_k * head_dim * item  # K and V
    used += stages * heads_per_tile * tiles.block_q * tiles.block_k * bias_item
    used += stages * rows * max(tiles.block_k, 128) if has_mask else 0
    used += query_tile * item if has_gate else 0
    stats = 2 * rows * heads_per_tile * tiles.block_q * 4
    used += query_tile * 4 + stats if save_stats else 0
    # Persistent: the output leaves through a tile of its own, as q's holds
    # the next item's queries.
    used += query_tile * item if tiles.persistent else 0
    return used + 2048  # barriers and alignment


@dataclasses.dataclass(frozen=True)
class MosaicBackwardTiles:
    """Tiles of the three Mosaic GPU backward kernels (`msa_pallas.kernels.mosaic.backward`).

    Attributes:
      dkdv: `block_k` keys per consumer warpgroup (the wgmma rows), `block_q`
        queries per loop step, `msa_rows` rows per CTA (one per consumer).
      dq: `block_q` queries per consumer, `block_k` keys per loop step,
        `msa_rows` rows per CTA.
      dbias: `block_q` queries per consumer, `block_k` keys; `msa_rows`
        consumer warpgroups split the CTA's query tile (the CTA loops over
        the MSA rows).
      ping_pong: the two consumers of the dk/dv and dq kernels take turns
        (`kernels.mosaic.pipeline.PingPong`).
    """

    dkdv: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    dq: MosaicTiles = MosaicTiles(block_q=128, block_k=64, num_stages=2, msa_rows=2)
    dbias: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    ping_pong: bool = True


def dbias_in_bias_tile(pieces: int, bias_dtype) -> bool:
    """Whether the Mosaic dbias kernel writes its result through the bias
    tile's shared memory instead of a tile of its own: for float32 q (split
    into `pieces` > 1, which need the room) with a float32 bias."""
    return pieces > 1 and jnp.dtype(bias_dtype).itemsize == 4


def mosaic_backward_shared_memory_bytes(
    kernel: str, tiles: MosaicTiles, head_dim: int, dtype, bias_dtype, heads_per_tile: int = 1
) -> int:
    """Shared memory the backward kernel `kernel` ("dkdv", "dq" or
    "dbias") allocates with `tiles`; `head_dim` is the width of its tiles,
    `heads_per_tile` the heads that share one (2 for d = 8: in dk/dv and
    dq the bias and statistics tiles of each head, and one copy per head of
    the tiles held across the loop; dbias takes the heads one at a time).
    float32 operands take three bf16 pieces each
    (`kernels.mosaic.matmul.split_float32`), and the float32 gradients of
    q, k and v their own output tiles."""
    rows, stages, pair = tiles.msa_rows, tiles.num_stages, heads_per_tile
    item, bias_item = jnp.dtype(dtype).itemsize, jnp.dtype(bias_dtype).itemsize
    float32 = item == 4
    if float32:
        item = 2 * FLOAT32_PIECES  # bf16 pieces
    bias_tile = tiles.block_q * tiles.block_k * bias_item
    stats = 3 * max(tiles.block_q, 32) * 4
    mask = max(tiles.block_k, 128)
    held_copies = 1 + (pair if pair > 1 else 0)  # the tile and its per-head copies
    if kernel == "dkdv":
        used = 2 * held_copies * rows * tiles.block_k * head_dim * item + rows * mask  # K, V
        used += 2 * rows * tiles.block_k * head_dim * 4 if float32 else 0  # dK, dV
        used += stages * (
            2 * rows * tiles.block_q * head_dim * item + rows * pair * stats + pair * bias_tile
        )
    elif kernel == "dq":
        used = 2 * held_copies * rows * tiles.block_q * head_dim * item  # q, do
        used += rows * pair * stats
        used += rows * tiles.block_q * head_dim * 4 if float32 else 0  # dq
        used += stages * (
            2 * rows * tiles.block_k * head_dim * item + rows * mask + pair * bias_tile
        )
    elif kernel == "dbias":
        # The bias tiles, then the float32 result tiles (for float32 q with a
        # float32 bias, the result leaves through the bias tiles).
        used = rows * bias_tile  # one head's at a time
        if not dbias_in_bias_tile(FLOAT32_PIECES if float32 else 1, bias_dtype):
            used += rows * tiles.block_q * tiles.block_k * 4
        used += stages * (
            2 * rows * tiles.block_q * head_dim * item + rows * stats
            + 2 * tiles.block_k * head_dim * item + mask
        )
    else:
        raise ValueError(f"kernel={kernel!r}; expected 'dkdv', 'dq' or 'dbias'.")
    return used + 2048  # barriers and alignment
