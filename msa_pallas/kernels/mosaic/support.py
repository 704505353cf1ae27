"""Which inputs the Mosaic GPU kernels take, and the XLA-side preparation of
those they take with padding: `supports` (None or the reason), the head
dims, N and dtypes they take, d < 16 zero-padded to 16 (`pad_head_dim`), and
the bias and mask rows padded to whole TMA rows (`pad_residues`,
`pad_bias_rows`)."""

from __future__ import annotations

import jax.numpy as jnp

from msa_pallas.kernels.mosaic.heads import pairs_heads


HEAD_DIMS = (16, 32, 64, 128)
SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# float32 operands take three bf16 pieces each in shared memory: d <= 64 fits.
FLOAT32_MAX_HEAD_DIM = 64
# N must be a multiple of this (`supports`): Mosaic GPU's TMA descriptors
# view each array in GMEM as the 8-row tiles of its swizzled shared-memory
# tiles, so an array's residue axis must hold whole tiles of rows. The
# kernels take other N where their 16-bit row tiles are one swizzle wide
# (`takes_any_n`), through `unaligned_row_tile`.
RESIDUE_MULTIPLE = 8
# Head dims (as the kernels see them) whose 16-bit row tiles are each one
# swizzle wide (`unaligned_row_tile`); float32 row tiles at d = 64 (the
# forward's residual, the float32 backward's gradients), two swizzles wide,
# are two column pieces (`row_tile`).
ANY_N_TILE_DIMS = (16, 32, 64)
# TMA wants every global row stride a multiple of this many bytes.
TMA_STRIDE_BYTES = 16
# The width of a swizzled shared-memory tile of the bias (`smem_tile` with
# 64 or more 16-bit or float32 keys): the row of such an array in GMEM holds
# whole tiles of it.
SWIZZLE_BYTES = 128


def takes_any_n(head_dim: int, q_dtype) -> bool:
    """Whether the Mosaic kernels take N that is no multiple of
    `RESIDUE_MULTIPLE` at this head dim and q dtype: d <= 64 (d < 16 as the
    kernels read it, `kernel_head_dim`), 16-bit or float32 (the backward's
    bf16 pieces), where every 16-bit row tile they copy is one swizzle wide
    (`unaligned_row_tile`)."""
    return jnp.dtype(q_dtype) in (*SIXTEEN_BIT, jnp.dtype(jnp.float32)) and (
        kernel_head_dim(head_dim) in ANY_N_TILE_DIMS
    )


def supports(q_shape, q_dtype, bias_dtype) -> str | None:
    """None when `msa_row_attention` can run these inputs on the Mosaic
    kernels, else the reason it cannot.

    float32 inputs run the Triton forward (its three-TF32 products) and the
    Mosaic backward, whose kernels read each float32 operand as three bf16
    pieces (`split_float32`).

    Head dims below 16 are accepted: the kernels take d = 8 with an even
    number of heads as it is (`pairs_heads`; the float32 backward's bf16
    pieces are zero-padded to 16), the op zero-pads other ones to 16
    (`kernel_head_dim`).

    Args:
      q_shape: `[B, S, N, H, d]`.
      q_dtype, bias_dtype: dtypes of q (and k, v, gate) and of the bias.
    """
    *_, n_res, _, head_dim = q_shape
    q_dtype = jnp.dtype(q_dtype)
    if q_dtype not in (*SIXTEEN_BIT, jnp.dtype(jnp.float32)):
        return f"q dtype {q_dtype.name}: the Mosaic kernels take bfloat16 / float16 / float32"
    if kernel_head_dim(head_dim) not in HEAD_DIMS:
        return f"head dim {head_dim}: the Mosaic kernels take {HEAD_DIMS} (or d < 16, padded)"
    if q_dtype == jnp.float32 and kernel_head_dim(head_dim) > FLOAT32_MAX_HEAD_DIM:
        return (
            f"head dim {head_dim} in float32: the Mosaic backward holds three bf16 pieces "
            f"of each operand in shared memory, which fits d <= {FLOAT32_MAX_HEAD_DIM}"
        )
    bias_itemsize = jnp.dtype(bias_dtype).itemsize
    if bias_itemsize not in (2, 4):
        return f"bias dtype {jnp.dtype(bias_dtype).name}: the Mosaic kernels take 16- or 32-bit"
    if n_res < 1 or (n_res % RESIDUE_MULTIPLE and not takes_any_n(head_dim, q_dtype)):
        return (
            f"N={n_res}: the Mosaic kernels need N to be a multiple of {RESIDUE_MULTIPLE} "
            f"(any N with d <= {max(ANY_N_TILE_DIMS)})"
        )
    return None


