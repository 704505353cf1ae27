"""msa_pallas demo: the Pallas kernels against the plain-jnp path, op and layer.

Builds random inputs at an AlphaFold size, runs `msa_pallas.msa_row_attention`
with `implementation="pallas"` (forward, and `jax.grad` of a random-cotangent
loss w.r.t. q, k, v, bias and gate) and the same with `implementation="xla"`
on float32 copies of the inputs, prints the relative errors and the median
wall times of both implementations, and exits 1 if an error is above the
tolerance of the dtype (1e-5 for float32, 2e-2 for bfloat16 / float16).
Then it builds the Flax layer `msa_pallas.MSARowAttentionWithPairBias`
(msa_dim = H * d) and does the same for the layer: forward, and gradients
w.r.t. the MSA and pair representations, Pallas against XLA.

On a GPU the default is the AlphaFold2 training crop (B, S, N, H, d =
1, 128, 256, 8, 32) in bfloat16. Without one, a small float32 case runs the
same kernels in Pallas interpret mode (slow, so only a few timed calls).

From the repository root, with the virtualenv `scripts/env.sh` makes
(`bash scripts/demo.sh` runs the first line)::

    .venv/bin/python examples/demo.py
    .venv/bin/python examples/demo.py --shape 1 512 384 8 32 --dtype bfloat16 --iters 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import msa_pallas

GPU_SHAPE = (1, 128, 256, 8, 32)
GPU_DTYPE = "bfloat16"
CPU_SHAPE = (1, 8, 64, 4, 16)
CPU_DTYPE = "float32"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
MASKED_FRACTION = 0.1
GRAD_NAMES = ("q", "k", "v", "bias", "gate")
GRAD_ARGNUMS = (0, 1, 2, 3, 5)  # positions of q, k, v, bias, gate in the call


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", type=int, nargs=5, metavar=("B", "S", "N", "H", "D"),
        help=f"batch, MSA rows, residues, heads, head dim (default {GPU_SHAPE} on a "
        f"GPU, {CPU_SHAPE} on CPU)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(TOLERANCE),
        help=f"dtype of q, k, v and gate (default {GPU_DTYPE} on a GPU, {CPU_DTYPE} on CPU)",
    )
    parser.add_argument(
        "--iters", type=int,
        help="timed calls per measurement (default 20 on a GPU, 5 on CPU)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_inputs(key, shape, dtype):
    """Random q, k, v, bias, mask, gate and a loss cotangent (never zeros)."""
    batch, rows, n_res, heads, head_dim = shape
    keys = jax.random.split(key, 8)
    q, k, v, gate = (
        jax.random.normal(keys[i], shape, jnp.float32).astype(dtype) for i in range(4)
    )
    bias = jax.random.normal(keys[4], (batch, heads, n_res, n_res), jnp.float32)
    mask = jax.random.uniform(keys[5], (batch, rows, n_res)) >= MASKED_FRACTION
    # One MSA row with every key masked (when there are two or more rows): its
    # weights must come out uniform, and every output and gradient finite.
    masked_row = rows - 1 if rows > 1 else None
    if masked_row is not None:
        mask = mask.at[:, masked_row, :].set(False)
    cotangent = jax.random.normal(keys[6], shape, jnp.float32)
    return (q, k, v, bias, mask, gate), cotangent, masked_row


def attention_fns(implementation, cotangent):
    """jit-compiled forward and gradient (w.r.t. q, k, v, bias, gate) functions."""

    def forward(q, k, v, bias, mask, gate):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, mask, gate, implementation=implementation
        )

    def loss(q, k, v, bias, mask, gate):
        out = forward(q, k, v, bias, mask, gate)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=GRAD_ARGNUMS))


def relative_error(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    norm = np.linalg.norm(b)
    # An all-zero reference (e.g. dq of a fully masked row): the absolute error.
    return float(np.linalg.norm(a - b) / norm) if norm > 0 else float(np.linalg.norm(a))


def median_ms(fn, args, warmup: int, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def layer_demo(key, shape, dtype, tolerance, warmup, iters):
    """Builds the Flax layer, checks the Pallas layer against the XLA one, times both.

    Returns the list of quantities whose relative error is above `tolerance`.
    """
    batch, rows, n_res, heads, head_dim = shape
    msa_dim, pair_dim = heads * head_dim, 128 if jax.default_backend() == "gpu" else 16
    k_msa, k_pair, k_mask, k_cot, k_init = jax.random.split(key, 5)
    msa = jax.random.normal(k_msa, (batch, rows, n_res, msa_dim), jnp.float32)
    pair = jax.random.normal(k_pair, (batch, n_res, n_res, pair_dim), jnp.float32)
    msa_mask = jax.random.uniform(k_mask, (batch, rows, n_res)) > MASKED_FRACTION
    cotangent = jax.random.normal(k_cot, msa.shape, jnp.float32)

    def layer_fns(implementation, compute_dtype):
        layer = msa_pallas.MSARowAttentionWithPairBias(
            msa_dim=msa_dim, pair_dim=pair_dim, num_heads=heads,
            implementation=implementation, dtype=compute_dtype,
        )
        def forward(variables, msa, pair):
            return layer.apply(variables, msa, pair, msa_mask).astype(jnp.float32)
        def loss(variables, msa, pair):
            return jnp.sum(forward(variables, msa, pair) * cotangent)
        return layer, jax.jit(forward), jax.jit(jax.grad(loss, argnums=(1, 2)))

    layer, pallas_fwd, pallas_grad = layer_fns("pallas", dtype)
    _, xla_fwd, xla_grad = layer_fns("xla", dtype)
    _, ref_fwd, ref_grad = layer_fns("xla", jnp.float32)
    variables = layer.init(k_init, msa, pair, msa_mask)
    args = (variables, msa, pair)
    errors = {"output": relative_error(pallas_fwd(*args), ref_fwd(*args))}
    for name, g, ref_g in zip(("dmsa", "dpair"), pallas_grad(*args), ref_grad(*args)):
        errors[name] = relative_error(g, ref_g)

    print()
    print(f"layer MSARowAttentionWithPairBias(msa_dim={msa_dim}, pair_dim={pair_dim}, "
          f"num_heads={heads}), compute dtype {jnp.dtype(dtype).name}; relative error "
          "against the float32 XLA layer with the same weights")
    for name, err in errors.items():
        flag = "" if err <= tolerance else "   <-- above tolerance"
        print(f"  {name:<8} {err:9.2e}{flag}")
    print(f"  {'':<10} {'pallas':>10} {'xla':>10} {'speed-up':>9}")
    for label, p_fn, x_fn in (("forward", pallas_fwd, xla_fwd), ("fwd+bwd", pallas_grad, xla_grad)):
        p = median_ms(p_fn, args, warmup, iters)
        x = median_ms(x_fn, args, warmup, iters)
        print(f"  {label:<10} {p:10.3f} {x:10.3f} {x / p:8.2f}x")
    return [f"layer {name}" for name, err in errors.items() if not err <= tolerance]


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shape = tuple(args.shape) if args.shape else (GPU_SHAPE if on_gpu else CPU_SHAPE)
    dtype_name = args.dtype or (GPU_DTYPE if on_gpu else CPU_DTYPE)
    dtype = jnp.dtype(dtype_name)
    iters = args.iters or (20 if on_gpu else 5)
    tolerance = TOLERANCE[dtype_name]
    batch, rows, n_res, heads, head_dim = shape

    device = jax.devices()[0]
    print("msa_pallas demo: MSA row attention with pair bias")
    print(
        f"device: {device.device_kind} (backend {jax.default_backend()}), "
        f"jax {jax.__version__}, msa_pallas {msa_pallas.__version__}"
    )
    if not on_gpu:
        print("no GPU: the Pallas kernels run in interpret mode (slow; timings are not "
              "kernel performance)")
    inputs, cotangent, masked_row = make_inputs(jax.random.key(args.seed), shape, dtype)
    mask = np.asarray(inputs[4])
    if masked_row is not None:
        mask = np.delete(mask, masked_row, axis=1)
    mask_note = f"{100 * (1 - mask.mean()):.1f}% of keys masked at random"
    if masked_row is not None:
        mask_note += f", MSA row {masked_row} fully masked"
    print(
        f"shape: B={batch} S={rows} N={n_res} H={heads} d={head_dim}; {dtype_name} "
        f"q, k, v, gate; float32 bias; mask: {mask_note}"
    )

    pallas_fwd, pallas_grad = attention_fns("pallas", cotangent)
    xla_fwd, xla_grad = attention_fns("xla", cotangent)

    # Accuracy: the kernels on the demo dtype against the plain-jnp path on
    # float32 copies of the same inputs.
    inputs32 = tuple(
        x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x in inputs
    )
    out = pallas_fwd(*inputs)
    grads = pallas_grad(*inputs)
    ref_out = xla_fwd(*inputs32)
    ref_grads = xla_grad(*inputs32)
    errors = {"output": relative_error(out, ref_out)}
    for name, g, ref_g in zip(GRAD_NAMES, grads, ref_grads):
        errors[f"d{name}"] = relative_error(g, ref_g)
    finite = all(
        bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in (out, *grads)
    )
    failed = [name for name, err in errors.items() if not err <= tolerance]

    print()
    print("relative error ||pallas - ref|| / ||ref||, ref = implementation=\"xla\" "
          "on float32 inputs")
    for name, err in errors.items():
        flag = "" if err <= tolerance else "   <-- above tolerance"
        print(f"  {name:<8} {err:9.2e}{flag}")
    print(f"  tolerance for {dtype_name}: {tolerance:.0e}; all outputs finite: {finite}")

    # Speed: both implementations on the same (demo dtype) inputs.
    timings = {}
    for label, (fwd, grad) in (("pallas", (pallas_fwd, pallas_grad)), ("xla", (xla_fwd, xla_grad))):
        timings[label] = (
            median_ms(fwd, inputs, args.warmup, iters),
            median_ms(grad, inputs, args.warmup, iters),
        )

    print()
    print(f"median wall time in ms ({iters} timed calls after {args.warmup} warm-ups; "
          f"both on {dtype_name} inputs)")
    print(f"  {'':<10} {'pallas':>10} {'xla':>10} {'speed-up':>9}")
    for i, label in enumerate(("forward", "fwd+bwd")):
        p, x = timings["pallas"][i], timings["xla"][i]
        print(f"  {label:<10} {p:10.3f} {x:10.3f} {x / p:8.2f}x")

    failed += layer_demo(
        jax.random.key(args.seed + 1), shape, dtype, tolerance, args.warmup, iters
    )

    print()
    if failed:
        print(f"FAIL: relative error of {', '.join(failed)} above {tolerance:.0e}")
        return 1
    if not finite:
        print("FAIL: the Pallas output or gradients hold non-finite values")
        return 1
    print(f"PASS: every relative error <= {tolerance:.0e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
