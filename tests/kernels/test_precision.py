"""float32 means float32: the kernels' matrix products, as they are traced for
a GPU, never use plain TF32 (the default of NVIDIA's matrix units).

On CPU the kernels run in interpret mode, which always computes at full
precision: a kernel that fell back to TF32 would pass every numeric CPU test.
So this test reads the precision of every product inside the kernels from the
program traced for a GPU (`msa_pallas.exporting.gpu_target`; tracing compiles
nothing, so it runs on any host). The layers' projections: tests/layers/test_numerics.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import helpers
import msa_pallas
import msa_pallas.exporting
import msa_pallas.kernels.triton.common

PALLAS = "pallas"


def _kernel_program_on_gpu(dtype, head_dim):
    """The jaxpr of forward + backward through the kernels, traced as for a GPU
    (`exporting.gpu_target`: compiled Triton kernels, not interpret mode), on
    this host: tracing compiles nothing."""
    shape = (1, 2, 20, 2, head_dim)
    rows = jax.ShapeDtypeStruct(shape, dtype)
    bias = jax.ShapeDtypeStruct((1, 2, 20, 20), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 2, 20), jnp.bool_)

    def f(q, k, v, bias, mask, gate):
        op = lambda q, k, v, bias, gate: msa_pallas.msa_row_attention(
            q, k, v, bias, mask, gate, implementation=PALLAS)
        out, pullback = jax.vjp(op, q, k, v, bias, gate)
        return pullback(out)

    with msa_pallas.exporting.gpu_target():
        return jax.make_jaxpr(f)(rows, rows, rows, bias, mask, rows).jaxpr


X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
X6 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6


@pytest.mark.parametrize("dtype, head_dim, expected", [
    # dq's three products are bf16x6 (`default_block_config`), the others tf32x3.
    (jnp.float32, 32, {X3: 8, X6: 3}),
    (jnp.float32, 8, {X3: 8, X6: 3}),
    (jnp.float32, 128, {(jax.lax.Precision.HIGHEST,) * 2: 11}),
    (jnp.bfloat16, 32, None),
], ids=["f32-d32", "f32-d8", "f32-d128", "bf16-d32"])
def test_kernel_products_never_plain_tf32(dtype, head_dim, expected):
    """Every matrix product inside the kernels, as they are traced for a GPU,
    has the precision the float32 contract needs: split operands (three TF32
    or six bf16 products; head dims <= 64) or IEEE float32 (d = 128), never
    the default (plain TF32 on NVIDIA GPUs). 16-bit inputs use the native
    products. CPU tests run interpret mode, which is always full precision,
    so this is the CPU suite's only view of it (the GPU tests measure the
    splits' errors)."""
    found = helpers.dot_precisions(_kernel_program_on_gpu(dtype, head_dim))
    in_kernels = [(precision, dt) for inside, precision, dt in found if inside]
    assert all(dt == jnp.dtype(dtype) for _, dt in in_kernels), in_kernels
    counts = {}
    for precision, _ in in_kernels:
        counts[precision] = counts.get(precision, 0) + 1
    if expected is None:
        # forward 2, dk/dv 4, and dq + dbias 3 + 2 or the fused kernel's 3.
        assert set(counts) == {None} and counts[None] >= 9, counts
    else:
        # forward 2, dk/dv 4, dq 3, dbias 2.
        assert counts == expected, counts
    # The same rule as the kernels' helper states it (no TF32 without a split).
    dot_precision = msa_pallas.kernels.triton.common.dot_precision
    for d_pad in (16, 32, 64, 128):
        for products, split in (("tf32x3", X3), ("bf16x6", X6)):
            got = dot_precision(jnp.float32, interpret=False, d_pad=d_pad,
                                float32_products=products)
            assert got == (split if d_pad <= 64 else jax.lax.Precision.HIGHEST), (d_pad, got)
        got = dot_precision(jnp.float32, interpret=False, d_pad=d_pad, float32_products="ieee")
        assert got == jax.lax.Precision.HIGHEST
    for products in ("tf32x3", "bf16x6"):
        got = dot_precision(jnp.float32, interpret=True, d_pad=32, float32_products=products)
        assert got == jax.lax.Precision.HIGHEST
