"""Inputs of the GPU tests: the AlphaFold shapes (`SHAPES`), normal inputs drawn
on the GPU (`device_inputs`), and how many MSA rows of a float64 reference fit
in memory at once (`chunk_rows`). Shared by tests/kernels/triton/test_gpu.py,
tests/kernels/triton/test_gpu_reliability.py and tests/kernels/mosaic/test_gpu.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from helpers import Inputs

# The shapes that matter (benchmarks/shapes.py): id -> (B, S, N, H, d).
from benchmarks.shapes import GPU_TEST_DIMS as SHAPES  # noqa: E402
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

# float64 logits of one reference chunk: at most this many bytes.
CHUNK_BYTES = 2 << 30


def chunk_rows(shape) -> int:
    B, S, N, H, d = shape
    per_row = B * H * N * N * 8
    rows = 1
    while rows * 2 <= S and rows * 2 * per_row <= CHUNK_BYTES:
        rows *= 2
    return rows


@functools.partial(
    jax.jit, static_argnames=("shape", "dtype", "mask_rate", "gate", "bias_dtype")
)
def _device_inputs(key, *, shape, dtype, mask_rate=0.1, gate=True, bias_dtype=jnp.float32):
    B, S, N, H, d = shape
    ks = jax.random.split(key, 7)
    normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)
    rows = (B, S, N, H, d)
    keep = None
    if mask_rate is not None:
        keep = jax.random.bernoulli(ks[5], 1.0 - mask_rate, (B, S, N))
        keep = keep.at[0, min(1, S - 1)].set(False)  # one fully masked MSA row
    return Inputs(
        normal(ks[0], rows), normal(ks[1], rows), normal(ks[2], rows),
        jax.random.normal(ks[3], (B, H, N, N), jnp.float32).astype(bias_dtype),
        keep, normal(ks[4], rows) if gate else None, normal(ks[6], rows),
    )


def device_inputs(seed, shape, dtype, **kw) -> Inputs:
    """Fresh normal inputs drawn on the GPU (host NumPy draws of 10^8 values are
    slow); bias float32 unless `bias_dtype`; mask with 10% keys masked and MSA
    row 1 fully masked."""
    return _device_inputs(jax.random.PRNGKey(seed), shape=tuple(shape), dtype=dtype, **kw)
