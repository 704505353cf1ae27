"""Tile sizes and launch parameters for the Pallas kernels.

Triton tiles must be powers of two and the matrix units need every tile side
>= 16, so tiles along N are powers of two in [16, 128] and the head dim is
padded (inside the kernel, by masked loads) to `padded_head_dim(d)`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from msa_pallas.kernels.constants import FLOAT32_PIECES

MIN_TILE = 16
FLOAT32_PRODUCTS = ("tf32x3", "bf16x6", "ieee")
# The fused dq+dbias kernel holds whole softmax rows in registers: N <= 512.
MAX_FUSED_KEYS = 512
# Row-chunk split of the kernels that loop over S: about 4 programs per SM of
# an H100 / H200 (132 SMs), and at most 16 float32 partial sums of the bias.
TARGET_PROGRAMS = 512
MAX_ROW_CHUNKS = 16


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest divisor of `rows` that is <= `limit` (at least 1)."""
    return max(r for r in range(1, min(limit, rows) + 1) if rows % r == 0)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels compute with: a power of two, at least 16."""
    return max(MIN_TILE, next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Tiles and launch parameters of one kernel.

    Attributes:
      block_q: query residues per tile (power of two >= 16).
      block_k: key residues per tile (power of two >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the key/query loop.
      msa_rows: MSA rows one program of the forward, dk/dv and dq kernels
        serves: every row of a batch element shares the bias, so each bias
        tile a program loads feeds `msa_rows` rows (less bias traffic, more
        registers). Used as the largest divisor of S not above it. The
        kernels that loop over all S rows (dbias, dq+dbias) ignore it.
      float32_products: how float32 inputs multiply on the GPU: "tf32x3"
        (three TF32 products on operands split in two), "bf16x6" (six
        bf16 products on operands split exactly into three bf16 pieces;
        as accurate, and faster in the dq kernel on an H200) or "ieee"
        (FMA pipes; slower). Never plain TF32
        (`kernels.triton.common.dot_precision`). Part of the
        configuration, so it is in every compilation cache key.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    msa_rows: int = 1
    float32_products: str = "tf32x3"

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < MIN_TILE or value != next_power_of_2(value):
                raise ValueError(
                    f"{name}={value}; expected a power of two >= {MIN_TILE}."
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps}; expected 1, 2, 4, 8 or 16.")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages}; expected >= 1.")
        if self.msa_rows < 1:
            raise ValueError(f"msa_rows={self.msa_rows}; expected >= 1.")
        if self.float32_products not in FLOAT32_PRODUCTS:
            raise ValueError(
                f"float32_products={self.float32_products!r}; expected one of {FLOAT32_PRODUCTS}."
            )

    def msa_rows_for(self, rows: int) -> int:
        """MSA rows per program for S = `rows`: the largest divisor of S <= msa_rows."""
        return largest_divisor_at_most(rows, self.msa_rows)

    def clipped(self, n_res: int) -> "KernelTiles":
        """The same tiles, no larger than N rounded up to a power of two."""
        cap = max(MIN_TILE, next_power_of_2(n_res))
        return dataclasses.replace(
            self, block_q=min(self.block_q, cap), block_k=min(self.block_k, cap)
        )


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiles of the Mosaic GPU forward kernel (`msa_pallas.kernels.mosaic`).

    Attributes:
      block_q: query residues per consumer warpgroup (64 or 128).
      block_k: keys per pipeline stage (a multiple of 64).
      num_stages: depth of the shared-memory ring of K, V and bias tiles.
      msa_rows: consumer warpgroups per CTA, one MSA row each, sharing every
        bias tile (1, 2 or 4; used as the largest divisor of S not above
        it). Four consumers split the registers four ways (104 per thread,
        `kernels.mosaic.common.consumer_register_budget`): 64 x 64 tiles.
      ping_pong: with two consumers, the forward's consumers take turns
        (`kernels.mosaic.common.PingPong`). The backward kernels follow
        `MosaicBackwardTiles.ping_pong` instead.
      persistent: the forward launches one CTA per SM, each looping over
        its share of the (MSA-row group, query tile, batch-head) work items,
        so that one item's epilogue overlaps the loads of the next. The
        backward kernels ignore it.
      pipelined: each forward consumer issues the next key tile's `q k^T`
        before this tile's softmax and waits for it after this tile's
        `p v`, so its matrix products run during its own softmax (one
        logit tile more in registers). The backward kernels ignore it.
    """

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    msa_rows: int = 2
    ping_pong: bool = True
    persistent: bool = False
    pipelined: bool = False

    def __post_init__(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q={self.block_q}; expected 64 or 128.")
        if self.block_k % 64 or not 64 <= self.block_k <= 256:
            raise ValueError(f"block_k={self.block_k}; expected 64, 128, 192 or 256.")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages}; expected >= 2.")
        if self.msa_rows not in (1, 2, 4):
            raise ValueError(f"msa_rows={self.msa_rows}; expected 1, 2 or 4.")

    def msa_rows_for(self, rows: int) -> int:
        """MSA rows per CTA for S = `rows`: the largest divisor of S <= msa_rows."""
        return largest_divisor_at_most(rows, self.msa_rows)


