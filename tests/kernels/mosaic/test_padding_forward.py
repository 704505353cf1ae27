"""The Mosaic GPU forward on padded masks: it skips the key tiles and the
MSA rows the mask removes (`msa_pallas.kernels.key_tiles`), with the
results of visiting every tile.

The skipping kernel is held to the same kernel with `skip_masked=False`
(every key tile visited) within a few float32 roundings, on the CPU (the
Mosaic GPU interpreter) and on the GPU alike, and both to float64 NumPy.
Not bitwise: where the visiting kernel passes a fully masked tile, its
online softmax rescales by exp2(m·c - round(m·c)) (the row max m in base 2,
the subtraction contracted into an FMA), 1 within an ulp of m·c rather than
exactly 1; with |m·c| up to 16, that is up to 16 float32 roundings. Measured
on the H200: at most 2.4e-7 in the float32 residuals and one bf16 rounding
in 2 of 1,048,576 outputs.

The masks: padded residues at the end of every row (whole key tiles go),
padding in the middle of a row, dead rows (every key masked) alone in a
row pair, both rows of a pair dead (the pair's CTA visits no key tile), the
last row pairs dead (they have no work item), a batch element that is all
padding, a batch that is all padding (no CTA has an item), and masks that
change between rows. The dead rows' results are written after the kernel,
in place (`triton.dead_rows.fill_dead_rows`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
import numpy_reference
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.plan import zeroes_masked_queries
from msa_pallas.kernels.mosaic.tiles import MosaicTiles

OUT_TOLERANCE = 2e-2  # bf16 output against float64
TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)


def run(inputs, tiles, skip_masked, interpret):
    q, k, v, bias, mask, gate, _ = inputs.args
    return mosaic_forward.attention_forward(
        q, k, v, bias, jnp.asarray(mask).astype(jnp.int8), gate, scale=q.shape[-1] ** -0.5,
        tiles=tiles, interpret=interpret, save_stats=True, skip_masked=skip_masked,
    )


def check(inputs, tiles, *, interpret):
    """Skipping against visiting every tile (every output and residual),
    and against float64; the dead rows' outputs are their mean of v times
    the gate."""
    skipped = run(inputs, tiles, True, interpret)
    visited = run(inputs, tiles, False, interpret)
    for name, got, want in zip(("out", "attention", "row_max", "row_log2_sum"), skipped, visited):
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
        assert np.isfinite(got).all(), name
        # The visiting kernel's rescaling by a masked tile (module docstring).
        # In the bf16 output that is one rounding at most.
        roundings = 2 * float(jnp.finfo(jnp.bfloat16).eps) if name == "out" else (
            32 * float(jnp.finfo(jnp.float32).eps))
        scale = np.abs(want) + np.abs(want).mean() + (name == "row_log2_sum")
        np.testing.assert_array_less(np.abs(got - want), roundings * scale, err_msg=name)
    out = skipped[0]
    expected = numpy_reference.forward(*inputs.args[:6], scale=inputs.q.shape[-1] ** -0.5)
    assert helpers.rel_err(out, expected) <= OUT_TOLERANCE
    dead = ~np.asarray(inputs.mask).any(axis=-1)
    v_mean = helpers.to_f64(inputs.v).mean(axis=2, keepdims=True)
    gated = v_mean / (1 + np.exp(-helpers.to_f64(inputs.gate)))
    np.testing.assert_allclose(
        helpers.to_f64(out)[dead], np.broadcast_to(gated, out.shape)[dead], rtol=2e-2, atol=1e-2
    )


CPU_CASES = {
    # Key tile 3 of 4 is padding everywhere; row 1 dead beside a live row 0;
    # rows 4 and 5 (one CTA's pair) dead.
    "end-padding-dead-rows": dict(shape=(1, 6, 256, 1, 32), bias_dtype=jnp.float32,
                                  mask=dict(dead=(1, 4, 5))),
    # Two heads per tile (d = 8), N no whole number of key tiles, keys 64-127
    # masked in the odd rows, the second batch element all padding.
    "d8-middle-all-padding": dict(shape=(2, 4, 136, 2, 8), bias_dtype=jnp.bfloat16,
                                  mask=dict(middle=(64, 128), dead_batch=(1,))),
    # Every row dead: no row group has a work item.
    "all-padding": dict(shape=(1, 4, 64, 2, 16), bias_dtype=jnp.float32,
                        mask=dict(dead=(0, 1, 2, 3))),
    # Four rows per CTA: row 1 dead beside live rows, rows 4-7 (the second
    # group) dead, rows 8-11 live; keys 64-127 masked in the odd rows.
    "four-rows": dict(shape=(1, 12, 192, 1, 32), bias_dtype=jnp.float32,
                      mask=dict(middle=(64, 128), dead=(1, 4, 5, 6, 7)),
                      tiles=MosaicTiles(64, 64, 2, 4, ping_pong=False)),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_skipping_matches_visiting_every_tile(case, seed):
    spec = CPU_CASES[case]
    batch, rows, n_res, heads, head_dim = spec["shape"]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16, bias_dtype=spec["bias_dtype"]
    )
    inputs = inputs._replace(mask=jnp.asarray(helpers.padded_mask(batch, rows, n_res, seed, **spec["mask"])))
    check(inputs, spec.get("tiles", TILES), interpret=True)


def test_dead_row_means_hand_over_the_residuals_unselected(seed):
    """`dead_row_means=True` (for the backward's prologue kernel): the same
    output, live rows' residuals bit for bit the selected ones, and a fifth
    result, the dead rows' mean of v (0 for live rows); refused where dead
    rows are not skipped."""
    batch, rows, n_res, heads, head_dim = 1, 4, 64, 2, 16
    inputs = helpers.random_inputs(seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16)
    keep = helpers.padded_mask(batch, rows, n_res, seed, dead=(1, 3))
    q, k, v, bias, _, gate, _ = inputs.args
    mask = jnp.asarray(keep, jnp.int8)

    def forward(**options):
        return mosaic_forward.attention_forward(
            q, k, v, bias, mask, gate, scale=head_dim ** -0.5, tiles=TILES, interpret=True,
            save_stats=True, **options)

    selected = forward(skip_masked=True)
    *handed, means = forward(skip_masked=True, dead_row_means=True)
    dead = ~keep.any(axis=-1)
    np.testing.assert_array_equal(np.asarray(handed[0], np.float32),
                                  np.asarray(selected[0], np.float32))
    for got, want in zip(handed[1:], selected[1:]):
        np.testing.assert_array_equal(np.asarray(got)[~dead], np.asarray(want)[~dead])
    assert means.shape == (batch, rows, heads, head_dim) and means.dtype == jnp.float32
    v_mean = helpers.to_f64(v).mean(axis=2)
    np.testing.assert_allclose(np.asarray(means)[dead], v_mean[dead], rtol=1e-5, atol=1e-6)
    assert not np.asarray(means)[~dead].any()
    with pytest.raises(ValueError, match="dead_row_means"):
        forward(skip_masked=False, dead_row_means=True)


# Masked queries (`mask_queries`) on the persistent grid, whose kernel writes every
# zero of the output itself. (shape, mask, tiles, save_stats): "end" leaves query
# tile 2 of 3 (residues 128-135) without items, a partly masked tile 1, a dead row
# beside a live one, the last row pair dead and batch element 1 all padding;
# "d8-middle" two heads per tile and a masked tile in the middle of the odd rows;
# "four-rows" the padded training crop's tiles; "few-items" one live row and one
# query tile, two items for the interpreter's three CTAs (the third stores zeros
# alone); "no-gate" the query masks loaded alone, without a gate beside them.
MASKED_QUERY_CASES = {
    "end": ((2, 8, 136, 2, 16), dict(end_padding=0.27, dead=(1, 6, 7), dead_batch=(1,)),
            TILES, True),
    "d8-middle": ((1, 4, 192, 4, 8), dict(end_padding=0.0, middle=(64, 128), dead=(2, 3)),
                  TILES, False),
    "four-rows": ((1, 8, 128, 2, 32), dict(end_padding=0.5, dead=(1, 4, 5, 6, 7)),
                  MosaicTiles(64, 64, 2, 4, ping_pong=False), True),
    "few-items": ((1, 8, 40, 2, 16), dict(end_padding=0.2, dead=range(1, 8)), TILES, False),
    "no-gate": ((1, 4, 72, 2, 16), dict(end_padding=0.3, middle=(8, 24), dead=(3,)), TILES,
                True),
}


@pytest.mark.parametrize("case", list(MASKED_QUERY_CASES))
def test_persistent_kernel_writes_the_masked_queries_zeros(case, seed):
    """Where the mask masks queries too, the persistent kernel writes the
    zeros of every masked residue itself (`plan.zeroes_masked_queries`):
    its items zero their masked queries, and the producer's spare warp
    stores the zeros of the rows and query tiles without items, in boxes of
    whole rows. Its output is bitwise that of one CTA per item, whose zeros
    a kernel of their own writes after it (`zero_masked_queries`), and 0 at
    every masked residue; the output starts as NaN in the interpreter, so an
    element left unwritten fails. Live rows' residuals are bitwise too."""
    (batch, rows, n_res, heads, head_dim), mask_spec, tiles, save_stats = MASKED_QUERY_CASES[case]
    inputs = helpers.random_inputs(seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16)
    keep = helpers.padded_mask(batch, rows, n_res, seed, **mask_spec)
    q, k, v, bias, _, gate, _ = inputs.args
    if case == "no-gate":
        gate = None

    def forward(persistent):
        results = mosaic_forward.attention_forward(
            q, k, v, bias, jnp.asarray(keep, jnp.int8), gate, scale=head_dim ** -0.5,
            tiles=dataclasses.replace(tiles, persistent=persistent), interpret=True,
            save_stats=save_stats, skip_masked=True, mask_queries=True,
        )
        return [np.asarray(x.astype(jnp.float32)) for x in (results if save_stats else [results])]

    assert zeroes_masked_queries(True, dataclasses.replace(tiles, persistent=True))
    per_sm, per_item = forward(True), forward(False)
    out = per_sm[0]
    assert np.isfinite(out).all()
    assert not out[~keep].any()
    np.testing.assert_array_equal(out, per_item[0])
    live = keep.any(axis=-1)
    for got, want in zip(per_sm[1:], per_item[1:]):
        np.testing.assert_array_equal(got[live], want[live])


@pytest.mark.parametrize(
    "persistent, mask_queries", [(False, False), (True, False), (True, True)]
)
def test_skipping_kernel_lowers_for_the_gpu_on_a_cpu(persistent, mask_queries):
    """Its scalar loads of the bounds and of the row groups' count from GMEM
    lower for CUDA, persistent too; with masked queries, the producer warp
    that stores the zeros, whose last box per row (N = 200, boxes of 16
    residues) ends at N."""
    q = jnp.zeros((1, 4, 200, 8, 32), jnp.bfloat16)
    mask = jnp.zeros((1, 4, 200), jnp.int8)
    bias = jnp.zeros((1, 8, 200, 200), jnp.float32)
    tiles = MosaicTiles(128, 64, 2, 2, persistent=persistent)

    def forward(q, bias, mask):
        return mosaic_forward.attention_forward(
            q, q, q, bias, mask, q, scale=0.2, tiles=tiles, interpret=False, save_stats=True,
            skip_masked=True, mask_queries=mask_queries,
        )

    assert "mosaic_gpu" in mosaic_lowering.lowered_for_cuda(forward, q, bias, mask)


GPU_CASES = {
    "train-padded": dict(shape=(1, 16, 256, 8, 32), bias_dtype=jnp.float32,
                         mask=dict(dead=(12, 13, 14, 15, 3))),
    "N333-bf16-bias": dict(shape=(1, 8, 333, 8, 32), bias_dtype=jnp.bfloat16,
                           mask=dict(middle=(100, 230), dead=(5, 6, 7))),
    "d8-extra": dict(shape=(2, 8, 384, 8, 8), bias_dtype=jnp.float32,
                     mask=dict(dead=(6, 7), dead_batch=(1,))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_skipping_equals_visiting_every_tile(case, persistent, seed):
    spec = GPU_CASES[case]
    batch, rows, n_res, heads, head_dim = spec["shape"]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16, bias_dtype=spec["bias_dtype"]
    )
    inputs = inputs._replace(mask=jnp.asarray(helpers.padded_mask(batch, rows, n_res, seed, **spec["mask"])))
    tiles = mosaic_forward.default_tiles(
        inputs.q.shape, jnp.bfloat16, spec["bias_dtype"], save_stats=True, has_gate=True
    )
    check(inputs, dataclasses.replace(tiles, persistent=persistent), interpret=False)
