"""What the key mask lets the kernels skip: a small summary of it, computed once per call.

The mask's meaning is exact (SPEC §1), so padding costs nothing it need not:

- a key j with `mask[b, s, j] == 0` in a row that keeps at least one key gets
  probability exactly 0 (its logit is -1e9; exp2 of it less the row's max
  underflows in float32), so it adds nothing to the output, to dq, dk, dv
  or to the bias gradient: a key tile whose keys are all masked in that row
  need not be loaded;
- a row whose keys are all masked (a "dead" row: an MSA row of padding)
  gives uniform weights over all N keys: its output is the mean of v over
  the N keys, its dq and dk and its part of the bias gradient are exactly
  0 (its logits depend on neither q, k nor the bias) and its dv is the mean
  over queries of its output gradient: no tile of it needs the matrix units.

Each kernel loops over key (or query, or MSA-row) tiles between bounds
derived at run time from a small summary of the mask. Tiles masked in the
middle of a row are inside the bounds and computed (exactly, as zeros):
real padding is at the end of a crop and of an alignment.

The summary is the same for every kernel of either backend, so XLA
computes it once per call (it merges the kernels' identical computations):

- `key_spans`: each row's span of kept keys, two `[B, S]` int32 arrays;
  reductions over the keys that XLA computes in the pass that converts the
  mask for the kernels (`dead_rows` too);
- `live_extents`: each batch element's live rows and kept keys, four `[B]`
  int32 arrays, a small pass over the spans, for the kernels that serve
  row groups in order or sum over the rows (`span_operands` gives both).

The kernels derive their own bounds from it (`tile_span`,
`rows_of_key_tile`; `SpanReader` for the Mosaic kernels' refs): a row's
or a row group's key tiles, the row groups up to the last live one, a key
tile's rows. Every summary XLA computes is a launch of its own (1-2 us
each at the training crop on an H200): compiled for an H200, the Mosaic
forward and backward read one launch of summary (the extents) where tile
bounds made for each kernel took seven, the Triton ones one where they
took six (`python -m benchmarks profile launches`).

Arrays are int32 whatever `jax_enable_x64` says (the kernels' index type).

The Mosaic forward leaves the dead rows' output, and the Mosaic dk/dv
kernel their dv's means, to small kernels that read and write those rows
alone (`triton.dead_rows`, or, for the means, `triton.backward_prologue`);
the Triton kernels compute them themselves.

With attention dropout a dead row's uniform weights are dropped too, so
its output and dv have no shortcut: the forward and dk/dv kernels then
visit a dead row like a row that keeps every key (`dead_rows_whole`; its
logits still see the mask) and skip only the masked key tiles of live
rows. dq and the bias gradient skip dead rows with or without dropout:
their part there is exactly 0 either way (the logits do not depend on q,
k or the bias).

Where the mask masks queries too (the op's `mask_queries`: a masked
residue's output is 0, and no gradient flows from it), a row's span of kept
keys is its span of kept queries, the same residues: the kernels then skip
query tiles by the same summaries (`SpanReader.holds_queries`, the
`queries` of `rows_of_key_tile`), and a dead row is all zeros.

Skipping is off by default (`skipping_padding`): measured on the H200
before the summary was shared, the bounds, the dead rows' means and the
forward's fill (then XLA passes over every row) cost 3-11% on masked
shapes with nothing to skip, against the 9-64% it saves on padded ones
(benchmarks/log, 2026-12-04 08).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax


# Part of JAX's jit cache key (`jax.make_user_context`): a function jitted
# once and called inside and outside `skipping_padding` is traced, and
# compiled, once for each. A plain context variable would let a cached
# trace from outside serve a call inside, which then would not skip.
_SKIPPING = jax.make_user_context(default_value=False)


def skips_padding() -> bool:
    """Whether calls traced now skip what the key mask removes."""
    return bool(_SKIPPING.value)


@contextlib.contextmanager
def skipping_padding(enabled: bool = True):
    """Calls of the op traced inside skip (or, `enabled=False`, visit) the
    key tiles and MSA rows their key mask removes; results are the same up
    to float32 rounding. The setting is part of JAX's jit cache key: a
    jitted function called inside is traced and compiled for it, whether or
    not it ran outside before (as is every other jitted function, once
    per value of the setting). With attention dropout the same masks give
    the same dropped weights: the forward and dk/dv then visit the rows
    that keep no key whole (their uniform weights are dropped too), the rest
    is skipped.

        with msa_pallas.skipping_padding():
            grads = jax.jit(jax.grad(loss))(params, batch)
    """
    with _SKIPPING(bool(enabled)):
        yield


def dead_rows(mask, n_res: int):
    """`[B, S]` bool: the rows that keep no key among the first `n_res`.
    (A reduction of its own, not `key_spans`' end == 0: XLA computes it in
    the spans' pass, as one more of its results, where a comparison on them
    would be a pass of its own.)"""
    return ~jnp.any(mask[..., :n_res] != 0, axis=-1)


def key_spans(mask, n_res: int):
    """`(from_first, end)`, each `[B, S]` int32: each row's span of kept keys,
    first <= key < end, with from_first = N - first; both 0 for a dead row.
    Both are maxima over the keys (the first key as N less it): two
    reductions over the mask that XLA fuses into one pass, with the mask's
    conversion for the kernels; `SpanReader` reads them.

    Args:
      mask: `[B, S, N']` (N' >= N; nonzero keeps a key; columns past N, the
        kernels' padding, are ignored).
      n_res: N.
    """
    keep = mask[..., :n_res] != 0
    index = lax.broadcasted_iota(jnp.int32, keep.shape, keep.ndim - 1)
    from_first = jnp.max(jnp.where(keep, n_res - index, 0), axis=-1)
    end = jnp.max(jnp.where(keep, index + 1, 0), axis=-1)
    return from_first, end


# The names of `live_extents`' four arrays among a kernel's operands.
EXTENT_NAMES = ("live_rows_from_first", "live_rows_end", "kept_keys_from_first", "kept_keys_end")


def live_extents(from_first, end):
    """Four `[B]` int32 arrays from `key_spans`: for each batch element,
    S - its first live row, its last live row + 1, N - the first key any of
    its rows keeps, and the last such key + 1; all 0 where every row is
    dead. Maxima over the rows, in one reduction (XLA's variadic reduce: one
    pass, where stacking them would be one more); `SpanReader` reads them."""
    rows = end.shape[1]
    row = lax.broadcasted_iota(jnp.int32, end.shape, 1)
    live = end > 0
    parts = (jnp.where(live, rows - row, 0), jnp.where(live, row + 1, 0), from_first, end)
    return lax.reduce(
        parts, (jnp.int32(0),) * 4,
        lambda xs, ys: tuple(jnp.maximum(x, y) for x, y in zip(xs, ys)), (1,),
    )


def span_operands(mask, n_res: int) -> dict:
    """A kernel's skipping inputs, by name: "key_from_first" and "key_end"
    (`key_spans`), and `EXTENT_NAMES` (`live_extents`)."""
    from_first, end = key_spans(mask, n_res)
    return {"key_from_first": from_first, "key_end": end,
            **dict(zip(EXTENT_NAMES, live_extents(from_first, end)))}


def tile_span(row_spans, *, n_res: int, block_k: int, dead_rows_whole: bool = False):
    """`(lb, ub)` int32: the key tiles lb <= t < ub that hold every key kept
    by the rows whose `key_spans` values are `row_spans` (a list of
    `(from_first, end)` int32 scalars, one row's or a row group's); (0, 0)
    where every row is dead, but for `dead_rows_whole`, which reads a dead
    row as one that keeps every key."""
    # The rows' span, as one row's: the largest of their N - first and of
    # their ends (a dead row's zeros leave both as they are).
    from_first, end = jnp.int32(0), jnp.int32(0)
    for row_from_first, row_end in row_spans:
        if dead_rows_whole:
            dead = row_end == 0
            row_from_first = jnp.where(dead, n_res, row_from_first)
            row_end = jnp.where(dead, n_res, row_end)
        from_first = jnp.maximum(from_first, row_from_first)
        end = jnp.maximum(end, row_end)
    upper = ceil_div(end, block_k)
    return jnp.minimum(lax.div(n_res - from_first, jnp.int32(block_k)), upper), upper


def rows_of_key_tile(extent, key_tile, block_k: int, *, rows: int, n_res: int,
                     queries=None):
    """`(first, end)` int32: the rows first <= row < end of a batch element
    whose `live_extents` values are `extent` (four int32 scalars) hold every
    row that keeps a key of key tile `key_tile`: its live rows where the
    tile meets the keys its rows keep, else (0, 0). `queries`: None, or
    `(start, size)`, a range of query residues where the mask masks queries
    too (`mask_queries`): (0, 0) also where no row keeps one of them."""
    from_first_row, end_row, from_first_key, end_key = extent

    def meets_kept(start, size):
        return (start < end_key) & (start + size > n_res - from_first_key)

    hit = meets_kept(key_tile * block_k, block_k)
    if queries is not None:
        hit &= meets_kept(*queries)
    return jnp.where(hit, rows - from_first_row, 0), jnp.where(hit, end_row, 0)


# Batch elements whose live rows `SpanReader.live_row_groups` reads one by
# one (independent loads, issued together); more are read in a loop.
_UNROLLED_BATCH = 8


class SpanReader:
    """A kernel's bounds from `key_spans` and `live_extents`, read at run
    time (int32 scalars; any backend whose refs index to scalars).

    Args:
      from_first, end, extents: the refs of `key_spans` (`[B, S]` each) and
        of `live_extents` (four `[B]`); `reads(operands)` takes them from a
        kernel's inputs by name.
      n_res: N.
      rows_per_group: the MSA rows one work item serves.
      dead_rows_whole: read a dead row as one that keeps every key (attention
        dropout: its dropped uniform weights have no shortcut).
    """

    def __init__(self, from_first, end, extents, *, n_res: int, rows_per_group: int = 1,
                 dead_rows_whole: bool = False):
        self.from_first, self.end, self.extents = from_first, end, extents
        self.n_res, self.rows_per_group = n_res, rows_per_group
        self.dead_rows_whole = dead_rows_whole

    @classmethod
    def reads(cls, operands, **options) -> "SpanReader | None":
        """The reader of a kernel's `operands` (a dict of refs) holding
        `span_operands`' names; None where they are absent."""
        if "key_end" not in operands:
            return None
        extents = tuple(operands[name] for name in EXTENT_NAMES)
        return cls(operands["key_from_first"], operands["key_end"], extents, **options)

    def key_tiles(self, batch, row_group, block_k: int):
        """`(lb, ub)`: the key tiles lb <= t < ub hold every key that the
        group's rows keep; lb = ub (no tile) for a group of dead rows."""
        rows = (row_group * self.rows_per_group + member for member in range(self.rows_per_group))
        return tile_span(
            [(self.from_first[batch, row], self.end[batch, row]) for row in rows],
            n_res=self.n_res, block_k=block_k, dead_rows_whole=self.dead_rows_whole,
        )

    def holds_queries(self, batch, row_group, query_tile, block_q: int):
        """Whether query tile `query_tile` (of `block_q` residues) holds a
        residue that a row of the group keeps: where the mask masks queries
        too (`mask_queries`), an item of a tile that holds none has every
        query masked, and its results are 0."""
        first, end = self.key_tiles(batch, row_group, block_q)
        return (first <= query_tile) & (query_tile < end)

    def live_row_groups(self, groups: int):
        """The row groups, of `groups`, up to the last that keeps a key in
        any batch element (all of them with `dead_rows_whole`): a kernel
        that serves groups in order gives those after it no work item."""
        if self.dead_rows_whole:
            return jnp.int32(groups)
        return ceil_div(self._largest(self.extents[1]), self.rows_per_group)

    def live_query_tiles(self, block_q: int):
        """The query tiles of `block_q` residues up to the last that holds a
        residue any row of any batch element keeps: where the mask masks
        queries too (`mask_queries`), every query after it is masked in
        every row, and a kernel that serves query tiles in order gives the
        tiles after it no work item. Not with `dead_rows_whole`."""
        return ceil_div(self._largest(self.extents[3]), block_q)

    @staticmethod
    def _largest(per_batch):
        """The largest of a `[B]` int32 ref's values (0 for none above it)."""
        batch_size = per_batch.shape[0]
        if batch_size <= _UNROLLED_BATCH:
            largest = jnp.int32(0)
            for batch in range(batch_size):
                largest = jnp.maximum(largest, per_batch[batch])
            return largest
        return lax.fori_loop(
            0, batch_size, lambda batch, largest: jnp.maximum(largest, per_batch[batch]),
            jnp.int32(0),
        )

    def rows_of_key_tile(self, batch, key_tile, block_k: int, queries=None):
        """`(first, end)`: the rows first <= row < end of batch element
        `batch` hold every row that keeps a key of key tile `key_tile`;
        (0, 0) where no row does (or, `queries` = (start, size) where the
        mask masks queries too, where no row keeps one of those queries)."""
        extent = [part[batch] for part in self.extents]
        return rows_of_key_tile(extent, key_tile, block_k, rows=self.end.shape[1],
                                n_res=self.n_res, queries=queries)


def ceil_div(x, divisor: int):
    """ceil(x / divisor) for int32 x >= 0 and a static divisor."""
    return lax.div(x + (divisor - 1), jnp.int32(divisor))
