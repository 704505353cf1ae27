"""The Mosaic GPU backward kernels: Hopper (sm90), 16-bit inputs.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics, so no `[S, H, N, N]` array exists; the kernels
own disjoint outputs, so no atomics are used and two runs give bitwise
identical gradients. All are warp-specialised as the forward is
(`common.produce`: a producer warpgroup streams each loop step's tiles by TMA
into a shared-memory ring; consumer warpgroups compute with `wgmma`).

- dk/dv (`backward_dkdv`): one CTA per key tile of one head for `msa_rows`
  MSA rows, looping over query tiles. Each consumer warpgroup owns one row's
  K and V tile and works in the transposed orientation, keys along the wgmma
  rows: `s^T = k q^T` and `dp^T = v do^T` from shared memory, then
  `dv += p^T do` and `dk += ds^T q` with `p^T` and `ds^T` straight from
  registers. Per query tile the producer loads the rows' q and do tiles and
  row statistics and ONE tile of the transposed bias, shared by the rows
  (`bias^T` is made once per call: B·H·N² elements against the kernel's
  B·S·H·N² logits).
- dq (`backward_dq`): one CTA per query tile of one head for `msa_rows`
  rows, looping over key tiles, the forward's loop with `dp = do v^T`,
  `ds = p (dp - delta)` and `dq += ds k` in place of the online softmax.
- dbias (`backward_dbias`): one CTA per (query tile, key tile) of one head,
  looping over the S MSA rows (or a chunk of them); its two consumer
  warpgroups split the query tile, and the sum over S stays in registers.

d = 8 with an even H, 16-bit (`tile_heads`): the kernels read q, k, v and
`do` as they are, heads 2h and 2h + 1 in one 16-wide tile
(`common.pairs_heads`). dk/dv and dq take a CTA per pair of heads: the
tiles they hold across the loop (K and V, q and do) get one copy per head
with the other head's columns zeroed, each loop step runs the two heads
one after the other (each its own bias tile, statistics and accumulator),
and each head's columns of the result come from its own accumulator.
dbias sums one head over the chunk's rows, then the other, multiplying
q and do from registers with the other head's columns zeroed. Other
d < 16 (and float32 d = 8) are zero-padded to 16 by the caller.

float32 inputs (d <= 64): q, k, v and `do` enter as three bf16 pieces each
(`common.split_float32`, one XLA pass), `p` and `ds` are split in registers,
and every product is the sum of six bf16 `wgmma` products
(`common.piece_pairs`), each loop step's added to the running sum in float32;
the float32 gradients leave through float32 tiles of their own.

Inputs shared by all: q, k, v and `do` (the cotangent of the ungated
output, in q's dtype) `[B, S, N, H, d]`; bias `[B, H, N, N]` 16- or 32-bit;
mask `[B, S, N]` int8 or None; `stats` `[B, S, H, 3, N]` float32: the
forward's row max and log2 row sum (base 2) and `delta = sum_d do * o`.

N need not be a whole number of tiles (`common.supports`): tiles that run
past N read zeros (TMA), which give a zero gradient contribution wherever
they meet real residues (a zero `q` / `do` row, a zero statistic; keys past
N get `ds = 0` in dq), and the stores of q's layout and of the bias
gradient drop what lies past N. As in the forward, only the bias and mask
rows (and the bias gradient's) are padded, to whole TMA rows
(`common.pad_residues`). N need not be a multiple of 8 where
`common.takes_any_n` (d <= 64): the tiles of q, k, v and `do` (and the
gradients leaving through them; for float32 inputs each bf16 piece, and the
float32 gradients' tiles, at d = 64 as two column pieces) are then pairs of
views (`common.unaligned_row_tile`), TMA copying through the untiled one; the
bias's rows are padded to a multiple of 8 (`common.pad_bias_rows`), the
statistics to whole 16-byte rows, and the bias gradient's rows are
allocated to a multiple of 8 and sliced.

The loops visit every tile; they are where tiles that the key mask removes
entirely, and attention dropout, will go.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.block_sizes import (
    MosaicBackwardTiles, MosaicTiles, dbias_in_bias_tile, mosaic_backward_shared_memory_bytes,
    row_chunks,
)
from msa_pallas.kernels.constants import FLOAT32_PIECES, LOG2E, MASKED_LOGIT_LOG2
from msa_pallas.kernels.mosaic.common import (
    FLOAT32_MAX_HEAD_DIM, HEAD_DIMS, MAX_SHARED_MEMORY, RESIDUE_MULTIPLE, SIXTEEN_BIT, WGMMA,
    WGMMA_COL, WGMMA_ROW, PingPong, accumulate_products, accumulator_bias, aligned_residues,
    as_head_pairs, batch_head_and_warpgroup, bias_tile, check_kernel_inputs,
    combine_head_columns, consumer_registers, copy_row_tile_to_gmem, copy_tiles, heads_per_tile,
    kernel_head_dim, keys_before, launch, matrix_operand, operand_at, own_head_columns,
    pad_bias_rows, pad_residues, produce, producer_registers, row_tile, row_tile_at,
    row_view_names, smem_products, smem_tile, smem_vectors, split_float32, split_row_views,
    split_tiles, store_own_head_tiles, store_row_tile, takes_row_views, transposed, zeros,
)


def default_tiles(q_shape, q_dtype, bias_dtype) -> MosaicBackwardTiles:
    """The backward kernels' tiles for these inputs: per kernel the first
    candidate that fits in shared memory, two MSA rows (consumers) before one.
    The tiles of d <= 32 are the fastest of an H200 sweep (benchmarks/RESULTS.md);
    larger head dims take smaller tiles, for the registers their accumulators
    need (not swept yet). The consumers take turns (ping-pong) with a 16-bit
    bias; with a float32 bias that measured slower.

    float32 inputs (three bf16 pieces per operand in shared memory, the
    split products' registers) take 64 x 64 tiles, not timed yet.

    Tiles for d < 16 are chosen for the head dim the kernels see, 16 (for
    d = 8 with two heads per tile, `tile_heads`, with the shared memory
    of both heads' bias tiles)."""
    head_dim = kernel_head_dim(q_shape[-1])
    pair = tile_heads(q_shape, q_dtype)
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
    chosen = {}
    for kernel, by_head_dim in preferred.items():
        blocks = by_head_dim[min(d for d in by_head_dim if d >= head_dim)]
        candidates = [
            MosaicTiles(block_q, block_k, num_stages=2, msa_rows=rows)
            for rows in (2, 1) for block_q, block_k in blocks
        ]
        fits = [
            tiles for tiles in candidates
            if mosaic_backward_shared_memory_bytes(
                kernel, tiles, head_dim, q_dtype, bias_dtype, heads_per_tile=pair
            ) <= MAX_SHARED_MEMORY
        ]
        if not fits:
            raise ValueError(f"no Mosaic {kernel} configuration fits head dim {head_dim}")
        chosen[kernel] = fits[0]
    return MosaicBackwardTiles(**chosen, ping_pong=jnp.dtype(bias_dtype).itemsize == 2)


def _chunk_batch_and_head(batch_heads: int, heads: int):
    """The row chunk, batch element and head of this CTA, from its
    `chunk_batch_heads` grid index (chunks slowest)."""
    chunk_batch_head = lax.axis_index("chunk_batch_heads")
    batch_head = lax.rem(chunk_batch_head, batch_heads)
    return (
        lax.div(chunk_batch_head, batch_heads), lax.div(batch_head, heads),
        lax.rem(batch_head, heads),
    )


def _copy_key_tiles(gmem, smem_tma, smem, rows, batch, keys, head, slot, barrier):
    """The producer's copies of one key step of the dq kernel's loop: each of
    `rows`' K and V tiles (and key-mask vector, where there is a mask) into
    the consumer slots `(slot, 0..)`, all arriving on `barrier`."""
    for consumer, row in enumerate(rows):
        copy_tiles(
            gmem, smem_tma, ("k", "v"), (batch, row, keys, head), (slot, consumer), barrier
        )
        if "mask" in gmem:
            plgpu.copy_gmem_to_smem(
                gmem["mask"].at[batch, pl.ds(row, 1), keys],
                smem["mask"].at[slot, consumer, :, pl.ds(0, keys.size)], barrier,
            )


def _query_major_ds(
    q_smem, do_smem, k_smem, v_smem, bias, mask_ref, stats, key_tile, turns, *, scale: float,
    n_res: int, block_k: int, interpret: bool,
):
    """One `[block_q, block_k]` float32 `ds` tile of the dq kernel's loop
    (`_dq_kernel`): `s = q k^T + bias` and `dp = do v^T`
    from shared memory, then `ds` from the row statistics. `mask_ref` is the
    consumer's `[1, >= block_k]` int8 key-mask slot, or None."""
    s, dp = smem_products(
        ((q_smem, transposed(k_smem)), (do_smem, transposed(v_smem))),
        turns.hand_over, inits=(bias_tile(bias, scale), None), interpret=interpret,
    )
    keep = None
    if mask_ref is not None:
        keep = plgpu.load(mask_ref.at[0, pl.ds(0, block_k)], layout=WGMMA_COL) != 0
    _, ds = _recompute(s, dp, keep, stats, scale=scale, query_axis=0, with_p=False)
    if keep is None and n_res % block_k:
        # Keys past N read zeros, whose probability is not 0: their ds must
        # not reach dq (with a mask, the zeros read there mask them; the bias
        # gradient's columns past N are dropped by its store).
        ds = jnp.where(keys_before(n_res, key_tile, block_k, ds.shape), ds, 0.0)
    return ds


def _recompute(s, dp, keep, stats, *, scale: float, query_axis: int, with_p: bool):
    """The probabilities `p` (if `with_p`, else None) and the logit gradient
    `ds` of one tile, float32, as the forward computed them.

    Args:
      s: `q . k + bias / scale` of the tile (the product started from the
        bias tile, `common.bias_tile`); dp: `do . v`; both in the same
        orientation, queries along `query_axis`.
      keep: `[keys]` bool (nonzero keeps) or None.
      stats: row max, log2 row sum and delta, `[queries]` float32 each.
    """
    row_max, row_log2_sum, delta = stats
    per_query = lambda x: lax.broadcast_in_dim(x, s.shape, [query_axis])  # noqa: E731
    # For a row with a kept key the row max is an ordinary logit, so one
    # subtraction of m + log2(l) is exact enough; masked keys take their own
    # value below (m is -1.44e9 for a fully masked row). One FMA per logit.
    x = s * (scale * LOG2E) - per_query(row_max + row_log2_sum)
    if keep is not None:
        keep = lax.broadcast_in_dim(keep, s.shape, [1 - query_axis])
        if with_p:
            masked = per_query((MASKED_LOGIT_LOG2 - row_max) - row_log2_sum)
            x = jnp.where(keep, x, masked)
    p = jnp.exp2(x)
    ds = p * (dp - per_query(delta))
    if keep is not None:
        # A masked key's logit is a constant: no gradient flows through it.
        ds = jnp.where(keep, ds, 0.0)
    return (p if with_p else None), ds


def _held_tiles_per_head(smem, tiles: dict, wg, pair: int) -> list:
    """For each named tile a consumer holds across its loop, one view per
    head of the tile: the tile itself for one head per tile; for `pair`
    heads, copies with the other heads' columns zeroed, written to
    `smem[name + "_heads"]` (`common.store_own_head_tiles`) and committed."""
    if pair == 1:
        return [(tile,) for tile in tiles.values()]
    views = [store_own_head_tiles(tile, smem[f"{name}_heads"], wg) for name, tile in tiles.items()]
    plgpu.commit_smem()
    return views


def _load_stats(stats_ref, layout):
    """Row max, log2 row sum and delta: the rows of a `[3, queries]` tile."""
    return tuple(plgpu.load(stats_ref.at[i], layout=layout) for i in range(3))


def _dkdv_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, heads_per_tile: int, dtype, ping_pong: bool, interpret: bool,
    row_views: tuple[str, ...] = (),
):
    """`heads`: the heads of q, k and v as the kernel sees them, each
    `heads_per_tile` heads of the bias and statistics (2 for d = 8).
    `row_views`: the names of `smem` that are pairs of views (N % 8 != 0,
    `common.split_row_views`): copies go through `smem_tma`."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    query_tiles = pl.cdiv(n_res, block_q)
    has_mask = "mask" in gmem
    batch, head, wg = batch_head_and_warpgroup(heads)
    row_group = lax.axis_index("row_groups")
    keys = pl.ds(lax.axis_index("key_tiles") * block_k, block_k)

    @pl.when(wg < msa_rows)
    def _consumer():
        consumer_registers(msa_rows)
        row = row_group * msa_rows + wg
        k_smem, v_smem = operand_at(smem["k"], wg), operand_at(smem["v"], wg)
        copy_tiles(
            gmem, smem_tma, ("k", "v"), (batch, row, keys, head), wg, produced["kv"].at[wg]
        )
        keep = None
        if has_mask:
            plgpu.copy_gmem_to_smem(
                gmem["mask"].at[batch, pl.ds(row, 1), keys],
                smem["mask"].at[wg, :, pl.ds(0, block_k)], produced["kv"].at[wg],
            )
        plgpu.barrier_wait(produced["kv"].at[wg])
        if has_mask:
            keep = plgpu.load(smem["mask"].at[wg, 0, pl.ds(0, block_k)], layout=WGMMA_ROW) != 0
        # A product of a head's K or V with q or do tiles of both heads
        # sums over that head's columns alone.
        keys_of_head, values_of_head = _held_tiles_per_head(
            smem, {"k": k_smem, "v": v_smem}, wg, pair
        )
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_query_tile(query_tile, carry):
            dks, dvs = (list(c) for c in carry)
            slot = lax.rem(query_tile, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            q_smem, do_smem = operand_at(smem["q"], slot, wg), operand_at(smem["do"], slot, wg)
            # One head after the other, each a full turn: the registers hold
            # one head's logits at a time.
            for h in range(pair):
                s_t, dp_t = smem_products(
                    ((keys_of_head[h], transposed(q_smem)),
                     (values_of_head[h], transposed(do_smem))),
                    turns.hand_over, inits=(bias_tile(smem["bias"][slot, h], scale), None),
                    interpret=interpret,
                )
                stats = _load_stats(smem["stats"].at[slot, wg, h], WGMMA_COL)
                p_t, ds_t = _recompute(
                    s_t, dp_t, keep, stats, scale=scale, query_axis=1, with_p=True
                )
                # Finish the elementwise work before handing the turn over.
                p_t, ds_t = lax.optimization_barrier(
                    (matrix_operand(p_t, dtype), matrix_operand(ds_t, dtype))
                )
                turns.release()
                turns.take_turn()
                # Against q and do tiles of both heads: this head's columns of
                # dv and dk are right, the other's are dropped below.
                dvs[h], dks[h] = accumulate_products(
                    (dvs[h], dks[h]), (p_t, ds_t), (do_smem, q_smem), interpret
                )
            plgpu.barrier_arrive(consumed.at[slot])
            return tuple(dks), tuple(dvs)

        tile_dim = gmem["dk"].shape[-1]
        start = (zeros((block_k, tile_dim)),) * pair
        dks, dvs = lax.fori_loop(0, query_tiles, visit_query_tile, (start, start))
        turns.finish()
        dk, dv = combine_head_columns(dks), combine_head_columns(dvs)
        # 16-bit: K's and V's tiles are free again and hold the gradients on their way out.
        dk_name, dv_name = ("dk", "dv") if "dk" in smem else ("k", "v")
        store_row_tile(row_tile_at(smem[dk_name], wg), (dk * scale).astype(dtype))
        store_row_tile(row_tile_at(smem[dv_name], wg), dv.astype(dtype))
        plgpu.commit_smem()
        for name, tile in (("dk", dk_name), ("dv", dv_name)):
            copy_row_tile_to_gmem(
                row_tile_at(smem_tma[tile], wg), gmem[name].at[batch, row, keys, head]
            )
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == msa_rows)
    def _producer():
        producer_registers()
        first_row = row_group * msa_rows

        def issue_copies(query_tile, slot):
            queries = pl.ds(query_tile * block_q, block_q)
            barrier = produced["step"].at[slot]
            for r in range(msa_rows):
                row = first_row + r
                copy_tiles(
                    gmem, smem_tma, ("q", "do"), (batch, row, queries, head), (slot, r), barrier
                )
                plgpu.copy_gmem_to_smem(
                    gmem["stats"].at[batch, row, pl.ds(head * pair, pair), :, queries],
                    smem["stats"].at[slot, r], barrier,
                )
            for h in range(pair):
                plgpu.copy_gmem_to_smem(
                    gmem["bias_t"].at[batch, head * pair + h, keys, queries],
                    smem["bias"].at[slot, h], barrier,
                )

        produce(query_tiles, stages, issue_copies, consumed)


def _dq_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, heads_per_tile: int, dtype, ping_pong: bool, interpret: bool,
    row_views: tuple[str, ...] = (),
):
    """`heads`, `heads_per_tile` and `row_views` as in `_dkdv_kernel`."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    key_tiles = pl.cdiv(n_res, block_k)
    has_mask = "mask" in gmem
    batch, head, wg = batch_head_and_warpgroup(heads)
    row_group = lax.axis_index("row_groups")
    queries = pl.ds(lax.axis_index("query_tiles") * block_q, block_q)

    @pl.when(wg < msa_rows)
    def _consumer():
        consumer_registers(msa_rows)
        row = row_group * msa_rows + wg
        q_smem, do_smem = operand_at(smem["q"], wg), operand_at(smem["do"], wg)
        copy_tiles(
            gmem, smem_tma, ("q", "do"), (batch, row, queries, head), wg, produced["q"].at[wg]
        )
        plgpu.copy_gmem_to_smem(
            gmem["stats"].at[batch, row, pl.ds(head * pair, pair), :, queries],
            smem["stats"].at[wg], produced["q"].at[wg],
        )
        plgpu.barrier_wait(produced["q"].at[wg])
        stats = [_load_stats(smem["stats"].at[wg, h], WGMMA_ROW) for h in range(pair)]
        queries_of_head, douts_of_head = _held_tiles_per_head(
            smem, {"q": q_smem, "do": do_smem}, wg, pair
        )
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_key_tile(key_tile, dqs):
            dqs = list(dqs)
            slot = lax.rem(key_tile, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            k_smem, v_smem = operand_at(smem["k"], slot, wg), operand_at(smem["v"], slot, wg)
            for h in range(pair):
                ds = _query_major_ds(
                    queries_of_head[h], douts_of_head[h], k_smem, v_smem,
                    smem["bias"][slot, h], smem["mask"].at[slot, wg] if has_mask else None,
                    stats[h], key_tile, turns, scale=scale, n_res=n_res, block_k=block_k,
                    interpret=interpret,
                )
                ds = lax.optimization_barrier(matrix_operand(ds, dtype))
                turns.release()
                turns.take_turn()
                # Against K tiles of both heads: the other head's columns are
                # dropped below.
                (dqs[h],) = accumulate_products((dqs[h],), (ds,), (k_smem,), interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            return tuple(dqs)

        tile_dim = gmem["dq"].shape[-1]
        dqs = lax.fori_loop(
            0, key_tiles, visit_key_tile, (zeros((block_q, tile_dim)),) * pair
        )
        turns.finish()
        dq = combine_head_columns(dqs)
        # 16-bit: q's tile is free again and holds dq on its way out.
        out_name = "dq" if "dq" in smem else "q"
        store_row_tile(row_tile_at(smem[out_name], wg), (dq * scale).astype(dtype))
        plgpu.commit_smem()
        copy_row_tile_to_gmem(
            row_tile_at(smem_tma[out_name], wg), gmem["dq"].at[batch, row, queries, head]
        )
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == msa_rows)
    def _producer():
        producer_registers()
        first_row = row_group * msa_rows

        def issue_copies(key_tile, slot):
            keys = pl.ds(key_tile * block_k, block_k)
            barrier = produced["step"].at[slot]
            _copy_key_tiles(
                gmem, smem_tma, smem, [first_row + r for r in range(msa_rows)],
                batch, keys, head, slot, barrier,
            )
            for h in range(pair):
                plgpu.copy_gmem_to_smem(
                    gmem["bias"].at[batch, head * pair + h, queries, keys],
                    smem["bias"].at[slot, h], barrier,
                )

        produce(key_tiles, stages, issue_copies, consumed)


def _dbias_kernel(
    gmem, smem, produced, consumed, *, scale: float, tiles: MosaicTiles, consumers: int,
    rows_per_chunk: int, batch_heads: int, heads: int, heads_per_tile: int, interpret: bool,
    row_views: tuple[str, ...] = (),
):
    """`heads`, `heads_per_tile` and `row_views` as in `_dkdv_kernel`: with
    two heads per tile the CTA sums one head's gradient over the chunk's
    rows, then the other's, each head's bias tile loaded into the same
    shared memory."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    has_mask = "mask" in gmem
    chunk, batch, head = _chunk_batch_and_head(batch_heads, heads)
    wg = lax.axis_index("wg")
    cta_queries = lax.axis_index("query_tiles") * block_q * consumers
    keys = pl.ds(lax.axis_index("key_tiles") * block_k, block_k)
    first_row = chunk * rows_per_chunk

    @pl.when(wg < consumers)
    def _consumer():
        consumer_registers(consumers)
        queries = pl.ds(cta_queries + wg * block_q, block_q)

        def logit_products(h, slot):
            """`q k^T` started from head h's bias tile, and `do v^T`."""
            q_smem, do_smem = (operand_at(smem[n], slot, wg) for n in ("q", "do"))
            k_smem, v_smem = (operand_at(smem[n], slot) for n in ("k", "v"))
            # The bias tile is read from shared memory at every step (held in
            # registers across the loop, a float32 tile would crowd out s and
            # dp) into the logits' accumulator.
            bias = bias_tile(smem["bias"][wg], scale)
            if pair == 1:
                return smem_products(
                    ((q_smem, transposed(k_smem)), (do_smem, transposed(v_smem))),
                    inits=(bias, None), interpret=interpret,
                )
            # q and do tiles of both heads, from registers with the other
            # head's columns zeroed: the products sum over head h's alone.
            own_q, own_do = (
                own_head_columns(plgpu.load(tile, layout=WGMMA), pair)[h]
                for tile in (q_smem, do_smem)
            )
            return accumulate_products(
                (bias, zeros((block_q, block_k))), (own_q, own_do),
                (transposed(k_smem), transposed(v_smem)), interpret,
            )

        for h in range(pair):
            if h > 0 and "dbias" not in smem:
                # The previous head's result is leaving through the bias tile.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(
                gmem["bias"].at[batch, head * pair + h, queries, keys], smem["bias"].at[wg],
                produced["bias"].at[wg],
            )
            plgpu.barrier_wait(produced["bias"].at[wg])

            def visit_msa_row(row, dbias, h=h):
                slot = lax.rem(h * rows_per_chunk + row, stages)
                plgpu.barrier_wait(produced["step"].at[slot])
                s, dp = logit_products(h, slot)
                stats = _load_stats(smem["stats"].at[slot, wg], WGMMA_ROW)
                keep = None
                if has_mask:
                    keep = plgpu.load(
                        smem["mask"].at[slot, 0, pl.ds(0, block_k)], layout=WGMMA_COL
                    ) != 0
                plgpu.barrier_arrive(consumed.at[slot])
                _, ds = _recompute(s, dp, keep, stats, scale=scale, query_axis=0, with_p=False)
                return dbias + ds

            dbias = lax.fori_loop(0, rows_per_chunk, visit_msa_row, zeros((block_q, block_k)))
            # Without a tile of its own, the result leaves through the float32
            # bias tile, which this consumer alone has read.
            if "dbias" in smem:
                out_smem = smem["dbias"].at[wg]
                if h > 0:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            else:
                out_smem = smem["bias"].at[wg]
            out_smem[...] = dbias
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem, gmem["dbias"].at[chunk, batch, head * pair + h, queries, keys]
            )
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        producer_registers()

        def issue_copies(step, slot):
            # Step h * rows_per_chunk + r: row r of the chunk for head h.
            h, row = 0, first_row + step
            if pair > 1:
                h, row = lax.div(step, rows_per_chunk), first_row + lax.rem(step, rows_per_chunk)
            barrier = produced["step"].at[slot]
            for w in range(consumers):
                queries = pl.ds(cta_queries + w * block_q, block_q)
                copy_tiles(
                    gmem, smem_tma, ("q", "do"), (batch, row, queries, head), (slot, w), barrier
                )
                plgpu.copy_gmem_to_smem(
                    gmem["stats"].at[batch, row, head * pair + h, :, queries],
                    smem["stats"].at[slot, w], barrier,
                )
            copy_tiles(gmem, smem_tma, ("k", "v"), (batch, row, keys, head), slot, barrier)
            if has_mask:
                plgpu.copy_gmem_to_smem(
                    gmem["mask"].at[batch, pl.ds(row, 1), keys],
                    smem["mask"].at[slot, :, pl.ds(0, block_k)], barrier,
                )

        produce(pair * rows_per_chunk, stages, issue_copies, consumed)


