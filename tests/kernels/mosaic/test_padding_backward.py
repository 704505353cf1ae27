"""The Mosaic GPU backward kernels on padded masks (issue 36): what they skip
changes no result.

With a mask the dq kernel loops over the key tiles that hold its rows' kept
keys, the dk/dv kernel runs no query loop for a key tile its rows keep
nothing of (a dead row there takes the mean of its `do` as dv), and the
bias-gradient kernel loops over the MSA rows that keep a key of its key
tile. Each case runs the kernels with skipping and without
(`skip_masked=False`) on the same residuals and checks:

- every element finite: the interpreter fills outputs with NaN, so an
  element a skipping kernel leaves unwritten fails here (on the GPU, the
  bitwise comparison with the unskipped kernels, which write everything);
- dq, dk, the bias gradient and the dv of every row that keeps a key
  bitwise equal to the unskipped kernels' (a skipped tile adds exactly 0);
  the dv of dead rows equal to the float64 mean of their `do` over the N
  queries, element by element, and dq, dk of dead rows exactly 0;
- all four against the float64 NumPy gradients by relative error.

The persistent dq and dk/dv kernels (one CTA per SM, `tiles.persistent`)
are held bitwise to the kernels of one CTA per item, skipping and not.

Masks: padded residues at the end and in the middle (a whole key tile),
padded rows at the end and in the middle, a batch element that is all
padding, masks that differ from row to row (some starting past the first
key tile), N no whole number of tiles (and no multiple of 8).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
import numpy_reference
from msa_pallas.block_sizes import row_chunks
from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.tiles import MosaicBackwardTiles, MosaicTiles

from benchmarks import shapes

# MSA-row pairs (two consumers) and one row per CTA, 64 x 64 tiles.
PAIRS = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=2)
ONE_ROW = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=1)
# The GPU tests' shapes (train-like, 16 MSA rows).
GPU_SHAPES = {"N256": (1, 16, 256, 8, 32), "N333": (1, 16, 333, 8, 32), "d8": (1, 16, 256, 8, 8),
              "H16": (1, 16, 200, 16, 32)}
# Enough dead row groups (B·H·S/8 of them) that a persistent CTA (one per
# SM) writes several, one after the other.
MANY_DEAD_GROUPS = {"S256": (2, 256, 128, 8, 32), "S256-d8": (2, 256, 128, 8, 8),
                    # N no whole number of the dead rows' zero chunks (16 residues),
                    # so a row's last chunk is cut at N; past it, after batch
                    # element 0's last row (dead), lies batch element 1's first (live).
                    "S256-N136": (2, 256, 136, 8, 32)}
KERNEL_OUTPUTS = {"dq": ("dq",), "dkdv": ("dk", "dv"), "dbias": ("dbias",)}
# The skipping inputs every Mosaic kernel reads (`key_tiles.span_operands`).
SPANS = ("key_from_first", "key_end", *key_tiles.EXTENT_NAMES)


def padded_keep(kind: str, batch: int, rows: int, n_res: int, rng) -> np.ndarray:
    """`[B, S, N]` bool (True keeps a key), a few random holes among the
    kept keys, and batch element 1 (where B > 1) all padding.

    kind: "end" (the last quarter of the residues masked in every row; the
    last row and row 1 dead), "start" (the first 64 residues masked in
    every row, row 2 dead), "middle" (keys 64-127, a whole 64-key tile,
    masked in every row; row 1 dead) or "rows" (each row keeps a range of
    its own: row 0 from key 70, row 1 keys 64-89, row 2 the first 30, row
    3 none, the others every key).
    """
    keep = rng.random((batch, rows, n_res)) >= 0.1
    if kind == "end":
        keep[:, :, n_res - n_res // 4:] = False
        keep[:, [1, rows - 1]] = False
    elif kind == "start":
        keep[:, :, :64] = False
        keep[:, 2] = False
    elif kind == "middle":
        keep[:, :, 64:128] = False
        keep[:, 1] = False
    elif kind == "rows":
        for row, (start, end) in enumerate([(70, n_res), (64, 90), (0, 30)]):
            keep[:, row, :start] = False
            keep[:, row, end:] = False
        keep[:, 3] = False
    else:
        raise ValueError(kind)
    if batch > 1:
        keep[1] = False
    return keep


def inputs_with_keep(seed, keep, heads, head_dim, dtype, bias_dtype, gate=False):
    batch, rows, n_res = keep.shape
    inputs = helpers.random_inputs(
        seed, batch, rows, n_res, heads, head_dim, dtype, bias_dtype=bias_dtype, gate=gate,
        mask_rate=None,
    )
    return inputs._replace(mask=jnp.asarray(keep))


def run_kernels(operands, scale, tiles: MosaicBackwardTiles, kernels, *, skip: bool,
                interpret: bool = True, mask_queries: bool = False) -> dict:
    """The gradients by name of `kernels` (names of KERNEL_OUTPUTS)."""
    grads = {}
    for kernel in kernels:
        function = getattr(mosaic_backward, f"backward_{kernel}")
        extra = {} if kernel == "dbias" else {"ping_pong": tiles.ping_pong}
        if mask_queries:
            extra["mask_queries"] = True
        outs = function(
            *operands, scale=scale, tiles=getattr(tiles, kernel), interpret=interpret,
            skip_masked=skip, **extra,
        )
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads.update(zip(KERNEL_OUTPUTS[kernel], outs))
    return grads


def check_padded(inputs, operands, scale, tiles, kernels=tuple(KERNEL_OUTPUTS), *,
                 interpret: bool = True, label: str = "", regrouped: tuple = ()) -> dict:
    """Skipped against unskipped and against float64 (the module docstring);
    returns the kernels' gradients by name (as `run_kernels`) for each value
    of `skip`, `{True: ..., False: ...}`. `regrouped`: the outputs whose
    float32 sums skipping groups otherwise (the bias gradient's row chunks),
    equal to the unskipped ones up to float32 rounding, not bit for bit."""
    skipped = run_kernels(operands, scale, tiles, kernels, skip=True, interpret=interpret)
    unskipped = run_kernels(operands, scale, tiles, kernels, skip=False, interpret=interpret)
    q, k, v, bias, mask, _, dout = inputs.args
    keep = np.asarray(mask) != 0
    dead = ~keep.any(axis=-1)
    assert dead.any() and not dead.all(), "a case needs dead rows and live ones"
    expected = dict(zip(
        ("dq", "dk", "dv", "dbias"),
        numpy_reference.vjp(q, k, v, bias, mask, None, scale, dout)[:4],
    ))
    tolerance = helpers.tolerance(q.dtype)
    errors = {}
    for name, got in skipped.items():
        helpers.assert_finite(got, name)
        assert got.shape == expected[name].shape, (name, got.shape)
        got64, unskipped64 = helpers.to_f64(got), helpers.to_f64(unskipped[name])
        if name == "dv":
            live = ~dead
            np.testing.assert_array_equal(got64[live], unskipped64[live], err_msg=name)
            dead_mean = helpers.to_f64(dout)[dead].mean(axis=1, keepdims=True)
            np.testing.assert_allclose(
                got64[dead], np.broadcast_to(dead_mean, got64[dead].shape),
                rtol=tolerance, atol=tolerance * np.abs(dead_mean).max(), err_msg="dead dv",
            )
        elif name in regrouped:
            # Float32 roundings of the partial sums apart: far less than
            # one row's share of the sum, which a lost row would take.
            np.testing.assert_allclose(
                got64, unskipped64, rtol=0, atol=1e-5 * np.abs(unskipped64).max(), err_msg=name,
            )
        else:
            np.testing.assert_array_equal(got64, unskipped64, err_msg=name)
        if name in ("dq", "dk"):
            assert not got64[dead].any(), f"{name} of dead rows"
        errors[name] = helpers.rel_err(got, expected[name])
    print(f"[rel err] {label}: {errors}")
    assert all(e <= tolerance for e in errors.values()), errors
    return {True: skipped, False: unskipped}


# (mask kind, B, S, N, H, d, q dtype, bias dtype, tiles).
CASES = {
    # Row pairs: dead row 1 beside live row 0 (computed where row 0 keeps
    # the tile, the mean of do elsewhere), row group (2, 3) likewise, batch
    # element 1 all padding (every loop empty).
    "end-pairs-N72": ("end", 2, 4, 72, 1, 32, jnp.bfloat16, jnp.float32, PAIRS),
    # A masked key tile in the middle of every row, a dead row in the
    # middle; one row per CTA (odd S), bias in the input dtype.
    "middle-odd-S-bias-fp16": ("middle", 1, 3, 136, 1, 16, jnp.float16, jnp.float16, ONE_ROW),
    # Rows of their own: dq's loop from key tile 1 for rows 0-1, the bias
    # gradient's from row 2 for key tile 0; N no multiple of 8.
    "rows-N101": ("rows", 1, 4, 101, 1, 32, jnp.bfloat16, jnp.bfloat16, PAIRS),
    # d = 8 with two heads per tile: the dead rows' dv per head.
    "end-d8-paired-heads": ("end", 1, 4, 72, 2, 8, jnp.bfloat16, jnp.float32, PAIRS),
    # float32 inputs (bf16 pieces) loop between the same bounds as 16-bit
    # ones: not repeated here (their pieces are checked in test_backward.py).
}


@pytest.mark.parametrize("case", list(CASES))
def test_skipping_changes_nothing(case, seed):
    kind, batch, rows, n_res, heads, head_dim, dtype, bias_dtype, tiles = CASES[case]
    keep = padded_keep(kind, batch, rows, n_res, np.random.default_rng(seed))
    inputs = inputs_with_keep(seed, keep, heads, head_dim, dtype, bias_dtype)
    operands, scale = helpers.mosaic_backward_operands(inputs)
    backward_tiles = MosaicBackwardTiles(dkdv=tiles, dq=tiles, dbias=tiles, ping_pong=True)
    check_padded(inputs, operands, scale, backward_tiles, label=f"padded {case}")


def test_bias_gradient_over_row_chunks(seed):
    """S = 34 on two tiles and two chunks: the rows between the bounds of
    each key tile shared out between them. Rows 0-4 keep no key of the
    first key tile (its rows 5-24: chunk 0 sums rows 5-14, chunk 1 rows
    15-24), rows 25-33 are dead (the second tile's rows 0-24: 0-11 and
    12-24), row 20 is dead in the middle."""
    rows, n_res = 34, 128
    tiles = MosaicTiles(block_q=64, block_k=64, num_stages=2, msa_rows=1)
    assert row_chunks(2 * 2, rows) == 2
    keep = np.random.default_rng(seed).random((1, rows, n_res)) >= 0.1
    keep[:, :5, :64] = False
    keep[:, 25:] = False
    keep[:, 20] = False
    inputs = inputs_with_keep(seed, keep, 1, 16, jnp.bfloat16, jnp.float32)
    operands, scale = helpers.mosaic_backward_operands(inputs)
    backward_tiles = MosaicBackwardTiles(dkdv=tiles, dq=tiles, dbias=tiles)
    check_padded(inputs, operands, scale, backward_tiles, ("dbias",), label="dbias chunks",
                 regrouped=("dbias",))


# (tiles, H, d, N, first dead row at the end): two heads per tile (d = 8), and
# rows of 9 heads of d = 32, whose dead rows' zeros take two boxes per row (144 of
# 288 columns) and 16-residue chunks, the last past N. "few-items": one live row,
# one key or query tile: two live items for the interpreter's three CTAs, the third
# of which stores its share of the dead rows' zeros and serves no item.
PERSISTENT_CASES = {
    "row-pairs": (PAIRS, 2, 8, 72, 5), "one-row": (ONE_ROW, 2, 8, 72, 5),
    "wide-rows": (PAIRS, 9, 32, 40, 5), "few-items": (ONE_ROW, 2, 8, 40, 1),
}


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
def test_persistent_kernel_equals_one_cta_per_item(kernel, case, seed):
    """The persistent dq and dk/dv kernels (one CTA per SM,
    `tiles.persistent`) on padding rows at the end of the alignment: rows
    5-7 dead in every batch element (1-7 in "few-items"), so the row groups
    after row 5 have no loop, only their stores (dq = dk = 0 from the
    producer's spare warp, dv the mean of do); row 1 dead in the middle,
    batch element 1 all padding, the last quarter of the residues masked.
    Row pairs (row 5 dead beside live row 4) and one row per group. Skipping
    and not (every group live), against float64 and
    bitwise against the kernel of one CTA per item."""
    tiles, heads, head_dim, n_res, first_dead = PERSISTENT_CASES[case]
    rows = 8
    keep = padded_keep("end", 2, rows, n_res, np.random.default_rng(seed))
    keep[:, first_dead:] = False
    inputs = inputs_with_keep(seed, keep, heads, head_dim, jnp.bfloat16, jnp.float32)
    operands, scale = helpers.mosaic_backward_operands(inputs)
    per_item = MosaicBackwardTiles(dkdv=tiles, dq=tiles, dbias=tiles)
    per_sm = dataclasses.replace(per_item, **{kernel: dataclasses.replace(tiles, persistent=True)})
    runs = check_padded(inputs, operands, scale, per_sm, (kernel,), label=f"persistent {kernel}")
    for skip, got in runs.items():
        expected = run_kernels(operands, scale, per_item, (kernel,), skip=skip)
        for name in KERNEL_OUTPUTS[kernel]:
            np.testing.assert_array_equal(helpers.to_f64(got[name]), helpers.to_f64(expected[name]),
                                          err_msg=f"{name} skip={skip}")


# With the first 64 residues padded in every row: dq's items of query tile 0 run no
# loop, and the bias gradient's first CTA (two consumers' query tiles) holds kept
# residues in its second half alone.
MASKED_QUERY_CASES = {
    "start-pairs-N136": ("start", 2, 4, 136, 1, 32, jnp.bfloat16, jnp.float32, PAIRS),
}


@pytest.mark.parametrize("persistent", [False, True], ids=["per-item", "persistent"])
@pytest.mark.parametrize(
    "case", ["end-pairs-N72", "rows-N101", "end-d8-paired-heads", *MASKED_QUERY_CASES]
)
def test_masked_queries_skip_only_zeros(case, persistent, seed):
    """With the queries masked too (the op's `mask_queries`), `do` is 0 at a
    masked residue and a dead row is all zeros: the kernels told so
    (`mask_queries`) skip query tiles that hold no kept residue (dk/dv's
    loops past the last, dq's items, the bias gradient's CTAs) and read no dead row's `do`
    for its dv. What they skip adds exactly 0: bitwise the kernels that
    skip masked keys alone, every element written (the interpreter's NaN),
    and a dead row's dv 0. Per item and persistent (the dead row groups'
    stores)."""
    kind, batch, rows, n_res, heads, head_dim, dtype, bias_dtype, tiles = (
        CASES | MASKED_QUERY_CASES)[case]
    keep = padded_keep(kind, batch, rows, n_res, np.random.default_rng(seed))
    inputs = inputs_with_keep(seed, keep, heads, head_dim, dtype, bias_dtype)
    inputs = inputs._replace(dout=inputs.dout * jnp.asarray(keep, inputs.dout.dtype)[..., None, None])
    operands, scale = helpers.mosaic_backward_operands(inputs)
    tiles = dataclasses.replace(tiles, persistent=persistent)
    backward_tiles = MosaicBackwardTiles(dkdv=tiles, dq=tiles, dbias=tiles, ping_pong=True)
    masked = run_kernels(operands, scale, backward_tiles, KERNEL_OUTPUTS, skip=True,
                         mask_queries=True)
    keys_only = run_kernels(operands, scale, backward_tiles, KERNEL_OUTPUTS, skip=True)
    dead = ~keep.any(axis=-1)
    assert dead.any() and not dead.all()
    for name, got in masked.items():
        helpers.assert_finite(got, name)
        np.testing.assert_array_equal(helpers.to_f64(got), helpers.to_f64(keys_only[name]),
                                      err_msg=name)
    assert not helpers.to_f64(masked["dv"])[dead].any()
    assert not helpers.to_f64(masked["dq"])[~keep].any()


def test_mask_queries_needs_skipping():
    """The kernels mask queries only where they skip padding (without
    dropout, and dk/dv without a dead_dv of its own): else a clear error."""
    shape = (1, 4, 96, 2, 32)
    q = jnp.zeros(shape, jnp.bfloat16)
    bias = jnp.zeros((1, 2, 96, 96), jnp.float32)
    stats = jnp.zeros((1, 4, 2, 3, 96), jnp.float32)
    mask = jnp.ones((1, 4, 96), jnp.int8)
    for kernel in KERNEL_OUTPUTS:
        function = getattr(mosaic_backward, f"backward_{kernel}")
        with pytest.raises(ValueError, match="mask_queries"):
            jax.eval_shape(lambda: function(  # noqa: B023
                q, q, q, bias, mask, q, stats, scale=0.2, tiles=PAIRS, interpret=True,
                skip_masked=False, mask_queries=True,
            ))
    with pytest.raises(ValueError, match="mask_queries"):
        jax.eval_shape(lambda: mosaic_backward.backward_dkdv(
            q, q, q, bias, mask, q, stats, scale=0.2, tiles=PAIRS, interpret=True,
            skip_masked=True, mask_queries=True, dead_dv=jnp.zeros((1, 4, 2, 32), jnp.float32),
        ))


class _Launched(Exception):
    """Raised by the spied launch: the inputs are all a test wants."""


@pytest.mark.parametrize("mask_kind", ["none", "mask", "mask-unskipped"])
def test_inputs_of_each_kernel(mask_kind, monkeypatch):
    """What each kernel is launched with: without a mask the inputs and
    shared memory of the unmasked kernels as they were (no bounds, no
    dead-row vector); with one, the mask and its bounds (and, for dk/dv,
    the dead rows' dv); with skipping off, the mask alone."""
    launched = {}

    def spy(kernel):
        def launch(body, plan, *, inputs, out_types, interpret):
            launched[kernel] = (set(inputs), set(plan.smem))
            raise _Launched

        return launch

    for kernel in KERNEL_OUTPUTS:
        module = importlib.import_module(f"msa_pallas.kernels.mosaic.backward.{kernel}")
        monkeypatch.setattr(module, "launch", spy(kernel))
    shape = (1, 4, 96, 2, 32)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 2, 96, 96), jnp.float32)
    stats = jax.ShapeDtypeStruct((1, 4, 2, 3, 96), jnp.float32)
    mask = None if mask_kind == "none" else jax.ShapeDtypeStruct((1, 4, 96), jnp.int8)
    for kernel in KERNEL_OUTPUTS:
        function = getattr(mosaic_backward, f"backward_{kernel}")
        with pytest.raises(_Launched):
            jax.eval_shape(
                lambda q, bias, mask, stats: function(  # noqa: B023
                    q, q, q, bias, mask, q, stats, scale=0.2, tiles=PAIRS, interpret=False,
                    skip_masked=mask_kind != "mask-unskipped",
                ),
                q, bias, mask, stats,
            )
    unmasked = {"q", "k", "v", "do", "stats"}
    added = {
        "none": {"dq": set(), "dkdv": set(), "dbias": set()},
        "mask": {"dq": {"mask", *SPANS}, "dkdv": {"mask", *SPANS, "dead_dv"},
                 "dbias": {"mask", *SPANS}},
        "mask-unskipped": {"dq": {"mask"}, "dkdv": {"mask"}, "dbias": {"mask"}},
    }[mask_kind]
    for kernel, (inputs, smem) in launched.items():
        bias_name = "bias_t" if kernel == "dkdv" else "bias"
        assert inputs == unmasked | {bias_name} | added[kernel], (kernel, inputs)
        assert ("dead_dv" in smem) == ("dead_dv" in added[kernel]), (kernel, smem)


# N = 256 lowers as N = 333 does, with no ragged last tile: not repeated here.
@pytest.mark.parametrize("shape", ["N333", "d8"])
def test_gpu_shapes_lower_with_skipping(shape):
    """The three kernels with a mask (bounds, dead-row vector) lower for
    CUDA at the GPU tests' shapes with their default tiles, both bias
    widths."""
    dims = GPU_SHAPES[shape]
    for bias_dtype in (jnp.float32, jnp.bfloat16):
        operands = mosaic_lowering.backward_operands(dims, jnp.bfloat16, bias_dtype)
        tiles = mosaic_backward.default_tiles(dims, jnp.bfloat16, bias_dtype)
        for kernel in KERNEL_OUTPUTS:
            function = getattr(mosaic_backward, f"backward_{kernel}")
            text = mosaic_lowering.lowered_for_cuda(
                lambda *args: function(  # noqa: B023
                    *args, scale=0.2, tiles=getattr(tiles, kernel), interpret=False  # noqa: B023
                ),
                *operands,
            )
            assert "mosaic_gpu" in text, (shape, bias_dtype, kernel)


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("shape", ["N333", "d8"])
def test_persistent_kernels_lower_for_the_gpu(shape, kernel):
    """The persistent dq and dk/dv kernels lower for CUDA at the GPU tests'
    shapes with their default tiles made persistent, skipping and not, both
    bias widths."""
    dims = GPU_SHAPES[shape]
    function = getattr(mosaic_backward, f"backward_{kernel}")
    for bias_dtype in (jnp.float32, jnp.bfloat16):
        operands = mosaic_lowering.backward_operands(dims, jnp.bfloat16, bias_dtype)
        tiles = mosaic_backward.default_tiles(dims, jnp.bfloat16, bias_dtype)
        persistent = dataclasses.replace(getattr(tiles, kernel), persistent=True)
        for skip in (True, False):
            text = mosaic_lowering.lowered_for_cuda(
                lambda *args: function(  # noqa: B023
                    *args, scale=0.2, tiles=persistent, interpret=False,  # noqa: B023
                    skip_masked=skip,  # noqa: B023
                ),
                *operands,
            )
            assert "mosaic_gpu" in text, (shape, bias_dtype, skip)


# --- On the GPU: train-like sizes, the padded mask of the benchmarks. ---

def gpu_residuals(inputs):
    """The operands from the Mosaic forward (compiled)."""
    q, k, v, bias, mask, _, dout = inputs.args
    mask, scale = mask.astype(jnp.int8), q.shape[-1] ** -0.5
    forward_tiles = mosaic_forward.default_tiles(q.shape, q.dtype, bias.dtype, save_stats=True)
    _, attention, row_max, row_log2_sum = mosaic_forward.attention_forward(
        q, k, v, bias, mask, None, scale=scale, tiles=forward_tiles, interpret=False,
        save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    return (q, k, v, bias, mask, dout, jnp.stack([row_max, row_log2_sum, delta], axis=3)), scale


def benchmark_padded_keep(dims) -> np.ndarray:
    """benchmarks/shapes.py's padded mask (the last quarter of residues and
    of MSA rows padding) with a dead row in the middle too."""
    shape = shapes.Shape("padded", tuple(dims), mask="padded")
    keep = np.array(shapes.make_mask(shape, jax.random.key(0)))
    keep[:, dims[1] // 3] = False
    return keep


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["bias-f32", "bias-bf16"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_skipping_changes_nothing(shape, bias_dtype, seed):
    """The compiled kernels with their default tiles on the padded mask:
    skipped equal to unskipped bitwise (dead rows' dv: their mean of do; the
    bias gradient up to rounding, its row chunks sharing the live rows),
    and against float64."""
    dims = GPU_SHAPES[shape]
    keep = benchmark_padded_keep(dims)
    inputs = inputs_with_keep(seed, keep, *dims[3:], jnp.bfloat16, bias_dtype)
    operands, scale = gpu_residuals(inputs)
    tiles = mosaic_backward.default_tiles(inputs.q.shape, jnp.bfloat16, bias_dtype)
    check_padded(inputs, operands, scale, tiles, interpret=False, label=f"gpu padded {shape}",
                 regrouped=("dbias",))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*GPU_SHAPES, *MANY_DEAD_GROUPS])
def test_gpu_persistent_kernels_equal_one_cta_per_item(shape, seed):
    """The compiled persistent dq and dk/dv kernels (their default tiles,
    one CTA per SM) on the padded mask, whose last quarter of MSA rows is
    dead: bitwise the one-CTA-per-item kernels' gradients, skipping and not."""
    dims = {**GPU_SHAPES, **MANY_DEAD_GROUPS}[shape]
    inputs = inputs_with_keep(seed, benchmark_padded_keep(dims), *dims[3:], jnp.bfloat16,
                              jnp.float32)
    operands, scale = gpu_residuals(inputs)
    tiles = mosaic_backward.default_tiles(inputs.q.shape, jnp.bfloat16, jnp.float32)
    persistent = dataclasses.replace(
        tiles, dq=dataclasses.replace(tiles.dq, persistent=True),
        dkdv=dataclasses.replace(tiles.dkdv, persistent=True),
    )
    for skip in (True, False):
        expected = run_kernels(operands, scale, tiles, ("dq", "dkdv"), skip=skip, interpret=False)
        got = run_kernels(operands, scale, persistent, ("dq", "dkdv"), skip=skip, interpret=False)
        for name, value in got.items():
            helpers.assert_finite(value, name)
            np.testing.assert_array_equal(helpers.to_f64(value), helpers.to_f64(expected[name]),
                                          err_msg=f"{name} skip={skip}")


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
def test_gpu_op_on_a_padded_batch(gate, seed):
    """`implementation="mosaic"` forward and gradients on the padded train
    crop's mask (16 rows), against float64."""
    dims = GPU_SHAPES["N256"]
    inputs = inputs_with_keep(
        seed, benchmark_padded_keep(dims), *dims[3:], jnp.bfloat16, jnp.float32, gate=gate
    )
    result = jax.block_until_ready(helpers.fwd_bwd("mosaic", skip_padding=True)(*inputs.args))
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, helpers.numpy_results(inputs), helpers.tolerance(jnp.bfloat16),
        f"gpu mosaic padded gate={gate}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*GPU_SHAPES, *MANY_DEAD_GROUPS])
def test_gpu_masked_queries_skip_only_zeros(shape, seed):
    """`test_masked_queries_skip_only_zeros` compiled, with the tiles the
    dispatch takes skipping padding (persistent dq and dk/dv) on the padded
    mask: told to mask queries, the kernels equal bitwise those that skip
    masked keys alone on the same `do` (0 at masked residues)."""
    dims = {**GPU_SHAPES, **MANY_DEAD_GROUPS}[shape]
    keep = benchmark_padded_keep(dims)
    inputs = inputs_with_keep(seed, keep, *dims[3:], jnp.bfloat16, jnp.float32)
    inputs = inputs._replace(dout=inputs.dout * jnp.asarray(keep, inputs.dout.dtype)[..., None, None])
    operands, scale = gpu_residuals(inputs)
    tiles = mosaic_backward.default_tiles(inputs.q.shape, jnp.bfloat16, jnp.float32,
                                          persistent=True)
    masked = run_kernels(operands, scale, tiles, KERNEL_OUTPUTS, skip=True, interpret=False,
                         mask_queries=True)
    keys_only = run_kernels(operands, scale, tiles, KERNEL_OUTPUTS, skip=True, interpret=False)
    for name, got in masked.items():
        helpers.assert_finite(got, name)
        np.testing.assert_array_equal(helpers.to_f64(got), helpers.to_f64(keys_only[name]),
                                      err_msg=name)
    assert not helpers.to_f64(masked["dq"])[~keep].any()
