"""Shared test helpers: random inputs, error measures, tolerances, and jitted
forward+backward runners that are reused across tests (interpret-mode
compiles are the expensive part of the CPU suite)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

import msa_pallas
import numpy_reference
from msa_pallas.block_sizes import default_block_config
from msa_pallas.kernels.triton import forward as triton_forward

# Relative error (Frobenius norm) against a float64 reference.
TOLERANCE = {
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 2e-2,
}

# bfloat16 / float16: the kernels' error against float64 may be at most
# XLA_ERROR_RATIO times the plain-jnp path's error on the same inputs, plus
# eps / 16 of the dtype. Measured on CPU: the kernels' error is 1.1 - 1.7x the
# jnp path's (they round ds to the input dtype for the matrix units, where the
# jnp path's autodiff keeps it in float32). On near one-hot rows, a forward
# that stores its residual output in the input dtype, or a delta from an
# unrounded `do`, exceeds the bound 1.8 - 3x (test_attention.py).
XLA_ERROR_RATIO = 2.0

GRAD_NAMES = ("dq", "dk", "dv", "dbias", "dgate")
RESULT_NAMES = ("out",) + GRAD_NAMES


def tolerance(dtype) -> float:
    return TOLERANCE[jnp.dtype(dtype)]


def xla_relative_floor(dtype) -> float:
    """The absolute floor of the kernels-vs-XLA error comparison: eps / 16."""
    return float(jnp.finfo(dtype).eps) / 16


def assert_no_worse_than_xla(pallas_errors: dict, xla_errors: dict, dtype, label: str = "") -> None:
    """Each result's error (against float64) of the kernels is at most
    `XLA_ERROR_RATIO * xla + eps / 16`: the half-precision accuracy the kernels
    measure, much tighter than the absolute `TOLERANCE`."""
    floor = xla_relative_floor(dtype)
    bad = {
        name: (err, xla_errors[name]) for name, err in pallas_errors.items()
        if not err <= XLA_ERROR_RATIO * xla_errors[name] + floor
    }
    assert not bad, (
        f"{label}: kernel errors above {XLA_ERROR_RATIO} x the xla path's + {floor:.1e} "
        f"(name: (pallas, xla)): {bad}"
    )


def to_f64(x) -> np.ndarray:
    """Any array (bfloat16 and float16 included) as a float64 NumPy array."""
    return np.asarray(x).astype(np.float64)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (Frobenius norm over all elements)."""
    a, b = to_f64(a), to_f64(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    denom = np.linalg.norm(b.ravel())
    assert denom > 0, "reference is all zeros: the comparison would prove nothing"
    return float(np.linalg.norm((a - b).ravel()) / denom)


class Inputs(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array
    mask: jax.Array | None
    gate: jax.Array | None
    dout: jax.Array  # cotangent of the output, in q's dtype

    @property
    def args(self):
        return (self.q, self.k, self.v, self.bias, self.mask, self.gate, self.dout)


def random_inputs(
    key,
    B,
    S: int,
    N: int,
    H: int,
    d: int,
    dtype=jnp.float32,
    mask_rate: float | None = 0.2,
    *,
    fully_masked_row=None,
    gate: bool = True,
    bias_dtype=jnp.float32,
    gate_dtype=None,
) -> Inputs:
    """Fresh standard-normal inputs (never zeros).

    Args:
      key: a PRNG key or an int seed.
      B: int (one leading batch dim) or a tuple of leading batch dims (`()`
        for none: q is then `[S, N, H, d]`).
      mask_rate: fraction of keys masked out (bool mask); None for no mask.
      fully_masked_row: None, True (the first MSA row of the first batch
        element), or an index tuple into `[*batch, S]`: every key of that MSA
        row is masked.
      gate: draw gate logits (else None).
      bias_dtype: the bias is drawn float32 normal and cast to this.
      gate_dtype: the gate's dtype; None: q's dtype.
    """
    # Drawn with NumPy and moved to the device once: eager jax.random calls
    # would compile a kernel per shape, seconds per test on a 2-core CI box.
    if not isinstance(key, (int, np.integer)):
        key = int(np.asarray(jax.random.key_data(key)).ravel()[-1])
    rng = np.random.default_rng(int(key))
    batch = (B,) if isinstance(B, int) else tuple(B)
    rows = (*batch, S, N, H, d)

    def normal(shape, dt):
        x = rng.standard_normal(shape, dtype=np.float32)
        return jnp.asarray(x.astype(jnp.dtype(dt)))

    q, k, v = normal(rows, dtype), normal(rows, dtype), normal(rows, dtype)
    bias = normal((*batch, H, N, N), bias_dtype)
    mask = None
    if mask_rate is not None or fully_masked_row is not None:
        rate = 0.0 if mask_rate is None else mask_rate
        keep = rng.random((*batch, S, N)) >= rate
        if fully_masked_row is not None:
            index = (0,) * (len(batch) + 1) if fully_masked_row is True else tuple(fully_masked_row)
            keep[index] = False
        mask = jnp.asarray(keep)
    g = normal(rows, dtype if gate_dtype is None else gate_dtype) if gate else None
    dout = normal(rows, dtype)
    return Inputs(q, k, v, bias, mask, g, dout)


def numpy_results(inputs: Inputs, scale=None):
    """(out, (dq, dk, dv, dbias, dgate)) in float64 from the NumPy reference,
    computed on the inputs upcast to float64."""
    q, k, v, bias, mask, gate, dout = inputs.args
    out = numpy_reference.forward(q, k, v, bias, mask, gate, scale)
    grads = numpy_reference.vjp(q, k, v, bias, mask, gate, scale, dout)
    return out, grads


@functools.lru_cache(maxsize=None)
def fwd_bwd(implementation, scale=None, block_config=None, skip_padding=False):
    """A jitted `(q, k, v, bias, mask, gate, dout) -> (out, (dq, dk, dv, dbias, dgate))`
    for `msa_pallas.msa_row_attention`; mask and gate may be None (dgate is then None).
    `skip_padding`: traced inside `msa_pallas.skipping_padding()`.

    Cached per (implementation, scale, block_config) so that tests sharing a
    shape share the compiled function.
    """

    def run(q, k, v, bias, mask, gate, dout):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate,
                scale=scale, implementation=implementation, block_config=block_config,
            )

        with msa_pallas.skipping_padding(skip_padding):
            out, pullback = jax.vjp(f, q, k, v, bias, gate)
            return out, pullback(dout)

    return jax.jit(run)


def assert_finite(x, name: str = "") -> None:
    x = to_f64(x)
    bad = int(np.sum(~np.isfinite(x)))
    assert bad == 0, f"{name}: {bad} of {x.size} elements are not finite"


def assert_fully_masked_row(result, inputs: Inputs, batch: int, row: int) -> None:
    """MSA row `row` of batch element `batch` has every key masked: each query
    gets the mean of the row's v (uniform weights), times the gate; the replaced
    logits pass no gradient to q and k of that row, while v still gets one."""
    out, (dq, dk, dv, _, _) = result
    v_mean = to_f64(inputs.v[batch, row]).mean(axis=0, keepdims=True)  # [1, H, d]
    expected = v_mean / (1.0 + np.exp(-to_f64(inputs.gate[batch, row])))
    np.testing.assert_allclose(to_f64(out[batch, row]), expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(dq[batch, row]) == 0) and np.all(np.asarray(dk[batch, row]) == 0)
    assert np.all(np.asarray(dv[batch, row]) != 0)


def assert_shapes_dtypes_finite(result, inputs: Inputs) -> None:
    """Output and gradients have the shapes and dtypes of their primals, and
    every element is finite.

    In Pallas interpret mode an output element the kernels never write holds
    NaN, so finiteness (together with the accuracy checks) proves that every
    element of every output was written.
    """
    out, (dq, dk, dv, dbias, dgate) = result
    q, bias, gate = inputs.q, inputs.bias, inputs.gate
    for name, x, like in (
        ("out", out, q), ("dq", dq, q), ("dk", dk, inputs.k), ("dv", dv, inputs.v),
        ("dbias", dbias, bias),
    ):
        chex.assert_shape(x, like.shape, custom_message=name)
        chex.assert_type(x, like.dtype, custom_message=name)
        assert_finite(x, name)
    if gate is None:
        assert dgate is None
    else:
        chex.assert_shape(dgate, gate.shape, custom_message="dgate")
        chex.assert_type(dgate, gate.dtype, custom_message="dgate")
        assert_finite(dgate, "dgate")


def compare(
    result, reference, tol: float, label: str = "", *, floor: float = 0.0, **tol_overrides
) -> dict:
    """Asserts the error <= tol for the output and every gradient; returns the errors.

    The error is `||a - b|| / (||b|| + floor * sqrt(size))`: the relative error
    for `floor=0`; with a floor (results of O(1) inputs), a result that is zero
    in exact arithmetic is compared with its rounding noise instead of being
    divided by zero. `tol_overrides` (e.g. `dbias=2e-2`) sets the tolerance of
    one result, for a result returned in a lower precision than the others.
    """
    out, grads = result
    ref_out, ref_grads = reference
    errors = {}
    for name, a, b in zip(RESULT_NAMES, (out, *grads), (ref_out, *ref_grads)):
        if b is None:
            assert a is None, f"{label} {name}: expected None"
            continue
        if floor == 0.0:
            errors[name] = rel_err(a, b)
            continue
        a64, b64 = to_f64(a), to_f64(b)
        assert a64.shape == b64.shape, (label, name, a64.shape, b64.shape)
        scale = np.linalg.norm(b64.ravel()) + floor * np.sqrt(b64.size)
        errors[name] = float(np.linalg.norm((a64 - b64).ravel()) / scale)
    text = " ".join(f"{n}={e:.2e}" for n, e in errors.items())
    print(f"[rel err] {label}: {text}")
    failed = {
        n: e for n, e in errors.items() if not e <= tol_overrides.get(n, tol)
    }
    assert not failed, f"{label}: relative errors above {tol:g}: {failed} (all: {text})"
    return errors


def dot_precisions(jaxpr, in_kernel: bool = False, found=None) -> list:
    """`(inside a pallas_call?, precision, operand dtype)` of every dot_general
    of a jaxpr and of the jaxprs inside it (jit, custom_vjp, pallas_call, ...)."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((in_kernel, eqn.params["precision"], eqn.invars[0].aval.dtype))
        inner = in_kernel or eqn.primitive.name == "pallas_call"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    dot_precisions(sub, inner, found)
    return found


# --- a float64 jnp reference, for the GPU tests -----------------------------


def _jnp_attention(q, k, v, bias, mask, gate, scale):
    """The op's definition in plain jnp at the inputs' precision, `[B, S, N, H, d]` layout.

    Independent of msa_pallas. Computes in the inputs' dtype throughout (float64
    under `jax.enable_x64`), with HIGHEST matmul precision.
    """
    hi = jax.lax.Precision.HIGHEST
    logits = scale * jnp.einsum("bsihc,bsjhc->bshij", q, k, precision=hi) + bias[:, None]
    if mask is not None:
        logits = jnp.where(mask[:, :, None, None, :], logits, numpy_reference.MASKED_LOGIT)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bshij,bsjhc->bsihc", p, v, precision=hi)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return out


@jax.jit
def _jnp_reference_fwd_bwd(q, k, v, bias, mask, gate, dout, scale):
    f = lambda q, k, v, bias, gate: _jnp_attention(q, k, v, bias, mask, gate, scale)
    out, pullback = jax.vjp(f, q, k, v, bias, gate)
    return out, pullback(dout)


def jnp_reference_fwd_bwd(inputs: Inputs, scale=None, *, chunk_rows=None, keep_rows=None):
    """(out, grads) computed in float64 with plain jnp on the default device.

    Inputs are `[B, S, N, H, d]` (one batch dim). Runs under
    `jax.enable_x64(True)`; returns NumPy float64 arrays.

    Args:
      chunk_rows: compute `chunk_rows` MSA rows at a time (the float64 logits
        of all S rows may not fit in memory); the bias gradient is summed over
        the chunks on the device. None: all rows at once.
      keep_rows: return out, dq, dk, dv, dgate for the first `keep_rows` MSA
        rows only (they depend on no other row); dbias is always summed over
        all S rows. None: all rows.
    """
    q, k, v, bias, mask, gate, dout = inputs.args
    rows = q.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    chunk_rows = rows if chunk_rows is None else chunk_rows
    keep_rows = rows if keep_rows is None else keep_rows
    with jax.enable_x64(True):
        up = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
        bias64 = up(bias)
        dbias, kept = None, []
        for start in range(0, rows, chunk_rows):
            part = lambda x: None if x is None else x[:, start:start + chunk_rows]
            out, (dq, dk, dv, db, dg) = _jnp_reference_fwd_bwd(
                up(part(q)), up(part(k)), up(part(v)), bias64, part(mask), up(part(gate)),
                up(part(dout)), jnp.float64(scale),
            )
            dbias = db if dbias is None else dbias + db
            if start < keep_rows:
                n_keep = min(keep_rows - start, chunk_rows)
                kept.append(tuple(
                    None if x is None else to_f64(x[:, :n_keep]) for x in (out, dq, dk, dv, dg)
                ))
        cat = lambda i: None if kept[0][i] is None else np.concatenate([c[i] for c in kept], axis=1)
        out, dq, dk, dv, dg = (cat(i) for i in range(5))
        return out, (dq, dk, dv, to_f64(dbias), dg)


def expected_kernel_calls(n_res: int, head_dim: int, dtype) -> int:
    """Triton kernels in a forward + backward step with the default tiles:
    forward, dk/dv, and dq + dbias (one fused kernel where the default
    config fuses them, else two)."""
    config = msa_pallas.block_sizes.default_block_config(n_res, head_dim, dtype)
    return 3 if config.fuses_dq_dbias(n_res) else 4


def padded_mask(batch, rows, n_res, seed, *, end_padding=0.25, middle=None, dead=(),
                dead_batch=()):
    """`[B, S, N]` bool: the last `end_padding` of the residues masked in
    every row, keys `middle` = (start, stop) masked in the odd rows, the rows
    `dead` (indices into S) and batch elements `dead_batch` all masked, and
    10% of the other keys masked at random, differently in every row."""
    rng = np.random.default_rng(seed)
    keep = rng.random((batch, rows, n_res)) >= 0.1
    keep[:, :, n_res - int(n_res * end_padding):] = False
    if middle is not None:
        keep[:, 1::2, middle[0]:middle[1]] = False
    for row in dead:
        keep[:, row] = False
    for element in dead_batch:
        keep[element] = False
    return keep


# The Mosaic kernels' other ways of computing the same results, each the opposite of
# its `MosaicTiles` default: masked keys' ds made 0 by a select after the product
# (`mask_without_select` off, the backward kernels), a float32 bias tile read lane by
# lane (`staggered_bias` off, every kernel). By test id.
MOSAIC_OTHER_WAYS = {
    "mask-with-select": {"mask_without_select": False},
    "plain-bias-loads": {"staggered_bias": False},
}


def mosaic_backward_operands(inputs: Inputs):
    """The Mosaic backward kernels' operands `(q, k, v, bias, mask, do, stats)`
    and the scale, from the Triton forward (interpreted) on `inputs`, the
    cotangent `dout` taken as the ungated output's cotangent `do`. The row
    statistics follow the contract the kernels rely on for a row whose keys
    are all masked (row max -1e9·log2(e), log2 row sum log2(N))."""
    q, k, v, bias, mask, _, dout = inputs.args
    mask = None if mask is None else mask.astype(jnp.int8)
    scale = q.shape[-1] ** -0.5
    tiles = default_block_config(q.shape[2], q.shape[-1], q.dtype, bias.dtype).forward
    _, attention, row_max, row_log2_sum = triton_forward.attention_forward(
        q, k, v, bias, mask, None, scale=scale, tiles=tiles, interpret=True, save_stats=True
    )
    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * attention, -1), 2, 3)
    stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)
    return (q, k, v, bias, mask, dout, stats), scale

