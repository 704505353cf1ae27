"""Which work items a persistent CTA serves, and in what order.

The forward's work items are (batch, head, MSA-row group, first query),
counted over `grid` = (B * H, query tiles, row groups) with the row groups
fastest, so that the CTAs at work at the same time read the same bias tiles.
With one CTA per item the grid names the item; a persistent CTA (one per SM)
takes items cta, cta + ctas, ... in turn, and its ring's steps run on from
item to item.

When padding is skipped, only the first `row_groups` row groups (a count
read at run time: those before the last group that keeps a key) have
items: the dead groups after them (padding rows at the end of the
alignment) take none, so a padded batch's items are as many as its live
rows need, and their results are filled in by the caller. Where the mask
masks queries too, the query tiles after the last that holds a kept
residue (padding residues at the end of the crop) take none either.

The persistent dq and dk/dv kernels' items (`BackwardItems`) are counted
the same way, a query or key tile in place of the first query; their
CTAs write the dead groups' results themselves: a few stores per row
group, where the one-CTA-per-item grid spends a CTA on each of its items.
Zeros (dq, dk, and dv where the mask masks queries too) go out in boxes
of whole output rows, every head at once (`RowZeros`): one head's tile
is a strided box of 32- or 64-byte pieces, and on an H100 the dk/dv
kernel's such stores at the padded extra MSA took 62 of its 305 us, where
whole rows took 15 (2026-12-06). A spare warp of the producer stores them,
from the kernel's start, while the consumers compute: stored by the
consumers, between their items or after them, they cost more
(benchmarks/log, 2026-12-06 07 and 08). The persistent forward stores the
zeros of masked queries the same way (`plan.zeroes_masked_queries`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.mosaic.pipeline import (
    batch_head_and_warpgroup, consumer_registers, producer_registers,
)


def decode_item(linear, tiles: int, row_groups, heads: int):
    """(batch, head, row_group, tile) of work item `linear` in the numbering
    every grid of work items shares: row groups fastest, then `tiles` tiles
    (query or key tiles), then batch and head (`heads` of them). `row_groups`
    (an int or a traced int32, at least 1) is the count numbered."""
    batch_head = lax.div(linear, row_groups * tiles)
    return (lax.div(batch_head, heads), lax.rem(batch_head, heads), lax.rem(linear, row_groups),
            lax.rem(lax.div(linear, row_groups), tiles))


class CtaShare:
    """A persistent CTA's share of a count of indices (one CTA per SM, the
    "ctas" axis): CTA `cta` takes indices cta, cta + ctas, ..."""

    def __init__(self):
        self.ctas, self.cta = lax.axis_size("ctas"), lax.axis_index("ctas")

    def share(self, count):
        """How many of `count` indices this CTA takes (an int32)."""
        return count // self.ctas + (self.cta < count % self.ctas).astype(jnp.int32)

    def index(self, local):
        """The index of the CTA's `local`-th of its share."""
        return local * self.ctas + self.cta


