"""The Mosaic GPU dq kernel (`backward_dq`): one CTA per query tile of one
head for `msa_rows` rows, looping over key tiles, the forward's loop with
`dp = do v^T`, `ds = p (dp - delta)` and `dq += ds k` in place of the
online softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.key_tiles import SpanReader
from msa_pallas.kernels.mosaic.backward.operands import (
    gradient_rows, kernel_operands, load_stats, recompute, split_operands,
)
from msa_pallas.kernels.mosaic.dropout_words import (
    HeadDropout, check_dropout, copy_words_to_ring, kept, load_ring_words, word_length,
    word_operands,
)
from msa_pallas.kernels.mosaic.heads import (
    combine_head_columns, held_tiles_per_head, tile_heads, tiles_of_head_pairs,
)
from msa_pallas.kernels.mosaic.logits import accumulator_bias, keys_before, load_bias_tile
from msa_pallas.kernels.mosaic.matmul import (
    WGMMA_COL, WGMMA_ROW, accumulate_products, matrix_operand, smem_products, zeros,
)
from msa_pallas.kernels.mosaic.pipeline import (
    PingPong, copy_tiles, launch, produce, ring_slot, run_when,
)
from msa_pallas.kernels.mosaic.plan import dq_plan
from msa_pallas.kernels.mosaic.smem import (
    copy_row_tile_to_gmem, operand_at, row_tile_at, row_view_names, split_row_views, store_row_tile,
    transposed,
)
from msa_pallas.kernels.mosaic.support import check_kernel_inputs
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic.work_items import serve_items


def _copy_key_tiles(gmem, smem_tma, smem, rows, batch, keys, head, pair, slot, barrier):
    """The producer's copies of one key step of the dq kernel's loop: each of
    `rows`' K and V tiles (and key-mask vector, where there is a mask, and
    the keys' dropout words of the tile's `pair` heads, with dropout) into
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
        if "key_words" in smem:
            copy_words_to_ring(
                gmem["key_words"], smem["key_words"].at[slot, consumer], batch, row,
                pl.ds(head * pair, pair), keys, barrier,
            )


def _query_major_ds(
    q_smem, do_smem, k_smem, v_smem, bias, mask_ref, stats, key_tile, turns, *, scale: float,
    n_res: int, block_k: int, interpret: bool, dropout_keep=None,
    mask_without_select: bool = False,
):
    """One `[block_q, block_k]` float32 `ds` tile of the dq kernel's loop
    (`_dq_kernel`): `s = q k^T + bias` and `dp = do v^T`
    from shared memory, then `ds` from the row statistics. `bias` is the
    step's bias tile (`logits.load_bias_tile`); `mask_ref` the consumer's
    `[1, >= block_k]` int8 key-mask slot, or None; `dropout_keep` None, or a
    function giving the tile's dropout keep mask (`operands.recompute`, as
    `mask_without_select`), called after the products: the mask does not take
    registers across them."""
    s, dp = smem_products(
        ((q_smem, transposed(k_smem)), (do_smem, transposed(v_smem))),
        turns.hand_over, inits=(bias, None), interpret=interpret,
    )
    keep = None
    if mask_ref is not None:
        keep = plgpu.load(mask_ref.at[0, pl.ds(0, block_k)], layout=WGMMA_COL) != 0
    _, ds = recompute(
        s, dp, keep, stats, scale=scale, query_axis=0, with_p=False,
        dropout_keep=None if dropout_keep is None else dropout_keep(),
        mask_without_select=mask_without_select,
    )
    if keep is None and n_res % block_k:
        # Keys past N read zeros, whose probability is not 0: their ds must
        # not reach dq (with a mask, the zeros read there mask them; the bias
        # gradient's columns past N are dropped by its store).
        ds = jnp.where(keys_before(n_res, key_tile, block_k, ds.shape), ds, 0.0)
    return ds


