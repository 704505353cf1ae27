"""Attention dropout's random bits: a counter-based hash of each attention
weight's coordinates, one definition for the XLA path and every kernel.

Whether the weight of query i on key j in MSA row s, head h, batch element b
is kept depends on the PRNG key and on (b, s, h, i, j) alone: not on tile
sizes, on the order the kernels visit tiles, on the backend, or on how many
devices share the call. So the backward kernels regenerate exactly the
forward's mask without storing it, and the XLA path draws the same mask.

The construction, all in uint32 arithmetic (wrapping):

- one seed per (b, s, h) from the key: `row_seeds` (`jax.random.bits`,
  computed once per call in XLA; the kernels read one scalar per row);
- a word per query index and one per key index, each a full-avalanche hash
  (MurmurHash3's 32-bit finaliser) of the seed and the index:
  `query_words`, `key_words` (vectors of a tile's length: cheap);
- per weight, the two words XORed and multiplied by an odd constant (the
  first multiplier of Wellons's `lowbias32`), the weight kept where the
  product is at least `keep_threshold(rate)`: `keeps`.

Per weight that is an XOR, a multiply and a compare, beside the softmax's
own work: the part of the hash a kernel evaluates N x N times is kept to
what the statistics need, the rest runs on vectors of a tile's length. The
XOR alone would not do: its top bits over a 2 x 2 block of weights XOR to
zero, so kept weights would come in rectangles; the multiply's carries mix
every bit of the XOR into the top ones (tests/test_dropout.py checks the
joint law of 2 x 2 blocks against independent draws).

The keep probability is `1 - threshold / 2**32`, the rate rounded to a
multiple of 2**-32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "row_seeds", "keep_threshold", "query_words", "key_words", "keeps", "keep_mask",
    "check_kernel_arguments",
]

_QUERY_SALT = np.uint32(0x243F6A88)  # distinct salts: query and key words differ
_KEY_SALT = np.uint32(0x85A308D3)


def _shift_right(x, bits: int):
    # `>>` on uint32 is the logical shift, in jnp and in the kernels' lowerings.
    return x >> np.uint32(bits)


def _finalise(x):
    """MurmurHash3's fmix32: a bijection of uint32 with full avalanche."""
    x = x ^ _shift_right(x, 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ _shift_right(x, 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ _shift_right(x, 16)


def _word(seed, index, salt):
    return _finalise(_finalise(seed ^ salt) + index)


def query_words(seed, index):
    """The word of each query index: uint32, `seed`'s and `index`'s broadcast
    shape. `seed`: uint32 (one row's seed, or seeds broadcast against
    `index`); `index`: uint32 query positions i in [0, N)."""
    return _word(seed, index, _QUERY_SALT)


def key_words(seed, index):
    """The word of each key index j: as `query_words`."""
    return _word(seed, index, _KEY_SALT)


def keeps(query_word, key_word, threshold):
    """Whether each weight is kept: bool, the broadcast shape of the words.

    `query_word`, `key_word`: uint32 from `query_words` / `key_words` of the
    same row's seed, broadcast to the weights' shape (either orientation: the
    XOR is symmetric). `threshold`: `keep_threshold(rate)` as a uint32 (a
    NumPy scalar, or an array of the words' shape where a backend needs it).
    """
    return (query_word ^ key_word) * np.uint32(0x7FEB352D) >= threshold


def keep_threshold(rate: float) -> np.uint32:
    """The uint32 threshold for dropout `rate` in [0, 1): a weight is kept
    where its hash is at least this, so with probability
    `1 - threshold / 2**32` (the rate rounded to a multiple of 2**-32)."""
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate!r}; expected a float in [0, 1).")
    return np.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def row_seeds(key: jax.Array, batch: int, rows: int, heads: int) -> jax.Array:
    """One uint32 seed per (b, s, h): `[B, S, H]`, drawn from `key` (a typed
    PRNG key or a raw uint32 key). Drawn on the call's global shape, so a
    sharded call's devices read slices of the one unsharded draw."""
    return jax.random.bits(key, (batch, rows, heads), jnp.uint32)


def keep_mask(seeds: jax.Array, n_res: int, rate: float) -> jax.Array:
    """The whole mask, for the XLA path and for tests: bool
    `[B, S, H, N, N]` (query i, key j last) from `seeds` `[B, S, H]` uint32.
    Materialises B·S·H·N² words: the kernels never do this."""
    positions = jnp.arange(n_res, dtype=jnp.uint32)
    seed = seeds[..., None]
    query = query_words(seed, positions)[..., :, None]
    key = key_words(seed, positions)[..., None, :]
    return keeps(query, key, keep_threshold(rate))


def check_kernel_arguments(dropout_seeds, dropout_rate: float, q_shape) -> bool:
    """Whether a kernel call drops weights, after checking its dropout
    arguments (every backend's kernels): the rate is in [0, 1); a positive
    rate needs `dropout_seeds`, uint32 `[B, S, H]` of q's `[B, S, N, H, d]`
    `q_shape`."""
    keep_threshold(dropout_rate)  # checks the rate
    if float(dropout_rate) == 0.0:
        return False
    if dropout_seeds is None:
        raise ValueError(
            f"dropout_rate={dropout_rate!r} needs dropout_seeds (uint32 [B, S, H]); got None."
        )
    expected = (q_shape[0], q_shape[1], q_shape[3])
    if tuple(dropout_seeds.shape) != expected or dropout_seeds.dtype != jnp.uint32:
        raise ValueError(
            f"dropout_seeds has shape {tuple(dropout_seeds.shape)} and dtype "
            f"{dropout_seeds.dtype}; expected uint32 [B, S, H] (for q {tuple(q_shape)}: "
            f"expected {expected})."
        )
    return True
