"""The programs `python -m benchmarks multi-gpu` times: the op's and the layer's forward + backward,
their random inputs, and the partition specs of their arguments along each mesh axis.

`make_problem(variant, dims, dtype, implementation, seed)` returns
`(f_and_b, args, specs, bias_gradient_name, vanishing_gradients)`: `f_and_b(*args)` gives
the output and a dict of gradients, `specs(axis)` the PartitionSpecs of `args` when the
mesh axis `axis` ("rows", "heads" or "batch") shards them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import msa_pallas
from msa_pallas.sharding import msa_partition_specs

VARIANTS = ("op-f32-bias", "op-bias-in-dtype", "layer")
AXIS_KWARG = {"rows": "row_axis", "heads": "head_axis", "batch": "batch_axis"}
PAIR_DIM = 128
KEEP_FRACTION = 0.9
# Gradients of the layer that are zero in exact arithmetic: a key bias or a pair-bias
# bias adds one constant to a whole softmax row, which the softmax ignores. What they
# hold is rounding noise, so their relative differences say nothing: they are kept in
# results.json ("grads_max_rel_by_name") and left out of "grads_max_rel".
VANISHING_LAYER_GRADIENTS = ("['dparams']['key']['bias']", "['dparams']['pair_bias']['bias']")


def op_problem(dims, dtype, bias_dtype, implementation, key):
    """(f+b function, its arguments, argument specs by axis, name of the bias gradient)."""
    B, S, N, H, d = dims
    rows = (B, S, N, H, d)

    @jax.jit
    def make_args(key):
        kq, kk, kv, kb, km, ko = jax.random.split(key, 6)
        return (
            jax.random.normal(kq, rows, dtype),
            jax.random.normal(kk, rows, dtype),
            jax.random.normal(kv, rows, dtype),
            jax.random.normal(kb, (B, H, N, N), jnp.float32).astype(bias_dtype),
            jax.random.bernoulli(km, KEEP_FRACTION, (B, S, N)),
            jax.random.normal(ko, rows, dtype),
        )

    args = make_args(key)

    def f_and_b(q, k, v, bias, mask, dout):
        def f(q, k, v, bias):
            return msa_pallas.msa_row_attention(q, k, v, bias, mask, implementation=implementation)

        out, pullback = jax.vjp(f, q, k, v, bias)
        return out, dict(zip(("dq", "dk", "dv", "dbias"), pullback(dout)))

    def specs(axis):
        s = msa_partition_specs(**{AXIS_KWARG[axis]: axis})
        return (s.rows, s.rows, s.rows, s.bias, s.mask, s.rows)

    return f_and_b, args, specs, "dbias", ()


def layer_problem(dims, dtype, implementation, key):
    B, S, N, H, d = dims
    layer = msa_pallas.MSARowAttentionWithPairBias(
        msa_dim=H * d, pair_dim=PAIR_DIM, num_heads=H, dtype=dtype, implementation=implementation,
    )

    @jax.jit
    def make_args(key):
        km, kz, kmask, kc, ki = jax.random.split(key, 5)
        m = jax.random.normal(km, (B, S, N, H * d), dtype)
        z = jax.random.normal(kz, (B, N, N, PAIR_DIM), dtype)
        mask = jax.random.bernoulli(kmask, KEEP_FRACTION, (B, S, N))
        cot = jax.random.normal(kc, (B, S, N, H * d), dtype)
        params = layer.init(ki, m[:, :1], z, mask[:, :1])["params"]
        return params, m, z, mask, cot

    params, m, z, mask, cot = make_args(key)

    def f_and_b(params, m, z, mask, cot):
        def f(params, m, z):
            return layer.apply({"params": params}, m, z, mask)

        out, pullback = jax.vjp(f, params, m, z)
        dparams, dm, dz = pullback(cot.astype(out.dtype))
        return out, {"dparams": dparams, "dmsa": dm, "dpair": dz}

    def param_spec(path, leaf, axis):
        """Head parallelism: the projections into heads split by output feature,
        the output projection by input feature; anything else replicated."""
        if axis != "heads":
            return P()
        names = [getattr(p, "key", str(p)) for p in path]
        if names[0] in ("query", "key", "value", "gate", "pair_bias"):
            return P(None, axis) if names[-1] == "kernel" else P(axis)
        if names[0] == "out_proj" and names[-1] == "kernel":
            return P(axis, None)
        return P()

    def specs(axis):
        params_specs = jax.tree_util.tree_map_with_path(
            lambda path, leaf: param_spec(path, leaf, axis), params
        )
        batch = axis if axis == "batch" else None
        rows = axis if axis == "rows" else None
        return (
            params_specs, P(batch, rows, None, None), P(batch, None, None, None),
            P(batch, rows, None), P(batch, rows, None, None),
        )

    return f_and_b, (params, m, z, mask, cot), specs, "dpair", VANISHING_LAYER_GRADIENTS


def make_problem(variant, dims, dtype, implementation, seed):
    # RBG keys: XLA compiles their random bits far faster than threefry's on CPU.
    key = jax.random.key(seed, impl="rbg")
    if variant == "op-f32-bias":
        return op_problem(dims, dtype, jnp.float32, implementation, key)
    if variant == "op-bias-in-dtype":
        return op_problem(dims, dtype, dtype, implementation, key)
    if variant == "layer":
        return layer_problem(dims, dtype, implementation, key)
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
