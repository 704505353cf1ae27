"""The public op `msa_row_attention` and its dispatch between implementations."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from msa_pallas.block_sizes import BlockConfig, default_block_config
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.common import pad_head_dim, pairs_heads
from msa_pallas.kernels.mosaic.common import supports as mosaic_supports
from msa_pallas.kernels.vjp import fused_attention
from msa_pallas.reference import key_keep, msa_row_attention_xla
from msa_pallas.validation import (
    KERNEL_DTYPES,
    MAX_KERNEL_HEAD_DIM,
    validate_arguments,
    validate_block_config,
    validate_dropout,
)


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# 16-bit on Hopper, for N the Mosaic kernels take (a multiple of 8): from
# this N the Mosaic kernels, forward and backward, are faster than the Triton
# ones (measured from N = 200 up, the train crop N = 256 included;
# benchmarks/RESULTS.md).
MOSAIC_MIN_RESIDUES = 192
# float32 with a float32 bias: the Triton forward and the Mosaic backward
# (bf16 pieces) were faster than the Triton kernels from N = 256 (the train
# crop) up, at N a multiple of 128 (benchmarks/RESULTS.md); other N were not
# measured and run the Triton kernels.
MOSAIC_FLOAT32_MIN_RESIDUES = 256
MOSAIC_FLOAT32_RESIDUE_MULTIPLE = 128


def target_platform() -> str:
    """The platform the op is traced for: `"gpu"`, `"cpu"`, `"tpu"`, ...

    JAX's default backend, unless the current abstract mesh names an abstract
    device (`jax.sharding.use_abstract_mesh`, as `msa_pallas.exporting.gpu_target`
    sets to export for a GPU from a host without one): then that device's
    platform. Pallas's Triton lowering reads the same abstract device for the
    GPU's compute capability.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in _GPU_PLATFORMS else platform


def on_gpu() -> bool:
    """True when the op is traced for a GPU (`target_platform()`), where the
    kernels compile through Triton; elsewhere they run in interpret mode."""
    return target_platform() == "gpu"


def on_hopper() -> bool:
    """True when the op is traced for a GPU of compute capability 9.x (H100,
    H200), where the Mosaic GPU kernel compiles."""
    if not on_gpu() or getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "")
    return str(capability).startswith("9")


def resolve_implementation(implementation, q, dropout_rate: float, bias=None) -> str:
    """The implementation `msa_row_attention` runs.

    `implementation` when given; else, when q's dtype and head dim fit the
    kernels and no attention dropout is asked for: `"mosaic"` on a Hopper GPU
    where the Mosaic kernels take the inputs (`mosaic.common.supports`; d = 8
    with an even H read as it is, two heads per tile, other d < 16
    zero-padded to 16), for 16-bit inputs with N >= 192 (N a multiple of 8,
    or any N with d <= 64), and for float32 inputs with a float32 bias,
    N >= 256 and a multiple of 128; `"pallas"` (the Triton kernels)
    otherwise on a GPU; `"xla"` elsewhere.
    """
    if implementation is not None:
        return implementation
    # Runs before validation: a malformed q must reach the checks that name it.
    shape, dtype = getattr(q, "shape", ()), getattr(q, "dtype", None)
    kernel_fits = (
        dropout_rate == 0.0
        and len(shape) >= 1
        and dtype is not None
        and jnp.dtype(dtype) in KERNEL_DTYPES
        and shape[-1] <= MAX_KERNEL_HEAD_DIM
    )
    if not (on_gpu() and kernel_fits):
        return "xla"
    bias_dtype = getattr(bias, "dtype", None)
    if not (on_hopper() and len(shape) >= 5 and bias_dtype is not None):
        return "pallas"
    n_res = shape[-3]
    if jnp.dtype(dtype) == jnp.float32:
        measured = (
            jnp.dtype(bias_dtype) == jnp.float32
            and n_res >= MOSAIC_FLOAT32_MIN_RESIDUES
            and n_res % MOSAIC_FLOAT32_RESIDUE_MULTIPLE == 0
        )
    else:
        # Any N the Mosaic kernels take (`mosaic_supports`): N no multiple of 8
        # (d <= 64) was measured faster too (RESULTS, any-N entries).
        measured = n_res >= MOSAIC_MIN_RESIDUES
    if measured and mosaic_supports(shape[-5:], dtype, bias_dtype) is None:
        return "mosaic"
    return "pallas"


