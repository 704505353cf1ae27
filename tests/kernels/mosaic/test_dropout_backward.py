"""Attention dropout in the Mosaic GPU backward kernels (`backward_dkdv`,
`backward_dq`, `backward_dbias` with `dropout_seeds` and `dropout_rate`),
on the CPU in the Mosaic GPU interpreter, and lowered for CUDA.

The kernels are driven with the operands the op's vjp gives them: `do`
already divided by (1 - rate), and `delta = (1 - rate) sum_d do * o` with
`o` the dropped, scaled attention output; the row statistics are the
undropped softmax's (here from the Triton forward without dropout). The
reference is float64 NumPy: the gradients of `o = (P * keep) @ v / (1 -
rate)` for a random cotangent of o, with the mask of
`msa_pallas.dropout.keep_mask`. Cases: rates 0.1 and 0.5, N no whole number
of tiles (and no multiple of 8), masked keys and a fully masked row,
float32 and 16-bit biases, an odd S, d = 8 with two heads per tile (each
head its own seed), float32 inputs as bf16 pieces. Two seeds give
different gradients; rate 0 traces exactly the kernels without dropout.
GPU cases at train-like sizes are marked `gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
import numpy_reference
from msa_pallas import dropout
from msa_pallas.attention import on_hopper
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic.plan import dbias_plan, dkdv_plan, dq_plan
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles
from msa_pallas.kernels.triton import forward as triton_forward

SMALL = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)
SMALL_TILES = MosaicBackwardTiles(dkdv=SMALL, dq=SMALL, dbias=SMALL)
ONE_DBIAS_CONSUMER = MosaicBackwardTiles(
    dkdv=SMALL, dq=SMALL, dbias=MosaicTiles(block_q=64, block_k=128, num_stages=2, msa_rows=1),
)
GRADIENTS = ("dq", "dk", "dv", "dbias")


def random_seeds(seed: int, inputs) -> jax.Array:
    batch, rows, _, heads, _ = inputs.q.shape
    return dropout.row_seeds(jax.random.key(seed), batch, rows, heads)


def _heads_first(x):
    """`[B, S, N, H, d]` -> float64 `[B, S, H, N, d]`."""
    return helpers.to_f64(x).transpose(0, 1, 3, 2, 4)


def reference(inputs, seeds, rate: float, scale: float):
    """float64 `(o, (dq, dk, dv, dbias))`: the dropped, scaled attention
    output `[B, S, N, H, d]` and the gradients of `sum(o * dout)`."""
    q, k, v, bias, mask, _, dout = inputs.args
    p = numpy_reference.probabilities(q, k, bias, mask, scale)  # [B, S, H, N, N]
    keep = np.asarray(dropout.keep_mask(seeds, q.shape[2], rate))
    q_h, k_h, v_h, g_h = (_heads_first(x) for x in (q, k, v, dout))
    weights = p * keep / (1.0 - rate)
    o = np.einsum("bshij,bshjd->bshid", weights, v_h)
    dv = np.einsum("bshij,bshid->bshjd", weights, g_h)
    dp = np.einsum("bshid,bshjd->bshij", g_h, v_h) * keep / (1.0 - rate)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    if mask is not None:
        ds = np.where(np.asarray(mask)[:, :, None, None, :] != 0, ds, 0.0)
    dq = scale * np.einsum("bshij,bshjd->bshid", ds, k_h)
    dk = scale * np.einsum("bshij,bshid->bshjd", ds, q_h)
    back = lambda x: x.transpose(0, 1, 3, 2, 4)  # noqa: E731
    return back(o), (back(dq), back(dk), back(dv), ds.sum(axis=1))


def vjp_operands(inputs, o, rate: float):
    """The backward kernels' `(q, k, v, bias, mask, do, stats)` and scale as
    the vjp gives them with dropout: `do = dout / (1 - rate)` in q's dtype,
    the undropped row statistics (the Triton forward without dropout), and
    `delta = (1 - rate) sum_d do * o` from the float64 `o` (`reference`)."""
    q, k, v, bias, mask, _, dout = inputs.args
    mask = None if mask is None else mask.astype(jnp.int8)
    scale = q.shape[-1] ** -0.5
    tiles = default_block_config(q.shape[2], q.shape[-1], q.dtype, bias.dtype).forward
    _, _, row_max, row_log2_sum = triton_forward.attention_forward(
        q, k, v, bias, mask, None, scale=scale, tiles=tiles,
        interpret=jax.default_backend() != "gpu", save_stats=True,
    )
    do = (dout.astype(jnp.float32) / (1.0 - rate)).astype(q.dtype)
    delta = (1.0 - rate) * jnp.sum(do.astype(jnp.float32) * jnp.asarray(o, jnp.float32), -1)
    stats = jnp.stack([row_max, row_log2_sum, jnp.swapaxes(delta, 2, 3)], axis=3)
    return (q, k, v, bias, mask, do, stats), scale


def run_backward(operands, seeds, rate, scale, tiles: MosaicBackwardTiles, **kwargs):
    bound = dict(scale=scale, interpret=True, dropout_rate=rate, **kwargs)
    dk, dv = mosaic_backward.backward_dkdv(
        *operands, seeds, tiles=tiles.dkdv, ping_pong=tiles.ping_pong, **bound
    )
    dq = mosaic_backward.backward_dq(
        *operands, seeds, tiles=tiles.dq, ping_pong=tiles.ping_pong, **bound
    )
    dbias = mosaic_backward.backward_dbias(*operands, seeds, tiles=tiles.dbias, **bound)
    return dq, dk, dv, dbias


# (B, S, N, H, d, q dtype, bias dtype, rate, tiles, masked): MSA-row pairs
# over two query and key tiles with N = 72 past the last whole tile, with a
# mask (a fully masked row) and without one (the keys past N then pass no
# ds in dq); an odd S with a 16-bit bias and one dbias consumer at N = 37
# (no multiple of 8: row views); d = 8 with H = 2, two heads per tile in
# every kernel, each with its own seed; float32 inputs as bf16 pieces.
CASES = {
    "rate0.1-N72-bf16": (1, 2, 72, 1, 32, jnp.bfloat16, jnp.float32, 0.1, SMALL_TILES, True),
    "rate0.5-N72-no-mask": (1, 2, 72, 1, 32, jnp.bfloat16, jnp.float32, 0.5, SMALL_TILES, False),
    "rate0.5-N37-odd-S-fp16-bias16": (
        1, 3, 37, 1, 16, jnp.float16, jnp.float16, 0.5, ONE_DBIAS_CONSUMER, True,
    ),
    "rate0.1-d8-pairs": (1, 2, 72, 2, 8, jnp.bfloat16, jnp.float32, 0.1, SMALL_TILES, True),
    "rate0.5-float32-pieces-N45": (
        1, 2, 45, 1, 32, jnp.float32, jnp.float32, 0.5, SMALL_TILES, True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_backward_kernels_with_dropout_against_float64(case, seed):
    batch, rows, n_res, heads, head_dim, dtype, bias_dtype, rate, tiles, masked = CASES[case]
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, dtype, bias_dtype=bias_dtype, gate=False,
        mask_rate=0.2 if masked else None, fully_masked_row=(0, rows - 1) if masked else None,
    )
    seeds = random_seeds(seed, inputs)
    scale = head_dim**-0.5
    o, expected = reference(inputs, seeds, rate, scale)
    operands, scale = vjp_operands(inputs, o, rate)
    gradients = run_backward(operands, seeds, rate, scale, tiles)
    errors = {}
    for name, got, want in zip(GRADIENTS, gradients, expected):
        helpers.assert_finite(got, name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        errors[name] = helpers.rel_err(got, want)
    print(f"[rel err] mosaic backward, dropout, {case}: {errors}")
    tolerance = helpers.tolerance(dtype)
    assert all(error <= tolerance for error in errors.values()), errors


# MSA-row pairs, and one row per CTA in every kernel (dead rows 2 and 3 then
# each a group of their own).
ONE_ROW = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=1)
SKIPPING_TILES = {
    "row-pairs": SMALL_TILES,
    "one-row": MosaicBackwardTiles(dkdv=ONE_ROW, dq=ONE_ROW, dbias=ONE_ROW),
}


@pytest.mark.parametrize("tiles", list(SKIPPING_TILES))
def test_skipping_padding_with_dropout(tiles, seed):
    """`skip_masked=True` with dropout, on the vjp's operands: dq skips the
    masked last key tile of the live rows and the dead rows 2 and 3 (dq = 0
    there whatever is dropped), dk/dv skips that tile's query loops but
    visits the dead rows whole (their dv is their dropped uniform weights'
    product with `do`, not its mean), and dbias sums the live rows alone.
    dq, dk and dv equal the visiting kernels' bit for bit, dbias to float32
    rounding (its row chunks split other rows), all float64's."""
    tiles = SKIPPING_TILES[tiles]
    inputs = helpers.random_inputs(seed, 1, 4, 136, 1, 32, jnp.bfloat16, gate=False)
    keep = helpers.padded_mask(1, 4, 136, seed, end_padding=0.5, dead=(2, 3))
    inputs = inputs._replace(mask=jnp.asarray(keep))
    seeds = random_seeds(seed, inputs)
    rate, scale = 0.3, 32**-0.5
    o, expected = reference(inputs, seeds, rate, scale)
    operands, scale = vjp_operands(inputs, o, rate)
    visited = run_backward(operands, seeds, rate, scale, tiles)
    skipped = run_backward(operands, seeds, rate, scale, tiles, skip_masked=True)
    for name, x, y, want in zip(GRADIENTS, skipped, visited, expected):
        helpers.assert_finite(x, name)
        if name == "dbias":
            assert helpers.rel_err(x, y) < 1e-6, name
        else:
            np.testing.assert_array_equal(helpers.to_f64(x), helpers.to_f64(y), err_msg=name)
        error = helpers.rel_err(x, want)
        assert error <= helpers.tolerance(jnp.bfloat16), (name, error)
    dead = ~keep.any(-1)
    dv_mean = helpers.to_f64(operands[5])[dead].mean(axis=1, keepdims=True)
    assert helpers.rel_err(skipped[2][dead], np.broadcast_to(dv_mean, skipped[2][dead].shape)) > 0.05


