"""The XLA passes around the kernels, written several ways, timed alone on the GPU.

    PYTHONPATH=. python benchmarks/log/2026-12-04-11-padding/xla_passes.py extra train

For each shape: the backward's elementwise pass (do, the gate's gradient, delta and the
stacked statistics) and the row means of v (or do) over residues, each variant the median
of 7 samples of 20 calls, and one traced call's kernels.
"""

import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.profiling.timeline import gpu_kernels, read_trace
from benchmarks.shapes import SHAPES
from benchmarks.timing import median_ms, warm_up_device


def round_to_bf16(x):
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def gate_terms(dout, att, gate):
    """(float32 do before rounding, the gate's gradient) as the op's backward makes them."""
    s = jax.nn.sigmoid(gate.astype(jnp.float32))
    dout32 = dout.astype(jnp.float32)
    return dout32 * s, (dout32 * att * s * (1.0 - s)).astype(gate.dtype)


def stacked(row_max, row_log2_sum, delta):
    return jnp.stack([row_max, row_log2_sum, delta], axis=3)


def delta_now(dout, att, gate, row_max, row_log2_sum):
    do32, dgate = gate_terms(dout, att, gate)
    do32 = round_to_bf16(do32)
    delta = jnp.sum(do32 * att, axis=-1)
    delta, dgate = lax.optimization_barrier((delta, dgate))
    return do32.astype(jnp.bfloat16), dgate, stacked(row_max, row_log2_sum,
                                                     jnp.swapaxes(delta, 2, 3))


def delta_split(dout, att, gate, row_max, row_log2_sum):
    do32, dgate = gate_terms(dout, att, gate)
    do, dgate = lax.optimization_barrier((do32.astype(jnp.bfloat16), dgate))
    delta = lax.optimization_barrier(jnp.sum(do.astype(jnp.float32) * att, axis=-1))
    return do, dgate, stacked(row_max, row_log2_sum, jnp.swapaxes(delta, 2, 3))


def delta_dot(dout, att, gate, row_max, row_log2_sum):
    do32, dgate = gate_terms(dout, att, gate)
    do32 = round_to_bf16(do32)
    *lead, heads, d = att.shape
    ones = jnp.repeat(jnp.eye(heads, dtype=jnp.float32), d, axis=0)  # [H * d, H]
    delta = jnp.dot((do32 * att).reshape(*lead, heads * d), ones,
                    precision=lax.Precision.HIGHEST)
    return do32.astype(jnp.bfloat16), dgate, stacked(row_max, row_log2_sum,
                                                     jnp.swapaxes(delta, 2, 3))


def delta_transposed(dout, att, gate, row_max, row_log2_sum):
    # delta summed straight into [B, S, H, N] (no barrier, XLA's choice).
    do32, dgate = gate_terms(dout, att, gate)
    do32 = round_to_bf16(do32)
    delta = jnp.sum(jnp.swapaxes(do32 * att, 2, 3), axis=-1)
    return do32.astype(jnp.bfloat16), dgate, stacked(row_max, row_log2_sum, delta)


def delta_no_stack(dout, att, gate, row_max, row_log2_sum):
    # What the pass costs without the stack (a lower bound for writing delta into a
    # statistics buffer the forward leaves room in).
    do32, dgate = gate_terms(dout, att, gate)
    do32 = round_to_bf16(do32)
    delta, dgate = lax.optimization_barrier((jnp.sum(do32 * att, axis=-1), dgate))
    return do32.astype(jnp.bfloat16), dgate, jnp.swapaxes(delta, 2, 3)


def mean_now(x):
    return jnp.mean(x.astype(jnp.float32), axis=2)


def mean_dot(x):
    b, s, n, h, d = x.shape
    ones = jnp.ones((n,), x.dtype)
    return jnp.einsum("bsnx,n->bsx", x.reshape(b, s, n, h * d), ones,
                      preferred_element_type=jnp.float32).reshape(b, s, h, d) / n


def mean_two_stage(x):
    b, s, n, h, d = x.shape
    step = 16 if n % 16 == 0 else 8
    part = jnp.sum(x.reshape(b, s, n // step, step, h * d).astype(jnp.float32), axis=3)
    return (jnp.sum(part, axis=2) / n).reshape(b, s, h, d)


def mean_flat(x):
    b, s, n, h, d = x.shape
    return jnp.mean(x.reshape(b * s, n, h * d).astype(jnp.float32), axis=1).reshape(b, s, h, d)


def traced_kernels(fn, args):
    with tempfile.TemporaryDirectory() as scratch:
        with jax.profiler.trace(scratch):
            jax.block_until_ready(fn(*args))
        return [(k["name"], k["dur"]) for k in gpu_kernels(read_trace(scratch))]


def time_variants(title, variants, args_sets, check):
    print(f"\n## {title}")
    reference = None
    for name, fn in variants.items():
        fn = jax.jit(fn)
        outs = fn(*args_sets[0])
        if reference is None:
            reference = outs
        error = check(outs, reference)
        us = 1e3 * median_ms(lambda i: fn(*args_sets[i % len(args_sets)]), samples=7, reps=20,
                             warmup=3)
        kernels = traced_kernels(fn, args_sets[0])
        listed = ", ".join(f"{n} {t:.1f}" for n, t in kernels)
        print(f"{name:18s} {us:8.1f} us  (max rel diff {error:.2e})  kernels: {listed}", flush=True)


def delta_of(stats):
    return stats[:, :, :, 2] if stats.ndim == 5 else stats


def max_rel(outs, reference):
    a = jax.tree.leaves(outs)
    b = jax.tree.leaves(reference)
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)))
    return worst


def main(names):
    warm_up_device(1.0)
    for name in names:
        b, s, n, h, d = SHAPES[name].dims
        print(f"\n# {name} {SHAPES[name].dims}")
        args_sets = []
        for seed in range(2):
            keys = jax.random.split(jax.random.key(seed), 5)
            dout = jax.random.normal(keys[0], (b, s, n, h, d), jnp.bfloat16)
            att = jax.random.normal(keys[1], (b, s, n, h, d), jnp.float32)
            gate = jax.random.normal(keys[2], (b, s, n, h, d), jnp.bfloat16)
            row_max = jax.random.normal(keys[3], (b, s, h, n), jnp.float32)
            row_log2_sum = jax.random.normal(keys[4], (b, s, h, n), jnp.float32)
            args_sets.append((dout, att, gate, row_max, row_log2_sum))
        time_variants("backward's elementwise pass", {
            "now": delta_now, "split": delta_split, "dot": delta_dot,
            "transposed": delta_transposed, "no_stack": delta_no_stack,
        }, args_sets, lambda o, r: max_rel((*o[:2], delta_of(o[2])), (*r[:2], delta_of(r[2]))))
        time_variants("row means over residues", {
            "now": mean_now, "dot": mean_dot, "two_stage": mean_two_stage, "flat": mean_flat,
        }, [(a[0],) for a in args_sets], max_rel)


if __name__ == "__main__":
    main(sys.argv[1:] or ["extra", "train"])
