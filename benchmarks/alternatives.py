"""The implementations of MSA row attention that the benchmarks time, one adapter each.

`IMPLEMENTATIONS` maps a name to a builder `build(case) -> Callables`: msa_pallas (and
its variants: the Triton or the Mosaic kernels forced, msa_pallas_skip, traced inside
`msa_pallas.skipping_padding()` (where the dispatch picks the persistent Mosaic dq and
dk/dv kernels), msa_pallas_persistent, those kernels without skipping,
msa_pallas_skip_k64, skipping with 64-key forward and dk/dv tiles,
msa_pallas_skip_k64_dbias, the bias gradient's 64-key too, msa_pallas_skip_mask_queries,
skipping with the op's `mask_queries` (masked residues' outputs 0),
msa_pallas_skip_mask_queries_q64, that with 64-query forward and dq tiles,
msa_pallas_skip_mask_queries_narrow, those and 64-key forward, dk/dv and bias-gradient
tiles, msa_pallas_lean, every
Mosaic kernel with `LEAN_OPTIONS` (a select per logit fewer), msa_pallas_skip_lean, both,
msa_pallas_mask_with_select and msa_pallas_skip_mask_with_select, the backward
kernels with the select that `MosaicTiles.mask_without_select` takes out,
msa_pallas_prologue, the backward's prologue kernel (`MosaicBackwardTiles.prologue_kernel`)
without skipping, msa_pallas_skip_xla_prologue, skipping with XLA's passes in its place,
and msa_pallas_dpa,
`msa_pallas.dot_product_attention` in tokamax's layouts), xla (msa_pallas' plain-jnp
path, the reference of the forward check), cudnn (`jax.nn.dot_product_attention`),
cuequivariance (`cuequivariance_jax.triangle_attention`), tokamax_mosaic and
tokamax_triton (`tokamax.dot_product_attention`), and jax_mha_nobias, a reference point
that computes less (no bias, no mask). The other packages are not in
the GPU image: benchmarks/fetch_wheels.sh fetches their wheels and run_gpu.sh installs
them; where they are missing, or without a GPU, the builders raise `Unavailable`.
`python -m benchmarks check` checks each mapping, forward and gradients, against xla.

Every op is `op(q, k, v, bias, mask) -> out` in msa_pallas' layout: q/k/v `[B, S, N, H, d]`,
bias `[B, H, N, N]` in the case's bias dtype (an adapter whose package needs another
dtype casts inside the timed call), mask `[B, S, N]` bool, True keeps a key.
`LAYER_CORES` holds the alternatives as `attention_fn`s for msa_pallas' Flax layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

import msa_pallas
from msa_pallas.kernels.mosaic.support import supports as mosaic_supports
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles
# Unavailable, on_gpu and the importers are used by the scripts through this module too.
from benchmarks.packages import (ALTERNATIVE_PACKAGES, Unavailable, import_cuequivariance,  # noqa: F401
                      import_tokamax, on_gpu, package_version, tokamax_with)
from benchmarks.shapes import HALF_DTYPES, Case


@dataclasses.dataclass
class Callables:
    """Jitted `fwd(q, k, v, bias, mask)` and `fwd_bwd(q, k, v, bias, mask, ct)`.

    `fwd_bwd` returns the gradients of `sum(out.astype(f32) * ct)` with respect
    to q, k, v and bias. `info` is recorded in results.json.
    """

    fwd: Callable
    fwd_bwd: Callable
    info: dict


def jitted_pair(op: Callable, info: dict | None = None) -> Callables:
    """Jitted forward and forward+backward callables of `op(q, k, v, bias, mask)`."""

    def loss(q, k, v, bias, mask, ct):
        out = op(q, k, v, bias, mask)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    return Callables(
        fwd=jax.jit(op),
        fwd_bwd=jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
        info=info or {},
    )


# --- msa_pallas and JAX's own ------------------------------------------------


def planned_backward_tiles(plan, **changes):
    """The Mosaic backward tiles `plan` (a `CallPlan` on the Mosaic backward) chose,
    with `changes` by kernel (`dq={"persistent": True}`: fields of its `MosaicTiles`),
    and the plan's choice of the backward's prologue kernel."""
    tiles = dict(plan.backward_tiles)
    return msa_pallas.MosaicBackwardTiles(
        **{kernel: dataclasses.replace(tiles[kernel], **changes.get(kernel, {}))
           for kernel in ("dkdv", "dq", "dbias")},
        ping_pong=plan.ping_pong, prologue_kernel=plan.prologue_kernel,
    )


def persistent_backward_config(config, plan):
    """`config` with the plan's Mosaic dq and dk/dv tiles made persistent
    (`MosaicTiles.persistent`); as it is where the plan's backward is not Mosaic's."""
    if plan.backward != "mosaic":
        return config
    persistent = {"persistent": True}
    return dataclasses.replace(config, mosaic_backward=planned_backward_tiles(
        plan, dkdv=persistent, dq=persistent))


def asked_block_config(q, bias, mask=None, gate=None, *, implementation=None,
                       skip: bool = False, persistent_backward: bool = False,
                       kernel_options: dict | None = None, narrow_key_tiles: tuple = (),
                       narrow_query_tiles: tuple = ()):
    """The block config a profiling command asks for on q `[B, S, N, H, d]`, `bias`
    (arrays or `jax.ShapeDtypeStruct`s): None (the op's own) unless
    `persistent_backward` (`persistent_backward_config`), `kernel_options`
    (`kernel_options_config`), `narrow_key_tiles` (`narrow_key_tiles_config`) or
    `narrow_query_tiles` (`narrow_query_tiles_config`), on the plan the call makes,
    skipping padding or not."""
    if not (persistent_backward or kernel_options or narrow_key_tiles or narrow_query_tiles):
        return None
    with msa_pallas.skipping_padding(skip):  # the plan skipping makes
        plan = msa_pallas.explain(q, q, q, bias, mask, gate, implementation=implementation)
    config = msa_pallas.default_block_config(q.shape[2], q.shape[-1], q.dtype, bias.dtype)
    if persistent_backward:
        config = persistent_backward_config(config, plan)
    if kernel_options:
        config = kernel_options_config(config, plan, kernel_options)
    if narrow_key_tiles:
        config = narrow_key_tiles_config(config, plan, narrow_key_tiles)
    if narrow_query_tiles:
        config = narrow_query_tiles_config(config, plan, narrow_query_tiles)
    return config


# Keys per tile of `narrow_key_tiles_config`, queries per tile of
# `narrow_query_tiles_config`.
NARROW_KEYS = 64
NARROW_QUERIES = 64


def _narrow_tiles_config(config, plan, kernels, field: str, size: int, allowed, name: str):
    """`config` with the plan's Mosaic tiles of `kernels` (of `allowed`) given
    `field` = `size` (the others' as planned); as it is where the plan's kernels are
    not Mosaic's. `name`: the caller's, for the error."""
    if plan.forward != "mosaic" or plan.backward != "mosaic":
        return config
    unknown = set(kernels) - set(allowed)
    if unknown:
        raise ValueError(f"{name}: no such kernels {sorted(unknown)} (of {sorted(allowed)})")
    # From the tiles `config` sets (another narrowing's), else the plan's.
    forward = config.mosaic_forward or plan.forward_tiles
    if "forward" in kernels:
        forward = dataclasses.replace(forward, **{field: size})
    backward = config.mosaic_backward or planned_backward_tiles(plan)
    backward = dataclasses.replace(backward, **{
        kernel: dataclasses.replace(getattr(backward, kernel), **{field: size})
        for kernel in kernels if kernel != "forward"})
    return dataclasses.replace(config, mosaic_forward=forward, mosaic_backward=backward)


def narrow_key_tiles_config(config, plan, kernels=("forward", "dkdv")):
    """`config` with the plan's Mosaic tiles of `kernels` (of "forward", "dkdv" and
    "dbias") cut to `NARROW_KEYS` keys. With 25% of N = 256 residues padding, a
    128-key tile holds live and padded keys alike, and skipping saves nothing of it;
    64-key tiles skip one in four."""
    return _narrow_tiles_config(config, plan, kernels, "block_k", NARROW_KEYS,
                                ("forward", "dkdv", "dbias"), "narrow_key_tiles_config")


def narrow_query_tiles_config(config, plan, kernels=("forward", "dq")):
    """`config` with the plan's Mosaic tiles of `kernels` (of "forward" and "dq") cut
    to `NARROW_QUERIES` queries per consumer. With the queries masked too
    (`mask_queries`) and 25% of N = 256 residues padding, the forward's and dq's
    128-query tiles hold live and padded queries alike; 64-query tiles skip one in
    four."""
    return _narrow_tiles_config(config, plan, kernels, "block_q", NARROW_QUERIES,
                                ("forward", "dq"), "narrow_query_tiles_config")


# The Mosaic kernels' leaner ways, fields of `MosaicTiles`: a float32 bias read lane by
# lane (off by default: slower on an H100), and masked keys' ds made 0 without a select
# (the default since it measured faster on an H100: log 2026-12-05 13).
LEAN_OPTIONS = {"staggered_bias": False, "mask_without_select": True}


def backward_options() -> frozenset[str]:
    """The fields of `MosaicBackwardTiles` that are options of the three kernels
    together, not of each kernel's tiles (`prologue_kernel`)."""
    tile_fields = {field.name for field in dataclasses.fields(MosaicTiles)}
    return frozenset(field.name for field in dataclasses.fields(MosaicBackwardTiles)
                     if field.type in ("bool", bool) and field.name not in tile_fields)


def kernel_options_config(config, plan, options: dict):
    """`config` with `options` set: fields of `MosaicTiles` in every Mosaic kernel's
    tiles, those of `backward_options` in the backward's; the tiles `config` sets
    (`persistent_backward_config`'s, say), else the plan's; as it is where neither of
    the plan's backends is Mosaic's."""
    together = {name: value for name, value in options.items() if name in backward_options()}
    each = {name: value for name, value in options.items() if name not in together}
    changes = {}
    if plan.forward == "mosaic" and each:
        changes["mosaic_forward"] = dataclasses.replace(
            config.mosaic_forward or plan.forward_tiles, **each)
    if plan.backward == "mosaic":
        tiles = config.mosaic_backward or planned_backward_tiles(plan)
        changes["mosaic_backward"] = dataclasses.replace(tiles, **together, **{
            kernel: dataclasses.replace(getattr(tiles, kernel), **each)
            for kernel in ("dkdv", "dq", "dbias")})
    return dataclasses.replace(config, **changes) if changes else config


def _msa_pallas_builder(implementation: str | None, skip_padding: bool = False,
                        persistent_backward: bool = False, narrow_key_tiles: tuple = (),
                        kernel_options: dict | None = None, mask_queries: bool = False,
                        narrow_query_tiles: tuple = ()) -> Callable[[Case], Callables]:
    """`narrow_key_tiles`: the Mosaic kernels whose tiles `narrow_key_tiles_config`
    cuts to `NARROW_KEYS` keys (none: as planned); `narrow_query_tiles`, those
    `narrow_query_tiles_config` cuts to `NARROW_QUERIES` queries. `mask_queries`: the op's option of
    that name (a masked residue's output is 0; `info["masks_queries"]` says so, and
    `python -m benchmarks check` compares with the xla path taking it too)."""
    def build(case: Case) -> Callables:
        _, rows, n, heads, d = case.dims
        # Without a GPU the kernels run in their interpreters.
        chosen = implementation or ("pallas" if not on_gpu() else None)
        q_like = jax.ShapeDtypeStruct((1, rows, n, heads, d), case.dtype)
        bias_like = jax.ShapeDtypeStruct((1, heads, n, n), case.bias_dtype)
        mask_like = jax.ShapeDtypeStruct((1, rows, n), jnp.bool_)
        with msa_pallas.skipping_padding(skip_padding):
            # The plan the op makes: skipping changes the backward's tiles.
            plan = msa_pallas.explain(q_like, q_like, q_like, bias_like, mask_like,
                                      implementation=chosen)
        config = msa_pallas.default_block_config(n, d, case.dtype, case.bias_dtype)
        if persistent_backward:
            config = persistent_backward_config(config, plan)
        if narrow_key_tiles:
            config = narrow_key_tiles_config(config, plan, narrow_key_tiles)
        if narrow_query_tiles:
            config = narrow_query_tiles_config(config, plan, narrow_query_tiles)
        if kernel_options:
            config = kernel_options_config(config, plan, kernel_options)
        changed = (persistent_backward or bool(narrow_key_tiles) or bool(narrow_query_tiles)
                   or kernel_options)
        block_config = config if changed else None

        def op(q, k, v, bias, mask):
            # Read when the call is traced, inside the jitted function.
            with msa_pallas.skipping_padding(skip_padding):
                return msa_pallas.msa_row_attention(
                    q, k, v, bias, mask, scale=case.scale, implementation=chosen,
                    block_config=block_config, mask_queries=mask_queries,
                )

        info = {"interpret": plan.interpret, "implementation": plan.implementation,
                "forward_kernel": plan.forward, "skips_padding": skip_padding,
                "block_config": dataclasses.asdict(config)}
        if mask_queries:
            info["masks_queries"] = True
        return jitted_pair(op, info)

    return build


# What a user gets: the Mosaic GPU kernels where `implementation=None` picks them.
build_msa_pallas = _msa_pallas_builder(None)
# The Triton kernels alone, to see what the Mosaic kernels add.
build_msa_pallas_triton = _msa_pallas_builder("pallas")
# What a user gets inside `msa_pallas.skipping_padding()`: the padding the mask
# removes skipped (`msa_pallas.kernels.key_tiles`).
build_msa_pallas_skip = _msa_pallas_builder(None, skip_padding=True)
# The persistent dq and dk/dv kernels on every shape, padding visited: whether they
# pay where nothing is skipped.
build_msa_pallas_persistent = _msa_pallas_builder(None, persistent_backward=True)
# Skipping with 64-key forward and dk/dv tiles (`narrow_key_tiles_config`): whether
# the finer tiles pay at a short padded crop, and what they cost elsewhere.
build_msa_pallas_skip_k64 = _msa_pallas_builder(None, skip_padding=True,
                                                narrow_key_tiles=("forward", "dkdv"))
# ... and the bias gradient's tiles too: at the padded training crop every kernel but dq
# plans 128-key tiles, so 64-key ones in all of them skip the padded quarter of the keys.
build_msa_pallas_skip_k64_dbias = _msa_pallas_builder(
    None, skip_padding=True, narrow_key_tiles=("forward", "dkdv", "dbias"))
# Skipping with the mask masking queries too (the op's `mask_queries`: a padding
# residue's output is 0): the kernels then skip masked query tiles and read nothing of
# padding rows. It computes a different output at masked residues: a variant, never
# the subject the alternatives are held to.
build_msa_pallas_skip_mask_queries = _msa_pallas_builder(None, skip_padding=True,
                                                         mask_queries=True)
# ... with 64-query forward and dq tiles (`narrow_query_tiles_config`): at the padded
# training crop the planned 128-query tiles hold live and padded queries alike.
build_msa_pallas_skip_mask_queries_q64 = _msa_pallas_builder(
    None, skip_padding=True, mask_queries=True, narrow_query_tiles=("forward", "dq"))
# ... and 64-key forward, dk/dv and bias-gradient tiles: every tile of every kernel
# either all padding or all live at the padded training crop.
build_msa_pallas_skip_mask_queries_narrow = _msa_pallas_builder(
    None, skip_padding=True, mask_queries=True, narrow_query_tiles=("forward", "dq"),
    narrow_key_tiles=("forward", "dkdv", "dbias"))
# Every Mosaic kernel with `LEAN_OPTIONS`: whether a select per logit fewer pays.
build_msa_pallas_lean = _msa_pallas_builder(None, kernel_options=LEAN_OPTIONS)
# ... and skipping padding: the padded shapes' cells of issue 36 with them.
build_msa_pallas_skip_lean = _msa_pallas_builder(None, skip_padding=True,
                                                 kernel_options=LEAN_OPTIONS)
# The backward kernels as they were before `mask_without_select` became the default: a
# masked key's ds made 0 by a select after the product (log 2026-12-05 13).
MASK_WITH_SELECT_OPTIONS = {"mask_without_select": False}
build_msa_pallas_mask_with_select = _msa_pallas_builder(
    None, kernel_options=MASK_WITH_SELECT_OPTIONS)
build_msa_pallas_skip_mask_with_select = _msa_pallas_builder(
    None, skip_padding=True, kernel_options=MASK_WITH_SELECT_OPTIONS)
# The backward's prologue in one Pallas kernel in place of XLA's passes
# (`MosaicBackwardTiles.prologue_kernel`): asked without skipping (the dispatch takes it
# where padding is skipped), and skipping, XLA's passes in its place: what it gains.
PROLOGUE_OPTIONS = {"prologue_kernel": True}
build_msa_pallas_prologue = _msa_pallas_builder(None, kernel_options=PROLOGUE_OPTIONS)
build_msa_pallas_skip_xla_prologue = _msa_pallas_builder(
    None, skip_padding=True, kernel_options={"prologue_kernel": False})


def build_msa_pallas_mosaic(case: Case) -> Callables:
    """The Mosaic GPU kernels forced (`implementation="mosaic"`), also where
    `implementation=None` does not pick them: how a dispatch rule is checked."""
    if not on_gpu():
        raise Unavailable("the Mosaic GPU kernels are timed on a GPU only")
    reason = mosaic_supports(case.dims, case.dtype, case.bias_dtype)
    if reason is not None:
        raise Unavailable(reason)
    return _msa_pallas_builder("mosaic")(case)


def build_msa_pallas_dpa(case: Case) -> Callables:
    """`msa_pallas.dot_product_attention` called as tokamax's is (`tokamax_op`'s
    layouts: bias `[B, 1, H, N, N]`, mask `[B, S, 1, 1, N]`), as AlphaFold3-style
    code calls it: what the swap of one function gives."""
    chosen = None if on_gpu() else "pallas"  # interpreted off a GPU, as msa_pallas

    def op(q, k, v, bias, mask):
        return msa_pallas.dot_product_attention(
            q, k, v, bias=bias[:, None], mask=mask[:, :, None, None, :], scale=case.scale,
            implementation=chosen)

    return jitted_pair(op, {"layout": "tokamax's: bias [B,1,H,N,N], mask [B,S,1,1,N]"})


def build_xla(case: Case, mask_queries: bool = False) -> Callables:
    """msa_pallas' plain-jnp path (materialises [B, S, H, N, N] logits);
    `mask_queries`: the op's option of that name (the reference of the variants
    that take it)."""

    def op(q, k, v, bias, mask):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, mask, scale=case.scale, implementation="xla",
            mask_queries=mask_queries,
        )

    return jitted_pair(op)


