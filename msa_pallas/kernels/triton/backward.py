"""The Pallas backward kernels: dk/dv, dq, and the bias gradient summed over S.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics (`common.probabilities`), so no `[S, H, N, N]`
array exists. The kernels own disjoint outputs, so no atomics are used and
two runs give bitwise identical gradients:

- dk/dv: one program per key tile of one head and `tiles.msa_rows` MSA rows
  of one batch element, looping over query tiles (each bias tile it loads
  serves all its rows).
- dq: one program per query tile of one head and `tiles.msa_rows` MSA rows,
  looping over key tiles.
- dbias: one program per (query tile, key tile) of one (batch, head),
  looping over the S MSA rows; the sum over S stays in registers and the
  bias tile is read once.
- dq+dbias (N <= 512, in place of dq and dbias): the dbias kernel with one
  key tile spanning all N keys, which also writes each row's dq of its query
  tile: one recomputation of the probabilities serves both.

When (tiles x heads x batch) gives too few programs to fill the GPU, the
kernels that loop over S split the rows into chunks (`row_chunks`), one
program each, and their float32 partial bias gradients are added.

With a key mask, every loop runs between bounds derived at run time from
the mask's summary (`key_tiles`, small int32 inputs): dq's key loop over
the tiles that hold its rows' kept keys (`key_tiles.key_spans`); dk/dv's
query loop only for a key tile within some row's kept keys; the bias
gradient's row loop over the batch element's live rows, and none for a key
tile that no row keeps a key of (`key_tiles.live_extents`). What is skipped
would add exactly 0. A row that keeps no key gets dq = dk = 0 and dv = the
mean of its `do` (uniform weights) without a matrix product; with dropout,
which drops those uniform weights too, dk/dv visits its every key tile
instead.

With dropout (`dropout_rate > 0`) every kernel regenerates the forward's
mask (`common.dropout_keeps`) and computes `ds = p * (keep * dp - delta)` and
`dv = (p * keep)^T do`, p undropped. The caller passes `do / (1 - rate)` and
`delta = (1 - rate) * sum_d do * o` with that `do`: no scaling in here.

Inputs shared by all: q, k, v `[B, S, N, H, d]`; bias `[B, H, N, N]`;
mask `[B, S, N]` int8 or None; `do` `[B, S, N, H, d]` (the cotangent of the
ungated output, in q's dtype); row_max, row_log2_sum and delta
(`sum_d do * o`) `[B, S, H, N]` float32; dropout_seeds `[B, S, H]` uint32
or None (read only where `dropout_rate > 0`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas import dropout
from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.triton import common
from msa_pallas.kernels.triton.backward_launch import bind, call_over_row_chunks, per_row_call


def _query_tile_stats(row_max_ref, row_log2_sum_ref, delta_ref, prefix, q_start, block_q, n_res):
    return tuple(
        common.load_vector(ref, prefix, q_start, block_q, n_res)
        for ref in (row_max_ref, row_log2_sum_ref, delta_ref)
    )


def _recompute_tile(
    q, k, v, do, bias, keep, stats, k_start, *, scale, n_res, precision, dropout_keep=None
):
    """The probabilities `p` (undropped) and the logit gradient `ds` of one
    (query tile, key tile) of one MSA row, both `[block_q, block_k]` float32,
    from the forward's row statistics: what every backward kernel rebuilds.

    Args:
      q, do: `[block_q, d_pad]`; k, v: `[block_k, d_pad]`, input dtype.
      bias: `[block_q, block_k]` float32 in base 2 (`common.load_bias_tile`).
      keep: `[block_k]` bool or None.
      stats: (row max, log2 row sum, delta), each `[block_q]` float32.
      dropout_keep: `[block_q, block_k]` bool (`common.dropout_keeps`) or None.
    """
    row_max, row_log2_sum, delta = stats
    t = common.log2_logits(
        q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res,
        precision=precision,
    )
    p = common.probabilities(t, row_max, row_log2_sum)
    dp = plgpu.dot(do, v, trans_b=True, precision=precision)
    return p, common.logit_gradient(p, dp, delta, keep, dropout_keep)


def _tile_words(words, seeds, start, block):
    """Each row's dropout words of one tile (`common.dropout_words`)."""
    return [common.dropout_words(words, seed, start, block) for seed in seeds]


