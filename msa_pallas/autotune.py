"""Optional autotuner: time candidate tiles on this GPU and cache the winners.

`default_block_config` is a table that needs no tuning run. Where a shape
matters enough, `autotune` times each kernel (forward, dk/dv, dq, dbias, and for N <= 512
the fused dq+dbias kernel, kept only where it beats dq plus dbias) with
every candidate `KernelTiles` on random inputs of the given shape, keeps the
fastest per kernel, and stores the result in a JSON file so later calls (and
later processes) reuse it without timing. Where `implementation=None` runs the
Mosaic GPU kernels (Hopper), it tunes their tiles too (`mosaic_candidates`: each
kernel's own default choice and its neighbours; the forward for 16-bit
inputs only, as float32 runs the Triton forward)::

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

from msa_pallas.block_sizes import (
    MAX_FUSED_KEYS, BlockConfig, KernelTiles, MosaicBackwardTiles, MosaicTiles,
    default_block_config,
)
from msa_pallas.dispatch import current_target, plan_call
from msa_pallas.kernels.mosaic import backward as mosaic_backward
from msa_pallas.kernels.mosaic import forward as mosaic_forward
from msa_pallas.kernels.mosaic.support import pad_head_dim
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


# The Mosaic GPU kernels the autotuner times, by the names of their timings.
MOSAIC_KERNELS = ("mosaic_forward", "mosaic_dkdv", "mosaic_dq", "mosaic_dbias")


def cache_key(shape, dtype, has_mask: bool, has_gate: bool, mosaic: bool = False) -> str:
    device = jax.devices()[0].device_kind
    shape_text = "x".join(str(s) for s in shape)
    return (
        f"{device}|jax {jax.__version__}|{shape_text}|{jnp.dtype(dtype).name}"
        f"|mask={has_mask}|gate={has_gate}" + ("|mosaic" if mosaic else "")
    )


def _read_cache(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# Fields of `MosaicTiles` that choose how a kernel computes its results, not its tiles.
# Never tuned, they are not cached: an entry leaves them to the library's defaults of
# the day (one written before `mask_without_select` became the default would otherwise
# keep the select it no longer takes).
UNTUNED_FIELDS = ("staggered_bias", "mask_without_select")


def _tiles_from_json(cls, entry: dict):
    """`cls(**entry)` with the tuned fields `cls` has (an entry may predate a
    field's removal, or hold an `UNTUNED_FIELDS` value)."""
    names = {field.name for field in dataclasses.fields(cls)} - set(UNTUNED_FIELDS)
    return cls(**{name: value for name, value in entry.items() if name in names})


def _tiles_to_json(tiles) -> dict:
    """The tuned fields of `tiles` (`KernelTiles` or `MosaicTiles`)."""
    return {name: value for name, value in dataclasses.asdict(tiles).items()
            if name not in UNTUNED_FIELDS}


def _config_from_json(entry: dict) -> BlockConfig:
    fields = {}
    for name, tiles in entry.items():
        if tiles is None:
            fields[name] = None
        elif name == "mosaic_forward":
            fields[name] = _tiles_from_json(MosaicTiles, tiles)
        elif name == "mosaic_backward":
            fields[name] = MosaicBackwardTiles(
                **{kernel: _tiles_from_json(MosaicTiles, tiles[kernel])
                   for kernel in ("dkdv", "dq", "dbias")},
                ping_pong=tiles["ping_pong"],
            )
        else:
            fields[name] = KernelTiles(**tiles)
    return BlockConfig(**fields)


def _config_to_json(config: BlockConfig) -> dict:
    entry = {}
    for field in dataclasses.fields(config):
        tiles = getattr(config, field.name)
        if field.name == "mosaic_backward" and tiles is not None:
            entry[field.name] = {
                kernel: _tiles_to_json(getattr(tiles, kernel))
                for kernel in ("dkdv", "dq", "dbias")
            } | {"ping_pong": tiles.ping_pong}
        else:
            entry[field.name] = None if tiles is None else _tiles_to_json(tiles)
    return entry


def _neighbours(tiles: MosaicTiles, *, persistent: bool) -> list[MosaicTiles]:
    """`tiles` and the tiles one step from it along each of its choices
    (query and key tile, pipeline depth, MSA rows per CTA, and for the
    forward the persistent grid); choices `MosaicTiles` rejects are left out."""
    changes = [
        {"block_q": 192 - tiles.block_q},  # the other of 64 and 128
        # Halved and doubled: the dk/dv kernel fails at block_k = 192 (`plan.DKDV_BLOCK_K`).
        {"block_k": tiles.block_k // 2}, {"block_k": tiles.block_k * 2},
        {"num_stages": tiles.num_stages + 1},
        {"msa_rows": 3 - tiles.msa_rows if tiles.msa_rows <= 2 else 2},
    ]
    if persistent:
        changes.append({"persistent": not tiles.persistent})
    found = [tiles]
    for change in changes:
        try:
            found.append(dataclasses.replace(tiles, **change))
        except ValueError:
            continue
    return list(dict.fromkeys(found))


def mosaic_candidates(
    shape, dtype, *, has_mask: bool = True, has_gate: bool = False
) -> dict[str, tuple[MosaicTiles, ...]]:
    """Candidate tiles per Mosaic GPU kernel (`MOSAIC_KERNELS`) for q of
    `shape` and `dtype` with a float32 bias: the kernels' own default choice
    (`default_tiles`, which picks what fits in shared memory) and its
    neighbours. A neighbour that does not fit fails to compile and is
    skipped by `autotune`. No persistent forward off a GPU (the Mosaic GPU
    interpreter stalls on it). No forward for float32 inputs (the Triton
    forward runs there)."""
    plan = _mosaic_plan(shape, dtype, has_mask, has_gate)
    interpret = plan.interpret
    candidates = {
        f"mosaic_{kernel}": tuple(_neighbours(tiles, persistent=False))
        for kernel, tiles in plan.backward_tiles
    }
    if plan.forward == "mosaic":
        candidates["mosaic_forward"] = tuple(
            _neighbours(plan.forward_tiles, persistent=not interpret)
        )
    return {name: candidates[name] for name in MOSAIC_KERNELS if name in candidates}


def _mosaic_plan(shape, dtype, has_mask, has_gate, implementation="mosaic"):
    """The op's plan for these inputs on this device, on the Mosaic kernels
    (head-dim padding, default tiles; no persistent forward interpreted) or
    on `implementation`."""
    batch, rows, n_res, heads, _ = shape
    q = jax.ShapeDtypeStruct(shape, dtype)
    return plan_call(
        q, q, q, jax.ShapeDtypeStruct((batch, heads, n_res, n_res), jnp.float32),
        jax.ShapeDtypeStruct((batch, rows, n_res), jnp.bool_) if has_mask else None,
        q if has_gate else None,
        implementation=implementation,
    )


def _median_ms(fn, iters: int, reps: int) -> float:
    jax.block_until_ready(fn())  # compile
    jax.block_until_ready(fn())
    return statistics.median(batched_times_ms(lambda i: fn(), samples=iters, reps=reps))


def _kernel_runners(
    shape, dtype, has_mask: bool, has_gate: bool, interpret: bool, seed: int, mosaic: bool
):
    """One callable per kernel, taking its tiles, on fresh random inputs
    (the Mosaic kernels' too where `mosaic`)."""
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
    if not mosaic:
        return runners

    # The Mosaic kernels on the same inputs and residuals, with d padded as
    # the op's plan pads it (either backward follows either forward).
    plan = _mosaic_plan(shape, dtype, has_mask, has_gate)
    def widen(x, width):
        return x if x is None or x.shape[-1] >= width else pad_head_dim(x)

    forward_in = [widen(x, plan.forward_head_dim) for x in (q, k, v, gate)]
    backward_in = [widen(x, plan.backward_head_dim) for x in (q, k, v, do)]
    stats = jnp.stack([row_max, row_log2_sum, delta], axis=3)

    def mosaic_forward_run(tiles):
        fq, fk, fv, fgate = forward_in
        return mosaic_forward.attention_forward(
            fq, fk, fv, bias, mask, fgate,
            scale=scale, tiles=tiles, interpret=interpret, save_stats=True,
        )

    def mosaic_backward_kernel(kernel, **extra):
        bq, bk, bv, bdo = backward_in
        return lambda tiles: kernel(
            bq, bk, bv, bias, mask, bdo, stats,
            scale=scale, tiles=tiles, interpret=interpret, **extra,
        )

    if plan.forward == "mosaic":
        runners["mosaic_forward"] = mosaic_forward_run
    runners["mosaic_dkdv"] = mosaic_backward_kernel(
        mosaic_backward.backward_dkdv, ping_pong=plan.ping_pong)
    runners["mosaic_dq"] = mosaic_backward_kernel(
        mosaic_backward.backward_dq, ping_pong=plan.ping_pong)
    runners["mosaic_dbias"] = mosaic_backward_kernel(mosaic_backward.backward_dbias)
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
    timer: Callable[[str, Any, Callable[[], Any]], float] | None = None,
    mosaic: bool | None = None,
) -> BlockConfig:
    """The fastest tiles of each kernel for one problem, timed on this device.

    Args:
      shape: `(B, S, N, H, d)` of q (leading batch dims flattened into B).
      dtype: q's dtype.
      has_mask, has_gate: whether calls pass a mask / a gate.
      candidates: per kernel name (`"forward"`, `"backward_dkdv"`,
        `"backward_dq"`, `"backward_dbias"`, `"backward_dq_dbias"`, and the
        Mosaic kernels' `MOSAIC_KERNELS`), the tiles to try; a kernel not
        named takes `DEFAULT_CANDIDATES` (`mosaic_candidates`). Triton tiles
        are clipped to N first; candidates that fail to compile (a Mosaic
        tile past shared memory among them) are skipped.
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
      mosaic: also tune the Mosaic GPU kernels' tiles (`mosaic_forward`,
        `mosaic_backward` of the result). None: where `implementation=None`
        runs them (`msa_pallas.dispatch`, with a float32 bias: on Hopper, at
        the shapes where they measured faster). True tunes them for
        `implementation="mosaic"` anywhere they take the shape; off a GPU they
        run in their interpreter (for tests).

    Returns:
      A `BlockConfig` to pass as `block_config=`.
    """
    if len(shape) != 5:
        raise ValueError(f"shape={shape}; expected (B, S, N, H, d).")
    shape = tuple(int(s) for s in shape)
    target = current_target()
    if mosaic is None:
        default = _mosaic_plan(shape, dtype, has_mask, has_gate, implementation=None)
        mosaic = default.implementation == "mosaic"
    path = cache_dir() / CACHE_FILE
    key = cache_key(shape, dtype, has_mask, has_gate, mosaic)
    if use_cache and key in (cached := _read_cache(path)):
        return _config_from_json(cached[key])

    n_res = shape[2]
    interpret = not target.gpu
    runners = _kernel_runners(shape, dtype, has_mask, has_gate, interpret, seed, mosaic)
    defaults = dict(DEFAULT_CANDIDATES)
    if mosaic:
        defaults |= mosaic_candidates(shape, dtype, has_mask=has_mask, has_gate=has_gate)
    candidates = defaults | (candidates or {})
    if timer is None:
        timer = lambda name, tiles, run: _median_ms(run, iters, reps)
    clip = lambda t: t.clipped(n_res) if isinstance(t, KernelTiles) else t  # noqa: E731
    best, best_ms = {}, {}
    for name, run in runners.items():
        timings = {}
        for tiles in dict.fromkeys(clip(t) for t in candidates[name]):
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
    mosaic_best = {name: best.pop(name) for name in MOSAIC_KERNELS if name in best}
    if mosaic:
        best["mosaic_forward"] = mosaic_best.get("mosaic_forward")
        best["mosaic_backward"] = MosaicBackwardTiles(
            dkdv=mosaic_best["mosaic_dkdv"], dq=mosaic_best["mosaic_dq"],
            dbias=mosaic_best["mosaic_dbias"],
            ping_pong=_mosaic_plan(shape, dtype, has_mask, has_gate).ping_pong,
        )
    config = BlockConfig(**best)

    if use_cache:
        cached = _read_cache(path)
        cached[key] = _config_to_json(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent tuners never leave a torn file
    return config
