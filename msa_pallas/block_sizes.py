"""Tile sizes and launch parameters for the Pallas kernels.

Triton tiles must be powers of two and the matrix units need every tile side
>= 16, so tiles along N are powers of two in [16, 128] and the head dim is
padded (inside the kernel, by masked loads) to `padded_head_dim(d)`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MIN_TILE = 16
# The fused dq+dbias kernel holds whole softmax rows in registers: N <= 512.
MAX_FUSED_KEYS = 512
# Row-chunk split of the kernels that loop over S: about 4 programs per SM of
# an H100 / H200 (132 SMs), and at most 16 float32 partial sums of the bias.
TARGET_PROGRAMS = 512
MAX_ROW_CHUNKS = 16


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels compute with: a power of two, at least 16."""
    return max(MIN_TILE, next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Tiles and launch parameters of one kernel.

    Attributes:
      block_q: query rows per tile (power of two >= 16).
      block_k: key rows per tile (power of two >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the key/query loop.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

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

    def clipped(self, n_res: int) -> "KernelTiles":
        """The same tiles, no larger than N rounded up to a power of two."""
        cap = max(MIN_TILE, next_power_of_2(n_res))
        return dataclasses.replace(
            self, block_q=min(self.block_q, cap), block_k=min(self.block_k, cap)
        )


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
    """

    forward: KernelTiles
    backward_dkdv: KernelTiles
    backward_dq: KernelTiles
    backward_dbias: KernelTiles
    backward_dq_dbias: KernelTiles | None = None

    def clipped(self, n_res: int) -> "BlockConfig":
        return BlockConfig(
            *(
                None if (tiles := getattr(self, f.name)) is None else tiles.clipped(n_res)
                for f in dataclasses.fields(self)
            )
        )

    def fuses_dq_dbias(self, n_res: int) -> bool:
        """Whether the backward runs the fused dq+dbias kernel at this N."""
        return self.backward_dq_dbias is not None and self.backward_dq_dbias.block_k >= n_res


def default_block_config(n_res: int, head_dim: int, dtype) -> BlockConfig:
    """A heuristic choice by (N, d, dtype) that needs no tuning run.

    Args:
      n_res: N, the residues per MSA row.
      head_dim: d.
      dtype: q's dtype.
    """
    # From tile sweeps on an H200 (benchmarks/RESULTS.md, profile_kernels.py):
    # 64-wide tiles with 4 warps lead; deeper pipelining pays in 16 bits once
    # the key loop is long, while 3xTF32 float32 products (three times the
    # operand registers) run best unpipelined.
    long_rows = n_res > 256
    d_pad = padded_head_dim(head_dim)
    if jnp.dtype(dtype).itemsize >= 4 and d_pad <= 64:
        # float32 with 3xTF32 products (H200, d=32, ms at train / long):
        # unpipelined (1-stage) dk/dv 64x64 takes 0.60 / 29.9, against
        # 0.85 / 47.2 for the 2-stage 32x64 tiles chosen for IEEE products.
        forward = KernelTiles(64, 64, 4, 3) if long_rows else KernelTiles(64, 32, 4, 2)
        dkdv = KernelTiles(64, 64, 4, 1)
        dq = KernelTiles(64, 32, 4, 1)
        dbias = KernelTiles(64, 64, 4, 1) if long_rows else KernelTiles(64, 64, 4, 3)
    elif jnp.dtype(dtype).itemsize >= 4 or d_pad >= 128:
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
        # 16-bit inputs (H200, bf16, d=32, ms at long): dk/dv 128x64 7.0
        # against 7.2 for 64x64; dq 64x64 4.56 against 4.70 for 64x32.
        stages = 3 if long_rows else 2
        forward = KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=stages)
        dkdv = (
            KernelTiles(block_q=128, block_k=64, num_warps=4, num_stages=3)
            if long_rows
            else KernelTiles(block_q=32, block_k=64, num_warps=4, num_stages=2)
        )
        dq = (
            KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=3)
            if long_rows
            else KernelTiles(block_q=64, block_k=32, num_warps=4, num_stages=2)
        )
        dbias = KernelTiles(block_q=64, block_k=64, num_warps=4, num_stages=3)
    # Measured on an H200 (bf16, d=32): the fused kernel with 16 query rows
    # against all keys takes 0.17 ms at train (2 warps; dq + dbias: 0.25 ms)
    # and 1.67 ms at finetune (4 warps; 1.68 ms). Taller query tiles were 3x to
    # 80x slower (register spills, most likely); in float32 it takes 1.1 ms at
    # train at best (4 warps, 1 stage) against 0.69 ms for the two kernels.
    dq_dbias = None
    sixteen_bit = jnp.dtype(dtype).itemsize < 4
    if sixteen_bit and d_pad < 128 and n_res <= MAX_FUSED_KEYS:
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
