"""Train a small stack of MSA row-attention layers with optax (adam), under jax.jit.

A toy Evoformer-like residual stack, `m = m + layer_i(m, z, mask)`, fitted on
one fixed batch of random data to a random target with a masked mean squared
error. It shows the pieces a real model needs: `init`, a jit-compiled training
step with `jax.value_and_grad` through the fused op's custom VJP, the
`"dropout"` rng stream, optional bf16 compute (`--dtype bfloat16`; parameters
stay float32), the choice of implementation, and the same step on several
devices (`--mesh`).

    PYTHONPATH=. python3 examples/train_stack.py --steps 30
    PYTHONPATH=. python3 examples/train_stack.py --steps 30 --implementation pallas   # GPU
    PYTHONPATH=. python3 examples/train_stack.py --dropout 0.1    # attention dropout, in the kernels
    PYTHONPATH=. python3 examples/train_stack.py --alphafold2 --dropout 0.15
    PYTHONPATH=. python3 examples/train_stack.py --mesh data=2            # data parallel, 2 devices
    PYTHONPATH=. python3 examples/train_stack.py --mesh rows=2 --compare  # MSA rows, and 1 device

Several devices (`--mesh data=2`, `--mesh rows=2`, `--mesh data=2,rows=2`):
the step is the same function, jit-compiled with its inputs placed on a
device mesh. The batch axis B of the MSA, the pair representation, the mask
and the target is sharded over `data` (data parallelism: `--batch` defaults
to the size of `data`), and the MSA rows S of the MSA, the mask and the
target over `rows`; the parameters and the adam state are replicated. The
compiler partitions the rest: every device runs the attention kernels on its
own shard (`msa_pallas` partitions its kernel calls over B and S), the bias
gradient's partial sums over S are all-reduced in float32, and the parameter
gradients and the loss are all-reduced across the devices. `--compare` trains
again on one device from the same start and prints the largest relative
difference between the two loss curves: they differ only in the order in which
float32 sums add up (below 1e-6 relative over 30 steps in float32; with
`--dtype bfloat16`, Flax's Dense layers round each device's part of a
parameter gradient to bfloat16 before the sum, ~1e-4), and exits 1 above
`--tolerance`.

`main(steps, ...)` returns the list of per-step losses.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from msa_pallas.layers import MSARowAttentionWithPairBias


class RowAttentionStack(nn.Module):
    """`num_layers` residual MSA row-attention layers sharing one pair representation."""

    num_layers: int
    msa_dim: int
    pair_dim: int
    num_heads: int
    dropout: float = 0.0
    alphafold2: bool = False
    implementation: str | None = None
    dtype: Any = None

    @nn.compact
    def __call__(self, m, z, mask, deterministic: bool = True):
        for i in range(self.num_layers):
            kwargs = dict(msa_dim=self.msa_dim, pair_dim=self.pair_dim, num_heads=self.num_heads,
                          dropout=self.dropout, implementation=self.implementation,
                          dtype=self.dtype, name=f"row_attention_{i}")
            if self.alphafold2:
                layer = MSARowAttentionWithPairBias.alphafold2(**kwargs)
            else:
                layer = MSARowAttentionWithPairBias(**kwargs)
            m = m + layer(m, z, mask, deterministic=deterministic).astype(m.dtype)
        return m


def make_batch(seed: int, batch: int, rows: int, res: int, msa_dim: int, pair_dim: int):
    """Random msa/pair/mask and a random target (float32), drawn on the host as a
    data loader would hand them over."""
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((batch, rows, res, msa_dim), dtype=np.float32)
    z = rng.standard_normal((batch, res, res, pair_dim), dtype=np.float32)
    mask = rng.random((batch, rows, res)) < 0.9
    mask[..., 0] = True  # every row keeps at least one key
    target = rng.standard_normal((batch, rows, res, msa_dim), dtype=np.float32)
    return m, z, mask, target


def masked_mse(pred, target, mask):
    w = mask[..., None].astype(jnp.float32)
    err = (pred.astype(jnp.float32) - target) ** 2 * w
    return err.sum() / (w.sum() * pred.shape[-1])


MESH_AXES = ("data", "rows")


def parse_mesh(text: str | None) -> dict[str, int]:
    """`"data=2,rows=2"` -> {"data": 2, "rows": 2}; None or "" -> {}."""
    sizes = {}
    for part in (text or "").split(","):
        if not part:
            continue
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1 or name in sizes:
            raise ValueError(f"--mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS "
                             f"in {MESH_AXES}, each at most once, e.g. data=2 or data=2,rows=2")
        sizes[name] = int(size)
    return sizes


def make_mesh(sizes: dict[str, int], devices=None):
    """A mesh with the axes `sizes` names (Auto axes: the compiler propagates the
    inputs' shardings), on the first prod(sizes) devices."""
    devices = jax.devices() if devices is None else devices
    count = math.prod(sizes.values())
    if count > len(devices):
        raise ValueError(f"the mesh {sizes} needs {count} devices; {len(devices)} visible")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices[:count],
                         axis_types=(AxisType.Auto,) * len(sizes))


