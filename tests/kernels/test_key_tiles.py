"""The mask summary the kernels skip padding by (`msa_pallas.kernels.key_tiles`), and
the bounds the kernels derive from it at run time, against a direct NumPy reading of
the same masks: each row's span of kept keys, dead rows, each batch element's live rows,
each row group's key tiles (dead rows skipped, or read whole as with dropout), the row
groups that have work items, and each key tile's rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from msa_pallas.kernels import key_tiles


def random_padded_mask(rng, batch, rows, n_res, group) -> np.ndarray:
    """`[B, S, N]` bool: random holes, a padded end of residues and of rows that differs
    by batch element (at least the last group of `group` rows dead in each), a dead row
    in the middle."""
    keep = rng.random((batch, rows, n_res)) >= 0.3
    for b in range(batch):
        keep[b, :, rng.integers(n_res // 2, n_res + 1):] = False
        keep[b, rng.integers(1, rows - group + 1):] = False
    keep[:, rows // 2] = False
    return keep


def bounds_of(kept: np.ndarray) -> tuple[int, int]:
    """(first, last + 1) of the True entries of a vector; (0, 0) where there are none."""
    where = np.flatnonzero(kept)
    return (int(where[0]), int(where[-1]) + 1) if where.size else (0, 0)


def kept_tiles(keep: np.ndarray, block_k: int) -> np.ndarray:
    """`[B, S, T]`: whether each key tile of each row keeps a key."""
    batch, rows, n_res = keep.shape
    tiles = -(-n_res // block_k)
    padded = np.pad(keep, ((0, 0), (0, 0), (0, tiles * block_k - n_res)))
    return padded.reshape(batch, rows, tiles, block_k).any(-1)


def as_kernel_mask(keep: np.ndarray) -> jnp.ndarray:
    """The int8 mask as the kernels read it: wider than N (their padded copy), the
    columns past N kept, which must neither make a row live nor matter."""
    batch, rows, _ = keep.shape
    wide = np.concatenate([keep, np.ones((batch, rows, 8), bool)], axis=-1)
    return jnp.asarray(wide.astype(np.int8))


def span_reader(mask, n_res, group, dead_rows_whole=False):
    """A `SpanReader` over the arrays the kernels read (concrete arrays index as
    their refs do)."""
    return key_tiles.SpanReader.reads(
        key_tiles.span_operands(mask, n_res), n_res=n_res, rows_per_group=group,
        dead_rows_whole=dead_rows_whole,
    )


def ints(values) -> tuple[int, ...]:
    return tuple(int(x) for x in values)


CASES = [  # (B, S, N, block_k, rows per group)
    (1, 8, 256, 64, 2),
    (2, 6, 200, 128, 2),  # N no whole number of tiles
    (3, 5, 72, 64, 1),
]


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
def test_spans_and_extents_match_the_mask(batch, rows, n_res, block_k, group, seed):
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    mask = as_kernel_mask(keep)

    from_first, ends = (np.asarray(x) for x in key_tiles.key_spans(mask, n_res))
    for x in (from_first, ends):
        assert x.dtype == np.int32 and x.shape == (batch, rows)
    for b in range(batch):
        for s in range(rows):
            first, end = bounds_of(keep[b, s])
            expected = (n_res - first, end) if end else (0, 0)
            assert (from_first[b, s], ends[b, s]) == expected, (b, s)
    np.testing.assert_array_equal(key_tiles.dead_rows(mask, n_res), ~keep.any(-1))

    parts = key_tiles.live_extents(jnp.asarray(from_first), jnp.asarray(ends))
    extents = np.stack([np.asarray(x) for x in parts], axis=-1)
    assert extents.dtype == np.int32 and extents.shape == (batch, 4)
    for b in range(batch):
        first_row, end_row = bounds_of(keep[b].any(-1))
        first_key, end_key = bounds_of(keep[b].any(0))
        assert ints(extents[b]) == (rows - first_row, end_row, n_res - first_key, end_key), b


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
@pytest.mark.parametrize("dead_rows_whole", [False, True], ids=["skip-dead", "dead-whole"])
def test_row_groups_key_tiles(batch, rows, n_res, block_k, group, dead_rows_whole, seed):
    """Each row group's key tiles run from the first to the last tile that keeps a key
    in any of its rows, (0, 0) for a group of dead rows; read whole (dropout), a dead
    row keeps every tile. The live row groups run up to the last group that keeps a key
    in any batch element (dead groups in the middle count); read whole, all of them."""
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    tiles = kept_tiles(keep, block_k)
    if dead_rows_whole:
        tiles[~keep.any(-1)] = True
    by_group = tiles.reshape(batch, rows // group, group, -1).any(2)
    reader = span_reader(as_kernel_mask(keep), n_res, group, dead_rows_whole)
    for b in range(batch):
        for g in range(rows // group):
            got = ints(reader.key_tiles(b, g, block_k))
            assert got == bounds_of(by_group[b, g]), (b, g)
    live_groups = by_group.any(-1)
    expected = max(bounds_of(live_groups[b])[1] for b in range(batch))
    assert int(reader.live_row_groups(rows // group)) == expected
    # The Triton kernels' per-row reading of the same spans.
    from_first, ends = key_tiles.key_spans(as_kernel_mask(keep), n_res)
    for b in range(batch):
        for s in range(rows):
            got = ints(key_tiles.tile_span([(from_first[b, s], ends[b, s])], n_res=n_res,
                                           block_k=block_k, dead_rows_whole=dead_rows_whole))
            assert got == bounds_of(tiles[b, s]), (b, s)


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
def test_key_tiles_rows(batch, rows, n_res, block_k, group, seed):
    """A key tile's rows (the bias gradient's row loop): the batch element's live rows
    where some row keeps a key between the first and the last kept key of the batch
    element, so that they hold every row that keeps a key of the tile; else none."""
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    tiles = kept_tiles(keep, block_k)
    reader = span_reader(as_kernel_mask(keep), n_res, group)
    for b in range(batch):
        live_rows = bounds_of(keep[b].any(-1))
        first_key, end_key = bounds_of(keep[b].any(0))
        for t in range(tiles.shape[-1]):
            got = ints(reader.rows_of_key_tile(b, t, block_k))
            inside = end_key > 0 and t * block_k < end_key and (t + 1) * block_k > first_key
            assert got == (live_rows if inside else (0, 0)), (b, t)
            tight_first, tight_end = bounds_of(tiles[b, :, t])
            if tight_end:
                assert got[0] <= tight_first and tight_end <= got[1], (b, t)


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
def test_query_tiles_where_queries_are_masked(batch, rows, n_res, block_k, group, seed):
    """Where the mask masks queries too, a query tile of a row group holds a kept
    residue of its rows exactly when it lies between their first and last kept one
    (`holds_queries`), and a key tile's rows for a range of queries are none where no
    row of the batch element keeps one of those queries (the bias gradient's CTAs)."""
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    reader = span_reader(as_kernel_mask(keep), n_res, group)
    block_q = block_k
    query_tiles = -(-n_res // block_q)
    for b in range(batch):
        for g in range(rows // group):
            first, end = bounds_of(keep[b, g * group:(g + 1) * group].any(0))
            for t in range(query_tiles):
                expected = end > 0 and t * block_q < end and (t + 1) * block_q > first
                assert bool(reader.holds_queries(b, g, t, block_q)) == expected, (b, g, t)
        live_rows = bounds_of(keep[b].any(-1))
        first_key, end_key = bounds_of(keep[b].any(0))
        for start, size in ((0, block_q), (first_key, 1), (end_key, 2 * block_q)):
            got = ints(reader.rows_of_key_tile(b, 0, n_res, queries=(start, size)))
            meets = end_key > 0 and start < end_key and start + size > first_key
            assert got == (live_rows if meets else (0, 0)), (b, start, size)
    # The forward serves the query tiles up to the last that any row keeps a
    # residue of: every tile after it is masked in every row and batch element.
    last_kept = max(bounds_of(keep[b].any(0))[1] for b in range(batch))
    assert int(reader.live_query_tiles(block_q)) == -(-last_kept // block_q)
    assert not any(bool(reader.holds_queries(b, g, t, block_q))
                   for b in range(batch) for g in range(rows // group)
                   for t in range(int(reader.live_query_tiles(block_q)), query_tiles))


def test_end_padding_gives_the_tight_rows():
    """Padding at the end of a crop and of an alignment, or keys kept from a tile's
    start on (no holes): each key tile's rows are exactly the rows that keep a key of
    it."""
    batch, rows, n_res, block_k = 2, 8, 200, 64
    keep = np.zeros((batch, rows, n_res), bool)
    keep[0, :5, :130] = True
    keep[1, :3, 64:128] = True
    tiles = kept_tiles(keep, block_k)
    reader = span_reader(jnp.asarray(keep.astype(np.int8)), n_res, 1)
    for b in range(batch):
        for t in range(tiles.shape[-1]):
            assert ints(reader.rows_of_key_tile(b, t, block_k)) == bounds_of(tiles[b, :, t])
    assert int(reader.live_row_groups(rows)) == 5


def test_no_live_row_gives_empty_bounds():
    mask = jnp.zeros((2, 4, 64), jnp.int8)
    reader = span_reader(mask, 64, 2)
    assert not any(np.asarray(x).any() for x in key_tiles.live_extents(*key_tiles.key_spans(mask, 64)))
    assert ints(reader.key_tiles(1, 1, 64)) == (0, 0)
    assert int(reader.live_row_groups(2)) == 0
    assert int(reader.live_query_tiles(32)) == 0
    assert ints(reader.rows_of_key_tile(0, 0, 64)) == (0, 0)
    whole = span_reader(mask, 64, 2, dead_rows_whole=True)
    assert ints(whole.key_tiles(1, 1, 32)) == (0, 2)
    assert int(whole.live_row_groups(2)) == 2


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bool_])
def test_any_mask_dtype(dtype):
    keep = np.zeros((1, 3, 40), bool)
    keep[0, 0, 5:17] = True
    keep[0, 1, 30] = True
    from_first, ends = key_tiles.key_spans(jnp.asarray(keep.astype(dtype)), 40)
    assert ints(from_first[0]) == (35, 10, 0) and ints(ends[0]) == (17, 31, 0)


@pytest.mark.parametrize("batch", [3, 11])  # read one by one, and in a loop
def test_live_row_groups_and_query_tiles_over_many_batch_elements(batch, seed):
    rng = np.random.default_rng(seed)
    rows, n_res = 12, 32
    keep = np.zeros((batch, rows, n_res), bool)
    ends = rng.integers(0, rows + 1, batch)
    for b, end in enumerate(ends):
        keep[b, :end, : rng.integers(1, n_res + 1)] = True
    reader = span_reader(jnp.asarray(keep.astype(np.int8)), n_res, 2)
    assert int(reader.live_row_groups(rows // 2)) == -(-int(ends.max()) // 2)
    last_kept = max(bounds_of(keep[b].any(0))[1] for b in range(batch))
    assert int(reader.live_query_tiles(8)) == -(-last_kept // 8)