def kernel_head_dim(head_dim: int) -> int:
    """The head dim the Mosaic kernels see: d below 16 is zero-padded to 16
    (a 16-bit `wgmma` needs K a multiple of 16); others as they are."""
    return max(head_dim, HEAD_DIMS[0])


def pad_head_dim(x):
    """`[..., d]` zero-padded to `kernel_head_dim(d)` (unchanged for d >= 16).

    Zero columns of q, k, v, `do` and the gate change no logit and give zero
    output and gradient columns, which the caller slices off.
    """
    padding = kernel_head_dim(x.shape[-1]) - x.shape[-1]
    if not padding:
        return x
    return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, padding),))


def check_kernel_inputs(q, bias, float32: bool = False, paired_heads: bool = False) -> None:
    """Raises ValueError unless a Mosaic kernel can take these operands as
    they are; `float32`: the kernel takes float32 q (in bf16 pieces) too;
    `paired_heads`: it takes d = 8 with an even H (`pairs_heads`) too."""
    reason = supports(q.shape, q.dtype, bias.dtype)
    if reason is None and q.dtype == jnp.float32 and not float32:
        reason = "q dtype float32: this Mosaic kernel takes bfloat16 / float16"
    paired = paired_heads and pairs_heads(q.shape[-1], q.shape[-2])
    if reason is None and q.shape[-1] not in HEAD_DIMS and not paired:
        reason = f"head dim {q.shape[-1]}: pad it to {kernel_head_dim(q.shape[-1])} first"
    if reason is not None:
        raise ValueError(reason)


def aligned_residues(n_res: int, dtype, swizzled: bool) -> int:
    """N rounded up for the last axis of an array that the kernels copy by
    TMA: to whole 128-byte rows for an array tiled into swizzled shared
    memory (the bias, its transpose and its gradient: 32 float32 or 64
    16-bit elements), else to whole 16-byte strides (the int8 mask: 16)."""
    multiple = (SWIZZLE_BYTES if swizzled else TMA_STRIDE_BYTES) // jnp.dtype(dtype).itemsize
    return -(-n_res // multiple) * multiple


def pad_residues(x, swizzled: bool):
    """`x` with its last (residue) axis zero-padded to `aligned_residues`.

    The kernels take N that are no whole number of their tiles: tiles that
    run past N read zeros and drop what they would write there. Only arrays
    whose last axis is N are padded: the bias (`B·H·N²` elements, against
    the kernels' `B·S·H·N²` logits; XLA fuses the pad into the division of
    a float32 bias, `accumulator_bias`) and the mask (`B·S·N`, padded in the
    same fusion as its conversion to int8).
    """
    padding = aligned_residues(x.shape[-1], x.dtype, swizzled) - x.shape[-1]
    if padding == 0:
        return x
    return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, padding),))


def pad_bias_rows(bias):
    """`[B, H, N, N']` with its rows (N) zero-padded to a multiple of
    `RESIDUE_MULTIPLE`: the bias tiles are 8-row tiled in shared memory, so
    their TMA copies need whole tiles of rows in GMEM (N % 8 != 0; B·H·N²
    elements, against the kernels' B·S·H·N² logits)."""
    padding = -bias.shape[-2] % RESIDUE_MULTIPLE
    if padding == 0:
        return bias
    return jnp.pad(bias, ((0, 0),) * (bias.ndim - 2) + ((0, padding), (0, 0)))
