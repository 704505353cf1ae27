"""Tile choice: KernelTiles validation, clipping to N, the default heuristic."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from msa_pallas.block_sizes import (
    MAX_FUSED_KEYS,
    MAX_ROW_CHUNKS,
    TRITON_KERNELS,
    BlockConfig,
    KernelTiles,
    default_block_config,
    next_power_of_2,
    padded_head_dim,
    row_chunks,
    row_chunks_in_waves,
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
    config = BlockConfig(big, big, big, KernelTiles(16, 128), KernelTiles(16, 512)).clipped(37)
    for name in TRITON_KERNELS:
        tiles = getattr(config, name)
        assert tiles.block_q <= 64 and tiles.block_k <= 64, name
    assert config.backward_dbias.block_q == 16
    assert config.fuses_dq_dbias(37)
    hash(config)  # a static argument of jit / custom_vjp
    unfused = BlockConfig(big, big, big, big)
    assert unfused.backward_dq_dbias is None and unfused.clipped(37).backward_dq_dbias is None


def test_fused_dq_dbias_needs_every_key_in_one_tile():
    config = BlockConfig(*(KernelTiles(32, 32),) * 4, backward_dq_dbias=KernelTiles(16, 64))
    assert config.fuses_dq_dbias(64) and config.fuses_dq_dbias(40)
    assert not config.fuses_dq_dbias(65)
    assert not BlockConfig(*(KernelTiles(32, 32),) * 4).fuses_dq_dbias(16)


@pytest.mark.parametrize(
    "programs, rows, expected",
    [
        (128, 128, 4),  # train: 16 query tiles x 8 heads -> 4 chunks of 32 rows
        (2048, 512, 1),  # enough programs already
        (192, 512, 4),  # 3 chunks wanted; 4 is the next divisor of 512
        (16, 8, 8),  # capped at S
        (1, 1024, 16),  # capped at MAX_ROW_CHUNKS
        (100, 131, 1),  # S prime and > MAX_ROW_CHUNKS: no split
        (200, 9, 3),  # 3 wanted, divides 9
        (120, 10, 5),  # 5 wanted, divides 10
        (100, 7, 7),  # 6 wanted; 7 (= S) is the next divisor
    ],
)
def test_row_chunks(programs, rows, expected):
    chunks = row_chunks(programs, rows)
    assert chunks == expected
    assert rows % chunks == 0 and 1 <= chunks <= MAX_ROW_CHUNKS


@pytest.mark.parametrize(
    "programs, rows, slots, expected",
    [
        (32, 128, 132, 4),  # train: one wave of 128 CTAs; row_chunks takes 16 (four waves)
        (72, 512, 132, 7),  # finetune: 4 waves of 73-74 rows; row_chunks' 8, 5 of 64
        (36, 1024, 132, 11),  # extra MSA: 3 whole waves of 93-94 rows; 16, 5 of 64
        (144, 768, 132, 4),  # triangle attention at N = 768: 5 waves of 192 rows
        (512, 512, 132, 1),  # long: enough programs already
        (32, 128, 100, 3),  # 100 SMs: one wave of 42-43 rows beats 3 of 16 (8) and 2 of 32 (4)
        (2, 34, 132, 2),  # S = 2 x 17: 17 is above MAX_ROW_CHUNKS
        (36, 384, 132, 11),  # triangle attention at N = 384: 3 waves of 34-35 rows
    ],
)
def test_row_chunks_in_waves(programs, rows, slots, expected):
    chunks = row_chunks_in_waves(programs, rows, slots)
    assert chunks == expected
    assert chunks <= row_chunks(programs, rows)


@pytest.mark.parametrize("slots", [8, 100, 132])
@pytest.mark.parametrize("rows", [1, 7, 24, 128, 130, 512])
@pytest.mark.parametrize("programs", [1, 3, 32, 72, 144, 600])
def test_row_chunks_in_waves_take_the_fewest_row_steps(programs, rows, slots):
    """Against every other count up to row_chunks': no fewer row steps, and
    none as few with fewer chunks."""
    def row_steps(chunks):
        return -(-programs * chunks // slots) * -(-rows // chunks)

    chosen = row_chunks_in_waves(programs, rows, slots)
    for other in range(1, row_chunks(programs, rows) + 1):
        assert row_steps(chosen) <= row_steps(other)
        if other < chosen:
            assert row_steps(chosen) < row_steps(other)


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


@pytest.mark.parametrize("bias_dtype", [None, jnp.float32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("n_res", [1, 5, 37, 256, 1000, 4096])
def test_default_block_config_is_valid(n_res, head_dim, dtype, bias_dtype):
    config = default_block_config(n_res, head_dim, dtype, bias_dtype)
    assert isinstance(config, BlockConfig)
    cap = max(16, next_power_of_2(n_res))
    assert config.mosaic_forward is None  # the op sets it for implementation="mosaic"
    for name in TRITON_KERNELS:
        tiles = getattr(config, name)
        if name == "backward_dq_dbias":
            # 16-bit inputs with 16 < d <= 64 (padded 32 or 64) and N <= 512
            # only: one key tile of all N. With d <= 16 the fused kernel is
            # many times slower than dq + dbias (the extra-MSA stack).
            fused = (jnp.dtype(dtype).itemsize == 2 and 16 < head_dim <= 64
                     and n_res <= MAX_FUSED_KEYS)
            assert (tiles is not None) == fused, tiles
            assert config.fuses_dq_dbias(n_res) == fused
            if tiles is None:
                continue
            assert tiles.block_k == cap, tiles
        else:
            assert isinstance(tiles, KernelTiles), name
            assert max(tiles.block_q, tiles.block_k) <= min(cap, 128), (name, tiles)
        for side in (tiles.block_q, tiles.block_k):
            assert side >= 16 and side == next_power_of_2(side), (name, tiles)
        assert tiles.num_warps in (1, 2, 4, 8, 16) and tiles.num_stages >= 1
        assert tiles.msa_rows >= 1
    assert config.clipped(n_res) == config  # already clipped
    hash(config)


def test_extra_msa_stack_never_fuses_dq_dbias():
    # The extra-MSA stack (d=8) ran the fused dq+dbias kernel 30-50x slower
    # than the two kernels: the default must not pick it, for any bias dtype.
    for bias_dtype in (None, jnp.float32, jnp.bfloat16):
        config = default_block_config(384, 8, jnp.bfloat16, bias_dtype)
        assert not config.fuses_dq_dbias(384)


def test_wide_bias_gets_its_own_tiles():
    # A float32 bias with 16-bit inputs: 64x32 dbias tiles at every N (with
    # d >= 32), and at N <= 256 two MSA rows per dk/dv program; a 16-bit bias
    # keeps the 64x64 dbias tile at N <= 256.
    for n_res in (256, 384, 1024):
        wide = default_block_config(n_res, 32, jnp.bfloat16, jnp.float32)
        assert (wide.backward_dbias.block_q, wide.backward_dbias.block_k) == (64, 32)
    narrow = default_block_config(256, 32, jnp.bfloat16)
    wide = default_block_config(256, 32, jnp.bfloat16, jnp.float32)
    assert (narrow.backward_dbias.block_q, narrow.backward_dbias.block_k) == (64, 64)
    assert wide.backward_dkdv.msa_rows == 2 and narrow.backward_dkdv.msa_rows == 1
    # The bias as wide as q (or narrower) is no wide bias.
    assert default_block_config(1024, 32, jnp.bfloat16, jnp.bfloat16) == (
        default_block_config(1024, 32, jnp.bfloat16))
    assert default_block_config(256, 32, jnp.float32, jnp.float32) == (
        default_block_config(256, 32, jnp.float32))


@pytest.mark.parametrize("limit, rows, expected", [(1, 7, 1), (2, 8, 2), (4, 6, 3), (4, 5, 1), (3, 2, 2)])
def test_msa_rows_per_program_divides_s(limit, rows, expected):
    assert KernelTiles(16, 16, msa_rows=limit).msa_rows_for(rows) == expected


def test_msa_rows_must_be_positive():
    with pytest.raises(ValueError, match="msa_rows"):
        KernelTiles(16, 16, msa_rows=0)