def mosaic_shared_memory_bytes(
    tiles: MosaicTiles, head_dim: int, dtype, bias_dtype, *, has_mask: bool, has_gate: bool,
    save_stats: bool, heads_per_tile: int = 1,
) -> int:
    """Shared memory the Mosaic forward kernel allocates with `tiles`;
    `head_dim` is the width of its tiles, `heads_per_tile` the heads that
    share one (2 for d = 8: `kernels.mosaic.common.pairs_heads`)."""
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
        (`kernels.mosaic.common.PingPong`).
      dq_dbias: None, or the tiles of the fused dq + dbias kernel
        (`kernels.mosaic.backward.backward_dq_dbias`,
        `kernels.mosaic.backward.dq_dbias_tiles`), which then replaces the
        dq and dbias kernels: one exponential per logit for both instead of
        two. It takes 16-bit inputs with d >= 16 and N up to about 512.
        Opt-in: on the H200 it made the op's forward + backward no
        measurably faster (benchmarks/RESULTS.md).
    """

    dkdv: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    dq: MosaicTiles = MosaicTiles(block_q=128, block_k=64, num_stages=2, msa_rows=2)
    dbias: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    ping_pong: bool = True
    dq_dbias: MosaicTiles | None = None


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
    (`kernels.mosaic.common.split_float32`), and the float32 gradients of
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


# The fields of `BlockConfig` that hold Triton tiles.
TRITON_KERNELS = ("forward", "backward_dkdv", "backward_dq", "backward_dbias", "backward_dq_dbias")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tiles for the forward kernel and the three backward kernels.

    Hashable, so it can be a static argument of `jax.jit` / `custom_vjp`.

    Attributes:
      forward: the forward kernel (grid over query tiles, loop over key tiles).
      backward_dkdv: dk/dv kernel (grid over key tiles, loop over query tiles).
      backward_dq: dq kernel (grid over query tiles, loop over key tiles).
      backward_dbias: bias-gradient kernel (grid over query x key tiles,
        loop over the S MSA rows, so the sum over S never leaves registers).
      backward_dq_dbias: optional fused dq and bias-gradient kernel (grid
        over query tiles, loop over the S MSA rows) whose key tile spans all
        N keys; when set and `block_k >= N` it replaces `backward_dq` and
        `backward_dbias`, sharing one recomputation of the probabilities.
      mosaic_forward: the Mosaic GPU forward's tiles, where the call runs it
        (`msa_pallas.dispatch`); None: its `default_tiles`.
      mosaic_backward: the Mosaic GPU backward kernels' tiles, where the call
        runs them; None: their `default_tiles`.
    """

    forward: KernelTiles
    backward_dkdv: KernelTiles
    backward_dq: KernelTiles
    backward_dbias: KernelTiles
    backward_dq_dbias: KernelTiles | None = None
    mosaic_forward: MosaicTiles | None = None
    mosaic_backward: MosaicBackwardTiles | None = None

    def clipped(self, n_res: int) -> "BlockConfig":
        """Triton tiles no larger than N rounded up to a power of two (the
        Mosaic kernel handles any N with its own tiles)."""
        return dataclasses.replace(
            self,
            **{
                name: tiles.clipped(n_res)
                for name in TRITON_KERNELS
                if (tiles := getattr(self, name)) is not None
            },
        )

    def fuses_dq_dbias(self, n_res: int) -> bool:
        """Whether the backward runs the fused dq+dbias kernel at this N."""
        return self.backward_dq_dbias is not None and self.backward_dq_dbias.block_k >= n_res


