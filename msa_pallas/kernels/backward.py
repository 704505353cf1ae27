"""The Pallas backward kernels: dk/dv, dq, and the bias gradient summed over S.

Each kernel recomputes the probabilities of its tiles from q, k, the bias and
the forward's row statistics (`common.probabilities`), so no `[S, H, N, N]`
array exists. The three kernels own disjoint outputs, so no atomics are used
and two runs give bitwise identical gradients:

- dk/dv: one program per key tile of one (batch, MSA row, head), looping
  over query tiles.
- dq: one program per query tile of one (batch, MSA row, head), looping over
  key tiles.
- dbias: one program per (query tile, key tile) of one (batch, head),
  looping over the S MSA rows; the sum over S stays in registers and the
  bias tile is read once.

Inputs shared by all three: q, k, v `[B, S, N, H, d]`; bias `[B, H, N, N]`;
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

from msa_pallas.block_sizes import padded_head_dim
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
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int,
):
    k_start = pl.program_id(0) * block_k
    k = common.load_rows(k_ref, (), k_start, block_k, n_res, head_dim)
    v = common.load_rows(v_ref, (), k_start, block_k, n_res, head_dim)
    keep = common.load_key_keep(mask_ref, (), k_start, block_k, n_res)
    precision = common.dot_precision(k.dtype)

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
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res
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
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int,
):
    q_start = pl.program_id(0) * block_q
    q = common.load_rows(q_ref, (), q_start, block_q, n_res, head_dim)
    do = common.load_rows(do_ref, (), q_start, block_q, n_res, head_dim)
    row_max, row_log2_sum, delta = _query_tile_stats(
        row_max_ref, row_log2_sum_ref, delta_ref, (), q_start, block_q, n_res
    )
    precision = common.dot_precision(q.dtype)

    def visit_key_tile(key_tile, dq):
        k_start = key_tile * block_k
        k = common.load_rows(k_ref, (), k_start, block_k, n_res, head_dim)
        v = common.load_rows(v_ref, (), k_start, block_k, n_res, head_dim)
        keep = common.load_key_keep(mask_ref, (), k_start, block_k, n_res)
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        t = common.log2_logits(
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res
        )
        p = common.probabilities(t, row_max, row_log2_sum)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = common.logit_gradient(p, dp, delta, keep)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    dq = jax.lax.fori_loop(
        0, pl.cdiv(n_res, block_k), visit_key_tile, jnp.zeros(q.shape, jnp.float32)
    )
    common.store_rows(dq_ref, (), q_start, dq * scale, n_res, head_dim)


def _dbias_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, row_max_ref, row_log2_sum_ref, delta_ref,
    dbias_ref,
    *, scale: float, n_res: int, head_dim: int, block_q: int, block_k: int,
):
    q_start = pl.program_id(0) * block_q
    k_start = pl.program_id(1) * block_k
    # The bias tile is the same for every MSA row: read it once.
    bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
    precision = common.dot_precision(q_ref.dtype)

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
            q, k, bias, keep, k_start, qk_scale_log2=scale * common.LOG2E, n_res=n_res
        )
        p = common.probabilities(t, row_max, row_log2_sum)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        return dbias + common.logit_gradient(p, dp, delta, keep)

    rows = q_ref.shape[0]
    dbias = jax.lax.fori_loop(
        0, rows, visit_msa_row, jnp.zeros((block_q, block_k), jnp.float32)
    )
    plgpu.store(
        common.bias_view(dbias_ref, q_start, k_start, block_q, block_k),
        dbias.astype(dbias_ref.dtype),
        mask=common.tile_mask(q_start, k_start, block_q, block_k, n_res),
    )


def _all_rows_specs(rows: int, n_res: int, d_pad: int):
    """Specs for a (q tile, k tile, h, b) grid whose programs see all S MSA rows."""
    return dict(
        rows=pl.BlockSpec(
            (None, rows, n_res, None, d_pad), lambda i, j, h, b: (b, 0, 0, h, 0)
        ),
        bias=pl.BlockSpec((None, None, n_res, n_res), lambda i, j, h, b: (b, h, 0, 0)),
        mask=pl.BlockSpec((None, rows, n_res), lambda i, j, h, b: (b, 0, 0)),
        stats=pl.BlockSpec((None, rows, None, n_res), lambda i, j, h, b: (b, 0, h, 0)),
    )


def _operand_specs(n_res: int, d_pad: int, has_mask: bool):
    """In-specs of the per-row kernels (dk/dv and dq), on a (tile, s, h, b) grid."""
    row_spec, stat_spec = row_specs(n_res, d_pad), stats_spec(n_res)
    return [
        row_spec, row_spec, row_spec, bias_spec(n_res),
        mask_spec(n_res) if has_mask else None,
        row_spec, stat_spec, stat_spec, stat_spec,
    ]


def _bind(body, scale, n_res, head_dim, tiles):
    return functools.partial(
        body, scale=scale, n_res=n_res, head_dim=head_dim,
        block_q=tiles.block_q, block_k=tiles.block_k,
    )


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dkdv(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dk, dv `[B, S, N, H, d]` in q's dtype (arguments as in the module docstring)."""
    batch, rows, n_res, heads, head_dim = q.shape
    d_pad = padded_head_dim(head_dim)
    row_grad = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return common.pallas_call(
        _bind(_dkdv_kernel, scale, n_res, head_dim, tiles), tiles,
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
        _bind(_dq_kernel, scale, n_res, head_dim, tiles), tiles,
        grid=(pl.cdiv(n_res, tiles.block_q), rows, heads, batch),
        in_specs=_operand_specs(n_res, d_pad, mask is not None),
        out_specs=row_specs(n_res, d_pad), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret, name="msa_row_attention_bwd_dq",
    )(q, k, v, bias, mask, do, row_max, row_log2_sum, delta)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def backward_dbias(q, k, v, bias, mask, do, row_max, row_log2_sum, delta, *, scale, tiles, interpret):
    """dbias `[B, H, N, N]` in the bias dtype, summed over the S MSA rows."""
    batch, rows, n_res, heads, head_dim = q.shape
    specs = _all_rows_specs(rows, n_res, padded_head_dim(head_dim))
    return common.pallas_call(
        _bind(_dbias_kernel, scale, n_res, head_dim, tiles), tiles,
        grid=(pl.cdiv(n_res, tiles.block_q), pl.cdiv(n_res, tiles.block_k), heads, batch),
        in_specs=[
            specs["rows"], specs["rows"], specs["rows"], specs["bias"],
            None if mask is None else specs["mask"],
            specs["rows"], specs["stats"], specs["stats"], specs["stats"],
        ],
        out_specs=specs["bias"], out_shape=jax.ShapeDtypeStruct(bias.shape, bias.dtype),
        interpret=interpret, name="msa_row_attention_bwd_dbias",
    )(q, k, v, bias, mask, do, row_max, row_log2_sum, delta)
