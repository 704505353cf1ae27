"""Attention dropout inside the Mosaic GPU kernels (`msa_pallas.dropout`'s
random bits): the operands' checks, the word arrays the wrappers compute in
XLA, a tile's words loaded from them as a vector in a wgmma layout (from
GMEM, or through a pipeline's ring), and a tile's keep mask from the two
broadcast vectors.

The words hash the GLOBAL residue positions, so the mask does not depend on
tile sizes: the forward and each backward kernel, whatever their tiles and
orientation (queries along the wgmma rows or columns), draw the same mask.
No kernel hashes: each wrapper computes every row's query and key words
once per call in XLA (`word_operands`, uint32 `[B, S, H, N]` each, N
padded to whole tiles), and a kernel reads a tile's vector of words in the
layout it broadcasts in (in the wgmma layouts a column vector is
replicated: hashed in the kernel, every thread would hash a quarter of the
tile's words). Per weight only `dropout.keeps` and a select run.

The words a consumer uses for its whole loop are loaded from GMEM once
(`HeadDropout`). Those of each loop step ride the ring: the producer copies
them into the step's slot with its tiles (`copy_words_to_ring`) and the
consumer reads them after the step's products (`load_ring_words`), so they
take no registers across the products; loaded from GMEM at the start of
the step, they made the backward kernels spill (measured on the H200,
benchmarks/log/2026-12-04-09-dropout-tiles.md).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
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


def check_dropout(dropout_seeds, dropout_rate: float, q_shape):
    """The kernels' `Dropout` settings for `dropout_rate` (None when it is 0),
    after checking its operands: `dropout_seeds` uint32 `[B, S, H]` for q of
    `q_shape` `[B, S, N, H, d]`, given when the rate is positive."""
    if not dropout.check_kernel_arguments(dropout_seeds, dropout_rate, q_shape):
        return None
    return Dropout.of(dropout_rate)


def word_length(n_res: int, *spans: int) -> int:
    """The length of the word arrays a kernel reads: N rounded up so that
    every `span`-long slice it takes (from a multiple of `span`) is in
    bounds, for each of `spans` (its query and key tiles' lengths)."""
    return max(pl.cdiv(n_res, span) * span for span in spans)


def word_operands(dropout_seeds, length: int) -> dict:
    """The kernels' dropout operands, computed in XLA once per call:
    "query_words" and "key_words", uint32 `[B, S, H, length]`, the words of
    positions 0 <= i < `length` (`dropout.query_words` / `key_words`) of
    each row's seed in `dropout_seeds` `[B, S, H]` uint32. Positions past N
    (`word_length`'s padding) get words too; their weights are zero or
    their results dropped anyway."""
    positions = jnp.arange(length, dtype=jnp.uint32)
    seeds = dropout_seeds[..., None]
    return {
        "query_words": dropout.query_words(seeds, positions),
        "key_words": dropout.key_words(seeds, positions),
    }


def load_words(words_ref, batch, row, head, start, length: int, layout):
    """The words of positions start <= i < start + `length` of one (batch,
    MSA row, head), from a `[B, S, H, >= start + length]` GMEM ref
    (`word_operands`): uint32 `[length]` in `layout` (`matmul.WGMMA_ROW` or
    `WGMMA_COL`), one load."""
    # Mosaic GPU's optimized transfers are SMEM's alone; from GMEM each
    # thread loads its own words as vectors of the layout's length.
    return plgpu.load(
        words_ref.at[batch, row, head, pl.ds(start, length)], layout=layout, optimized=False
    )


def copy_words_to_ring(words_ref, slot_ref, batch, row, heads, positions, barrier):
    """Copies the words of `positions` (a `pl.ds`) of one (batch, MSA row)
    and the heads `heads` (a `pl.ds`) from a `[B, S, H, L]` GMEM ref
    (`word_operands`) into a ring slot's `[heads, >= length]` shared memory
    (`smem.smem_vectors`), on `barrier`: the loop step that reads them
    waits for them with its tiles."""
    plgpu.copy_gmem_to_smem(
        words_ref.at[batch, row, heads, positions],
        slot_ref.at[:, pl.ds(0, positions.size)], barrier,
    )


def load_ring_words(slot_ref, head: int, length: int, layout):
    """One head's words from a ring slot (`copy_words_to_ring`): uint32
    `[length]` in `layout`, read where they are used, so that they do not
    take registers across the step's products."""
    return plgpu.load(slot_ref.at[head, pl.ds(0, length)], layout=layout)


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
    its own words), queries along the tiles' axis `query_axis` (0 in the
    forward and dq, 1 in dk/dv). `gmem` holds "query_words" and
    "key_words" (`word_operands`).

    A kernel loads the words of the positions it holds across its loop once
    (`query_words` / `key_words`: one vector per head). The backward
    kernels take each step's others through the ring (`load_ring_words`);
    the forward, whose 64-key stages leave room for them, loads them per
    step, before the step's products so that the loads' latency hides
    behind them, then `drop`s each step's tiles."""

    def __init__(self, settings: Dropout, gmem, batch, row, first_head, heads: int,
                 query_axis: int = 0):
        self.settings, self.query_axis, self.heads = settings, query_axis, heads
        self.gmem, self.batch, self.row, self.first_head = gmem, batch, row, first_head
        # Each vector in the layout that broadcasts along its tile axis.
        self.query_layout, self.key_layout = (
            (WGMMA_ROW, WGMMA_COL) if query_axis == 0 else (WGMMA_COL, WGMMA_ROW)
        )

    def _words(self, name: str, start, length: int, layout) -> tuple:
        return tuple(
            load_words(
                self.gmem[name], self.batch, self.row, self.first_head + h, start, length, layout
            )
            for h in range(self.heads)
        )

    def query_words(self, start, length: int) -> tuple:
        """Per head, the words of queries start <= i < start + length."""
        return self._words("query_words", start, length, self.query_layout)

    def key_words(self, start, length: int) -> tuple:
        """Per head, the words of keys start <= j < start + length."""
        return self._words("key_words", start, length, self.key_layout)

    def keeps(self, query_words_per_head, key_words_per_head, shape) -> tuple:
        """Per head, the `shape` tile's keep mask (`kept`)."""
        return tuple(
            kept(query_words, key_words, shape, self.query_axis, self.settings)
            for query_words, key_words in zip(query_words_per_head, key_words_per_head,
                                              strict=True)
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