def cudnn_op(scale: float, implementation: str = "cudnn") -> Callable:
    """`op(q, k, v, bias, mask)` through `jax.nn.dot_product_attention`, MSA rows folded into batch.

    q/k/v `[B, S, N, H, d]` -> `[B*S, N, H, d]` (a free reshape). The bias is
    passed as `[1, H, N, N]` when B == 1 (the API broadcasts it over the
    batch); for B > 1 it has to be repeated over S to `[B*S, H, N, N]`. The key
    mask goes in as bool `[B*S, 1, 1, N]`. Note that jax 0.11.2 turns a boolean
    mask into an additive bias and adds it to `bias`, so with a mask the
    combined `[B*S, H, N, N]` bias is materialised in any case (and its
    gradient reduced over S by XLA). `implementation="xla"` runs the same
    mapping anywhere (`python -m benchmarks check` uses it on CPU).
    """

    def op(q, k, v, bias, mask):
        b, s, n, h, d = q.shape
        rows = lambda x: x.reshape(b * s, n, h, d)  # noqa: E731
        if b == 1:
            bias_rows = bias
        else:
            bias_rows = jnp.broadcast_to(bias[:, None], (b, s, h, n, n))
            bias_rows = bias_rows.reshape(b * s, h, n, n)
        out = jax.nn.dot_product_attention(
            rows(q), rows(k), rows(v),
            bias=bias_rows,
            mask=mask.reshape(b * s, 1, 1, n),
            scale=scale,
            implementation=implementation,
        )
        return out.reshape(b, s, n, h, d)

    return op


