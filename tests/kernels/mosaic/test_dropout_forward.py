"""Attention dropout in the Mosaic GPU forward kernel
(`kernels.mosaic.forward.attention_forward(..., dropout_seeds, dropout_rate=)`),
on the CPU in the Mosaic GPU interpreter, and lowered for CUDA.

The reference is float64 NumPy: the undropped softmax, the mask of
`msa_pallas.dropout.keep_mask` (the one definition of the random bits, on
GLOBAL residue positions), `o = (P * keep) @ v / (1 - rate)`, then the gate.
Cases: rates 0.1 and 0.5, N no whole number of tiles (and no multiple of 8),
masked keys and a fully masked row, with and without a gate, float32 and
16-bit biases, d = 8 with two heads per tile (each head its own seed), the
persistent grid. The row statistics saved for the backward are the
undropped ones; two seeds give different outputs; rate 0 traces exactly the
kernel without dropout. GPU cases at train-like sizes are marked `gpu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
import numpy_reference
from msa_pallas import dropout
from msa_pallas.attention import on_hopper
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.tiles import MosaicTiles

OUT_TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}
SMALL_TILES = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)


def random_seeds(seed: int, inputs) -> jax.Array:
    """Fresh uint32 row seeds `[B, S, H]` for `inputs` (`dropout.row_seeds`)."""
    batch, rows, _, heads, _ = inputs.q.shape
    return dropout.row_seeds(jax.random.key(seed), batch, rows, heads)


def reference(inputs, seeds, rate: float, scale: float):
    """float64 `(out, o)`: the gated output and the dropped, scaled, ungated
    attention output, `[B, S, N, H, d]` each."""
    q, k, v, bias, mask, gate, _ = inputs.args
    p = numpy_reference.probabilities(q, k, bias, mask, scale)  # [B, S, H, N, N]
    keep = np.asarray(dropout.keep_mask(seeds, q.shape[2], rate))
    v_heads = helpers.to_f64(v).transpose(0, 1, 3, 2, 4)
    o = np.einsum("bshij,bshjd->bshid", p * keep, v_heads) / (1.0 - rate)
    o = o.transpose(0, 1, 3, 2, 4)
    if gate is None:
        return o, o
    return o / (1.0 + np.exp(-helpers.to_f64(gate))), o


def run_forward(inputs, seeds, rate, tiles=SMALL_TILES, save_stats=True, **kwargs):
    q, k, v, bias, mask, gate, _ = inputs.args
    mask = None if mask is None else mask.astype(jnp.int8)
    return mosaic_forward.attention_forward(
        q, k, v, bias, mask, gate, seeds, scale=q.shape[-1] ** -0.5, tiles=tiles,
        interpret=True, save_stats=save_stats, dropout_rate=rate, **kwargs,
    )


# (B, S, N, H, d, q dtype, bias dtype, gate, rate, tiles): N = 72 runs past
# the last whole tile (two query and key tiles; without a mask the keys past
# N get a -inf logit, not a masked one), N = 37 is no multiple of 8
# (row views), d = 8 with H = 2 takes two heads per tile, each with its own
# seed; an odd S (one MSA row per CTA); the persistent grid (3 CTAs here).
CASES = {
    "rate0.1-N72-gate": (1, 2, 72, 1, 32, jnp.bfloat16, jnp.float32, True, 0.1, SMALL_TILES),
    "rate0.5-N37-fp16-bias16-nogate": (
        1, 2, 37, 2, 16, jnp.float16, jnp.float16, False, 0.5, SMALL_TILES,
    ),
    "rate0.5-N72-no-mask": (1, 2, 72, 1, 16, jnp.bfloat16, jnp.float32, True, 0.5, SMALL_TILES),
    "rate0.1-d8-pairs-odd-S": (1, 3, 72, 2, 8, jnp.bfloat16, jnp.float32, True, 0.1, SMALL_TILES),
    "rate0.5-persistent-B2": (
        2, 2, 72, 1, 32, jnp.bfloat16, jnp.bfloat16, True, 0.5,
        dataclasses.replace(SMALL_TILES, persistent=True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_with_dropout_against_float64(case, seed):
    batch, rows, n_res, heads, head_dim, dtype, bias_dtype, gate, rate, tiles = CASES[case]
    masked = "no-mask" not in case
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, dtype, bias_dtype=bias_dtype, gate=gate,
        mask_rate=0.2 if masked else None, fully_masked_row=(0, rows - 1) if masked else None,
    )
    seeds = random_seeds(seed, inputs)
    out, attention, row_max, row_log2_sum = run_forward(inputs, seeds, rate, tiles)
    expected_out, expected_o = reference(inputs, seeds, rate, head_dim**-0.5)
    tolerance = OUT_TOLERANCE[jnp.dtype(dtype)]
    errors = {
        "out": helpers.rel_err(out, expected_out), "attention": helpers.rel_err(attention, expected_o),
    }
    print(f"[rel err] mosaic forward, dropout, {case}: {errors}")
    assert out.dtype == dtype and attention.dtype == jnp.float32
    assert all(error <= tolerance for error in errors.values()), errors
    assert np.isfinite(np.asarray(row_max)).all() and np.isfinite(np.asarray(row_log2_sum)).all()


@pytest.mark.parametrize("persistent", [False, True], ids=["per-item", "persistent"])
def test_skipping_padding_with_dropout(persistent, seed):
    """`skip_masked=True` with dropout: the row group that keeps keys skips
    its masked last key tile; the dead group (rows 2 and 3), whose uniform
    weights are dropped too, is visited whole, not given the mean of v. The
    dead rows equal the visiting kernel's bit for bit, the live rows within
    float32 rounding (a skipped tile leaves out a rescaling by exp2 of an FMA
    residue), and every result float64's. N = 136: keys 68 on padding."""
    inputs = helpers.random_inputs(seed, 1, 4, 136, 1, 32, jnp.bfloat16)
    keep = helpers.padded_mask(1, 4, 136, seed, end_padding=0.5, dead=(2, 3))
    inputs = inputs._replace(mask=jnp.asarray(keep))
    seeds = random_seeds(seed, inputs)
    tiles = dataclasses.replace(SMALL_TILES, persistent=persistent)
    visited = run_forward(inputs, seeds, 0.3, tiles)
    skipped = run_forward(inputs, seeds, 0.3, tiles, skip_masked=True)
    dead = ~keep.any(-1)
    for name, x, y in zip(("out", "attention", "row_max", "row_log2_sum"), skipped, visited):
        x, y = helpers.to_f64(x), helpers.to_f64(y)
        helpers.assert_finite(x, name)
        np.testing.assert_array_equal(x[dead], y[dead], err_msg=f"{name} of dead rows")
        assert helpers.rel_err(x[~dead], y[~dead]) < 1e-5, name
    expected_out, expected_o = reference(inputs, seeds, 0.3, 32**-0.5)
    assert helpers.rel_err(skipped[0], expected_out) <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert helpers.rel_err(skipped[1], expected_o) <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)]


