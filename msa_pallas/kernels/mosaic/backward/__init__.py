"""The Mosaic GPU backward kernels: Hopper (sm90), 16-bit inputs.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics, so no `[S, H, N, N]` array exists; the kernels
own disjoint outputs, so no atomics are used and two runs give bitwise
identical gradients. All are warp-specialised as the forward is
(`pipeline.produce`: a producer warpgroup streams each loop step's tiles by TMA
into a shared-memory ring; consumer warpgroups compute with `wgmma`).

One file per kernel, each holding the kernel and its wrapper: dkdv.py, dq.py,
dbias.py; operands.py what they share. Their plans are in `plan`, their
default tiles (`default_tiles`) in `tiles`.

- dk/dv (`backward_dkdv`): one CTA per key tile of one head for `msa_rows`
  MSA rows, looping over query tiles. Each consumer warpgroup owns one row's
  K and V tile and works in the transposed orientation, keys along the wgmma
  rows: `s^T = k q^T` and `dp^T = v do^T` from shared memory, then
  `dv += p^T do` and `dk += ds^T q` with `p^T` and `ds^T` straight from
  registers. Per query tile the producer loads the rows' q and do tiles and
  row statistics and ONE tile of the transposed bias, shared by the rows
  (`bias^T` is made once per call: B·H·N² elements against the kernel's
  B·S·H·N² logits).
- dq (`backward_dq`): one CTA per query tile of one head for `msa_rows`
  rows, looping over key tiles, the forward's loop with `dp = do v^T`,
  `ds = p (dp - delta)` and `dq += ds k` in place of the online softmax.
- dbias (`backward_dbias`): one CTA per (query tile, key tile) of one head,
  looping over the S MSA rows (or a chunk of them); its two consumer
  warpgroups split the query tile, and the sum over S stays in registers.

d = 8 with an even H, 16-bit (`tile_heads`): the kernels read q, k, v and
`do` as they are, heads 2h and 2h + 1 in one 16-wide tile
(`heads.pairs_heads`). dk/dv and dq take a CTA per pair of heads: the
tiles they hold across the loop (K and V, q and do) get one copy per head
with the other head's columns zeroed, each loop step runs the two heads
one after the other (each its own bias tile, statistics and accumulator),
and each head's columns of the result come from its own accumulator.
dbias sums one head over the chunk's rows, then the other, multiplying
q and do from registers with the other head's columns zeroed. Other
d < 16 (and float32 d = 8) are zero-padded to 16 by the caller.

float32 inputs (d <= 64): q, k, v and `do` enter as three bf16 pieces each
(`matmul.split_float32`, one XLA pass), `p` and `ds` are split in registers,
and every product is the sum of six bf16 `wgmma` products
(`matmul.piece_pairs`), each loop step's added to the running sum in float32;
the float32 gradients leave through float32 tiles of their own.

Inputs shared by all: q, k, v and `do` (the cotangent of the ungated
output, in q's dtype) `[B, S, N, H, d]`; bias `[B, H, N, N]` 16- or 32-bit;
mask `[B, S, N]` int8 or None; `stats` `[B, S, H, 3, N]` float32: the
forward's row max and log2 row sum (base 2) and `delta = sum_d do * o`.

N need not be a whole number of tiles (`support.supports`): tiles that run
past N read zeros (TMA), which give a zero gradient contribution wherever
they meet real residues (a zero `q` / `do` row, a zero statistic; keys past
N get `ds = 0` in dq), and the stores of q's layout and of the bias
gradient drop what lies past N. As in the forward, only the bias and mask
rows (and the bias gradient's) are padded, to whole TMA rows
(`support.pad_residues`). N need not be a multiple of 8 where
`support.takes_any_n` (d <= 64): the tiles of q, k, v and `do` (and the
gradients leaving through them; for float32 inputs each bf16 piece, and the
float32 gradients' tiles, at d = 64 as two column pieces) are then pairs of
views (`smem.unaligned_row_tile`), TMA copying through the untiled one; the
bias's rows are padded to a multiple of 8 (`support.pad_bias_rows`), the
statistics to whole 16-byte rows, and the bias gradient's rows are
allocated to a multiple of 8 and sliced.

Attention dropout (`dropout_seeds`, `dropout_rate` > 0; `dropout_words`):
each wrapper computes the words of the rows' global positions from the
seeds in XLA, its kernel regenerates the forward's mask from a tile's
vectors of them (one load each), and `operands.recompute` gives `ds = p
(keep dp - delta)` and dv's weights `p keep`; `do` and delta come scaled
by the vjp, so no kernel divides by 1 - rate.

Padding (`kernels.key_tiles`): every kernel's loop runs between bounds
read at run time (`lb`, `ub` in dq and dk/dv, the row range in dbias),
the ring's slots counted from the loop's first step (`pipeline.produce`,
`pipeline.ring_slot`). With a mask the wrappers compute them from it
(int32 inputs, a pass over the mask in XLA): dq visits the key tiles that
hold its row group's kept keys; dk/dv runs its query loop only where a row
of the group keeps a key of its key tile, and a dead row there takes the
mean of its `do` as dv (`triton.dead_rows.dead_row_means`, which reads
dead rows alone, or the caller's, `triton.backward_prologue`; with dropout, which drops a dead row's uniform weights
too, a dead row's query loops run as for a row keeping every key); dbias
sums the rows between the first and the last that keep a key of its key
tile, shared out among its row chunks. What is left out adds exactly 0,
so the results are bitwise those of every tile, but for the dead rows' dv
without dropout (the mean against the uniform weights' sum, equal to
rounding) and the bias gradient where its rows are chunked (the chunks'
partial sums group the rows otherwise).
`skip_masked=False` visits every tile (the tests' unskipped kernels);
without a mask nothing of this is traced.
"""

from __future__ import annotations

from msa_pallas.kernels.mosaic.backward.dbias import backward_dbias
from msa_pallas.kernels.mosaic.backward.dkdv import backward_dkdv
from msa_pallas.kernels.mosaic.backward.dq import backward_dq
from msa_pallas.kernels.mosaic.heads import tile_heads
from msa_pallas.kernels.mosaic.tiles import backward_tiles as default_tiles

__all__ = ["backward_dbias", "backward_dkdv", "backward_dq", "default_tiles", "tile_heads"]


