"""The Mosaic GPU backward kernels: Hopper (sm90), 16-bit inputs.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics, so no `[S, H, N, N]` array exists; the kernels
own disjoint outputs, so no atomics are used and two runs give bitwise
identical gradients. All three are warp-specialised as the forward is
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
(`common.pad_residues`).

The loops visit every tile; they are where tiles that the key mask removes
entirely, and attention dropout, will go.
"""

from __future__ import annotations

import functools

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
    FLOAT32_MAX_HEAD_DIM, MAX_SHARED_MEMORY, WGMMA_COL, WGMMA_ROW, PingPong,
    accumulate_products, accumulator_bias, aligned_residues, batch_head_and_warpgroup,
    bias_tile, check_kernel_inputs, consumer_registers, copy_tiles, kernel_head_dim,
    keys_before, launch, matrix_operand, operand_at, pad_residues, produce, producer_registers,
    smem_products, smem_tile, smem_vectors, split_float32, split_tiles, transposed, zeros,
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

    Tiles for d < 16 are chosen for the head dim the kernels see, 16."""
    head_dim = kernel_head_dim(q_shape[-1])
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
            if mosaic_backward_shared_memory_bytes(kernel, tiles, head_dim, q_dtype, bias_dtype)
            <= MAX_SHARED_MEMORY
        ]
        if not fits:
            raise ValueError(f"no Mosaic {kernel} configuration fits head dim {head_dim}")
        chosen[kernel] = fits[0]
    return MosaicBackwardTiles(**chosen, ping_pong=jnp.dtype(bias_dtype).itemsize == 2)


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


def _load_stats(stats_ref, layout):
    """Row max, log2 row sum and delta: the rows of a `[3, queries]` tile."""
    return tuple(plgpu.load(stats_ref.at[i], layout=layout) for i in range(3))


def _dkdv_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, dtype, ping_pong: bool, interpret: bool,
):
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
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
        copy_tiles(gmem, smem, ("k", "v"), (batch, row, keys, head), wg, produced["kv"].at[wg])
        keep = None
        if has_mask:
            plgpu.copy_gmem_to_smem(
                gmem["mask"].at[batch, pl.ds(row, 1), keys],
                smem["mask"].at[wg, :, pl.ds(0, block_k)], produced["kv"].at[wg],
            )
        plgpu.barrier_wait(produced["kv"].at[wg])
        if has_mask:
            keep = plgpu.load(smem["mask"].at[wg, 0, pl.ds(0, block_k)], layout=WGMMA_ROW) != 0
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_query_tile(query_tile, carry):
            dk, dv = carry
            slot = lax.rem(query_tile, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            q_smem, do_smem = operand_at(smem["q"], slot, wg), operand_at(smem["do"], slot, wg)
            s_t, dp_t = smem_products(
                ((k_smem, transposed(q_smem)), (v_smem, transposed(do_smem))), turns.hand_over,
                inits=(bias_tile(smem["bias"][slot], scale), None), interpret=interpret,
            )
            stats = _load_stats(smem["stats"].at[slot, wg], WGMMA_COL)
            p_t, ds_t = _recompute(
                s_t, dp_t, keep, stats, scale=scale, query_axis=1, with_p=True
            )
            # Finish the elementwise work before handing the turn over.
            p_t, ds_t = lax.optimization_barrier(
                (matrix_operand(p_t, dtype), matrix_operand(ds_t, dtype))
            )
            turns.release()
            turns.take_turn()
            dv, dk = accumulate_products(
                (dv, dk), (p_t, ds_t), (do_smem, q_smem), interpret
            )
            plgpu.barrier_arrive(consumed.at[slot])
            return dk, dv

        head_dim = gmem["dk"].shape[-1]
        dk, dv = lax.fori_loop(
            0, query_tiles, visit_query_tile,
            (zeros((block_k, head_dim)), zeros((block_k, head_dim))),
        )
        turns.finish()
        # 16-bit: K's and V's tiles are free again and hold the gradients on their way out.
        dk_smem, dv_smem = (
            (smem["dk"].at[wg], smem["dv"].at[wg]) if "dk" in smem else (k_smem, v_smem)
        )
        dk_smem[...] = (dk * scale).astype(dtype)
        dv_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, gmem["dk"].at[batch, row, keys, head])
        plgpu.copy_smem_to_gmem(dv_smem, gmem["dv"].at[batch, row, keys, head])
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
                copy_tiles(gmem, smem, ("q", "do"), (batch, row, queries, head), (slot, r), barrier)
                plgpu.copy_gmem_to_smem(
                    gmem["stats"].at[batch, row, head, :, queries], smem["stats"].at[slot, r],
                    barrier,
                )
            plgpu.copy_gmem_to_smem(
                gmem["bias_t"].at[batch, head, keys, queries], smem["bias"].at[slot], barrier
            )

        produce(query_tiles, stages, issue_copies, consumed)


def _dq_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, dtype, ping_pong: bool, interpret: bool,
):
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
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
        copy_tiles(gmem, smem, ("q", "do"), (batch, row, queries, head), wg, produced["q"].at[wg])
        plgpu.copy_gmem_to_smem(
            gmem["stats"].at[batch, row, head, :, queries], smem["stats"].at[wg],
            produced["q"].at[wg],
        )
        plgpu.barrier_wait(produced["q"].at[wg])
        stats = _load_stats(smem["stats"].at[wg], WGMMA_ROW)
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_key_tile(key_tile, dq):
            slot = lax.rem(key_tile, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            k_smem, v_smem = operand_at(smem["k"], slot, wg), operand_at(smem["v"], slot, wg)
            s, dp = smem_products(
                ((q_smem, transposed(k_smem)), (do_smem, transposed(v_smem))), turns.hand_over,
                inits=(bias_tile(smem["bias"][slot], scale), None), interpret=interpret,
            )
            keep = None
            if has_mask:
                keep = plgpu.load(
                    smem["mask"].at[slot, wg, 0, pl.ds(0, block_k)], layout=WGMMA_COL
                ) != 0
            _, ds = _recompute(s, dp, keep, stats, scale=scale, query_axis=0, with_p=False)
            if keep is None and n_res % block_k:
                # Keys past N read zeros, whose probability is not 0: their
                # ds must not reach dq (with a mask, the zeros read there
                # mask them).
                ds = jnp.where(keys_before(n_res, key_tile, block_k, ds.shape), ds, 0.0)
            ds = lax.optimization_barrier(matrix_operand(ds, dtype))
            turns.release()
            turns.take_turn()
            (dq,) = accumulate_products((dq,), (ds,), (k_smem,), interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            return dq

        head_dim = gmem["dq"].shape[-1]
        dq = lax.fori_loop(0, key_tiles, visit_key_tile, zeros((block_q, head_dim)))
        turns.finish()
        # 16-bit: q's tile is free again and holds dq on its way out.
        out_smem = smem["dq"].at[wg] if "dq" in smem else q_smem
        out_smem[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, gmem["dq"].at[batch, row, queries, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == msa_rows)
    def _producer():
        producer_registers()
        first_row = row_group * msa_rows

        def issue_copies(key_tile, slot):
            keys = pl.ds(key_tile * block_k, block_k)
            barrier = produced["step"].at[slot]
            for r in range(msa_rows):
                row = first_row + r
                copy_tiles(gmem, smem, ("k", "v"), (batch, row, keys, head), (slot, r), barrier)
                if has_mask:
                    plgpu.copy_gmem_to_smem(
                        gmem["mask"].at[batch, pl.ds(row, 1), keys],
                        smem["mask"].at[slot, r, :, pl.ds(0, block_k)], barrier,
                    )
            plgpu.copy_gmem_to_smem(
                gmem["bias"].at[batch, head, queries, keys], smem["bias"].at[slot], barrier
            )

        produce(key_tiles, stages, issue_copies, consumed)


def _dbias_kernel(
    gmem, smem, produced, consumed, *, scale: float, tiles: MosaicTiles, consumers: int,
    rows_per_chunk: int, batch_heads: int, heads: int, interpret: bool,
):
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    has_mask = "mask" in gmem
    chunk_batch_head = lax.axis_index("chunk_batch_heads")
    chunk = lax.div(chunk_batch_head, batch_heads)
    batch_head = lax.rem(chunk_batch_head, batch_heads)
    batch, head = lax.div(batch_head, heads), lax.rem(batch_head, heads)
    wg = lax.axis_index("wg")
    cta_queries = lax.axis_index("query_tiles") * block_q * consumers
    keys = pl.ds(lax.axis_index("key_tiles") * block_k, block_k)
    first_row = chunk * rows_per_chunk

    @pl.when(wg < consumers)
    def _consumer():
        consumer_registers(consumers)
        queries = pl.ds(cta_queries + wg * block_q, block_q)
        plgpu.copy_gmem_to_smem(
            gmem["bias"].at[batch, head, queries, keys], smem["bias"].at[wg],
            produced["bias"].at[wg],
        )
        plgpu.barrier_wait(produced["bias"].at[wg])

        def visit_msa_row(step, dbias):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            q_smem, do_smem = (operand_at(smem[n], slot, wg) for n in ("q", "do"))
            k_smem, v_smem = (operand_at(smem[n], slot) for n in ("k", "v"))
            # The bias tile is read from shared memory at every step (held in
            # registers across the loop, a float32 tile would crowd out s and
            # dp) into the logits' accumulator.
            s, dp = smem_products(
                ((q_smem, transposed(k_smem)), (do_smem, transposed(v_smem))),
                inits=(bias_tile(smem["bias"][wg], scale), None), interpret=interpret,
            )
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
        out_smem = smem["dbias"] if "dbias" in smem else smem["bias"]
        out_smem[wg] = dbias
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg], gmem["dbias"].at[chunk, batch, head, queries, keys]
        )
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        producer_registers()

        def issue_copies(step, slot):
            row = first_row + step
            barrier = produced["step"].at[slot]
            for w in range(consumers):
                queries = pl.ds(cta_queries + w * block_q, block_q)
                copy_tiles(gmem, smem, ("q", "do"), (batch, row, queries, head), (slot, w), barrier)
                plgpu.copy_gmem_to_smem(
                    gmem["stats"].at[batch, row, head, :, queries], smem["stats"].at[slot, w],
                    barrier,
                )
            copy_tiles(gmem, smem, ("k", "v"), (batch, row, keys, head), slot, barrier)
            if has_mask:
                plgpu.copy_gmem_to_smem(
                    gmem["mask"].at[batch, pl.ds(row, 1), keys],
                    smem["mask"].at[slot, :, pl.ds(0, block_k)], barrier,
                )

        produce(rows_per_chunk, stages, issue_copies, consumed)


def _split_operands(*operands):
    """(pieces, operands): 1 and the operands as they are for 16-bit inputs;
    for float32 ones `FLOAT32_PIECES` and each operand's bf16 pieces stacked
    on a new leading axis (`common.split_float32`, one XLA pass each)."""
    if operands[0].dtype != jnp.float32:
        return 1, operands
    return FLOAT32_PIECES, tuple(jnp.stack(split_float32(x, FLOAT32_PIECES)) for x in operands)


def _operands(**named):
    """The kernel's inputs by name, the bias and mask rows padded to whole
    TMA rows (`common.pad_residues`); None entries dropped."""
    swizzled = {"bias": True, "bias_t": True, "mask": False}
    return {
        name: pad_residues(x, swizzled[name]) if name in swizzled else x
        for name, x in named.items() if x is not None
    }


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
    check_kernel_inputs(q, bias, float32=True)
    batch, rows, n_res, heads, head_dim = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pieces, (q_in, k, v, do) = _split_operands(q, k, v, do)
    inputs = _operands(
        q=q_in, k=k, v=v, bias_t=jnp.swapaxes(accumulator_bias(bias, scale), -1, -2),
        mask=mask, do=do, stats=stats,
    )
    out_types = {"dk": jax.ShapeDtypeStruct(q.shape, q.dtype),
                 "dv": jax.ShapeDtypeStruct(q.shape, q.dtype)}
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces)  # noqa: E731
    smem = {
        "k": operand_tiles((msa_rows, block_k, head_dim)),
        "v": operand_tiles((msa_rows, block_k, head_dim)),
        "q": operand_tiles((stages, msa_rows, block_q, head_dim)),
        "do": operand_tiles((stages, msa_rows, block_q, head_dim)),
        "stats": smem_vectors((stages, msa_rows, 3, block_q), jnp.float32),
        "bias": smem_tile((stages, block_k, block_q), bias.dtype),
    }
    if pieces > 1:
        smem["dk"] = smem_tile((msa_rows, block_k, head_dim), jnp.float32)
        smem["dv"] = smem_tile((msa_rows, block_k, head_dim), jnp.float32)
    if mask is not None:
        smem["mask"] = smem_vectors((msa_rows, 1, block_k), mask.dtype)
    produced_step, consumed = _step_scratch((2 * pieces + 1) * msa_rows + 1, stages, msa_rows)
    kv_copies = 2 * pieces + (1 if mask is not None else 0)
    produced = {
        "kv": plgpu.Barrier(num_arrivals=kv_copies, num_barriers=msa_rows),
        "step": produced_step,
    }
    body = functools.partial(
        _dkdv_kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads, dtype=q.dtype, ping_pong=ping_pong,
        interpret=interpret,
    )
    return launch(
        body, name="msa_mosaic_dkdv",
        scratch=(smem, produced, consumed, plgpu.Barrier(num_arrivals=msa_rows)),
        inputs=inputs, out_types=out_types,
        grid=(rows // msa_rows, pl.cdiv(n_res, block_k), batch * heads),
        grid_names=("row_groups", "key_tiles", "batch_heads"),
        consumers=msa_rows, interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret", "ping_pong"))
def backward_dq(
    q, k, v, bias, mask, do, stats, *, scale: float, tiles: MosaicTiles, interpret: bool,
    ping_pong: bool = True,
):
    """dq `[B, S, N, H, d]` in q's dtype (arguments as in the module
    docstring; float32 q, k, v and do as in `backward_dbias`)."""
    check_kernel_inputs(q, bias, float32=True)
    batch, rows, n_res, heads, head_dim = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pieces, (q_in, k, v, do) = _split_operands(q, k, v, do)
    inputs = _operands(
        q=q_in, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do,
        stats=stats,
    )
    out_types = {"dq": jax.ShapeDtypeStruct(q.shape, q.dtype)}
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces)  # noqa: E731
    smem = {
        "q": operand_tiles((msa_rows, block_q, head_dim)),
        "do": operand_tiles((msa_rows, block_q, head_dim)),
        "stats": smem_vectors((msa_rows, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, msa_rows, block_k, head_dim)),
        "v": operand_tiles((stages, msa_rows, block_k, head_dim)),
        "bias": smem_tile((stages, block_q, block_k), bias.dtype),
    }
    if pieces > 1:
        smem["dq"] = smem_tile((msa_rows, block_q, head_dim), jnp.float32)
    copies = 2 * msa_rows * pieces + 1
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
        msa_rows=msa_rows, heads=heads, dtype=q.dtype, ping_pong=ping_pong,
        interpret=interpret,
    )
    (dq,) = launch(
        body, name="msa_mosaic_dq",
        scratch=(smem, produced, consumed, plgpu.Barrier(num_arrivals=msa_rows)),
        inputs=inputs, out_types=out_types,
        grid=(rows // msa_rows, pl.cdiv(n_res, block_q), batch * heads),
        grid_names=("row_groups", "query_tiles", "batch_heads"),
        consumers=msa_rows, interpret=interpret,
    )
    return dq


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
    check_kernel_inputs(q, bias, float32=True)
    batch, rows, n_res, heads, head_dim = q.shape
    consumers = tiles.msa_rows
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    query_tiles = pl.cdiv(n_res, block_q * consumers)
    key_tiles = pl.cdiv(n_res, block_k)
    chunks = row_chunks(query_tiles * key_tiles * batch * heads, rows)
    pieces, (q, k, v, do) = _split_operands(q, k, v, do)
    inputs = _operands(
        q=q, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do,
        stats=stats,
    )
    # Rows of a whole TMA stride, sliced back to N below.
    dbias_shape = (chunks, batch, heads, n_res, aligned_residues(n_res, jnp.float32, True))
    out_types = {"dbias": jax.ShapeDtypeStruct(dbias_shape, jnp.float32)}
    operand_tiles = lambda shape: split_tiles(shape, q.dtype, pieces)  # noqa: E731
    smem = {"bias": smem_tile((consumers, block_q, block_k), bias.dtype)}
    if not dbias_in_bias_tile(pieces, bias.dtype):
        smem["dbias"] = smem_tile((consumers, block_q, block_k), jnp.float32)
    smem |= {
        "q": operand_tiles((stages, consumers, block_q, head_dim)),
        "do": operand_tiles((stages, consumers, block_q, head_dim)),
        "stats": smem_vectors((stages, consumers, 3, block_q), jnp.float32),
        "k": operand_tiles((stages, block_k, head_dim)),
        "v": operand_tiles((stages, block_k, head_dim)),
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
        _dbias_kernel, scale=scale, tiles=tiles,
        consumers=consumers, rows_per_chunk=rows // chunks, batch_heads=batch * heads,
        heads=heads, interpret=interpret,
    )
    (partial_sums,) = launch(
        body, name="msa_mosaic_dbias", scratch=(smem, produced, consumed),
        inputs=inputs, out_types=out_types,
        grid=(query_tiles, key_tiles, chunks * batch * heads),
        grid_names=("query_tiles", "key_tiles", "chunk_batch_heads"),
        consumers=consumers, interpret=interpret,
    )
    partial_sums = partial_sums[..., :n_res]
    return partial_sums[0] if chunks == 1 else partial_sums.sum(axis=0)
