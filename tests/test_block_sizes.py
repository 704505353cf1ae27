"""Tile choice: KernelTiles validation, clipping to N, the default heuristic."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from msa_pallas.block_sizes import (
    BlockConfig,
    KernelTiles,
    default_block_config,
    next_power_of_2,
    padded_head_dim,
)

POWERS = (16, 32, 64, 128, 256)


@pytest.mark.parametrize("bad", [0, 1, 8, 15, 24, 48, 100, -16])
@pytest.mark.parametrize("field", ["block_q", "block_k"])
def test_tiles_reject_bad_sizes(field, bad):
    kwargs = dict(block_q=32, block_k=32)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=f"{field}={bad}; expected a power of two >= 16"):
        KernelTiles(**kwargs)


@pytest.mark.parametrize("q, k", [(16, 16), (16, 128), (64, 32), (256, 16)])
def test_tiles_accept_powers_of_two(q, k):
    tiles = KernelTiles(q, k)
    assert (tiles.block_q, tiles.block_k) == (q, k)


def test_tiles_reject_bad_launch_parameters():
    with pytest.raises(ValueError, match="num_warps=3"):
        KernelTiles(32, 32, num_warps=3)
    with pytest.raises(ValueError, match="num_stages=0"):
        KernelTiles(32, 32, num_stages=0)


@pytest.mark.parametrize("n_res", [1, 2, 5, 16, 17, 37, 64, 100, 128, 129, 1000, 4096])
def test_clipped_caps_at_next_power_of_two(n_res):
    cap = max(16, next_power_of_2(n_res))
    for q in POWERS:
        for k in POWERS:
            tiles = KernelTiles(q, k, num_warps=8, num_stages=3).clipped(n_res)
            assert tiles.block_q == min(q, cap) and tiles.block_k == min(k, cap)
            assert (tiles.num_warps, tiles.num_stages) == (8, 3)  # untouched


def test_block_config_clipped_clips_every_kernel():
    big = KernelTiles(128, 128)
    config = BlockConfig(big, big, big, KernelTiles(16, 128)).clipped(37)
    for f in dataclasses.fields(config):
        tiles = getattr(config, f.name)
        assert tiles.block_q <= 64 and tiles.block_k <= 64, f.name
    assert config.backward_dbias.block_q == 16
    hash(config)  # a static argument of jit / custom_vjp


def test_next_power_of_2():
    assert [next_power_of_2(x) for x in (0, 1, 2, 3, 4, 5, 17, 1000, 1024, 1025)] == [
        1, 1, 2, 4, 4, 8, 32, 1024, 1024, 2048,
    ]


@pytest.mark.parametrize(
    "d, expected",
    [(1, 16), (8, 16), (15, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (65, 128), (100, 128), (128, 128)],
)
def test_padded_head_dim(d, expected):
    assert padded_head_dim(d) == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("n_res", [1, 5, 37, 256, 1000, 4096])
def test_default_block_config_is_valid(n_res, head_dim, dtype):
    config = default_block_config(n_res, head_dim, dtype)
    assert isinstance(config, BlockConfig)
    cap = max(16, next_power_of_2(n_res))
    for f in dataclasses.fields(config):
        tiles = getattr(config, f.name)
        assert isinstance(tiles, KernelTiles), f.name
        for side in (tiles.block_q, tiles.block_k):
            assert side >= 16 and side == next_power_of_2(side), (f.name, tiles)
            assert side <= min(cap, 128), (f.name, tiles)  # tiles along N are in [16, 128]
        assert tiles.num_warps in (1, 2, 4, 8, 16) and tiles.num_stages >= 1
    assert config.clipped(n_res) == config  # already clipped
    hash(config)