def default_block_config(n_res: int, head_dim: int, dtype, bias_dtype=None) -> BlockConfig:
    """A heuristic choice by (N, d, dtype, bias dtype) that needs no tuning run.

    The rules come from tile sweeps on an H200 (`benchmarks/profile_kernels.py`;
    the measurements are in benchmarks/RESULTS.md). For one shape that
    matters, `msa_pallas.autotune` times the candidates on your GPU.

    Args:
      n_res: N, the residues per MSA row.
      head_dim: d.
      dtype: q's dtype.
      bias_dtype: the bias's dtype as the kernels read it (default: q's).
    """
    long_rows = n_res > 256
    d_pad = padded_head_dim(head_dim)
    itemsize = jnp.dtype(dtype).itemsize
    wide_bias = bias_dtype is not None and jnp.dtype(bias_dtype).itemsize > itemsize
    if itemsize >= 4 and d_pad <= 64:
        # float32 with split operands: three times the operand registers, so
        # unpipelined (1-stage) tiles in the backward. The dq kernel is 7-14%
        # faster with six bf16 products than with three TF32 ones; the other
        # kernels are not (benchmarks/RESULTS.md).
        forward = KernelTiles(64, 64, 4, 3) if long_rows else KernelTiles(64, 32, 4, 2)
        dkdv = KernelTiles(64, 64, 4, 1)
        dq = KernelTiles(64, 32, 4, 1, float32_products="bf16x6")
        dbias = KernelTiles(64, 64, 4, 1) if long_rows else KernelTiles(64, 64, 4, 3)
    elif itemsize >= 4 or d_pad >= 128:
        # IEEE float32 products, or d=128: twice the registers per tile.
        forward = KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=2)
        dkdv = KernelTiles(block_q=32, block_k=64, num_warps=4, num_stages=2)
        dq = KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=2)
        dbias = (
            KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=2)
            if d_pad <= 64
            else KernelTiles(block_q=32, block_k=32, num_warps=4, num_stages=2)
        )
    else:
        # 16-bit inputs: 64-wide tiles with 4 warps; deeper pipelining once
        # the key loop is long.
        stages = 3 if long_rows else 2
        forward = KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=stages)
        dkdv = (
            KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=3)
            if long_rows
            else KernelTiles(block_q=32, block_k=64, num_warps=4, num_stages=2)
        )
        dq = (
            KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=3)
            if long_rows
            else KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=2)
        )
        dbias = (
            KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=3)
            if long_rows and d_pad >= 32
            else KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=3)
        )
        if wide_bias:
            # A float32 bias tile takes twice the shared memory of a 16-bit
            # one: 64x32 dbias tiles win at every N (64x64 only beside the
            # 16-wide head dim of the extra-MSA stack), and 2 MSA rows per
            # dk/dv program pay at N <= 256.
            if not long_rows:
                dkdv = KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=2, msa_rows=2)
            if d_pad >= 32:
                dbias = KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=3)
                if n_res <= 384:
                    forward = KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=3)
    # The fused dq+dbias kernel (16 query rows against all keys) wins at d=32
    # with N <= 256 and ties at N = 384; taller query tiles spill registers;
    # with a 16-wide padded head dim (d <= 16, the extra-MSA stack) it is
    # 30-50x slower than dq + dbias, and in float32 slower than the two
    # kernels. So: 16-bit inputs, 32 <= d_pad <= 64, N <= 512.
    dq_dbias = None
    if itemsize < 4 and 32 <= d_pad < 128 and n_res <= MAX_FUSED_KEYS:
        dq_dbias = KernelTiles(
            block_q=16, block_k=max(MIN_TILE, next_power_of_2(n_res)),
            num_warps=2 if n_res <= 256 else 4, num_stages=2,
        )
    return BlockConfig(forward, dkdv, dq, dbias, dq_dbias).clipped(n_res)


def row_chunks(programs: int, rows: int) -> int:
    """How many slices of the S MSA rows a kernel that loops over S splits into.

    The dbias kernels loop over S so that the sum over S stays in registers;
    when (tiles x heads x batch) alone gives too few programs to fill the
    GPU, the rows are split into chunks, one program each, and the chunks'
    float32 partial sums are added afterwards. The count divides S (every
    chunk has the same static trip count).

    Args:
      programs: programs of the grid without the split.
      rows: S.
    """
    wanted = min(rows, MAX_ROW_CHUNKS, -(-TARGET_PROGRAMS // max(1, programs)))
    for chunks in range(max(1, wanted), min(rows, MAX_ROW_CHUNKS) + 1):
        if rows % chunks == 0:
            return chunks
    return max(c for c in range(1, wanted + 1) if rows % c == 0)
