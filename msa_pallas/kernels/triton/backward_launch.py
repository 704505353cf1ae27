"""How the Triton backward kernels are launched (`backward.py` holds the
kernels): the per-row grid of dk/dv and dq, and the row-chunked grid of the
kernels that loop over S (dbias, dq+dbias), whose chunks' float32 partial
bias gradients are added here. Operands and shapes as in `backward.py`'s
module docstring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from msa_pallas.block_sizes import padded_head_dim, row_chunks
from msa_pallas.kernels import key_tiles as mask_summary  # `key_tiles` names a count here
from msa_pallas.kernels.triton import common
from msa_pallas.kernels.triton.forward import (
    bias_spec, mask_spec, qkv_spec, seeds_spec, spans_spec, stats_spec,
)


def row_chunk_specs(rows_per_chunk: int, n_res: int, d_pad: int):
    """Specs for a (q tile, k tile, row chunk, h, b) grid whose programs see
    `rows_per_chunk` consecutive MSA rows, and the `[chunks, B, H, N, N]`
    partial bias gradient they write."""
    rows = rows_per_chunk
    return dict(
        qkv=pl.BlockSpec(
            (None, rows, n_res, None, d_pad), lambda i, j, c, h, b: (b, c, 0, h, 0)
        ),
        bias=pl.BlockSpec((None, None, n_res, n_res), lambda i, j, c, h, b: (b, h, 0, 0)),
        mask=pl.BlockSpec((None, rows, n_res), lambda i, j, c, h, b: (b, c, 0)),
        stats=pl.BlockSpec((None, rows, None, n_res), lambda i, j, c, h, b: (b, c, h, 0)),
        # Live rows and kept keys per batch element: four `[B]` (`key_tiles.live_extents`).
        extent=(pl.BlockSpec((None,), lambda i, j, c, h, b: (b,)),) * 4,
        # `[B, S, H, 1]` dropout seeds (`common.dropout_operand`).
        seeds=pl.BlockSpec((None, rows, None, 1), lambda i, j, c, h, b: (b, c, h, 0)),
        partial_bias=pl.BlockSpec(
            (None, None, None, n_res, n_res), lambda i, j, c, h, b: (c, b, h, 0, 0)
        ),
    )


def call_over_row_chunks(
    kernel, tiles, operands, seeds, *, key_tiles, row_out, dbias_dtype, name, interpret,
    skip_padding,
):
    """Runs a kernel that loops over S on a (q tile, key_tiles, chunk, h, b)
    grid and sums the chunks' partial bias gradients.

    Returns (dq or None, dbias): dq `[B, S, N, H, d]` when `row_out`, dbias
    `[B, H, N, N]` in `dbias_dtype`.
    """
    q, bias, mask = operands[0], operands[3], operands[4]
    batch, num_msa_rows, n_res, heads, head_dim = q.shape
    query_tiles = pl.cdiv(n_res, tiles.block_q)
    chunks = row_chunks(query_tiles * key_tiles * heads * batch, num_msa_rows)
    specs = row_chunk_specs(num_msa_rows // chunks, n_res, padded_head_dim(head_dim))
    extents = None
    if mask is not None and skip_padding:
        # block_k >= N (dq+dbias) gives one key tile: the rows that keep any key.
        extents = mask_summary.live_extents(*mask_summary.key_spans(mask, n_res))
    # One chunk writes the gradient in dbias_dtype; several write float32
    # partial sums, added here.
    partial = jax.ShapeDtypeStruct(
        (chunks, *bias.shape), dbias_dtype if chunks == 1 else jnp.float32
    )
    out_specs, out_shape = [specs["partial_bias"]], [partial]
    if row_out:
        out_specs.insert(0, specs["qkv"])
        out_shape.insert(0, jax.ShapeDtypeStruct(q.shape, q.dtype))
    results = common.pallas_call(
        kernel, tiles,
        grid=(query_tiles, key_tiles, chunks, heads, batch),
        in_specs=[
            specs["qkv"], specs["qkv"], specs["qkv"], specs["bias"],
            None if mask is None else specs["mask"],
            specs["qkv"], specs["stats"], specs["stats"], specs["stats"],
            None if extents is None else specs["extent"],
            None if seeds is None else specs["seeds"],
        ],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
    )(*operands, extents, seeds)
    dbias = results[-1][0] if chunks == 1 else results[-1].sum(axis=0).astype(dbias_dtype)
    return (results[0] if row_out else None), dbias


def per_row_call(body, outputs: int, block: int, operands, dropout_seeds, *, scale, tiles,
                  interpret, skip_padding, dropout_rate, name):
    """Runs a per-row kernel (dk/dv: 2 outputs over key tiles of size
    `block`; dq: 1 over query tiles) on a (tile, S / msa_rows, h, b) grid:
    with a mask to skip by, the rows' spans of kept keys
    (`key_tiles.key_spans`) are one more operand; then the dropout seeds,
    or None.

    Returns the list of `outputs` gradients `[B, S, N, H, d]` in q's dtype.
    """
    q, mask = operands[0], operands[4]
    batch, num_msa_rows, n_res, heads, head_dim = q.shape
    d_pad = padded_head_dim(head_dim)
    msa_rows = tiles.msa_rows_for(num_msa_rows)
    seeds, threshold = common.dropout_operand(dropout_seeds, dropout_rate, q.shape)
    spans = None
    if mask is not None and skip_padding:
        spans = mask_summary.key_spans(mask, n_res)
    row_spec, stat_spec = qkv_spec(n_res, d_pad, msa_rows), stats_spec(n_res, msa_rows)
    in_specs = [
        row_spec, row_spec, row_spec, bias_spec(n_res),
        None if mask is None else mask_spec(n_res, msa_rows),
        row_spec, stat_spec, stat_spec, stat_spec,
        None if spans is None else spans_spec(msa_rows),
        None if seeds is None else seeds_spec(msa_rows),
    ]
    return common.pallas_call(
        bind(body, scale, n_res, head_dim, tiles, q.dtype, interpret, threshold,
              msa_rows=msa_rows), tiles,
        grid=(pl.cdiv(n_res, block), num_msa_rows // msa_rows, heads, batch),
        in_specs=in_specs, out_specs=[row_spec] * outputs,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * outputs,
        interpret=interpret, name=name,
    )(*operands, spans, seeds)


def bind(body, scale, n_res, head_dim, tiles, dtype, interpret, dropout_threshold, **extra):
    return functools.partial(
        body, scale=scale, n_res=n_res, head_dim=head_dim, dropout_threshold=dropout_threshold,
        block_q=tiles.block_q, block_k=tiles.block_k,
        precision=common.dot_precision(
            dtype, interpret, padded_head_dim(head_dim), tiles.float32_products
        ),
        **extra,
    )
