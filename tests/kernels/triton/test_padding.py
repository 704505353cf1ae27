"""The Triton kernels skip what the key mask removes (issue 36), exactly.

With a mask, every Triton kernel loops between bounds read from the mask's
summary (`msa_pallas.kernels.key_tiles`) and gives rows that keep no key
("dead" rows) their uniform-weight results without a matrix product. The
kernels' `skip_padding=False` visits every tile and row, as they did before;
these tests run both on padded masks and check:

- the skipping kernels equal the visiting ones bit for bit (every logit a
  skipped tile holds underflows, so it adds exact zeros), except the two
  results a dead row gets as a mean (its ungated output: the mean of v; its
  dv: the mean of `do`): those are summed in another order and compared with
  float64;
- both, and the op's forward and gradients through `implementation="triton"`,
  against the float64 references (tests/numpy_reference.py).

In interpret mode an output element no program writes holds NaN: every
result is checked finite, so a skipped row or tile left unwritten fails.
The masks: padded residues at the end and in the middle (a whole tile), at
the start of a row, padded MSA rows at the end and one in the middle, a
batch element that is all padding, and rows that each keep their own keys;
N is never a multiple of the tile. The `gpu` tests run the compiled kernels
at train-like sizes with the benchmark's padded mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
import numpy_reference
from helpers import rel_err, tolerance
from msa_pallas import exporting
from msa_pallas.block_sizes import BlockConfig, KernelTiles, default_block_config
from msa_pallas.kernels.triton import backward, forward

from benchmarks import shapes

# Small tiles, so that N = 40 has three key tiles, the last one partial.
SMALL = dict(block_q=16, block_k=16, num_warps=4, num_stages=2)
SMALL_CONFIG = BlockConfig(
    forward=KernelTiles(**SMALL),
    backward_dkdv=KernelTiles(**SMALL, msa_rows=2),
    backward_dq=KernelTiles(**SMALL),
    backward_dbias=KernelTiles(**SMALL),
)
# The fused dq+dbias kernel in place of dq and dbias (one key tile spans N).
FUSED_CONFIG = dataclasses.replace(
    SMALL_CONFIG, backward_dq_dbias=KernelTiles(block_q=16, block_k=64, num_warps=2)
)


# --- masks: [B, S, N] bool, True keeps a key ---------------------------------------


def padded_mask(batch: int, rows: int, n_res: int, kind: str, rng) -> np.ndarray:
    """A padded key mask of one `kind` (see the module docstring)."""
    keep = np.ones((batch, rows, n_res), bool)
    residues = n_res - n_res // 3
    if kind == "end":  # padded residues at the end of every row
        keep[..., residues:] = False
    elif kind == "middle":  # a masked span holding a whole 16-key tile
        keep[..., 14:34] = False
    elif kind == "rows":  # padded residues, the last rows and one middle row dead
        keep[..., residues:] = False
        keep[:, rows - max(1, rows // 4):] = False
        keep[:, rows // 2 - 1] = False
    elif kind == "batch":  # batch element 1 is all padding
        keep[..., residues:] = False
        keep[1:] = False
    elif kind == "varying":  # each row its own length, holes, a padded start
        for b in range(batch):
            for s in range(rows):
                keep[b, s, rng.integers(n_res // 4, n_res + 1):] = False
        keep &= rng.random(keep.shape) > 0.2
        keep[:, 0, :n_res // 2] = False
        keep[:, 0, -1] = True
        keep[0, -1] = False
    else:
        raise ValueError(kind)
    return keep


MASK_KINDS = ("end", "middle", "rows", "batch", "varying")


def dead_rows(keep: np.ndarray) -> np.ndarray:
    """`[B, S]` bool: the rows that keep no key."""
    return ~keep.any(axis=-1)


def random_operands(seed, shape, dtype, bias_dtype, gate: bool):
    """q, k, v, do, bias and gate (or None): fresh normal draws."""
    rng = np.random.default_rng(seed)
    batch, rows, n_res, heads, _ = shape
    normal = lambda s, dt: jnp.asarray(rng.standard_normal(s, dtype=np.float32).astype(dt))
    q, k, v, do = (normal(shape, dtype) for _ in range(4))
    bias = normal((batch, heads, n_res, n_res), bias_dtype)
    return q, k, v, do, bias, normal(shape, dtype) if gate else None


# --- the kernels, skipping and not ---------------------------------------------------


def run_kernels(q, k, v, do, bias, mask, gate, config: BlockConfig, *, skip: bool,
                interpret: bool, stats=None):
    """Every Triton kernel of `config` on one set of inputs: a dict of NumPy
    arrays (out, attention, row_max, row_log2_sum; dk, dv, dq, dbias, and
    dq_fused, dbias_fused where the config has the fused kernel).

    The backward kernels read `stats` (row_max, row_log2_sum, attention) when
    given, else this forward's: the same statistics for a skipping and a
    visiting run isolate the backward's comparison."""
    scale = q.shape[-1] ** -0.5
    common = dict(scale=scale, interpret=interpret, skip_padding=skip)
    out, attention, row_max, row_log2_sum = forward.attention_forward(
        q, k, v, bias, mask, gate, tiles=config.forward, save_stats=True, **common
    )
    results = dict(out=out, attention=attention, row_max=row_max, row_log2_sum=row_log2_sum)
    if stats is not None:
        row_max, row_log2_sum, attention = stats
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * attention, axis=-1), 2, 3)
    operands = (q, k, v, bias, mask, do, row_max, row_log2_sum, delta)
    results["dk"], results["dv"] = backward.backward_dkdv(
        *operands, tiles=config.backward_dkdv, **common
    )
    results["dq"] = backward.backward_dq(*operands, tiles=config.backward_dq, **common)
    results["dbias"] = backward.backward_dbias(
        *operands, tiles=config.backward_dbias, dbias_dtype=jnp.float32, **common
    )
    if config.backward_dq_dbias is not None:
        results["dq_fused"], results["dbias_fused"] = backward.backward_dq_dbias(
            *operands, tiles=config.backward_dq_dbias, dbias_dtype=jnp.float32, **common
        )
    return {name: np.asarray(x) for name, x in results.items()}


