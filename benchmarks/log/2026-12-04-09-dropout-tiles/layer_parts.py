"""The reference layer's forward with and without attention dropout, and the op alone on
operands of the layer's shapes and dtypes (caught through the layer's `attention_fn`),
forward and f+b, rate 0 and 0.1 (`PYTHONPATH=. python3 layer_parts.py finetune`)."""
import sys

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.layer import layer_shape, make_inputs, make_layer
from msa_pallas import msa_row_attention

shape_name = sys.argv[1] if len(sys.argv) > 1 else "finetune"
shape = layer_shape(shape_name)
m, z, mask, _ = make_inputs(shape, jnp.bfloat16)
caught = {}


def catch(q, k, v, bias, mask=None, gate=None, **options):
    caught.update(q=q, k=k, v=v, bias=bias, gate=gate)
    return msa_row_attention(q, k, v, bias, mask, gate, **options)


def median_ms(fn, *args):
    return timing.median_ms(lambda i: fn(*args), samples=7, reps=10, warmup=2)


times = {}
for rate in (0.0, 0.1):
    layer = make_layer(shape, "reference", rate, jnp.bfloat16, {})
    params = jax.jit(layer.init)(jax.random.key(1, impl="rbg"), m[:, :1, :1], z[:, :1, :1],
                                 mask[:, :1, :1])["params"]

    def forward(params, m, z, mask, key, layer=layer, rate=rate):
        return layer.apply({"params": params}, m, z, mask, deterministic=rate == 0.0,
                           rngs={"dropout": key})

    compiled = jax.jit(forward).lower(params, m, z, mask, jax.random.key(2)).compile()
    times[f"layer fwd {rate}"] = median_ms(compiled, params, m, z, mask, jax.random.key(2))
    if rate == 0.0:
        probe = make_layer(shape, "reference", rate, jnp.bfloat16, {"attention_fn": catch})
        jax.eval_shape(lambda p: probe.apply({"params": p}, m, z, mask, deterministic=True),
                       params)
        ops = {name: jax.random.normal(jax.random.key(7), x.shape, x.dtype)
               for name, x in caught.items()}
        print({name: (x.shape, x.dtype.name) for name, x in ops.items()}, flush=True)

args = tuple(ops[name] for name in ("q", "k", "v", "bias", "gate"))
op_mask = jnp.asarray(mask, bool)
for rate in (0.0, 0.1):
    options = dict(dropout_rate=rate, dropout_rng=jax.random.key(3)) if rate else {}

    def op(q, k, v, bias, gate, options=options):
        return msa_row_attention(q, k, v, bias, op_mask, gate, **options)

    def loss(*args, op=op):
        return jnp.sum(op(*args).astype(jnp.float32))

    forward = jax.jit(op).lower(*args).compile()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    times[f"op fwd {rate}"] = median_ms(forward, *args)
    times[f"op f+b {rate}"] = median_ms(grads, *args)
for name, ms in times.items():
    print(shape_name, name, round(ms, 4), flush=True)