def build_cudnn(case: Case) -> Callables:
    """`jax.nn.dot_product_attention(implementation="cudnn")` (see `cudnn_op`)."""
    if not on_gpu():
        raise Unavailable("cuDNN needs a GPU")
    if case.dtype_name not in HALF_DTYPES:
        raise Unavailable("cuDNN flash attention takes bf16/fp16 only")
    return jitted_pair(cudnn_op(case.scale))


def build_jax_mha_nobias(case: Case) -> Callables:
    """JAX's own Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`),
    default block sizes, MSA rows folded into the batch, **without bias and mask**.

    Not an alternative (it computes less): a reference point for what a
    Triton flash-attention kernel reaches at these shapes on this GPU when
    there is no bias to add and no bias gradient to reduce.
    """
    if not on_gpu():
        raise Unavailable("a Triton kernel: needs a GPU")
    if case.dtype_name not in HALF_DTYPES:
        raise Unavailable("16-bit only (its float32 products would be TF32)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_attention

    def op(q, k, v, bias, mask):
        del bias, mask  # not supported by this kernel: the point of the comparison
        b, s, n, h, d = q.shape
        rows = lambda x: x.reshape(b * s, n, h, d)  # noqa: E731
        out = jax_attention.mha(rows(q), rows(k), rows(v), None, sm_scale=case.scale)
        return out.reshape(b, s, n, h, d)

    info = {"reference_point": True,
            "note": "no bias and no mask: a reference point, not an alternative"}
    return jitted_pair(op, info)


# --- the alternatives from other packages --------------------------------------


def cuequivariance_op(cuet, scale: float) -> Callable:
    """`op(q, k, v, bias, mask)` in msa_pallas' layout through `cuet.triangle_attention`.

    cuEquivariance takes q/k/v `[B, S, H, N, d]` (one transpose each way,
    counted in the time), the pair bias `[B, 1, H, N, N]` in float32 (shared by
    the S rows; a bias in another dtype is cast here, in the timed call; its
    gradient is reduced over S inside the kernel and comes back in float32,
    cast to the bias dtype) and the key mask `[B, S, 1, 1, N]` bool, True keeps
    a key, masked logits replaced by -1e9. It returns `[out, lse, max]`.
    """

    def op(q, k, v, bias, mask):
        heads_first = lambda x: jnp.swapaxes(x, 2, 3)  # noqa: E731 - [B,S,N,H,d] <-> [B,S,H,N,d]
        out, _lse, _max = cuet.triangle_attention(
            heads_first(q), heads_first(k), heads_first(v),
            bias[:, None].astype(jnp.float32),
            mask[:, :, None, None, :].astype(jnp.bool_),
            scale,
        )
        return heads_first(out)

    return op


def tokamax_op(tokamax, scale: float, implementation: str) -> Callable:
    """`op(q, k, v, bias, mask)` through `tokamax.dot_product_attention`.

    tokamax takes `[*batch, N, H, d]`, so msa_pallas' `[B, S, N, H, d]` goes in
    as it is, with (B, S) as two batch dimensions: no transpose. The bias goes
    in as `[B, 1, H, N, N]` in its own dtype and the key mask as `[B, S, 1, 1, N]`
    (True keeps a key; masked logits are replaced by float32's minimum); both
    broadcast over S without a `[B, S, H, N, N]` array in the forward.
    (tokamax's backward kernels write a per-row bias gradient and sum it over S
    in XLA: that is in its `f+b` memory.) One implementation only, so tokamax
    raises rather than falling back to another.
    """

    def op(q, k, v, bias, mask):
        return tokamax.dot_product_attention(
            q, k, v, bias=bias[:, None], mask=mask[:, :, None, None, :].astype(jnp.bool_),
            scale=scale, implementation=implementation,
        )

    return op


def build_cuequivariance(case: Case) -> Callables:
    """`cuequivariance_jax.triangle_attention` (NVIDIA cuEquivariance's CUDA kernels)."""
    if not on_gpu():
        raise Unavailable("cuEquivariance's kernels need a GPU")
    cuet = import_cuequivariance()
    info = {
        "versions": {name: package_version(name) for name in ALTERNATIVE_PACKAGES[1:]},
        "layout": "q/k/v transposed to [B,S,H,N,d] and back; bias [B,1,H,N,N] cast to f32",
    }
    if case.dtype_name == "f32":
        info["note"] = ("cuequivariance_ops_jax runs the float32 backward in TF32 "
                        "(no full-float32 backward; it warns)")
    return jitted_pair(cuequivariance_op(cuet, case.scale), info)


def _build_tokamax(case: Case, implementation: str, half_only: bool = False) -> Callables:
    """The builder of a tokamax entry; `implementation` is a key of tokamax's registry."""
    if not on_gpu():
        raise Unavailable(f"tokamax's {implementation} kernels need a GPU")
    if half_only and case.dtype_name not in HALF_DTYPES:
        # tokamax 0.0.17 maps float32 to the TF32 (or F32) dot preset, and its
        # Mosaic GPU kernels cast only to bf16/fp16: NotImplementedError.
        raise Unavailable(f"tokamax's {implementation} kernels take bf16/fp16 only")
    tokamax = tokamax_with(implementation)
    info = {"versions": {"tokamax": package_version("tokamax")},
            "implementation": implementation,
            "layout": "no transpose: (B, S) are batch dims; bias [B,1,H,N,N], mask [B,S,1,1,N]",
            "config": "tokamax's default (its autotuning cache, else heuristics)"}
    if case.dtype_name == "f32":
        info["note"] = "tokamax's default precision for float32 on GPU is TF32"
    return jitted_pair(tokamax_op(tokamax, case.scale, implementation), info)


def build_tokamax_mosaic(case: Case) -> Callables:
    """`tokamax.dot_product_attention(implementation="mosaic")` on NVIDIA (Mosaic GPU kernels)."""
    # "mosaic_gpu" is what tokamax's API makes of implementation="mosaic" when
    # the default device's kind contains "NVIDIA" (else it picks "mosaic_tpu");
    # naming it directly never takes the TPU kernels.
    return _build_tokamax(case, "mosaic_gpu", half_only=True)


def build_tokamax_triton(case: Case) -> Callables:
    """`tokamax.dot_product_attention(implementation="triton")`: Pallas Triton kernels."""
    return _build_tokamax(case, "triton")


IMPLEMENTATIONS: dict[str, Callable[[Case], Callables]] = {
    "msa_pallas": build_msa_pallas,
    "msa_pallas_triton": build_msa_pallas_triton,
    "msa_pallas_mosaic": build_msa_pallas_mosaic,
    "msa_pallas_skip": build_msa_pallas_skip,
    "msa_pallas_persistent": build_msa_pallas_persistent,
    "msa_pallas_skip_k64": build_msa_pallas_skip_k64,
    "msa_pallas_skip_k64_dbias": build_msa_pallas_skip_k64_dbias,
    "msa_pallas_skip_mask_queries": build_msa_pallas_skip_mask_queries,
    "msa_pallas_skip_mask_queries_q64": build_msa_pallas_skip_mask_queries_q64,
    "msa_pallas_skip_mask_queries_narrow": build_msa_pallas_skip_mask_queries_narrow,
    "msa_pallas_lean": build_msa_pallas_lean,
    "msa_pallas_skip_lean": build_msa_pallas_skip_lean,
    "msa_pallas_mask_with_select": build_msa_pallas_mask_with_select,
    "msa_pallas_skip_mask_with_select": build_msa_pallas_skip_mask_with_select,
    "msa_pallas_prologue": build_msa_pallas_prologue,
    "msa_pallas_skip_xla_prologue": build_msa_pallas_skip_xla_prologue,
    "msa_pallas_dpa": build_msa_pallas_dpa,
    "xla": build_xla,
    "cudnn": build_cudnn,
    "cuequivariance": build_cuequivariance,
    "tokamax_mosaic": build_tokamax_mosaic,
    "tokamax_triton": build_tokamax_triton,
    "jax_mha_nobias": build_jax_mha_nobias,
}
# Timed for comparison but computing a different operation (no bias, no mask):
# never an alternative to beat, and its output is not checked.
REFERENCE_POINTS = ("jax_mha_nobias",)
# msa_pallas' own variants: checked, timed, never a yardstick.
OWN_VARIANTS = ("msa_pallas_triton", "msa_pallas_mosaic", "msa_pallas_skip",
                "msa_pallas_persistent", "msa_pallas_skip_k64", "msa_pallas_skip_k64_dbias",
                "msa_pallas_skip_mask_queries", "msa_pallas_skip_mask_queries_q64",
                "msa_pallas_skip_mask_queries_narrow",
                "msa_pallas_lean",
                "msa_pallas_skip_lean", "msa_pallas_mask_with_select",
                "msa_pallas_skip_mask_with_select", "msa_pallas_prologue",
                "msa_pallas_skip_xla_prologue", "msa_pallas_dpa")
# What the full table measures unless asked for more: msa_pallas and every
# alternative (the variants and reference points add half again to its time).
TABLE_IMPLEMENTATIONS = tuple(
    name for name in IMPLEMENTATIONS if name not in OWN_VARIANTS + REFERENCE_POINTS
)


# --- attention cores for msa_pallas' Flax layer --------------------------------


def gated_attention_fn(op_for_scale: Callable[[float], Callable]) -> Callable:
    """An `attention_fn` with `msa_pallas.msa_row_attention`'s signature around an op
    without a gate.

    `op_for_scale(scale)` returns `op(q, k, v, bias, mask)` in the benchmark's
    form (above). The returned function takes q/k/v/gate `[*batch, S, N, H, d]`
    (the batch dimensions folded into one for the op), bias `[*batch, H, N, N]`,
    mask `[*batch, S, N]` (nonzero keeps a key; None keeps every key), and
    returns `op(...) * sigmoid(gate)` in q's dtype, the gate applied in float32
    as msa_pallas' kernels do. `implementation` and `block_config` are
    msa_pallas' own knobs and are ignored; attention dropout is refused.
    """

    def attention_fn(q, k, v, bias, mask=None, gate=None, *, scale=None, implementation=None,
                     block_config=None, dropout_rate=0.0, dropout_rng=None):
        del implementation, block_config, dropout_rng
        if dropout_rate:
            raise NotImplementedError("attention dropout is not in this core")
        *batch, s, n, h, d = q.shape
        folded = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
        keep = (jnp.ones((*batch, s, n), jnp.bool_) if mask is None
                else mask if mask.dtype == jnp.bool_ else mask != 0)
        op = op_for_scale(1.0 / math.sqrt(d) if scale is None else scale)
        out = op(folded(q), folded(k), folded(v), folded(bias), folded(keep))
        out = out.reshape(*batch, s, n, h, d).astype(jnp.float32)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
        return out.astype(q.dtype)

    return attention_fn


def cuequivariance_core() -> Callable:
    """cuEquivariance's `triangle_attention` as a layer's attention core (GPU only)."""
    if not on_gpu():
        raise Unavailable("cuEquivariance's kernels need a GPU")
    cuet = import_cuequivariance()
    return gated_attention_fn(lambda scale: cuequivariance_op(cuet, scale))


def tokamax_core(implementation: str) -> Callable:
    """tokamax's `dot_product_attention` with `implementation` as a layer's attention core."""
    if not on_gpu():
        raise Unavailable(f"tokamax's {implementation} kernels need a GPU")
    tokamax = tokamax_with(implementation)
    return gated_attention_fn(lambda scale: tokamax_op(tokamax, scale, implementation))


# name -> a function returning the layer's `attention_fn`, or raising `Unavailable`.
LAYER_CORES: dict[str, Callable[[], Callable]] = {
    "cuequivariance": cuequivariance_core,
    "tokamax_mosaic": lambda: tokamax_core("mosaic_gpu"),
    "tokamax_triton": lambda: tokamax_core("triton"),
}