def _dkdv_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    spans_ref, seeds_ref, dk_ref, dv_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, msa_rows: int,
    precision, dropout_threshold=None,
):
    """`spans_ref`: the rows' spans of kept keys (`key_tiles.key_spans`) or
    None. A row whose span leaves out this key tile keeps no key in it:
    its dk and dv are 0; a row that keeps no key at all has dk = 0 and dv =
    the mean of its `do` over the N queries. The query loop runs only when
    some row of the program keeps a key in the tile."""
    key_tile = pl.program_id(0)
    k_start = key_tile * block_k
    program_rows = common.program_rows_of(msa_rows)
    num_query_tiles = pl.cdiv(n_res, block_q)
    if spans_ref is None:
        query_tiles_end, dead_rows = num_query_tiles, None
    else:
        # With dropout dead rows are visited whole: their dropped weights have
        # no shortcut.
        row_bounds = [
            key_tiles.tile_span([common.load_row_span(spans_ref, row)], n_res=n_res,
                                block_k=block_k, dead_rows_whole=seeds_ref is not None)
            for row in program_rows
        ]
        dead_rows = None if seeds_ref is not None else [end == 0 for _, end in row_bounds]
        tile_kept = functools.reduce(
            jnp.logical_or,
            [(first <= key_tile) & (key_tile < end) for first, end in row_bounds],
        )
        query_tiles_end = jnp.where(tile_kept, jnp.int32(num_query_tiles), jnp.int32(0))
    keys = [
        (
            common.load_residues(k_ref, row, k_start, block_k, n_res, head_dim),
            common.load_residues(v_ref, row, k_start, block_k, n_res, head_dim),
            common.load_key_keep(mask_ref, row, k_start, block_k, n_res),
        )
        for row in program_rows
    ]
    seeds = [common.load_dropout_seed(seeds_ref, row) for row in program_rows]
    key_words = _tile_words(dropout.key_words, seeds, k_start, block_k)

    def visit_query_tile(query_tile, carry):
        q_start = query_tile * block_q
        # One bias tile for all of this program's MSA rows.
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        query_words = _tile_words(dropout.query_words, seeds, q_start, block_q)
        updated = []
        for row, (k, v, keep), row_query_words, row_key_words, (dk, dv) in zip(
            program_rows, keys, query_words, key_words, carry
        ):
            q = common.load_residues(q_ref, row, q_start, block_q, n_res, head_dim)
            do = common.load_residues(do_ref, row, q_start, block_q, n_res, head_dim)
            stats = _query_tile_stats(
                row_max_ref, row_log2_sum_ref, delta_ref, row, q_start, block_q, n_res
            )
            dropout_keep = common.dropout_keeps(row_query_words, row_key_words, dropout_threshold)
            p, ds = _recompute_tile(
                q, k, v, do, bias, keep, stats, k_start,
                scale=scale, n_res=n_res, precision=precision, dropout_keep=dropout_keep,
            )
            if dropout_keep is not None:
                p = jnp.where(dropout_keep, p, 0.0)  # the weights that multiplied v
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
            updated.append((dk, dv))
        return tuple(updated)

    zeros = jnp.zeros(keys[0][0].shape, jnp.float32)
    carry = common.tile_loop(
        0, query_tiles_end, visit_query_tile, tuple((zeros, zeros) for _ in program_rows)
    )
    for position, (row, (dk, dv)) in enumerate(zip(program_rows, carry)):
        if dead_rows is not None:
            dead = dead_rows[position]
            do_mean = common.residue_mean(do_ref, row, dead, block_q, n_res, head_dim)
            dv = jnp.where(dead, jnp.broadcast_to(do_mean[None, :], dv.shape), dv)
        common.store_residues(dk_ref, row, k_start, dk * scale, n_res, head_dim)
        common.store_residues(dv_ref, row, k_start, dv, n_res, head_dim)