def test_statistics_are_the_undropped_ones_and_seeds_matter(seed):
    """The saved row max and log2 row sum are bitwise those of rate 0 (the
    backward recomputes the undropped softmax from them), while the outputs
    differ: between rate 0 and 0.5, and between two seeds at one rate. The
    same seeds give bitwise the same output."""
    inputs = helpers.random_inputs(seed, 1, 2, 72, 1, 32, jnp.bfloat16)
    seeds = random_seeds(seed, inputs)
    undropped = run_forward(inputs, None, 0.0)
    dropped = run_forward(inputs, seeds, 0.5)
    for name, x, y in zip(("row_max", "row_log2_sum"), undropped[2:], dropped[2:]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    other_seeds = seeds ^ jnp.uint32(0x9E3779B9)
    other = run_forward(inputs, other_seeds, 0.5, save_stats=False)
    again = run_forward(inputs, seeds, 0.5, save_stats=False)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    assert helpers.rel_err(dropped[0], undropped[0]) > 0.1
    assert helpers.rel_err(other, dropped[0]) > 0.1
    np.testing.assert_array_equal(as_f32(again), as_f32(dropped[0]))


def test_rate_0_traces_the_kernel_without_dropout():
    """With rate 0 the seeds are ignored: the wrapper (unjitted, so that
    both take the same arguments) traces exactly the jaxpr of the call
    without them; nothing of dropout reaches the kernel."""
    shape = (1, 2, 72, 2, 8)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 2, 72, 72), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 2, 72), jnp.int8)
    seeds = jax.ShapeDtypeStruct((1, 2, 2), jnp.uint32)
    bound = dict(scale=0.3, tiles=SMALL_TILES, interpret=True, save_stats=True)
    unjitted = mosaic_forward.attention_forward.__wrapped__

    def with_seeds(q, k, v, bias, mask, gate, seeds):
        return unjitted(q, k, v, bias, mask, gate, seeds, dropout_rate=0.0, **bound)

    def without(q, k, v, bias, mask, gate, seeds):
        del seeds
        return unjitted(q, k, v, bias, mask, gate, **bound)

    args = (q, q, q, bias, mask, q, seeds)
    assert str(jax.make_jaxpr(with_seeds)(*args)) == str(jax.make_jaxpr(without)(*args))


