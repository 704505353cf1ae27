"""The Mosaic GPU bias-gradient kernel (`backward_dbias`): one CTA per
(query tile, key tile) of one head, looping over the S MSA rows (or a chunk
of them); its consumer warpgroups split the query tile, and the sum over S
stays in registers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.mosaic.backward.operands import (
    kernel_operands, load_stats, recompute, split_operands,
)
from msa_pallas.kernels.mosaic.dropout_words import (
    check_dropout, copy_words_to_ring, kept, load_ring_words, word_length, word_operands,
)
from msa_pallas.kernels.mosaic.heads import own_head_columns, tile_heads, tiles_of_head_pairs
from msa_pallas.kernels.mosaic.logits import accumulator_bias, load_bias_tile
from msa_pallas.kernels.mosaic.matmul import (
    WGMMA, WGMMA_COL, WGMMA_ROW, accumulate_products, smem_products, zeros,
)
from msa_pallas.kernels.mosaic.pipeline import (
    consumer_registers, copy_tiles, launch, produce, producer_registers,
)
from msa_pallas.kernels.mosaic.plan import dbias_plan
from msa_pallas.kernels.mosaic.smem import operand_at, row_view_names, split_row_views, transposed
from msa_pallas.kernels.mosaic.support import (
    RESIDUE_MULTIPLE, aligned_residues, check_kernel_inputs,
)
from msa_pallas.kernels.mosaic.tiles import MosaicTiles


def _chunk_batch_and_head(batch_heads: int, heads: int):
    """The row chunk, batch element and head of this CTA, from its
    `chunk_batch_heads` grid index (chunks slowest)."""
    chunk_batch_head = lax.axis_index("chunk_batch_heads")
    batch_head = lax.rem(chunk_batch_head, batch_heads)
    return (
        lax.div(chunk_batch_head, batch_heads), lax.div(batch_head, heads),
        lax.rem(batch_head, heads),
    )


def _dbias_kernel(
    gmem, smem, produced, consumed, *, scale: float, tiles: MosaicTiles, consumers: int,
    chunks: int, rows: int, batch_heads: int, heads: int, heads_per_tile: int,
    n_res: int, interpret: bool, row_views: tuple[str, ...] = (), dropout=None,
    mask_queries: bool = False,
):
    """`heads`, `heads_per_tile` and `row_views` as in `dkdv._dkdv_kernel`: with
    two heads per tile the CTA sums one head's gradient over the chunk's
    rows, then the other's, each head's bias tile loaded into the same
    shared memory. With a mask, `gmem` may hold the mask's spans
    (`key_tiles.span_operands`): the loop visits the batch element's live
    rows, and none where the CTA's key tile lies outside every row's kept
    keys; the rows left out add exactly 0. `dropout`
    (`dropout_words.Dropout`): gmem holds "query_words" and "key_words"
    (`dropout_words.word_operands`); each step's row and head has its own
    words, which the producer copies into the step's slot. `mask_queries`
    (with the spans): the mask masks queries too (`do` is 0 at a masked
    residue), and a CTA whose query tile holds no residue any row keeps
    visits no row either."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    has_mask = "mask" in gmem
    chunk, batch, head = _chunk_batch_and_head(batch_heads, heads)
    wg = lax.axis_index("wg")
    cta_queries = lax.axis_index("query_tiles") * block_q * consumers
    key_tile = lax.axis_index("key_tiles")
    keys = pl.ds(key_tile * block_k, block_k)
    # The chunk's rows the loop visits, first_row <= row < first_row + visited_rows;
    # the consumers and the producer both read them here, so they agree on
    # the ring's steps (`visited_rows` per head). The S rows as evenly as
    # whole rows allow: a count known when tracing where the chunks divide S.
    if rows % chunks == 0:
        first_row, visited_rows = chunk * (rows // chunks), rows // chunks
    else:
        first_row = lax.div(rows * chunk, chunks)
        visited_rows = lax.div(rows * (chunk + 1), chunks) - first_row
    spans = key_tiles.SpanReader.reads(gmem, n_res=n_res)
    if spans is not None:
        # With a mask, the rows between the first and the last that keep a
        # key (a row that keeps none adds exactly 0), shared out evenly
        # among the chunks: padding rows at the end of the alignment would
        # otherwise leave the chunks that hold them idle while the others do
        # every live row.
        queries = (cta_queries, block_q * consumers) if mask_queries else None
        first, end = spans.rows_of_key_tile(batch, key_tile, block_k, queries)
        live_rows = end - first
        first_row = first + lax.div(live_rows * chunk, chunks)
        visited_rows = first + lax.div(live_rows * (chunk + 1), chunks) - first_row

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
            bias = load_bias_tile(smem["bias"].at[wg], scale, staggered=tiles.staggered_bias)
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
                slot = lax.rem(h * visited_rows + row, stages)
                plgpu.barrier_wait(produced["step"].at[slot])
                s, dp = logit_products(h, slot)
                stats = load_stats(smem["stats"].at[slot, wg], WGMMA_ROW)
                keep = None
                if has_mask:
                    keep = plgpu.load(
                        smem["mask"].at[slot, 0, pl.ds(0, block_k)], layout=WGMMA_COL
                    ) != 0
                dropout_keep = None
                if dropout is not None:
                    # Read after the products: the words' registers are not
                    # held across them.
                    dropout_keep = kept(
                        load_ring_words(smem["query_words"].at[slot, wg], 0, block_q, WGMMA_ROW),
                        load_ring_words(smem["key_words"].at[slot, 0], 0, block_k, WGMMA_COL),
                        s.shape, 0, dropout,
                    )
                plgpu.barrier_arrive(consumed["step"].at[slot])
                _, ds = recompute(
                    s, dp, keep, stats, scale=scale, query_axis=0, with_p=False,
                    dropout_keep=dropout_keep, mask_without_select=tiles.mask_without_select,
                )
                return dbias + ds

            dbias = lax.fori_loop(0, visited_rows, visit_msa_row, zeros((block_q, block_k)))
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
        # The CTA may end once its stores have read shared memory: their
        # writes land before the kernel completes, and the next CTA on the
        # SM need not wait for them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == consumers)
    def _producer():
        producer_registers()

        def issue_copies(step, slot):
            # Step h * visited_rows + r: the r-th visited row for head h.
            h, row = 0, first_row + step
            if pair > 1:
                h, row = lax.div(step, visited_rows), first_row + lax.rem(step, visited_rows)
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
            if dropout is not None:
                words_head = pl.ds(head * pair + h, 1)
                for w in range(consumers):
                    copy_words_to_ring(
                        gmem["query_words"], smem["query_words"].at[slot, w], batch, row,
                        words_head, pl.ds(cta_queries + w * block_q, block_q), barrier,
                    )
                copy_words_to_ring(
                    gmem["key_words"], smem["key_words"].at[slot, 0], batch, row, words_head, keys,
                    barrier,
                )

        produce(0, pair * visited_rows, stages, issue_copies, consumed["step"])


@functools.partial(
    jax.jit,
    static_argnames=("scale", "tiles", "interpret", "skip_masked", "dropout_rate", "mask_queries"),
)
def backward_dbias(
    q, k, v, bias, mask, do, stats, dropout_seeds=None, *, scale: float, tiles: MosaicTiles,
    interpret: bool, skip_masked: bool = False, dropout_rate: float = 0.0,
    mask_queries: bool = False,
):
    """dbias `[B, H, N, N]` float32, summed over the S MSA rows (arguments as
    in `kernels.mosaic.backward`'s docstring; q, k, v and do may also be float32).

    With a mask, each CTA's loop over rows runs from the first to the last
    row that keeps a key, and not at all where no row keeps a key of its
    key tile (from the mask's spans, `key_tiles.span_operands`): the rows
    left out (padding rows at the ends of the alignment) would add exactly
    0. `skip_masked` False (the default; the op skips inside
    `skipping_padding`) visits every row.

    When (tiles x heads x batch) gives too few CTAs to fill the GPU, the rows
    are split into chunks (`block_sizes.row_chunks_in_waves`), one CTA each,
    and the chunks' float32 partial sums are added in a fixed order. When
    skipping, the chunks share the rows between the bounds, not all S: the
    sum is the same up to float32 rounding (its terms grouped otherwise).

    float32 q, k, v and do enter as `FLOAT32_PIECES` bfloat16 pieces each
    (`matmul.split_float32`, a pass over them in XLA), and each product is
    the sum of the pieces' products (`matmul.piece_pairs`): float32
    accuracy from the 16-bit `wgmma`.

    `dropout_seeds`, `dropout_rate`: attention dropout, as in
    `backward_dkdv`; skipping, dead rows are left out with dropout too
    (their part is 0 whatever is dropped).

    `mask_queries`: skipping, the mask masks queries too (the op's
    `mask_queries`: `do` is 0 at a masked residue): a CTA whose query tile
    holds no residue that a row of its batch element keeps visits no row,
    and its gradient tile is 0.
    """
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    batch, rows, n_res, heads, _ = q.shape
    consumers = tiles.msa_rows
    pair = tile_heads(q.shape, q.dtype)
    dropout = check_dropout(dropout_seeds, dropout_rate, q.shape)
    kernel_plan = dbias_plan(
        q.shape, q.dtype, bias.dtype, tiles,
        mask_dtype=None if mask is None else mask.dtype, interpret=interpret,
        dropout=dropout is not None,
    )
    chunks = kernel_plan.grid[-1] // (batch * heads // pair)
    _, (q, k, v, do) = split_operands(*tiles_of_head_pairs(pair, q, k, v, do))
    inputs = kernel_operands(
        q=q, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do, stats=stats
    )
    if dropout is not None:
        # The CTA's query tile is its consumers' tiles side by side.
        length = word_length(n_res, tiles.block_q * consumers, tiles.block_k)
        inputs |= word_operands(dropout_seeds, length)
    skips = mask is not None and skip_masked
    if mask_queries and not skips:
        raise ValueError("mask_queries: only where padding is skipped (a mask, skip_masked)")
    if skips:
        inputs |= key_tiles.span_operands(mask, n_res)
    # Rows of whole 8-row tiles and columns of a whole TMA stride, sliced
    # back to N below.
    dbias_shape = (
        chunks, batch, heads, pl.cdiv(n_res, RESIDUE_MULTIPLE) * RESIDUE_MULTIPLE,
        aligned_residues(n_res, jnp.float32, True),
    )
    out_types = {"dbias": jax.ShapeDtypeStruct(dbias_shape, jnp.float32)}
    body = functools.partial(
        _dbias_kernel, scale=scale, tiles=tiles, consumers=consumers,
        chunks=chunks, rows=rows, batch_heads=batch * heads // pair,
        heads=heads // pair, heads_per_tile=pair, n_res=n_res, interpret=interpret,
        row_views=row_view_names(kernel_plan.smem), dropout=dropout, mask_queries=mask_queries,
    )
    (partial_sums,) = launch(
        body, kernel_plan, inputs=inputs, out_types=out_types, interpret=interpret
    )
    partial_sums = partial_sums[..., :n_res, :n_res]
    return partial_sums[0] if chunks == 1 else partial_sums.sum(axis=0)
