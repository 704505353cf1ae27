"""The op's `mask_queries`: the mask masks query residues too.

`out[b, s, i] = 0` wherever `mask[b, s, i]` is False, and no gradient flows
from there: the float64 reference is the default op's output times the
mask, and its gradients those of the default op with the output gradient
zeroed at masked residues. Skipping padding on the Mosaic kernels, the
kernels give the zeros themselves and skip masked queries (their query
tiles, and every read of a padding row); elsewhere the op zeroes them after
the kernels. Cases: padded residues at the end and in the middle, padding
rows, a batch element that is all padding, masks that change between rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
import numpy_reference
from test_padding import CASES as PADDING_CASES, TOLERANCE

CASES = {
    # test_padding.py's: the last 25% of residues padded in every row, rows
    # (or a batch element) all padding, residues in the middle; and below.
    **PADDING_CASES,
    # Over half the residues padded: whole query tiles of every kernel masked
    # in every row (the forward's and dq's 128 queries among them).
    "half-padded": ((1, 4, 256, 2, 16), jnp.bfloat16, dict(end_padding=0.55, dead=(2,))),
    # Rows of their own spans: rows 2 and 3 keep residues 140-199 alone (their
    # first query tiles all padding, visited by the kernels that serve rows 0 and
    # 1 beside them or loop from query tile 0).
    "spans-of-their-own": ((1, 4, 256, 2, 16), jnp.bfloat16,
                           dict(spans=((0, 250), (0, 250), (140, 200), (140, 200)))),
    # The Mosaic forward's four MSA rows per CTA (64 x 64 tiles, its plan where
    # masked queries are skipped): the second 64-query tile padding in every
    # row, row 1 dead beside live rows, the second group of four rows dead.
    "four-rows-dead-group": ((1, 8, 128, 1, 32), jnp.bfloat16,
                             dict(end_padding=0.5, dead=(1, 4, 5, 6, 7))),
}

# On the GPU alone: the padded training crop's rows and heads, whose masked
# queries skip whole 64-query tiles of four MSA rows per CTA (the forward's
# tiles where masked queries are skipped): a dead row among live ones, and
# the last row group dead.
GPU_CASES = {
    "train-padded": ((1, 16, 256, 8, 32), jnp.bfloat16, dict(dead=(3, 12, 13, 14, 15))),
}


def _inputs(case, seed):
    (batch, rows, n_res, heads, head_dim), dtype, mask = {**CASES, **GPU_CASES}[case]
    inputs = helpers.random_inputs(seed, batch, rows, n_res, heads, head_dim, dtype)
    if "spans" in mask:
        # Each row keeps 90% of its span's residues, at random.
        keep = np.random.default_rng(seed).random((batch, rows, n_res)) >= 0.1
        for row, (start, end) in enumerate(mask["spans"]):
            keep[:, row, :start] = False
            keep[:, row, end:] = False
    else:
        keep = helpers.padded_mask(batch, rows, n_res, seed, **mask)
    return inputs._replace(mask=jnp.asarray(keep))


@functools.lru_cache(maxsize=None)
def _fwd_bwd(implementation, skip_padding: bool):
    """A jitted `(q, k, v, bias, mask, gate, dout) -> (out, (dq, dk, dv,
    dbias, dgate))` of the op with `mask_queries=True`."""

    def run(q, k, v, bias, mask, gate, dout):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation=implementation, mask_queries=True,
            )

        with msa_pallas.skipping_padding(skip_padding):
            out, pullback = jax.vjp(f, q, k, v, bias, gate)
            return out, pullback(dout)

    return jax.jit(run)


def _reference(inputs):
    """(out, (dq, dk, dv, dbias, dgate)) in float64: the default op's output
    times the mask; its gradients with the output gradient so masked."""
    q, k, v, bias, mask, gate, dout = inputs.args
    keep = np.asarray(mask)[..., None, None]
    out = numpy_reference.forward(q, k, v, bias, mask, gate) * keep
    grads = numpy_reference.vjp(q, k, v, bias, mask, gate, None, helpers.to_f64(dout) * keep)
    return out, grads


def _check(result, inputs, label):
    for x in (result[0], *result[1]):
        helpers.assert_finite(x, label)
    helpers.compare(result, _reference(inputs), TOLERANCE[jnp.dtype(inputs.q.dtype)], label,
                    floor=1e-3)
    # Exact zeros where the mask removes a query: the output, and the
    # gradients of that query's q and gate.
    masked = ~np.asarray(inputs.mask)
    out, (dq, _, _, _, dgate) = result
    for name, x in (("out", out), ("dq", dq), ("dgate", dgate)):
        assert not np.any(helpers.to_f64(x)[masked]), f"{label} {name}: nonzero at a masked query"


def _mosaic_in_interpreter(case, skip_padding=True):
    if jax.default_backend() == "cpu" and not skip_padding and case != "end-dead-rows":
        # The kernels without skipping, zeroed after: one case in the interpreter.
        pytest.skip("one Mosaic case visiting padding in the interpreter")


@pytest.mark.parametrize("skip_padding", [True, False], ids=["skipping", "visiting"])
@pytest.mark.parametrize("implementation", ["mosaic", "triton", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_masked_queries_against_float64(case, implementation, skip_padding, seed):
    inputs = _inputs(case, seed)
    if implementation == "mosaic":
        if inputs.q.dtype == jnp.float32:
            pytest.skip("the Mosaic forward takes 16-bit inputs")
        _mosaic_in_interpreter(case, skip_padding)
    if implementation == "xla" and skip_padding:
        pytest.skip("the plain-jnp path skips nothing")
    result = _fwd_bwd(implementation, skip_padding)(*inputs.args)
    _check(result, inputs, f"{case} {implementation} skip={skip_padding}")


def test_four_rows_case_runs_four_rows_per_cta():
    """The case meant for the forward's four MSA rows per CTA plans them, in
    the interpreter as on a Hopper GPU, with the kernels masking the queries."""
    inputs = _inputs("four-rows-dead-group", 0)
    for target in (None, msa_pallas.dispatch.Target("gpu", 90)):
        with msa_pallas.skipping_padding():
            plan = msa_pallas.explain(*inputs.args[:4], inputs.mask, inputs.gate,
                                      implementation="mosaic", mask_queries=True, target=target)
        assert plan.kernels_mask_queries and plan.forward_tiles.msa_rows == 4, plan


def test_the_mosaic_kernels_mask_the_queries_where_padding_is_skipped():
    """Which path zeroes the masked queries: the Mosaic kernels skipping
    padding (forward and backward, no dropout), the op after the kernels
    elsewhere; without a mask, nothing."""
    inputs = _inputs("end-dead-rows", 0)
    target = msa_pallas.dispatch.Target("gpu", 90)
    plan = functools.partial(msa_pallas.explain, *inputs.args[:4], inputs.mask, inputs.gate,
                             implementation="mosaic", mask_queries=True, target=target)
    with msa_pallas.skipping_padding():
        assert plan().kernels_mask_queries
        assert "skipped by every kernel" in str(plan())
        dropping = plan(dropout_rate=0.1, dropout_rng=jax.random.key(0))
        assert dropping.masks_queries and not dropping.kernels_mask_queries
    visiting = plan()
    assert visiting.masks_queries and not visiting.kernels_mask_queries
    assert "set after the kernels" in str(visiting)
    unmasked = msa_pallas.explain(*inputs.args[:4], None, inputs.gate, mask_queries=True,
                                  implementation="mosaic", target=target)
    assert not unmasked.masks_queries


@pytest.mark.parametrize("implementation", ["mosaic", "triton", "xla"])
def test_without_mask_queries_nothing_changes(implementation, seed):
    """`mask_queries=False` is the default op bit for bit, and with the
    queries masked, the kept queries' outputs are the default's."""
    inputs = _inputs("end-dead-rows", seed)
    if implementation == "mosaic":
        _mosaic_in_interpreter("end-dead-rows")
    args = (*inputs.args[:6],)

    def op(**options):
        return jax.jit(functools.partial(
            msa_pallas.msa_row_attention, implementation=implementation, **options
        ))(*args)

    default = np.asarray(op())
    np.testing.assert_array_equal(np.asarray(op(mask_queries=False)), default)
    masked = np.asarray(op(mask_queries=True))
    keep = np.asarray(inputs.mask)
    np.testing.assert_array_equal(masked[keep], default[keep])
    assert not np.any(masked[~keep])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", ["end-dead-rows", "middle-all-padding-d8", "spans-of-their-own", *GPU_CASES]
)
def test_gpu_masked_queries(case, seed):
    """On the GPU: every backend's op with the queries masked, skipping and
    visiting, against float64 (the compiled Mosaic kernels, persistent grid
    included)."""
    inputs = _inputs(case, seed)
    for implementation in ("mosaic", "triton"):
        for skip_padding in (True, False):
            result = _fwd_bwd(implementation, skip_padding)(*inputs.args)
            _check(result, inputs, f"{case} {implementation} skip={skip_padding}")


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_masked_queries_under_x64_equal_the_plain_run(implementation):
    """`jax_enable_x64` (set globally: the Mosaic interpreter reads the global
    flag) changes nothing in the kernels that mask queries, skipping: the
    int32 bounds and summaries stay int32."""
    inputs = _inputs("end-dead-rows", 3)
    plain = jax.tree.map(np.asarray, _fwd_bwd(implementation, True)(*inputs.args))
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        result = jax.tree.map(np.asarray, _fwd_bwd(implementation, True)(*inputs.args))
    finally:
        jax.config.update("jax_enable_x64", before)
    for name, got, want in zip(helpers.RESULT_NAMES, jax.tree.leaves(result),
                               jax.tree.leaves(plain)):
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
