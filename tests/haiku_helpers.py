"""Shared pieces of the Haiku tests (tests/layers/test_haiku.py, test_haiku_params.py).

Imported only after `pytest.importorskip("haiku")`: it imports Haiku.
"""

from __future__ import annotations

import pathlib
import types

import haiku as hk
import jax.numpy as jnp
import numpy as np

from af2_numpy_reference import random_msa_inputs
from msa_pallas.haiku import MSARowAttentionWithPairBias

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCOPE = "msa_row_attention_with_pair_bias"
TOL = 1e-5


def configs(num_head=8, gating=True, zero_init=True, **extra):
    return (types.SimpleNamespace(num_head=num_head, gating=gating, orientation="per_row",
                                  dropout_rate=0.15, shared_dropout=True, **extra),
            types.SimpleNamespace(zero_init=zero_init, subbatch_size=4))


def transformed(config, global_config, **kwargs) -> hk.Transformed:
    kwargs.setdefault("implementation", "xla")

    def forward(msa_act, msa_mask, pair_act, is_training=False):
        module = MSARowAttentionWithPairBias(config, global_config, **kwargs)
        return module(msa_act, msa_mask, pair_act, is_training=is_training)

    return hk.transform(forward)


def dummy_inputs(S, N, c_m, c_z, dtype=jnp.float32):
    return (jnp.ones((S, N, c_m), dtype), jnp.ones((S, N), jnp.float32),
            jnp.ones((N, N, c_z), dtype))


def masked_case(rng, S=6, N=21, c_m=32, c_z=16):
    """AF2-style float 0/1 mask: row 1 fully masked, row 2 partly, the rest keep a key."""
    m, z, mask = random_msa_inputs(rng, (), S, N, c_m, c_z)
    mask[1] = False
    mask[2] = np.arange(N) % 3 == 0
    assert mask[2].any() and not mask[2].all()
    return m, z, mask.astype(np.float32)
