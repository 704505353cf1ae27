"""The dead rows' kernels (`msa_pallas.kernels.triton.dead_rows`): the means
over residues and the forward output of the rows whose keys are all
masked, against float64 NumPy, in interpret mode on the CPU and compiled on
the GPU.

Outputs start poisoned (NaN): a dead row's element left unwritten stays
NaN, and every live row must come back NaN, bit for bit the buffer it was
(the fill writes in place and touches dead rows alone). Cases: N no whole
number of tiles, C = H·d no power of two, a mask wider than N whose keys
past N are kept (ignored), dead rows in the middle and at the end, a batch
element all padding, and no dead row at all.

`zero_masked_queries` starts from random outputs, NaN at the masked
residues (nothing of the output may be read): masked residues must come
back +0, every other element bit for bit what it was. Masks pad residues at
the end and in the middle, differently in each row, keep with any nonzero
value, and carry junk (zeros included) past N, to be ignored.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
from msa_pallas import exporting
from msa_pallas.kernels.triton import dead_rows

# (B, S, N, H, d, the rows made dead, the batch elements made all padding)
CASES = {
    "N37-C24-middle-and-end": ((2, 5, 37, 3, 8), (1, 4), ()),
    "N64-C64-dead-batch": ((2, 3, 64, 8, 8), (2,), (1,)),
    "N100-C256": ((1, 4, 100, 8, 32), (0, 3), ()),
    "no-dead-row": ((1, 3, 40, 2, 16), (), ()),
}


def random_case(case, seed, dtype=jnp.bfloat16):
    """(v, gate, do) in `dtype`, the keep mask `[B, S, N]` and the dead rows
    `[B, S]`; the mask handed to the kernels is 8 keys wider than N, those
    keys kept."""
    shape, dead, dead_batch = CASES[case]
    batch, rows, n_res = shape[:3]
    rng = np.random.default_rng(seed)
    v, gate, do = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))
    keep = helpers.padded_mask(batch, rows, n_res, seed, dead=dead, dead_batch=dead_batch)
    wide = np.concatenate([keep, np.ones((batch, rows, 8), bool)], axis=-1)
    return v, gate, do, jnp.asarray(wide, jnp.int8), ~keep.any(axis=-1)


def poisoned(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)


def check_means(do, mask, dead, *, interpret):
    n_res = do.shape[2]
    means = dead_rows.dead_row_means(do, mask, n_res=n_res, interpret=interpret)
    batch, rows = do.shape[:2]
    want = helpers.to_f64(do).reshape(batch, rows, n_res, -1).mean(axis=2)
    assert means.shape == want.shape and means.dtype == jnp.float32
    means = np.asarray(means)
    np.testing.assert_allclose(means[dead], want[dead], rtol=1e-5, atol=1e-6)
    # The rows that keep a key get 0 (the dk/dv kernel adds it to every dv).
    assert not means[~dead].any()


def check_fill(v, gate, mask, dead, *, interpret: bool):
    n_res = v.shape[2]
    out, means = dead_rows.fill_dead_rows(
        poisoned(v.shape, v.dtype), v, gate, mask, n_res=n_res, interpret=interpret
    )
    assert out.shape == v.shape and out.dtype == v.dtype
    mean = helpers.to_f64(v).mean(axis=2, keepdims=True)
    gated = mean if gate is None else mean / (1 + np.exp(-helpers.to_f64(gate)))
    out = np.asarray(out.astype(jnp.float32))
    assert np.isnan(out[~dead]).all(), "a live row's output was written"
    assert np.isfinite(out[dead]).all(), "a dead row's output was left unwritten"
    np.testing.assert_allclose(
        out[dead], np.broadcast_to(gated, out.shape)[dead], rtol=1e-2, atol=1e-2
    )
    # The dead rows' means of v, for the residuals; 0 in the other rows.
    batch, rows = v.shape[:2]
    assert means.shape == (batch, rows, math.prod(v.shape[3:])) and means.dtype == jnp.float32
    means = np.asarray(means)
    np.testing.assert_allclose(means[dead], mean.reshape(batch, rows, -1)[dead], rtol=1e-5,
                               atol=1e-6)
    assert not means[~dead].any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_dead_row_means(case, dtype, seed):
    _, _, do, mask, dead = random_case(case, seed, dtype)
    check_means(do, mask, dead, interpret=True)


@pytest.mark.parametrize("case", list(CASES))
def test_fill_writes_dead_rows_alone(case, seed):
    v, gate, _, mask, dead = random_case(case, seed)
    check_fill(v, gate, mask, dead, interpret=True)


def test_fill_without_a_gate(seed):
    v, _, _, mask, dead = random_case("N37-C24-middle-and-end", seed)
    check_fill(v, None, mask, dead, interpret=True)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_kernels_lower_for_the_gpu_with_the_fill_in_place(x64):
    """Both kernels lower to Triton for an H200 on this machine, with and
    without `jax_enable_x64`; the fill's call aliases every result it
    writes to the buffer it reads."""
    shape = (1, 4, 200, 8, 8)
    v = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, 4, 208), jnp.int8)

    def kernels(out, v, mask):
        means = dead_rows.dead_row_means(v, mask, n_res=200, interpret=False)
        return means, dead_rows.fill_dead_rows(out, v, v, mask, n_res=200, interpret=False)

    with jax.enable_x64(x64):
        text = mosaic_lowering.lowered_for_cuda(kernels, v, v, mask)
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 2, text[:2000]
    fill = next(line for line in text.splitlines() if "msa_fill_dead_rows" in line)
    assert fill.count("output_operand_alias<") == 1 and "operand_index = 3" in fill, fill[-800:]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_dead_row_kernels(case, seed):
    v, gate, do, mask, dead = random_case(case, seed)
    check_means(do, mask, dead, interpret=False)
    check_fill(v, gate, mask, dead, interpret=False)


# (B, S, N, H, d, the rows made dead, the batch elements made all padding, the
# residues masked in the odd rows (or None), whether any residue is masked)
ZERO_CASES = {
    "N37-C24-middle-and-end": ((2, 5, 37, 3, 8), (1, 4), (), (10, 15), True),
    "N100-C256-dead-batch": ((2, 3, 100, 8, 32), (0,), (1,), (40, 52), True),
    "N64-C256-2x128-first": ((1, 4, 64, 2, 128), (), (), (0, 9), True),
    "N100-C24-none-masked": ((1, 3, 100, 3, 8), (), (), None, False),
}


def zero_case(case, seed, dtype):
    """(out, the keep mask `[B, S, N]` bool, the mask handed to the kernel):
    out random in `dtype`, NaN at the masked residues; the kernel's mask
    int8, keeping with random nonzero values, 5 keys wider than N, those
    random (zeros included: ignored)."""
    shape, dead, dead_batch, middle, masks_any = ZERO_CASES[case]
    batch, rows, n_res = shape[:3]
    rng = np.random.default_rng(seed)
    if masks_any:
        keep = helpers.padded_mask(batch, rows, n_res, seed, middle=middle, dead=dead,
                                   dead_batch=dead_batch)
    else:
        keep = np.ones((batch, rows, n_res), bool)
    values = rng.choice(np.array([1, 2, -1, 127, -128], np.int8), keep.shape)
    junk = rng.integers(-128, 128, (batch, rows, 5)).astype(np.int8)
    mask = np.concatenate([np.where(keep, values, 0).astype(np.int8), junk], axis=-1)
    x = rng.standard_normal(shape)
    x[~keep] = np.nan
    return jnp.asarray(x, dtype), keep, jnp.asarray(mask)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def check_zero(out, keep, mask, *, interpret: bool):
    before = bits(out)  # read first: the kernel writes into a buffer aliased to out
    zeroed = dead_rows.zero_masked_queries(out, mask, n_res=out.shape[2], interpret=interpret)
    assert zeroed.shape == before.shape and zeroed.dtype == out.dtype
    after = bits(zeroed)
    assert not after[~keep].any(), "a masked residue is not +0"
    np.testing.assert_array_equal(after[keep], before[keep], "a kept residue was written")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_zero_masked_queries(case, dtype, seed):
    check_zero(*zero_case(case, seed, dtype), interpret=True)


@pytest.mark.parametrize("programs", [4, 16])
def test_zero_masked_queries_in_chunks_of_tiles(programs, seed, monkeypatch):
    """Programs that serve several tiles of a row's residues: N = 100 in 7
    tiles of 16 (C = 256), for 6 rows; with 4 programs wanted each serves
    a whole row, with 16 a chunk of 2 tiles (each row's last chunk, of
    one)."""
    monkeypatch.setattr(dead_rows, "_ZERO_PROGRAMS", programs)
    assert dead_rows._zero_tiles_per_program(6, 7) == {4: 7, 16: 2}[programs]
    check_zero(*zero_case("N100-C256-dead-batch", seed, jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_zero_masked_queries_lowers_for_the_gpu_in_place(x64):
    """The zeroing lowers to Triton for an H200 on this machine, with and
    without `jax_enable_x64`, its result aliased to the output it takes."""
    out = jax.ShapeDtypeStruct((1, 4, 200, 2, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, 4, 208), jnp.int8)

    def kernel(out, mask):
        return dead_rows.zero_masked_queries(out, mask, n_res=200, interpret=False)

    with jax.enable_x64(x64):
        text = mosaic_lowering.lowered_for_cuda(kernel, out, mask)
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 1, text[:2000]
    call = next(line for line in text.splitlines() if "msa_zero_masked_queries" in line)
    assert call.count("output_operand_alias<") == 1 and "operand_index = 1" in call, call[-800:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_gpu_zero_masked_queries(case, dtype, seed):
    check_zero(*zero_case(case, seed, dtype), interpret=False)
