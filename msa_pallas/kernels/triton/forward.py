"""The Pallas forward kernel: flash-style biased, masked, gated row attention.

One program computes one query tile of one head for `tiles.msa_rows` MSA
rows of one batch element (every row shares the bias tiles): it walks
the key tiles with an online softmax (running max and sum in float32), reads
the key mask as a `[block_k]` vector and the pair bias as a
`[block_q, block_k]` tile, applies the sigmoid gate in the epilogue and, for
the backward, saves the row max and log2 row sum. No `[S, H, N, N]` array
exists anywhere.

With a key mask, the key loop runs between bounds read at run time: the
first and last key tiles that keep a key in the program's rows
(`key_tiles`); the tiles outside them would add exactly 0. A row that keeps
no key gets its uniform-weight results without a matrix product (with
dropout, which drops those weights too, it is visited whole).

With attention dropout (`dropout_rate > 0`), each weight of the softmax is
kept or dropped by `msa_pallas.dropout`'s hash of the row's seed and the
weight's global (query, key) position: the program hashes its query tile's
positions once and each key tile's once (vectors), and per weight only mixes
the two words and selects. The row max and sum are those of the undropped
weights; the kept ones multiply v and the output is divided by the keep
probability `1 - rate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas import dropout
from msa_pallas.block_sizes import KernelTiles, padded_head_dim
from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.triton import common


def _forward_kernel(
    q_ref, k_ref, v_ref, bias_ref, mask_ref, gate_ref, spans_ref, seeds_ref,  # inputs
    out_ref, attention_ref, row_max_ref, row_log2_sum_ref,  # outputs
    *, qk_scale_log2: float, n_res: int, head_dim: int, block_q: int, block_k: int,
    msa_rows: int, precision, dropout_threshold=None, keep_probability: float = 1.0,
):
    """`spans_ref`: the refs of this program's rows' spans of kept keys
    (`key_tiles.key_spans`, `[msa_rows]` each, or scalars for one row), or
    None: visit every key tile. `seeds_ref`: `[msa_rows, 1]` (or `[1]`) uint32
    dropout seeds of the rows, or None (no dropout); `dropout_threshold`
    (`dropout.keep_threshold`) and `keep_probability` (1 - rate) go with it."""
    q_start = pl.program_id(0) * block_q
    program_rows = common.program_rows_of(msa_rows)
    num_key_tiles = pl.cdiv(n_res, block_k)
    if spans_ref is None:
        first, end, dead_rows = 0, num_key_tiles, None
    else:
        # With dropout dead rows are visited whole: their dropped weights
        # have no shortcut.
        row_spans = [common.load_row_span(spans_ref, row) for row in program_rows]
        first, end = key_tiles.tile_span(row_spans, n_res=n_res, block_k=block_k,
                                         dead_rows_whole=seeds_ref is not None)
        dead_rows = None
        if seeds_ref is None:
            dead_rows = [row_end == 0 for _, row_end in row_spans]
    qs = [
        common.load_residues(q_ref, row, q_start, block_q, n_res, head_dim)
        for row in program_rows
    ]
    d_pad = qs[0].shape[-1]
    seeds = [common.load_dropout_seed(seeds_ref, row) for row in program_rows]
    query_words = [
        common.dropout_words(dropout.query_words, seed, q_start, block_q) for seed in seeds
    ]

    def visit_key_tile(key_tile, carry):
        k_start = key_tile * block_k
        # One bias tile for all of this program's MSA rows.
        bias = common.load_bias_tile(bias_ref, q_start, k_start, block_q, block_k, n_res)
        updated = []
        for row, q, seed, row_query_words, (acc, row_max, row_sum) in zip(
            program_rows, qs, seeds, query_words, carry
        ):
            k = common.load_residues(k_ref, row, k_start, block_k, n_res, head_dim)
            v = common.load_residues(v_ref, row, k_start, block_k, n_res, head_dim)
            keep = common.load_key_keep(mask_ref, row, k_start, block_k, n_res)
            t = common.log2_logits(
                q, k, bias, keep, k_start, qk_scale_log2=qk_scale_log2, n_res=n_res,
                precision=precision,
            )
            new_max = jnp.maximum(row_max, jnp.max(t, axis=1))
            rescale = jnp.exp2(row_max - new_max)
            p = jnp.exp2(t - new_max[:, None])
            row_sum = row_sum * rescale + jnp.sum(p, axis=1)
            key_words = common.dropout_words(dropout.key_words, seed, k_start, block_k)
            dropout_keep = common.dropout_keeps(row_query_words, key_words, dropout_threshold)
            if dropout_keep is not None:
                p = jnp.where(dropout_keep, p, 0.0)
            acc = acc * rescale[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
            updated.append((acc, new_max, row_sum))
        return tuple(updated)

    init = tuple(
        (
            jnp.zeros((block_q, d_pad), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
        for _ in program_rows
    )
    carry = common.tile_loop(first, end, visit_key_tile, init)
    for position, (row, (acc, row_max, row_sum)) in enumerate(zip(program_rows, carry)):
        if dead_rows is None:
            # Dropout's 1 / (1 - rate) on the row's normaliser: a vector.
            row_norm = row_sum if seeds_ref is None else row_sum * keep_probability
            out = acc / row_norm[:, None]
        else:
            out, row_max, row_sum = _dead_row_results(
                v_ref, row, dead_rows[position], acc, row_max, row_sum,
                n_res=n_res, head_dim=head_dim, block_k=block_k,
            )
        if attention_ref is not None:
            common.store_residues(attention_ref, row, q_start, out, n_res, head_dim)
        if gate_ref is not None:
            gate = common.load_residues(gate_ref, row, q_start, block_q, n_res, head_dim)
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
        common.store_residues(out_ref, row, q_start, out, n_res, head_dim)
        if row_max_ref is not None:
            common.store_vector(row_max_ref, row, q_start, row_max, n_res)
            common.store_vector(row_log2_sum_ref, row, q_start, jnp.log2(row_sum), n_res)


def _dead_row_results(v_ref, row, dead, acc, row_max, row_sum, *, n_res, head_dim, block_k):
    """(ungated output `[block_q, d_pad]`, row max, row sum) of one row: a
    dead row's (all keys masked, visited by no key tile) are what visiting
    every tile gives, uniform weights: the mean of v, the masked logit as
    the max and N as the sum; a live row's are its loop's."""
    block_q, d_pad = acc.shape
    row_sum = jnp.where(dead, jnp.float32(n_res), row_sum)
    row_max = jnp.where(dead, jnp.float32(common.MASKED_LOGIT_LOG2), row_max)
    v_mean = common.residue_mean(v_ref, row, dead, block_k, n_res, head_dim)
    out = jnp.where(
        dead, jnp.broadcast_to(v_mean[None, :], (block_q, d_pad)), acc / row_sum[:, None]
    )
    return out, row_max, row_sum


def _rows_block(msa_rows: int):
    return None if msa_rows == 1 else msa_rows


def qkv_spec(n_res: int, d_pad: int, msa_rows: int = 1) -> pl.BlockSpec:
    """`[B, S, N, H, d]` arrays, `msa_rows` MSA rows of one head per program
    of a (tile, S / msa_rows, h, b) grid."""
    return pl.BlockSpec(
        (None, _rows_block(msa_rows), n_res, None, d_pad), lambda t, s, h, b: (b, s, 0, h, 0)
    )


def bias_spec(n_res: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, n_res, n_res), lambda t, s, h, b: (b, h, 0, 0))


def mask_spec(n_res: int, msa_rows: int = 1) -> pl.BlockSpec:
    return pl.BlockSpec((None, _rows_block(msa_rows), n_res), lambda t, s, h, b: (b, s, 0))


def spans_spec(msa_rows: int = 1) -> tuple[pl.BlockSpec, pl.BlockSpec]:
    """The two `[B, S]` int32 arrays of the rows' spans of kept keys
    (`key_tiles.key_spans`)."""
    spec = pl.BlockSpec((None, _rows_block(msa_rows)), lambda t, s, h, b: (b, s))
    return spec, spec


def seeds_spec(msa_rows: int = 1) -> pl.BlockSpec:
    """`[B, S, H, 1]` uint32 dropout seeds (`common.dropout_operand`)."""
    return pl.BlockSpec((None, _rows_block(msa_rows), None, 1), lambda t, s, h, b: (b, s, h, 0))


def stats_spec(n_res: int, msa_rows: int = 1) -> pl.BlockSpec:
    """`[B, S, H, N]` float32 row statistics."""
    return pl.BlockSpec(
        (None, _rows_block(msa_rows), None, n_res), lambda t, s, h, b: (b, s, h, 0)
    )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "tiles", "interpret", "save_stats", "skip_padding", "dropout_rate"),
)
def attention_forward(
    q, k, v, bias, mask, gate, dropout_seeds=None, *, scale: float, tiles: KernelTiles,
    interpret: bool, save_stats: bool, skip_padding: bool = False, dropout_rate: float = 0.0,
):
    """Runs the forward kernel.

    Args:
      q, k, v: `[B, S, N, H, d]`, float16 / bfloat16 / float32.
      bias: `[B, H, N, N]` floating.
      mask: `[B, S, N]` int8 (nonzero keeps) or None.
      gate: `[B, S, N, H, d]` gate logits or None.
      dropout_seeds: `[B, S, H]` uint32 (`dropout.row_seeds`), or None;
        read only where `dropout_rate > 0`, and needed there.
      scale: multiplies q . k.
      tiles: forward tiles (block_q, block_k, num_warps, num_stages).
      interpret: run in Pallas interpret mode (CPU).
      save_stats: also return what the backward needs.
      skip_padding: with a mask, visit only the key tiles between the first
        and the last that keep a key in each row, and none in a row that
        keeps no key (`key_tiles`); False (the default; the op skips
        inside `skipping_padding`) visits every tile, as without a mask.
        The results are the same bit for bit, but for a row that keeps no
        key, whose mean of v is summed in another order. With dropout,
        which drops such a row's uniform weights too, that row is visited
        whole: bit for bit throughout.
      dropout_rate: attention dropout's rate in [0, 1), static: the softmax
        weights are dropped (`msa_pallas.dropout`) and the kept ones scaled
        by 1 / (1 - rate). 0 (the default) is the kernel without dropout.

    Returns:
      out `[B, S, N, H, d]` in q's dtype, and, if `save_stats`, the ungated
      attention output `[B, S, N, H, d]` in float32 (dropped and scaled
      with dropout) and the float32 row max and log2 row sum of the
      undropped weights, each `[B, S, H, N]`, in base-2 units.
    """
    seeds, threshold = common.dropout_operand(dropout_seeds, dropout_rate, q.shape)
    batch, num_msa_rows, n_res, heads, head_dim = q.shape
    d_pad = padded_head_dim(head_dim)
    msa_rows = tiles.msa_rows_for(num_msa_rows)
    grid = (pl.cdiv(n_res, tiles.block_q), num_msa_rows // msa_rows, heads, batch)
    kernel = functools.partial(
        _forward_kernel,
        qk_scale_log2=scale * common.LOG2E,
        n_res=n_res, head_dim=head_dim, block_q=tiles.block_q, block_k=tiles.block_k,
        msa_rows=msa_rows,
        precision=common.dot_precision(q.dtype, interpret, d_pad, tiles.float32_products),
        dropout_threshold=threshold, keep_probability=1.0 - float(dropout_rate),
    )
    qkv_block = qkv_spec(n_res, d_pad, msa_rows)
    # The mask's summary: int32 inputs only where there is a mask to skip by.
    spans = None
    if mask is not None and skip_padding:
        spans = key_tiles.key_spans(mask, n_res)
    in_specs = [
        qkv_block, qkv_block, qkv_block, bias_spec(n_res),
        None if mask is None else mask_spec(n_res, msa_rows),
        None if gate is None else qkv_block,
        None if spans is None else spans_spec(msa_rows),
        None if seeds is None else seeds_spec(msa_rows),
    ]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [qkv_block]
    if save_stats:
        stats = jax.ShapeDtypeStruct((batch, num_msa_rows, heads, n_res), jnp.float32)
        out_shape += [jax.ShapeDtypeStruct(q.shape, jnp.float32), stats, stats]
        out_specs += [qkv_block, stats_spec(n_res, msa_rows), stats_spec(n_res, msa_rows)]
    else:
        kernel = _without_stats(kernel)
    results = common.pallas_call(
        kernel, tiles, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, name="msa_row_attention_fwd",
    )(q, k, v, bias, mask, gate, spans, seeds)
    return tuple(results) if save_stats else results[0]


def _without_stats(kernel):
    def kernel_without_stats(*refs):
        return kernel(*refs, None, None, None)
    return kernel_without_stats
