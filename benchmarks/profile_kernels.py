"""Per-kernel GPU times: forward, dk/dv, dq, dbias and the fused dq+dbias kernel.

Times each Pallas kernel on its own, so a change to one kernel can be judged
without the noise of the whole step, and tile candidates can be compared:

    python benchmarks/profile_kernels.py --shapes train,finetune,long --dtypes bf16,f32

Each time is the median over `--samples` batches of `--reps` back-to-back
calls divided by `--reps`: the launches queue up behind each other, so the
host's dispatch latency (tens of microseconds) is not in the number.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import DTYPES, SHAPES  # noqa: E402
from timing import batched_times_ms  # noqa: E402

from msa_pallas.attention import msa_row_attention  # noqa: E402
from msa_pallas.block_sizes import KernelTiles, default_block_config, next_power_of_2  # noqa: E402
from msa_pallas.kernels import backward, common  # noqa: E402
from msa_pallas.kernels.forward import attention_forward  # noqa: E402

# Without a GPU the kernels run in interpret mode: only a check that the script works.
INTERPRET = jax.default_backend() != "gpu"


def batched_ms(call, reps: int, samples: int) -> float:
    jax.block_until_ready(call())
    return statistics.median(batched_times_ms(lambda i: call(), samples=samples, reps=reps))


def make_inputs(shape, dtype, seed=0):
    batch, rows, n_res, heads, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    q, k, v, do, gate = (
        jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[:5]
    )
    bias = jax.random.normal(keys[5], (batch, heads, n_res, n_res), jnp.float32).astype(dtype)
    mask = jax.random.bernoulli(keys[6], 0.9, (batch, rows, n_res)).astype(jnp.int8)
    return q, k, v, do, gate, bias, mask


def fused_candidates(n_res: int):
    span = max(16, next_power_of_2(n_res))
    for warps, stages in ((4, 2), (4, 3), (8, 2), (2, 2)):
        yield KernelTiles(16, span, warps, stages)


def profile(name, shape, dtype_name, args, emit):
    dtype = DTYPES[dtype_name]
    q, k, v, do, gate, bias, mask = make_inputs(shape, dtype)
    scale = shape[-1] ** -0.5
    config = default_block_config(shape[2], shape[-1], dtype)
    time_it = lambda call: batched_ms(call, args.reps, args.samples)

    def run(label, call):
        try:
            emit(name, dtype_name, label, f"{time_it(call):.4f}")
        except Exception as exc:  # noqa: BLE001 - one failed variant must not end the run
            emit(name, dtype_name, label, f"ERROR {type(exc).__name__}: {str(exc)[:300]}")

    out, attention, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask, gate, scale=scale, tiles=config.forward, interpret=INTERPRET,
        save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * attention, -1), 2, 3)
    operands = (q, k, v, bias, mask, do, row_max, row_log2_sum, delta)
    precisions = ("tf32x3", "ieee") if dtype == jnp.float32 else (common.F32_DOTS,)
    for precision in precisions:
        common.F32_DOTS = precision
        jax.clear_caches()
        tag = f"[{precision}]" if dtype == jnp.float32 else ""
        run(f"forward{tag} {config.forward}", lambda: attention_forward(
            q, k, v, bias, mask, gate, scale=scale, tiles=config.forward, interpret=INTERPRET,
            save_stats=True))
        for kernel, tiles in (
            (backward.backward_dkdv, config.backward_dkdv),
            (backward.backward_dq, config.backward_dq),
            (backward.backward_dbias, config.backward_dbias),
        ):
            run(f"{kernel.__name__}{tag} {tiles}",
                lambda kernel=kernel, tiles=tiles: kernel(
                    *operands, scale=scale, tiles=tiles, interpret=INTERPRET))
    common.F32_DOTS = "tf32x3"
    jax.clear_caches()
    for tiles in args.dbias_tiles:
        run(f"backward_dbias {tiles}", lambda tiles=tiles: backward.backward_dbias(
            *operands, scale=scale, tiles=tiles.clipped(shape[2]), interpret=INTERPRET))
    if shape[2] <= 512 and not args.skip_fused:
        for tiles in fused_candidates(shape[2]):
            run(f"backward_dq_dbias {tiles}",
                lambda tiles=tiles: backward.backward_dq_dbias(
                    *operands, scale=scale, tiles=tiles, interpret=INTERPRET))

    def loss(q, k, v, bias, gate):
        out = msa_row_attention(q, k, v, bias, mask.astype(bool), gate, implementation="pallas")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    fwd = jax.jit(lambda *a: msa_row_attention(
        *a[:4], mask.astype(bool), a[4], implementation="pallas"))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    run("op forward", lambda: fwd(q, k, v, bias, gate))
    run("op forward+backward", lambda: fwd_bwd(q, k, v, bias, gate))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="train,finetune,long")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--dbias-tiles", default="",
                        help="extra dbias tiles to time, e.g. 64x64x4x2,32x64x4x2 (q x k x warps x stages)")
    args = parser.parse_args(argv)
    args.dbias_tiles = [
        KernelTiles(*map(int, text.split("x"))) for text in args.dbias_tiles.split(",") if text
    ]
    emit = lambda *fields: print(" | ".join(str(f) for f in fields), flush=True)
    for name in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            profile(name, SHAPES[name], dtype_name, args, emit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
