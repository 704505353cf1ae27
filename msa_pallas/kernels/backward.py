"""The Pallas backward kernels: dk/dv, dq, and the bias gradient summed over S.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics (`common.probabilities`), so no `[S, H, N, N]`
array exists. The kernels own disjoint outputs, so no atomics are used and
two runs give bitwise identical gradients:

- dk/dv: one program per key tile of one (batch, MSA row, head), looping
  over query tiles.
- dq: one program per query tile of one (batch, MSA row, head), looping over
  key tiles.
- dbias: one program per (query tile, key tile) of one (batch, head),
  looping over the S MSA rows; the sum over S stays in registers and the
  bias tile is read once.
- dq+dbias (N <= 512, in place of dq and dbias): the dbias kernel with one
  key tile spanning all N keys, which also writes each row's dq of its query
  tile: one recomputation of the probabilities serves both.

When (tiles x heads x batch) gives too few programs to fill the GPU, the
kernels that loop over S split the rows into chunks (`row_chunks`), one
program each, and their float32 partial bias gradients are added.

Inputs shared by all: q, k, v `[B, S, N, H, d]`; bias `[B, H, N, N]`;
mask `[B, S, N]` int8 or None; `do` `[B, S, N, H, d]` (the cotangent of the
ungated output, in q's dtype); row_max, row_log2_sum and delta
(`sum_d do * o`) `[B, S, H, N]` float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas.block_sizes import padded_head_dim, row_chunks
from msa_pallas.kernels import common
from msa_pallas.kernels.forward import bias_spec, mask_spec, row_specs, stats_spec


def _query_tile_stats(row_max_ref, row_log2_sum_ref, delta_ref, prefix, q_start, block_q, n_res):
    return tuple(
        common.load_vector(ref, prefix, q_start, block_q, n_res)
        for ref in (row_max_ref, row_log2_sum_ref, delta_ref)
    )


def _dkdv_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    dk_ref, dv_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, precision,
):
    k_start = pl.program_id(0) * block_k
    k = common.load_rows(k_ref, (), k_start, block_k, n_res, head_dim)
    v = common.load_rows(v_ref, (), k_start, block_k, n_res, head_dim)
    keep = common.load_key_keep(mask_ref, (), k_start, block_k, n_res)

    def visit_query_tile(query_tile, carry):
        dk, dv = carry
        q_start = query_tile * block_q
        q = common.load_rows(q_ref, (), q_start, block_q, n_res, head_dim)
        do = common.load_rows(do_ref, (), q_start, block_q, n_res, head_dim)
        row_max, row_log2_sum, delta = _query_tile_stats(
            row_max_ref, row_log2_sum_ref, delta_ref, (), q_start, block_q, n_res
        )
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        t = common.log2_logits(
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res,
            precision=precision,
        )
        p = common.probabilities(t, row_max, row_log2_sum)
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = common.logit_gradient(p, dp, delta, keep)
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(
        0, pl.cdiv(n_res, block_q), visit_query_tile, (zeros, zeros)
    )
    common.store_rows(dk_ref, (), k_start, dk * scale, n_res, head_dim)
    common.store_rows(dv_ref, (), k_start, dv, n_res, head_dim)


def _dq_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    dq_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, precision,
):
    q_start = pl.program_id(0) * block_q
    q = common.load_rows(q_ref, (), q_start, block_q, n_res, head_dim)
    do = common.load_rows(do_ref, (), q_start, block_q, n_res, head_dim)
    row_max, row_log2_sum, delta = _query_tile_stats(
        row_max_ref, row_log2_sum_ref, delta_ref, (), q_start, block_q, n_res
    )

    def visit_key_tile(key_tile, dq):
        k_start = key_tile * block_k
        k = common.load_rows(k_ref, (), k_start, block_k, n_res, head_dim)
        v = common.load_rows(v_ref, (), k_start, block_k, n_res, head_dim)
        keep = common.load_key_keep(mask_ref, (), k_start, block_k, n_res)
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        t = common.log2_logits(
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res,
            precision=precision,
        )
        p = common.probabilities(t, row_max, row_log2_sum)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = common.logit_gradient(p, dp, delta, keep)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    dq = jax.lax.fori_loop(
        0, pl.cdiv(n_res, block_k), visit_key_tile, jnp.zeros(q.shape, jnp.float32)
    )
    common.store_rows(dq_ref, (), q_start, dq * scale, n_res, head_dim)


def _bias_gradient_body(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    dq_ref, dbias_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int, precision,
):
    """One (query tile, key tile) of the bias gradient, summed over this
    program's MSA rows; with `dq_ref`, also each row's dq of the query tile,
    which needs the key tile to span every key (block_k >= N): the `ds` tile
    then covers whole softmax rows and gives dq in one product."""
    q_start = pl.program_id(0) * block_q
    # With dq there is one key tile: a constant start lets the compiler fold it.
    k_start = 0 if dq_ref is not None else pl.program_id(1) * block_k
    # The bias tile is the same for every MSA row: read it once.
    bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)

    def visit_msa_row(row, dbias):
        prefix = (row,)
        q = common.load_rows(q_ref, prefix, q_start, block_q, n_res, head_dim)
        do = common.load_rows(do_ref, prefix, q_start, block_q, n_res, head_dim)
        k = common.load_rows(k_ref, prefix, k_start, block_k, n_res, head_dim)
        v = common.load_rows(v_ref, prefix, k_start, block_k, n_res, head_dim)
        keep = common.load_key_keep(mask_ref, prefix, k_start, block_k, n_res)
        row_max, row_log2_sum, delta = _query_tile_stats(
            row_max_ref, row_log2_sum_ref, delta_ref, prefix, q_start, block_q, n_res
        )
        t = common.log2_logits(
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res,
            precision=precision,
        )
        p = common.probabilities(t, row_max, row_log2_sum)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = common.logit_gradient(p, dp, delta, keep)
        if dq_ref is not None:
            dq = plgpu.dot(ds.astype(k.dtype), k, precision=precision)
            common.store_rows(dq_ref, prefix, q_start, dq * scale, n_res, head_dim)
        return dbias + ds

    rows = q_ref.shape[0]
    dbias = jax.lax.fori_loop(
        0, rows, visit_msa_row, jnp.zeros((block_q, block_k), jnp.float32)
    )
    plgpu.store(
        common.bias_view(dbias_ref, q_start, k_start, block_q, block_k),
        dbias.astype(dbias_ref.dtype),
        mask=common.tile_mask(q_start, k_start, block_q, block_k, n_res),
    )


def _dbias_kernel(*refs, **static):
    *operand_refs, dbias_ref = refs
    _bias_gradient_body(*operand_refs, None, dbias_ref, **static)


def _dq_dbias_kernel(*refs, **static):
    _bias_gradient_body(*refs, **static)


def _row_chunk_specs(rows_per_chunk: int, n_res: int, d_pad: int):
    """Specs for a (q tile, k tile, row chunk, h, b) grid whose programs see
    `rows_per_chunk` consecutive MSA rows, and the `[chunks, B, H, N, N]`
    partial bias gradient they write."""
    rows = rows_per_chunk
    return dict(
        rows=pl.BlockSpec(
            (None, rows, n_res, None, d_pad), lambda i, j, c, h, b: (b, c, 0, h, 0)
        ),
        bias=pl.BlockSpec((None, None, n_res, n_res), lambda i, j, c, h, b: (b, h, 0, 0)),
        mask=pl.BlockSpec((None, rows, n_res), lambda i, j, c, h, b: (b, c, 0)),
        stats=pl.BlockSpec((None, rows, None, n_res), lambda i, j, c, h, b: (b, c, h, 0)),
        partial_bias=pl.BlockSpec(
            (None, None, None, n_res, n_res), lambda i, j, c, h, b: (c, b, h, 0, 0)
        ),
    )


def _call_over_row_chunks(kernel, tiles, operands, *, key_tiles, row_out, name, interpret):
    """Runs a kernel that loops over S on a (q tile, key_tiles, chunk, h, b)
    grid and sums the chunks' partial bias gradients.

    Returns (dq or None, dbias): dq `[B, S, N, H, d]` when `row_out`.
    """
    q, bias, mask = operands[0], operands[3], operands[4]
    batch, rows, n_res, heads, head_dim = q.shape
    query_tiles = pl.cdiv(n_res, tiles.block_q)
    chunks = row_chunks(query_tiles * key_tiles * heads * batch, rows)
    specs = _row_chunk_specs(rows // chunks, n_res, padded_head_dim(head_dim))
    # One chunk writes the gradient in the bias dtype; several write float32
    # partial sums, added here.
    partial = jax.ShapeDtypeStruct(
        (chunks, *bias.shape), bias.dtype if chunks == 1 else jnp.float32
    )
    out_specs, out_shape = [specs["partial_bias"]], [partial]
    if row_out:
        out_specs.insert(0, specs["rows"])
        out_shape.insert(0, jax.ShapeDtypeStruct(q.shape, q.dtype))
    results = common.pallas_call(
        kernel, tiles,
        grid=(query_tiles, key_tiles, chunks, heads, batch),
        in_specs=[
            specs["rows"], specs["rows"], specs["rows"], specs["bias"],
            None if mask is None else specs["mask"],
            specs["rows"], specs["stats"], specs["stats"], specs["stats"],
        ],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
    )(*operands)
    dbias = results[-1][0] if chunks == 1 else results[-1].sum(axis=0).astype(bias.dtype)
    return (results[0] if row_out else None), dbias


def _operand_specs(n_res: int, d_pad: int, has_mask: bool):
    """In-specs of the per-row kernels (dk/dv and dq), on a (tile, s, h, b) grid."""
    row_spec, stat_spec = row_specs(n_res, d_pad), stats_spec(n_res)
    return [
        row_spec, row_spec, row_spec, bias_spec(n_res),
        mask_spec(n_res) if has_mask else None,
        row_spec, stat_spec, stat_spec, stat_spec,
    ]


def _bind(body, scale, n_res, head_dim, tiles, dtype, interpret):
    return functools.partial(
        body, scale=scale, n_res=n_res, head_dim=head_dim,
        block_q=tiles.block_q, block_k=tiles.block_k,
        precision=common.dot_precision(dtype, interpret, padded_head_dim(head_dim)),
    )


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dkdv(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dk, dv `[B, S, N, H, d]` in q's dtype (arguments as in the module docstring)."""
    batch, rows, n_res, heads, head_dim = q.shape
    d_pad = padded_head_dim(head_dim)
    row_grad = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return common.pallas_call(
        _bind(_dkdv_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret), tiles,
        grid=(pl.cdiv(n_res, tiles.block_k), rows, heads, batch),
        in_specs=_operand_specs(n_res, d_pad, mask is not None),
        out_specs=[row_specs(n_res, d_pad)] * 2, out_shape=[row_grad, row_grad],
        interpret=interpret, name="msa_row_attention_bwd_dkdv",
    )(q, k, v, bias, mask, do, row_max, row_log2_sum, delta)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dq(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dq `[B, S, N, H, d]` in q's dtype (arguments as in the module docstring)."""
    batch, rows, n_res, heads, head_dim = q.shape
    d_pad = padded_head_dim(head_dim)
    return common.pallas_call(
        _bind(_dq_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret), tiles,
        grid=(pl.cdiv(n_res, tiles.block_q), rows, heads, batch),
        in_specs=_operand_specs(n_res, d_pad, mask is not None),
        out_specs=row_specs(n_res, d_pad), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret, name="msa_row_attention_bwd_dq",
    )(q, k, v, bias, mask, do, row_max, row_log2_sum, delta)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dbias(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dbias `[B, H, N, N]` in the bias dtype, summed over the S MSA rows."""
    n_res, head_dim = q.shape[2], q.shape[4]
    _, dbias = _call_over_row_chunks(
        _bind(_dbias_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret), tiles,
        (q, k, v, bias, mask, do, row_max, row_log2_sum, delta),
        key_tiles=pl.cdiv(n_res, tiles.block_k), row_out=False,
        name="msa_row_attention_bwd_dbias", interpret=interpret,
    )
    return dbias


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dq_dbias(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dq `[B, S, N, H, d]` in q's dtype and dbias `[B, H, N, N]` in the bias
    dtype from one kernel. `tiles.block_k` must be >= N: one key tile spans
    every key."""
    n_res, head_dim = q.shape[2], q.shape[4]
    if tiles.block_k < n_res:
        raise ValueError(
            f"backward_dq_dbias needs tiles.block_k >= N; got block_k={tiles.block_k}, N={n_res}."
        )
    return _call_over_row_chunks(
        _bind(_dq_dbias_kernel, scale, n_res, head_dim, tiles, q.dtype, interpret), tiles,
        (q, k, v, bias, mask, do, row_max, row_log2_sum, delta),
        key_tiles=1, row_out=True, name="msa_row_attention_bwd_dq_dbias", interpret=interpret,
    )
