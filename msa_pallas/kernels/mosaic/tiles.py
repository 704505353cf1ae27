"""The configurations of the Mosaic GPU kernels, `MosaicTiles` (the forward,
and each backward kernel's) and `MosaicBackwardTiles`, and their default
choice for given inputs (`forward_tiles`, `backward_tiles`): the fastest
measured candidates whose plan fits in shared memory."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from msa_pallas.kernels.mosaic.heads import heads_per_tile, tile_heads
from msa_pallas.kernels.mosaic.plan import dbias_plan, dkdv_plan, dq_plan, forward_plan
from msa_pallas.kernels.mosaic.smem import MAX_SHARED_MEMORY
from msa_pallas.kernels.mosaic.support import FLOAT32_MAX_HEAD_DIM, kernel_head_dim


# The largest N at which the forward takes four MSA rows per CTA where masked
# queries are skipped (`forward_tiles`).
FOUR_ROWS_MAX_N = 256


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiles of the Mosaic GPU forward kernel (`msa_pallas.kernels.mosaic`).

    Attributes:
      block_q: query residues per consumer warpgroup (64 or 128).
      block_k: keys per pipeline stage (a multiple of 64).
      num_stages: depth of the shared-memory ring of K, V and bias tiles.
      msa_rows: consumer warpgroups per CTA, one MSA row each, sharing every
        bias tile (1, 2 or 4; used as the largest of those dividing S, not
        above it). Four consumers share the registers four ways (104 a
        thread, `pipeline.consumer_register_budget`): 64 x 64 tiles, no
        turns; the forward's alone (the backward tiles take 1 or 2).
      ping_pong: with two consumers, the forward's consumers take turns
        (`kernels.mosaic.pipeline.PingPong`). The backward kernels follow
        `MosaicBackwardTiles.ping_pong` instead.
      persistent: the forward launches one CTA per SM, each looping over
        its share of the (MSA-row group, query tile, batch-head) work items,
        so that one item's epilogue overlaps the loads of the next. The dq
        and dk/dv kernels take it too (`work_items.BackwardItems`: skipping
        padding, the dead row groups at the end of the alignment get their
        results without a CTA each); chosen for them where padding is
        skipped (`backward_tiles`). The bias-gradient kernel ignores it.
      staggered_bias: a 32-bit bias tile is read from shared memory with
        Mosaic GPU's bank-conflict-free plan, a select per logit; False:
        each lane reads its own elements, with two-way bank conflicts and no
        select (`logits.load_bias_tile`). 16-bit tiles are read alike either
        way. Every kernel takes it.
      mask_without_select: the backward kernels make a masked key's ds 0
        without a select after the product: dq and dbias set its exponent
        to -inf, dk/dv multiplies ds by the key's 0 or 1
        (`backward.operands.recompute`). The same dq, dk and dv bitwise;
        compiled, dbias's sum over rows takes one rounding less per term (the
        product and the sum fused), so it may differ from the select's in the
        last bits. The default: on an H100, forward+backward 0.3-6.1% faster
        from finetune up, within run-to-run spread at the training and padded
        crops (benchmarks/log, 2026-12-05 13). False: the select after the
        product. The forward ignores it.
    """

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    msa_rows: int = 2
    ping_pong: bool = True
    persistent: bool = False
    staggered_bias: bool = True
    mask_without_select: bool = True

    def __post_init__(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q={self.block_q}; expected 64 or 128.")
        if self.block_k % 64 or not 64 <= self.block_k <= 256:
            raise ValueError(f"block_k={self.block_k}; expected 64, 128, 192 or 256.")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages}; expected >= 2.")
        if self.msa_rows not in (1, 2, 4):
            raise ValueError(f"msa_rows={self.msa_rows}; expected 1, 2 or 4.")
        if self.msa_rows == 4 and (self.block_q, self.block_k) != (64, 64):
            raise ValueError("msa_rows=4: four consumers' registers (104 a thread) hold "
                             "64 x 64 tiles alone; expected block_q = block_k = 64.")

    def msa_rows_for(self, rows: int) -> int:
        """MSA rows per CTA for S = `rows`: the largest of 1, 2 and 4 that
        divides S and is <= msa_rows."""
        return max(r for r in (1, 2, 4) if r <= self.msa_rows and rows % r == 0)


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
      prologue_kernel: after the Mosaic forward, without dropout, what the
        kernels read of the output's cotangent (`do`, the gate's gradient,
        the stacked row statistics; skipping padding, the dead rows' dv) is
        made by one Pallas kernel that reads each row once
        (`triton.backward_prologue`), in place of two XLA passes over every
        row (three skipping); chosen where padding is skipped
        (`backward_tiles`).
    """

    dkdv: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    dq: MosaicTiles = MosaicTiles(block_q=128, block_k=64, num_stages=2, msa_rows=2)
    dbias: MosaicTiles = MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=2)
    ping_pong: bool = True
    prologue_kernel: bool = False

    def __post_init__(self):
        for kernel in ("dkdv", "dq", "dbias"):
            rows = getattr(self, kernel).msa_rows
            if rows > 2:
                raise ValueError(f"{kernel}: msa_rows={rows}; the backward kernels take 1 "
                                 "or 2 MSA rows per CTA.")


def forward_tiles(
    q_shape, q_dtype, bias_dtype, save_stats: bool, has_gate: bool = True,
    persistent: bool = True, dropout: bool = False, skips_masked_queries: bool = False,
):
    """The fastest configuration measured that fits in shared memory.

    128-query tiles per warpgroup and 2 MSA rows per CTA win from N = 384 up
    (benchmarks/RESULTS.md, an H200); 128-key stages where they fit (a
    16-bit bias), else 64-key stages; one MSA row per CTA only for head dims
    too large for two.

    Where the kernels skip masked queries (`skips_masked_queries`: padding
    skipped, the op's `mask_queries`) up to N = `FOUR_ROWS_MAX_N` (S a
    multiple of 4, d <= 32, one head per tile, no dropout): four MSA rows
    per CTA in 64 x 64 tiles, whose 64-query tiles let a padded crop's
    masked queries skip whole tiles. On an H100 (2026-12-06, bf16 q/k/v,
    benchmarks/log/2026-12-06-02-four-msa-rows-per-cta-where-queries-are-skipped.md),
    at the padded training crop with `mask_queries`, forward / forward+
    backward: 0.053 -> 0.046 / 0.255 -> 0.246 ms with a bf16 bias, 0.050 ->
    0.049 / 0.255 -> 0.252 ms with a float32 one. Not elsewhere: at the
    unpadded training crop they took 0.059-0.060 against 0.053 ms forward
    (bf16 bias; 0.063 against 0.059 with a float32 one), and at N = 384,
    timed call by call, up to 28% longer.

    The persistent grid (with the residuals 2-22% faster at the SPEC
    shapes, within 1% at one) where its output tile fits beside them,
    unless `persistent` is False (the Mosaic GPU interpreter stalls on it
    on a machine with few cores). With d = 8 and an even H (two heads per
    tile, `heads.pairs_heads`) the consumers hold two heads' logits, so
    64-key stages; with attention `dropout` too, whose key words (one per
    key of the stage, in every thread) and keep masks do not fit in a
    consumer's registers beside a 128 x 128 logit tile: measured on the
    H200 at the fine-tuning crop (bf16, bias bf16), 128-key stages spill
    and take 1.18 ms against 0.73 ms for 64-key ones
    (benchmarks/log/2026-12-04-09-dropout-tiles.md).
    """
    batch, rows, n_res, heads, head_dim = q_shape
    pair = heads_per_tile(head_dim, heads)
    shapes = ((128, 128, 2, 2), (128, 64, 2, 2), (64, 64, 2, 2), (64, 64, 2, 1))
    if (skips_masked_queries and n_res <= FOUR_ROWS_MAX_N and rows % 4 == 0 and pair == 1
            and head_dim <= 32 and not dropout):
        shapes = ((64, 64, 2, 4),) + shapes
    if pair > 1 or dropout:
        # Two heads' logit tiles, or one and the dropout words, in
        # registers at once: 64 keys.
        shapes = tuple(shape for shape in shapes if shape[1] == 64)
    preferred = [
        MosaicTiles(*shape, ping_pong=shape[3] != 4, persistent=grid)
        for shape in shapes
        for grid in ((True, False) if persistent else (False,))
    ]
    for tiles in preferred:
        # Sized for the candidate's MSA rows: the shared memory does not
        # depend on S.
        rows_shape = (batch, tiles.msa_rows, n_res, heads, head_dim)
        kernel_plan = forward_plan(
            rows_shape, q_dtype, bias_dtype, tiles, mask_dtype=jnp.int8,
            gate_dtype=q_dtype if has_gate else None, save_stats=save_stats, interpret=False,
            mask_queries=skips_masked_queries,
        )
        if kernel_plan.shared_memory_bytes <= MAX_SHARED_MEMORY:
            return tiles
    raise ValueError(f"no Mosaic configuration fits head dim {head_dim} in shared memory")


def backward_tiles(q_shape, q_dtype, bias_dtype, dropout: bool = False,
                   persistent: bool = False, prologue_kernel: bool = False
                   ) -> MosaicBackwardTiles:
    """The backward kernels' tiles for these inputs: per kernel the first
    candidate that fits in shared memory, two MSA rows (consumers) before one.
    The tiles of d <= 32 are the fastest of an H200 sweep (benchmarks/RESULTS.md);
    larger head dims take smaller tiles, for the registers their accumulators
    need (not swept yet). The consumers take turns (ping-pong) with a 16-bit
    bias; with a float32 bias that measured slower.

    float32 inputs (three bf16 pieces per operand in shared memory, the
    split products' registers) take 64 x 64 tiles, not timed yet.

    With attention `dropout` the tiles are the same: the fastest in a sweep
    on the H200 (benchmarks/log/2026-12-04-09-dropout-tiles.md) once the
    kernels read each step's dropout words from its ring slot (the plans'
    `dropout`, counted here in the shared memory that must fit).

    Tiles for d < 16 are chosen for the head dim the kernels see, 16 (for
    d = 8 with two heads per tile, `tile_heads`, with the shared memory
    of both heads' bias tiles).

    `persistent` makes the dq and dk/dv tiles persistent (one CTA per SM,
    `MosaicTiles.persistent`; never with `dropout`, which they do not take).
    Where padding is skipped their CTAs write the dead row groups' gradients
    without a CTA each: on the H200, forward+backward 3-5% faster at the
    padded crops and 3% at the unpadded training crop (bf16, 2026-12-05,
    benchmarks/log/2026-12-05-03-padding-on-the-h200.md).

    `prologue_kernel` asks for the backward's prologue in one Pallas kernel
    (`MosaicBackwardTiles.prologue_kernel`). Where padding is skipped it
    measured 1.9-5.4% faster forward+backward at the padded crops and the same
    within 1% at the unpadded ones, for 8-9% more temporary memory at the
    extra MSA (its kernel writes the stacked statistics while the float32
    output it reads is alive; an H100, bf16, 2026-12-05,
    benchmarks/log/2026-12-05-11-the-backwards-prologue-where-padding-is-skipped.md)."""
    if persistent and dropout:
        raise ValueError("the persistent dq and dk/dv kernels take no dropout")
    head_dim = kernel_head_dim(q_shape[-1])
    pair = tile_heads(q_shape, q_dtype)
    # q as the kernels take it: d < 16 zero-padded to 16 unless two heads
    # share a tile.
    kernel_shape = (*q_shape[:-1], q_shape[-1] if pair > 1 else head_dim)
    if jnp.dtype(q_dtype) == jnp.float32 and head_dim > FLOAT32_MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim} in float32: the Mosaic backward takes d <= {FLOAT32_MAX_HEAD_DIM}"
        )
    preferred = {
        "dkdv": {32: [(64, 128)], 64: [(128, 64)], 128: [(64, 64)]},
        "dq": {32: [(128, 64)], 64: [(128, 64)], 128: [(64, 64)]},
        "dbias": {32: [(64, 128)], 64: [(64, 128), (64, 64)], 128: [(64, 128), (64, 64)]},
    }
    if jnp.dtype(q_dtype) == jnp.float32:
        preferred = {kernel: {64: [(64, 64)]} for kernel in preferred}
    plans = {"dkdv": dkdv_plan, "dq": dq_plan, "dbias": dbias_plan}
    chosen = {}
    for kernel, by_head_dim in preferred.items():
        blocks = by_head_dim[min(d for d in by_head_dim if d >= head_dim)]
        candidates = [
            MosaicTiles(block_q, block_k, num_stages=2, msa_rows=rows,
                        persistent=persistent and kernel in ("dq", "dkdv"))
            for rows in (2, 1) for block_q, block_k in blocks
        ]
        fits = [
            tiles for tiles in candidates
            # Sized for the candidate's MSA rows, whatever S.
            if plans[kernel](
                (kernel_shape[0], tiles.msa_rows, *kernel_shape[2:]), q_dtype, bias_dtype, tiles,
                mask_dtype=jnp.int8, interpret=False, dropout=dropout,
            ).shared_memory_bytes <= MAX_SHARED_MEMORY
        ]
        if not fits:
            raise ValueError(f"no Mosaic {kernel} configuration fits head dim {head_dim}")
        chosen[kernel] = fits[0]
    return MosaicBackwardTiles(**chosen, ping_pong=jnp.dtype(bias_dtype).itemsize == 2,
                               prologue_kernel=prologue_kernel)
