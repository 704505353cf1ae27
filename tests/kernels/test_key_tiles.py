"""The mask summaries the kernels skip padding by (`msa_pallas.kernels.key_tiles`),
against a direct NumPy reading of the same masks: key tiles kept per row, dead rows,
each row group's key-tile bounds, each key tile's row bounds, and the row groups that
have work items."""

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


CASES = [  # (B, S, N, block_k, rows per group)
    (1, 8, 256, 64, 2),
    (2, 6, 200, 128, 2),  # N no whole number of tiles
    (3, 5, 72, 64, 1),
]


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
def test_summaries_match_the_mask(batch, rows, n_res, block_k, group, seed):
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    # A mask wider than N (the kernels' padded copy): columns past N are ignored.
    wide = np.concatenate([keep, np.ones((batch, rows, 8), bool)], axis=-1)
    mask = jnp.asarray(wide.astype(np.int8))
    tiles = -(-n_res // block_k)
    padded = np.pad(keep, ((0, 0), (0, 0), (0, tiles * block_k - n_res)))
    kept = padded.reshape(batch, rows, tiles, block_k).any(-1)

    np.testing.assert_array_equal(key_tiles.kept_key_tiles(mask, n_res, block_k), kept)
    np.testing.assert_array_equal(key_tiles.dead_rows(mask, n_res), ~keep.any(-1))

    groups = kept.reshape(batch, rows // group, group, tiles).any(2)
    bounds = np.asarray(key_tiles.key_tile_bounds(mask, n_res, block_k, group))
    assert bounds.dtype == np.int32
    for b in range(batch):
        for g in range(rows // group):
            assert tuple(bounds[b, g]) == bounds_of(groups[b, g]), (b, g)

    by_tile = np.asarray(key_tiles.row_bounds(mask, n_res, block_k))
    for b in range(batch):
        for t in range(tiles):
            assert tuple(by_tile[b, t]) == bounds_of(kept[b, :, t]), (b, t)

    # Up to the last live group of any batch element; dead groups in the middle count.
    live_groups = groups.any(-1)
    expected = max((bounds_of(live_groups[b])[1] for b in range(batch)), default=0)
    visited = key_tiles.visited_row_groups(key_tiles.key_tile_bounds(mask, n_res, block_k, group))
    assert visited.shape == (1,) and visited.dtype == jnp.int32
    assert int(visited[0]) == expected


def test_no_live_row_visits_no_group():
    mask = jnp.zeros((2, 4, 64), jnp.int8)
    bounds = key_tiles.key_tile_bounds(mask, 64, 64, 2)
    assert not np.asarray(bounds).any()
    assert int(key_tiles.visited_row_groups(bounds)[0]) == 0


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bool_])
def test_kept_whole_dead_rows(dtype, seed):
    """With dropout the forward and dk/dv visit dead rows whole: their summary's
    mask keeps every key of a dead row, and is the mask elsewhere (live rows'
    masked tiles still skipped), in the mask's dtype and width."""
    batch, rows, n_res = 2, 6, 100
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, 2)
    dead = ~keep.any(-1)
    assert dead.any() and (~dead).any()
    # Columns past N (the kernels' padded copy) neither make a row live nor matter.
    wide = np.concatenate([keep, np.ones((batch, rows, 8), bool)], axis=-1)
    whole = np.asarray(key_tiles.kept_whole_dead_rows(jnp.asarray(wide.astype(dtype)), n_res))
    assert whole.dtype == np.dtype(dtype) and whole.shape == wide.shape
    np.testing.assert_array_equal(whole[dead] != 0, np.ones((dead.sum(), n_res + 8), bool))
    np.testing.assert_array_equal(whole[~dead], wide[~dead].astype(dtype))
    bounds = np.asarray(key_tiles.key_tile_bounds(jnp.asarray(whole), n_res, 32, 1))
    assert (bounds[dead] == (0, 4)).all() and (bounds[..., 1] > 0).all()


def span_reader(mask, n_res, group, dead_rows_whole=False):
    """A `SpanReader` over the arrays the Mosaic kernels read (concrete arrays
    index as their refs do)."""
    return key_tiles.SpanReader.reads(
        key_tiles.span_operands(mask, n_res), n_res=n_res, rows_per_group=group,
        dead_rows_whole=dead_rows_whole,
    )