def test_seeds_change_every_gradient(seed):
    """Two seeds at one rate give different gradients from every kernel;
    the same seeds give bitwise the same ones."""
    inputs = helpers.random_inputs(seed, 1, 2, 64, 1, 16, jnp.bfloat16, gate=False)
    seeds = random_seeds(seed, inputs)
    o, _ = reference(inputs, seeds, 0.5, 0.25)
    operands, scale = vjp_operands(inputs, o, 0.5)
    first = run_backward(operands, seeds, 0.5, scale, SMALL_TILES)
    other = run_backward(operands, seeds ^ jnp.uint32(0x9E3779B9), 0.5, scale, SMALL_TILES)
    again = run_backward(operands, seeds, 0.5, scale, SMALL_TILES)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    for name, x, y, z in zip(GRADIENTS, first, other, again):
        assert helpers.rel_err(y, x) > 0.1, name
        np.testing.assert_array_equal(as_f32(z), as_f32(x), err_msg=name)


KERNELS = ("backward_dkdv", "backward_dq", "backward_dbias")


@pytest.mark.parametrize("kernel", KERNELS)
def test_rate_0_traces_the_kernel_without_dropout(kernel):
    """With rate 0 the seeds are ignored: each wrapper (unjitted, so that
    both take the same arguments) traces exactly the jaxpr of the call
    without them."""
    shape = (1, 2, 72, 2, 8)
    operands = mosaic_lowering.backward_operands(shape, jnp.bfloat16, jnp.float32)
    seeds = jax.ShapeDtypeStruct((1, 2, 2), jnp.uint32)
    unjitted = getattr(mosaic_backward, kernel).__wrapped__
    bound = dict(scale=0.3, tiles=SMALL, interpret=True)

    def with_seeds(*args):
        return unjitted(*args, dropout_rate=0.0, **bound)

    def without(*args):
        return unjitted(*args[:-1], **bound)

    args = (*operands, seeds)
    assert str(jax.make_jaxpr(with_seeds)(*args)) == str(jax.make_jaxpr(without)(*args))


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_dropout_arguments(kernel, seed):
    inputs = helpers.random_inputs(seed, 1, 2, 64, 1, 16, jnp.bfloat16, gate=False)
    operands = mosaic_lowering.backward_operands(inputs.q.shape, jnp.bfloat16, jnp.float32)
    call = getattr(mosaic_backward, kernel)
    bound = dict(scale=0.25, tiles=SMALL, interpret=True, dropout_rate=0.1)
    seeds = random_seeds(seed, inputs)
    with pytest.raises(ValueError, match="needs dropout_seeds"):
        jax.eval_shape(lambda *a: call(*a, **bound), *operands)
    with pytest.raises(ValueError, match="expected uint32"):
        jax.eval_shape(lambda *a: call(*a, seeds.astype(jnp.int32), **bound), *operands)


