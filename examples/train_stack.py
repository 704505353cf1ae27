"""Train a small stack of MSA row-attention layers with optax (adam), under jax.jit.

A toy Evoformer-like residual stack, `m = m + layer_i(m, z, mask)`, fitted on
one fixed batch of random data to a random target with a masked mean squared
error. It shows the pieces a real model needs: `init`, a jit-compiled training
step with `jax.value_and_grad` through the fused op's custom VJP, the
`"dropout"` rng stream, optional bf16 compute (`--dtype bfloat16`; parameters
stay float32) and the choice of implementation.

    PYTHONPATH=. python3 examples/train_stack.py --steps 30
    PYTHONPATH=. python3 examples/train_stack.py --steps 30 --implementation pallas   # GPU
    PYTHONPATH=. python3 examples/train_stack.py --alphafold2 --dropout 0.15

`main(steps, ...)` returns the list of per-step losses.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

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


def make_batch(key, batch: int, rows: int, res: int, msa_dim: int, pair_dim: int):
    """Random msa/pair/mask and a random target (float32)."""
    k_m, k_z, k_mask, k_t = jax.random.split(key, 4)
    m = jax.random.normal(k_m, (batch, rows, res, msa_dim))
    z = jax.random.normal(k_z, (batch, res, res, pair_dim))
    mask = jax.random.bernoulli(k_mask, 0.9, (batch, rows, res))
    mask = mask.at[..., 0].set(True)  # every row keeps at least one key
    target = jax.random.normal(k_t, (batch, rows, res, msa_dim))
    return m, z, mask, target


def masked_mse(pred, target, mask):
    w = mask[..., None].astype(jnp.float32)
    err = (pred.astype(jnp.float32) - target) ** 2 * w
    return err.sum() / (w.sum() * pred.shape[-1])


def main(
    steps: int = 30,
    *,
    num_layers: int = 2,
    batch: int = 1,
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
) -> list[float]:
    """Trains for `steps` adam steps on one random batch; returns the losses (one per step).

    Each loss is computed before that step's update, so `losses[0]` is the
    loss at initialisation.
    """
    model = RowAttentionStack(num_layers, msa_dim, pair_dim, num_heads, dropout=dropout,
                              alphafold2=alphafold2, implementation=implementation, dtype=dtype)
    key = jax.random.key(seed)
    k_data, k_init, k_drop = jax.random.split(key, 3)
    m, z, mask, target = make_batch(k_data, batch, rows, res, msa_dim, pair_dim)
    params = model.init(k_init, m, z, mask)["params"]
    tx = optax.adam(learning_rate)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, step_key):
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
        params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(k_drop, step))
        losses.append(float(loss))
        if verbose and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}  ({time.perf_counter() - start:.1f} s)")
    return losses


def _parse(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--res", type=int, default=16)
    p.add_argument("--msa-dim", type=int, default=32)
    p.add_argument("--pair-dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--alphafold2", action="store_true", help="use the AlphaFold2 preset")
    p.add_argument("--implementation", choices=["pallas", "xla"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = _parse(None)
    losses = main(
        args.steps, num_layers=args.layers, batch=args.batch, rows=args.rows, res=args.res,
        msa_dim=args.msa_dim, pair_dim=args.pair_dim, num_heads=args.heads, dropout=args.dropout,
        alphafold2=args.alphafold2, implementation=args.implementation,
        dtype=None if args.dtype == "float32" else jnp.bfloat16, learning_rate=args.lr,
        seed=args.seed,
    )
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} over {len(losses)} steps")