def _dq_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    spans_ref, seeds_ref, dq_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, msa_rows: int,
    precision, dropout_threshold=None,
):
    """`spans_ref`: the rows' spans of kept keys (`key_tiles.key_spans`) or
    None: the key loop spans the tiles that keep a key in some row of the
    program (a row that keeps none has dq = 0)."""
    q_start = pl.program_id(0) * block_q
    program_rows = common.program_rows_of(msa_rows)
    num_key_tiles = pl.cdiv(n_res, block_k)
    if spans_ref is None:
        first, end = 0, num_key_tiles
    else:
        first, end = key_tiles.tile_span(
            [common.load_row_span(spans_ref, row) for row in program_rows],
            n_res=n_res, block_k=block_k,
        )
    queries = [
        (
            common.load_residues(q_ref, row, q_start, block_q, n_res, head_dim),
            common.load_residues(do_ref, row, q_start, block_q, n_res, head_dim),
            _query_tile_stats(
                row_max_ref, row_log2_sum_ref, delta_ref, row, q_start, block_q, n_res
            ),
        )
        for row in program_rows
    ]
    seeds = [common.load_dropout_seed(seeds_ref, row) for row in program_rows]
    query_words = _tile_words(dropout.query_words, seeds, q_start, block_q)

    def visit_key_tile(key_tile, carry):
        k_start = key_tile * block_k
        # One bias tile for all of this program's MSA rows.
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        key_words = _tile_words(dropout.key_words, seeds, k_start, block_k)
        updated = []
        for row, (q, do, stats), row_query_words, row_key_words, dq in zip(
            program_rows, queries, query_words, key_words, carry
        ):
            k = common.load_residues(k_ref, row, k_start, block_k, n_res, head_dim)
            v = common.load_residues(v_ref, row, k_start, block_k, n_res, head_dim)
            keep = common.load_key_keep(mask_ref, row, k_start, block_k, n_res)
            dropout_keep = common.dropout_keeps(row_query_words, row_key_words, dropout_threshold)
            _, ds = _recompute_tile(
                q, k, v, do, bias, keep, stats, k_start,
                scale=scale, n_res=n_res, precision=precision, dropout_keep=dropout_keep,
            )
            updated.append(dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision))
        return tuple(updated)

    zeros = jnp.zeros(queries[0][0].shape, jnp.float32)
    carry = common.tile_loop(first, end, visit_key_tile, tuple(zeros for _ in program_rows))
    for row, dq in zip(program_rows, carry):
        common.store_residues(dq_ref, row, q_start, dq * scale, n_res, head_dim)