# (shape, q dtype, bias dtype): d = 32 over tails (N = 200), d = 8 two heads
# per tile with a 16-bit bias, float32 pieces.
LOWERED = {
    "d32-N200": ((1, 4, 200, 8, 32), jnp.bfloat16, jnp.float32),
    "d8-pairs-bias-bf16": ((1, 4, 200, 8, 8), jnp.bfloat16, jnp.bfloat16),
    "float32": ((1, 4, 200, 8, 32), jnp.float32, jnp.float32),
}


@pytest.mark.parametrize(
    "case, skip_masked",
    [(case, False) for case in LOWERED] + [("d32-N200", True)],
    ids=list(LOWERED) + ["d32-N200-skipping"],
)
def test_lowers_for_the_gpu_on_a_cpu(case, skip_masked):
    """With dropout each kernel, with its default tiles with dropout, lowers
    for CUDA on a machine without a GPU (the word vectors' loads from GMEM
    and from shared memory in both orientations' layouts, their copies into
    the dbias ring, the keep mask's uint32 arithmetic). Skipping padding,
    dk/dv visits dead rows whole: it takes no means of `do`."""
    shape, dtype, bias_dtype = LOWERED[case]
    operands = mosaic_lowering.backward_operands(shape, dtype, bias_dtype)
    seeds = jax.ShapeDtypeStruct((shape[0], shape[1], shape[3]), jnp.uint32)
    tiles = mosaic_backward.default_tiles(shape, dtype, bias_dtype, dropout=True)
    for kernel, kernel_tiles in zip(KERNELS, (tiles.dkdv, tiles.dq, tiles.dbias)):
        call = getattr(mosaic_backward, kernel)

        def backward(*args, call=call, kernel_tiles=kernel_tiles):
            return call(*args, scale=0.2, tiles=kernel_tiles, interpret=False, dropout_rate=0.1,
                        skip_masked=skip_masked)

        text = mosaic_lowering.lowered_for_cuda(backward, *operands, seeds)
        assert "mosaic_gpu" in text and "msa_dead_row_means" not in text, kernel


