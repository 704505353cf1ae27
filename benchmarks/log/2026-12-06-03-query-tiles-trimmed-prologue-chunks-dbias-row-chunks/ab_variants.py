"""The A/B of this entry: variants alternated in one process, programs of ten calls, fwd / f+b ms per call.

    PYTHONPATH=. python benchmarks/log/2026-12-06-03-query-tiles-trimmed-prologue-chunks-dbias-row-chunks/ab_variants.py CASES VARIANTS

CASES: shape:bias[:plain], comma-separated; VARIANTS: old, new, stage3, pN (the prologue's _MIN_PROGRAMS), tN (TARGET_PROGRAMS)."""
import contextlib, dataclasses, statistics, sys
import jax, jax.numpy as jnp
from benchmarks import timing
from benchmarks.measure import in_one_program
from benchmarks.profiling.forward import parse_shape
from benchmarks.profiling.kernels import make_inputs
from benchmarks.shapes import DTYPES, SHAPES, make_mask
import msa_pallas
from msa_pallas import msa_row_attention, skipping_padding
from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.mosaic import forward as mforward
from msa_pallas.kernels.mosaic.plan import forward_plan
from msa_pallas.kernels.mosaic.tiles import MAX_SHARED_MEMORY
from msa_pallas.kernels.triton import backward_prologue
from msa_pallas import block_sizes

new_live = key_tiles.SpanReader.live_query_tiles
plan_tiles = mforward.default_tiles


def stage3(q_shape, q_dtype, bias_dtype, save_stats, *a, **kw):
    tiles = plan_tiles(q_shape, q_dtype, bias_dtype, save_stats, *a, **kw)
    if tiles.msa_rows == 4:
        deeper = dataclasses.replace(tiles, num_stages=3)
        p = forward_plan((q_shape[0], 4, *q_shape[2:]), q_dtype, bias_dtype, deeper, mask_dtype=jnp.int8,
                         gate_dtype=q_dtype, save_stats=save_stats, interpret=False)
        if p.shared_memory_bytes <= MAX_SHARED_MEMORY:
            return deeper
    return tiles


def patch(name):
    jax.clear_caches()
    key_tiles.SpanReader.live_query_tiles = (
        new_live if name != "old" else (lambda self, block_q: jnp.int32(-(-self.n_res // block_q))))
    mforward.default_tiles = stage3 if name == "stage3" else plan_tiles
    backward_prologue._MIN_PROGRAMS = int(name[1:]) if name.startswith("p") else 2048
    block_sizes.TARGET_PROGRAMS = int(name[1:]) if name.startswith("t") else 512


cases = sys.argv[1].split(",")  # shape:bias
variants = sys.argv[2].split(",")
timing.warm_up_device()
for case in cases:
    shape, bias_name, *mode = case.split(":")
    plain = mode == ["plain"]
    dtype = jnp.bfloat16
    bias_dtype = dtype if bias_name == "input" else DTYPES[bias_name]
    q, k, v, do, gate, bias, mask = make_inputs(parse_shape(shape), dtype, bias_dtype=bias_dtype)
    mask = make_mask(SHAPES[shape], jax.random.key(1)) != 0
    compiled = {}
    for name in variants:
        patch(name)

        def fwd(q, k, v, bias, gate):
            return msa_row_attention(q, k, v, bias, mask, gate, mask_queries=not plain)

        def loss(q, k, v, bias, gate):
            return jnp.sum(fwd(q, k, v, bias, gate).astype(jnp.float32) * do.astype(jnp.float32))

        with (contextlib.nullcontext() if plain else skipping_padding()):
            f = jax.jit(in_one_program(jax.jit(fwd), 10)).lower(q, k, v, bias, gate).compile()
            g = jax.jit(in_one_program(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), 10)).lower(
                q, k, v, bias, gate).compile()
        compiled[name] = (f, g)
    patch("new")
    results = {name: ([], []) for name in variants}
    for _ in range(3):
        for name in variants:
            for i, call in enumerate(compiled[name]):
                ms = timing.times_ms(lambda _, call=call: call(q, k, v, bias, gate), samples=5, reps=3,
                                     warmup=1, settle_seconds=0.2)
                results[name][i].extend(m / 10 for m in ms)
    row = [f"{name} {statistics.median(r[0]):.4f}/{statistics.median(r[1]):.4f}"
           for name, r in results.items()]
    print(f"{shape} bias={bias_name} {'plain' if plain else 'mq'} :: " + " | ".join(row), flush=True)