# Results a dead row gets as a mean, summed in another order when skipped.
MEAN_OF_DEAD_ROWS = {"out": "v", "attention": "v", "dv": "do"}


def assert_skipping_equals_visiting(skipped: dict, visited: dict, keep, label: str):
    """Every result finite; bitwise equal, but for the dead rows of
    `MEAN_OF_DEAD_ROWS` (checked against float64 by `assert_dead_rows`)."""
    dead = dead_rows(keep)
    for name, x in skipped.items():
        helpers.assert_finite(x, f"{label} {name} (skipping)")
        helpers.assert_finite(visited[name], f"{label} {name} (visiting)")
        if name in MEAN_OF_DEAD_ROWS:
            x, y = x[~dead], visited[name][~dead]
        else:
            y = visited[name]
        np.testing.assert_array_equal(x, y, err_msg=f"{label} {name}: skipping != visiting")


def assert_dead_rows(results: dict, q, v, do, gate, keep, label: str):
    """A dead row: its output the mean of v (times the gate), its row max the
    masked logit and log2 row sum log2(N) (uniform weights), dq = dk = 0,
    dv the mean of `do`; within tolerance of float64."""
    dead = dead_rows(keep)
    if not dead.any():
        return
    tol = tolerance(q.dtype)
    v_mean = helpers.to_f64(v)[dead].mean(axis=1, keepdims=True)  # [rows, 1, H, d]
    do_mean = helpers.to_f64(do)[dead].mean(axis=1, keepdims=True)
    n_res = q.shape[2]
    expected_out = v_mean
    if gate is not None:
        expected_out = v_mean / (1.0 + np.exp(-helpers.to_f64(gate)[dead]))
    expected = dict(
        attention=np.broadcast_to(v_mean, results["attention"][dead].shape),
        out=np.broadcast_to(expected_out, results["out"][dead].shape),
        dv=np.broadcast_to(do_mean, results["dv"][dead].shape),
    )
    for name, reference in expected.items():
        err = rel_err(results[name][dead], reference)
        assert err <= tol, f"{label} {name} of dead rows: relative error {err:.2e} > {tol}"
    masked_log2 = np.float32(msa_pallas.kernels.constants.MASKED_LOGIT_LOG2)
    assert np.all(results["row_max"][dead] == masked_log2), label
    np.testing.assert_allclose(results["row_log2_sum"][dead], np.log2(n_res), rtol=1e-6)
    for name in ("dq", "dk") + (("dq_fused",) if "dq_fused" in results else ()):
        assert np.all(results[name][dead] == 0), f"{label} {name} of dead rows is not 0"