def resolve_forward_kernel(resolved: str, q_dtype) -> str:
    """The forward kernel `msa_row_attention` runs for `resolved`
    (`resolve_implementation`'s answer): `"xla"`, `"triton"`, or `"mosaic"`,
    which runs the Mosaic forward for 16-bit inputs and the Triton forward
    (three TF32 products) for float32 ones; either backward follows either
    forward through the shared residuals."""
    if resolved == "xla":
        return "xla"
    if resolved == "mosaic" and jnp.dtype(q_dtype).itemsize == 2:
        return "mosaic"
    return "triton"


def kernel_bias_dtype(q_dtype, bias_dtype, round_bias: bool) -> str | None:
    """The dtype name the kernels read the bias in, or None for its own."""
    q_dtype, bias_dtype = jnp.dtype(q_dtype), jnp.dtype(bias_dtype)
    if round_bias and q_dtype.itemsize < 4 and bias_dtype.itemsize > q_dtype.itemsize:
        return q_dtype.name
    return None


def msa_row_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    mask: jax.Array | None = None,
    gate: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    block_config: BlockConfig | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    round_bias: bool = False,
) -> jax.Array:
    """Row-wise gated self-attention over an MSA, with a pair bias.

    For each batch element b, MSA row s, head h and query residue i::

        logits[j] = scale * <q[b,s,i,h], k[b,s,j,h]> + bias[b,h,i,j]
        logits[j] = -1e9                     where mask[b,s,j] is False / 0
        out[b,s,i,h] = softmax(logits) @ v[b,s,:,h] * sigmoid(gate[b,s,i,h])

    The softmax and every accumulation run in float32; a row whose keys are
    all masked gets uniform weights (finite, never NaN).

    Args:
      q, k, v: `[*batch, S, N, H, d]`, float16, bfloat16 or float32 (float64
        too with `implementation="xla"`). The layout a Dense projection of
        `[*batch, S, N, C]` produces, so no transposes are needed.
      bias: `[*batch, H, N, N]`, floating; shared by all S rows.
      mask: `[*batch, S, N]`, bool or numeric (nonzero keeps a key), or None.
      gate: `[*batch, S, N, H, d]` gate logits, or None for no gate.
      scale: multiplies `q . k`; default `1 / sqrt(d)`.
      implementation: `"pallas"`: the Triton kernels (any CUDA GPU; float32
        too). `"mosaic"`: the Mosaic GPU kernels, forward and backward (Hopper,
        bfloat16 / float16, d in 16, 32, 64, 128, or d < 16: the kernels
        take d = 8 with an even H as it is, two heads per tile, and other
        d are zero-padded to 16; N a multiple of 8, or any N with d <= 64;
        float32 with d <= 64 (any N): the Triton forward and the Mosaic backward,
        its operands split into three bf16 pieces). `"xla"`: the plain-`jnp`
        path. None picks `"mosaic"` on a Hopper GPU for
        inputs it takes: 16-bit with N >= 192, float32 with a float32 bias
        and N >= 256 a multiple of 128; `"pallas"` on other GPUs and
        `"xla"` elsewhere (`resolve_implementation`).
        `"pallas"` and `"mosaic"` on a machine without a GPU run the same
        kernels in their interpreters (slow; for tests).
      block_config: tiles for the Pallas kernels; default chosen by
        `msa_pallas.block_sizes.default_block_config(N, d, dtype, bias_dtype)`.
      dropout_rate: dropout on the attention weights (the reference layer's
        convention), with `dropout_rng` a PRNG key. Not in the kernels yet:
        with a rate > 0, `implementation=None` runs the `"xla"` path and
        `"pallas"` raises.
      round_bias: opt-in speed for 16-bit q with a wider bias (float32, as
        AlphaFold's pair projections give): the kernels then read the bias
        rounded once to q's dtype (float16: saturated to its range), half
        the memory traffic of a float32 bias. It costs accuracy in
        proportion to the bias's size (README, "Numerics"); the logits,
        softmax and bias gradient stay float32, and the bias gradient comes
        back in the bias's own dtype. Default False: the kernels read the
        bias as given. No effect on the `"xla"` path or on float32 inputs.

    Returns:
      `[*batch, S, N, H, d]` in q's dtype. Differentiable in q, k, v, bias and
      gate; the bias gradient is summed over S inside the kernels.

    Example::

        q = k = v = jnp.ones((2, 8, 32, 4, 16), jnp.bfloat16)
        bias = jnp.zeros((2, 4, 32, 32), jnp.float32)
        out = msa_pallas.msa_row_attention(q, k, v, bias)   # [2, 8, 32, 4, 16]
    """
    implementation = resolve_implementation(implementation, q, dropout_rate, bias)
    validate_arguments(q, k, v, bias, mask, gate, scale, implementation)
    validate_dropout(dropout_rate, dropout_rng, implementation)
    validate_block_config(block_config)
    *batch_shape, rows, n_res, heads, head_dim = q.shape
    batch = math.prod(batch_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)

    # One flat batch axis: a free reshape, undone on the output.
    rows_shape = (batch, rows, n_res, heads, head_dim)
    q, k, v = (x.reshape(rows_shape) for x in (q, k, v))
    gate = None if gate is None else gate.reshape(rows_shape)
    bias = bias.reshape(batch, heads, n_res, n_res)
    if mask is not None:
        mask = key_keep(mask.reshape(batch, rows, n_res))

    if implementation == "xla":
        out = msa_row_attention_xla(
            q, k, v, bias, mask, gate,
            scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        )
    else:
        bias_dtype = kernel_bias_dtype(q.dtype, bias.dtype, round_bias)
        read_bias_dtype = bias.dtype if bias_dtype is None else bias_dtype
        if block_config is None:
            block_config = default_block_config(n_res, head_dim, q.dtype, read_bias_dtype)
        forward_tiles = None
        if resolve_forward_kernel(implementation, q.dtype) == "mosaic":
            # d < 16 for the Mosaic forward: d = 8 with an even H as it is,
            # two heads per tile (`pairs_heads`); other d zero-padded to 16,
            # the output sliced below (the padded columns' gradients are
            # dropped by the pad's transpose). The float32 path's Triton
            # forward takes d as it is. The Mosaic backward pads its own
            # operands where it does not pair heads.
            if not pairs_heads(head_dim, heads):
                q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
                gate = None if gate is None else pad_head_dim(gate)
            forward_tiles = block_config.mosaic_forward or mosaic_forward.default_tiles(
                q.shape, q.dtype, read_bias_dtype, save_stats=True, has_gate=gate is not None,
                persistent=on_gpu(),
            )
        backward_tiles = None
        if implementation == "mosaic":
            backward_tiles = block_config.mosaic_backward or mosaic_backward.default_tiles(
                q.shape, q.dtype, read_bias_dtype
            )
        block_config = dataclasses.replace(
            block_config, mosaic_forward=forward_tiles, mosaic_backward=backward_tiles
        )
        out = fused_attention(
            q, k, v, bias,
            None if mask is None else mask.astype(jnp.int8),
            gate, scale, block_config.clipped(n_res), not on_gpu(), bias_dtype,
        )[..., :head_dim]
    return out.reshape(*batch_shape, rows, n_res, heads, head_dim)