def _split_operands(*operands):
    """(pieces, operands): 1 and the operands as they are for 16-bit inputs;
    for float32 ones `FLOAT32_PIECES` and each operand's bf16 pieces stacked
    on a new leading axis (`common.split_float32`, one XLA pass each)."""
    if operands[0].dtype != jnp.float32:
        return 1, operands
    return FLOAT32_PIECES, tuple(jnp.stack(split_float32(x, FLOAT32_PIECES)) for x in operands)


def _operands(**named):
    """The kernel's inputs by name, the bias, mask and statistics rows
    padded to whole TMA rows (`common.pad_residues`) and the bias's rows to
    whole 8-row tiles (`common.pad_bias_rows`; N % 8 != 0); None entries
    dropped."""
    swizzled = {"bias": True, "bias_t": True, "mask": False, "stats": False}
    padded = {
        name: pad_residues(x, swizzled[name]) if name in swizzled else x
        for name, x in named.items() if x is not None
    }
    return {
        name: pad_bias_rows(x) if name in ("bias", "bias_t") else x for name, x in padded.items()
    }


def tile_heads(q_shape, dtype) -> int:
    """The heads in one tile of the backward kernels: 2 where they read d = 8
    as it is (16-bit inputs, an even H: `common.pairs_heads`), else 1."""
    if jnp.dtype(dtype) == jnp.float32:
        return 1
    return heads_per_tile(q_shape[-1], q_shape[-2])