PLANS = {"dkdv": dkdv_plan, "dq": dq_plan, "dbias": dbias_plan}


@pytest.mark.parametrize("kernel", list(PLANS))
@pytest.mark.parametrize("case", ["d32-N200", "d8-pairs-bias-bf16"])
def test_plans_with_dropout_are_what_the_lowered_kernels_allocate(case, kernel):
    """With dropout each backward plan counts its ring's word vectors: its
    bytes are the lowered kernel's, and its step barrier awaits their
    copies, one per consumer (dbias: one more, the step row's keys')."""
    shape, dtype, bias_dtype = LOWERED[case]
    operands = mosaic_lowering.backward_operands(shape, dtype, bias_dtype)
    seeds = jax.ShapeDtypeStruct((shape[0], shape[1], shape[3]), jnp.uint32)
    tiles = getattr(mosaic_backward.default_tiles(shape, dtype, bias_dtype, dropout=True), kernel)
    call = getattr(mosaic_backward, f"backward_{kernel}")
    used = mosaic_lowering.lowered_shared_memory(
        lambda *args: call(*args, scale=0.2, tiles=tiles, interpret=False, dropout_rate=0.1),
        *operands, seeds,
    )
    planned, plain = (
        PLANS[kernel](shape, dtype, bias_dtype, tiles, mask_dtype=jnp.int8, interpret=False,
                      dropout=dropout)
        for dropout in (True, False)
    )
    assert used == planned.shared_memory_bytes > plain.shared_memory_bytes
    word_copies = tiles.msa_rows + (kernel == "dbias")
    assert planned.arrivals("step") == plain.arrivals("step") + word_copies