def _bias_gradient_body(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    extent_ref, seeds_ref, dq_ref, dbias_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, precision,
    dropout_threshold=None,
):
    """One (query tile, key tile) of the bias gradient, summed over this
    program's MSA rows; with `dq_ref`, also each row's dq of the query tile,
    which needs the key tile to span every key (block_k >= N): the `ds` tile
    then covers whole softmax rows and gives dq in one product.

    `extent_ref`: the refs of the batch element's `key_tiles.live_extents`
    (four int32 scalars), or None: the MSA rows that keep a key in this key
    tile lie among its live rows (`key_tiles.rows_of_key_tile`, over all S
    rows; none where no row keeps a key of the tile). The row loop visits those of this
    program's rows only: the others add exactly 0 to the bias gradient, and
    their dq (rows that keep no key) is 0. `seeds_ref`: `[rows, 1]` uint32
    dropout seeds of the program's rows, or None: each row hashes its own
    words of the two tiles."""
    q_start = pl.program_id(0) * block_q
    # With dq there is one key tile: a constant start lets the compiler fold it.
    k_start = common.index(0) if dq_ref is not None else pl.program_id(1) * block_k
    # The bias tile is the same for every MSA row: read it once.
    bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)

    def visit_msa_row(row, dbias):
        prefix = (row,)
        q = common.load_residues(q_ref, prefix, q_start, block_q, n_res, head_dim)
        do = common.load_residues(do_ref, prefix, q_start, block_q, n_res, head_dim)
        k = common.load_residues(k_ref, prefix, k_start, block_k, n_res, head_dim)
        v = common.load_residues(v_ref, prefix, k_start, block_k, n_res, head_dim)
        keep = common.load_key_keep(mask_ref, prefix, k_start, block_k, n_res)
        stats = _query_tile_stats(
            row_max_ref, row_log2_sum_ref, delta_ref, prefix, q_start, block_q, n_res
        )
        seed = common.load_dropout_seed(seeds_ref, prefix)
        dropout_keep = common.dropout_keeps(
            common.dropout_words(dropout.query_words, seed, q_start, block_q),
            common.dropout_words(dropout.key_words, seed, k_start, block_k),
            dropout_threshold,
        )
        _, ds = _recompute_tile(
            q, k, v, do, bias, keep, stats, k_start,
            scale=scale, n_res=n_res, precision=precision, dropout_keep=dropout_keep,
        )
        if dq_ref is not None:
            dq = plgpu.dot(ds.astype(k.dtype), k, precision=precision)
            common.store_residues(dq_ref, prefix, q_start, dq * scale, n_res, head_dim)
        return dbias + ds

    msa_rows_here = q_ref.shape[0]
    if extent_ref is None:
        first, end = 0, msa_rows_here
    else:
        # This program's rows are rows [chunk * R, (chunk + 1) * R) of S.
        row_offset = pl.program_id(2) * msa_rows_here
        rows_of_tile = key_tiles.rows_of_key_tile(
            common.load_extent(extent_ref), pl.program_id(1), block_k,
            rows=msa_rows_here * pl.num_programs(2), n_res=n_res,
        )
        first, end = (
            jnp.clip(bound - row_offset, 0, msa_rows_here) for bound in rows_of_tile
        )
        end = jnp.maximum(first, end)
        if dq_ref is not None:
            _store_zero_dq(dq_ref, 0, first, q_start, block_q, n_res, head_dim)
            _store_zero_dq(dq_ref, end, msa_rows_here, q_start, block_q, n_res, head_dim)
    dbias = common.tile_loop(
        first, end, visit_msa_row, jnp.zeros((block_q, block_k), jnp.float32)
    )
    plgpu.store(
        common.bias_view(dbias_ref, q_start, k_start, block_q, block_k),
        dbias.astype(dbias_ref.dtype),
        mask=common.tile_mask(q_start, k_start, block_q, block_k, n_res),
    )


def _store_zero_dq(dq_ref, first, end, q_start, block_q, n_res, head_dim):
    """dq = 0 in the query tile of MSA rows `[first, end)` of the program
    (rows that keep no key)."""
    zeros = jnp.zeros((block_q, dq_ref.shape[-1]), jnp.float32)

    def store_row(row, carry):
        common.store_residues(dq_ref, (row,), q_start, zeros, n_res, head_dim)
        return carry

    common.tile_loop(first, end, store_row, jnp.int32(0))


def _dbias_kernel(*refs, **static):
    *operand_refs, dbias_ref = refs
    _bias_gradient_body(*operand_refs, None, dbias_ref, **static)


def _dq_dbias_kernel(*refs, **static):
    _bias_gradient_body(*refs, **static)


# `skip_padding` (every kernel): with a mask, skip the tiles and rows it
# masks entirely (`key_tiles`); False (the default; the op skips inside
# `skipping_padding`) computes them, as without a mask. The gradients are
# the same bit for bit, but for the dv of a row that keeps no key (the mean
# of `do`, summed in another order). With dropout dk/dv visits dead rows
# whole. `dropout_rate` (every kernel): in [0, 1); > 0 needs
# `dropout_seeds` (module docstring), 0 is the kernel without.
_STATIC = ("scale", "tiles", "interpret", "skip_padding", "dropout_rate")