class ForwardItems:
    """This CTA's work items. `grid`: (B * H', query tiles, row groups);
    `heads`: H' (heads as the kernel sees them); `block_q`: queries per
    item; `persistent`: one CTA per SM (the "ctas" axis) or one per item
    (the "row_groups", "query_tiles" and "batch_heads" axes). Made once, at
    the kernel's start: the CTA's share and first item are computed there.
    `row_groups`: None (every row group has items) or a traced int32, the
    row groups that have items (the first ones); the CTA may then have
    none (`items_here` 0), and its `first` item is not one to load.
    `query_tiles`: likewise for the query tiles (None: all of them; a
    traced int32: the first ones, those after holding no query to serve)."""

    def __init__(self, grid, heads: int, block_q: int, persistent: bool, row_groups=None,
                 query_tiles=None):
        self.grid, self.heads, self.block_q, self.persistent = grid, heads, block_q, persistent
        self.runtime_count = row_groups is not None or query_tiles is not None
        # The counts of row groups and query tiles that have items (0 or more).
        self.live_row_groups = grid[2] if row_groups is None else row_groups
        self.live_query_tiles = grid[1] if query_tiles is None else query_tiles
        # Row groups and query tiles in the items' numbering; at least 1, so
        # that numbering a CTA's (absent) first item divides by them.
        self.row_groups = grid[2] if row_groups is None else lax.max(row_groups, 1)
        self.query_tiles = grid[1] if query_tiles is None else lax.max(query_tiles, 1)
        if persistent:
            # CTA `cta` takes items cta, cta + ctas, ...: the CTAs at work at
            # the same time take neighbouring row groups, so they read the
            # same bias tiles, as with one CTA per item.
            self.shares = CtaShare()
            self.ctas, self.cta = self.shares.ctas, self.shares.cta
            total = (grid[0] * (grid[1] if query_tiles is None else query_tiles)
                     * (grid[2] if row_groups is None else row_groups))
            self.items_here = self.shares.share(total)
            self.first = self.item(self.cta)
        else:
            batch, head, _ = batch_head_and_warpgroup(heads)
            row_group, query_tile = lax.axis_index("row_groups"), lax.axis_index("query_tiles")
            here = True
            if row_groups is not None:
                here = jnp.logical_and(here, row_group < row_groups)
            if query_tiles is not None:
                here = jnp.logical_and(here, query_tile < query_tiles)
            self.items_here = 1 if here is True else here.astype(jnp.int32)
            self.first = (batch, head, row_group, query_tile * block_q)

    def item(self, linear):
        """(batch, head, row_group, q_start) of work item `linear`."""
        batch, head, row_group, query_tile = decode_item(
            linear, self.query_tiles, self.row_groups, self.heads
        )
        return batch, head, row_group, query_tile * self.block_q

    def for_each(self, work, steps_per_item=None):
        """`work(item, steps_before, next_item, has_next)` for this CTA's
        items, in order: `steps_before` counts the ring steps of the CTA's
        earlier items, `work` returns the count after its item (every item
        takes `steps_per_item` steps where that is known when tracing).
        Returns the CTA's steps in all."""
        if not self.persistent:
            if not self.runtime_count:
                return work(self.first, 0, self.first, False)
            # One item or none.
            return lax.fori_loop(
                0, self.items_here, lambda _, steps: work(self.first, steps, self.first, False),
                jnp.int32(0),
            )

        def visit(index, steps_before):
            linear = self.shares.index(index)
            if steps_per_item is not None:
                steps_before = index * steps_per_item
            return work(self.item(linear), steps_before, self.item(linear + self.ctas),
                        index + 1 < self.items_here)

        return lax.fori_loop(0, self.items_here, visit, jnp.int32(0))


# The stores of dead row groups' results a persistent backward consumer keeps
# in flight (their tiles hold the same values from store to store).
DEAD_STORES_IN_FLIGHT = 8


# Shared memory for the tile of zeros a persistent kernel stores over whole
# rows of its outputs (`dead_zeros_smem`).
DEAD_ZEROS_BYTES = 8192
# The widest box a TMA copy takes along one axis, in elements.
_TMA_BOX_MAX = 256