def assert_against_float64(results: dict, q, k, v, do, bias, mask, gate, label: str):
    """The forward (with the gate) and the kernels' gradients of the ungated
    output (the cotangent `do`) against the float64 NumPy reference."""
    tol = tolerance(q.dtype)
    out = numpy_reference.forward(q, k, v, bias, mask, gate)
    dq, dk, dv, dbias, _ = numpy_reference.vjp(q, k, v, bias, mask, None, None, do)
    references = dict(out=out, dq=dq, dk=dk, dv=dv, dbias=dbias)
    if "dq_fused" in results:
        references.update(dq_fused=dq, dbias_fused=dbias)
    errors = {name: rel_err(results[name], ref) for name, ref in references.items()}
    print(f"[rel err] {label}: " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    failed = {name: err for name, err in errors.items() if not err <= tol}
    assert not failed, f"{label}: relative errors above {tol}: {failed}"


# --- CPU: the kernels in interpret mode ------------------------------------------------

# id: (dtype, bias dtype, gate, head dim)
KERNEL_CASES = {
    "f32-d8": (jnp.float32, jnp.float32, True, 8),
    "bf16-f32bias-d16": (jnp.bfloat16, jnp.float32, False, 16),
    "bf16-bf16bias-d8": (jnp.bfloat16, jnp.bfloat16, True, 8),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_skip_exactly(case, seed):
    """Forward, dk/dv (two MSA rows a program), dq, dbias and the fused
    dq+dbias kernel on every padded mask: skipping == visiting, the dead rows'
    results, and both against float64. N = 40: three 16-key tiles."""
    dtype, bias_dtype, gate, head_dim = KERNEL_CASES[case]
    shape = (2, 4, 40, 2, head_dim)
    q, k, v, do, bias, gate = random_operands(seed, shape, dtype, bias_dtype, gate)
    rng = np.random.default_rng(seed + 1)
    for kind in MASK_KINDS:
        keep = padded_mask(*shape[:3], kind, rng)
        mask = jnp.asarray(keep.astype(np.int8))
        label = f"{case} {kind}"
        visited = run_kernels(q, k, v, do, bias, mask, gate, FUSED_CONFIG, skip=False,
                              interpret=True)
        stats = tuple(jnp.asarray(visited[n]) for n in ("row_max", "row_log2_sum", "attention"))
        skipped = run_kernels(q, k, v, do, bias, mask, gate, FUSED_CONFIG, skip=True,
                              interpret=True, stats=stats)
        assert_skipping_equals_visiting(skipped, visited, keep, label)
        assert_dead_rows(skipped, q, v, do, gate, keep, label)
        assert_against_float64(skipped, q, k, v, do, bias, mask, gate, label)


def test_forward_two_rows_a_program(seed):
    """The forward and dq with two MSA rows a program: the key loop spans
    both rows' tiles (one dead, one keeping only its last tile)."""
    shape = (1, 4, 40, 2, 16)
    q, k, v, do, bias, gate = random_operands(seed, shape, jnp.float32, jnp.float32, True)
    keep = np.ones(shape[:3], bool)
    keep[0, 0] = False
    keep[0, 1, :32] = False
    keep[0, 3, 20:] = False
    mask = jnp.asarray(keep)
    config = dataclasses.replace(
        SMALL_CONFIG, forward=KernelTiles(**SMALL, msa_rows=2),
        backward_dq=KernelTiles(**SMALL, msa_rows=2),
    )
    visited = run_kernels(q, k, v, do, bias, mask, gate, config, skip=False, interpret=True)
    stats = tuple(jnp.asarray(visited[n]) for n in ("row_max", "row_log2_sum", "attention"))
    skipped = run_kernels(q, k, v, do, bias, mask, gate, config, skip=True, interpret=True,
                          stats=stats)
    assert_skipping_equals_visiting(skipped, visited, keep, "two rows")
    assert_dead_rows(skipped, q, v, do, gate, keep, "two rows")
    assert_against_float64(skipped, q, k, v, do, bias, mask, gate, "two rows")


def test_bias_gradient_over_row_chunks(seed):
    """S = 24 split into 12 chunks of 2 rows (`block_sizes.row_chunks`): each
    chunk clips the rows that keep a key in its key tile to its own; dead
    rows at the start, in the middle and at the end."""
    shape = (1, 24, 40, 1, 16)
    q, k, v, do, bias, _ = random_operands(seed, shape, jnp.bfloat16, jnp.float32, False)
    rng = np.random.default_rng(seed + 1)
    keep = padded_mask(*shape[:3], "varying", rng)
    keep[:, :3] = False
    keep[:, 11] = False
    keep[:, 19:] = False
    keep[:, 5, 32:] = True  # the last key tile: kept in row 5 only
    mask = jnp.asarray(keep)
    assert msa_pallas.block_sizes.row_chunks(3 * 3, 24) == 12
    visited = run_kernels(q, k, v, do, bias, mask, None, FUSED_CONFIG, skip=False,
                          interpret=True)
    stats = tuple(jnp.asarray(visited[n]) for n in ("row_max", "row_log2_sum", "attention"))
    skipped = run_kernels(q, k, v, do, bias, mask, None, FUSED_CONFIG, skip=True,
                          interpret=True, stats=stats)
    assert_skipping_equals_visiting(skipped, visited, keep, "row chunks")
    assert_dead_rows(skipped, q, v, do, None, keep, "row chunks")
    assert_against_float64(skipped, q, k, v, do, bias, mask, None, "row chunks")


# id: (dtype, bias dtype, gate, head dim, block config)
OP_CASES = {
    "f32-gate-d8": (jnp.float32, jnp.float32, True, 8, SMALL_CONFIG),
    "bf16-nogate-fused": (jnp.bfloat16, jnp.float32, False, 32, FUSED_CONFIG),
    "bf16-bf16bias-gate": (jnp.bfloat16, jnp.bfloat16, True, 16, SMALL_CONFIG),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_op_on_padded_masks_against_float64(case, seed):
    """`msa_row_attention(implementation="triton")`, forward and every
    gradient (gate included), on each padded mask against float64: the
    skipping forward's statistics feed the skipping backward."""
    dtype, bias_dtype, gate, head_dim, config = OP_CASES[case]
    shape = (2, 4, 40, 2, head_dim)
    q, k, v, dout, bias, gate = random_operands(seed, shape, dtype, bias_dtype, gate)
    rng = np.random.default_rng(seed + 1)
    run = helpers.fwd_bwd("triton", None, config, skip_padding=True)
    for kind in MASK_KINDS:
        keep = padded_mask(*shape[:3], kind, rng)
        inputs = helpers.Inputs(q, k, v, bias, jnp.asarray(keep), gate, dout)
        result = run(*inputs.args)
        helpers.assert_shapes_dtypes_finite(result, inputs)
        loose = {"dbias": 2e-2} if bias_dtype == jnp.bfloat16 else {}
        helpers.compare(result, helpers.numpy_results(inputs), tolerance(dtype),
                        f"{case} {kind}", **loose)
        _, (dq, dk, dv, _, _) = result
        dead = dead_rows(keep)
        assert np.all(np.asarray(dq)[dead] == 0) and np.all(np.asarray(dk)[dead] == 0)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_compiled_kernels_lower_with_bounds(x64):
    """The compiled path (Python-int tile starts, int32 bounds read at run
    time) traces and lowers to Triton for an H200 with a mask, with and
    without `jax_enable_x64`; the visiting path lowers without the bounds."""
    shape = (1, 4, 96, 2, 32)
    q = jnp.zeros(shape, jnp.bfloat16)
    bias = jnp.zeros((1, 2, 96, 96), jnp.float32)
    mask = jnp.ones(shape[:3], jnp.int8)
    config = dataclasses.replace(
        FUSED_CONFIG, forward=KernelTiles(**SMALL, msa_rows=2),
        backward_dq_dbias=KernelTiles(block_q=16, block_k=128, num_warps=2),
    )

    def kernels(q, bias, mask):
        stats = jnp.zeros((1, 4, 2, 96), jnp.float32)
        return run_kernels_traced(q, bias, mask, stats, config)

    with jax.enable_x64(x64), exporting.gpu_target():
        text = jax.jit(kernels).trace(q, bias, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 5, text.count(exporting.TRITON_CUSTOM_CALL)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_summary_input_only_with_a_mask(masked):
    """Without a mask the kernels take no summary (the unmasked kernels are
    the ones from before); with one, the per-row kernels take the rows' spans
    of kept keys (two `[B, S]` int32 arrays) and the kernels that loop over
    S each batch element's live extents (four `[B]`)."""
    shape = (1, 4, 96, 2, 32)
    q = jnp.zeros(shape, jnp.bfloat16)
    bias = jnp.zeros((1, 2, 96, 96), jnp.float32)
    mask = jnp.ones(shape[:3], jnp.int8) if masked else None
    stats = jnp.zeros((1, 4, 2, 96), jnp.float32)
    config = dataclasses.replace(
        FUSED_CONFIG, backward_dq_dbias=KernelTiles(block_q=16, block_k=128, num_warps=2)
    )
    jaxpr = jax.make_jaxpr(
        lambda q, bias, mask: run_kernels_traced(q, bias, mask, stats, config)
    )(q, bias, mask)
    calls = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    calls += [
        inner for eqn in jaxpr.jaxpr.eqns if "jaxpr" in eqn.params
        for inner in eqn.params["jaxpr"].jaxpr.eqns if inner.primitive.name == "pallas_call"
    ]
    assert len(calls) == 5
    spans, extents = [(1, 4), (1, 4)], [(1,)] * 4
    expected = [spans, spans, spans, extents, extents]  # forward, dk/dv, dq, dbias, dq+dbias
    for call, summary in zip(calls, expected):
        summaries = [v.aval.shape for v in call.invars if v.aval.dtype == jnp.int32]
        assert summaries == (summary if masked else []), summaries


def run_kernels_traced(q, bias, mask, stats, config):
    """Every kernel of `config`, compiled (not interpreted), on traced inputs."""
    common = dict(scale=0.25, interpret=False, skip_padding=True)
    outs = forward.attention_forward(q, q, q, bias, mask, q, tiles=config.forward,
                                     save_stats=True, **common)
    operands = (q, q, q, bias, mask, q, stats, stats, stats)
    outs += backward.backward_dkdv(*operands, tiles=config.backward_dkdv, **common)
    outs += (backward.backward_dq(*operands, tiles=config.backward_dq, **common),)
    outs += (backward.backward_dbias(*operands, tiles=config.backward_dbias, **common),)
    outs += backward.backward_dq_dbias(*operands, tiles=config.backward_dq_dbias, **common)
    return outs


# --- GPU: the compiled kernels at train-like sizes -----------------------------------

GPU_SHAPES = {"256": (1, 16, 256, 8, 32), "333": (1, 16, 333, 8, 32)}
# id: (dtype, bias dtype)
GPU_DTYPES = {
    "bf16-f32bias": (jnp.bfloat16, jnp.float32),
    "bf16-bf16bias": (jnp.bfloat16, jnp.bfloat16),
    "f32": (jnp.float32, jnp.float32),
}


def benchmark_padded_mask(dims) -> np.ndarray:
    """The benchmark's padded mask (`benchmarks/shapes.py`): the last quarter
    of the residues and of the MSA rows padding."""
    shape = shapes.Shape("padded", tuple(dims), mask="padded")
    return np.asarray(shapes.make_mask(shape, jax.random.key(0)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_id", list(GPU_DTYPES))
@pytest.mark.parametrize("shape_id", list(GPU_SHAPES))
def test_gpu_kernels_skip_exactly(shape_id, dtype_id, seed):
    """The compiled kernels with their default tiles on the padded mask:
    skipping == visiting (bitwise but for the dead rows' means), dead rows,
    and both against float64; then the op's forward and gradients."""
    dims, (dtype, bias_dtype) = GPU_SHAPES[shape_id], GPU_DTYPES[dtype_id]
    q, k, v, do, bias, gate = random_operands(seed, dims, dtype, bias_dtype, True)
    keep = benchmark_padded_mask(dims)
    mask = jnp.asarray(keep.astype(np.int8))
    # The fused dq+dbias kernel where the default tiles have it (16-bit inputs).
    config = default_block_config(dims[2], dims[4], dtype, bias_dtype).clipped(dims[2])
    label = f"gpu {shape_id} {dtype_id}"
    visited = run_kernels(q, k, v, do, bias, mask, gate, config, skip=False, interpret=False)
    stats = tuple(jnp.asarray(visited[n]) for n in ("row_max", "row_log2_sum", "attention"))
    skipped = run_kernels(q, k, v, do, bias, mask, gate, config, skip=True, interpret=False,
                          stats=stats)
    assert_skipping_equals_visiting(skipped, visited, keep, label)
    assert_dead_rows(skipped, q, v, do, gate, keep, label)
    assert_against_float64(skipped, q, k, v, do, bias, mask, gate, label)

    inputs = helpers.Inputs(q, k, v, bias, jnp.asarray(keep), gate, do)
    result = helpers.fwd_bwd("triton", skip_padding=True)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    loose = {"dbias": 2e-2} if bias_dtype == jnp.bfloat16 else {}
    helpers.compare(result, helpers.jnp_reference_fwd_bwd(inputs), tolerance(dtype),
                    label + " op", **loose)
