"""Optional autotuner: time candidate tiles on this GPU and cache the winners.

`default_block_config` is a table that needs no tuning run. Where a shape
matters enough, `autotune` times each kernel (forward, dk/dv, dq, dbias, and for N <= 512
the fused dq+dbias kernel, kept only where it beats dq plus dbias) with
every candidate `KernelTiles` on random inputs of the given shape, keeps the
fastest per kernel, and stores the result in a JSON file so later calls (and
later processes) reuse it without timing::

    config = msa_pallas.autotune.autotune((1, 512, 1024, 8, 32), jnp.bfloat16)
    out = msa_pallas.msa_row_attention(q, k, v, bias, mask, block_config=config)

The cache lives in `$MSA_PALLAS_CACHE_DIR` or `~/.cache/msa_pallas`
(`autotune.json`), keyed by device, jax version, shape, dtype and whether a
mask and a gate are used. Without a GPU the kernels run in interpret mode,
so the timings say nothing about GPU speed; that mode exists for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp

from msa_pallas.attention import on_gpu
from msa_pallas.block_sizes import (
    MAX_FUSED_KEYS, BlockConfig, KernelTiles, default_block_config,
)
from msa_pallas.kernels.triton import backward
from msa_pallas.kernels.triton.forward import attention_forward
from msa_pallas.timing import batched_times_ms

CACHE_FILE = "autotune.json"

# Candidates per kernel, from the tile sweep recorded in benchmarks/RESULTS.md.
DEFAULT_CANDIDATES: dict[str, tuple[KernelTiles, ...]] = {
    "forward": (
        KernelTiles(64, 64, 4, 2), KernelTiles(64, 64, 4, 3), KernelTiles(128, 64, 4, 3),
        KernelTiles(128, 32, 4, 3), KernelTiles(64, 32, 4, 2), KernelTiles(128, 64, 8, 2),
    ),
    # 1-stage candidates: float32 (3xTF32) products run best unpipelined.
    "backward_dkdv": (
        KernelTiles(32, 64, 4, 2), KernelTiles(64, 64, 4, 3), KernelTiles(128, 64, 4, 3),
        KernelTiles(64, 128, 4, 3), KernelTiles(32, 128, 4, 2), KernelTiles(64, 64, 4, 1),
        KernelTiles(32, 64, 4, 1),
    ),
    "backward_dq": (
        KernelTiles(64, 32, 4, 2), KernelTiles(64, 64, 4, 3), KernelTiles(128, 64, 8, 2),
        KernelTiles(128, 32, 4, 2), KernelTiles(64, 32, 4, 1),
    ),
    "backward_dbias": (
        KernelTiles(64, 64, 4, 3), KernelTiles(64, 64, 4, 2), KernelTiles(128, 64, 8, 3),
        KernelTiles(64, 128, 4, 2), KernelTiles(32, 32, 4, 2), KernelTiles(64, 64, 4, 1),
    ),
    # block_k is clipped to N rounded up to a power of two: all keys in one tile.
    "backward_dq_dbias": (
        KernelTiles(16, MAX_FUSED_KEYS, 4, 2), KernelTiles(16, MAX_FUSED_KEYS, 4, 3),
        KernelTiles(16, MAX_FUSED_KEYS, 8, 2),
    ),
}


def cache_dir() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("MSA_PALLAS_CACHE_DIR", pathlib.Path.home() / ".cache" / "msa_pallas")
    )


def cache_key(shape, dtype, has_mask: bool, has_gate: bool) -> str:
    device = jax.devices()[0].device_kind
    shape_text = "x".join(str(s) for s in shape)
    return (
        f"{device}|jax {jax.__version__}|{shape_text}|{jnp.dtype(dtype).name}"
        f"|mask={has_mask}|gate={has_gate}"
    )


def _read_cache(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _config_from_json(entry: dict) -> BlockConfig:
    return BlockConfig(**{
        name: None if tiles is None else KernelTiles(**tiles) for name, tiles in entry.items()
    })


def _median_ms(fn, iters: int, reps: int) -> float:
    jax.block_until_ready(fn())  # compile
    jax.block_until_ready(fn())
    return statistics.median(batched_times_ms(lambda i: fn(), samples=iters, reps=reps))


def _kernel_runners(shape, dtype, has_mask: bool, has_gate: bool, interpret: bool, seed: int):
    """One callable per kernel, taking KernelTiles, on fresh random inputs."""
    batch, rows, n_res, heads, head_dim = shape
    keys = jax.random.split(jax.random.key(seed), 7)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[:4])
    bias = jax.random.normal(keys[4], (batch, heads, n_res, n_res), jnp.float32)
    mask = (
        jax.random.bernoulli(keys[5], 0.9, (batch, rows, n_res)).astype(jnp.int8)
        if has_mask else None
    )
    gate = jax.random.normal(keys[6], shape, jnp.float32).astype(dtype) if has_gate else None
    scale = 1.0 / math.sqrt(head_dim)
    reference_tiles = default_block_config(n_res, head_dim, dtype).forward
    _, attention, row_max, row_log2_sum = attention_forward(
        q, k, v, bias, mask, gate,
        scale=scale, tiles=reference_tiles, interpret=interpret, save_stats=True,
    )
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * attention, axis=-1), 2, 3)
    operands = (q, k, v, bias, mask, do, row_max, row_log2_sum, delta)

    def forward(tiles):
        return attention_forward(
            q, k, v, bias, mask, gate,
            scale=scale, tiles=tiles, interpret=interpret, save_stats=True,
        )

    def backward_kernel(kernel):
        return lambda tiles: kernel(*operands, scale=scale, tiles=tiles, interpret=interpret)

    runners = {
        "forward": forward,
        "backward_dkdv": backward_kernel(backward.backward_dkdv),
        "backward_dq": backward_kernel(backward.backward_dq),
        "backward_dbias": backward_kernel(backward.backward_dbias),
    }
    if n_res <= MAX_FUSED_KEYS:
        runners["backward_dq_dbias"] = backward_kernel(backward.backward_dq_dbias)
    return runners


def autotune(
    shape: tuple[int, int, int, int, int],
    dtype,
    *,
    has_mask: bool = True,
    has_gate: bool = False,
    candidates: dict[str, tuple[KernelTiles, ...]] | None = None,
    iters: int = 10,
    reps: int = 5,
    use_cache: bool = True,
    seed: int = 0,
    verbose: bool = False,
    timer: Callable[[str, KernelTiles, Callable[[], Any]], float] | None = None,
) -> BlockConfig:
    """The fastest tiles of each kernel for one problem, timed on this device.

    Args:
      shape: `(B, S, N, H, d)` of q (leading batch dims flattened into B).
      dtype: q's dtype.
      has_mask, has_gate: whether calls pass a mask / a gate.
      candidates: per kernel name (`"forward"`, `"backward_dkdv"`,
        `"backward_dq"`, `"backward_dbias"`, `"backward_dq_dbias"`), the tiles
        to try; default `DEFAULT_CANDIDATES`. Tiles are clipped to N first;
        candidates that fail to compile are skipped.
      iters: timed samples per candidate (median); a sample is `reps`
        back-to-back calls, so the host's dispatch latency stays out of it.
      reps: calls per sample.
      use_cache: read and write `cache_dir() / "autotune.json"`.
      seed: for the random inputs.
      verbose: print each timing.
      timer: how one candidate is timed: `timer(kernel_name, tiles, run)`
        returns milliseconds, where `run()` launches the kernel once with
        those tiles. None: the median of `iters` samples of `reps` calls.
        For tests, or to time with a profiler.

    Returns:
      A `BlockConfig` to pass as `block_config=`.
    """
    if len(shape) != 5:
        raise ValueError(f"shape={shape}; expected (B, S, N, H, d).")
    shape = tuple(int(s) for s in shape)
    path = cache_dir() / CACHE_FILE
    key = cache_key(shape, dtype, has_mask, has_gate)
    if use_cache and key in (cached := _read_cache(path)):
        return _config_from_json(cached[key])

    n_res = shape[2]
    runners = _kernel_runners(shape, dtype, has_mask, has_gate, not on_gpu(), seed)
    candidates = candidates or DEFAULT_CANDIDATES
    if timer is None:
        timer = lambda name, tiles, run: _median_ms(run, iters, reps)
    best, best_ms = {}, {}
    for name, run in runners.items():
        timings = {}
        for tiles in dict.fromkeys(t.clipped(n_res) for t in candidates[name]):
            try:
                timings[tiles] = float(timer(name, tiles, functools.partial(run, tiles)))
            except Exception as error:  # a tile the compiler rejects is no candidate
                if verbose:
                    print(f"{name} {tiles}: skipped ({type(error).__name__})")
                continue
            if verbose:
                print(f"{name} {tiles}: {timings[tiles]:.3f} ms")
        if not timings:
            raise RuntimeError(f"autotune: no candidate of {name} compiled for shape {shape}.")
        best[name] = min(timings, key=timings.get)
        best_ms[name] = timings[best[name]]
    # The fused dq+dbias kernel replaces the two only where it is faster.
    fused_ms = best_ms.pop("backward_dq_dbias", math.inf)
    if fused_ms >= best_ms["backward_dq"] + best_ms["backward_dbias"]:
        best["backward_dq_dbias"] = None
    config = BlockConfig(**best)

    if use_cache:
        cached = _read_cache(path)
        cached[key] = {
            name: None if tiles is None else dataclasses.asdict(tiles)
            for name, tiles in best.items()
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent tuners never leave a torn file
    return config