def _dq_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, heads_per_tile: int, dtype, ping_pong: bool, interpret: bool,
    row_views: tuple[str, ...] = (), tile_bounds=None, dropout=None, work_items=None,
    mask_queries: bool = False,
):
    """`heads`, `heads_per_tile`, `row_views` and `dropout` as in
    `dkdv._dkdv_kernel` (here the queries' words are the consumer's for
    good, and the producer copies each step's key words into its slot);
    `tile_bounds` as in `backward_dq`. With `tiles.persistent`,
    `work_items` = (B * H', query tiles, row groups), which the CTAs share
    out (`work_items.BackwardItems`): skipping padding, the row groups
    after the last that keeps a key (`key_tiles.SpanReader`) take no loop,
    only their dq = 0. `mask_queries` (with the spans): an item whose query
    tile holds no residue its rows keep takes no loop either (its queries'
    `do` is 0)."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    key_tile_count = pl.cdiv(n_res, block_k)
    has_mask = "mask" in gmem
    wg = lax.axis_index("wg")
    # dq's rows hold every head: `[B, S, N, heads * tile width]`.
    tile_dim = gmem["dq"].shape[-1] // heads
    # 16-bit: q's tile is free after the loop and holds dq on its way out.
    out_name = "dq" if "dq" in smem else "q"

    # With a mask to skip by (`key_tiles.span_operands`); dead rows are
    # skipped with dropout too (their dq is 0 whatever is dropped).
    spans = SpanReader.reads(gmem, n_res=n_res, rows_per_group=msa_rows)

    def key_tiles_of(batch, head, row_group, query_tile):
        """The key tiles the item's loop visits, lb <= key tile < ub; the
        consumers and the producer both read them here, so they agree on the
        ring's steps. With a mask: the tiles that hold every key the group's
        rows keep (none for a group of dead rows, whose dq is 0)."""
        if tile_bounds is not None:
            return tile_bounds((batch, head, row_group, query_tile * block_q), key_tile_count)
        if spans is not None:
            lb, ub = spans.key_tiles(batch, row_group, block_k)
            if mask_queries:
                ub = jnp.where(spans.holds_queries(batch, row_group, query_tile, block_q), ub, lb)
            return lb, ub
        return 0, key_tile_count

    def load_queries(batch, head, row_group, query_tile):
        """Starts the copies of the item's q and do tiles and statistics,
        which the consumer holds across its loop."""
        queries = pl.ds(query_tile * block_q, block_q)
        row = row_group * msa_rows + wg
        copy_tiles(
            gmem, smem_tma, ("q", "do"), (batch, row, queries, head), wg, produced["q"].at[wg]
        )
        plgpu.copy_gmem_to_smem(
            gmem["stats"].at[batch, row, pl.ds(head * pair, pair), :, queries],
            smem["stats"].at[wg], produced["q"].at[wg],
        )

    def consume_item(batch, head, row_group, query_tile, lb, ub):
        queries = pl.ds(query_tile * block_q, block_q)
        row = row_group * msa_rows + wg
        # An item whose loop runs no step (a group of dead rows) loads
        # nothing: its dq is 0.
        visits = True if isinstance(lb, int) else lb < ub
        q_smem, do_smem = operand_at(smem["q"], wg), operand_at(smem["do"], wg)

        def await_queries():
            load_queries(batch, head, row_group, query_tile)
            plgpu.barrier_wait(produced["q"].at[wg])

        run_when(visits, await_queries)
        stats = [load_stats(smem["stats"].at[wg, h], WGMMA_ROW) for h in range(pair)]
        queries_of_head, douts_of_head = held_tiles_per_head(
            smem, {"q": q_smem, "do": do_smem}, wg, pair, when=visits
        )
        if dropout is not None:
            # The item's queries' words, for good.
            row_dropout = HeadDropout(dropout, gmem, batch, row, head * pair, pair)
            query_words = row_dropout.query_words(queries.start, block_q)
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_key_tile(key_tile, dqs):
            dqs = list(dqs)
            slot = ring_slot(key_tile, lb, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            k_smem, v_smem = operand_at(smem["k"], slot, wg), operand_at(smem["v"], slot, wg)
            for h in range(pair):
                dropout_keep = None
                if dropout is not None:
                    def dropout_keep(h=h, slot=slot):
                        key_words = load_ring_words(
                            smem["key_words"].at[slot, wg], h, block_k, WGMMA_COL
                        )
                        return kept(query_words[h], key_words, (block_q, block_k), 0, dropout)
                ds = _query_major_ds(
                    queries_of_head[h], douts_of_head[h], k_smem, v_smem,
                    load_bias_tile(smem["bias"].at[slot, h], scale,
                                   staggered=tiles.staggered_bias),
                    smem["mask"].at[slot, wg] if has_mask else None,
                    stats[h], key_tile, turns, scale=scale, n_res=n_res, block_k=block_k,
                    interpret=interpret, dropout_keep=dropout_keep,
                    mask_without_select=tiles.mask_without_select,
                )
                ds = lax.optimization_barrier(matrix_operand(ds, dtype))
                turns.release()
                turns.take_turn()
                # Against K tiles of both heads: the other head's columns are
                # dropped below.
                (dqs[h],) = accumulate_products((dqs[h],), (ds,), (k_smem,), interpret)
            plgpu.barrier_arrive(consumed["step"].at[slot])
            return tuple(dqs)

        dqs = lax.fori_loop(
            lb, ub, visit_key_tile, (zeros((block_q, tile_dim)),) * pair
        )
        turns.finish()
        dq = combine_head_columns(dqs)
        store_row_tile(row_tile_at(smem[out_name], wg), (dq * scale).astype(dtype))
        plgpu.commit_smem()
        copy_row_tile_to_gmem(
            row_tile_at(smem_tma[out_name], wg),
            gmem["dq"].at[batch, row, queries, pl.ds(head * tile_dim, tile_dim)],
        )
        # The tile is read out before the CTA ends or its next item loads it.
        # The CTA may end once its stores have read shared memory: their
        # writes land before the kernel completes, and the next CTA on the
        # SM need not wait for them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def produce_item(batch, head, row_group, query_tile, lb, ub):
        queries = pl.ds(query_tile * block_q, block_q)
        first_row = row_group * msa_rows

        def issue_copies(key_tile, slot):
            keys = pl.ds(key_tile * block_k, block_k)
            barrier = produced["step"].at[slot]
            _copy_key_tiles(
                gmem, smem_tma, smem, [first_row + r for r in range(msa_rows)],
                batch, keys, head, pair, slot, barrier,
            )
            for h in range(pair):
                plgpu.copy_gmem_to_smem(
                    gmem["bias"].at[batch, head * pair + h, queries, keys],
                    smem["bias"].at[slot, h], barrier,
                )

        produce(lb, ub, stages, issue_copies, consumed["step"])

    def dead_zeros(items):
        """The dead row groups' dq is 0: every head's rows at once, stored
        from a tile of zeros (`work_items.RowZeros`)."""
        return items.dead_row_zeros(smem["dead_zeros"], [gmem["dq"]], msa_rows)

    serve_items(
        consume_item, produce_item, key_tiles_of, consumers=msa_rows, heads=heads,
        persistent=tiles.persistent, tile_axis="query_tiles", work_items=work_items,
        live_groups=(spans.live_row_groups(work_items[2])
                     if spans is not None and tiles.persistent else None),
        dead_zeros=dead_zeros,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "tiles", "interpret", "ping_pong", "tile_bounds", "skip_masked", "dropout_rate",
        "mask_queries",
    ),
)
def backward_dq(
    q, k, v, bias, mask, do, stats, dropout_seeds=None, *, scale: float, tiles: MosaicTiles,
    interpret: bool, ping_pong: bool = True, tile_bounds=None, skip_masked: bool = False,
    dropout_rate: float = 0.0, mask_queries: bool = False,
):
    """dq `[B, S, N, H, d]` in q's dtype (arguments as in
    `kernels.mosaic.backward`'s docstring; float32 q, k, v and do as in
    `backward_dbias`).

    With a mask, each CTA's key loop runs over the key tiles that hold its
    rows' kept keys alone (from the mask's spans, `key_tiles.span_operands`):
    the tiles it leaves out would add exactly 0. A CTA of dead rows runs
    no step and loads none of its q, do and statistics: it writes dq = 0.

    With `tiles.persistent` one CTA per SM loops over its share of the
    work items (`work_items.BackwardItems`); skipping padding, the row
    groups after the last that keeps a key (padding rows at the end of the
    alignment) have no item of their own: each CTA then stores zeros over
    its share of their rows, every head at once (`work_items.
    store_dead_zeros`). Not with dropout.

    Args:
      tile_bounds: None, or, to test the pipeline's runtime bounds,
        `tile_bounds(work, tiles) -> (lb, ub)`: the tiles of the loop,
        lb <= tile < ub (int32), that the CTA of work item `work` =
        (batch, head, MSA-row group, first query) visits, of `tiles`; the
        others are left out of its gradients. In place of the mask's.
      skip_masked: False visits every key tile whatever the mask (the
        default; the op skips inside `skipping_padding`). Dead rows are
        skipped with dropout too: their dq is 0 whatever is dropped.
      dropout_seeds, dropout_rate: attention dropout, as in `backward_dkdv`.
      mask_queries: skipping, the mask masks queries too (the op's
        `mask_queries`: `do` is 0 at a masked residue): an item whose query
        tile holds no residue its rows keep runs no loop, and its dq is 0.
    """
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    rows, n_res, heads = q.shape[1], q.shape[2], q.shape[3]
    msa_rows = tiles.msa_rows_for(rows)
    pair = tile_heads(q.shape, q.dtype)
    dropout = check_dropout(dropout_seeds, dropout_rate, q.shape)
    pieces, (q_in, k, v, do) = split_operands(*tiles_of_head_pairs(pair, q, k, v, do))
    inputs = kernel_operands(
        q=q_in, k=k, v=v, bias=accumulator_bias(bias, scale), mask=mask, do=do, stats=stats
    )
    if dropout is not None:
        inputs |= word_operands(dropout_seeds, word_length(n_res, tiles.block_q, tiles.block_k))
    if tiles.persistent and dropout is not None:
        raise ValueError("the persistent dq kernel (tiles.persistent) takes no dropout")
    skips = mask is not None and skip_masked and tile_bounds is None
    if mask_queries and not skips:
        raise ValueError("mask_queries: only where padding is skipped (a mask, skip_masked)")
    if skips:
        inputs |= key_tiles.span_operands(mask, n_res)
    # Every head of a residue in one row (`dead_groups` stores whole rows).
    out_types = {"dq": gradient_rows(k, pieces, q.dtype)}
    kernel_plan = dq_plan(
        q.shape, q.dtype, bias.dtype, tiles,
        mask_dtype=None if mask is None else mask.dtype, interpret=interpret,
        dropout=dropout is not None,
    )
    body = functools.partial(
        _dq_kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads // pair, heads_per_tile=pair, dtype=q.dtype,
        ping_pong=ping_pong, interpret=interpret, row_views=row_view_names(kernel_plan.smem),
        tile_bounds=tile_bounds, dropout=dropout, work_items=kernel_plan.work_items,
        mask_queries=mask_queries,
    )
    (dq,) = launch(body, kernel_plan, inputs=inputs, out_types=out_types, interpret=interpret)
    return dq.reshape(q.shape)
