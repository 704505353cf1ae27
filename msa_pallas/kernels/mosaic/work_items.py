"""Which work items a forward CTA serves, and in what order.

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
rows need, and their results are filled in by the caller.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from msa_pallas.kernels.mosaic.pipeline import batch_head_and_warpgroup


class ForwardItems:
    """This CTA's work items. `grid`: (B * H', query tiles, row groups);
    `heads`: H' (heads as the kernel sees them); `block_q`: queries per
    item; `persistent`: one CTA per SM (the "ctas" axis) or one per item
    (the "row_groups", "query_tiles" and "batch_heads" axes). Made once, at
    the kernel's start: the CTA's share and first item are computed there.
    `row_groups`: None (every row group has items) or a traced int32, the
    row groups that have items (the first ones); the CTA may then have
    none (`items_here` 0), and its `first` item is not one to load."""

    def __init__(self, grid, heads: int, block_q: int, persistent: bool, row_groups=None):
        self.grid, self.heads, self.block_q, self.persistent = grid, heads, block_q, persistent
        self.runtime_count = row_groups is not None
        # Row groups per (batch-head, query tile) in the items' numbering; at
        # least 1, so that numbering a CTA's (absent) first item divides by it.
        self.row_groups = grid[2] if row_groups is None else lax.max(row_groups, 1)
        if persistent:
            # CTA `cta` takes items cta, cta + ctas, ...: the CTAs at work at
            # the same time take neighbouring row groups, so they read the
            # same bias tiles, as with one CTA per item.
            self.ctas, self.cta = lax.axis_size("ctas"), lax.axis_index("ctas")
            total = grid[0] * grid[1] * (grid[2] if row_groups is None else row_groups)
            self.items_here = total // self.ctas + (self.cta < total % self.ctas).astype(jnp.int32)
            self.first = self.item(self.cta)
        else:
            batch, head, _ = batch_head_and_warpgroup(heads)
            row_group = lax.axis_index("row_groups")
            self.items_here = (
                1 if row_groups is None else (row_group < row_groups).astype(jnp.int32)
            )
            self.first = (batch, head, row_group, lax.axis_index("query_tiles") * block_q)

    def item(self, linear):
        """(batch, head, row_group, q_start) of work item `linear`."""
        batch_heads, query_tiles, _ = self.grid
        row_groups = self.row_groups
        row_group = lax.rem(linear, row_groups)
        query_tile = lax.rem(lax.div(linear, row_groups), query_tiles)
        batch_head = lax.div(linear, row_groups * query_tiles)
        return (lax.div(batch_head, self.heads), lax.rem(batch_head, self.heads), row_group,
                query_tile * self.block_q)

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
            linear = index * self.ctas + self.cta
            if steps_per_item is not None:
                steps_before = index * steps_per_item
            return work(self.item(linear), steps_before, self.item(linear + self.ctas),
                        index + 1 < self.items_here)

        return lax.fori_loop(0, self.items_here, visit, jnp.int32(0))
