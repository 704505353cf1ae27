"""What the Mosaic GPU kernels share: which inputs they take, shared-memory
tiles, the producer's copy ring, and the two kinds of `wgmma` product.

Every Mosaic kernel here is warp-specialised the same way: consumer
warpgroups compute, one producer warpgroup streams the tiles of each loop
step by TMA into a `num_stages`-deep ring of shared-memory slots (`produce`).
A slot's `produced` barrier completes when its copies have landed; each
consumer arrives on the slot's `consumed` barrier when it is done with it.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from msa_pallas.kernels.constants import FLOAT32_PIECES, LOG2E
from msa_pallas.reference import MASKED_LOGIT

HEAD_DIMS = (16, 32, 64, 128)
# The head dim the forward takes as it is, two heads to a 16-wide tile
# (`pairs_heads`).
PAIRED_HEAD_DIM = 8
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
# Shared memory an sm90 CTA may use (227 KiB).
MAX_SHARED_MEMORY = 227 * 1024
# Registers of the producer warpgroup: it only issues copies.
PRODUCER_REGISTERS = 40
# An SM's register file, the most registers a thread holds at launch, and the
# most the consumers ask for (`setmaxnreg` takes multiples of 8).
REGISTER_FILE = 65536
MAX_THREAD_REGISTERS = 255
MAX_CONSUMER_REGISTERS = 240
WARPGROUP_THREADS = 128
WGMMA = plgpu.Layout.WGMMA
# Vectors along a wgmma tile's rows (one value per row) and columns.
WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)
WGMMA_COL = plgpu.Layout.WGMMA.reduce(0)
# Streaming multiprocessors of an H100 / H200 SXM: the persistent grid's
# size when lowering for one from a host without a GPU.
HOPPER_MULTIPROCESSORS = 132
# CTAs of a persistent grid in the interpreter: few, so that each runs
# several items (on a machine with few cores the interpreter stalls on the
# persistent grid: the tests run it on the GPU).
INTERPRETED_CTAS = 3
# The row reductions stay inside warps: no shared scratch for them.
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


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


def aligned_residues(n_res: int, dtype, swizzled: bool) -> int:
    """N rounded up for the last axis of an array that the kernels copy by
    TMA: to whole 128-byte rows for an array tiled into swizzled shared
    memory (the bias, its transpose and its gradient: 32 float32 or 64
    16-bit elements), else to whole 16-byte strides (the int8 mask: 16)."""
    multiple = (SWIZZLE_BYTES if swizzled else TMA_STRIDE_BYTES) // jnp.dtype(dtype).itemsize
    return -(-n_res // multiple) * multiple


def pad_bias_rows(bias):
    """`[B, H, N, N']` with its rows (N) zero-padded to a multiple of
    `RESIDUE_MULTIPLE`: the bias tiles are 8-row tiled in shared memory, so
    their TMA copies need whole tiles of rows in GMEM (N % 8 != 0; B·H·N²
    elements, against the kernels' B·S·H·N² logits)."""
    padding = -bias.shape[-2] % RESIDUE_MULTIPLE
    if padding == 0:
        return bias
    return jnp.pad(bias, ((0, 0),) * (bias.ndim - 2) + ((0, padding), (0, 0)))


def takes_row_views(n_res: int, interpret: bool) -> bool:
    """Whether a kernel's row tiles are `unaligned_row_tile` pairs: N % 8 != 0,
    compiled (the interpreter copies any rows into 8-row tiles)."""
    return n_res % RESIDUE_MULTIPLE != 0 and not interpret


def row_view_names(smem: dict) -> tuple[str, ...]:
    """The names of shared-memory specs that are `unaligned_row_tile` pairs,
    or tuples of them (`row_tile`'s column pieces, `split_tiles`' bf16
    pieces): `split_row_views`' `row_views`."""
    def is_pair(spec):
        return isinstance(spec, plgpu.RefUnion)

    return tuple(
        name for name, spec in smem.items()
        if is_pair(spec) or (isinstance(spec, tuple) and spec and all(map(is_pair, spec)))
    )


def split_row_views(smem: dict, row_views) -> tuple[dict, dict]:
    """`smem` for TMA copies and `smem` for everything else: each name in
    `row_views` (a pair of views, `unaligned_row_tile`, or a tuple of
    them) replaced by its first view in the one and by its second in the
    other."""
    def view(ref, which):
        return tuple(piece[which] for piece in ref) if isinstance(ref, tuple) else ref[which]

    tma = {name: view(ref, 0) if name in row_views else ref for name, ref in smem.items()}
    return tma, {name: view(ref, 1) if name in row_views else ref for name, ref in smem.items()}


def row_tile(shape, dtype, unaligned: bool):
    """Shared memory for a tile of rows of q, k, v, `do`, the gate or an output:
    `smem_tile`, or with `unaligned` (N % 8 != 0) `unaligned_row_tile`'s
    pair of views; a row wider than the widest swizzle (float32 at d = 64)
    as a tuple of such pairs, one per column piece one swizzle wide
    (`store_row_tile`, `copy_row_tile_to_gmem`)."""
    if not unaligned:
        return smem_tile(shape, dtype)
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    if row_bytes <= SWIZZLE_BYTES:
        return unaligned_row_tile(shape, dtype)
    width = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return tuple(
        unaligned_row_tile((*shape[:-1], width), dtype) for _ in range(row_bytes // SWIZZLE_BYTES)
    )


def row_tile_at(tile, index):
    """`tile.at[index]` for a `row_tile`, also for one of column pieces."""
    if isinstance(tile, tuple):
        return tuple(piece.at[index] for piece in tile)
    return tile.at[index]


def store_row_tile(tile, value) -> None:
    """Writes `value` (`[rows, width]`, registers) to a `row_tile` view
    (`row_tile_at`), each column piece its own columns."""
    if not isinstance(tile, tuple):
        tile[...] = value
        return
    width = tile[0].shape[-1]
    for i, piece in enumerate(tile):
        piece[...] = value[:, i * width:(i + 1) * width]


def copy_row_tile_to_gmem(tile, gmem_ref) -> None:
    """`plgpu.copy_smem_to_gmem` of a `row_tile` view (`row_tile_at`, the
    TMA views) to `gmem_ref` (`[rows, width]`), each column piece to its
    own columns."""
    if not isinstance(tile, tuple):
        plgpu.copy_smem_to_gmem(tile, gmem_ref)
        return
    width = tile[0].shape[-1]
    for i, piece in enumerate(tile):
        plgpu.copy_smem_to_gmem(piece, gmem_ref.at[:, pl.ds(i * width, width)])


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


def kernel_head_dim(head_dim: int) -> int:
    """The head dim the Mosaic kernels see: d below 16 is zero-padded to 16
    (a 16-bit `wgmma` needs K a multiple of 16); others as they are."""
    return max(head_dim, HEAD_DIMS[0])


def pairs_heads(head_dim: int, heads: int) -> bool:
    """Whether the kernels read d = 8 as it is, heads 2h and 2h + 1 in one
    16-wide tile of the `[..., H / 2, 16]` view of `[..., H, 8]` (no padded
    copy in HBM): every product over d takes one operand with the other
    head's half zeroed (`own_head_columns`), every product into d keeps
    its own head's half (`combine_head_columns`). The forward, and the
    backward for 16-bit inputs (`backward.tile_heads`)."""
    return head_dim == PAIRED_HEAD_DIM and heads % 2 == 0


def heads_per_tile(head_dim: int, heads: int) -> int:
    """Heads in one tile of the Mosaic kernels: 2 where `pairs_heads`, else 1."""
    return 2 if pairs_heads(head_dim, heads) else 1


def as_head_pairs(x, heads_per_tile: int):
    """`[..., H, d]` seen as `[..., H / heads_per_tile, heads_per_tile * d]`
    (a free reshape): heads `2h` and `2h + 1` of d = 8 in one 16-wide tile."""
    *lead, heads, head_dim = x.shape
    return x.reshape(*lead, heads // heads_per_tile, head_dim * heads_per_tile)


def head_of_columns(shape, heads_per_tile: int):
    """`[rows, width]` int32 in the wgmma layout: the head of the tile
    (of `heads_per_tile`, each `width / heads_per_tile` columns wide) that
    each column belongs to."""
    column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
    head_dim = shape[-1] // heads_per_tile
    head = jnp.zeros_like(column)
    for h in range(1, heads_per_tile):
        head = jnp.where(column >= h * head_dim, h, head)
    return head


def own_head_columns(tile, heads_per_tile: int) -> tuple:
    """A tile of several heads (`[rows, heads_per_tile * d]`, registers, the
    wgmma layout) as one copy per head with the other heads' columns
    zeroed: a product over the columns with such a copy sums over that
    head's alone."""
    head = head_of_columns(tile.shape, heads_per_tile)
    return tuple(
        jnp.where(head == h, tile, jnp.zeros_like(tile)) for h in range(heads_per_tile)
    )


def combine_head_columns(per_head):
    """One tile of several heads from one tile per head (each `[rows,
    width]`, the wgmma layout): each head's columns from its own tile."""
    combined = per_head[0]
    if len(per_head) > 1:
        head = head_of_columns(combined.shape, len(per_head))
        for h in range(1, len(per_head)):
            combined = jnp.where(head == h, per_head[h], combined)
    return combined


def store_own_head_tiles(tile_ref, head_refs, index) -> tuple:
    """Writes `own_head_columns` of the shared-memory tile `tile_ref` to
    `head_refs[h].at[index]`, one ref per head (a wgmma operand indexed by a
    constant fails to lower), and returns those views. The caller commits
    the writes (`plgpu.commit_smem`) before a `wgmma` reads them."""
    tile = plgpu.load(tile_ref, layout=WGMMA)
    for ref, own in zip(head_refs, own_head_columns(tile, len(head_refs))):
        ref[index] = own
    return tuple(ref.at[index] for ref in head_refs)


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


def accumulator_bias(bias, scale: float):
    """The bias as the kernels' logit products start from it.

    The kernels compute logits in the units of `q . k`: the first product's
    accumulator starts from `bias / scale`, so the matrix units add the
    bias, and one FMA per logit, `(q.k + bias / scale) * scale * log2(e)`,
    brings it to base 2. A 32-bit bias is divided here, once per call
    (B·H·N² elements, against the kernels' B·S·H·N² logits); a 16-bit one is
    divided in the kernels, in float32 (`bias_tile`), which keeps it exact.
    """
    if jnp.dtype(bias.dtype).itemsize == 4:
        return bias * jnp.float32(1.0 / scale)
    return bias


def bias_tile(tile, scale: float):
    """A bias tile read from shared memory (`accumulator_bias`'s array), as
    float32 in the units of `q . k`."""
    if jnp.dtype(tile.dtype).itemsize == 4:
        return tile
    return tile.astype(jnp.float32) * (1.0 / scale)


def masked_accumulator_logit(scale: float) -> float:
    """The logit a masked key gets, in the units of `q . k`: -2^k with the
    smallest k for which it is at least 1e9 in magnitude once scaled.

    A power of two, so that its base-2 value `-2^k * scale * log2(e)` is an
    exact float32 product: in a row whose keys are all masked, every logit
    minus the row max is then exactly 0 and the weights are uniform. In a
    row with a kept key, masked keys get weight 0 as with AlphaFold's -1e9,
    unless every kept logit is itself below -1e9.
    """
    return -(2.0 ** math.ceil(math.log2(-MASKED_LOGIT / scale)))


def smem_tile(shape, dtype):
    """Shared memory tiled and swizzled as TMA and wgmma want it."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    tiling = plgpu.TilingTransform((8, 8 * swizzle // bits))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def unaligned_row_tile(shape, dtype):
    """Shared memory for a tile of rows of an array whose row count is no
    multiple of 8 (N % 8 != 0): a `plgpu.RefUnion` of two views of the same
    bytes, `(tma_view, wgmma_view)`.

    A TMA copy through a `smem_tile` (8-row tiles) needs the copied array's
    row axis to be a multiple of 8 in jax 0.11.2 (Mosaic GPU's
    `TileTransform` has no rounding up). `tma_view` is swizzled but not
    tiled, so TMA takes any row count (rows past the array read as zeros and
    are not written); `wgmma_view` is `smem_tile`'s layout, which `wgmma`
    needs. Where a row is exactly one swizzle wide (`shape[-1]` times the
    item size = the swizzle, as for d = 16, 32 and 64 in 16 bits) the two
    layouts are the same bytes. Written through one view, read through the
    other. Compiled only: the Mosaic GPU interpreter does not alias the views
    for writes, and copies any rows into 8-row tiles (`row_tile`'s callers
    use `smem_tile` there).
    """
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    if shape[-1] * bits != 8 * swizzle:
        raise ValueError(
            f"a row of {shape[-1]} x {bits} bits is no single {swizzle}-byte swizzle: "
            "the untiled and the tiled views would differ"
        )
    tma_view = plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(swizzle),))
    return plgpu.RefUnion(tma_view, smem_tile(shape, dtype))


def split_tiles(shape, dtype, pieces: int, unaligned: bool = False):
    """`row_tile(shape, dtype, unaligned)`, or for an operand split into
    `pieces` > 1 bf16 pieces (`split_float32`) a tuple of one bf16
    `row_tile` per piece."""
    if pieces == 1:
        return row_tile(shape, dtype, unaligned)
    return tuple(row_tile(shape, jnp.bfloat16, unaligned) for _ in range(pieces))


def smem_vectors(shape, dtype):
    """Shared memory for per-residue vectors (mask, row statistics), each
    last-axis row starting 128-byte aligned as TMA wants."""
    *lead, length = shape
    return plgpu.SMEM((*lead, max(length, 128 // jnp.dtype(dtype).itemsize)), dtype)


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp2(x * -LOG2E))


def split_float32(x, pieces: int = FLOAT32_PIECES, in_kernel: bool = False) -> tuple:
    """float32 `x` as `pieces` bfloat16 arrays whose float32 sum is `x`
    (to 24 bits with 3 pieces): each piece is the rounding of what the
    previous ones left.

    In XLA the rounding is a `reduce_precision`: XLA on GPU may drop a
    bf16 -> float32 convert pair (excess precision is allowed by default),
    which would leave every later piece zero. Inside a kernel
    (`in_kernel`), where Mosaic GPU has no `reduce_precision`, the convert
    pair is kept as written.
    """
    split, rest = [], x.astype(jnp.float32)
    for _ in range(pieces):
        if in_kernel:
            piece = rest.astype(jnp.bfloat16)
            rounded = piece.astype(jnp.float32)
        else:
            rounded = lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
            piece = rounded.astype(jnp.bfloat16)
        split.append(piece)
        rest = rest - rounded
    return tuple(split)


def matrix_operand(x, dtype):
    """A float32 register tile as the left operand of a 16-bit `wgmma`: `x`
    rounded to `dtype`, or for float32 inputs its `split_float32` pieces."""
    if jnp.dtype(dtype) == jnp.float32:
        return split_float32(x, in_kernel=True)
    return x.astype(dtype)


def piece_pairs(a, b) -> list:
    """The `(a_i, b_j)` products whose sum is `a @ b` to float32 accuracy.

    `a` and `b` are operands or tuples of the same number P of bf16 pieces
    (`split_float32`): the pairs with `i + j < P`, the terms of the product
    of the two sums above the float32 rounding (P = 3: 6 products, as XLA's
    BF16_BF16_F32_X6), smallest first so that the accumulator adds them
    before the large ones.
    """
    if not isinstance(a, tuple):
        return [(a, b)]
    pieces = len(a)
    pairs = [(i, j) for i in range(pieces) for j in range(pieces) if i + j < pieces]
    return [(a[i], b[j]) for i, j in sorted(pairs, key=lambda ij: -sum(ij))]


def smem_products(
    operands, while_they_run: Callable[[], None] | None = None, inits=None,
    interpret: bool = False,
):
    """`init + a @ b` float32 for each `(a, b)` pair of shared-memory operands
    (`b` may be a transposed view) and its `init` (`[M, N]` float32 in the
    wgmma layout, or None for zeros), issued together and waited for once,
    running `while_they_run()` while the matrix units work.

    `a` and `b` may be tuples of bf16 pieces of float32 operands
    (`piece_pairs`): their products are summed in the one accumulator.

    An `init` starts the product's accumulator: whatever it holds is added
    by the matrix units, at no cost to the FP32 pipe.

    Returns a tuple of `[M, N]` float32 values in the wgmma layout.
    """
    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731
    shapes = [(first(a).shape[0], first(b).shape[1]) for a, b in operands]
    inits = (None,) * len(operands) if inits is None else tuple(inits)

    def accumulate(acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, operands):
            for a_piece, b_piece in piece_pairs(a, b):
                plgpu.wgmma(acc_ref, a_piece, b_piece)
        if while_they_run is not None:
            while_they_run()

    if interpret or all(init is None for init in inits):
        # The interpreter's wgmma takes such operands as the GPU's does, into
        # zeroed accumulators; the inits are added afterwards.
        def compute(*acc_refs):
            accumulate(acc_refs)
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        products = pl.run_scoped(
            compute, *(plgpu.ACC(shape, jnp.float32) for shape in shapes)
        )
        return tuple(
            product if init is None else init + product
            for product, init in zip(products, inits)
        )

    starts = tuple(
        zeros(shape) if init is None else init for shape, init in zip(shapes, inits)
    )
    return pl.run_state(accumulate)(tuple(plgpu.ACC.init(start) for start in starts))


def accumulate_products(
    accs, lhss, rhs_smems, interpret: bool, while_they_run: Callable[[], None] | None = None
):
    """`acc + lhs @ rhs` for each triple, `lhs` 16-bit in registers and `rhs`
    in shared memory, running `while_they_run()` while the matrix units work.
    `lhs` and `rhs` may be tuples of bf16 pieces of float32 operands
    (`matrix_operand`, `operand_at`): their `piece_pairs` products are summed.

    On the GPU each wgmma accumulates into its `acc` in place. The
    interpreter's wgmma takes both operands from shared memory, so there the
    product is a float32-accumulated `jnp.dot` of the same 16-bit operands.
    """
    if interpret:
        products = [
            sum(
                jnp.dot(lhs_piece, rhs_piece[...], preferred_element_type=jnp.float32)
                for lhs_piece, rhs_piece in piece_pairs(lhs, rhs)
            )
            for lhs, rhs in zip(lhss, rhs_smems)
        ]
        if while_they_run is not None:
            while_they_run()
        return tuple(acc + product for acc, product in zip(accs, products))

    def accumulate(acc_refs):
        for acc_ref, lhs, rhs in zip(acc_refs, lhss, rhs_smems):
            for lhs_piece, rhs_piece in piece_pairs(lhs, rhs):
                plgpu.wgmma(acc_ref, lhs_piece, rhs_piece)
        if while_they_run is not None:
            while_they_run()

    if any(isinstance(lhs, tuple) for lhs in lhss):
        # float32 pieces: each step's product starts from zero and is added to
        # the running sum in float32. Accumulated across the loop's tiles in
        # the wgmma accumulator, the errors grew with N on an H200 (2.1e-6
        # at N = 256, 6.9e-6 at N = 1024, against 8e-7 for dbias, whose
        # products are over d only).
        products = pl.run_state(accumulate)(
            tuple(plgpu.ACC.init(zeros(acc.shape)) for acc in accs)
        )
        return tuple(acc + product for acc, product in zip(accs, products))
    return pl.run_state(accumulate)(tuple(plgpu.ACC.init(acc) for acc in accs))


class PingPong:
    """Two consumer warpgroups taking turns, so that one's softmax work (the
    exponential and FP32 units) overlaps the other's matrix products.

    Each loop step: issue the first products and `hand_over()` while they
    run; the elementwise work; `release()`, then `take_turn()` before the
    second products. `start()` before the loop and `finish()` after it
    offset the two warpgroups by half a step and balance the barrier's
    arrivals. With `enabled` False every method does nothing.
    """

    def __init__(self, barrier, wg, enabled: bool):
        self.barrier, self.wg, self.enabled = barrier, wg, enabled

    def _sync(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def start(self):
        if self.enabled:
            pl.when(self.wg == 1)(self._sync)

    def hand_over(self):
        if self.enabled:
            self._sync()

    def release(self):
        if self.enabled:
            plgpu.barrier_arrive(self.barrier)

    def take_turn(self):
        if self.enabled:
            plgpu.barrier_wait(self.barrier)

    def finish(self):
        if self.enabled:
            pl.when(self.wg == 0)(self._sync)


def consumer_register_budget(consumers: int) -> int:
    """Registers per thread of a consumer warpgroup: what the producer
    (`producer_registers`) gives up, split among `consumers`.

    `setmaxnreg` moves registers within the CTA's launch allocation (every
    thread's count at launch, in units of 8, at most 65536 in all); an
    increase that asks for more than the decreases freed waits for ever.
    With 1 consumer the per-thread ceiling binds (240 of 255); with 2, 168
    at launch leave 232; with 4, 96 at launch leave 104.
    """
    threads = (consumers + 1) * WARPGROUP_THREADS
    at_launch = min(MAX_THREAD_REGISTERS, REGISTER_FILE // threads // 8 * 8)
    freed = (at_launch - PRODUCER_REGISTERS) * WARPGROUP_THREADS
    return min(MAX_CONSUMER_REGISTERS, at_launch + freed // consumers // WARPGROUP_THREADS // 8 * 8)


def consumer_registers(consumers: int) -> None:
    """Raises a consumer warpgroup's register budget (`consumer_register_budget`)."""
    plgpu.set_max_registers(consumer_register_budget(consumers), action="increase")


def producer_registers() -> None:
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")


def copy_tiles(gmem, smem, names, source_index, destination_index, barrier) -> None:
    """TMA copies `gmem[name].at[source_index]` -> `smem[name].at[destination_index]`
    for each name, all completing `barrier`.

    A split float32 operand (`split_float32`) leads with its pieces in GMEM
    and is a tuple of one shared-memory ref per piece: every piece is copied.
    """
    as_tuple = lambda index: index if isinstance(index, tuple) else (index,)  # noqa: E731
    source_index, destination_index = as_tuple(source_index), as_tuple(destination_index)
    for name in names:
        if isinstance(smem[name], tuple):
            copies = [((piece, *source_index), ref) for piece, ref in enumerate(smem[name])]
        else:
            copies = [(source_index, smem[name])]
        for source, destination in copies:
            plgpu.copy_gmem_to_smem(gmem[name].at[source], destination.at[destination_index], barrier)


def operand_at(operand, *index):
    """`operand.at[index]`, or for a split operand (a tuple of one ref per
    piece, see `copy_tiles`) the tuple of each piece's, as `smem_products`
    takes it."""
    if isinstance(operand, tuple):
        return tuple(piece.at[index] for piece in operand)
    return operand.at[index]


def transposed(operand):
    """The transposed view of an operand or of each of its pieces."""
    if isinstance(operand, tuple):
        return tuple(piece.T for piece in operand)
    return operand.T


def batch_head_and_warpgroup(heads: int):
    """(batch, head, wg) of this thread, for grids whose last axis is the
    flattened B * H ("batch_heads")."""
    batch_head = lax.axis_index("batch_heads")
    return lax.div(batch_head, heads), lax.rem(batch_head, heads), lax.axis_index("wg")


def keys_before(n_res: int, key_tile, block_k: int, shape):
    """`[rows, block_k]` bool in the wgmma layout: whether each column's key
    (of key tile `key_tile`) lies before N. Keys past N read zeros."""
    key_ids = key_tile * block_k + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
    return key_ids < n_res


def zeros(shape):
    """float32 zeros in the wgmma accumulator layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)


def produce(num_steps: int, stages: int, issue_copies, consumed) -> None:
    """The producer's loop: `issue_copies(step, slot)` for every step, each
    into its ring slot once the consumers have released that slot.

    Args:
      num_steps: the loop's static trip count.
      stages: ring depth.
      issue_copies: issues the TMA copies of one step into slot `slot`.
      consumed: `[stages]` barriers the consumers arrive on.
    """
    for step in range(min(stages, num_steps)):
        issue_copies(jnp.int32(step), step)

    @pl.loop(stages, max(stages, num_steps))
    def _(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(consumed.at[slot])
        issue_copies(step, slot)

    # Observe the consumers' last release of every slot, so that no barrier
    # phase is left unobserved when the CTA ends.
    for step in range(max(0, num_steps - stages), num_steps):
        plgpu.barrier_wait(consumed.at[step % stages])


def multiprocessors(interpret: bool) -> int:
    """The CTAs of a persistent grid: one per SM of the GPU the kernel runs on."""
    if interpret:
        return INTERPRETED_CTAS
    device = jax.devices()[0]
    if device.platform == "gpu":
        return device.core_count
    return HOPPER_MULTIPROCESSORS


def launch(body, *, name: str, scratch, inputs: dict, out_types: dict, grid, grid_names,
           consumers: int, interpret: bool):
    """Runs `body(gmem, *scratch_refs)` as a warp-specialised kernel of
    `consumers` consumer warpgroups and one producer (the last `wg`).

    `gmem` maps the names of `inputs` and `out_types` to their refs. `name`
    is the kernel's name on the GPU (what a profiler lists).
    """
    names = (*inputs, *out_types)

    def entry(*refs):
        gmem = dict(zip(names, refs))
        # The kernel's index arithmetic is int32 whatever `jax_enable_x64`
        # says: traced with it on, its Python ints would be int64 operands.
        with jax.enable_x64(False):
            pl.run_scoped(lambda *scratch_refs: body(gmem, *scratch_refs), *scratch,
                          collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=tuple(out_types.values()),
        grid=grid,
        grid_names=grid_names,
        num_threads=consumers + 1,
        thread_name="wg",
        kernel_name=name,
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*inputs.values())
