"""Kernel times with and without attention dropout (H200): the Mosaic forward with
residuals, and the three Mosaic backward kernels, rate 0 against 0.1, at the train,
finetune and extra shapes (`PYTHONPATH=. python3 time_dropout_kernels.py`). One call is
timed per sample: launch overhead is in every number."""
import time, jax, jax.numpy as jnp
from msa_pallas import dropout
from msa_pallas.kernels.mosaic import forward as F, backward as B

def bench(f, *a, n=50):
    for _ in range(3): jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3

for name, shape in {"train": (1, 128, 256, 8, 32), "finetune": (1, 512, 384, 8, 32),
                    "extra": (1, 1024, 384, 8, 8)}.items():
    b, s, n, h, d = shape
    ks = jax.random.split(jax.random.key(0), 6)
    q, k, v, g = (jax.random.normal(x, shape, jnp.bfloat16) for x in ks[:4])
    bias = jax.random.normal(ks[4], (b, h, n, n), jnp.float32)
    mask = (jax.random.uniform(ks[5], (b, s, n)) > 0.1).astype(jnp.int8)
    seeds = dropout.row_seeds(jax.random.key(1), b, s, h)
    ft = F.default_tiles(shape, jnp.bfloat16, jnp.float32, save_stats=True, has_gate=True)
    bt = B.default_tiles(shape, jnp.bfloat16, jnp.float32)
    stats = jax.random.normal(ks[0], (b, s, h, 3, n), jnp.float32) * 0.1
    row = {}
    for rate in (0.0, 0.1):
        fw = jax.jit(lambda *a: F.attention_forward(*a, scale=d**-0.5, tiles=ft, interpret=False,
                                                    save_stats=True, dropout_rate=rate))
        row[f"fwd{rate}"] = bench(fw, q, k, v, bias, mask, g, seeds)
        _, att, m, l = fw(q, k, v, bias, mask, g, seeds)
        st = jnp.stack([m, l, jnp.swapaxes(jnp.sum(att * q.astype(jnp.float32), -1), 2, 3)], 3)
        ops = (q, k, v, bias, mask, g, st, seeds)
        for kn, t in (("dkdv", bt.dkdv), ("dq", bt.dq), ("dbias", bt.dbias)):
            kw = {} if kn == "dbias" else {"ping_pong": bt.ping_pong}
            f = jax.jit(lambda *a, kn=kn, t=t, kw=kw: getattr(B, "backward_" + kn)(
                *a, scale=d**-0.5, tiles=t, interpret=False, dropout_rate=rate, **kw))
            row[f"{kn}{rate}"] = bench(f, *ops)
    print(name, {k: round(x, 3) for k, x in row.items()},
          {kn: round(row[f"{kn}0.1"] / row[f"{kn}0.0"], 3) for kn in ("fwd", "dkdv", "dq", "dbias")})