@functools.partial(jax.jit, static_argnames=_STATIC)
def backward_dkdv(
    q, k, v, bias, mask, do, row_max, row_log2_sum, delta, dropout_seeds=None, *, scale, tiles,
    interpret, skip_padding=False, dropout_rate=0.0,
):
    """dk, dv `[B, S, N, H, d]` in q's dtype (arguments as in the module docstring)."""
    dk, dv = per_row_call(
        _dkdv_kernel, 2, tiles.block_k, (q, k, v, bias, mask, do, row_max, row_log2_sum, delta),
        dropout_seeds, scale=scale, tiles=tiles, interpret=interpret,
        skip_padding=skip_padding, dropout_rate=dropout_rate, name="msa_row_attention_bwd_dkdv",
    )
    return dk, dv


@functools.partial(jax.jit, static_argnames=_STATIC)
def backward_dq(
    q, k, v, bias, mask, do, row_max, row_log2_sum, delta, dropout_seeds=None, *, scale, tiles,
    interpret, skip_padding=False, dropout_rate=0.0,
):
    """dq `[B, S, N, H, d]` in q's dtype (arguments as in the module docstring)."""
    (dq,) = per_row_call(
        _dq_kernel, 1, tiles.block_q, (q, k, v, bias, mask, do, row_max, row_log2_sum, delta),
        dropout_seeds, scale=scale, tiles=tiles, interpret=interpret,
        skip_padding=skip_padding, dropout_rate=dropout_rate, name="msa_row_attention_bwd_dq",
    )
    return dq


@functools.partial(jax.jit, static_argnames=(*_STATIC, "dbias_dtype"))
def backward_dbias(
    q, k, v, bias, mask, do, row_max, row_log2_sum, delta, dropout_seeds=None, *, scale, tiles,
    interpret, dbias_dtype=None, skip_padding=False, dropout_rate=0.0,
):
    """dbias `[B, H, N, N]` summed over the S MSA rows, in `dbias_dtype`
    (default: the bias dtype)."""
    n_res, head_dim = q.shape[2], q.shape[4]
    seeds, threshold = common.dropout_operand(dropout_seeds, dropout_rate, q.shape)
    _, dbias = call_over_row_chunks(
        bind(_dbias_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret, threshold),
        tiles,
        (q, k, v, bias, mask, do, row_max, row_log2_sum, delta), seeds,
        key_tiles=pl.cdiv(n_res, tiles.block_k), row_out=False,
        dbias_dtype=jnp.dtype(dbias_dtype or bias.dtype),
        name="msa_row_attention_bwd_dbias", interpret=interpret, skip_padding=skip_padding,
    )
    return dbias


@functools.partial(jax.jit, static_argnames=(*_STATIC, "dbias_dtype"))
def backward_dq_dbias(
    q, k, v, bias, mask, do, row_max, row_log2_sum, delta, dropout_seeds=None, *, scale, tiles,
    interpret, dbias_dtype=None, skip_padding=False, dropout_rate=0.0,
):
    """dq `[B, S, N, H, d]` in q's dtype and dbias `[B, H, N, N]` in
    `dbias_dtype` (default: the bias dtype) from one kernel. `tiles.block_k`
    must be >= N: one key tile spans every key."""
    n_res, head_dim = q.shape[2], q.shape[4]
    if tiles.block_k < n_res:
        raise ValueError(
            f"backward_dq_dbias needs tiles.block_k >= N; got block_k={tiles.block_k}, N={n_res}."
        )
    seeds, threshold = common.dropout_operand(dropout_seeds, dropout_rate, q.shape)
    return call_over_row_chunks(
        bind(_dq_dbias_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret, threshold),
        tiles,
        (q, k, v, bias, mask, do, row_max, row_log2_sum, delta), seeds,
        key_tiles=1, row_out=True, dbias_dtype=jnp.dtype(dbias_dtype or bias.dtype),
        name="msa_row_attention_bwd_dq_dbias", interpret=interpret, skip_padding=skip_padding,
    )
