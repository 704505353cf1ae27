"""msa_pallas.dot_product_attention (tokamax's / AlphaFold3's layouts) against a
float64 NumPy reference: the fused mapping of shared biases and key masks, and
the plain path with its warning for everything else."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_pallas
from helpers import rel_err


def reference(q, k, v, bias, mask, gate=None, scale=None):
    """softmax(scale q.k + bias, masked keys -> -1e9) v [* sigmoid(gate)] in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("...qhd,...khd->...hqk", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -1e9)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("...hqk,...khd->...qhd", w, v)
    if gate is not None:
        out = out / (1 + np.exp(-np.asarray(gate, np.float64)))
    return out


def draw(rng, *shapes):
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


@pytest.mark.parametrize("implementation", ["xla", "pallas", "triton"])
def test_alphafold3_call(seed, implementation):
    """q [rows, N, H, D], bias [1, H, N, N], mask [rows, 1, 1, N]: AF3's triangle attention."""
    rng = np.random.default_rng(seed)
    rows, n, heads, d = 3, 10, 2, 16
    q, k, v = draw(rng, *[(rows, n, heads, d)] * 3)
    (bias,) = draw(rng, (1, heads, n, n))
    mask = rng.uniform(size=(rows, 1, 1, n)) > 0.3
    mask[..., 0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fused path: no fallback warning
        out = msa_pallas.dot_product_attention(q, k, v, bias=bias, mask=jnp.asarray(mask),
                                               implementation=implementation)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, reference(q, k, v, bias, mask)) < 1e-5


def test_gradients_match_xla_and_bias_gradient_is_summed(seed):
    rng = np.random.default_rng(seed)
    rows, n, heads, d = 2, 8, 2, 8
    q, k, v, gate = draw(rng, *[(rows, n, heads, d)] * 4)
    (bias,) = draw(rng, (1, heads, n, n))
    mask = jnp.asarray(rng.uniform(size=(rows, 1, 1, n)) > 0.2).at[..., 0].set(True)

    def loss(implementation, *args):
        out = msa_pallas.dot_product_attention(*args[:3], bias=args[3], mask=mask, gate=args[4],
                                               implementation=implementation)
        return jnp.sum(jnp.sin(out))

    args = (q, k, v, bias, gate)
    grads = {impl: jax.jit(jax.grad(lambda *a, impl=impl: loss(impl, *a), argnums=range(5)))(*args)
             for impl in ("xla", "pallas")}
    assert grads["xla"][3].shape == bias.shape
    for a, b in zip(grads["pallas"], grads["xla"]):
        assert rel_err(a, b) < 1e-5
    out = msa_pallas.dot_product_attention(q, k, v, bias=bias, mask=mask, gate=gate,
                                           implementation="xla")
    assert rel_err(out, reference(q, k, v, bias, mask, gate)) < 1e-5


@pytest.mark.parametrize("bias_shape,mask_shape", [
    ((2, 1, 2, 6, 6), (2, 3, 1, 1, 6)),   # bias shared by the 3 rows of each batch element
    ((2, 3, 2, 6, 6), (1, 6)),            # a bias per element: rows of one (S = 1)
    ((6,), None),                         # a key bias, broadcast over everything
    (None, (3, 1, 1, 6)),                 # no bias, a key mask per row
], ids=["shared-rows", "per-element", "key-bias", "no-bias"])
def test_batch_axes_map_onto_rows(seed, bias_shape, mask_shape):
    rng = np.random.default_rng(seed)
    shape = (2, 3, 6, 2, 8)
    q, k, v = draw(rng, shape, shape, shape)
    bias = None if bias_shape is None else draw(rng, bias_shape)[0]
    mask = None
    if mask_shape is not None:
        mask = rng.uniform(size=mask_shape) > 0.3
        mask[..., 0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = msa_pallas.dot_product_attention(q, k, v, bias, mask, implementation="xla")
    assert rel_err(out, reference(q, k, v, bias, mask)) < 1e-5


def test_key_value_seq_lengths_is_a_key_mask(seed):
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, *[(3, 7, 2, 8)] * 3)
    lengths = jnp.asarray([7, 4, 1])
    mask = (np.arange(7)[None] < np.asarray(lengths)[:, None])[:, None, None, :]
    out = msa_pallas.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                           implementation="xla")
    assert rel_err(out, reference(q, k, v, None, mask)) < 1e-5


@pytest.mark.parametrize("case", ["query-mask", "causal", "cross"])
def test_other_forms_take_the_plain_path_with_a_warning(seed, case):
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, *[(2, 6, 2, 8)] * 3)
    (bias,) = draw(rng, (1, 2, 6, 6))
    kwargs, mask = {}, None
    if case == "query-mask":
        mask = rng.uniform(size=(2, 1, 6, 6)) > 0.3
        mask[..., 0] = True
        kwargs["mask"] = jnp.asarray(mask)
    elif case == "causal":
        kwargs["is_causal"] = True
        mask = np.tril(np.ones((6, 6), bool))
    else:
        k, v = draw(rng, (2, 9, 2, 8), (2, 9, 2, 8))
        (bias,) = draw(rng, (1, 2, 6, 9))
    with pytest.warns(UserWarning, match="plain"):
        out = msa_pallas.dot_product_attention(q, k, v, bias=bias, **kwargs)
    assert rel_err(out, reference(q, k, v, bias, mask)) < 1e-5


def test_errors():
    q = jnp.ones((2, 6, 2, 8))
    with pytest.raises(ValueError, match="implementation"):
        msa_pallas.dot_product_attention(q, q, q, implementation="cudnn")
    with pytest.raises(ValueError, match="key"):
        msa_pallas.dot_product_attention(q, jnp.ones((2, 6, 3, 8)), q)
    with pytest.raises(ValueError, match="broadcast"):
        msa_pallas.dot_product_attention(q, q, q, bias=jnp.ones((3, 2, 6, 6)))
    with pytest.raises(ValueError, match="gate"):
        msa_pallas.dot_product_attention(q, q, q, gate=jnp.ones((2, 6, 2, 4)))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [333, 384])
def test_gpu_alphafold3_call_bf16(seed, n):
    """AF3's call at triangle-attention sizes (H = 4, D = 32, bf16), forward and gradients."""
    rng = np.random.default_rng(seed)
    q, k, v = (x.astype(jnp.bfloat16) for x in draw(rng, *[(n, n, 4, 32)] * 3))
    (bias,) = draw(rng, (1, 4, n, n))
    mask = jnp.asarray(rng.uniform(size=(n, 1, 1, n)) > 0.1).at[..., 0].set(True)
    out = jax.jit(lambda *a: msa_pallas.dot_product_attention(*a, mask=mask))(q, k, v, bias)
    assert rel_err(out, reference(q, k, v, bias, mask)) < 2e-2
    grad = jax.jit(jax.grad(lambda b: jnp.sum(msa_pallas.dot_product_attention(
        q, k, v, b, mask).astype(jnp.float32) ** 2)))(bias)
    assert grad.shape == bias.shape and bool(jnp.all(jnp.isfinite(grad)))