def dead_zeros_smem(width: int, dtype, residues: int):
    """The plans' shared memory for `store_dead_zeros`: a tile of `[rows,
    columns]`, neither tiled nor swizzled, for an output
    whose rows are `width` wide (every head of a residue, `H' * tile
    width`: whole rows, contiguous in global memory). Its columns: the
    widest divisor of `width` that one TMA box takes, a multiple of 8 (as
    `width` is); its rows: as many as fit in `DEAD_ZEROS_BYTES`, a power of
    two, at least 8 and at most `residues` rounded up to one."""
    columns = 8 * max(c for c in range(1, _TMA_BOX_MAX // 8 + 1) if (width // 8) % c == 0)
    rows = max(8, DEAD_ZEROS_BYTES // (columns * jnp.dtype(dtype).itemsize))
    rows = min(1 << (rows.bit_length() - 1), max(8, 1 << (residues - 1).bit_length()))
    return plgpu.SMEM((rows, columns), dtype)


def fill_dead_zeros(tile) -> None:
    """Writes zeros to a consumer's tile of `dead_zeros_smem`, made visible
    to the TMA stores that read it."""
    tile[...] = jnp.zeros(tile.shape, tile.dtype)
    plgpu.commit_smem()


def store_dead_zeros(tile, out_row, chunk) -> None:
    """Starts the TMA stores of `tile` (`fill_dead_zeros`' `[rows,
    columns]`) over residues `chunk * rows` on of one row of an output,
    `out_row` (`[N, width]`), every `columns` of its width; keeps
    `DEAD_STORES_IN_FLIGHT` in flight. Residues past N are not written."""
    rows, columns = tile.shape
    n_res = out_row.shape[0]
    # The last chunk's box ends at N. A box contiguous in global memory is
    # stored with one plain bulk copy (`cp.async.bulk`, not a TMA tensor
    # copy), bounded only by the array's end: one that ran past N wrote its
    # residues past N at the start of the next MSA row, on an H100 the next
    # batch element's first row (benchmarks/log, 2026-12-06 09).
    chunks = pl.cdiv(n_res, rows)
    last_rows = n_res - (chunks - 1) * rows

    def store(count):
        for start in range(0, out_row.shape[-1], columns):
            plgpu.wait_smem_to_gmem(DEAD_STORES_IN_FLIGHT, wait_read_only=True)
            plgpu.copy_smem_to_gmem(
                tile.at[pl.ds(0, count)],
                out_row.at[pl.ds(chunk * rows, count), pl.ds(start, columns)],
            )

    if last_rows == rows:
        store(rows)
    else:
        # Comparisons, not a negation: warps (a producer's spare one) lower
        # no `not`.
        pl.when(chunk < chunks - 1)(lambda: store(rows))
        pl.when(chunk == chunks - 1)(lambda: store(last_rows))


def store_every_tile(tiles, store) -> None:
    """`store(tile)` (TMA stores of one dead row group's tile `tile`, from
    shared memory that holds the same values for each) for 0 <= tile <
    `tiles`, none awaited but to keep `DEAD_STORES_IN_FLIGHT` in flight."""

    @pl.loop(0, tiles)
    def _(tile):
        plgpu.wait_smem_to_gmem(DEAD_STORES_IN_FLIGHT, wait_read_only=True)
        store(tile)


class BackwardItems:
    """A persistent backward CTA's work items (one CTA per SM, the "ctas"
    axis): (batch, head, row group, tile) over `grid` = (B * H', tiles, row
    groups), the row groups fastest as in the one-CTA-per-item grids, the
    tile being a query tile (dq) or a key tile (dk/dv).

    `live_groups` (a traced int32, or None for all): the row groups before
    it have items, run in full; those from it on are dead (padding rows at
    the end of the alignment, `key_tiles.SpanReader.live_row_groups`) and only
    write their fixed results, a (batch, head, row group) at a time: every
    tile of a dead group takes the same values. CTA `cta` takes items (and
    dead groups) cta, cta + ctas, ..."""

    def __init__(self, grid, heads: int, live_groups=None):
        self.grid, self.heads = grid, heads
        self.groups = grid[2] if live_groups is None else lax.clamp(0, live_groups, grid[2])
        self.shares = CtaShare()

    def _for_each(self, count, work) -> None:
        """`work(index)` for this CTA's share of `count` indices."""

        @pl.loop(0, self.shares.share(count))
        def _(local):
            work(self.shares.index(local))

    def for_each_live(self, work) -> None:
        """`work(batch, head, row_group, tile)` for this CTA's live items, in order."""
        batch_heads, tiles, _ = self.grid
        # At least one group in the numbering, so that no item divides by 0.
        groups = lax.max(self.groups, 1)
        self._for_each(
            batch_heads * tiles * self.groups,
            lambda linear: work(*decode_item(linear, tiles, groups, self.heads)),
        )

    def dead_row_zeros(self, tile, outs, rows_per_group: int):
        """The `RowZeros` of the dead row groups' rows (all their residues,
        every row of a group) in every output of `outs`."""
        batch_heads, _, groups = self.grid
        return RowZeros(self.shares, tile, outs, rows_per_group, batch_heads // self.heads,
                        [(self.groups, groups - self.groups, 0)])

    def for_each_dead_group(self, work) -> None:
        """`work(batch, head, row_group)` for this CTA's share of the dead row
        groups (of every batch element and head)."""
        batch_heads, _, groups = self.grid
        dead = groups - self.groups

        def unit(linear):
            # Numbered as items of one tile each, over the dead groups alone.
            batch, head, dead_group, _ = decode_item(linear, 1, lax.max(dead, 1), self.heads)
            work(batch, head, self.groups + dead_group)

        self._for_each(batch_heads * dead, unit)


class RowZeros:
    """Zeros stored by a persistent CTA over whole rows of outputs (`[B, S,
    N, width]` refs, every head of a residue in its row: one box of
    `store_dead_zeros` for any number of heads, where one head's tile would
    be a strided box of narrow pieces), from `tile` (`dead_zeros_smem`'s,
    filled here by the warpgroup that builds this, at the kernel's start),
    in chunks of its rows of residues.

    `regions`: per batch element (of `batch`), (first group, groups, first
    chunk) triples (ints or traced int32s): every row of each of those row
    groups (of `rows_per_group` rows), its chunks from the first on. The
    units are (batch, region, group, chunk), the chunks of a group fastest,
    so that the CTAs at work at the same time write neighbouring memory;
    `shares` (a `CtaShare`) gives this CTA its share of them, which `store`
    writes."""

    def __init__(self, shares: CtaShare, tile, outs, rows_per_group: int, batch: int,
                 regions):
        fill_dead_zeros(tile)
        self.shares, self.tile, self.outs = shares, tile, outs
        self.rows_per_group = rows_per_group
        self.chunks = pl.cdiv(outs[0].shape[2], tile.shape[0])
        # Per region: its first group, its first chunk, its chunks per group
        # (at least 1, a divisor), and its units per batch element.
        self.regions = []
        for first_group, groups, first_chunk in regions:
            chunks = self.chunks - first_chunk
            self.regions.append((first_group, first_chunk, lax.max(chunks, 1),
                                 lax.max(groups, 0) * lax.max(chunks, 0)))
        self.per_batch = sum(units for *_, units in self.regions)
        self.here = shares.share(batch * self.per_batch)

    def store(self) -> None:
        """Stores this CTA's units (`store_dead_zeros`), and waits for the
        stores to have read the tile, so that the CTA may end."""

        @pl.loop(0, self.here)
        def _(local):
            linear = self.shares.index(local)
            batch = lax.div(linear, lax.max(self.per_batch, 1))
            within = lax.rem(linear, lax.max(self.per_batch, 1))
            # The region of the unit, and the unit within it.
            row_group = chunk = jnp.int32(0)
            before = jnp.int32(0)
            for first_group, first_chunk, chunks, units in self.regions:
                unit = within - before
                here = jnp.logical_and(unit >= 0, unit < units)
                row_group = jnp.where(here, first_group + lax.div(unit, chunks), row_group)
                chunk = jnp.where(here, first_chunk + lax.rem(unit, chunks), chunk)
                before = before + units
            for member in range(self.rows_per_group):
                row = row_group * self.rows_per_group + member
                for out in self.outs:
                    store_dead_zeros(self.tile, out.at[batch, row], chunk)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def serve_items(consume, produce, bounds_of, *, consumers: int, heads: int, persistent: bool,
                tile_axis: str, work_items=None, live_groups=None, dead_zeros=None,
                dead_groups=None) -> None:
    """A backward kernel's warp-specialised body over its work items
    (batch, head, row group, tile): the consumer warpgroups (wg < consumers)
    run `consume(*item, lb, ub)` for each, the producer `produce(*item, lb,
    ub)`, with the loop bounds `(lb, ub) = bounds_of(*item)`.

    One CTA per item (not `persistent`): the grid's "batch_heads",
    "row_groups" and `tile_axis` axes name it. Persistent: the CTA's share
    of `work_items` (`BackwardItems`); with `live_groups`, the count of
    row groups that have items (a traced int32, `key_tiles.SpanReader.
    live_row_groups`; None: all), those alone; the groups after them are
    dead: the zeros of `dead_zeros(items)` (a `RowZeros`, or None) go out
    from the producer's second warp, its first serving the items, and
    `dead_groups(items)` (or None) writes the rest on the consumers, after
    their items.
    """
    wg = lax.axis_index("wg")
    if not persistent:
        batch, head, _ = batch_head_and_warpgroup(heads)
        item = (batch, head, lax.axis_index("row_groups"), lax.axis_index(tile_axis))
        bounds = bounds_of(*item)

        @pl.when(wg < consumers)
        def _consumer():
            consumer_registers(consumers)
            consume(*item, *bounds)

        @pl.when(wg == consumers)
        def _producer():
            producer_registers()
            produce(*item, *bounds)

        return

    items = BackwardItems(work_items, heads, live_groups)

    def with_bounds(run):
        return lambda *item: run(*item, *bounds_of(*item))

    @pl.when(wg < consumers)
    def _consumer():
        consumer_registers(consumers)
        items.for_each_live(with_bounds(consume))
        if live_groups is not None and dead_groups:
            dead_groups(items)
        # The CTA may end once its stores have read shared memory.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == consumers)
    def _producer():
        producer_registers()
        if live_groups is None or dead_zeros is None:
            items.for_each_live(with_bounds(produce))
            return
        zeros = dead_zeros(items)

        # The dead groups' zeros from a warp of their own, while the
        # consumers compute.
        @plgpu.warp_map
        def _(warp):
            pl.when(warp == 0)(lambda: items.for_each_live(with_bounds(produce)))
            pl.when(warp == 1)(zeros.store)
