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
