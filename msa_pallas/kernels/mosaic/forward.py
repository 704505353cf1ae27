"""The Mosaic GPU forward kernel: Hopper (sm90), 16-bit inputs.

One CTA serves one query tile of one head for `msa_rows` MSA rows of one
batch element. The MSA rows share the pair bias, and that is what the CTA is
built around:

- a producer warpgroup streams, per key tile, the K and V tiles of every row
  and ONE bias tile (and the rows' key-mask vectors) by TMA into a
  `num_stages`-deep shared-memory ring; one of its warps refills the K
  slots (with the bias and mask), another the V slots, each as soon as the
  consumers release it;
- each of the `msa_rows` consumer warpgroups owns one MSA row: it computes
  `q k^T` with `wgmma` from shared memory, adds the shared bias tile, runs the
  online softmax in float32 (base 2), and multiplies the 16-bit
  probabilities, straight from registers, with V by `wgmma`;
- with two consumers, a schedule barrier makes them alternate, so one's
  softmax (the exponential unit) overlaps the other's matrix products.

The work items are (B * H, query tiles, S / msa_rows), the MSA rows fastest,
so the CTAs that run at the same time read the same bias tiles and find them
in L2. With `MosaicTiles.persistent` one CTA per SM loops over its share of
them: the ring's steps and barriers run on across items, so the producer
streams the next item's first tiles while the consumers finish the last ones,
and each consumer loads its next q tile after the item's last `q k^T` and its
next gate tile after the gating. Otherwise the grid has one CTA per item.

N need not be a whole number of tiles (TMA reads past N as zeros, keys past N
get a -inf logit, stores past N are dropped), nor a multiple of 8 where
`support.takes_any_n`: row tiles are then pairs of views
(`smem.unaligned_row_tile`, `smem.row_tile`). Only the bias and mask rows
are padded (`support.pad_residues`, `support.pad_bias_rows`); the row
statistics go to planes padded to whole query tiles and sliced (Mosaic GPU
clips a contiguous window's bulk copy only at the array's end). Results and
residuals are the Triton forward's: either backward follows.

Each item's key loop runs between bounds known at run time (`key_tiles_of`),
the ring's slots and barrier phases following a running count of the CTA's
steps; with `skip_masked` and a mask, only the tiles holding its rows' kept
keys (`kernels.key_tiles`), and only the row groups up to the last that
keeps a key have items (`work_items`). The kernel's results for dead rows
(no kept key) are left to the wrapper (`_with_dead_rows`): their output is
written in place by a small kernel that reads and writes those rows alone
(`triton.dead_rows.fill_dead_rows`), their residuals are selects on its
means of v. A dead row's CTA here would spend a work item's latency on a
mean it need not compute. Where the mask masks queries too (`mask_queries`:
out is 0 at a masked residue), an item whose query tile holds no kept
residue visits no key tile either, and nothing is filled but zeros, at every
masked residue; the query tiles after the last that holds a kept residue
have no items at all. A persistent grid writes those zeros itself: its
items zero their masked queries, and a spare warp of the producer the rows
and query tiles without items (`zeroes_masked_queries`); with one CTA per
item a small kernel does after it (`triton.dead_rows.zero_masked_queries`).
With `dropout_rate` > 0 the weights `dropout` drops (their words read from
XLA's arrays, `dropout_words`) are zeroed after the row statistics, and the
output scaled by 1 / (1 - rate). Skipping with dropout, a dead row's
dropped uniform weights have no shortcut: its items visit every key tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.constants import LOG2E, MASKED_LOGIT_LOG2
from msa_pallas.kernels.key_tiles import SpanReader, dead_rows
from msa_pallas.kernels.mosaic.dropout_words import HeadDropout, check_dropout, kept_sum_scale
from msa_pallas.kernels.mosaic.forward_operands import forward_operands
from msa_pallas.kernels.mosaic.heads import (
    combine_head_columns, heads_per_tile, store_own_head_tiles,
)
from msa_pallas.kernels.mosaic.logits import (
    keys_before, load_bias_tile, masked_accumulator_logit, online_softmax, sigmoid,
)
from msa_pallas.kernels.mosaic.matmul import (
    WGMMA, WGMMA_COL, WGMMA_ROW, accumulate_products, smem_products,
)
from msa_pallas.kernels.mosaic.pipeline import (
    PingPong, consumer_registers, launch, producer_registers,
)
from msa_pallas.kernels.mosaic.plan import forward_plan, zeroes_masked_queries
from msa_pallas.kernels.mosaic.smem import (
    copy_row_tile_to_gmem, row_tile_at, row_view_names, split_row_views, store_row_tile,
)
from msa_pallas.kernels.mosaic.support import check_kernel_inputs
from msa_pallas.kernels.mosaic.tiles import MosaicTiles, forward_tiles
from msa_pallas.kernels.mosaic.work_items import ForwardItems, RowZeros
from msa_pallas.kernels.triton.dead_rows import fill_dead_rows, zero_masked_queries


# The tiles `attention_forward` takes by default (`tiles.forward_tiles`).
default_tiles = forward_tiles


def _kernel(
    gmem, smem, produced, consumed, schedule, *, scale: float, n_res: int,
    tiles: MosaicTiles, msa_rows: int, heads: int, heads_per_tile: int, grid, dtype,
    interpret: bool, row_views: tuple[str, ...] = (), key_bounds=None, skips_masked=False,
    dropout=None, mask_queries=False,
):
    """`heads`: the heads of q, k and v as the kernel sees them, each
    `heads_per_tile` heads of the bias (2 for d = 8, `heads.pairs_heads`).
    `row_views`: the names of `smem` that are pairs of views
    (`smem.unaligned_row_tile`, N % 8 != 0): TMA copies go through the
    first, everything else through the second. `key_bounds`: as in
    `attention_forward`. `skips_masked`: gmem holds the mask's spans
    (`key_tiles.span_operands`); without dropout, dead rows' results are
    not the op's (`attention_forward` replaces them). `mask_queries`
    (with `skips_masked`): an item whose query tile holds no residue its
    rows keep visits no key tile (its results are 0, as the op's there);
    with a persistent grid the kernel writes every zero of the output
    (`zeroes_masked_queries`), whose gmem ref is then `[B, S, N, H' * w]`,
    every head of a residue in one row.
    `dropout` (`dropout_words.Dropout`): gmem holds "query_words", "key_words"."""
    smem_tma, smem = split_row_views(smem, row_views)
    block_q, block_k, stages = tiles.block_q, tiles.block_k, tiles.num_stages
    pair = heads_per_tile
    key_tiles = pl.cdiv(n_res, block_k)
    has_mask, has_gate = "mask" in gmem, "gate" in gmem
    save_stats = "attention" in gmem
    ping_pong = msa_rows == 2 and tiles.ping_pong
    to_log2 = scale * LOG2E
    masked = masked_accumulator_logit(scale)
    wg = lax.axis_index("wg")
    static_bounds = key_bounds is None and not skips_masked  # every item, every key tile
    writes_zeros = zeroes_masked_queries(mask_queries, tiles)
    if skips_masked:
        # With dropout a dead row's dropped uniform weights have no shortcut:
        # its items visit every key tile.
        spans = SpanReader.reads(
            gmem, n_res=n_res, rows_per_group=msa_rows, dead_rows_whole=dropout is not None
        )
    tile_dim = gmem["q"].shape[-1]

    def key_tiles_of(work):
        """`(lb, ub)`: item `work` visits key tiles lb <= key tile < ub, in
        order. The consumers and the producer both ask here, so they agree
        on the ring's steps."""
        if static_bounds:
            return 0, key_tiles
        if key_bounds is not None:
            return key_bounds(work, key_tiles)
        batch, _, row_group, q_start = work
        lb, ub = spans.key_tiles(batch, row_group, block_k)
        if mask_queries:
            holds = spans.holds_queries(batch, row_group, lax.div(q_start, block_q), block_q)
            ub = jnp.where(holds, ub, lb)
        return lb, ub

    def load_own(name, work):
        """The consumer's copy of its q or gate tile for item `work`, on its
        "q" barrier (awaited once per item: the gate, issued an epilogue
        after q, lands long before the next epilogue needs it)."""
        batch, head, row_group, q_start = work
        plgpu.copy_gmem_to_smem(
            gmem[name].at[batch, row_group * msa_rows + wg, pl.ds(q_start, block_q), head],
            smem_tma[name].at[wg], produced["q"].at[wg],
        )

    def load_row_data(work):
        """Item `work`'s gate tile and query mask, read in the epilogue: the
        next item's loads after it."""
        if has_gate:
            load_own("gate", work)
        if writes_zeros:
            batch, _, row_group, q_start = work
            plgpu.copy_gmem_to_smem(
                gmem["mask"].at[batch, pl.ds(row_group * msa_rows + wg, 1),
                                pl.ds(q_start, block_q)],
                smem["query_mask"].at[wg, :, pl.ds(0, block_q)], produced["q"].at[wg],
            )

    def consume_item(work, steps_before, next_work, has_next):
        """Work item `(batch, head, row_group, q_start)` for consumer `wg`,
        its key tiles taking the ring's steps from `steps_before` on;
        returns the steps after it. Loads `next_work`'s q and row data
        (when `has_next`) as soon as this item is done with them."""
        batch, head, row_group, q_start = work
        row = row_group * msa_rows + wg
        queries = pl.ds(q_start, block_q)
        q_smem = smem["q"].at[wg]
        lb, ub = key_tiles_of(work)
        # The ring step of key tile 0 (a virtual one where lb > 0).
        first_step = steps_before - lb
        if dropout is not None:  # from GMEM: in flight while q's tile lands
            row_dropout = HeadDropout(dropout, gmem, batch, row, head * pair, pair)
            query_words = row_dropout.query_words(q_start, block_q)
        plgpu.barrier_wait(produced["q"].at[wg])

        if pair == 1:
            queries_of_head = (q_smem,)
        else:
            # Each head's q tile keeps its own columns: a product with a K
            # tile of both heads then sums over that head's alone.
            queries_of_head = store_own_head_tiles(q_smem, smem["q_heads"], wg)
            plgpu.commit_smem()
        row_max = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), WGMMA_ROW)
        row_sum = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), WGMMA_ROW)

        def slot_of(key_tile):
            return lax.rem(first_step + key_tile, stages)

        def prefetch_next_queries(when):
            """After the item's last product with q, its tile takes the next
            item's queries, while this one's last tiles and epilogue run;
            first every warp of the warpgroup is past its wait for it."""

            @pl.when(jnp.logical_and(has_next, when))
            def _():
                plgpu.commit_smem()
                load_own("q", next_work)

        def mask_logits(logits, slot, key_tile):
            """The tile's logits (a tuple, one per head) with masked keys and
            keys past N replaced; reads the tile's mask vector, so the slot's
            K may be released after it."""
            shape = logits[0].shape
            if has_mask:
                keep = plgpu.load(
                    smem["mask"].at[slot, wg, 0, pl.ds(0, block_k)], layout=WGMMA_COL
                )
                keep = lax.broadcast_in_dim(keep != 0, shape, [1])
                logits = tuple(jnp.where(keep, t, masked) for t in logits)
            if n_res % block_k:
                before = keys_before(n_res, key_tile, block_k, shape)
                logits = tuple(jnp.where(before, t, -jnp.inf) for t in logits)
            return logits

        def rescaled(acc, rescale):
            return acc * lax.broadcast_in_dim(rescale, acc.shape, [0])

        def key_loop():
            """Per key tile: `q k^T`, the softmax, `p v`, in that order, for
            each head of the tile (`pair` of them), each with its own
            statistics and output accumulator. Returns tuples, one entry per
            head."""
            acc = plgpu.layout_cast(jnp.zeros((block_q, tile_dim), jnp.float32), WGMMA)
            if static_bounds:
                plgpu.barrier_wait(produced["k"].at[slot_of(lb)])
            else:
                # An item may have no key tile (its rows all dead); its q
                # tile then takes the next item's queries at once.
                pl.when(lb < ub)(lambda: plgpu.barrier_wait(produced["k"].at[slot_of(lb)]))
                prefetch_next_queries(ub <= lb)

            def visit_key_tile(key_tile, carry):
                accs, row_maxes, row_sums = carry
                slot = slot_of(key_tile)
                if dropout is not None:  # loaded first: the products hide its latency
                    key_words = row_dropout.key_words(key_tile * block_k, block_k)
                # The product starts from the bias tile, so the matrix units add it.
                keys_t = smem["k"].at[slot, wg].T
                logits = smem_products(
                    tuple((queries, keys_t) for queries in queries_of_head), turns.hand_over,
                    inits=tuple(
                        load_bias_tile(smem["bias"].at[slot, h], scale,
                                       staggered=tiles.staggered_bias)
                        for h in range(pair)
                    ),
                    interpret=interpret,
                )
                prefetch_next_queries(key_tile == ub - 1)
                logits = mask_logits(logits, slot, key_tile)
                plgpu.barrier_arrive(consumed["k"].at[slot])

                softmaxes = [
                    online_softmax(t, row_max, row_sum, to_log2)
                    for t, row_max, row_sum in zip(logits, row_maxes, row_sums)
                ]
                accs = tuple(
                    rescaled(acc, rescale) for acc, (_, rescale, _, _) in zip(accs, softmaxes)
                )
                ps = tuple(p for p, _, _, _ in softmaxes)
                if dropout is not None:  # the row sums above are the undropped weights'
                    ps = row_dropout.drop(ps, query_words, key_words)
                p16s = tuple(p.astype(dtype) for p in ps)
                new_maxes = tuple(new_max for _, _, new_max, _ in softmaxes)
                row_sums = tuple(row_sum for _, _, _, row_sum in softmaxes)
                accs, row_sums, new_maxes, p16s = lax.optimization_barrier(
                    (accs, row_sums, new_maxes, p16s)
                )

                turns.release()
                plgpu.barrier_wait(produced["v"].at[slot])
                turns.take_turn()

                def wait_for_next_keys():
                    later = key_tile + 1
                    pl.when(later < ub)(
                        lambda: plgpu.barrier_wait(produced["k"].at[slot_of(later)]))

                accs = accumulate_products(
                    accs, p16s, (smem["v"].at[slot, wg],) * pair, interpret, wait_for_next_keys
                )
                plgpu.barrier_arrive(consumed["v"].at[slot])
                return accs, new_maxes, row_sums

            return lax.fori_loop(
                lb, ub, visit_key_tile, ((acc,) * pair, (row_max,) * pair, (row_sum,) * pair)
            )

        accs, row_maxes, row_sums = key_loop()
        if skips_masked:
            # A live row's sum is >= 1 (its max's term); a row that visited
            # no key tile (dead) has 0: finite results, which the wrapper
            # replaces.
            row_sums = tuple(jnp.maximum(row_sum, 1.0) for row_sum in row_sums)

        # Each head's columns of the tile come from its own accumulator.
        outs = [
            acc * lax.broadcast_in_dim(kept_sum_scale(row_sum, dropout), acc.shape, [0])
            for acc, row_sum in zip(accs, row_sums)
        ]
        out = combine_head_columns(outs)
        # The previous item's results have left the tiles written below.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if save_stats:
            store_row_tile(row_tile_at(smem["attention"], wg), out)
            for h, (row_max, row_sum) in enumerate(zip(row_maxes, row_sums)):
                # The backward's masked logit (base 2) for a row whose keys are
                # all masked, so that its weights come out uniform there as here.
                row_max_log2 = row_max * to_log2
                if has_mask:
                    row_max_log2 = jnp.where(row_max <= masked, MASKED_LOGIT_LOG2, row_max_log2)
                smem["row_max"][wg, h] = row_max_log2
                smem["row_log2_sum"][wg, h] = jnp.log2(row_sum)
        if has_gate:
            out = out * sigmoid(smem["gate"][wg].astype(jnp.float32))
        if writes_zeros:
            # 0 at the masked queries (their rows' results otherwise).
            kept = plgpu.load(
                smem["query_mask"].at[wg, 0, pl.ds(0, block_q)], layout=WGMMA_ROW
            ) != 0
            out = jnp.where(lax.broadcast_in_dim(kept, out.shape, [0]), out, 0.0)
        # With one CTA per item q's tile is free by now and holds the output on
        # its way out; a persistent CTA's holds the next item's queries.
        out_name = "out" if "out" in smem else "q"
        smem[out_name].at[wg][...] = out.astype(dtype)
        # Every thread's reads of the gate and writes of the output are done.
        plgpu.commit_smem()
        pl.when(has_next)(lambda: load_row_data(next_work))
        # Whole rows: the head's columns of them.
        out_columns = pl.ds(head * tile_dim, tile_dim) if writes_zeros else head
        plgpu.copy_smem_to_gmem(
            smem_tma[out_name].at[wg], gmem["out"].at[batch, row, queries, out_columns]
        )
        if save_stats:
            copy_row_tile_to_gmem(
                row_tile_at(smem_tma["attention"], wg),
                gmem["attention"].at[batch, row, queries, head],
            )
            # [pair, block_q] windows of the statistics' [H, N] planes.
            for name in ("row_max", "row_log2_sum"):
                plgpu.copy_smem_to_gmem(
                    smem[name].at[wg],
                    gmem[name].at[batch, row, pl.ds(head * pair, pair), queries],
                )
        return steps_before + (ub - lb)

    def produce_item(work, steps_before, *_, ring: str):
        """The producer's copies of ring "k" (K tiles, mask vectors, bias
        tile) or "v" (V tiles) for one work item, into the ring's steps
        `steps_before` on; returns the steps after it."""
        batch, head, row_group, q_start = work
        first_row = row_group * msa_rows
        queries = pl.ds(q_start, block_q)
        lb, ub = key_tiles_of(work)
        first_step = steps_before - lb

        def load(key_tile, wait_for_slot):
            """The copies of key tile `key_tile`; `wait_for_slot`: whether its
            slot may still be in use (a bool, or a traced one)."""
            slot = lax.rem(first_step + key_tile, stages)
            keys = pl.ds(key_tile * block_k, block_k)
            if wait_for_slot is True:
                plgpu.barrier_wait(consumed[ring].at[slot])
            elif wait_for_slot is not False:
                pl.when(wait_for_slot)(lambda: plgpu.barrier_wait(consumed[ring].at[slot]))
            for r in range(msa_rows):
                plgpu.copy_gmem_to_smem(
                    gmem[ring].at[batch, first_row + r, keys, head], smem_tma[ring].at[slot, r],
                    produced[ring].at[slot],
                )
            if ring == "v":
                return
            # The mask vectors and the bias tile complete the "k" barrier too.
            for r in range(msa_rows if has_mask else 0):
                plgpu.copy_gmem_to_smem(
                    gmem["mask"].at[batch, pl.ds(first_row + r, 1), keys],
                    smem["mask"].at[slot, r, :, pl.ds(0, block_k)], produced["k"].at[slot],
                )
            for h in range(pair):
                plgpu.copy_gmem_to_smem(
                    gmem["bias"].at[batch, head * pair + h, queries, keys],
                    smem["bias"].at[slot, h], produced["k"].at[slot],
                )

        # The CTA's first `stages` steps find their slots free: with fewer key
        # tiles than stages, those of its first items (not only its first).
        # The item's first `stages` tiles are unrolled, each waiting for its
        # slot only where an earlier step used it.
        for i in range(min(stages, ub - lb) if static_bounds else stages):
            used_before = steps_before + i >= stages if tiles.persistent else False
            if static_bounds:
                load(jnp.int32(lb + i), used_before)
            else:
                pl.when(lb + i < ub)(
                    lambda i=i, used_before=used_before: load(lb + i, used_before)
                )
        if not static_bounds or ub - lb > stages:
            pl.loop(lb + stages, ub)(lambda key_tile: load(key_tile, True))
        return steps_before + (ub - lb)

    items = ForwardItems(
        grid, heads, block_q, tiles.persistent,
        row_groups=spans.live_row_groups(grid[2]) if skips_masked else None,
        # The query tiles after the last kept residue: results 0, as the
        # wrapper writes them, and residuals that nothing reads. Each would
        # cost an item's q tile and stores, and hand its q latency to the next.
        query_tiles=spans.live_query_tiles(block_q) if mask_queries else None,
    )
    first_item = items.first

    def for_each_item(work):
        return items.for_each(work, key_tiles if static_bounds else None)

    def zeros_without_items():
        """The output's zeros that no item writes: every residue of the row
        groups without items (padding rows at the end of the alignment),
        and of the others the query tiles without items (padding residues
        at the end of the crop), every head and every row of a group at
        once (`work_items.RowZeros`)."""
        zeros_tile = smem["dead_zeros"]
        live_groups, live_tiles = items.live_row_groups, items.live_query_tiles
        regions = [
            (live_groups, grid[2] - live_groups, 0),
            (0, live_groups, live_tiles * (block_q // zeros_tile.shape[0])),
        ]
        return RowZeros(items.shares, zeros_tile, [gmem["out"]], msa_rows, grid[0] // heads,
                        regions)

    # The consumers take turns across items too: the one whose epilogue runs
    # leaves the units to the other.
    turns = PingPong(schedule, wg, enabled=ping_pong)

    def load_first_item():
        load_own("q", first_item)
        load_row_data(first_item)

    @pl.when(wg < msa_rows)
    def _consumer():
        consumer_registers(msa_rows)
        if skips_masked:  # the CTA may have no item
            pl.when(items.items_here > 0)(load_first_item)
        else:
            load_first_item()
        turns.start()
        for_each_item(consume_item)
        turns.finish()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == msa_rows)
    def _producer():
        producer_registers()
        zeros = zeros_without_items() if writes_zeros else None

        def feed(ring):
            steps = for_each_item(functools.partial(produce_item, ring=ring))
            # Observe the consumers' last releases of every slot, so that no
            # barrier phase is left unobserved when the CTA ends: those of its
            # last `stages` steps (with static bounds every CTA has an item,
            # so at least key_tiles steps).
            for back in range(stages, 0, -1):
                def observe(back=back):
                    plgpu.barrier_wait(consumed[ring].at[lax.rem(steps - back, stages)])

                if static_bounds and back <= key_tiles:
                    observe()
                else:
                    pl.when(steps >= back)(observe)

        # One warp per ring: a K slot refills as soon as the consumers are
        # done with its keys, even while they still multiply by the V tile
        # of the same step.
        @plgpu.warp_map
        def _(warp):
            pl.when(warp == 0)(lambda: feed("k"))
            pl.when(warp == 1)(lambda: feed("v"))
            if zeros is not None:
                pl.when(warp == 2)(zeros.store)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "tiles", "interpret", "save_stats", "key_bounds", "skip_masked", "dropout_rate",
        "dead_row_means", "mask_queries",
    ),
)
def attention_forward(
    q, k, v, bias, mask, gate, dropout_seeds=None, *, scale: float, tiles: MosaicTiles,
    interpret: bool, save_stats: bool, key_bounds=None, skip_masked: bool = False,
    dropout_rate: float = 0.0, dead_row_means: bool = False, mask_queries: bool = False,
):
    """Runs the Mosaic GPU forward kernel; the contract of the Triton forward.

    Args:
      q, k, v: `[B, S, N, H, d]`, bfloat16 / float16, d in `HEAD_DIMS` or
        d = 8 with H even (two heads per tile, `heads.pairs_heads`), N a
        multiple of `support.RESIDUE_MULTIPLE` or any N where
        `support.takes_any_n`.
      bias: `[B, H, N, N]`, 16- or 32-bit float.
      mask: `[B, S, N]` int8 (nonzero keeps) or None.
      gate: `[B, S, N, H, d]` gate logits or None.
      dropout_seeds: uint32 `[B, S, H]` (`dropout.row_seeds`), or None
        without dropout.
      scale: multiplies q . k.
      tiles: the kernel's configuration.
      interpret: run in the Mosaic GPU interpreter (CPU).
      save_stats: also return what the backward needs.
      key_bounds: to test the pipeline, `key_bounds(work, key_tiles) -> (lb,
        ub)`: the key tiles lb <= t < ub that work item `work` = (batch,
        head, row group, first query) visits, leaving the others out.
      skip_masked: with a mask, visit only the key tiles with kept keys and
        the row groups up to the last with one (`kernels.key_tiles`; the op:
        `skipping_padding`), the dead rows' results given after the
        kernel (`_with_dead_rows`), or with dropout, the dead rows visited
        whole (`key_tiles.SpanReader`'s `dead_rows_whole`); False, all.
      dropout_rate: attention dropout on the probabilities (`dropout`'s
        mask, kept ones scaled by 1 / (1 - rate)); the row statistics are
        the undropped ones'. 0: none.
      dead_row_means: with `save_stats`, skipping (a mask, no dropout): the
        residuals of dead rows as the kernel left them (unwritten where it
        had no item for them), and the dead rows' mean of v as a fifth
        result, for `triton.backward_prologue`, which reads those in their
        place.
      mask_queries: skipping (a mask, no dropout): the mask masks queries
        too, and out is 0 at the residues it masks in a row (the op's
        `mask_queries`): an item whose query tile holds no kept residue
        visits no key tile, dead rows are rows of zeros, written by the
        kernel where its grid is persistent (`zeroes_masked_queries`), else
        after it, in place, by `triton.dead_rows.zero_masked_queries`. The
        residuals are as the kernel left them (unwritten for the row groups
        after the last live one): `triton.backward_prologue` with the query
        mask reads a live row's alone.

    Returns:
      out `[B, S, N, H, d]` in q's dtype, and, if `save_stats`, the ungated
      attention output `[B, S, N, H, d]` in float32 (with dropout: dropped and
      scaled) and the float32 row max and log2 row sum, each `[B, S, H, N]`,
      in base-2 units (the undropped weights'); with `dead_row_means`, then
      `[B, S, H, d]` float32, a dead row's mean of v (0 elsewhere).
    """
    check_kernel_inputs(q, bias, paired_heads=True)
    shape = batch, rows, n_res, heads, head_dim = q.shape
    msa_rows = tiles.msa_rows_for(rows)
    shapes = {"out": q.shape, "attention": q.shape}
    pair = heads_per_tile(head_dim, heads)
    skips_masked = mask is not None and skip_masked and key_bounds is None
    dropout = check_dropout(dropout_seeds, dropout_rate, shape)
    if mask_queries and not (skips_masked and dropout is None) or mask_queries and dead_row_means:
        raise ValueError("mask_queries: only where dead rows are skipped (a mask, skip_masked, "
                         "no dropout), without dead_row_means (their rows are zeros)")
    inputs, out_types = forward_operands(
        q, k, v, bias, mask, gate, None if dropout is None else dropout_seeds, scale=scale,
        tiles=tiles, msa_rows=msa_rows, pair=pair, skips_masked=skips_masked,
        save_stats=save_stats,
    )
    writes_zeros = zeroes_masked_queries(mask_queries, tiles)
    if writes_zeros:
        # Every head of a residue in one row: boxes of whole rows for the zeros.
        out_types["out"] = jax.ShapeDtypeStruct((*shape[:3], heads * head_dim), q.dtype)
    kernel_plan = forward_plan(
        shape, q.dtype, bias.dtype, tiles, mask_dtype=None if mask is None else mask.dtype,
        gate_dtype=None if gate is None else gate.dtype, save_stats=save_stats,
        interpret=interpret, mask_queries=mask_queries,
    )
    body = functools.partial(
        _kernel, scale=scale, n_res=n_res, tiles=tiles, msa_rows=msa_rows,
        heads=heads // pair, heads_per_tile=pair, grid=kernel_plan.work_items, dtype=q.dtype,
        interpret=interpret, row_views=row_view_names(kernel_plan.smem), key_bounds=key_bounds,
        skips_masked=skips_masked, dropout=dropout, mask_queries=mask_queries,
    )
    outs = launch(body, kernel_plan, inputs=inputs, out_types=out_types, interpret=interpret)
    outs = tuple(x.reshape(shapes.get(name, x.shape)) for name, x in zip(out_types, outs))
    means = ()
    if mask_queries:
        if not writes_zeros:
            out, *residuals = outs
            outs = (zero_masked_queries(out, mask, n_res=n_res, interpret=interpret), *residuals)
    elif skips_masked and dropout is None:
        outs = _with_dead_rows(outs, v, gate, mask, n_res, interpret,
                               selected=not (save_stats and dead_row_means))
        if save_stats and dead_row_means:
            *outs, means = outs
            means = (means.reshape(*shape[:2], heads, head_dim),)
    elif dead_row_means and save_stats:
        raise ValueError("dead_row_means: only where dead rows are skipped (a mask, "
                         "skip_masked, no dropout)")
    if save_stats:
        out, attention, row_max, row_log2_sum = outs
        outs = (out, attention, row_max[..., :n_res], row_log2_sum[..., :n_res], *means)
    return outs if save_stats else outs[0]


