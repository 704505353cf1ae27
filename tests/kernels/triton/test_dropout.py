"""Attention dropout in the Triton kernels (issue 37): the forward and every
backward kernel against a float64 reference whose mask is
`msa_pallas.dropout.keep_mask`.

The reference (`dropout_reference`) is written here in NumPy float64 from the
definition: P = softmax(logits) undropped, keep the mask of global (i, j)
positions, o = (P * keep / (1 - rate)) v; the gradients of the ungated
output for a random cotangent `do`. The backward kernels are driven with the
operands the VJP gives them: `do / (1 - rate)` in q's dtype and
`delta = (1 - rate) * sum_d (do / (1 - rate)) * o`.

In interpret mode an output element no program writes holds NaN: every
result is checked finite. N is never a multiple of the tile; a fully masked
row (uniform weights, dropped too) and masked keys are in every mask. The
`gpu` tests run the compiled kernels at train-like sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import numpy_reference
from helpers import rel_err, tolerance
from msa_pallas import dropout, exporting
from msa_pallas.block_sizes import BlockConfig, KernelTiles, default_block_config, row_chunks
from msa_pallas.kernels.triton import backward, forward

SMALL = dict(block_q=16, block_k=16, num_warps=4, num_stages=2)
# Three 16-wide tiles over N = 40, the last partial; two MSA rows per
# forward, dk/dv and dq program; the fused dq+dbias kernel beside the
# separate ones.
CONFIG = BlockConfig(
    forward=KernelTiles(**SMALL, msa_rows=2),
    backward_dkdv=KernelTiles(**SMALL, msa_rows=2),
    backward_dq=KernelTiles(**SMALL, msa_rows=2),
    backward_dbias=KernelTiles(**SMALL),
    backward_dq_dbias=KernelTiles(block_q=16, block_k=64, num_warps=2),
)


def random_case(seed, shape, dtype, bias_dtype, gate: bool):
    """q, k, v, do, bias, gate (or None), an int8 key mask (20% masked, MSA
    row 1 of batch element 0 all masked) and `[B, S, H]` uint32 seeds."""
    rng = np.random.default_rng(seed)
    batch, rows, n_res, heads, _ = shape
    normal = lambda s, dt: jnp.asarray(rng.standard_normal(s, dtype=np.float32).astype(dt))
    q, k, v, do = (normal(shape, dtype) for _ in range(4))
    bias = normal((batch, heads, n_res, n_res), bias_dtype)
    gate = normal(shape, dtype) if gate else None
    keep = rng.random((batch, rows, n_res)) >= 0.2
    keep[0, 1] = False
    mask = jnp.asarray(keep.astype(np.int8))
    seeds = jnp.asarray(rng.integers(0, 2**32, (batch, rows, heads), dtype=np.uint32))
    return q, k, v, do, bias, gate, mask, seeds


def dropout_reference(q, k, v, bias, mask, gate, do, seeds, rate):
    """A dict of float64 out (gated), attention (the ungated o), and dq, dk,
    dv, dbias: the gradients of o for the cotangent `do`, with the weights
    P * keep / (1 - rate), P the undropped softmax
    (`numpy_reference.probabilities`)."""
    to_heads = lambda x: helpers.to_f64(x).transpose(0, 1, 3, 2, 4)  # [B, S, H, N, d]
    qh, kh, vh, doh = (to_heads(x) for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    p = numpy_reference.probabilities(q, k, bias, mask)
    keep = np.asarray(dropout.keep_mask(seeds, q.shape[2], rate)) / (1.0 - rate)
    transpose = lambda x: np.swapaxes(x, -1, -2)
    # Batched matrix products (BLAS): the gpu cases' N x N tiles are large.
    o = (p * keep) @ vh
    out = o if gate is None else o / (1.0 + np.exp(-to_heads(gate)))
    dv = transpose(p * keep) @ doh
    dp = (doh @ transpose(vh)) * keep
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    ds = np.where(np.asarray(mask)[:, :, None, None, :] != 0, ds, 0.0)
    dq = scale * (ds @ kh)
    dk = scale * (transpose(ds) @ qh)
    back = lambda x: x.transpose(0, 1, 3, 2, 4)
    return dict(
        out=back(out), attention=back(o), dq=back(dq), dk=back(dk), dv=back(dv),
        dbias=ds.sum(axis=1),
    )


def test_reference_is_the_gradient_of_its_forward(seed):
    """`dropout_reference`'s analytic gradients equal JAX's autodiff (float64)
    of its own forward, written independently in jnp here."""
    shape = (1, 2, 12, 2, 8)
    q, k, v, do, bias, _, mask, seeds = random_case(seed, shape, jnp.float32, jnp.float32, False)
    rate, keep_mask = 0.3, dropout.keep_mask(seeds, shape[2], 0.3)
    reference = dropout_reference(q, k, v, bias, mask, None, do, seeds, rate)
    with jax.enable_x64(True):
        def attention(q, k, v, bias):
            logits = jnp.einsum("bsihd,bsjhd->bshij", q, k) * shape[-1] ** -0.5 + bias[:, None]
            logits = jnp.where(mask[:, :, None, None, :] != 0, logits, -1e9)
            weights = jax.nn.softmax(logits, axis=-1) * keep_mask / (1.0 - rate)
            return jnp.einsum("bshij,bsjhd->bsihd", weights, v)

        primals = [jnp.asarray(helpers.to_f64(x)) for x in (q, k, v, bias)]
        out, pullback = jax.vjp(attention, *primals)
        grads = pullback(jnp.asarray(helpers.to_f64(do)))
    assert rel_err(out, reference["attention"]) < 1e-12
    for name, grad in zip(("dq", "dk", "dv", "dbias"), grads):
        assert rel_err(grad, reference[name]) < 1e-12, name


def run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, config, *, interpret=True,
                skip_padding=False):
    """`kernel_results` as NumPy arrays."""
    results = kernel_results(q, k, v, do, bias, mask, gate, seeds, rate, config, interpret,
                             skip_padding)
    return {name: np.asarray(x) for name, x in results.items()}


def kernel_results(q, k, v, do, bias, mask, gate, seeds, rate, config, interpret,
                   skip_padding=False):
    """Every Triton kernel of `config` with dropout `rate`, the backward ones
    on the VJP's operands: a dict (out, attention, row_max, row_log2_sum, dk,
    dv, dq, dbias and, where the config has the fused kernel, dq_fused,
    dbias_fused). `skip_padding`: every kernel's."""
    statics = dict(scale=q.shape[-1] ** -0.5, interpret=interpret, dropout_rate=rate,
                   skip_padding=skip_padding)
    out, attention, row_max, row_log2_sum = forward.attention_forward(
        q, k, v, bias, mask, gate, seeds, tiles=config.forward, save_stats=True, **statics
    )
    results = dict(out=out, attention=attention, row_max=row_max, row_log2_sum=row_log2_sum)
    # What the VJP passes: `do` scaled (and rounded to q's dtype), delta
    # from that rounded `do` and the dropped o.
    do_scaled = (do.astype(jnp.float32) / (1.0 - rate)).astype(q.dtype)
    delta = (1.0 - rate) * jnp.sum(do_scaled.astype(jnp.float32) * attention, axis=-1)
    operands = (q, k, v, bias, mask, do_scaled, row_max, row_log2_sum,
                jnp.swapaxes(delta, 2, 3), seeds)
    results["dk"], results["dv"] = backward.backward_dkdv(
        *operands, tiles=config.backward_dkdv, **statics
    )
    results["dq"] = backward.backward_dq(*operands, tiles=config.backward_dq, **statics)
    results["dbias"] = backward.backward_dbias(
        *operands, tiles=config.backward_dbias, dbias_dtype=jnp.float32, **statics
    )
    if config.backward_dq_dbias is not None:
        results["dq_fused"], results["dbias_fused"] = backward.backward_dq_dbias(
            *operands, tiles=config.backward_dq_dbias, dbias_dtype=jnp.float32, **statics
        )
    return results