# (B, S, N, H, d, q dtype): the train crop's N and H at fewer MSA rows, d =
# 8 of the extra-MSA stack (two heads per tile), N = 333 (no whole number of
# tiles), float32 inputs.
GPU_SHAPES = {
    "train": (1, 16, 256, 8, 32, jnp.bfloat16),
    "extra": (1, 16, 384, 8, 8, jnp.bfloat16),
    "N333": (1, 8, 333, 8, 32, jnp.bfloat16),
    "float32": (1, 8, 256, 8, 32, jnp.float32),
}


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() == "gpu" and not on_hopper(), reason="needs sm90")
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["bias-f32", "bias-bf16"])
@pytest.mark.parametrize("rate", [0.1, 0.5])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_backward_with_dropout(shape, rate, bias_dtype, seed):
    """The compiled kernels with their default tiles against float64, and
    bitwise repeatable."""
    batch, rows, n_res, heads, head_dim, dtype = GPU_SHAPES[shape]
    if dtype == jnp.float32 and bias_dtype != jnp.float32:
        pytest.skip("float32 inputs take a float32 bias")
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, dtype, bias_dtype=bias_dtype, gate=False,
        fully_masked_row=(0, rows - 1),
    )
    seeds = random_seeds(seed, inputs)
    o, expected = reference(inputs, seeds, rate, head_dim**-0.5)
    operands, scale = vjp_operands(inputs, o, rate)
    tiles = mosaic_backward.default_tiles(inputs.q.shape, dtype, bias_dtype)

    def backward():
        bound = dict(scale=scale, interpret=False, dropout_rate=rate)
        turns = dict(ping_pong=tiles.ping_pong)
        dk, dv = mosaic_backward.backward_dkdv(*operands, seeds, tiles=tiles.dkdv, **turns, **bound)
        dq = mosaic_backward.backward_dq(*operands, seeds, tiles=tiles.dq, **turns, **bound)
        dbias = mosaic_backward.backward_dbias(*operands, seeds, tiles=tiles.dbias, **bound)
        return jax.block_until_ready((dq, dk, dv, dbias))

    gradients = backward()
    errors = {name: helpers.rel_err(g, e) for name, g, e in zip(GRADIENTS, gradients, expected)}
    print(f"[rel err] mosaic backward, dropout {rate}, {shape}: {errors}")
    assert all(error <= helpers.tolerance(dtype) for error in errors.values()), errors
    for name, x, y in zip(GRADIENTS, backward(), gradients):
        np.testing.assert_array_equal(
            np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)), err_msg=name
        )
