"""The Mosaic GPU forward kernel's operands as it reads them, made in XLA
once per call: q, k, v and the gate as head pairs for d = 8, the bias in
the units of `q . k` with its rows padded, the mask padded, the inputs of
padding skipping (the mask's spans) or of dropout (the rows' query and key
words); and the kernel's output types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from msa_pallas.kernels.key_tiles import span_operands
from msa_pallas.kernels.mosaic.dropout_words import word_length, word_operands
from msa_pallas.kernels.mosaic.heads import as_head_pairs
from msa_pallas.kernels.mosaic.logits import accumulator_bias
from msa_pallas.kernels.mosaic.support import pad_bias_rows, pad_residues
from msa_pallas.kernels.mosaic.tiles import MosaicTiles


def forward_operands(
    q, k, v, bias, mask, gate, dropout_seeds, *, scale: float, tiles: MosaicTiles,
    msa_rows: int, pair: int, skips_masked: bool, save_stats: bool,
):
    """`(inputs, out_types)`: the kernel's inputs by name (None left out)
    and its outputs' `jax.ShapeDtypeStruct`s by name, in the kernel's order.

    Arguments as `forward.attention_forward`'s (`dropout_seeds` None without
    dropout); `pair`: heads per tile (`heads.heads_per_tile`);
    `skips_masked`: the kernel skips masked key tiles, reading the mask's
    spans (`key_tiles.span_operands`).
    The outputs are those of the head-pair view; the statistics' planes run
    to whole query tiles.
    """
    batch, rows, n_res, heads, _ = q.shape
    if pair > 1:
        # [..., H, 8] seen as [..., H / 2, 16]: heads 2h and 2h + 1 in one tile.
        q, k, v = (as_head_pairs(x, pair) for x in (q, k, v))
        gate = None if gate is None else as_head_pairs(gate, pair)

    bias = accumulator_bias(bias, scale)
    bias = pad_bias_rows(pad_residues(bias, swizzled=True))
    inputs = {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "gate": gate}
    if dropout_seeds is not None:
        inputs |= word_operands(dropout_seeds, word_length(n_res, tiles.block_q, tiles.block_k))
    if skips_masked:
        inputs |= span_operands(mask, n_res)
    if mask is not None:
        inputs["mask"] = pad_residues(mask, swizzled=False)
    inputs = {name: x for name, x in inputs.items() if x is not None}
    out_types = {"out": jax.ShapeDtypeStruct(q.shape, q.dtype)}
    query_tiles = pl.cdiv(n_res, tiles.block_q)
    if save_stats:
        # Whole query tiles, so that no statistics window runs past its plane.
        stats = jax.ShapeDtypeStruct((batch, rows, heads, query_tiles * tiles.block_q), jnp.float32)
        out_types |= {
            "attention": jax.ShapeDtypeStruct(q.shape, jnp.float32),
            "row_max": stats, "row_log2_sum": stats,
        }
    return inputs, out_types
