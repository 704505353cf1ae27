"""The Mosaic GPU dk/dv kernel (`backward_dkdv`): one CTA per key tile of
one head for `msa_rows` MSA rows, looping over query tiles. Each consumer
warpgroup owns one row's K and V tile and works in the transposed
orientation, keys along the wgmma rows: `s^T = k q^T` and `dp^T = v do^T`
from shared memory, then `dv += p^T do` and `dk += ds^T q` with `p^T` and
`ds^T` straight from registers. Per query tile the producer loads the rows'
q and do tiles and row statistics and ONE tile of the transposed bias,
shared by the rows (`bias^T` is made once per call: B·H·N² elements against
the kernel's B·S·H·N² logits)."""

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
from msa_pallas.kernels.mosaic.logits import accumulator_bias, load_bias_tile
from msa_pallas.kernels.mosaic.matmul import (
    WGMMA_COL, WGMMA_ROW, accumulate_products, matrix_operand, smem_products, zeros,
)
from msa_pallas.kernels.mosaic.pipeline import (
    PingPong, copy_tiles, launch, produce, ring_slot, run_when,
)
from msa_pallas.kernels.mosaic.plan import dkdv_plan
from msa_pallas.kernels.mosaic.smem import (
    copy_row_tile_to_gmem, operand_at, row_tile_at, row_view_names, split_row_views, store_row_tile,
    transposed,
)
from msa_pallas.kernels.mosaic.support import check_kernel_inputs
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic.work_items import serve_items, store_every_tile
from msa_pallas.kernels.triton.dead_rows import dead_row_means