def _with_dead_rows(results, v, gate, mask, n_res: int, interpret: bool, selected: bool = True):
    """The kernel's `results` (out, and with the residuals the float32
    attention output and the row statistics on their padded planes) with
    the rows whose keys are all masked given their exact values (SPEC §1:
    uniform weights over the N keys), as the kernel visiting every tile
    gives them: out is the mean of v times sigmoid(gate), written in place
    by `fill_dead_rows`; the attention output that mean, the row max the
    masked logit (base 2) and the log2 sum log2(N), as selects that XLA
    fuses into what reads them (the backward's passes), so that no float32
    row is written for a dead row. Not `selected`: the residuals as they
    are, and the dead rows' means of v appended."""
    out, *residuals = results
    out, means = fill_dead_rows(out, v, gate, mask, n_res=n_res, interpret=interpret)
    if not residuals:
        return (out,)
    if not selected:
        return (out, *residuals, means)
    attention, row_max, row_log2_sum = residuals
    dead = dead_rows(mask, n_res)
    rows, planes = dead[:, :, None, None, None], dead[:, :, None, None]
    means = means.reshape(*attention.shape[:2], 1, *attention.shape[3:])
    return (
        out,
        jnp.where(rows, means, attention),
        jnp.where(planes, jnp.float32(MASKED_LOGIT_LOG2), row_max),
        jnp.where(planes, jnp.float32(math.log2(n_res)), row_log2_sum),
    )
