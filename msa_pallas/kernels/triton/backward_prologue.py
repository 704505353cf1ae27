"""What the Mosaic backward kernels read besides q, k, v and the bias, made
in one Pallas (Triton) kernel: the cotangent of the ungated output `do`,
the gate's gradient, the stacked row statistics and, where padding is
skipped, the dv of rows whose keys are all masked.

Written in XLA (`vjp`), the gate's backward and delta take one pass over
every row, and the statistics' stack into one `[B, S, H, 3, N]` array (one
TMA copy per tile in the kernels) a second. Skipping padding
(`key_tiles.skipping_padding`), the Mosaic forward leaves the residuals of
dead rows (MSA rows that keep no key) as its kernel left them and gives
their mean of v instead (`dead_rows.fill_dead_rows`; SPEC §1: a dead row's
weights are uniform over its N keys); XLA then reads every row's float32
attention output through a select on those means, selects dead rows'
statistics to those of uniform weights in the stack, and a third launch
reads the dead rows' `do` again for their dv (`dead_rows.dead_row_means`).

This kernel is one launch that reads each row once, and a dead row's
float32 attention output not at all. A program serves one MSA row and a
slice of its heads (whole heads: delta is a sum over each head's d
columns) and loops over the row's residues, or, where no dead row's dv is
made, over a chunk of them, so that a launch over few rows has programs
enough (`_MIN_PROGRAMS`) to keep the memory busy:

- a live row: `do = round(dout * sigmoid(g))` (rounded to q's dtype, as the
  kernels multiply it), `dgate = dout * o * sigmoid(g) * (1 - sigmoid(g))`,
  `delta = sum_d do * o`, and the forward's row max and log2 sum copied
  beside delta;
- a dead row (where the caller tells them, skipping): the same with o its
  mean of v (one vector), the row max the masked logit and the log2 sum
  log2(N) (uniform weights, base 2), and its dv, the mean over residues of
  `do`, summed on the way. A dead row that no backward kernel reads (one
  in a group of rows after the last group that keeps a key: padding rows
  at the end of the alignment, whose work items load nothing) gets its
  gate's gradient and dv alone: its `do` and statistics would be written
  for nobody.

Without a gate `do` is the cotangent itself (in q's dtype), not written
again; only the statistics (and the dead rows' dv) are.

Masking queries (`query_mask`: the key mask masks queries too, the op's
output is 0 at a masked residue and no gradient flows from it), the
cotangent is taken as 0 at a masked residue: a live row's there get do,
dgate and delta 0, selected (their dout, gate and o are loaded but may
hold anything), a row max above every logit and a log2 sum of 0 (the
forward may have skipped the residue's query tile and left it no
statistics: with these its weights are 0 in every kernel that visits it),
and `do` is written even without a gate, since it is no longer the
cotangent. A dead row's queries are all masked: nothing of it
is read (no means are made), its gate's gradient and, where a kernel reads
them, its `do` are 0 and its statistics those of uniform weights with delta
0; its dv is 0, so no dead rows' dv is made. Padding rows then cost only
writes.

The results are the XLA passes' up to the order of float32 sums (delta over
d, the dead rows' mean over N) and the last bit of the sigmoid.
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas.block_sizes import next_power_of_2
from msa_pallas.kernels.constants import MASKED_LOGIT_LOG2, MASKED_QUERY_ROW_MAX_LOG2
from msa_pallas.kernels.key_tiles import ceil_div
from msa_pallas.kernels.triton import common

# Elements of a `[residues, columns]` tile a program loads at once; the
# widest slice of a row's columns a program serves (256 bytes of a bf16
# row); the launch.
_TILE_ELEMENTS = 4096
_MAX_COLUMNS = 128
# Where no row's sum over its residues is made (no dead rows' dv), a row's
# residues are split among programs until the launch has this many: with one
# program per row slice a short alignment's launch (the training crop's 128
# rows) has too few loads in flight to stream at the memory's rate.
_MIN_PROGRAMS = 2048
_LAUNCH = collections.namedtuple("Launch", "num_warps num_stages")(num_warps=4, num_stages=2)


def heads_per_program(heads: int, head_dim: int) -> int:
    """Heads of a program's column slice: the largest power of two that
    divides H with at most `_MAX_COLUMNS` columns (at least one head)."""
    per_program = heads & -heads
    while per_program > 1 and per_program * head_dim > _MAX_COLUMNS:
        per_program //= 2
    return per_program


def _check(dout, gate, attention, means, row_max, row_log2_sum, key_end, live_rows_end,
           n_res, query_mask=None):
    batch, rows, n_tokens, heads, head_dim = dout.shape
    if n_tokens != n_res or head_dim != next_power_of_2(head_dim):
        raise ValueError(
            f"dout {dout.shape}: expected [B, S, N={n_res}, H, d] with d a power of two"
        )
    if gate is not None and gate.shape != dout.shape:
        raise ValueError(f"gate {gate.shape}: expected {dout.shape}")
    if attention.shape != dout.shape or attention.dtype != jnp.float32:
        raise ValueError(f"attention {attention.shape} {attention.dtype}: expected "
                         f"{dout.shape} float32")
    for name, plane in (("row_max", row_max), ("row_log2_sum", row_log2_sum)):
        if plane.shape[:3] != (batch, rows, heads) or plane.shape[3] < n_res:
            raise ValueError(f"{name} {plane.shape}: expected [B, S, H, N' >= {n_res}]")
    if query_mask is not None:
        # A dead row's queries are all masked: nothing of it is read, its
        # means least of all; key_end alone tells it apart.
        if means is not None or key_end is None:
            raise ValueError("query_mask: dead rows are told by key_end alone (means None, "
                             "key_end given): nothing of them is read")
        if (query_mask.ndim != 3 or query_mask.shape[:2] != (batch, rows)
                or query_mask.shape[2] < n_res or query_mask.dtype != jnp.int8):
            raise ValueError(f"query_mask {query_mask.shape} {query_mask.dtype}: expected "
                             f"[B={batch}, S={rows}, N' >= {n_res}] int8")
    else:
        if (means is None) != (key_end is None):
            raise ValueError(
                "means and key_end: both (dead rows told apart) or neither (none)")
        if means is None:
            if live_rows_end is not None:
                raise ValueError(
                    "live_rows_end tells dead rows apart: it needs means and key_end")
            return
        if means.shape != (batch, rows, heads, head_dim) or means.dtype != jnp.float32:
            raise ValueError(f"means {means.shape} {means.dtype}: expected "
                             f"{(batch, rows, heads, head_dim)} float32")
    if key_end.shape != (batch, rows):
        raise ValueError(f"key_end {key_end.shape}: expected {(batch, rows)}")
    if live_rows_end is not None and live_rows_end.shape != (batch,):
        raise ValueError(f"live_rows_end {live_rows_end.shape}: expected {(batch,)}")


def _prologue_kernel(
    end_ref, live_end_ref, dout_ref, gate_ref, attention_ref, means_ref, row_max_ref,
    row_log2_sum_ref, query_mask_ref, do_ref, dgate_ref, stats_ref, dead_dv_ref, *, n_res: int,
    heads: int, head_dim: int, block: int, do_dtype, rows_per_group: int, chunk_tiles: int,
):
    """One MSA row's column slice (`heads` heads of `head_dim` columns),
    its tiles of `block` residues from `chunk_tiles` * the grid's fourth
    index on, `chunk_tiles` of them (all the row's where dead_dv is made):
    refs `[N, width]` (dout, gate, attention, do, dgate), `[width]` (means,
    dead_dv), `[heads, N']` (the row statistics), `[N']` int8 (query_mask),
    `[heads, 3, N]` (stats), the scalar `end_ref` (the row's
    `key_tiles.key_spans` end: 0 for a dead row), the scalar `live_end_ref`
    (the batch element's `live_rows_end`). `gate_ref` is None without a
    gate, `do_ref` without a gate or a query mask; `end_ref` where no row
    is told dead; `means_ref` and `dead_dv_ref` where no row is told dead or
    queries are masked; `query_mask_ref` where they are not; `live_end_ref`
    where every dead row is read."""
    width = heads * head_dim
    every_head = pl.ds(common.index(0), heads)
    tiles = pl.cdiv(n_res, block)
    # This program's tiles: first_tile <= tile < end_tile.
    if chunk_tiles >= tiles:
        first_tile, end_tile = 0, tiles
    else:
        first_tile = pl.program_id(3) * chunk_tiles
        end_tile = jnp.minimum(first_tile + chunk_tiles, tiles)

    def stats_in_range(start):
        """`[heads, block]` bool: the statistics' columns below N."""
        in_range = common.residue_ids(start, block) < n_res
        return jnp.broadcast_to(in_range[None, :], (heads, block))

    def gate_backward(start, ungated, store_do=True):
        """`(do, delta)` of the tile at `start` (do float32, rounded to the
        kernels' dtype; delta `[heads, block]`), its gate's gradient stored
        and, `store_do`, `do`; `ungated`: the tile's o, `[block, width]` or
        `[width]`."""
        dout = common.load_residues(dout_ref, (), start, block, n_res, width).astype(jnp.float32)
        keep = None
        if query_mask_ref is not None:
            # No gradient flows from a masked query: its dout is 0. Its
            # gate and o are selected to 0 too (not multiplied: a masked
            # residue's may hold anything), so do, dgate and delta are 0.
            keep = common.load_vector(query_mask_ref, (), start, block, n_res) != 0
            keep = keep[:, None]
            dout = jnp.where(keep, dout, 0.0)
            ungated = jnp.where(keep, ungated, 0.0)
        if gate_ref is None:
            do = dout
            if do_ref is not None:
                # Masking queries: `do` is no longer the cotangent itself.
                common.store_residues(do_ref, (), start, do, n_res, width)
        else:
            logits = common.load_residues(gate_ref, (), start, block, n_res, width)
            logits = logits.astype(jnp.float32)
            if keep is not None:
                logits = jnp.where(keep, logits, 0.0)
            gate = jax.nn.sigmoid(logits)
            # The order of the products of the XLA pass (`vjp`).
            dgate = dout * ungated * gate * (1.0 - gate)
            common.store_residues(dgate_ref, (), start, dgate, n_res, width)
            do = dout * gate
            do = do.astype(do_dtype)
            if store_do:
                common.store_residues(do_ref, (), start, do, n_res, width)
            do = do.astype(jnp.float32)
        delta = jnp.sum((do * ungated).reshape(block, heads, head_dim), axis=-1)
        return do, delta.T

    def store_stats(start, plane: int, value):
        view = stats_ref.at[every_head, common.index(plane), pl.ds(start, block)]
        plgpu.store(view, value, mask=stats_in_range(start))

    def load_stats(ref, start):
        view = ref.at[every_head, pl.ds(start, block)]
        return plgpu.load(view, mask=stats_in_range(start), other=0.0)

    def live():
        def visit(tile, carry):
            start = tile * block
            attention = common.load_residues(attention_ref, (), start, block, n_res, width)
            _, delta = gate_backward(start, attention)
            if query_mask_ref is None:
                store_stats(start, 0, load_stats(row_max_ref, start))
                store_stats(start, 1, load_stats(row_log2_sum_ref, start))
            else:
                # A masked query's statistics may be none of the forward's (it
                # skipped the query's tile): a row max above every logit makes
                # its weights 0 in every kernel that visits it.
                keep = common.load_vector(query_mask_ref, (), start, block, n_res) != 0
                keep = jnp.broadcast_to(keep[None, :], (heads, block))
                store_stats(start, 0, jnp.where(keep, load_stats(row_max_ref, start),
                                                MASKED_QUERY_ROW_MAX_LOG2))
                store_stats(start, 1, jnp.where(keep, load_stats(row_log2_sum_ref, start), 0.0))
            store_stats(start, 2, delta)
            return carry

        if query_mask_ref is None:
            common.tile_loop(first_tile, end_tile, visit, jnp.int32(0))
        else:
            # The tiles past the row's last kept residue hold masked queries
            # alone: their results are constants, and nothing of them is read.
            kept_tiles = jnp.clip(ceil_div(end_ref[...], block), first_tile, end_tile)
            common.tile_loop(first_tile, kept_tiles, visit, jnp.int32(0))
            common.tile_loop(kept_tiles, end_tile, masked_tile, jnp.int32(0))
        if dead_dv_ref is not None:
            dead_dv_ref[...] = jnp.zeros((width,), jnp.float32)

    def store_masked_queries(start, row_max, row_log2_sum, read: bool = True):
        """The tile at `start` of masked queries alone, read from nothing:
        the gate's gradient 0 and, `read`, `do` 0 and the statistics
        (`row_max`, `row_log2_sum`, delta 0)."""
        zeros = jnp.zeros((block, width), jnp.float32)
        if dgate_ref is not None:
            common.store_residues(dgate_ref, (), start, zeros, n_res, width)
        if read:
            common.store_residues(do_ref, (), start, zeros, n_res, width)
            for plane, value in enumerate((row_max, row_log2_sum, 0.0)):
                store_stats(start, plane, jnp.full((heads, block), value, jnp.float32))

    def masked_tile(tile, carry):
        """A tile of a live row's masked queries: weights 0 wherever visited."""
        store_masked_queries(tile * block, MASKED_QUERY_ROW_MAX_LOG2, 0.0)
        return carry

    if end_ref is None:
        live()
        return
    dead = end_ref[...] == 0
    pl.when(jnp.logical_not(dead))(live)

    def dead_row_of_masked_queries(read: bool):
        """A dead row's results, masking queries: every query masked, so
        nothing is read and every result is a constant (the statistics of
        uniform weights, as without the query mask)."""

        def visit(tile, carry):
            store_masked_queries(tile * block, MASKED_LOGIT_LOG2, math.log2(n_res), read)
            return carry

        common.tile_loop(first_tile, end_tile, visit, jnp.int32(0))

    def dead_row(read: bool):
        if query_mask_ref is not None:
            dead_row_of_masked_queries(read)
            return
        means = means_ref[...]
        uniform = (jnp.full((heads, block), MASKED_LOGIT_LOG2, jnp.float32),
                   jnp.full((heads, block), math.log2(n_res), jnp.float32))

        def visit(tile, total):
            start = tile * block
            do, delta = gate_backward(start, means[None, :], store_do=read)
            if read:
                store_stats(start, 0, uniform[0])
                store_stats(start, 1, uniform[1])
                store_stats(start, 2, delta)
            # Rows past N load as 0 and add nothing.
            return total + jnp.sum(do, axis=0)

        total = common.tile_loop(0, tiles, visit, jnp.zeros((width,), jnp.float32))
        dead_dv_ref[...] = total / jnp.float32(n_res)

    if live_end_ref is None:
        pl.when(dead)(lambda: dead_row(True))
        return
    # The row's group starts before the batch element's last live row.
    read = (pl.program_id(0) // rows_per_group) * rows_per_group < live_end_ref[...]
    pl.when(dead & read)(lambda: dead_row(True))
    pl.when(dead & jnp.logical_not(read))(lambda: dead_row(False))


def backward_prologue(dout, gate, attention, means, row_max, row_log2_sum, key_end, *,
                      do_dtype, interpret: bool, live_rows_end=None, rows_per_group: int = 1,
                      query_mask=None):
    """`(do, dgate, stats, dead_dv)`: what the Mosaic backward kernels read
    of the output's cotangent (module docstring).

    Args:
      dout: `[B, S, N, H, d]`, the cotangent of the op's output (d a power
        of two: the kernels' head dim).
      gate: like dout (any float dtype), the gate logits, or None.
      attention: `[B, S, N, H, d]` float32, the forward kernel's ungated
        output; dead rows' are not read.
      means: `[B, S, H, d]` float32, the dead rows' mean of v
        (`dead_rows.fill_dead_rows`); live rows' are not read. None (with
        key_end): no row is told dead, every row's residuals are read (as
        a forward that visits every row leaves them). None with query_mask.
      row_max, row_log2_sum: `[B, S, H, N']` float32 (N' >= N), the
        forward's row statistics (base 2); dead rows' are not read.
      key_end: `[B, S]` int32, `key_tiles.key_spans`' end (0: a dead row),
        or None (not with query_mask).
      do_dtype: the dtype the kernels multiply `do` in (q's); without a
        gate, dout's.
      interpret: run in Pallas interpret mode (CPU).
      live_rows_end: `[B]` int32 (with key_end), or None: each batch
        element's last live row + 1 (`key_tiles.live_extents`). A dead row
        in a group of `rows_per_group` rows (rows G*g to G*g + G - 1, as
        the backward kernels serve them) that starts at or past it gets no
        `do` and no statistics: no kernel reads them, and those elements
        are left unwritten. None: every row's are written.
      rows_per_group: the MSA rows a backward kernel's work item serves (a
        common multiple of those of every kernel that reads `do`).
      query_mask: `[B, S, N']` int8 (N' >= N; nonzero keeps; columns past
        N ignored), the kernels' mask (that key_end was made from), masking
        queries too: the cotangent is taken as 0 at a masked residue, and a
        dead row's dout, gate and attention are not read (module
        docstring). Needs key_end, and means None. None: queries are not
        masked.

    Returns:
      do `[B, S, N, H, d]` in `do_dtype` (dout itself without a gate or a
      query mask; 0 at masked queries); dgate like gate (None without one);
      stats `[B, S, H, 3, N]` float32: row max, log2 row sum and delta;
      dead_dv `[B, S, H, d]` float32, a dead row's mean of `do` over the
      residues (its dv), 0 elsewhere (None without means: no row told dead,
      or queries masked, every dead row's dv then 0). The rows
      `live_rows_end` leaves out have no `do` or stats.
    """
    _check(dout, gate, attention, means, row_max, row_log2_sum, key_end, live_rows_end,
           dout.shape[2], query_mask)
    if gate is None and jnp.dtype(do_dtype) != dout.dtype:
        raise ValueError(f"without a gate do is dout ({dout.dtype}); do_dtype {do_dtype}")
    batch, rows, n_res, heads, head_dim = dout.shape
    program_heads = heads_per_program(heads, head_dim)
    width = program_heads * head_dim
    block = max(1, min(next_power_of_2(n_res), _TILE_ELEMENTS // width))
    programs = rows * batch * (heads // program_heads)
    tiles = pl.cdiv(n_res, block)
    # A dead row's dv sums over all its residues: one program per row slice.
    chunks = 1 if means is not None else max(1, min(tiles, pl.cdiv(_MIN_PROGRAMS, programs)))
    chunk_tiles = pl.cdiv(tiles, chunks)
    chunks = pl.cdiv(tiles, chunk_tiles)
    as_rows = lambda x: x.reshape(batch, rows, n_res, heads * head_dim)  # noqa: E731
    # Each program's blocks are its row slice's whole rows: it indexes its
    # own residues (`_prologue_kernel`'s chunk of tiles).
    row_spec = pl.BlockSpec((None, None, n_res, width), lambda s, b, c, t: (b, s, 0, c))
    vector_spec = pl.BlockSpec((None, None, width), lambda s, b, c, t: (b, s, c))

    def plane_spec(plane):
        return pl.BlockSpec((None, None, program_heads, plane.shape[-1]),
                            lambda s, b, c, t: (b, s, c, 0))

    rows_type = jax.ShapeDtypeStruct((batch, rows, n_res, heads * head_dim), do_dtype)
    # `do` is the cotangent itself only without a gate and a query mask;
    # dead rows' dv is made only where their means are given.
    writes_do = gate is not None or query_mask is not None
    out_shape = [
        rows_type if writes_do else None,
        None if gate is None else jax.ShapeDtypeStruct(rows_type.shape, gate.dtype),
        jax.ShapeDtypeStruct((batch, rows, heads, 3, n_res), jnp.float32),
        None if means is None else jax.ShapeDtypeStruct((batch, rows, heads * head_dim),
                                                        jnp.float32),
    ]
    if means is not None:
        means = means.reshape(batch, rows, heads * head_dim)
    out_specs = [
        row_spec if writes_do else None, None if gate is None else row_spec,
        pl.BlockSpec((None, None, program_heads, 3, n_res), lambda s, b, c, t: (b, s, c, 0, 0)),
        None if means is None else vector_spec,
    ]
    kernel = functools.partial(
        _prologue_kernel, n_res=n_res, heads=program_heads, head_dim=head_dim, block=block,
        do_dtype=jnp.dtype(do_dtype), rows_per_group=rows_per_group, chunk_tiles=chunk_tiles,
    )
    do, dgate, stats, dead_dv = common.pallas_call(
        kernel, _LAUNCH, grid=(rows, batch, heads // program_heads, chunks),
        in_specs=[
            None if key_end is None else pl.BlockSpec((None, None), lambda s, b, c, t: (b, s)),
            None if live_rows_end is None else pl.BlockSpec((None,), lambda s, b, c, t: (b,)),
            row_spec, None if gate is None else row_spec, row_spec,
            None if means is None else vector_spec,
            plane_spec(row_max), plane_spec(row_log2_sum),
            None if query_mask is None else pl.BlockSpec((None, None, query_mask.shape[-1]),
                                                         lambda s, b, c, t: (b, s, 0)),
        ],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        name="msa_backward_prologue",
    )(key_end, live_rows_end, as_rows(dout), None if gate is None else as_rows(gate),
      as_rows(attention), means, row_max, row_log2_sum, query_mask)
    if dead_dv is not None:
        dead_dv = dead_dv.reshape(batch, rows, heads, head_dim)
    do = dout if do is None else do.reshape(dout.shape)
    return do, None if gate is None else dgate.reshape(dout.shape), stats, dead_dv
