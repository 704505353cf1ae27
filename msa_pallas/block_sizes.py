"""Tile sizes and launch parameters for the Pallas kernels.

Triton tiles must be powers of two and the matrix units need every tile side
>= 16, so tiles along N are powers of two in [16, 128] and the head dim is
padded (inside the kernel, by masked loads) to `padded_head_dim(d)`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles

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


def row_chunks_in_waves(programs: int, rows: int, slots: int) -> int:
    """How many slices of the S MSA rows the Mosaic dbias kernel splits into:
    at most `row_chunks`' count, and fewer where they take no longer.

    The kernel's CTAs run `slots` at a time (one per SM: its shared memory
    leaves no room for a second), each over at most ceil(S / chunks) rows
    (the chunks need not divide S: they split it as evenly as whole rows
    allow), so a launch takes about waves x ceil(S / chunks) row steps,
    waves = ceil(programs x chunks / slots). Of the counts up to
    `row_chunks(programs, rows)`, the one of fewest row steps, and of those
    the fewest chunks: fewer float32 partial sums of the bias to write and
    add. At the training crop (32 programs, S = 128) that is 4 chunks, one
    wave of 128 CTAs, where `row_chunks` takes 16, four waves of a quarter
    of the rows each; at the extra MSA (36 programs, S = 1,024) 11 chunks,
    three whole waves of 93-94 rows, where 16 take five of 64 (the last
    a third full). More chunks than `row_chunks` takes are never chosen:
    each adds a partial sum (B x H x N^2 float32) that a shorter tail may
    not repay.

    Args:
      programs: programs of the grid without the split.
      rows: S.
      slots: CTAs that run at once (the GPU's SMs).
    """
    def row_steps(chunks: int) -> int:
        return -(-programs * chunks // slots) * -(-rows // chunks)

    return min(range(1, row_chunks(programs, rows) + 1),
               key=lambda chunks: (row_steps(chunks), chunks))


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
