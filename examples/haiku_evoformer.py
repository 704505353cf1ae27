"""msa_pallas's Haiku MSARowAttentionWithPairBias inside a small AlphaFold2-style Evoformer.

A Haiku Evoformer-style block, AlphaFold2's layout and parameter names::

    msa_act += dropout_rows(MSARowAttentionWithPairBias(msa_act, msa_mask, pair_act))
    msa_act += MSATransition(msa_act)             # LayerNorm -> Linear 4x -> relu -> Linear

with `msa_pallas.haiku.MSARowAttentionWithPairBias` in place of AlphaFold2's
module (the same parameters, so AF2 weights load unchanged). The blocks are
stacked as AlphaFold2 stacks its 48 Evoformer blocks: one parameter set per
block on a leading axis, applied with `jax.lax.scan`.

The script builds random AlphaFold2-format parameters, writes them to an
`.npz` in AF2's flat naming (`module/path//param`, e.g.
`alphafold/alphafold_iteration/evoformer/evoformer_iteration/msa_row_attention_with_pair_bias//query_w`,
stacked over blocks), loads them back with the equivalent of AF2's
`utils.flat_params_to_haiku`, runs the stack under `jax.jit` and prints the
output shape.

From the repository root, with the virtualenv `scripts/env.sh` makes (or any
environment where msa_pallas and dm-haiku are installed, with its `python`)::

    .venv/bin/python examples/haiku_evoformer.py
    .venv/bin/python examples/haiku_evoformer.py --blocks 4 --seqs 32 --res 64 --implementation xla

Needs dm-haiku: in `.venv` already (the test extra); elsewhere `pip install -e ".[haiku]"`
from the repository root.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from msa_pallas.haiku import MSARowAttentionWithPairBias

# Where AlphaFold2 keeps the Evoformer blocks (model_1 ... model_5).
EVOFORMER_SCOPE = "alphafold/alphafold_iteration/evoformer"


def af2_config(num_head: int = 8) -> types.SimpleNamespace:
    """The fields of AF2's `evoformer` config this block reads (an ml_collections
    ConfigDict works the same way)."""
    row_attention = types.SimpleNamespace(
        num_head=num_head, gating=True, orientation="per_row",
        dropout_rate=0.15, shared_dropout=True)
    transition = types.SimpleNamespace(num_intermediate_factor=4, dropout_rate=0.0)
    return types.SimpleNamespace(
        msa_row_attention_with_pair_bias=row_attention, msa_transition=transition)


class MSATransition(hk.Module):
    """AF2's `modules.Transition` (Algorithm 9), same parameter names."""

    def __init__(self, config, global_config, name: str = "msa_transition"):
        super().__init__(name=name)
        self.config = config
        self.global_config = global_config

    def __call__(self, act, mask, is_training: bool = False):
        del mask, is_training
        channels = act.shape[-1]
        hidden = int(channels * self.config.num_intermediate_factor)
        act = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=1e-5,
                           name="input_layer_norm")(act)

        def linear(x, n_out, name, init):  # AF2's common_modules.Linear: "weights", "bias"
            with hk.name_scope(name):
                w = hk.get_parameter("weights", (x.shape[-1], n_out), x.dtype, init=init)
                b = hk.get_parameter("bias", (n_out,), x.dtype, init=jnp.zeros)
            return x @ w + b

        relu_init = hk.initializers.VarianceScaling(2.0, "fan_in", "truncated_normal")
        final_init = (jnp.zeros if self.global_config.zero_init
                      else hk.initializers.VarianceScaling(1.0, "fan_in", "truncated_normal"))
        act = jax.nn.relu(linear(act, hidden, "transition1", relu_init))
        return linear(act, channels, "transition2", final_init)


class EvoformerBlock(hk.Module):
    """MSA row attention with pair bias and an MSA transition, residual (AF2 order)."""

    def __init__(self, config, global_config, name: str = "evoformer_iteration",
                 implementation: str | None = None):
        super().__init__(name=name)
        self.config = config
        self.global_config = global_config
        self.implementation = implementation

    def __call__(self, msa_act, msa_mask, pair_act, is_training: bool = False):
        c, gc = self.config, self.global_config
        row_attention = MSARowAttentionWithPairBias(
            c.msa_row_attention_with_pair_bias, gc, implementation=self.implementation)
        update = row_attention(msa_act, msa_mask, pair_act, is_training=is_training)
        if is_training:  # AF2's dropout_wrapper: one mask shared by all MSA rows
            rate = c.msa_row_attention_with_pair_bias.dropout_rate
            keep = jax.random.bernoulli(hk.next_rng_key(), 1.0 - rate, (1, *update.shape[1:]))
            update = update * keep / (1.0 - rate)
        msa_act = msa_act + update
        msa_act = msa_act + MSATransition(c.msa_transition, gc)(msa_act, msa_mask, is_training)
        return msa_act


