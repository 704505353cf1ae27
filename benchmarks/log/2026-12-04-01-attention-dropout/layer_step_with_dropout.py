"""Times the reference layer's jitted training step (c_m = 256, c_z = 128, H = 8, bf16
compute) at the train and finetune crops, on the msa_pallas that Python imports:

    PYTHONPATH=TREE python3 layer_step_with_dropout.py IMPLEMENTATION RATE

IMPLEMENTATION: default (None), xla, triton, mosaic; RATE: attention dropout."""
import sys, time, jax, jax.numpy as jnp
import msa_pallas
from msa_pallas.layers import MSARowAttentionWithPairBias
impl = None if sys.argv[1] == "default" else sys.argv[1]
rate = float(sys.argv[2])
for name, (S, N) in {"train": (128, 256), "finetune": (512, 384)}.items():
    B, c_m, c_z, H = 1, 256, 128, 8
    k_m, k_z, k_mask, k_cot = jax.random.split(jax.random.key(0, impl="rbg"), 4)
    m = jax.random.normal(k_m, (B, S, N, c_m), jnp.bfloat16)
    z = jax.random.normal(k_z, (B, N, N, c_z), jnp.bfloat16)
    mask = jax.random.bernoulli(k_mask, 0.9, (B, S, N)).at[..., 0].set(True)
    cot = jax.random.normal(k_cot, (B, S, N, c_m), jnp.float32)
    layer = MSARowAttentionWithPairBias(msa_dim=c_m, pair_dim=c_z, num_heads=H, dropout=rate,
                                        dtype=jnp.bfloat16, implementation=impl)
    params = jax.jit(layer.init)(jax.random.key(1, impl="rbg"), m[:, :1, :1], z[:, :1, :1], mask[:, :1, :1])["params"]
    def loss(p, m, z, key):
        out = layer.apply({"params": p}, m, z, mask, deterministic=rate == 0, rngs={"dropout": key})
        return jnp.sum(out.astype(jnp.float32) * cot)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(params, m, z, jax.random.key(2)).compile()
    temp = step.memory_analysis().temp_size_in_bytes
    key = jax.random.key(2)
    for _ in range(3): jax.block_until_ready(step(params, m, z, key))
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5): out = step(params, m, z, key)
        jax.block_until_ready(out); samples.append((time.perf_counter() - t) / 5 * 1e3)
    print(f"{msa_pallas.__file__} impl={sys.argv[1]} rate={rate} {name}: step {sorted(samples)[2]:.3f} ms, temp {temp/1e6:.0f} MB", flush=True)
