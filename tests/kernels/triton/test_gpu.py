"""The compiled Triton kernels on a GPU (every test here is marked `gpu` and
skipped elsewhere; see conftest.py).

The reference is float64, computed on the GPU under `jax.enable_x64(True)` by
an independent plain-jnp transcription of the op (`helpers.jnp_reference_fwd_bwd`,
itself checked against the NumPy reference on CPU), chunked over MSA rows so
the float64 logits fit in memory. Relative errors are printed with a
`[rel err]` prefix for the release notes: run with `pytest -s -m gpu`.

For the `long` and `longer` shapes the float64 reference of all S rows would
be large and slow, so those two cases take the first 16 MSA rows (S=16, noted
in the test id); `test_full_msa_long_rows` runs them at full S and checks the
first 16 rows and the bias gradient (summed over all S) against float64.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
from gpu_inputs import DTYPES, SHAPES, chunk_rows, device_inputs
from helpers import compare, fwd_bwd, tolerance

pytestmark = pytest.mark.gpu

PALLAS = "pallas"


def run_and_check(inputs, label, *, block_config=None, scale=None, reference_inputs=None):
    """Runs the op's forward and gradients and compares them with float64 of
    `reference_inputs` (default: the same inputs)."""
    shape = inputs.q.shape
    start = time.perf_counter()
    result = jax.block_until_ready(fwd_bwd(PALLAS, scale, block_config)(*inputs.args))
    elapsed = time.perf_counter() - start
    helpers.assert_shapes_dtypes_finite(result, inputs)
    reference = helpers.jnp_reference_fwd_bwd(
        inputs if reference_inputs is None else reference_inputs, scale,
        chunk_rows=chunk_rows(shape),
    )
    errors = compare(result, reference, tolerance(inputs.q.dtype), label)
    print(f"[gpu] {label}: first call (compile + run) {elapsed:.2f} s")
    return result, errors


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("shape_id", list(SHAPES))
def test_shapes_against_float64(shape_id, dtype_id, seed):
    shape = SHAPES[shape_id]
    inputs = device_inputs(seed, shape, DTYPES[dtype_id])
    run_and_check(inputs, f"gpu {shape_id} {shape} {dtype_id}")


@pytest.mark.parametrize("shape_id", ["train", "long-S16"])
def test_float32_products_everywhere(shape_id, seed):
    """float32 inputs with every kernel's products as six bf16 products
    (`KernelTiles.float32_products="bf16x6"`; the default has it in dq
    only), and with every kernel's as three TF32 products: both within the
    float32 tolerance of float64."""
    shape = SHAPES[shape_id]
    inputs = device_inputs(seed, shape, jnp.float32)
    base = msa_pallas.block_sizes.default_block_config(shape[2], shape[4], jnp.float32, jnp.float32)
    for products in ("bf16x6", "tf32x3"):
        config = dataclasses.replace(base, **{
            name: dataclasses.replace(getattr(base, name), float32_products=products)
            for name in ("forward", "backward_dkdv", "backward_dq", "backward_dbias")
        })
        run_and_check(inputs, f"gpu {shape_id} f32 {products}", block_config=config)


@pytest.mark.parametrize("shape_id", ["train", "extra", "long-S16"])
def test_bias_in_input_dtype(shape_id, seed):
    """A bf16 bias with bf16 inputs: its own tiles (default_block_config's
    16-bit-bias rules) and a bf16 bias gradient, summed in float32."""
    inputs = device_inputs(seed, SHAPES[shape_id], jnp.bfloat16, bias_dtype=jnp.bfloat16)
    result, _ = run_and_check(inputs, f"gpu {shape_id} bf16 bias bf16")
    assert result[1][3].dtype == jnp.bfloat16


@pytest.mark.parametrize("msa_rows", [2, 3])
def test_several_msa_rows_per_program(msa_rows, seed):
    """Forward, dk/dv and dq programs serving several MSA rows (S = 6: 2 or 3
    programs per head), against float64 and bitwise against one row each."""
    shape = (1, 6, 200, 4, 32)
    inputs = device_inputs(seed, shape, jnp.bfloat16)
    base = msa_pallas.block_sizes.default_block_config(200, 32, jnp.bfloat16, jnp.float32)
    rows = lambda tiles, r: dataclasses.replace(tiles, msa_rows=r)  # noqa: E731
    config = lambda r: dataclasses.replace(  # noqa: E731
        base, forward=rows(base.forward, r), backward_dkdv=rows(base.backward_dkdv, r),
        backward_dq=rows(base.backward_dq, r), backward_dq_dbias=None,
    )
    result, _ = run_and_check(inputs, f"gpu msa_rows={msa_rows}", block_config=config(msa_rows))
    one_row = jax.block_until_ready(fwd_bwd(PALLAS, None, config(1))(*inputs.args))
    for name, a, b in zip(helpers.RESULT_NAMES, jax.tree.leaves(result), jax.tree.leaves(one_row)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_bias(dtype, seed):
    """`round_bias=True`: the kernels read the float32 bias rounded to q's
    dtype; the results match float64 of the rounded bias, and the bias
    gradient comes back in float32."""
    inputs = device_inputs(seed, (1, 16, 384, 8, 32), dtype)
    rounded = inputs._replace(bias=inputs.bias.astype(dtype).astype(jnp.float32))

    def run(q, k, v, bias, mask, gate, dout):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation=PALLAS, round_bias=True)
        out, pullback = jax.vjp(f, q, k, v, bias, gate)
        return out, pullback(dout)

    result = jax.block_until_ready(jax.jit(run)(*inputs.args))
    assert result[1][3].dtype == jnp.float32
    reference = helpers.jnp_reference_fwd_bwd(rounded, chunk_rows=16)
    compare(result, reference, tolerance(dtype), f"gpu round_bias {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("shape_id, full_shape", [
    ("long", (1, 512, 1024, 8, 32)), ("longer", (1, 128, 2048, 8, 32)),
])
def test_full_msa_long_rows(shape_id, full_shape, seed):
    """All S rows through the kernels (bf16); out, dq, dk, dv, dgate of the first
    16 rows (which depend on no other row) and dbias (summed over all S rows,
    reference chunked) against float64."""
    inputs = device_inputs(seed, full_shape, jnp.bfloat16)
    result = jax.block_until_ready(fwd_bwd(PALLAS)(*inputs.args))
    helpers.assert_shapes_dtypes_finite(result, inputs)
    keep = 16
    reference = helpers.jnp_reference_fwd_bwd(
        inputs, chunk_rows=chunk_rows(full_shape), keep_rows=keep
    )
    out, grads = result
    first = lambda x: None if x is None else x[:, :keep]
    sliced = (first(out), tuple(g if i == 3 else first(g) for i, g in enumerate(grads)))
    compare(sliced, reference, 2e-2, f"gpu {shape_id} {full_shape} bf16 (rows :16, dbias all)")


def test_deterministic_train_bf16(seed):
    inputs = device_inputs(seed, SHAPES["train"], jnp.bfloat16)
    run = fwd_bwd(PALLAS)
    first = jax.tree.leaves(jax.block_until_ready(run(*inputs.args)))
    second = jax.tree.leaves(jax.block_until_ready(run(*inputs.args)))
    assert len(first) == 6
    for name, a, b in zip(helpers.RESULT_NAMES, first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name} differs between runs"


# Small and awkward cases: id -> (shape, dtype, device_inputs kwargs, block config)
T = msa_pallas.KernelTiles
SMALL = {
    "N37-d8": ((2, 4, 37, 3, 8), {}),
    "N37-d64": ((1, 4, 37, 2, 64), {}),
    "N70-d128": ((1, 3, 70, 2, 128), {}),
    "N5-d16": ((2, 3, 5, 2, 16), {}),
    "N300-d32-no-mask": ((1, 4, 300, 2, 32), dict(mask_rate=None)),
    "N37-d16-no-gate": ((1, 4, 37, 2, 16), dict(gate=False)),
}


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("case", list(SMALL))
def test_small_and_awkward(case, dtype_id, seed):
    shape, kw = SMALL[case]
    inputs = device_inputs(seed, shape, DTYPES[dtype_id], **kw)
    run_and_check(inputs, f"gpu {case} {dtype_id}")


def test_fp16_and_custom_scale(seed):
    inputs = device_inputs(seed, (1, 8, 100, 4, 32), jnp.float16)
    run_and_check(inputs, "gpu fp16 N100 scale=0.2", scale=0.2)


@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_small_tiles(dtype_id, seed):
    config = msa_pallas.BlockConfig(T(16, 16), T(16, 16), T(16, 16), T(16, 16))
    inputs = device_inputs(seed, (1, 3, 37, 2, 8), DTYPES[dtype_id])
    run_and_check(inputs, f"gpu N37 tiles 16x16 {dtype_id}", block_config=config)


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("fused", ["fused", "separate"])
@pytest.mark.parametrize("shape", [(1, 7, 256, 4, 32), (2, 5, 37, 2, 16), (1, 6, 500, 2, 64)])
def test_dq_dbias_fused_and_separate(shape, fused, dtype_id, seed):
    """The fused dq+dbias kernel (default for 16-bit inputs with N <= 512) and
    the separate dq and dbias kernels, each forced, at S prime or split into
    chunks, against float64."""
    dtype = DTYPES[dtype_id]
    config = msa_pallas.block_sizes.default_block_config(shape[2], shape[4], dtype)
    span = msa_pallas.block_sizes.next_power_of_2(shape[2])
    config = dataclasses.replace(
        config, backward_dq_dbias=T(16, span) if fused == "fused" else None
    )
    inputs = device_inputs(seed, shape, dtype)
    run_and_check(inputs, f"gpu {fused} dq+dbias {shape} {dtype_id}", block_config=config)


def test_poisoned_memory(seed):
    """Fill a large block of GPU memory with NaN, free it so the allocator hands
    it out again, then run forward and backward: any output element the kernels
    fail to write (tile tails, padded head-dim columns) would show as NaN."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 16 << 30)
    elements = int(min(limit // 2, 32 << 30) // 4)
    poison = jnp.full((elements,), jnp.nan, jnp.float32)
    poison.block_until_ready()
    poison.delete()
    del poison
    for shape, dtype in (((2, 4, 37, 3, 8), jnp.float32), ((1, 32, 200, 8, 32), jnp.bfloat16)):
        inputs = device_inputs(seed, shape, dtype)
        run_and_check(inputs, f"gpu poisoned {shape} {jnp.dtype(dtype).name}")
