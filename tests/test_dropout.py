"""Attention dropout: the random bits (`msa_pallas.dropout`) and the op with
`dropout_rate` on every backend.

The bits are checked statistically: the kept fraction against a binomial
bound, independence across batch elements, rows, heads, queries and keys
(neighbours, and lags of a tile's width, so a pattern that repeats per tile
would show), and the parity of 2 x 2 blocks (the hash XORs a query word with
a key word; its mixing must hide that). The op is checked against the
float64 NumPy reference given the same mask (`dropout.keep_mask` of the
seeds drawn from the key), every backend against the xla path with the same
key, the mean over many keys against the undropped output, and the xla
path's gradients against finite differences in float64.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_pallas
import numpy_reference
from helpers import compare, random_inputs, rel_err, tolerance
from msa_pallas import dropout
from msa_pallas.attention import on_gpu

RATES = (0.1, 0.5)


def binomial_bound(n: int, p: float, sigmas: float = 6.0) -> float:
    """Half-width of a `sigmas`-sigma interval of a kept fraction over n draws."""
    return sigmas * math.sqrt(p * (1.0 - p) / n)


@pytest.fixture(scope="module")
def masks():
    """rate -> bool `[B, S, H, N, N]` (2, 8, 4, 256, 256): 4.2 M weights each."""
    seeds = dropout.row_seeds(jax.random.key(7), 2, 8, 4)
    return {rate: np.asarray(dropout.keep_mask(seeds, 256, rate)) for rate in RATES}


@pytest.mark.parametrize("rate", RATES)
def test_kept_fraction_within_binomial_bound(masks, rate):
    keep = masks[rate]
    kept = keep.mean()
    assert abs(kept - (1.0 - rate)) < binomial_bound(keep.size, rate), kept
    # Per row and head too: no (b, s, h) is far off.
    per_row = keep.mean(axis=(-2, -1))
    assert np.all(np.abs(per_row - (1.0 - rate)) < binomial_bound(256 * 256, rate)), per_row


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("axis,lag", [
    (0, 1), (1, 1), (2, 1), (3, 1), (4, 1),  # neighbours: b, s, h, i, j
    (3, 64), (4, 64), (4, 128), (3, 128), (4, 16), (4, 8),  # lags of tile widths
])
def test_no_correlation(masks, rate, axis, lag):
    keep = np.moveaxis(masks[rate], axis, 0).astype(np.float64)
    a, b = keep[:-lag].ravel(), keep[lag:].ravel()
    corr = np.corrcoef(a, b)[0, 1]
    assert abs(corr) < 6.0 / math.sqrt(a.size), (axis, lag, corr)


# chi-square with 15 degrees of freedom exceeds this with probability 1e-5.
CHI2_15_DOF_1E5 = 48.0


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("di,dj", [(1, 1), (7, 33), (64, 64), (1, 128)])
def test_two_by_two_blocks_as_independent(masks, rate, di, dj):
    """The 16 kept/dropped patterns of the weights (i, j), (i + di, j),
    (i, j + dj), (i + di, j + dj) against independent draws (chi-square):
    the hash XORs a query word with a key word, and where that structure
    leaked (the XOR alone: its top bits over such a block XOR to zero) the
    patterns are far off."""
    keep = masks[rate]
    pattern = (keep[..., :-di, :-dj].astype(np.int64) * 8 + keep[..., di:, :-dj] * 4
               + keep[..., :-di, dj:] * 2 + keep[..., di:, dj:])
    counts = np.bincount(pattern.ravel(), minlength=16)
    kept = 1.0 - rate
    expected = pattern.size * np.array(
        [math.prod(kept if value >> bit & 1 else rate for bit in range(4)) for value in range(16)])
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < CHI2_15_DOF_1E5, (di, dj, chi2)


def test_the_xor_alone_would_fail_the_block_test(masks):
    """The block test can fail: on the words' XOR without the multiply it
    does, by orders of magnitude."""
    seeds = np.asarray(dropout.row_seeds(jax.random.key(7), 1, 4, 2)).astype(np.uint32)
    positions = np.arange(128, dtype=np.uint32)
    query = np.asarray(dropout.query_words(seeds[..., None], positions))[..., :, None]
    key = np.asarray(dropout.key_words(seeds[..., None], positions))[..., None, :]
    keep = (query ^ key) >= dropout.keep_threshold(0.5)
    pattern = (keep[..., :-1, :-1].astype(np.int64) * 8 + keep[..., 1:, :-1] * 4
               + keep[..., :-1, 1:] * 2 + keep[..., 1:, 1:])
    counts = np.bincount(pattern.ravel(), minlength=16)
    # Independent fair draws give each pattern 1/16; the XOR never gives odd parity.
    odd = [value for value in range(16) if bin(value).count("1") % 2]
    assert counts[odd].sum() == 0


def test_bits_are_deterministic_and_key_dependent():
    a = dropout.keep_mask(dropout.row_seeds(jax.random.key(1), 1, 2, 2), 40, 0.3)
    b = dropout.keep_mask(dropout.row_seeds(jax.random.key(1), 1, 2, 2), 40, 0.3)
    c = dropout.keep_mask(dropout.row_seeds(jax.random.key(2), 1, 2, 2), 40, 0.3)
    np.testing.assert_array_equal(a, b)
    assert np.mean(np.asarray(a) != np.asarray(c)) > 0.2
    # A raw uint32 key draws as its typed twin does.
    raw = dropout.row_seeds(jax.random.PRNGKey(1), 1, 2, 2)
    np.testing.assert_array_equal(raw, dropout.row_seeds(jax.random.key(1), 1, 2, 2))


def test_mask_does_not_depend_on_n():
    """Weight (i, j) of a row is the same bit whatever N is (so no tile or
    padding of N can move it)."""
    seeds = dropout.row_seeds(jax.random.key(3), 1, 2, 2)
    small, large = dropout.keep_mask(seeds, 37, 0.2), dropout.keep_mask(seeds, 128, 0.2)
    np.testing.assert_array_equal(small, np.asarray(large)[..., :37, :37])


def test_keep_threshold():
    assert dropout.keep_threshold(0.0) == 0
    assert dropout.keep_threshold(0.5) == 2**31
    assert dropout.keep_threshold(0.999999999999) == 2**32 - 1
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="dropout rate"):
            dropout.keep_threshold(bad)


# --------------------------------------------------------------------------
# The op with dropout, every backend.
# --------------------------------------------------------------------------

# (B, S, N, H, d, dtype, random_inputs kwargs); N no multiple of 8 or of a tile.
OP_CASES = {
    "f32-N37": (1, 2, 37, 2, 16, jnp.float32, {}),
    "d8": (1, 2, 24, 2, 8, jnp.float32, {}),
    "bf16-N40": (1, 2, 40, 2, 32, jnp.bfloat16, {}),
    "no-mask-no-gate": (1, 2, 20, 2, 16, jnp.float32, dict(mask_rate=None, gate=False)),
}


# The op cases the Mosaic GPU interpreter runs on a CPU (all of them on a GPU).
MOSAIC_CPU_CASES = {("bf16-N40", 0.5), ("d8", 0.1)}


def op_fwd_bwd(implementation, rate, key):
    def run(q, k, v, bias, mask, gate, dout):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation=implementation,
                dropout_rate=rate, dropout_rng=key,
            )
        out, pullback = jax.vjp(f, q, k, v, bias, gate)
        return out, pullback(dout)
    return jax.jit(run)


def reference_with_dropout(inputs, rate, key):
    q = inputs.q
    seeds = dropout.row_seeds(key, q.shape[0], q.shape[1], q.shape[3])
    keep = np.asarray(dropout.keep_mask(seeds, q.shape[2], rate))
    args = inputs.args[:6]
    out = numpy_reference.forward(*args, None, dropout=(keep, rate))
    grads = numpy_reference.vjp(*args, None, inputs.dout, dropout=(keep, rate))
    return out, grads


@pytest.mark.parametrize("case", OP_CASES)
@pytest.mark.parametrize("rate", RATES)
def test_op_with_dropout_against_float64(implementation, case, rate, seed):
    if implementation == "mosaic" and not on_gpu() and (case, rate) not in MOSAIC_CPU_CASES:
        pytest.skip("the Mosaic GPU interpreter is slow: tests/kernels/mosaic/test_dropout_* "
                    "cover its kernels; two op cases here")
    b, s, n, h, d, dtype, kwargs = OP_CASES[case]
    inputs = random_inputs(seed, b, s, n, h, d, dtype, **kwargs)
    key = jax.random.key(seed % 1000)
    result = op_fwd_bwd(implementation, rate, key)(*inputs.args)
    reference = reference_with_dropout(inputs, rate, key)
    compare(result, reference, tolerance(dtype), f"{implementation} {case} rate {rate}")
    if implementation != "xla":
        # The same mask as the xla path's: equal to float32 tolerance.
        xla = op_fwd_bwd("xla", rate, key)(*inputs.args)
        for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(xla)):
            assert rel_err(got, want) < 4 * tolerance(dtype)


def test_dropout_changes_with_the_key(implementation, seed):
    if implementation == "mosaic" and not on_gpu():
        pytest.skip("the Mosaic kernels' seeds: tests/kernels/mosaic/test_dropout_* on a CPU")
    inputs = random_inputs(seed, 1, 2, 24, 2, 16)
    first = op_fwd_bwd(implementation, 0.3, jax.random.key(0))(*inputs.args)[0]
    again = op_fwd_bwd(implementation, 0.3, jax.random.key(0))(*inputs.args)[0]
    other = op_fwd_bwd(implementation, 0.3, jax.random.key(1))(*inputs.args)[0]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert rel_err(first, other) > 0.05


def test_mean_over_keys_is_the_undropped_output(seed):
    """Dropout is unbiased: over 512 keys the mean output is the undropped
    one (xla path; the kernels equal it given a key, above)."""
    inputs = random_inputs(seed, 1, 2, 32, 2, 16, mask_rate=0.2)
    q, k, v, bias, mask, gate, _ = inputs.args

    def run(key):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, mask, gate, implementation="xla", dropout_rate=0.2, dropout_rng=key)

    samples = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(seed % 997), 512))
    plain = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation="xla")
    assert rel_err(samples.mean(axis=0), plain) < 0.05
    assert rel_err(samples[0], plain) > 0.1


def test_xla_gradients_against_finite_differences():
    """The xla path with dropout, in float64: its gradients are those of the
    function it computes (the mask is fixed by the key)."""
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        inputs = random_inputs(5, 1, 2, 12, 2, 8, jnp.float64, bias_dtype=jnp.float64)
        q, k, v, bias, mask, gate, _ = inputs.args
        key = jax.random.key(4)

        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation="xla", dropout_rate=0.3,
                dropout_rng=key)

        check_grads(f, (q, k, v, bias, gate), order=1, modes=("rev",), eps=1e-6,
                    atol=1e-6, rtol=1e-6)


def test_plan_with_dropout_skips_padding_but_dead_rows():
    q = jax.ShapeDtypeStruct((1, 2, 64, 2, 16), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 2, 64, 64), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 2, 64), jnp.bool_)
    with msa_pallas.skipping_padding():
        plan = msa_pallas.explain(q, q, q, bias, mask, implementation="triton",
                                  dropout_rate=0.1, dropout_rng=jax.random.key(0))
        skipping = msa_pallas.explain(q, q, q, bias, mask, implementation="triton")
    assert plan.dropout_rate == 0.1 and plan.skips_padding
    assert "attention dropout: rate 0.1" in str(plan)
    assert "rows that keep no key skipped by dq and dbias alone" in str(plan)
    assert skipping.skips_padding and "MSA rows the mask removes are skipped" in str(skipping)
    # Outside the context nothing is skipped.
    plain = msa_pallas.explain(q, q, q, bias, mask, implementation="triton",
                               dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert not plain.skips_padding and "padding" not in str(plain)
