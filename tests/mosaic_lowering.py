"""The Mosaic GPU kernels lowered for CUDA on a machine without a GPU
(Mosaic GPU's own lowering, layouts and TMA descriptors included, runs at
trace time), and the shared memory a lowered kernel asks for."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from msa_pallas import exporting


def lowered_for_cuda(function, *args) -> str:
    """`jax.jit(function)` lowered for CUDA (an H200) at `args` (arrays or
    `jax.ShapeDtypeStruct`s): its text. The Triton kernels beside the
    Mosaic ones (`triton.dead_rows`) lower for the GPU that
    `exporting.gpu_target` names."""
    with exporting.gpu_target():
        return jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lowered_shared_memory(function, *args) -> int:
    """The bytes of shared memory the one Mosaic GPU kernel of `function`
    asks for at launch, as Mosaic GPU's lowering computes them: lowered
    under a limit of 0 bytes, the lowering refuses the kernel naming them."""
    with mosaic_gpu_core.artificial_shared_memory_limit(0):
        try:
            lowered_for_cuda(function, *args)
        except ValueError as error:
            found = re.search(r"smem_bytes=(\d+)", str(error))
            if found:
                return int(found.group(1))
            raise
    raise AssertionError("the lowering took a kernel past a shared-memory limit of 0 bytes")


def backward_operands(shape, dtype, bias_dtype, has_mask: bool = True) -> tuple:
    """`jax.ShapeDtypeStruct`s of a Mosaic backward kernel's q, k, v, bias,
    mask, do and stats for q of `shape` `[B, S, N, H, d]`."""
    batch, rows, n_res, heads, _ = shape
    q = jax.ShapeDtypeStruct(shape, dtype)
    bias = jax.ShapeDtypeStruct((batch, heads, n_res, n_res), bias_dtype)
    mask = jax.ShapeDtypeStruct((batch, rows, n_res), jnp.int8) if has_mask else None
    stats = jax.ShapeDtypeStruct((batch, rows, heads, 3, n_res), jnp.float32)
    return q, q, q, bias, mask, q, stats