def assert_against_reference(results, reference, dtype, label):
    """Every result finite (an unwritten element is NaN in interpret mode),
    and within the dtype's tolerance of float64."""
    for name, x in results.items():
        helpers.assert_finite(x, f"{label} {name}")
    pairs = {name: name for name in reference} | {"dq_fused": "dq", "dbias_fused": "dbias"}
    errors = {
        name: rel_err(results[name], reference[ref]) for name, ref in pairs.items()
        if name in results
    }
    print(f"[rel err] {label}: " + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    tol = tolerance(dtype)
    failed = {name: err for name, err in errors.items() if not err <= tol}
    assert not failed, f"{label}: relative errors above {tol}: {failed}"


# --- CPU: the kernels in interpret mode --------------------------------------------

# id: (dtype, bias dtype, gate, head dim, rate)
CASES = {
    "f32-gate-r0.1": (jnp.float32, jnp.float32, True, 8, 0.1),
    "bf16-f32bias-r0.5": (jnp.bfloat16, jnp.float32, False, 16, 0.5),
    "bf16-bf16bias-gate-r0.5": (jnp.bfloat16, jnp.bfloat16, True, 8, 0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_against_float64(case, seed):
    """Forward, dk/dv, dq, dbias and the fused dq+dbias kernel with dropout
    against float64: N = 40 over 16-wide tiles, two MSA rows a program,
    masked keys and a fully masked row, 1 - rate kept."""
    dtype, bias_dtype, gate, head_dim, rate = CASES[case]
    shape = (2, 4, 40, 2, head_dim)
    q, k, v, do, bias, gate, mask, seeds = random_case(seed, shape, dtype, bias_dtype, gate)
    results = run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, CONFIG)
    reference = dropout_reference(q, k, v, bias, mask, gate, do, seeds, rate)
    assert_against_reference(results, reference, dtype, case)
    # The row statistics are those of the undropped weights.
    undropped = forward.attention_forward(
        q, k, v, bias, mask, gate, tiles=CONFIG.forward, save_stats=True, scale=head_dim**-0.5,
        interpret=True,
    )
    for position, name in ((2, "row_max"), (3, "row_log2_sum")):
        np.testing.assert_array_equal(results[name], np.asarray(undropped[position]), name)


@pytest.mark.parametrize("case", ["f32-gate-r0.1", "bf16-bf16bias-gate-r0.5"])
def test_skipping_padding_with_dropout_is_exact(case, seed):
    """`skip_padding=True` with dropout on padded masks: the masked key tiles
    of live rows are skipped, the dead rows (their uniform weights dropped
    too) visited whole by the forward and dk/dv and skipped by dq and the
    bias gradient (0 there), so every result equals the visiting kernels'
    bit for bit, dead rows included, and float64. Masks: the last quarter of
    the residues (a whole 16-key tile) and 20 keys in the middle of the odd
    rows padded, row 3 dead, batch element 1 all padding."""
    dtype, bias_dtype, gate, head_dim, rate = CASES[case]
    shape = (2, 4, 40, 2, head_dim)
    q, k, v, do, bias, gate, _, seeds = random_case(seed, shape, dtype, bias_dtype, gate)
    keep = helpers.padded_mask(*shape[:3], seed, middle=(14, 34), dead=(3,), dead_batch=(1,))
    mask = jnp.asarray(keep.astype(np.int8))
    visited = run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, CONFIG)
    skipped = run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, CONFIG, skip_padding=True)
    for name, x in skipped.items():
        np.testing.assert_array_equal(x, visited[name], err_msg=f"{case} {name}")
    assert_against_reference(
        skipped, dropout_reference(q, k, v, bias, mask, gate, do, seeds, rate), dtype, case
    )
    # A dead row's output is its dropped uniform weights' (not the mean of v).
    dead = ~keep.any(-1)
    v_mean = helpers.to_f64(v)[dead].mean(axis=1, keepdims=True)
    assert rel_err(skipped["attention"][dead], np.broadcast_to(
        v_mean, skipped["attention"][dead].shape)) > 0.05


