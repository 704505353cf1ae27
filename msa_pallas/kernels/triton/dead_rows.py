"""The results of dead rows (MSA rows whose keys are all masked), from small
Pallas (Triton) kernels that read and write those rows alone.

A dead row's weights are uniform over its N keys (SPEC §1,
`kernels.key_tiles`): its ungated output is the mean of v over the keys,
and its dv the mean over queries of its output gradient. The Mosaic kernels
skipping padding compute no dead row; these kernels give them their
results:

- `fill_dead_rows` writes the dead rows' output, mean(v) * sigmoid(gate),
  in place (the forward's output buffer is aliased to it), and gives their
  means of v: the residuals' dead rows are selects on them, which XLA fuses
  into the backward's passes, so that no float32 row is written for them;
- `dead_row_means` gives the mean over residues of `do` for dead rows, 0
  for the others: the dk/dv kernel's dv there.

The arrays are seen as `[B, S, N, C]` (C = heads × head dim, in any head
layout: the mean is per column): reshapes that move no byte. A program
serves one MSA row and a slice of its columns; it reads the row's key mask
and, if the row keeps a key, writes its means (0) and ends. Where nothing
is padded the kernels cost a launch and the mask's B·S·N bytes; XLA passes
in their place read every row (at the padded extra MSA on an H200, v's and
`do`'s means over every row took 14.6 and 15.2 us; 2026-12-04), and a
select filling the output rewrote every row of it.

`zero_masked_queries` serves the op's `mask_queries` mode, where the key
mask masks queries too and a masked query's output is exactly 0: the
Mosaic forward leaves arbitrary values there (or, in rows of padding at the
end of the alignment, nothing at all), and this kernel zeroes them in place
after it. It reads only the mask and writes only the masked residues: a
tile of residues all kept costs its mask read alone, nothing of the output
is read, and a dead row is one whose every residue is zeroed. Each of its
programs serves a chunk of one row's residues in one column slice, so that
the stores of a few rows spread over every SM.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas.block_sizes import next_power_of_2
from msa_pallas.kernels.triton import common

# Elements per tile a program loads or stores at once; the widest column
# slice a program serves (128 bytes of a bf16 row); the launch.
_TILE_ELEMENTS = 4096
_MAX_COLUMNS = 64
# `zero_masked_queries`' widest column slice: it only stores, and wider
# stores are fewer (512 bytes of a bf16 row, all of C = 256).
_MAX_ZERO_COLUMNS = 256
# About how many programs `zero_masked_queries` launches (fewer where its
# rows hold fewer tiles of residues).
_ZERO_PROGRAMS = 2048
_LAUNCH = collections.namedtuple("Launch", "num_warps num_stages")(num_warps=4, num_stages=2)


def _column_slice(columns: int, max_columns: int = _MAX_COLUMNS) -> int:
    """The columns of a program's slice: the largest power of two that
    divides C, at most `max_columns` (no slice runs past C)."""
    return min(max_columns, columns & -columns)


def _residues_per_tile(width: int, n_res: int) -> int:
    """Residues per `[block, width]` tile: a power of two, at most N's."""
    return max(1, min(next_power_of_2(n_res), _TILE_ELEMENTS // width))


def _row_keeps_a_key(mask_ref, n_res: int):
    """Whether the row's `[N']` key mask keeps any of its first N keys (a
    bool scalar); read tile by tile."""
    block = min(next_power_of_2(n_res), _TILE_ELEMENTS)

    def count_tile(tile, kept):
        keep = common.load_vector(mask_ref, (), tile * block, block, n_res)
        return kept + jnp.sum(keep != 0, dtype=jnp.int32)  # int32 under x64 too

    return common.tile_loop(0, pl.cdiv(n_res, block), count_tile, jnp.int32(0)) > 0


def _row_specs(mask_width: int, n_res: int, width: int):
    """BlockSpecs of an (S, B, column slices, ...) grid: the mask `[B, S,
    mask_width]` (the program's row), rows `[B, S, N, C]` and means `[B, S,
    C]` (its row and column slice, `width` wide); axes after the third
    leave the blocks as they are."""
    return {
        "mask": pl.BlockSpec((None, None, mask_width), lambda s, b, c, *_: (b, s, 0)),
        "rows": pl.BlockSpec((None, None, n_res, width), lambda s, b, c, *_: (b, s, 0, c)),
        "means": pl.BlockSpec((None, None, width), lambda s, b, c, *_: (b, s, c)),
    }


def _as_rows(x):
    """`[B, S, N, ...]` as `[B, S, N, C]`."""
    return x.reshape(*x.shape[:3], -1)


def _layout(x, mask, n_res: int):
    """What a call on rows `x` `[B, S, N, ...]` takes: x as `[B, S, N, C]`,
    its programs' column slice, their BlockSpecs and grid, and the means'
    type (`[B, S, C]` float32)."""
    x_rows = _as_rows(x)
    batch, rows, _, columns = x_rows.shape
    width = _column_slice(columns)
    means = jax.ShapeDtypeStruct((batch, rows, columns), jnp.float32)
    grid = (rows, batch, columns // width)
    return x_rows, width, _row_specs(mask.shape[-1], n_res, width), grid, means


def _write_means(mask_ref, rows_ref, means_ref, *, n_res: int, width: int):
    """Writes the program's row and column slice of the means: the row's
    mean over residues if the row is dead, else 0 (a live row reads
    nothing: its loop runs no tile). Returns (dead, the mean)."""
    dead = jnp.logical_not(_row_keeps_a_key(mask_ref, n_res))
    mean = common.residue_mean(
        rows_ref, (), dead, _residues_per_tile(width, n_res), n_res, width
    )
    means_ref[...] = mean
    return dead, mean


def _dead_mean_kernel(mask_ref, rows_ref, means_ref, *, n_res: int, width: int):
    _write_means(mask_ref, rows_ref, means_ref, n_res=n_res, width=width)


def dead_row_means(x, mask, *, n_res: int, interpret: bool):
    """`[B, S, C]` float32: for each row whose keys are all masked, the mean
    over residues of `x` (the output gradient: its dv); 0 elsewhere.

    Args:
      x: `[B, S, N, ...]`, any float dtype; C is the product of the axes
        after N.
      mask: `[B, S, N']` (N' >= N; nonzero keeps a key; keys past N are
        ignored).
      n_res: N.
      interpret: run in Pallas interpret mode (CPU).
    """
    x_rows, width, specs, grid, means = _layout(x, mask, n_res)
    kernel = functools.partial(_dead_mean_kernel, n_res=n_res, width=width)
    return common.pallas_call(
        kernel, _LAUNCH, grid=grid, in_specs=[specs["mask"], specs["rows"]],
        out_specs=specs["means"], out_shape=means,
        interpret=interpret, name="msa_dead_row_means",
    )(mask, x_rows)


def _fill_kernel(mask_ref, v_ref, gate_ref, out_in_ref, out_ref, means_ref, *, n_res: int,
                 width: int):
    del out_in_ref  # the same buffer as out_ref
    dead, mean = _write_means(mask_ref, v_ref, means_ref, n_res=n_res, width=width)
    block = _residues_per_tile(width, n_res)

    @pl.when(dead)
    def _():
        def write_tile(tile, carry):
            start = tile * block
            gated = jnp.broadcast_to(mean[None, :], (block, width))
            if gate_ref is not None:
                gate = common.load_residues(gate_ref, (), start, block, n_res, width)
                gated = gated * jax.nn.sigmoid(gate.astype(jnp.float32))
            common.store_residues(out_ref, (), start, gated, n_res, width)
            return carry

        common.tile_loop(0, pl.cdiv(n_res, block), write_tile, jnp.int32(0))


def fill_dead_rows(out, v, gate, mask, *, n_res: int, interpret: bool):
    """`(out, means)`: the output `out` with the rows whose keys are all
    masked given their exact values (uniform weights over the N keys:
    mean(v) * sigmoid(gate)), in place, the other rows' left as they are,
    bit for bit; and `[B, S, C]` float32, the dead rows' mean of v (their
    ungated output, for the residuals), 0 elsewhere.

    Args:
      out: `[B, S, N, ...]` in v's dtype; C is the product of the axes after N.
      v: like out; gate: like out (any float dtype), or None.
      mask: `[B, S, N']` (N' >= N; nonzero keeps; keys past N ignored).
      n_res: N.
      interpret: run in Pallas interpret mode (CPU).
    """
    out_rows, width, specs, grid, means = _layout(out, mask, n_res)
    kernel = functools.partial(_fill_kernel, n_res=n_res, width=width)
    # The mask, v and the gate (if any) are read; out, after them, is written in
    # place (None operands are not counted).
    read = 2 if gate is None else 3
    filled, means = common.pallas_call(
        kernel, _LAUNCH, grid=grid,
        in_specs=[specs["mask"], specs["rows"], None if gate is None else specs["rows"],
                  specs["rows"]],
        out_specs=[specs["rows"], specs["means"]],
        out_shape=[jax.ShapeDtypeStruct(out_rows.shape, out.dtype), means],
        interpret=interpret, name="msa_fill_dead_rows", input_output_aliases={read: 0},
    )(mask, _as_rows(v), None if gate is None else _as_rows(gate), out_rows)
    return filled.reshape(out.shape), means


def _zero_kernel(mask_ref, out_in_ref, out_ref, *, n_res: int, width: int,
                 tiles_per_program: int):
    del out_in_ref  # the same buffer as out_ref, never read
    block = _residues_per_tile(width, n_res)
    first = pl.program_id(3) * tiles_per_program

    def zero_tile(tile, carry):
        start = tile * block
        # Residues past N read as kept: nothing is stored there.
        masked = common.load_vector(mask_ref, (), start, block, n_res, other=1) == 0

        # A tile that keeps every residue stores nothing: a live row costs its
        # mask reads alone.
        @pl.when(jnp.sum(masked, dtype=jnp.int32) > 0)  # int32 under x64 too
        def _():
            view = out_ref.at[pl.ds(start, block), common.full_columns(out_ref)]
            plgpu.store(view, jnp.zeros((block, width), out_ref.dtype),
                        mask=jnp.broadcast_to(masked[:, None], (block, width)))

        return carry

    if tiles_per_program == 1:
        zero_tile(first, None)
    else:
        end = jnp.minimum(first + tiles_per_program, pl.cdiv(n_res, block))
        common.tile_loop(first, end, zero_tile, jnp.int32(0))


def _zero_tiles_per_program(programs: int, tiles: int) -> int:
    """Tiles of residues per program of `zero_masked_queries`, for `programs`
    rows and column slices of `tiles` tiles each: at least one, and at most
    as many as leave `_ZERO_PROGRAMS` programs (where there are that many
    tiles), to keep every SM storing."""
    return max(1, min(tiles, programs * tiles // _ZERO_PROGRAMS))


def zero_masked_queries(out, mask, *, n_res: int, interpret: bool):
    """`out` with every residue whose mask is 0 set to 0 (all of its C
    columns), in place; every other element is left as it was, bit for bit.
    Only the mask is read; a row all masked (dead) is zeroed whole.

    Args:
      out: `[B, S, N, ...]`, any float dtype; C is the product of the axes
        after N.
      mask: `[B, S, N']` int8 (N' >= N; nonzero keeps a residue; residues
        past N are ignored).
      n_res: N.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      `[B, S, N, ...]` like out (its buffer, aliased).
    """
    out_rows = _as_rows(out)
    batch, rows, _, columns = out_rows.shape
    width = _column_slice(columns, _MAX_ZERO_COLUMNS)
    slices = columns // width
    tiles = pl.cdiv(n_res, _residues_per_tile(width, n_res))
    per_program = _zero_tiles_per_program(rows * batch * slices, tiles)
    # With a whole row per program the padded training crop's 128 rows were
    # 128 programs, each storing its 8 KB tiles one after another: 8.0 us
    # against 5.0 in chunks on an H100 (benchmarks/log, 2026-12-06 08).
    specs = _row_specs(mask.shape[-1], n_res, width)
    kernel = functools.partial(_zero_kernel, n_res=n_res, width=width,
                               tiles_per_program=per_program)
    zeroed = common.pallas_call(
        kernel, _LAUNCH, grid=(rows, batch, slices, pl.cdiv(tiles, per_program)),
        in_specs=[specs["mask"], specs["rows"]], out_specs=specs["rows"],
        out_shape=jax.ShapeDtypeStruct(out_rows.shape, out.dtype),
        interpret=interpret, name="msa_zero_masked_queries", input_output_aliases={1: 0},
    )(mask, out_rows)
    return zeroed.reshape(out.shape)
