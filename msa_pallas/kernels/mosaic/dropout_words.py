"""Attention dropout inside the Mosaic GPU kernels (`msa_pallas.dropout`'s
random bits): the operands' checks, a row's seed read from GMEM, the words
of a tile's queries or keys as a vector in a wgmma layout, and a tile's
keep mask from the two broadcast vectors.

The words hash the GLOBAL residue positions, so the mask does not depend on
tile sizes: the forward and each backward kernel, whatever their tiles and
orientation (queries along the wgmma rows or columns), draw the same
mask. Per tile a kernel computes one vector of words for its queries and
one for its keys (each at most a few hundred hashes, spread over the
warpgroup's threads); per weight only `dropout.keeps` and a select run.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas import dropout
from msa_pallas.kernels.mosaic.matmul import WGMMA_COL, WGMMA_ROW


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A kernel's static dropout settings: the uint32 keep threshold
    (`dropout.keep_threshold`) and the factor 1 / (1 - rate) the forward
    scales its kept weights' sum by (the backward kernels never scale)."""

    threshold: int
    scale: float

    @classmethod
    def of(cls, rate: float) -> Dropout | None:
        """The settings of `rate`; None for rate 0 (no dropout: the kernels
        trace exactly what they trace without these settings)."""
        if float(rate) == 0.0:
            return None
        return cls(threshold=int(dropout.keep_threshold(rate)), scale=1.0 / (1.0 - float(rate)))


def check_dropout(dropout_seeds, dropout_rate: float, q_shape, *, skips_masked: bool):
    """The kernels' `Dropout` settings for `dropout_rate` (None when it is 0),
    after checking its operands: `dropout_seeds` uint32 `[B, S, H]` for q of
    `q_shape` `[B, S, N, H, d]`, given when the rate is positive. Padding
    skipping with dropout is refused: a dead row's uniform weights are
    dropped too, so its shortcuts (the mean of v or of `do`) would be wrong."""
    settings = Dropout.of(dropout_rate)
    if settings is None:
        return None
    if dropout_seeds is None:
        raise ValueError(
            f"dropout_rate={dropout_rate!r} needs dropout_seeds (uint32 [B, S, H]); got None."
        )
    batch, rows, _, heads, _ = q_shape
    expected = (batch, rows, heads)
    if tuple(dropout_seeds.shape) != expected or dropout_seeds.dtype != jnp.uint32:
        raise ValueError(
            f"dropout_seeds has shape {tuple(dropout_seeds.shape)} and dtype "
            f"{dropout_seeds.dtype}; expected uint32 {expected} ([B, S, H] of q {tuple(q_shape)})."
        )
    if skips_masked:
        raise ValueError(
            "dropout with skip_masked=True (padding skipping) is not supported: a dead row's "
            "uniform weights are dropped too. Pass skip_masked=False."
        )
    return settings


def row_seed(seeds_ref, batch, row, head):
    """The uint32 seed of (batch, MSA row, head) from the `[B, S, H]` GMEM
    ref: one scalar load."""
    return seeds_ref[batch, row, head]


def position_words(words_of, seed, start, length: int, layout):
    """`words_of(seed, positions)` (`dropout.query_words` or
    `dropout.key_words`) of the `length` global positions from `start`
    (int32, the tile's first residue): uint32 `[length]` in `layout`
    (`matmul.WGMMA_ROW` or `WGMMA_COL`). Positions past N get words too;
    their weights are zero or their results dropped anyway."""
    offsets = plgpu.layout_cast(lax.broadcasted_iota(jnp.uint32, (length,), 0), layout)
    return words_of(seed, lax.convert_element_type(start, jnp.uint32) + offsets)


def query_words(seed, start, length: int, layout):
    """The words of a tile's queries (`position_words`)."""
    return position_words(dropout.query_words, seed, start, length, layout)


def key_words(seed, start, length: int, layout):
    """The words of a tile's keys (`position_words`)."""
    return position_words(dropout.key_words, seed, start, length, layout)


def kept(query_words_vector, key_words_vector, shape, query_axis: int, settings: Dropout):
    """Whether each weight of a `shape` tile (queries along `query_axis`) is
    kept: bool in the wgmma layout, from the two vectors broadcast to the
    tile (`dropout.keeps`)."""
    query = lax.broadcast_in_dim(query_words_vector, shape, [query_axis])
    key = lax.broadcast_in_dim(key_words_vector, shape, [1 - query_axis])
    return dropout.keeps(query, key, np.uint32(settings.threshold))


def dropped(x, keep):
    """`x` with the dropped weights' entries 0."""
    return jnp.where(keep, x, 0.0)


class HeadDropout:
    """The dropout of one consumer's tiles of one MSA row and `heads`
    consecutive heads (2 where a tile holds two heads of d = 8, each with
    its own seed), queries along the tiles' axis `query_axis` (0 in the
    forward, dq and dbias, 1 in dk/dv).

    A kernel computes the words of the positions it holds across its loop
    once (`query_words` / `key_words`: one vector per head) and the others
    per loop step, then `drop`s each step's tiles."""

    def __init__(self, settings: Dropout, seeds_ref, batch, row, first_head, heads: int,
                 query_axis: int = 0):
        self.settings, self.query_axis = settings, query_axis
        self.seeds = tuple(row_seed(seeds_ref, batch, row, first_head + h) for h in range(heads))
        # Each vector in the layout that broadcasts along its tile axis.
        self.query_layout, self.key_layout = (
            (WGMMA_ROW, WGMMA_COL) if query_axis == 0 else (WGMMA_COL, WGMMA_ROW)
        )

    def query_words(self, start, length: int) -> tuple:
        """Per head, the words of queries start <= i < start + length."""
        return tuple(query_words(s, start, length, self.query_layout) for s in self.seeds)

    def key_words(self, start, length: int) -> tuple:
        """Per head, the words of keys start <= j < start + length."""
        return tuple(key_words(s, start, length, self.key_layout) for s in self.seeds)

    def keep(self, head: int, query_words_per_head, key_words_per_head, shape):
        """Head `head`'s keep mask of a `shape` tile (`kept`)."""
        return kept(
            query_words_per_head[head], key_words_per_head[head], shape, self.query_axis,
            self.settings,
        )

    def keeps(self, query_words_per_head, key_words_per_head, shape) -> tuple:
        """Per head, the `shape` tile's keep mask (`kept`)."""
        return tuple(
            self.keep(h, query_words_per_head, key_words_per_head, shape)
            for h in range(len(self.seeds))
        )

    def drop(self, tiles, query_words_per_head, key_words_per_head) -> tuple:
        """`tiles` (one per head) with their dropped weights 0."""
        keeps = self.keeps(query_words_per_head, key_words_per_head, tiles[0].shape)
        return tuple(dropped(t, keep) for t, keep in zip(tiles, keeps))


def kept_sum_scale(row_sum, settings: Dropout | None):
    """The factor of the forward's output rows, 1 / row sum times 1 / (1 -
    rate) with dropout (exactly `1 / row_sum` without)."""
    if settings is None:
        return 1.0 / row_sum
    return settings.scale / row_sum
