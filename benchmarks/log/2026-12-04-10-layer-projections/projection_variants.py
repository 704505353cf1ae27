"""The reference layer's step with its projections written in different ways (timing only).

    PYTHONPATH=. python benchmarks/log/2026-12-04-10-layer-projections/projection_variants.py train
(a second argument: the XLA core alone, a CPU smoke test at `tiny`)."""
import sys
import jax, jax.numpy as jnp
from benchmarks import timing
from benchmarks.layer import LayerProgram, core_options, layer_shape, make_inputs
from msa_pallas import msa_row_attention

shape_name = sys.argv[1] if len(sys.argv) > 1 else "train"
sh = layer_shape(shape_name)
C, CZ, H, D = sh["msa_dim"], sh["pair_dim"], sh["heads"], sh["head_dim"]
bf = jnp.bfloat16
m, z, mask, cot = make_inputs(sh, bf)
keys = jax.random.split(jax.random.key(0), 16)
P = {}
for i, n in enumerate(["q", "k", "v", "g", "o"]):
    P[n + "w"] = jax.random.uniform(keys[i], (C, C), jnp.float32, -C**-0.5, C**-0.5)
    P[n + "b"] = jax.random.uniform(keys[5 + i], (C,), jnp.float32, -C**-0.5, C**-0.5)
P["zw"] = jax.random.uniform(keys[11], (CZ, H), jnp.float32, -CZ**-0.5, CZ**-0.5)
P["zb"] = jax.random.uniform(keys[12], (H,), jnp.float32, -CZ**-0.5, CZ**-0.5)
P["lnw"] = jnp.ones((C,)); P["lnb"] = jnp.zeros((C,))


def ln(x, w, b):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(bf)


def dense(x, w, b):
    return jnp.dot(x, w.astype(bf)) + b.astype(bf)


def forward(p, m, z, mask, key, variant, impl, rate):
    x = ln(m, p["lnw"], p["lnb"])
    if variant == "separate":
        q, k, v, g = (dense(x, p[n + "w"], p[n + "b"]) for n in "qkvg")
    elif variant == "concat":
        w = jnp.concatenate([p[n + "w"] for n in "qkvg"], 1)
        b = jnp.concatenate([p[n + "b"] for n in "qkvg"])
        y = dense(x, w, b)
        q, k, v, g = jnp.split(y, 4, -1)
    elif variant == "barrier":
        q, k, v, g = (dense(jax.lax.optimization_barrier(x), p[n + "w"], p[n + "b"]) for n in "qkvg")
    elif variant == "nobias_then_add":
        w = jnp.concatenate([p[n + "w"] for n in "qkvg"], 1)
        y = jnp.dot(x, w.astype(bf)).reshape(*x.shape[:-1], 4, C)
        y = y + jnp.stack([p[n + "b"] for n in "qkvg"]).astype(bf)
        q, k, v, g = (y[..., i, :] for i in range(4))
    bias = jnp.moveaxis(dense(z, p["zw"], p["zb"]), -1, -3)
    hd = lambda t: t.reshape(*t.shape[:-1], H, D)
    kw = dict(dropout_rate=rate, dropout_rng=key) if rate else {}
    o = msa_row_attention(hd(q), hd(k), hd(v), bias, mask, hd(g), implementation=impl, **kw)
    return dense(o.reshape(*o.shape[:-2], C), p["ow"], p["ob"])


res = {}
CORES = ((("xla", 0.1),) if len(sys.argv) > 2 else (("default", 0.1), ("xla", 0.1), ("default", 0.0)))
for core, rate in CORES:  # (("default", 0.1), ("xla", 0.1), ("default", 0.0)):
    impl = None if core == "default" else core
    for variant in ("separate", "concat", "barrier", "nobias_then_add"):
        def loss(p, m, z, mask, cot, key):
            return jnp.sum(forward(p, m, z, mask, key, variant, impl, rate).astype(jnp.float32) * cot)
        args = (P, m, z, mask, cot, jax.random.key(2))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        ms = timing.median_ms(lambda i: step(*args), samples=7, reps=10, warmup=3)
        print(f"{shape_name} {core} rate {rate} {variant}: {ms:.4f} ms", flush=True)
    # the real layer, same harness
    prog = LayerProgram(sh, "reference", rate, bf, bf, core_options(core))
    _, step = prog.compile()
    ms = timing.median_ms(lambda i: step(*prog.args), samples=7, reps=10, warmup=3)
    print(f"{shape_name} {core} rate {rate} LAYER: {ms:.4f} ms", flush=True)