def _dkdv_kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int, tiles: MosaicTiles,
    msa_rows: int, heads: int, heads_per_tile: int, dtype, ping_pong: bool, interpret: bool,
    row_views: tuple[str, ...] = (), tile_bounds=None, dropout=None, work_items=None,
    mask_queries: bool = False,
):
    """`heads`: the heads of q, k and v as the kernel sees them, each
    `heads_per_tile` heads of the bias and statistics (2 for d = 8).
    `row_views`: the names of `smem` that are pairs of views (N % 8 != 0,
    `smem.split_row_views`): copies go through `smem_tma`. `tile_bounds`:
    as in `backward_dkdv`. With a mask, `gmem` may hold the mask's spans
    (`key_tiles.span_operands`: the loop runs where the key tile lies
    within the group's kept keys) and "dead_dv" (`[B, S, heads, tile
    width]` float32: a dead row's dv per key, 0 for the other rows), as
    `backward_dkdv` makes them. `dropout` (`dropout_words.Dropout`): gmem
    holds "query_words" and "key_words" (`dropout_words.word_operands`);
    each consumer reads its keys' words once, and the producer copies each
    step's query words into its slot.
    With `tiles.persistent`, `work_items` = (B * H', key tiles, row groups),
    which the CTAs share out (`work_items.BackwardItems`): skipping
    padding, the row groups after the last that keeps a key take no loop,
    only their dk = 0 and dv = the mean of their `do` ("dead_dv").
    `mask_queries` (with the spans, no "dead_dv"): the mask masks queries
    too, so `do` is 0 at a masked residue: an item's loop ends with the
    query tile of its rows' last kept residue, and a dead row's dv is 0."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    query_tiles = pl.cdiv(n_res, block_q)
    # The gradients' rows hold every head: `[B, S, N, heads * tile width]`.
    tile_dim = gmem["dk"].shape[-1] // heads
    has_mask = "mask" in gmem
    wg = lax.axis_index("wg")
    # 16-bit: K's and V's tiles are free after the loop and hold the
    # gradients on their way out.
    dk_name, dv_name = ("dk", "dv") if "dk" in smem else ("k", "v")

    def out_tile(name, batch, row, keys, head):
        """Head `head`'s `[keys, tile width]` window of gradient `name`."""
        return gmem[name].at[batch, row, keys, pl.ds(head * tile_dim, tile_dim)]

    def copy_dead_dv(batch, head, row):
        """Starts the copy of row `row`'s dead-row dv (the mean of its `do`,
        `dead_dv`) into the consumer's vector."""
        plgpu.copy_gmem_to_smem(
            gmem["dead_dv"].at[batch, pl.ds(row, 1), head],
            smem["dead_dv"].at[wg, :, pl.ds(0, tile_dim)], produced["dead_dv"].at[wg],
        )

    def copied_dead_dv():
        """The dead-row dv `copy_dead_dv` started, once landed: `[tile_dim]`
        float32 in the accumulators' column layout."""
        plgpu.barrier_wait(produced["dead_dv"].at[wg])
        return plgpu.load(smem["dead_dv"].at[wg, 0, pl.ds(0, tile_dim)], layout=WGMMA_COL)

    # With dropout a dead row's dv has no shortcut: its loops run.
    spans = SpanReader.reads(
        gmem, n_res=n_res, rows_per_group=msa_rows, dead_rows_whole=dropout is not None
    )

    def query_tiles_of(batch, head, row_group, key_tile):
        """The query tiles the item's loop visits, lb <= query tile < ub; the
        consumers and the producer both read them here, so they agree on
        the ring's steps. With a mask: every query tile where a row of the
        group keeps a key of the tile, else none."""
        if tile_bounds is not None:
            return tile_bounds((batch, head, row_group, key_tile * block_k), query_tiles)
        if spans is not None:
            first, end = spans.key_tiles(batch, row_group, block_k)
            visited = (first <= key_tile) & (key_tile < end)
            if mask_queries:
                # The queries' span is the keys' (the same residues), in query
                # tiles; the loop from tile 0 all the same (padding is at the
                # end, and a bound known when tracing keeps the ring's slots
                # cheap to compute).
                _, end_query = spans.key_tiles(batch, row_group, block_q)
                return jnp.int32(0), jnp.where(visited, end_query, 0)
            # An int32 lower bound, not a Python 0: the producer's first
            # steps' query tiles then stay unknown at trace time, where a
            # tile past N would fail the slice's bounds check.
            return jnp.int32(0), visited.astype(jnp.int32) * query_tiles
        return 0, query_tiles

    def load_keys(batch, head, row_group, key_tile):
        """Starts the copies of the item's K and V tiles and mask vector,
        which the consumer holds across its loop."""
        keys = pl.ds(key_tile * block_k, block_k)
        row = row_group * msa_rows + wg
        copy_tiles(
            gmem, smem_tma, ("k", "v"), (batch, row, keys, head), wg, produced["kv"].at[wg]
        )
        if has_mask:
            plgpu.copy_gmem_to_smem(
                gmem["mask"].at[batch, pl.ds(row, 1), keys],
                smem["mask"].at[wg, :, pl.ds(0, block_k)], produced["kv"].at[wg],
            )

    def consume_item(batch, head, row_group, key_tile, lb, ub):
        keys = pl.ds(key_tile * block_k, block_k)
        visits = True if isinstance(lb, int) else lb < ub
        row = row_group * msa_rows + wg
        k_smem, v_smem = operand_at(smem["k"], wg), operand_at(smem["v"], wg)

        if "dead_dv" in gmem:
            copy_dead_dv(batch, head, row)

        def await_keys():
            load_keys(batch, head, row_group, key_tile)
            plgpu.barrier_wait(produced["kv"].at[wg])

        # A CTA whose loop runs no step loads no K, V or mask: its dk is 0,
        # its dv 0 or a dead row's (`dead_dv`).
        run_when(visits, await_keys)
        keep = None
        if has_mask:
            keep = plgpu.load(smem["mask"].at[wg, 0, pl.ds(0, block_k)], layout=WGMMA_ROW) != 0
        # A product of a head's K or V with q or do tiles of both heads
        # sums over that head's columns alone.
        keys_of_head, values_of_head = held_tiles_per_head(
            smem, {"k": k_smem, "v": v_smem}, wg, pair, when=visits
        )
        if dropout is not None:
            # Keys along the tiles' rows; their words are the CTA's for good.
            row_dropout = HeadDropout(dropout, gmem, batch, row, head * pair, pair, query_axis=1)
            key_words = row_dropout.key_words(keys.start, block_k)
        turns = PingPong(schedule, wg, enabled=ping_pong and msa_rows == 2)
        turns.start()

        def visit_query_tile(query_tile, carry):
            dks, dvs = (list(c) for c in carry)
            slot = ring_slot(query_tile, lb, stages)
            plgpu.barrier_wait(produced["step"].at[slot])
            q_smem, do_smem = operand_at(smem["q"], slot, wg), operand_at(smem["do"], slot, wg)
            # One head after the other, each a full turn: the registers hold
            # one head's logits at a time.
            for h in range(pair):
                s_t, dp_t = smem_products(
                    ((keys_of_head[h], transposed(q_smem)),
                     (values_of_head[h], transposed(do_smem))),
                    turns.hand_over,
                    inits=(load_bias_tile(smem["bias"].at[slot, h], scale,
                                          staggered=tiles.staggered_bias), None),
                    interpret=interpret,
                )
                stats = load_stats(smem["stats"].at[slot, wg, h], WGMMA_COL)
                dropout_keep = None
                if dropout is not None:
                    # The step's query words from its slot, read after the products.
                    query_words = load_ring_words(
                        smem["query_words"].at[slot, wg], h, block_q, WGMMA_COL
                    )
                    dropout_keep = kept(query_words, key_words[h], s_t.shape, 1, dropout)
                # With dropout p_t is p keep, the weights dv takes.
                p_t, ds_t = recompute(
                    s_t, dp_t, keep, stats, scale=scale, query_axis=1, with_p=True,
                    dropout_keep=dropout_keep, mask_without_select=tiles.mask_without_select,
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
            plgpu.barrier_arrive(consumed["step"].at[slot])
            return tuple(dks), tuple(dvs)

        start = (zeros((block_k, tile_dim)),) * pair
        dks, dvs = lax.fori_loop(lb, ub, visit_query_tile, (start, start))
        turns.finish()
        dk, dv = combine_head_columns(dks), combine_head_columns(dvs)
        if "dead_dv" in gmem:
            # A skipped tile (no loop: dk = dv = 0 so far) of a dead row: the
            # uniform weights give each key the mean of the row's `do`
            # (`dead_dv` is 0 for the other rows). Where the loop ran, this
            # adds 0 to what it computed.
            skipped = (ub == lb).astype(jnp.float32)
            dv = dv + lax.broadcast_in_dim(copied_dead_dv() * skipped, dv.shape, [1])
        store_row_tile(row_tile_at(smem[dk_name], wg), (dk * scale).astype(dtype))
        store_row_tile(row_tile_at(smem[dv_name], wg), dv.astype(dtype))
        plgpu.commit_smem()
        for name, tile in (("dk", dk_name), ("dv", dv_name)):
            copy_row_tile_to_gmem(
                row_tile_at(smem_tma[tile], wg), out_tile(name, batch, row, keys, head)
            )
        # The tiles are read out before the CTA ends or its next item loads
        # them. The CTA may end once its stores have read shared memory: their
        # writes land before the kernel completes, and the next CTA on the
        # SM need not wait for them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def produce_item(batch, head, row_group, key_tile, lb, ub):
        keys = pl.ds(key_tile * block_k, block_k)
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
                if dropout is not None:
                    copy_words_to_ring(
                        gmem["query_words"], smem["query_words"].at[slot, r], batch, row,
                        pl.ds(head * pair, pair), queries, barrier,
                    )
            for h in range(pair):
                plgpu.copy_gmem_to_smem(
                    gmem["bias_t"].at[batch, head * pair + h, keys, queries],
                    smem["bias"].at[slot, h], barrier,
                )

        produce(lb, ub, stages, issue_copies, consumed["step"])

    def dead_zeros(items):
        """A dead row group's dk is 0, and where the mask masks queries too
        its dv as well: every head's rows at once, stored from a tile of
        zeros (`work_items.RowZeros`: contiguous boxes, where one head's
        tiles would be narrow strided ones)."""
        zero_names = ("dk",) if "dead_dv" in gmem else ("dk", "dv")
        return items.dead_row_zeros(smem["dead_zeros"], [gmem[name] for name in zero_names],
                                    msa_rows)

    def dead_groups(items):
        """Where the mask does not mask queries, a dead row's dv at each key
        is its row's mean of `do`: per head one load of that mean, then the
        same tile stored for every key tile (the last item's stores have
        read the tile)."""

        @items.for_each_dead_group
        def _(batch, head, row_group):
            row = row_group * msa_rows + wg
            copy_dead_dv(batch, head, row)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last group's dv tile
            # In the accumulators' layout, as the loop's dv.
            dv = zeros((block_k, tile_dim)) + lax.broadcast_in_dim(
                copied_dead_dv(), (block_k, tile_dim), [1]
            )
            store_row_tile(row_tile_at(smem[dv_name], wg), dv.astype(dtype))
            plgpu.commit_smem()

            def store(key_tile):
                keys = pl.ds(key_tile * block_k, block_k)
                copy_row_tile_to_gmem(
                    row_tile_at(smem_tma[dv_name], wg), out_tile("dv", batch, row, keys, head)
                )

            store_every_tile(pl.cdiv(n_res, block_k), store)

    # Dead row groups only where a persistent kernel skips padding (without
    # dropout, so with "dead_dv" or with the queries masked), as in dq.
    serve_items(
        consume_item, produce_item, query_tiles_of, consumers=msa_rows, heads=heads,
        persistent=tiles.persistent, tile_axis="key_tiles", work_items=work_items,
        live_groups=(spans.live_row_groups(work_items[2])
                     if spans is not None and tiles.persistent else None),
        dead_zeros=dead_zeros, dead_groups=dead_groups if "dead_dv" in gmem else None,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "tiles", "interpret", "ping_pong", "tile_bounds", "skip_masked", "dropout_rate",
        "mask_queries",
    ),
)
def backward_dkdv(
    q, k, v, bias, mask, do, stats, dropout_seeds=None, *, scale: float, tiles: MosaicTiles,
    interpret: bool, ping_pong: bool = True, tile_bounds=None, skip_masked: bool = False,
    dropout_rate: float = 0.0, dead_dv=None, mask_queries: bool = False,
):
    """dk, dv `[B, S, N, H, d]` in q's dtype (arguments as in
    `kernels.mosaic.backward`'s docstring; float32 q, k, v and do as in
    `backward_dbias`).

    With a mask, a CTA whose key tile lies outside its rows' kept keys
    (from the mask's spans, `key_tiles.span_operands`) runs no query loop
    and loads no K, V or mask: it writes dk = 0, and dv = 0 but for a dead
    row, whose uniform weights give every key the mean of its `do` over the
    N queries (`triton.dead_rows.dead_row_means`, which reads dead rows
    alone). Rows that keep a key there, and dead rows beside them, are
    computed as without the mask's help.

    With `tiles.persistent` one CTA per SM loops over its share of the
    work items (`work_items.BackwardItems`); skipping padding, the row
    groups after the last that keeps a key (padding rows at the end of the
    alignment) have no item of their own: each CTA then stores dk = 0 over
    its share of their rows, every head at once (`work_items.
    store_dead_zeros`), and dv: 0 the same way where the mask masks
    queries too, else each row's mean of `do`, loaded once per row and
    head and stored to every key tile. Not with dropout.

    With dropout a dead row's uniform weights are dropped too: skipping,
    its query loops run as if it kept every key
    (`key_tiles.SpanReader`'s `dead_rows_whole`), and only live rows'
    masked key tiles are skipped.

    Args:
      tile_bounds: None, or, to test the pipeline's runtime bounds,
        `tile_bounds(work, tiles) -> (lb, ub)`: the tiles of the loop,
        lb <= tile < ub (int32), that the CTA of work item `work` =
        (batch, head, MSA-row group, first key) visits, of `tiles`; the
        others are left out of its gradients. In place of the mask's.
      skip_masked: False runs every query loop whatever the mask (the
        default; the op skips inside `skipping_padding`).
      dropout_seeds, dropout_rate: attention dropout (`dropout_words`;
        rate 0: none), `do` and the statistics' delta scaled as
        `operands.recompute` says: `dv = (p keep)^T do`, `ds = p (keep dp -
        delta)`.
      dead_dv: skipping without dropout, `[B, S, H, d]` (or `[B, S, H·d]`)
        float32, each dead row's mean of `do` over the residues and 0 for
        the other rows, where the caller has it (`triton.backward_prologue`);
        None: computed here (`triton.dead_rows.dead_row_means`).
      mask_queries: skipping without dropout, the mask masks queries too
        (the op's `mask_queries`: `do` is 0 at a masked residue, a dead
        row's everywhere): each loop ends with the query tile of its rows'
        last kept residue, and a dead row's dv is 0 (no `dead_dv`).
    """
    check_kernel_inputs(q, bias, float32=True, paired_heads=q.dtype != jnp.float32)
    batch, rows, n_res, heads = q.shape[:4]
    msa_rows = tiles.msa_rows_for(rows)
    pair = tile_heads(q.shape, q.dtype)
    skips = mask is not None and skip_masked and tile_bounds is None
    dropout = check_dropout(dropout_seeds, dropout_rate, q.shape)
    if tiles.persistent and dropout is not None:
        raise ValueError("the persistent dk/dv kernel (tiles.persistent) takes no dropout")
    # With dropout a dead row's dv has no shortcut (its uniform weights are
    # dropped too): its query loops run, as a row keeping every key's would.
    skips_dead_rows = skips and dropout is None
    if mask_queries and (not skips_dead_rows or dead_dv is not None):
        raise ValueError("mask_queries: only where dead rows are skipped (a mask, skip_masked, "
                         "no dropout), without dead_dv (a dead row's dv is 0)")
    if not skips_dead_rows or mask_queries:
        dead_dv = None
    elif dead_dv is None:
        # `do` as the kernels multiply it, in q's dtype, read in dead rows alone.
        dead_dv = dead_row_means(do, mask, n_res=n_res, interpret=interpret)
    if dead_dv is not None:
        # Heads 2h and 2h + 1 side by side, as their tile holds them.
        dead_dv = dead_dv.reshape(batch, rows, heads // pair, -1)
    pieces, (q_in, k, v, do) = split_operands(*tiles_of_head_pairs(pair, q, k, v, do))
    inputs = kernel_operands(
        q=q_in, k=k, v=v, bias_t=jnp.swapaxes(accumulator_bias(bias, scale), -1, -2),
        mask=mask, do=do, stats=stats,
    )
    if dropout is not None:
        inputs |= word_operands(dropout_seeds, word_length(n_res, tiles.block_q, tiles.block_k))
    if skips:
        inputs |= key_tiles.span_operands(mask, n_res)
        if dead_dv is not None:
            inputs["dead_dv"] = dead_dv
    # Every head of a residue in one row (`dead_groups` stores whole rows).
    out_types = {name: gradient_rows(k, pieces, q.dtype) for name in ("dk", "dv")}
    kernel_plan = dkdv_plan(
        q.shape, q.dtype, bias.dtype, tiles,
        mask_dtype=None if mask is None else mask.dtype, interpret=interpret,
        dead_rows=dead_dv is not None, dropout=dropout is not None,
    )
    body = functools.partial(
        _dkdv_kernel, scale=scale, n_res=n_res, tiles=tiles,
        msa_rows=msa_rows, heads=heads // pair, heads_per_tile=pair, dtype=q.dtype,
        ping_pong=ping_pong, interpret=interpret, row_views=row_view_names(kernel_plan.smem),
        tile_bounds=tile_bounds, dropout=dropout, work_items=kernel_plan.work_items,
        mask_queries=mask_queries,
    )
    dk, dv = launch(body, kernel_plan, inputs=inputs, out_types=out_types, interpret=interpret)
    return dk.reshape(q.shape), dv.reshape(q.shape)