@pytest.mark.parametrize("batch, rows, n_res, block_k, group", CASES)
def test_spans_give_the_tile_summaries(batch, rows, n_res, block_k, group, seed):
    """What the Mosaic kernels derive at run time from the rows' spans of kept keys
    (`key_spans`, `live_extents`, `SpanReader`): each row group's key tiles and the
    live row groups as the tile summaries give them, with and without dead rows read
    as whole; each key tile's rows, a range that holds the rows keeping a key of it
    and no row outside the batch element's live ones."""
    keep = random_padded_mask(np.random.default_rng(seed), batch, rows, n_res, group)
    wide = np.concatenate([keep, np.ones((batch, rows, 8), bool)], axis=-1)
    mask = jnp.asarray(wide.astype(np.int8))
    tiles = -(-n_res // block_k)

    from_first, ends = (np.asarray(x) for x in key_tiles.key_spans(mask, n_res))
    for x in (from_first, ends):
        assert x.dtype == np.int32 and x.shape == (batch, rows)
    for b in range(batch):
        for s in range(rows):
            first, end = bounds_of(keep[b, s])
            expected = (n_res - first, end) if end else (0, 0)
            assert (from_first[b, s], ends[b, s]) == expected, (b, s)
    np.testing.assert_array_equal(key_tiles.dead_rows(mask, n_res), ~keep.any(-1))

    whole = key_tiles.kept_whole_dead_rows(mask, n_res)
    for dead_rows_whole, summarised in ((False, mask), (True, whole)):
        reader = span_reader(mask, n_res, group, dead_rows_whole)
        bounds = np.asarray(key_tiles.key_tile_bounds(summarised, n_res, block_k, group))
        for b in range(batch):
            for g in range(rows // group):
                got = tuple(int(x) for x in reader.key_tiles(b, g, block_k))
                assert got == tuple(bounds[b, g]), (dead_rows_whole, b, g)
        expected = int(key_tiles.visited_row_groups(jnp.asarray(bounds))[0])
        assert int(reader.live_row_groups(rows // group)) == expected

    reader = span_reader(mask, n_res, group)
    by_tile = np.asarray(key_tiles.row_bounds(mask, n_res, block_k))
    for b in range(batch):
        live_rows = bounds_of(keep[b].any(-1))
        for t in range(tiles):
            first, end = (int(x) for x in reader.rows_of_key_tile(b, t, block_k))
            tight_first, tight_end = by_tile[b, t]
            if tight_end == 0:
                assert (first, end) in ((0, 0), live_rows), (b, t)
            else:
                assert first <= tight_first and tight_end <= end, (b, t)
                assert (first, end) == live_rows, (b, t)


def test_spans_of_end_padding_are_the_tight_summaries():
    """Padding at the end of a crop and of an alignment (no holes): each key tile's
    rows from the spans are exactly the rows that keep a key of it."""
    batch, rows, n_res, block_k = 2, 8, 200, 64
    keep = np.zeros((batch, rows, n_res), bool)
    keep[0, :5, :130] = True
    keep[1, :3, :64] = True
    mask = jnp.asarray(keep.astype(np.int8))
    reader = span_reader(mask, n_res, 1)
    by_tile = np.asarray(key_tiles.row_bounds(mask, n_res, block_k))
    for b in range(batch):
        for t in range(-(-n_res // block_k)):
            got = tuple(int(x) for x in reader.rows_of_key_tile(b, t, block_k))
            assert got == tuple(by_tile[b, t]), (b, t)
    assert int(reader.live_row_groups(rows)) == 5


def test_no_live_row_gives_empty_spans():
    mask = jnp.zeros((2, 4, 64), jnp.int8)
    reader = span_reader(mask, 64, 2)
    assert not np.asarray(key_tiles.live_extents(*key_tiles.key_spans(mask, 64))).any()
    assert tuple(int(x) for x in reader.key_tiles(1, 1, 64)) == (0, 0)
    assert int(reader.live_row_groups(2)) == 0
    assert tuple(int(x) for x in reader.rows_of_key_tile(0, 0, 64)) == (0, 0)