def main(
    steps: int = 30,
    *,
    num_layers: int = 2,
    batch: int | None = None,
    rows: int = 8,
    res: int = 16,
    msa_dim: int = 32,
    pair_dim: int = 16,
    num_heads: int = 4,
    dropout: float = 0.0,
    alphafold2: bool = False,
    implementation: str | None = None,
    dtype: Any = None,
    learning_rate: float = 3e-3,
    seed: int = 0,
    verbose: bool = True,
    mesh: dict[str, int] | str | None = None,
) -> list[float]:
    """Trains for `steps` adam steps on one random batch; returns the losses (one per step).

    Each loss is computed before that step's update, so `losses[0]` is the
    loss at initialisation. `mesh` ({"data": 2}, "rows=2", ...: see the module
    docstring) runs the step on a device mesh; the data, the initial
    parameters and the dropout keys do not depend on it. `batch` defaults to
    the size of the mesh's `data` axis (1 without one).
    """
    sizes = parse_mesh(mesh) if isinstance(mesh, (str, type(None))) else dict(mesh)
    batch = sizes.get("data", 1) if batch is None else batch
    for axis, size in (("data", batch), ("rows", rows)):
        if size % sizes.get(axis, 1):
            raise ValueError(f"the mesh axis {axis}={sizes[axis]} must divide "
                             f"{'--batch' if axis == 'data' else '--rows'}={size}")
    model = RowAttentionStack(num_layers, msa_dim, pair_dim, num_heads, dropout=dropout,
                              alphafold2=alphafold2, implementation=implementation, dtype=dtype)
    k_init, k_drop = jax.random.split(jax.random.key(seed))
    m, z, mask, target = map(jnp.asarray, make_batch(seed, batch, rows, res, msa_dim, pair_dim))
    # Under jit: run eagerly, every small op of the initialisers would compile on its own.
    params = jax.jit(model.init)(k_init, m, z, mask)["params"]
    tx = optax.adam(learning_rate)
    opt_state = jax.jit(tx.init)(params)
    out_shardings = None
    if sizes:
        device_mesh = make_mesh(sizes)
        data, msa_rows = sizes.get("data"), sizes.get("rows")
        place = lambda x, spec: jax.device_put(x, NamedSharding(device_mesh, spec))
        m, target = (place(x, P(data and "data", msa_rows and "rows")) for x in (m, target))
        mask = place(mask, P(data and "data", msa_rows and "rows"))
        z = place(z, P(data and "data"))
        replicated = NamedSharding(device_mesh, P())
        params, opt_state = jax.device_put((params, opt_state), replicated)
        out_shardings = (replicated, replicated, replicated)
        if verbose:
            print(f"mesh {dict(device_mesh.shape)} on {device_mesh.devices.size} devices; "
                  f"msa {m.sharding.spec}, pair {z.sharding.spec}, batch {batch}")

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def train_step(params, opt_state, data, step_key):
        m, z, mask, target = data

        def loss_fn(params):
            pred = model.apply({"params": params}, m, z, mask, deterministic=False,
                               rngs={"dropout": step_key})
            return masked_mse(pred, target, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    start = time.perf_counter()
    for step in range(steps):
        params, opt_state, loss = train_step(
            params, opt_state, (m, z, mask, target), jax.random.fold_in(k_drop, step))
        losses.append(float(loss))
        if verbose and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}  ({time.perf_counter() - start:.1f} s)")
    return losses


def _parse(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=None,
                   help="batch size B (default: the size of the mesh's data axis, else 1)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--res", type=int, default=16)
    p.add_argument("--msa-dim", type=int, default=32)
    p.add_argument("--pair-dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--alphafold2", action="store_true", help="use the AlphaFold2 preset")
    p.add_argument("--implementation", choices=["triton", "pallas", "mosaic", "xla"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None,
                   help="run the step on a device mesh: data=N (batch), rows=N (MSA rows) or both, "
                        "e.g. data=2,rows=2")
    p.add_argument("--compare", action="store_true",
                   help="with --mesh: train again on one device and compare the loss curves")
    p.add_argument("--tolerance", type=float, default=None,
                   help="with --compare: exit 1 if the largest relative difference of the "
                        "losses exceeds it (default 1e-5 in float32, 1e-2 in bfloat16)")
    return p.parse_args(argv)


def compare_curves(sharded: Sequence[float], single: Sequence[float]) -> float:
    """The largest relative difference between two loss curves, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(sharded, single))


if __name__ == "__main__":
    args = _parse(None)
    sizes = parse_mesh(args.mesh)
    options = dict(
        num_layers=args.layers, batch=args.batch, rows=args.rows, res=args.res,
        msa_dim=args.msa_dim, pair_dim=args.pair_dim, num_heads=args.heads, dropout=args.dropout,
        alphafold2=args.alphafold2, implementation=args.implementation,
        dtype=None if args.dtype == "float32" else jnp.bfloat16, learning_rate=args.lr,
        seed=args.seed,
    )
    start = time.perf_counter()
    losses = main(args.steps, mesh=sizes, **options)
    seconds = time.perf_counter() - start
    where = f"mesh {args.mesh}" if sizes else "1 device"
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} over {len(losses)} steps ({where}, "
          f"{seconds:.1f} s with compilation)")
    if args.compare and sizes:
        options["batch"] = args.batch if args.batch is not None else sizes.get("data", 1)
        start = time.perf_counter()
        single = main(args.steps, **options)
        seconds = time.perf_counter() - start
        print(f"loss {single[0]:.5f} -> {single[-1]:.5f} over {len(single)} steps (1 device, "
              f"{seconds:.1f} s with compilation)")
        difference = compare_curves(losses, single)
        tolerance = args.tolerance or (1e-5 if args.dtype == "float32" else 1e-2)
        same = difference <= tolerance
        print(f"mesh {args.mesh} vs 1 device: largest relative loss difference {difference:.2e} "
              f"over {len(losses)} steps ({'same curve' if same else 'DIFFERENT'}, "
              f"tolerance {tolerance:g})")
        raise SystemExit(0 if same else 1)