def _tiles_of_head_pairs(pair: int, *operands):
    """q, k, v and do as the kernels read them: `[..., H / 2, 16]` for two
    heads per tile (`common.as_head_pairs`), else as they are."""
    if pair == 1:
        return operands
    return tuple(as_head_pairs(x, pair) for x in operands)


def _step_scratch(copies: int, stages: int, consumers: int):
    produced = plgpu.Barrier(num_arrivals=copies, num_barriers=stages)
    consumed = plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)
    return produced, consumed


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret", "ping_pong"))
def backward_dkdv(
    q, k, v, bias, mask, do, stats, *, scale: float, tiles: MosaicTiles, interpret: bool,
    ping_pong: bool = True,
):
    """dk, dv `[B, S, N, H, d]` in q's dtype (arguments as in the module
    docstring; float32 q, k, v and do as in `backward_dbias`)."""
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    batch, rows, n_res, heads, _ = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = tile_heads(q.shape, q.dtype)
    pieces, (q_in, k, v, do) = _split_operands(*_tiles_of_head_pairs(pair, q, k, v, do))
    inputs = _operands(
        q=q_in, k=k, v=v, bias_t=jnp.swapaxes(accumulator_bias(bias, scale), -1, -2),
        mask=mask, do=do, stats=stats,
    )
    tile_dim = k.shape[-1]
    out_types = {"dk": jax.ShapeDtypeStruct(k.shape[pieces > 1:], q.dtype),
                 "dv": jax.ShapeDtypeStruct(k.shape[pieces > 1:], q.dtype)}
    row_views = takes_row_views(n_res, interpret)
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces, row_views)  # noqa: E731
    smem = {
        "k": operand_tiles((msa_rows, block_k, tile_dim)),
        "v": operand_tiles((msa_rows, block_k, tile_dim)),
        "q": operand_tiles((stages, msa_rows, block_q, tile_dim)),
        "do": operand_tiles((stages, msa_rows, block_q, tile_dim)),
        "stats": smem_vectors((stages, msa_rows, pair, 3, block_q), jnp.float32),
        "bias": smem_tile((stages, pair, block_k, block_q), bias.dtype),
    }
    if pair > 1:
        for name in ("k_heads", "v_heads"):
            smem[name] = tuple(
                smem_tile((msa_rows, block_k, tile_dim), q.dtype) for _ in range(pair)
            )
    if pieces > 1:
        smem["dk"] = row_tile((msa_rows, block_k, tile_dim), jnp.float32, row_views)
        smem["dv"] = row_tile((msa_rows, block_k, tile_dim), jnp.float32, row_views)
    if mask is not None:
        smem["mask"] = smem_vectors((msa_rows, 1, block_k), mask.dtype)
    produced_step, consumed = _step_scratch(
        (2 * pieces + 1) * msa_rows + pair, stages, msa_rows
    )
    kv_copies = 2 * pieces + (1 if mask is not None else 0)
    produced = {
        "kv": plgpu.Barrier(num_arrivals=kv_copies, num_barriers=msa_rows),
        "step": produced_step,
    }
    body = functools.partial(
        _dkdv_kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads // pair, heads_per_tile=pair, dtype=q.dtype,
        ping_pong=ping_pong, interpret=interpret, row_views=row_view_names(smem),
    )
    dk, dv = launch(
        body, name="msa_mosaic_dkdv",
        scratch=(smem, produced, consumed, plgpu.Barrier(num_arrivals=msa_rows)),
        inputs=inputs, out_types=out_types,
        grid=(rows // msa_rows, pl.cdiv(n_res, block_k), batch * heads // pair),
        grid_names=("row_groups", "key_tiles", "batch_heads"),
        consumers=msa_rows, interpret=interpret,
    )
    return dk.reshape(q.shape), dv.reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret", "ping_pong"))
def backward_dq(
    q, k, v, bias, mask, do, stats, *, scale: float, tiles: MosaicTiles, interpret: bool,
    ping_pong: bool = True,
):
    """dq `[B, S, N, H, d]` in q's dtype (arguments as in the module
    docstring; float32 q, k, v and do as in `backward_dbias`)."""
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    batch, rows, n_res, heads, _ = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = tile_heads(q.shape, q.dtype)
    pieces, (q_in, k, v, do) = _split_operands(*_tiles_of_head_pairs(pair, q, k, v, do))
    inputs = _operands(
        q=q_in, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do,
        stats=stats,
    )
    tile_dim = k.shape[-1]
    out_types = {"dq": jax.ShapeDtypeStruct(k.shape[pieces > 1:], q.dtype)}
    row_views = takes_row_views(n_res, interpret)
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces, row_views)  # noqa: E731
    smem = {
        "q": operand_tiles((msa_rows, block_q, tile_dim)),
        "do": operand_tiles((msa_rows, block_q, tile_dim)),
        "stats": smem_vectors((msa_rows, pair, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, msa_rows, block_k, tile_dim)),
        "v": operand_tiles((stages, msa_rows, block_k, tile_dim)),
        "bias": smem_tile((stages, pair, block_q, block_k), bias.dtype),
    }
    if pair > 1:
        for name in ("q_heads", "do_heads"):
            smem[name] = tuple(
                smem_tile((msa_rows, block_q, tile_dim), q.dtype) for _ in range(pair)
            )
    if pieces > 1:
        smem["dq"] = row_tile((msa_rows, block_q, tile_dim), jnp.float32, row_views)
    copies = 2 * msa_rows * pieces + pair
    if mask is not None:
        smem["mask"] = smem_vectors((stages, msa_rows, 1, block_k), mask.dtype)
        copies += msa_rows
    produced_step, consumed = _step_scratch(copies, stages, msa_rows)
    produced = {
        "q": plgpu.Barrier(num_arrivals=2 * pieces + 1, num_barriers=msa_rows),
        "step": produced_step,
    }
    body = functools.partial(
        _dq_kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads // pair, heads_per_tile=pair, dtype=q.dtype,
        ping_pong=ping_pong, interpret=interpret, row_views=row_view_names(smem),
    )
    (dq,) = launch(
        body, name="msa_mosaic_dq",
        scratch=(smem, produced, consumed, plgpu.Barrier(num_arrivals=msa_rows)),
        inputs=inputs, out_types=out_types,
        grid=(rows // msa_rows, pl.cdiv(n_res, block_q), batch * heads // pair),
        grid_names=("row_groups", "query_tiles", "batch_heads"),
        consumers=msa_rows, interpret=interpret,
    )
    return dq.reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dbias(
    q, k, v, bias, mask, do, stats, *, scale: float, tiles: MosaicTiles, interpret: bool
):
    """dbias `[B, H, N, N]` float32, summed over the S MSA rows (arguments as
    in the module docstring; q, k, v and do may also be float32).

    When (tiles x heads x batch) gives too few CTAs to fill the GPU, the rows
    are split into chunks (`block_sizes.row_chunks`), one CTA each, and the
    chunks' float32 partial sums are added in a fixed order.

    float32 q, k, v and do enter as `FLOAT32_PIECES` bfloat16 pieces each
    (`common.split_float32`, a pass over them in XLA), and each product is
    the sum of the pieces' products (`common.piece_pairs`): float32
    accuracy from the 16-bit `wgmma`.
    """
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    batch, rows, n_res, heads, _ = q.shape
    consumers = tiles.msa_rows
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    query_tiles = pl.cdiv(n_res, block_q * consumers)
    key_tiles = pl.cdiv(n_res, block_k)
    pair = tile_heads(q.shape, q.dtype)
    chunks = row_chunks(query_tiles * key_tiles * batch * heads // pair, rows)
    pieces, (q, k, v, do) = _split_operands(*_tiles_of_head_pairs(pair, q, k, v, do))
    tile_dim = k.shape[-1]
    inputs = _operands(
        q=q, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do,
        stats=stats,
    )
    # Rows of whole 8-row tiles and columns of a whole TMA stride, sliced
    # back to N below.
    dbias_shape = (
        chunks, batch, heads, pl.cdiv(n_res, RESIDUE_MULTIPLE) * RESIDUE_MULTIPLE,
        aligned_residues(n_res, jnp.float32, True),
    )
    out_types = {"dbias": jax.ShapeDtypeStruct(dbias_shape, jnp.float32)}
    row_views = takes_row_views(n_res, interpret)
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces, row_views)  # noqa: E731
    smem = {"bias": smem_tile((consumers, block_q, block_k), bias.dtype)}
    if not dbias_in_bias_tile(pieces, bias.dtype):
        smem["dbias"] = smem_tile((consumers, block_q, block_k), jnp.float32)
    smem |= {
        "q": operand_tiles((stages, consumers, block_q, tile_dim)),
        "do": operand_tiles((stages, consumers, block_q, tile_dim)),
        "stats": smem_vectors((stages, consumers, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, block_k, tile_dim)),
        "v": operand_tiles((stages, block_k, tile_dim)),
    }
    copies = (2 * consumers + 2) * pieces + consumers
    if mask is not None:
        smem["mask"] = smem_vectors((stages, 1, block_k), mask.dtype)
        copies += 1
    produced_step, consumed = _step_scratch(copies, stages, consumers)
    produced = {
        "bias": plgpu.Barrier(num_arrivals=1, num_barriers=consumers),
        "step": produced_step,
    }
    body = functools.partial(
        _dbias_kernel, scale=scale, tiles=tiles, consumers=consumers,
        rows_per_chunk=rows // chunks, batch_heads=batch * heads // pair,
        heads=heads // pair, heads_per_tile=pair, interpret=interpret,
        row_views=row_view_names(smem),
    )
    (partial_sums,) = launch(
        body, name="msa_mosaic_dbias", scratch=(smem, produced, consumed),
        inputs=inputs, out_types=out_types,
        grid=(query_tiles, key_tiles, chunks * batch * heads // pair),
        grid_names=("query_tiles", "key_tiles", "chunk_batch_heads"),
        consumers=consumers, interpret=interpret,
    )
    partial_sums = partial_sums[..., :n_res, :n_res]
    return partial_sums[0] if chunks == 1 else partial_sums.sum(axis=0)


def shared_memory_bytes(smem: dict) -> int:
    """The bytes of a kernel's shared-memory specs (a `RefUnion`'s views
    share theirs; tuples are summed)."""
    def size(spec) -> int:
        if isinstance(spec, tuple):
            return sum(map(size, spec))
        if isinstance(spec, plgpu.RefUnion):
            return max(map(size, spec.refs))
        return math.prod(spec.shape) * jnp.dtype(spec.dtype).itemsize

    return sum(size(spec) for spec in smem.values())