def make_block(config, global_config, implementation=None) -> hk.Transformed:
    """One Evoformer block under AF2's module path."""
    def block(msa_act, msa_mask, pair_act, is_training=False):
        with hk.name_scope(EVOFORMER_SCOPE):
            return EvoformerBlock(config, global_config, implementation=implementation)(
                msa_act, msa_mask, pair_act, is_training)
    return hk.transform(block)


def evoformer_stack(block: hk.Transformed, stacked_params, msa_act, msa_mask, pair_act):
    """Applies the blocks in turn; `stacked_params` has a leading block axis (as AF2)."""
    def body(msa, layer_params):
        return block.apply(layer_params, None, msa, msa_mask, pair_act), None
    msa_act, _ = jax.lax.scan(body, msa_act, stacked_params)
    return msa_act


def haiku_to_flat(params) -> dict[str, np.ndarray]:
    """Haiku params -> AF2's npz naming `{"module/path//name": array}`."""
    return {f"{scope}//{name}": np.asarray(value)
            for scope, group in params.items() for name, value in group.items()}


def flat_params_to_haiku(flat) -> dict:
    """AF2's `utils.flat_params_to_haiku`: split each key at `//` into scope and name."""
    params = {}
    for path, array in flat.items():
        scope, name = path.split("//")
        params.setdefault(scope, {})[name] = jnp.asarray(array)
    return params


def main(blocks: int = 2, seqs: int = 16, res: int = 32, msa_channel: int = 64,
         pair_channel: int = 32, num_head: int = 8, implementation: str | None = None,
         seed: int = 0, verbose: bool = True):
    """Builds, saves, reloads and runs the stack; returns (output, loaded params, inputs)."""
    config = af2_config(num_head)
    # zero_init=False: random output projections, so the blocks do something.
    global_config = types.SimpleNamespace(zero_init=False)
    block = make_block(config, global_config, implementation)

    k_msa, k_pair, k_mask, k_init = jax.random.split(jax.random.key(seed), 4)
    msa_act = jax.random.normal(k_msa, (seqs, res, msa_channel))
    pair_act = jax.random.normal(k_pair, (res, res, pair_channel))
    msa_mask = (jax.random.uniform(k_mask, (seqs, res)) > 0.1).astype(jnp.float32)
    msa_mask = msa_mask.at[-1].set(0.0)  # a padding row, fully masked (as AF2 pads the MSA)

    # Random AF2-format parameters, one set per block, stacked on a leading axis.
    keys = jax.random.split(k_init, blocks)
    init = jax.jit(jax.vmap(block.init, in_axes=(0, None, None, None)))
    stacked = init(keys, msa_act, msa_mask, pair_act)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "params_model_evoformer_demo.npz")
        np.savez(path, **haiku_to_flat(stacked))
        flat = dict(np.load(path))
        loaded = flat_params_to_haiku(flat)

    if verbose:
        key = (f"{EVOFORMER_SCOPE}/evoformer_iteration/"
               "msa_row_attention_with_pair_bias/attention//query_w")
        print(f"{len(flat)} arrays in the npz, e.g. {key!r}: {flat[key].shape}")

    run = jax.jit(lambda p, m, mask, z: evoformer_stack(block, p, m, mask, z))
    start = time.perf_counter()
    out = jax.block_until_ready(run(loaded, msa_act, msa_mask, pair_act))
    if verbose:
        print(f"evoformer stack of {blocks} blocks: msa_act {msa_act.shape} -> {out.shape} "
              f"{out.dtype} ({time.perf_counter() - start:.2f} s incl. compile, "
              f"backend {jax.default_backend()})")
    return out, loaded, (msa_act, msa_mask, pair_act)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--res", type=int, default=32)
    parser.add_argument("--implementation", choices=("pallas", "xla"), default=None)
    args = parser.parse_args()
    main(args.blocks, args.seqs, args.res, implementation=args.implementation)