def test_bad_dropout_arguments(seed):
    inputs = helpers.random_inputs(seed, 1, 2, 64, 1, 16, jnp.bfloat16)
    seeds = random_seeds(seed, inputs)
    with pytest.raises(ValueError, match="needs dropout_seeds"):
        run_forward(inputs, None, 0.1)
    with pytest.raises(ValueError, match="expected uint32"):
        run_forward(inputs, seeds.astype(jnp.int32), 0.1)
    with pytest.raises(ValueError, match="expected uint32"):
        run_forward(inputs, seeds[:, :1], 0.1)
    with pytest.raises(ValueError, match="dropout rate"):
        run_forward(inputs, seeds, 1.0)


@pytest.mark.parametrize(
    "head_dim, persistent, skip_masked",
    [(32, False, False), (8, True, False), (32, True, True)],
    ids=["d32", "d8-persistent", "d32-persistent-skipping"],
)
def test_lowers_for_the_gpu_on_a_cpu(head_dim, persistent, skip_masked):
    """With dropout the kernel lowers for CUDA on a machine without a GPU
    (the word vectors' loads from GMEM in the wgmma row and column layouts,
    the keep mask's uint32 arithmetic): N = 200 runs past the last whole
    tile. Skipping padding, the bounds visit dead rows whole: no kernel
    fills them after."""
    shape = (1, 4, 200, 8, head_dim)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 200, 200), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 4, 200), jnp.int8)
    seeds = jax.ShapeDtypeStruct((1, 4, 8), jnp.uint32)
    tiles = mosaic_forward.default_tiles(
        shape, jnp.bfloat16, jnp.float32, save_stats=True, has_gate=True, persistent=persistent
    )

    def forward(q, k, v, bias, mask, gate, seeds):
        return mosaic_forward.attention_forward(
            q, k, v, bias, mask, gate, seeds, scale=0.2, tiles=tiles, interpret=False,
            save_stats=True, dropout_rate=0.1, skip_masked=skip_masked,
        )

    text = mosaic_lowering.lowered_for_cuda(forward, q, q, q, bias, mask, q, seeds)
    assert "mosaic_gpu" in text and "msa_fill_dead_rows" not in text


# (B, S, N, H, d): the train crop's N and H at fewer MSA rows, d = 8 of the
# extra-MSA stack, and N = 333 (no whole number of tiles).
GPU_SHAPES = {"train": (1, 16, 256, 8, 32), "extra": (1, 16, 384, 8, 8), "N333": (1, 8, 333, 8, 32)}


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() == "gpu" and not on_hopper(), reason="needs sm90")
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["bias-f32", "bias-bf16"])
@pytest.mark.parametrize("rate", [0.1, 0.5])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_forward_with_dropout(shape, rate, bias_dtype, seed):
    """The compiled kernel with its default tiles (persistent where they
    say) against float64, and bitwise repeatable."""
    batch, rows, n_res, heads, head_dim = GPU_SHAPES[shape]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, jnp.bfloat16, bias_dtype=bias_dtype,
        fully_masked_row=(0, rows - 1),
    )
    seeds = random_seeds(seed, inputs)
    tiles = mosaic_forward.default_tiles(
        inputs.q.shape, jnp.bfloat16, bias_dtype, save_stats=True, has_gate=True
    )
    q, k, v, bias, mask, gate, _ = inputs.args

    def forward():
        return jax.block_until_ready(mosaic_forward.attention_forward(
            q, k, v, bias, mask.astype(jnp.int8), gate, seeds, scale=head_dim**-0.5,
            tiles=tiles, interpret=False, save_stats=True, dropout_rate=rate,
        ))

    out, attention, _, _ = forward()
    expected_out, expected_o = reference(inputs, seeds, rate, head_dim**-0.5)
    errors = {
        "out": helpers.rel_err(out, expected_out), "attention": helpers.rel_err(attention, expected_o),
    }
    print(f"[rel err] mosaic forward, dropout {rate}, {shape}: {errors}")
    assert all(error <= OUT_TOLERANCE[jnp.dtype(jnp.bfloat16)] for error in errors.values())
    np.testing.assert_array_equal(
        np.asarray(forward()[0].astype(jnp.float32)), np.asarray(out.astype(jnp.float32))
    )
