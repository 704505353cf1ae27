"""Tile loads and the biased, masked logits tile shared by every kernel.

All kernels see q, k, v, gate and output refs laid out `[N, d_pad]` (one MSA
row, one head), the bias `[N, N]` (one head) and the key mask `[N]`. Tiles
past N and head-dim columns past d are masked in the loads, never padded in
memory: loads fill them with 0 and the logits of keys past N are -inf, so
they carry no weight.

Logits are computed in base 2 (`exp2` is the hardware's native exponential):
`t = log2(e) * (scale * q.k + bias)`, so softmax(logits) = 2^t / sum 2^t.

Attention dropout (`msa_pallas.dropout`): the kernels read one uint32 seed
per MSA row and head (`[B, S, H, 1]`, `dropout_seeds`), hash it with each
tile's global query and key positions into a word per position, and keep a
weight where the two words mix to at least the rate's threshold
(`dropout_keeps`).
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from msa_pallas import dropout
from msa_pallas.kernels.constants import LOG2E, MASKED_LOGIT_LOG2  # noqa: F401 (re-exported)
from msa_pallas.kernels import key_tiles


def dot_precision(dtype, interpret: bool, d_pad: int, float32_products: str = "tf32x3"):
    """The precision of the kernels' matrix products for inputs of `dtype`.

    16-bit inputs: the matrix units' native products, float32 accumulation.
    float32 inputs on the GPU with a (padded) head dim <= 64 run on the
    matrix units with split operands, never plain TF32
    (`KernelTiles.float32_products`):

    - "tf32x3" (the default): `a = a_hi + a_lo` in TF32, three TF32
      products (error 1e-7 to 1.5e-6 against float64);
    - "bf16x6": `a = a_hi + a_mid + a_lo` in bf16 (exact), the six largest
      of the nine bf16 products, smallest first (what Pallas lowers
      `DotAlgorithmPreset.BF16_BF16_F32_X6` to).

    IEEE float32 products for d = 128 (where the splits were not measured),
    for `float32_products="ieee"`, and in interpret mode (CPU has no TF32,
    and XLA's CPU backend computes a bf16x6 product as one float32 product).
    """
    if jnp.dtype(dtype) != jnp.float32:
        return None
    if interpret or d_pad > 64 or float32_products == "ieee":
        return jax.lax.Precision.HIGHEST
    if float32_products == "bf16x6":
        return jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def program_rows_of(msa_rows: int) -> list[tuple]:
    """Ref index prefixes of a program's MSA rows: `[()]` for one row (the
    specs then drop the row axis), `[(0,), (1,), ...]` for several."""
    # Array indices: a Python int index is not accepted by interpret mode.
    return [()] if msa_rows == 1 else [(jnp.int32(row),) for row in range(msa_rows)]


# Set while an interpreted kernel body is traced (`pallas_call`): its static
# indices and tile starts are then int32 arrays. Under `jax_enable_x64` a
# Python int becomes int64 where it meets traced indices, and Pallas's
# interpreter refuses indices of mixed types (its masked loads and stores
# slice with all of a view's starts at once). The Triton lowering needs the
# opposite: a static start in a load's indexer must stay a Python int (an
# array there is not a constant it can fold, and its masked-load rule fails),
# and it takes 64-bit mode as it is. Compiled kernels keep Python ints.
_int32_indices = contextvars.ContextVar("int32_indices", default=False)


def index(value: int):
    """A static index or tile start: int32 in an interpreted body, a Python
    int in a compiled one (`_int32_indices`)."""
    return jnp.int32(value) if _int32_indices.get() else value


def full_columns(ref):
    """Every column of a `[..., d_pad]` ref (`slice(None)`, or in an
    interpreted body a slice with an int32 start: `index`)."""
    return pl.ds(index(0), ref.shape[-1]) if _int32_indices.get() else slice(None)


def tile_loop(first, end, visit, init):
    """`lax.fori_loop(first, end, visit, init)`.

    Static bounds (Python ints: a loop of known trip count) keep their
    counter int32 in an interpreted body whatever `jax_enable_x64` says
    (`index`); bounds read at run time (int32 scalars, `load_row_span`) make
    both int32 in either mode. `first >= end` runs no iteration.
    """
    if isinstance(first, int) and isinstance(end, int):
        return jax.lax.fori_loop(index(first), index(end), visit, init)
    return jax.lax.fori_loop(jnp.int32(first), jnp.int32(end), visit, init)


def _load_scalar(ref, prefix: tuple):
    return ref[prefix] if prefix else ref[...]


def load_row_span(spans_ref, prefix: tuple):
    """One MSA row's `key_tiles.key_spans` values `(from_first, end)`, int32
    scalars (`spans_ref`: the refs of its two arrays, the row at `prefix`);
    `key_tiles.tile_span` gives their key tiles."""
    from_first_ref, end_ref = spans_ref
    return _load_scalar(from_first_ref, prefix), _load_scalar(end_ref, prefix)


def load_extent(extent_refs):
    """The four int32 scalars of one batch element's `key_tiles.live_extents`
    (the refs of its four arrays, the batch element's)."""
    return [_load_scalar(ref, ()) for ref in extent_refs]


def residue_mean(ref, prefix: tuple, dead, block: int, n_res: int, head_dim: int):
    """`[d_pad]` float32: the mean over the N residues of a `[*prefix, N, d_pad]`
    ref where `dead` (a bool scalar), read tile by tile with no matrix
    product; where not dead, nothing is read (the result is then unused).

    A dead row's (all keys masked) uniform weights make its ungated output
    the mean of v and its dv the mean of its output gradient."""
    def add_tile(tile, total):
        x = load_residues(ref, prefix, tile * block, block, n_res, head_dim)
        return total + jnp.sum(x.astype(jnp.float32), axis=0)

    num_tiles = -(-n_res // block)
    end = jnp.where(dead, jnp.int32(num_tiles), jnp.int32(0))
    total = tile_loop(0, end, add_tile, jnp.zeros((ref.shape[-1],), jnp.float32))
    return total / jnp.float32(n_res)


def residue_ids(start, block: int):
    return start + jnp.arange(block, dtype=jnp.int32)


def _both(mask_a, mask_b):
    if mask_a is None:
        return mask_b
    return mask_a if mask_b is None else mask_a & mask_b


def _in_range(start, block: int, n_res: int):
    """`[block]` bool, True below N; None when every tile is full (no mask needed)."""
    return None if n_res % block == 0 else residue_ids(start, block) < n_res


def residue_mask(start, block: int, n_res: int, head_dim: int, d_pad: int):
    """`[block, d_pad]` mask of rows < N and columns < head_dim, or None if all are."""
    rows = _in_range(start, block, n_res)
    cols = None if head_dim == d_pad else jnp.arange(d_pad) < head_dim
    return _both(
        None if rows is None else rows[:, None], None if cols is None else cols[None, :]
    )


def tile_mask(q_start, k_start, block_q: int, block_k: int, n_res: int):
    """`[block_q, block_k]` mask of query and key indices < N, or None if all are."""
    rows, cols = _in_range(q_start, block_q, n_res), _in_range(k_start, block_k, n_res)
    return _both(
        None if rows is None else rows[:, None], None if cols is None else cols[None, :]
    )


def load_residues(ref, prefix: tuple, start, block: int, n_res: int, head_dim: int):
    """Loads rows `[start, start + block)` of a `[*prefix, N, d_pad]` ref.

    Rows >= N and columns >= head_dim read as 0.

    Returns:
      `[block, d_pad]` in the ref's dtype.
    """
    mask = residue_mask(start, block, n_res, head_dim, ref.shape[-1])
    view = ref.at[(*prefix, pl.ds(start, block), full_columns(ref))]
    if mask is None:
        return view[...]
    return plgpu.load(view, mask=mask, other=0)


def store_residues(ref, prefix: tuple, start, value, n_res: int, head_dim: int):
    """Stores `[block, d_pad]` into rows `[start, start + block)`, columns < head_dim."""
    block, d_pad = value.shape
    view = ref.at[(*prefix, pl.ds(start, block), full_columns(ref))]
    plgpu.store(
        view, value.astype(ref.dtype), mask=residue_mask(start, block, n_res, head_dim, d_pad)
    )


def load_vector(ref, prefix: tuple, start, block: int, n_res: int, other=0):
    """Loads entries `[start, start + block)` of a `[*prefix, N]` ref; past N reads `other`."""
    view = ref.at[(*prefix, pl.ds(start, block))]
    mask = _in_range(start, block, n_res)
    return view[...] if mask is None else plgpu.load(view, mask=mask, other=other)


def store_vector(ref, prefix: tuple, start, value, n_res: int):
    block = value.shape[0]
    view = ref.at[(*prefix, pl.ds(start, block))]
    plgpu.store(view, value.astype(ref.dtype), mask=_in_range(start, block, n_res))


def bias_view(bias_ref, q_start, k_start, block_q: int, block_k: int):
    return bias_ref.at[pl.ds(q_start, block_q), pl.ds(k_start, block_k)]


def load_bias_tile(bias_ref, q_start, k_start, block_q: int, block_k: int, n_res: int):
    """The `[block_q, block_k]` float32 tile of a `[N, N]` bias, scaled to base 2."""
    view = bias_view(bias_ref, q_start, k_start, block_q, block_k)
    mask = tile_mask(q_start, k_start, block_q, block_k, n_res)
    tile = view[...] if mask is None else plgpu.load(view, mask=mask, other=0)
    return tile.astype(jnp.float32) * LOG2E


def load_key_keep(mask_ref, prefix: tuple, k_start, block_k: int, n_res: int):
    """`[block_k]` bool: True where the key is kept. None when there is no mask."""
    if mask_ref is None:
        return None
    return load_vector(mask_ref, prefix, k_start, block_k, n_res) != 0


def log2_logits(q, k, bias_log2, key_keep, k_start, *, qk_scale_log2: float, n_res: int, precision):
    """Base-2 logits of one tile.

    Args:
      q: `[block_q, d_pad]`; k: `[block_k, d_pad]`, input dtype.
      bias_log2: `[block_q, block_k]` float32, already times log2(e).
      key_keep: `[block_k]` bool or None.
      k_start: first key of the tile.
      precision: of the product, from `dot_precision`.

    Returns:
      `[block_q, block_k]` float32: masked keys hold MASKED_LOGIT_LOG2 (the
      replaced logit -1e9, as AlphaFold), keys past N hold -inf.
    """
    t = plgpu.dot(q, k, trans_b=True, precision=precision)
    t = t * qk_scale_log2 + bias_log2
    if key_keep is not None:
        t = jnp.where(key_keep[None, :], t, MASKED_LOGIT_LOG2)
    key_in_range = _in_range(k_start, k.shape[0], n_res)
    if key_in_range is not None:
        t = jnp.where(key_in_range[None, :], t, -jnp.inf)
    return t


def probabilities(t, row_max, row_log2_sum):
    """softmax weights from base-2 logits and the forward's row statistics.

    `(t - m) - log2(l)` rather than `t - (m + log2 l)`: for a fully masked row
    m is -1.44e9, where float32 cannot hold m + log2(l) apart from m.
    """
    return jnp.exp2((t - row_max[:, None]) - row_log2_sum[:, None])


def logit_gradient(p, dp, delta, key_keep, dropout_keep=None):
    """d(loss)/d(logit) of one tile: `p * (dp - delta)`, zero at masked keys;
    with dropout (`dropout_keep`, `[block_q, block_k]` bool, or None),
    `p * (keep * dp - delta)`: a dropped weight passed nothing to the output,
    but its softmax still normalised the kept ones.

    A masked logit was replaced by a constant, so nothing flows back through
    it to q, k or the bias (the weights of a fully masked row are uniform
    but not a function of the logits).
    """
    if dropout_keep is not None:
        dp = jnp.where(dropout_keep, dp, 0.0)
    ds = p * (dp - delta[:, None])
    if key_keep is not None:
        ds = jnp.where(key_keep[None, :], ds, 0.0)
    return ds


def dropout_operand(dropout_seeds, dropout_rate: float, q_shape):
    """Checks a kernel call's dropout arguments; returns `(seeds, threshold)`:
    the seeds as the kernels read them, `[B, S, H, 1]` uint32 (one scalar
    per MSA row and head: `load_dropout_seed`), and the kernels' static
    `dropout.keep_threshold`; `(None, None)` where dropout is off (rate 0:
    the kernels are then exactly those without dropout).

    Args:
      dropout_seeds: `[B, S, H]` uint32 (`dropout.row_seeds`) or None.
      dropout_rate: in [0, 1); > 0 needs the seeds.
      q_shape: `[B, S, N, H, d]`.
    """
    if not dropout.check_kernel_arguments(dropout_seeds, dropout_rate, q_shape):
        return None, None
    return dropout_seeds[..., None], dropout.keep_threshold(dropout_rate)


def load_dropout_seed(seeds_ref, prefix: tuple):
    """The uint32 dropout seed of one MSA row (`prefix`) of a program's head,
    from a `[*prefix, 1]` ref of `dropout_operand`; None without
    dropout (no ref), and so are the words and masks made from it."""
    return None if seeds_ref is None else seeds_ref[(*prefix, index(0))]


def dropout_words(words, seed, start, block: int):
    """`[block]` uint32: `words` (`dropout.query_words` / `key_words`) of
    `seed` at the global positions `[start, start + block)`: never
    tile-relative, so the mask does not depend on the tiles. Computed once
    per tile, a vector; positions past N get words too, unused."""
    if seed is None:
        return None
    return words(seed, residue_ids(start, block).astype(jnp.uint32))


def dropout_keeps(query_words, key_words, threshold):
    """`[block_q, block_k]` bool: the weights dropout keeps, from a query
    tile's and a key tile's words (`dropout_words`): the only per-weight
    work of dropout, with the select that applies it."""
    if query_words is None:
        return None
    return dropout.keeps(query_words[:, None], key_words[None, :], threshold)


def pallas_call(kernel, tiles, *, grid, in_specs, out_specs, out_shape, interpret: bool, name: str,
                input_output_aliases=None):
    """`pl.pallas_call` with the Triton launch parameters of `tiles` (a KernelTiles,
    or anything with its `num_warps` and `num_stages`); an interpreted kernel's body
    is traced with int32 indices (`_int32_indices`)."""

    def traced_body(*refs):
        token = _int32_indices.set(interpret)
        try:
            return kernel(*refs)
        finally:
            _int32_indices.reset(token)

    return pl.pallas_call(
        traced_body,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        input_output_aliases=input_output_aliases or {},
        interpret=interpret,
        name=name,
    )