def test_bias_gradient_loops_over_rows_with_their_seeds(seed):
    """S = 24 with one head: the bias-gradient kernels split S into 12
    chunks of 2 rows (`block_sizes.row_chunks`), so each program loops over
    two MSA rows, each with its own seed, in its row loop."""
    shape = (1, 24, 40, 1, 16)
    q, k, v, do, bias, _, mask, seeds = random_case(seed, shape, jnp.float32, jnp.float32, False)
    rate = 0.25
    config = dataclasses.replace(CONFIG, forward=KernelTiles(**SMALL, msa_rows=4))
    assert shape[1] // _row_chunks(config.backward_dbias, shape) == 2
    results = run_kernels(q, k, v, do, bias, mask, None, seeds, rate, config)
    reference = dropout_reference(q, k, v, bias, mask, None, do, seeds, rate)
    assert_against_reference(results, reference, jnp.float32, "row chunks")


def _row_chunks(tiles, shape):
    """The chunks a bias-gradient kernel splits the S rows of `shape` into."""
    batch, rows, n_res, heads, _ = shape
    tiles_each_way = -(-n_res // tiles.block_q), -(-n_res // tiles.block_k)
    return row_chunks(tiles_each_way[0] * tiles_each_way[1] * heads * batch, rows)


def test_mask_does_not_depend_on_tiles(seed):
    """The forward with 16 x 16 tiles and one row a program, and with
    32 x 64 tiles and two rows a program: the same output to float32
    rounding (the mask is of global positions, never tile-relative)."""
    shape = (1, 2, 40, 2, 8)
    q, k, v, _, bias, gate, mask, seeds = random_case(seed, shape, jnp.float32, jnp.float32, True)
    outs = [
        forward.attention_forward(
            q, k, v, bias, mask, gate, seeds, tiles=tiles, save_stats=False, scale=0.35,
            interpret=True, dropout_rate=0.3,
        )
        for tiles in (KernelTiles(**SMALL), KernelTiles(32, 64, msa_rows=2))
    ]
    assert rel_err(outs[0], outs[1]) < 1e-6


def test_seeds_change_the_output(seed):
    """Two different seeds give different outputs in every (b, s, h); the
    same seeds give the same output bit for bit."""
    shape = (1, 2, 40, 2, 8)
    q, k, v, _, bias, gate, mask, seeds = random_case(seed, shape, jnp.float32, jnp.float32, True)
    run = lambda seeds: np.asarray(forward.attention_forward(
        q, k, v, bias, mask, gate, seeds, tiles=CONFIG.forward, save_stats=False, scale=0.35,
        interpret=True, dropout_rate=0.1,
    ))
    first, again, other = run(seeds), run(seeds), run(seeds ^ np.uint32(1))
    np.testing.assert_array_equal(first, again)
    differs = np.abs(first - other).max(axis=(2, 4)) > 1e-3  # [B, S, H]
    assert differs.all(), differs


def _kernel_calls(jaxpr):
    """The pallas_call equations of a jaxpr, inside its jit equations too."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append(eqn)
        if "jaxpr" in eqn.params:
            calls += _kernel_calls(eqn.params["jaxpr"].jaxpr)
    return calls


@pytest.mark.parametrize("interpret", [True, False], ids=["interpret", "compiled"])
def test_rate_zero_is_the_kernel_without_dropout(interpret):
    """`dropout_rate=0` with seeds given: every kernel call is the one
    without dropout arguments (same pallas_call equations, no uint32
    operand); with a rate, each takes the `[B, S, H, 1]` seeds."""
    shape = (1, 4, 40, 2, 16)
    q = jnp.ones(shape, jnp.bfloat16)
    bias = jnp.ones((1, 2, 40, 40), jnp.float32)
    mask = jnp.ones(shape[:3], jnp.int8)
    stats = jnp.ones((1, 4, 2, 40), jnp.float32)
    seeds = jnp.ones((1, 4, 2), jnp.uint32)

    def kernels(*dropout_args, **rate):
        statics = dict(scale=0.25, interpret=interpret, **rate)
        outs = forward.attention_forward(q, q, q, bias, mask, q, *dropout_args,
                                         tiles=CONFIG.forward, save_stats=True, **statics)
        operands = (q, q, q, bias, mask, q, stats, stats, stats, *dropout_args)
        outs += backward.backward_dkdv(*operands, tiles=CONFIG.backward_dkdv, **statics)
        outs += (backward.backward_dq(*operands, tiles=CONFIG.backward_dq, **statics),)
        outs += (backward.backward_dbias(*operands, tiles=CONFIG.backward_dbias, **statics),)
        outs += backward.backward_dq_dbias(*operands, tiles=CONFIG.backward_dq_dbias,
                                           **statics)
        return outs

    plain = _kernel_calls(jax.make_jaxpr(kernels)().jaxpr)
    rate_zero = _kernel_calls(
        jax.make_jaxpr(lambda seeds: kernels(seeds, dropout_rate=0.0))(seeds).jaxpr
    )
    assert len(plain) == len(rate_zero) == 5
    for before, after in zip(plain, rate_zero):
        assert str(before) == str(after)
        assert all(v.aval.dtype != jnp.uint32 for v in after.invars)
    dropping = jax.make_jaxpr(lambda seeds: kernels(seeds, dropout_rate=0.1))(seeds)
    for call in _kernel_calls(dropping.jaxpr):
        seeds_in = [v.aval for v in call.invars if v.aval.dtype == jnp.uint32]
        assert [a.shape for a in seeds_in] == [(1, 4, 2, 1)], seeds_in


def test_bad_dropout_arguments():
    """Dropout without seeds, with seeds of the wrong shape or dtype, or at a
    rate outside [0, 1): a ValueError at trace time."""
    shape = (1, 2, 24, 2, 8)
    q = jnp.ones(shape, jnp.float32)
    bias = jnp.ones((1, 2, 24, 24), jnp.float32)
    mask = jnp.ones(shape[:3], jnp.int8)
    stats = jnp.ones((1, 2, 2, 24), jnp.float32)
    seeds = jnp.ones((1, 2, 2), jnp.uint32)
    statics = dict(scale=0.35, interpret=True, tiles=KernelTiles(**SMALL))

    def forward_call(seeds, **kw):
        return forward.attention_forward(q, q, q, bias, mask, None, seeds, save_stats=True,
                                         **statics, **kw)

    def backward_call(seeds, **kw):
        return backward.backward_dq(q, q, q, bias, mask, q, stats, stats, stats, seeds,
                                    **statics, **kw)

    for call in (forward_call, backward_call):
        with pytest.raises(ValueError, match="needs dropout_seeds"):
            call(None, dropout_rate=0.1)
        with pytest.raises(ValueError, match=r"expected \(1, 2, 2\)"):
            call(jnp.ones((1, 2, 3), jnp.uint32), dropout_rate=0.1)
        with pytest.raises(ValueError, match="uint32"):
            call(jnp.ones((1, 2, 2), jnp.int32), dropout_rate=0.1)
        with pytest.raises(ValueError, match="dropout rate"):
            call(seeds, dropout_rate=1.0)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_compiled_kernels_lower_with_dropout(x64):
    """The compiled kernels with dropout (uint32 hashing, the seeds read as
    scalars) trace and lower to Triton for an H200, with and without
    `jax_enable_x64`."""
    shape = (1, 4, 96, 2, 32)
    q = jnp.zeros(shape, jnp.bfloat16)
    bias = jnp.zeros((1, 2, 96, 96), jnp.float32)
    mask = jnp.ones(shape[:3], jnp.int8)
    seeds = jnp.zeros((1, 4, 2), jnp.uint32)
    config = dataclasses.replace(
        CONFIG, backward_dq_dbias=KernelTiles(block_q=16, block_k=128, num_warps=2)
    )

    def kernels(q, bias, mask, seeds):
        stats = jnp.zeros((1, 4, 2, 96), jnp.float32)
        statics = dict(scale=0.25, interpret=False, dropout_rate=0.1)
        outs = forward.attention_forward(q, q, q, bias, mask, q, seeds, tiles=config.forward,
                                         save_stats=True, **statics)
        operands = (q, q, q, bias, mask, q, stats, stats, stats, seeds)
        outs += backward.backward_dkdv(*operands, tiles=config.backward_dkdv, **statics)
        outs += (backward.backward_dq(*operands, tiles=config.backward_dq, **statics),)
        outs += (backward.backward_dbias(*operands, tiles=config.backward_dbias, **statics),)
        outs += backward.backward_dq_dbias(*operands, tiles=config.backward_dq_dbias,
                                           **statics)
        return outs

    with jax.enable_x64(x64), exporting.gpu_target():
        text = jax.jit(kernels).trace(q, bias, mask, seeds).lower(
            lowering_platforms=("cuda",)
        ).as_text()
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 5, text.count(exporting.TRITON_CUSTOM_CALL)


# --- GPU: the compiled kernels at train-like sizes ---------------------------------

GPU_SHAPES = {"256": (1, 16, 256, 8, 32), "333": (1, 16, 333, 8, 32)}
# id: (dtype, bias dtype)
GPU_DTYPES = {
    "bf16-f32bias": (jnp.bfloat16, jnp.float32),
    "bf16-bf16bias": (jnp.bfloat16, jnp.bfloat16),
    "f32": (jnp.float32, jnp.float32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rate", [0.1, 0.5])
@pytest.mark.parametrize("dtype_id", list(GPU_DTYPES))
@pytest.mark.parametrize("shape_id", list(GPU_SHAPES))
def test_gpu_kernels_against_float64(shape_id, dtype_id, rate, seed):
    """The compiled kernels with their default tiles (the fused dq+dbias
    kernel where those have it) and dropout against float64, and a second
    run equal bit for bit."""
    dims, (dtype, bias_dtype) = GPU_SHAPES[shape_id], GPU_DTYPES[dtype_id]
    q, k, v, do, bias, gate, mask, seeds = random_case(seed, dims, dtype, bias_dtype, True)
    config = default_block_config(dims[2], dims[4], dtype, bias_dtype).clipped(dims[2])
    label = f"gpu {shape_id} {dtype_id} rate {rate}"
    results = run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, config, interpret=False)
    reference = dropout_reference(q, k, v, bias, mask, gate, do, seeds, rate)
    assert_against_reference(results, reference, dtype, label)
    again = run_kernels(q, k, v, do, bias, mask, gate, seeds, rate, config, interpret=False)
    for name, x in results.items():
        np.testing.assert_array_equal(x, again[name], err_msg=f"{label} {name}: not repeatable")
